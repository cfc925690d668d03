"""What ``hiradix check`` found, for a CI to read: ``--json FILE`` and ``--junit FILE``.

A run is one or more campaigns (the two-tier machine, the rank campaign, the component
campaigns, or one engine's). Each records what it ran and reached, and its failure with
the reproducer where one was printed. The JSON holds everything; the JUnit XML gives each
campaign a test suite with one test case, failed when the campaign failed, so that a CI's
test report shows it beside the project's own tests.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class CampaignResult:
    """One campaign of a run."""

    name: str  # two-tier, ranks, hybrid (FULL, SWA), hybrid (FULL, MAMBA)
    engine: str
    version: str
    seconds: float
    examples: int
    steps: int  # checked steps: every invariant and the refinement ran after each
    configurations: int
    reached: dict[str, int] = field(default_factory=dict)
    unreached: list[str] = field(default_factory=list)
    failure: str | None = None  # what broke, as printed
    reproducer: str | None = None  # the printed reproducer script, where there is one
    # Driven beyond the engine's server guards (--beyond-server): a failure may not be
    # reachable through the server.
    beyond_server: bool = False


@dataclass
class CheckResults:
    """Every campaign of one ``hiradix check`` run and how it ended."""

    argv: list[str]
    campaigns: list[CampaignResult] = field(default_factory=list)
    exit_status: int | None = None

    def add(self, result: CampaignResult) -> None:
        self.campaigns.append(result)

    def as_json(self) -> dict[str, object]:
        failed = [c.name for c in self.campaigns if c.failure is not None]
        return {"command": ["hiradix", *self.argv], "exit_status": self.exit_status,
                "passed": self.exit_status == 0, "failed_campaigns": failed,
                "campaigns": [asdict(c) for c in self.campaigns]}

    def as_junit(self) -> ET.Element:
        suites = ET.Element("testsuites", name="hiradix check",
                            tests=str(len(self.campaigns)),
                            failures=str(sum(c.failure is not None for c in self.campaigns)),
                            time=f"{sum(c.seconds for c in self.campaigns):.3f}")
        for campaign in self.campaigns:
            suite = ET.SubElement(suites, "testsuite", name=campaign.name, tests="1",
                                  failures=str(int(campaign.failure is not None)),
                                  time=f"{campaign.seconds:.3f}")
            _properties(suite, {"engine": campaign.engine, "version": campaign.version,
                                "examples": campaign.examples, "steps": campaign.steps,
                                "configurations": campaign.configurations,
                                "server": ("beyond server" if campaign.beyond_server
                                           else "server guards respected"),
                                **{f"reached.{k}": v for k, v in campaign.reached.items()}})
            case = ET.SubElement(suite, "testcase", classname=f"hiradix.check.{campaign.engine}",
                                 name=campaign.name, time=f"{campaign.seconds:.3f}")
            if campaign.failure is not None:
                failure = ET.SubElement(case, "failure",
                                        message=campaign.failure.splitlines()[0][:500])
                failure.text = campaign.failure + (
                    f"\n\nReproducer:\n{campaign.reproducer}" if campaign.reproducer else "")
            if campaign.unreached:
                out = ET.SubElement(case, "system-out")
                out.text = "not reached: " + ", ".join(campaign.unreached)
        return suites


def _properties(suite: ET.Element, values: Mapping[str, object]) -> None:
    properties = ET.SubElement(suite, "properties")
    for name, value in values.items():
        ET.SubElement(properties, "property", name=name, value=str(value))


def write_results(results: CheckResults, json_path: str | None, junit_path: str | None,
                  ) -> list[str]:
    """Write the files asked for; the paths written."""
    written: list[str] = []
    if json_path is not None:
        Path(json_path).write_text(json.dumps(results.as_json(), indent=2) + "\n")
        written.append(json_path)
    if junit_path is not None:
        tree = ET.ElementTree(results.as_junit())
        ET.indent(tree)
        tree.write(junit_path, encoding="utf-8", xml_declaration=True)
        written.append(junit_path)
    return written


def counts(reached: Mapping[str, int], names: Sequence[str]) -> dict[str, int]:
    """``reached`` restricted to ``names``, zeros included."""
    return {name: int(reached.get(name, 0)) for name in names}
