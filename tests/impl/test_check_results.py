"""``hiradix check --json / --junit``: what a CI reads of a run (issue 30)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from hiradix import cli
from hiradix.conformance.tally import Tally

SHORT = ["--examples", "4", "--steps", "5", "--database", "none", "--seed", "1"]


def outputs(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    json_path, junit_path = tmp_path / "results.json", tmp_path / "results.xml"
    return json_path, junit_path, ["--json", str(json_path), "--junit", str(junit_path)]


def test_a_clean_run_lists_every_campaign_it_ran(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    json_path, junit_path, flags = outputs(tmp_path)
    assert cli.main(["check", *SHORT, *flags]) == 0
    assert f"(results: {json_path}, {junit_path})" in capsys.readouterr().out
    run = json.loads(json_path.read_text())
    assert run["exit_status"] == 0 and run["passed"] and run["failed_campaigns"] == []
    names = [c["name"] for c in run["campaigns"]]
    assert names == ["two-tier", "ranks", "hybrid (FULL, SWA)", "hybrid (FULL, MAMBA)"]
    for campaign in run["campaigns"]:
        assert campaign["examples"] > 0 and campaign["steps"] > 0, campaign
        assert campaign["failure"] is None
    assert run["campaigns"][2]["reached"].keys() >= {"healed", "evict_swa"}
    suites = ET.parse(junit_path).getroot()
    assert (suites.get("tests"), suites.get("failures")) == ("4", "0")
    assert [s.get("name") for s in suites.iter("testsuite")] == names
    assert not list(suites.iter("failure"))


def test_a_failure_is_a_failed_case_with_its_reproducer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_machine(engine: str, scenario: object, tally: Tally, beyond: bool) -> type:
        class Failing(RuleBasedStateMachine):
            def __init__(self) -> None:
                super().__init__()
                tally.begin_example()

            @rule(amount=st.integers(1, 3))
            def add(self, amount: int) -> None:
                tally.checks += 1
                assert amount < 2, f"planted: {amount}"
        return Failing

    monkeypatch.setattr(cli, "machine_for", failing_machine)
    json_path, junit_path, flags = outputs(tmp_path)
    assert cli.main(["check", *SHORT, *flags]) == 1
    run = json.loads(json_path.read_text())
    assert run["exit_status"] == 1 and not run["passed"]
    assert run["failed_campaigns"] == ["two-tier"]
    failed = run["campaigns"][0]
    assert "AssertionError: planted: 2" in failed["failure"]
    assert "state.add(amount=2)" in failed["reproducer"]
    suites = ET.parse(junit_path).getroot()
    assert suites.get("failures") == "1"
    failure = next(suites.iter("failure"))
    assert "planted" in (failure.get("message") or "") + (failure.text or "")
    assert "Reproducer:" in (failure.text or "")


def test_a_component_engine_run_is_one_campaign(tmp_path: Path) -> None:
    json_path, _, flags = outputs(tmp_path)
    assert cli.main(["check", "--engine", "ours-mamba", *SHORT, *flags]) == 0
    run = json.loads(json_path.read_text())
    [campaign] = run["campaigns"]
    assert (campaign["name"], campaign["engine"]) == ("hybrid (FULL, MAMBA)", "ours-mamba")
    assert campaign["examples"] >= 4 and campaign["reached"].keys() >= {"forks"}


@pytest.mark.parametrize("flag", ["--json", "--junit"])
def test_an_unwritable_results_file_is_one_line_and_exit_2(
        flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no such folder" / "results"
    assert cli.main(["check", *SHORT, flag, str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err, err
    assert not missing.parent.exists()
