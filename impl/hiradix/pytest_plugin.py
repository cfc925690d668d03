"""``hiradix check`` as pytest items, for a project that tests its own cache (spec/16).

Registered as the ``hiradix`` plugin (``[project.entry-points.pytest11]``), so that
installing hiradix makes the options available; without them the plugin adds nothing::

    pytest --hiradix-engine toycache --hiradix-seconds 30

adds one item per engine, ``hiradix-check[NAME]``, which runs the campaign of
``hiradix check --engine NAME --seconds N`` in process (spec/06's refinement and spec/05's
invariants after every step). It passes where the campaign finds nothing; it fails with
the shrunk reproducer where the campaign finds a failure (exit 1), and with the usage
error's one line where the engine cannot run at all (exit 2: a missing engine is a
failure here, never a skip -- an engine named on the command line is meant to be checked).
"""

from __future__ import annotations

import io
import json
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

DEFAULT_SECONDS = 30.0


class CheckFailed(Exception):
    """A campaign that found a failure or could not run; the message is the report."""


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--hiradix-engine NAME`` (repeatable) and ``--hiradix-seconds N``."""
    group = parser.getgroup("hiradix", "hiradix check campaigns as test items")
    group.addoption("--hiradix-engine", action="append", default=[], metavar="NAME",
                    help="run `hiradix check --engine NAME` as the item hiradix-check[NAME] "
                         "(repeatable; any name `hiradix check --engine` takes)")
    group.addoption("--hiradix-seconds", type=float, default=DEFAULT_SECONDS, metavar="N",
                    help=f"the budget of each campaign (default {DEFAULT_SECONDS:g})")
    group.addoption("--hiradix-examples", type=int, default=None, metavar="N",
                    help="a budget of examples instead, with --hiradix-seed: the same "
                         "examples however loaded the machine is")
    group.addoption("--hiradix-seed", type=int, default=None, metavar="S",
                    help="the campaign's seed (hiradix check --seed)")


class CheckItem(pytest.Item):
    """One engine's campaign (``hiradix check --engine NAME --seconds N``)."""

    def __init__(self, *, engine: str, budget: list[str], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.engine, self.budget = engine, budget

    def runtest(self) -> None:
        # Imported here, not at load: every pytest run of a project with hiradix installed
        # loads the plugin, and the CLI brings Hypothesis and the whole checker with it.
        from hiradix.cli import main

        out, err = io.StringIO(), io.StringIO()
        with tempfile.TemporaryDirectory(prefix="hiradix-check-") as folder:
            results = Path(folder) / "results.json"
            with redirect_stdout(out), redirect_stderr(err):
                status = main(["check", "--engine", self.engine, *self.budget,
                               "--json", str(results)])
            found = json.loads(results.read_text()) if results.exists() else None
        if status == 0:  # what the campaign ran (shown with -rA); a failure shows its own
            self.add_report_section("call", "hiradix check", out.getvalue())
        if status == 2:  # a usage error: one line on stderr, nothing ran
            lines = err.getvalue().strip().splitlines()
            raise CheckFailed(lines[-1] if lines else f"hiradix check exited 2 for {self.engine}")
        if status != 0:
            raise CheckFailed(_finding(found, out.getvalue()))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: object = None) -> str:
        if isinstance(excinfo.value, CheckFailed):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, self.name


def _finding(found: object, printed: str) -> str:
    """A failed campaign's report: its failure and reproducer from the results, else
    what the run printed last (a failure whose time ran out, a coverage requirement)."""
    if isinstance(found, dict):
        reports = [f"{c['failure']}\n\nReproducer:\n{c['reproducer']}" if c["reproducer"]
                   else c["failure"] for c in found["campaigns"] if c["failure"] is not None]
        if reports:
            return "\n\n".join(reports)
    return "\n".join(printed.strip().splitlines()[-5:])


@pytest.hookimpl(tryfirst=True)  # before -k / -m select among the items
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    """One item per ``--hiradix-engine``; nothing without the option."""
    examples, seed = config.getoption("hiradix_examples"), config.getoption("hiradix_seed")
    budget = (["--seconds", f"{float(config.getoption('hiradix_seconds')):g}"]
              if examples is None else ["--examples", str(examples)])
    budget += [] if seed is None else ["--seed", str(seed)]
    for engine in config.getoption("hiradix_engine"):
        name = f"hiradix-check[{engine}]"
        items.append(CheckItem.from_parent(session, name=name, nodeid=name, engine=engine,
                                           budget=budget))
