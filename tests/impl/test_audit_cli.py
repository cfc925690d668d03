"""Issue #34, the CLI rows of the audit, kept as tests: every usage error is exit 2 with
one line on stderr naming the argument, before any work (no example run, no file
written); budgets bound the run whatever the configuration; ``replay`` reads regular
files only, line by bounded line; ``--record`` writes traces that ``replay`` accepts,
storage steps included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from hiradix import cli
from hiradix.conformance import show
from hiradix.conformance.tally import Tally
from hiradix_model import trace


def _no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any campaign, rank run, demo or bench that starts fails the test."""
    def forbidden(*args: object, **kwargs: object) -> int:
        raise AssertionError("work began before the usage error")
    monkeypatch.setattr(cli, "run", forbidden)
    monkeypatch.setattr(cli, "bench_main", forbidden)
    monkeypatch.setattr(show, "demo", forbidden)
    monkeypatch.setattr(show, "replay_on_impl", forbidden)


def _one_line(err: str, prefix: str, argument: str) -> None:
    assert err.count("\n") == 1 and err.startswith(prefix), err
    assert argument in err, err


BUDGETS = [["--seconds", "nan"], ["--seconds", "inf"], ["--seconds=-inf"],
           ["--seconds", "0"], ["--seconds", "-1"]]


@pytest.mark.parametrize("argv", BUDGETS, ids=[" ".join(a) for a in BUDGETS])
def test_a_budget_that_would_never_end_or_never_start_is_a_usage_error(
        argv: list[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _no_work(monkeypatch)
    assert cli.main(["check", *argv]) == 2
    out, err = capsys.readouterr()
    _one_line(err, "hiradix check: --seconds: must be", "--seconds")
    assert out == ""


ARGPARSE = [["--seconds"], ["--seconds", "soon"], ["--steps", "1.5"]]


@pytest.mark.parametrize("argv", ARGPARSE, ids=[" ".join(a) for a in ARGPARSE])
def test_a_value_argparse_refuses_is_one_line_too(
        argv: list[str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Not argparse's usage block: one line naming the argument, exit 2."""
    _no_work(monkeypatch)
    assert cli.main(["check", *argv]) == 2
    _one_line(capsys.readouterr().err, f"hiradix check: argument {argv[0]}", argv[0])


def test_an_unknown_engine_is_one_line_listing_the_known(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _no_work(monkeypatch)
    assert cli.main(["check", "--engine", "mine"]) == 2
    err = capsys.readouterr().err
    _one_line(err, "hiradix check: --engine: unknown engine 'mine'", "--engine")
    assert "controlled" in err and "sglang-unified" in err and "module:attribute" in err


def test_show_refuses_a_missing_value_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _no_work(monkeypatch)
    assert cli.main(["show", "--svg"]) == 2
    _one_line(capsys.readouterr().err, "hiradix show: argument --svg", "--svg")


@pytest.mark.parametrize("scale", ["nan", "inf", "0"])
def test_bench_scale_is_a_finite_positive_budget(
        scale: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _no_work(monkeypatch)
    assert cli.main(["bench", "--scale", scale]) == 2
    _one_line(capsys.readouterr().err, "hiradix bench: --scale: must be", "--scale")


def test_a_page_size_past_the_pools_is_a_usage_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _no_work(monkeypatch)
    assert cli.main(["check", "--page-sizes", str(10 ** 9)]) == 2
    _one_line(capsys.readouterr().err, "hiradix check: --page-sizes: at most", "--page-sizes")


def test_page_size_1024_keeps_its_two_second_budget(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The audit's row: it ran 54 s (163 s here) for --seconds 2, one example of slow
    steps outlasting the budget that was only checked as examples began."""
    started = time.monotonic()
    assert cli.main(["check", "--page-sizes", "1024", "--seconds", "2", "--seed", "0",
                     "--database", "none"]) == 0
    elapsed = time.monotonic() - started
    out = capsys.readouterr().out
    assert "0 failures" in out and "page sizes: 1024" in out, out
    # The deadline, then at most the rule step under way and one rank run.
    assert elapsed < 2 + 15, f"the run took {elapsed:.1f} s for --seconds 2"


def test_the_budget_is_checked_between_the_steps_of_an_example(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """An example of 100 000 steps of 20 ms each would take half an hour: the deadline
    stops it between steps."""
    def endless(engine: str, scenario: object, tally: Tally, beyond: bool) -> type:
        class Endless(RuleBasedStateMachine):
            def __init__(self) -> None:
                super().__init__()
                tally.begin_example()

            @rule(amount=st.integers(0, 3))
            def step(self, amount: int) -> None:
                time.sleep(0.02)
                tally.checks += 1
                tally.exercised["INV-DEVICE-POOL-CONSERVATION"] += amount + 1
        return Endless

    monkeypatch.setattr(cli, "machine_for", endless)
    started = time.monotonic()
    assert cli.main(["check", "--seconds", "2", "--steps", "100000", "--batch", "1",
                     "--database", "none"]) == 0
    elapsed = time.monotonic() - started
    assert "0 failures" in capsys.readouterr().out
    assert elapsed < 2 + 10, f"the run took {elapsed:.1f} s for --seconds 2"


def test_a_budget_too_small_to_check_one_step_is_exit_2_not_a_clean_run(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def no_ranks(*args: object, **kwargs: object) -> object:
        raise AssertionError("a rank campaign ran after nothing was checked")
    monkeypatch.setattr(cli, "run_rank_campaign", no_ranks)
    assert cli.main(["check", "--seconds", "1e-9", "--database", "none"]) == 2
    out, err = capsys.readouterr()
    _one_line(err, "hiradix check: --seconds 1e-09: the budget ran out", "nothing was checked")
    assert "0 failures" not in out, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA usage error")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_cuda_device_without_cuda_is_a_usage_error_not_a_failure(
        device: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _no_work(monkeypatch)
    assert cli.main(["check", "--device", device, "--seconds", "1"]) == 2
    out, err = capsys.readouterr()
    _one_line(err, f"hiradix check: --device {device}: this machine has no CUDA", "--device")
    assert "FAILED" not in out


@pytest.mark.parametrize("device", ["tpu", "not a device", "meta"])
def test_a_device_that_is_not_cpu_or_cuda_is_a_usage_error(
        device: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _no_work(monkeypatch)
    assert cli.main(["check", "--device", device]) == 2
    _one_line(capsys.readouterr().err, f"hiradix check: --device {device}: ", "--device")


def _unwritable(tmp_path: Path) -> dict[str, Callable[[], str]]:
    """Ways a path cannot be written (root writes anywhere permissions allow nothing,
    so none of them depends on file modes)."""
    afile = tmp_path / "a-file"
    afile.write_text("x")
    fifo = tmp_path / "a-fifo"
    os.mkfifo(fifo)
    return {"parent is a file": lambda: str(afile / "out"),
            "parent missing": lambda: str(tmp_path / "missing" / "out"),
            "a directory": lambda: str(tmp_path),
            "a fifo": lambda: str(fifo)}


OUTPUTS = [("check", "--record"), ("check", "--reproducer"), ("check", "--trace"),
           ("show", "--svg"), ("bench", "--plot")]
KINDS = ["parent is a file", "parent missing", "a directory", "a fifo"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("command", "option"), OUTPUTS, ids=[" ".join(o) for o in OUTPUTS])
def test_an_unwritable_output_is_a_usage_error_before_any_work(
        command: str, option: str, kind: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _no_work(monkeypatch)
    path = _unwritable(tmp_path)[kind]()
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert cli.main([command, option, path]) == 2
    _one_line(capsys.readouterr().err, f"hiradix {command}: {option} {path}: ", option)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written


@pytest.mark.parametrize("option", ["--report", "--database"])
@pytest.mark.parametrize("kind", ["parent is a file", "a fifo"])
def test_an_unwritable_output_directory_is_a_usage_error(
        kind: str, option: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _no_work(monkeypatch)
    path = _unwritable(tmp_path)[kind]()
    assert cli.main(["check", option, path]) == 2
    _one_line(capsys.readouterr().err, f"hiradix check: {option} {path}: ", option)


def test_replay_of_a_fifo_is_refused_at_once(tmp_path: Path) -> None:
    """It blocked forever waiting for a writer. In a child process with a timeout, so
    that a regression fails here instead of hanging the suite."""
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    try:
        done = subprocess.run([sys.executable, "-m", "hiradix", "replay", str(fifo)],
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("hiradix replay of a FIFO did not return within 120 s")
    assert done.returncode == 2, done
    assert done.stderr == f"{fifo}:0: not a regular file (a FIFO)\n", done.stderr


def test_replay_of_a_device_is_refused_before_reading(
        capsys: pytest.CaptureFixture[str]) -> None:
    """/dev/zero ended in MemoryError: a line without end read whole."""
    assert cli.main(["replay", "/dev/zero"]) == 2
    assert capsys.readouterr().err == "/dev/zero:0: not a regular file (a device)\n"


def test_replay_of_a_directory_is_file_line_reason(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["replay", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{tmp_path}:0: ") and err.count("\n") == 1, err


def test_replay_reads_no_line_past_its_bound(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A line longer than trace.MAX_LINE_CHARS (no newline in 16 Mi characters) is
    FILE:LINE: reason, exit 2, without the rest of the file being read."""
    path = tmp_path / "long.jsonl"
    header = json.dumps({"format": trace.FORMAT, "engine": "x",
                         "config": {"page_size": 1, "device_slots": 4, "host_slots": 4}})
    path.write_text(header + "\n" + "x" * (trace.MAX_LINE_CHARS + 1))
    assert cli.main(["replay", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"{path}:2: line longer than {trace.MAX_LINE_CHARS} characters\n")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_record_writes_a_storage_run_that_replay_accepts(
        seed: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """7 of 12 recorded traces were rejected: the storage steps were left out. A clean
    storage run's trace holds them (from the attachment on) and replays."""
    path = tmp_path / "run.jsonl"
    assert cli.main(["check", "--storage", "memory,file", "--examples", "4", "--steps", "25",
                     "--batch", "4", "--seed", str(seed), "--database", "none",
                     "--record", str(path)]) == 0
    capsys.readouterr()
    ops = [json.loads(line)["op"] for line in path.read_text().splitlines()[1:]]
    assert ops[0] == "attach_storage", ops[:3]
    assert cli.main(["replay", str(path)]) == 0, capsys.readouterr()
    assert "all accepted by the model" in capsys.readouterr().out


def test_a_failure_the_budget_cuts_off_before_its_replay_is_still_a_failure(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The replay of a failure cut short is bounded too: when it does not fail again in
    its time (here the failure happens once only), the run is exit 1, never a clean run.
    Before, the replay ran without a deadline, and a failure it did not meet again
    was reported as a clean run."""
    failed: list[bool] = []

    def once(engine: str, scenario: object, tally: Tally, beyond: bool) -> type:
        class Once(RuleBasedStateMachine):
            def __init__(self) -> None:
                super().__init__()
                tally.begin_example()
                self.steps = 0

            @rule(amount=st.integers(0, 3))
            def step(self, amount: int) -> None:
                time.sleep(0.1)
                tally.checks += 1
                self.steps += 1
                # Late enough in the budget that its shrinking is cut short.
                if time.monotonic() - started > 1.2 and not failed:
                    failed.append(True)
                    raise AssertionError("one step fails, no other")
        return Once

    monkeypatch.setattr(cli, "machine_for", once)
    monkeypatch.setattr(cli, "REPLAY_MIN_SECONDS", 0.5)
    started = time.monotonic()
    assert cli.main(["check", "--seconds", "2", "--steps", "60", "--batch", "50",
                     "--database", "none"]) == 1
    out = capsys.readouterr().out
    assert failed and "FAILED on" in out and "ran out before the failure could be" in out, out
