"""``hiradix check`` usage errors: one line on stderr, exit 2, before any example runs --
never a conformance FAILED with a reproducer (issue #6, "failing loudly")."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from pathlib import Path

import pytest
import torch
from hypothesis import settings

from hiradix import cli
from hiradix.engines import BUILT_IN, EngineUnavailable, probe

BAD = [
    (["--examples", "0"], "--examples: must be positive"),
    (["--seconds", "-1"], "--seconds: must be positive"),
    (["--page-sizes", "0"], "--page-sizes: must be positive"),
    (["--steps", "0"], "--steps: must be positive"),
    (["--policies", "write_sometimes"], "--policies: unknown write_sometimes"),
    (["--strategies", "random"], "--strategies: unknown random"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_command_line_is_one_line_and_exit_2(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"hiradix check: {message}"), err
    assert err.count("\n") == 1 and "FAILED" not in out + err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA usage error")
def test_the_cuda_engine_without_cuda_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check", "--engine", "cuda", "--seconds", "1"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


MISSING = [(engine, package) for engine, package in [
    ("sglang", "sglang"), ("sglang-radix", "sglang"), ("sglang-unified", "sglang"),
    ("sglang-unified-rust", "sglang"), ("vllm", "vllm"), ("vllm-offload", "vllm")]
    if importlib.util.find_spec(package) is None]


@pytest.mark.skipif(not MISSING, reason="every engine is installed in this environment")
@pytest.mark.parametrize(("engine", "package"), MISSING)
def test_a_missing_engine_is_a_usage_error_naming_its_setup(
        engine: str, package: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(EngineUnavailable, match=f"{package} is not installed.*make "):
        probe(engine)
    assert cli.main(["check", "--engine", engine, "--seconds", "1"]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and "make " in err and "FAILED" not in out + err


def test_every_engine_is_registered_with_a_probe() -> None:
    assert set(BUILT_IN) >= {"ours", "sglang", "sglang-radix", "sglang-unified",
                            "sglang-unified-rust", "vllm", "vllm-offload"}
    assert probe("ours") == "hiradix"


def test_an_engine_whose_api_changed_is_a_usage_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def renamed(scenario: object) -> object:
        def build() -> object:
            raise AttributeError("module 'sglang.srt.mem_cache' has no attribute 'HiRadixCache'")
        return build
    monkeypatch.setitem(BUILT_IN, "ours", dataclasses.replace(BUILT_IN["ours"], factory=renamed))
    assert cli.main(["check", "--engine", "ours", "--seconds", "1"]) == 2
    out, err = capsys.readouterr()
    assert "does not match its adapter's API" in err and "HiRadixCache" in err
    assert "FAILED" not in out


def test_traces_name_the_engine_with_its_installed_version() -> None:
    assert cli.engine_label("ours", "hiradix") == "hiradix"
    assert cli.engine_label("sglang-unified", "0.5.23") == "sglang-unified 0.5.23"


GOOD_HEADER = ('{"format": "hiradix-trace/1", "engine": "hiradix", "config": {"page_size": 1, '
               '"device_slots": 4, "host_slots": 4}}')
BROKEN_TRACES = [
    ("empty", b"", 0, "empty trace"),
    ("blank lines only", b"\n\n", 0, "empty trace"),
    ("binary", b"\x00\xff\xfe\x80garbage", 0, "not a text file"),
    ("truncated header", GOOD_HEADER[:40].encode(), 1, "not JSON"),
    ("header not an object", b"[1, 2]\n", 1, "must be a JSON object"),
    ("wrong format", b'{"format": "other/2", "config": {}}\n', 1, "not a hiradix-trace/1"),
    ("no config", b'{"format": "hiradix-trace/1"}\n', 1, "no config object"),
    ("bad config", b'{"format": "hiradix-trace/1", "config": {"page_size": 0, '
                   b'"device_slots": 4, "host_slots": 4}}\n', 1, "invalid config"),
    ("unknown config field", b'{"format": "hiradix-trace/1", "config": {"pages": 1}}\n', 1,
     "invalid config"),
    ("truncated step", (GOOD_HEADER + '\n{"op": "evict", "args": {"num_tok').encode(), 2,
     "not JSON"),
    ("step not an object", (GOOD_HEADER + "\n42\n").encode(), 2, "must be a JSON object"),
    ("step without op", (GOOD_HEADER + '\n{"args": {}}\n').encode(), 2, "needs an \"op\""),
    ("args not an object", (GOOD_HEADER + '\n{"op": "evict", "args": [3]}\n').encode(), 2,
     "\"args\" must be an object"),
    ("unknown operation", (GOOD_HEADER + '\n{"op": "defrag", "args": {}}\n').encode(), 2,
     "unknown operation 'defrag'"),
    ("unknown argument", (GOOD_HEADER + '\n{"op": "evict", "args": {"tokens": 3}}\n').encode(),
     2, "malformed arguments"),
]


@pytest.mark.parametrize(("content", "line", "reason"), [b[1:] for b in BROKEN_TRACES],
                         ids=[b[0] for b in BROKEN_TRACES])
def test_replay_of_a_broken_file_is_file_line_reason_and_exit_2(
        tmp_path: Path, content: bytes, line: int, reason: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(content)
    assert cli.main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:{line}: ") and reason in err, err
    assert err.count("\n") == 1


def test_replay_of_a_missing_file_is_exit_2(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["replay", str(tmp_path / "absent.jsonl")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_replay_of_a_valid_trace_still_replays(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(GOOD_HEADER + '\n{"op": "evict", "args": {"num_tokens": 3, "victims": []}}\n')
    assert cli.main(["replay", str(path)]) == 0


def _campaign(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert cli.main(["check", "--examples", "12", "--steps", "20", "--database", "none",
                     *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    # Everything but the wall time: counts, configurations, operations, invariants.
    return [lines[0].split(" in ")[0], *lines[1:]]


def test_a_seeded_campaign_replays_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    first = _campaign(["--seed", "3"], capsys)
    assert first == _campaign(["--seed", "3"], capsys)
    assert first != _campaign(["--seed", "4"], capsys)


def test_seconds_bounds_the_run_shrinking_included(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """#15: a failure whose shrinking would outlast --seconds is reported, shrunk only as
    far as the time allowed, soon after the deadline."""
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, rule

    from hiradix.conformance.tally import Tally

    def slow_machine(engine: str, scenario: object, tally: Tally, beyond: bool) -> type:
        class Slow(RuleBasedStateMachine):
            def __init__(self) -> None:
                super().__init__()
                tally.begin_example()
                self.total = 0

            # From 50: the first example fails (at its 14th step), before the deadline,
            # which cuts examples between steps: it is the shrinking that runs out.
            @rule(amount=st.integers(50, 100))
            def add(self, amount: int) -> None:
                time.sleep(0.1)  # each example ~1.4 s: shrinking takes minutes
                tally.checks += 1
                self.total += amount
                assert self.total < 700, self.total
        return Slow

    monkeypatch.setattr(cli, "machine_for", slow_machine)
    started = time.monotonic()
    assert cli.main(["check", "--seconds", "3", "--database", "none", "--batch", "50",
                     "--steps", "60"]) == 1
    elapsed = time.monotonic() - started
    out = capsys.readouterr().out
    assert "FAILED" in out and "AssertionError" in out and "state.add(" in out, out
    assert "ran out in this batch" in out, out
    # The deadline, then one replay of the failure without shrinking (a few examples of
    # about a second here); unbounded, shrinking this machine takes minutes.
    assert elapsed < 3 + 10, f"the run took {elapsed:.1f} s for --seconds 3"


def test_a_derandomizing_profile_does_not_reach_the_campaign(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Hypothesis derandomizes under a CI environment variable; campaigns must not inherit
    it (under CI=true every batch once replayed the same examples: evictions only)."""
    settings.register_profile("hiradix-derandomized", derandomize=True)
    settings.load_profile("hiradix-derandomized")
    try:
        assert cli.main(["check", "--engine", "ours", "--examples", "12",
                         "--database", "none"]) == 0
    finally:
        settings.load_profile(os.environ.get("HIRADIX_PROFILE", "dev"))
    operations = next(line for line in capsys.readouterr().out.splitlines()
                      if line.startswith("operations: "))
    assert "insert=" in operations and "match_prefix=" in operations, operations


def test_a_reproducer_replays_a_fault_injection_step(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Rules take plain values (no ``st.data()``, which prints as ``data(...)``): a
    reproducer with an injected fault runs as written, and the fault is queued."""
    from hiradix.conformance.scenario import Scenario
    scenario = Scenario(page_size=2, storage="memory")  # type: ignore[arg-type]
    steps = ["state.inject(at_page=1, go=0, kind=1, operation='get')",
             "state.refines_the_model()"]
    namespace: dict[str, object] = {}
    exec(compile(cli.reproducer(scenario, steps, "controlled"), "reproducer", "exec"),
         namespace)
    assert namespace["state"].backend.queued_faults("get") == 1  # type: ignore[attr-defined]
    assert capsys.readouterr().out.strip().endswith("no failure reproduced")


def test_the_main_job_runs_ranks_and_fails_on_ranks_that_decide_alone(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """spec/12 12.7: the controlled campaign runs ranks in lockstep and reports them; with
    every rank deciding alone (no consensus), it fails naming the rank invariant and prints
    a replayable run."""
    from hiradix.conformance import rank_campaign
    from hiradix.conformance.ranks import RankRun, Skew
    from hiradix.distributed import LocalRanks, LocalSync

    healthy = _campaign(["--seed", "1"], capsys)
    assert any(line.startswith("ranks: 1 lockstep runs") and "INV-RANKS-CONSENSUS" in line
               for line in healthy), healthy
    run = RankRun(2, Skew(fuller_pool=1, slow_copies=0, storage_misses=1, slow_io=0),
                  seed=7, steps=200)
    monkeypatch.setattr(rank_campaign, "draw_rank_run", lambda rng: run)
    monkeypatch.setattr(LocalRanks, "sync", lambda self, rank: LocalSync())
    assert cli.main(["check", "--examples", "2", "--steps", "5", "--database", "none"]) == 1
    out = capsys.readouterr().out
    assert f"FAILED on rank run {run!r}" in out and "rank 0: RankFailure" in out, out
    assert "INV-RANKS-CONSENSUS" in out, out  # each rank kept its own proposal
    exec(compile(out.split("Reproducer:\n")[1], "reproducer", "exec"), {})
    assert "0 RankFailure" in capsys.readouterr().out  # the printed run replays the failure


def test_sglang_campaigns_keep_to_the_strategies_its_server_takes() -> None:
    """spec/04 4.4: SGLang's server takes lru, lfu, slru and priority; the other strategies
    its caches implement run only with --beyond-server, and the summary says so."""
    from hiradix_model.config import STRATEGIES

    narrowed = cli.server_values("sglang", {"eviction": STRATEGIES})
    assert set(narrowed) == {"eviction"}
    assert set(narrowed["eviction"]) == {"lru", "lfu", "slru", "priority"}
    # An adapter's own narrower space stays narrower (the Rust core has no slru).
    assert cli.server_values("sglang-unified-rust", {"eviction": ("lru", "fifo")}) == {
        "eviction": ("lru",)}
    assert cli.server_values("vllm", {}) == {}  # no server restriction declared
    asked = cli.argparse.Namespace(engine="sglang", strategies=list(STRATEGIES),
                                   beyond_server=False)
    assert cli.outside_server(asked) == ["fifo", "mru", "filo"]
    beyond = cli.argparse.Namespace(**{**vars(asked), "beyond_server": True})
    assert cli.outside_server(beyond) == []
