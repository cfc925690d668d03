"""Server mode and ``--beyond-server`` (issue 30): campaigns respect the guards an
adapter declares -- situations the engine's own server never creates -- unless asked to
go beyond them, and a failure found beyond them says so."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from hiradix import cli
from hiradix.conformance.scenario import Scenario
from hiradix.engines import BUILT_IN, CacheEngine
from hiradix.engines.ours.cache import OursAdapter
from hiradix_model import initial

GUARD = "reset_with_copies_in_flight"


class ResetDropsCopiesBadly(OursAdapter):
    """Ours, with a bug planted where only a reset during copies reaches it, and a
    guard saying its (imagined) server resets only when idle."""

    name = "ours-guarded"
    guards: Mapping[str, str] = {GUARD: "server.py:1: resets only when idle (planted)"}

    def reset(self) -> None:
        if self.observe(initial(self.config)).pending:
            raise AssertionError("planted: a reset with copies in flight")
        super().reset()


def guarded(scenario: Scenario) -> Callable[[], ResetDropsCopiesBadly]:
    return lambda: ResetDropsCopiesBadly(scenario)


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> str:
    ours = BUILT_IN["ours"]
    assert isinstance(ours, CacheEngine)
    monkeypatch.setitem(BUILT_IN, "ours-guarded", CacheEngine(
        "ours-guarded", "hiradix", ours.probe, guarded, ours.scenario_space))
    return "ours-guarded"


ARGS = ["--policies", "write_through", "--strategies", "lru", "--page-sizes", "1",
        "--seed", "3", "--database", "none", "--steps", "10"]


def test_server_mode_respects_the_guards(engine: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results.json"
    assert cli.main(["check", "--engine", engine, *ARGS, "--examples", "60",
                     "--json", str(results)]) == 0
    campaign = json.loads(results.read_text())["campaigns"][0]
    assert campaign["steps"] > 0 and campaign["beyond_server"] is False


def test_beyond_server_drives_the_guarded_calls_and_says_so(
        engine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results.json"
    # About one reset in five meets a copy in flight: the first few dozen examples reach one.
    status = cli.main(["check", "--engine", engine, "--beyond-server", *ARGS,
                       "--examples", "300", "--json", str(results)])
    out = capsys.readouterr().out
    assert status == 1 and "planted: a reset with copies in flight" in out
    assert "--beyond-server" in out and "may not be reachable through its server" in out
    campaign = json.loads(results.read_text())["campaigns"][0]
    assert campaign["beyond_server"] is True and campaign["failure"]


@pytest.mark.parametrize("engine_name", ["controlled", "ours-swa", "vllm"])
def test_beyond_server_where_nothing_is_guarded_is_a_usage_error(
        engine_name: str, capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(["check", "--engine", engine_name, "--beyond-server", "--seconds", "1"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    assert "--beyond-server" in err or "not installed" in err
