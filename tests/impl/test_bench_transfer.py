"""The transfer benchmark runs on CPU (its CUDA figures come from a GPU run), checks the
bytes it copied, and fails when the engine does not copy them."""

from __future__ import annotations

import pytest
import torch

from hiradix.bench import transfer as bench_transfer
from hiradix.host_pool import HostKVPool


def test_every_direction_order_and_size_has_a_row() -> None:
    got = list(bench_transfer.rows(torch.device("cpu"), [0.0625, 0.125], repeats=1))
    assert [(r[0], r[1], r[3]) for r in got] == [
        (d, size, order) for size in ("0.0625", "0.125")
        for order in ("contiguous", "scattered") for d in ("d2h", "h2d")]
    assert all(float(r[4]) > 0 and float(r[5]) > 0 for r in got)


def test_a_copy_that_lands_nothing_fails_the_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    # CPU: the synchronous engine copies at submit; make it copy nothing to the host.
    monkeypatch.setattr(HostKVPool, "copy_from_device_unchecked",
                        lambda self, pool, device_slots, host_slots: None)
    with pytest.raises(AssertionError, match="d2h: the host pool does not hold"):
        list(bench_transfer.rows(torch.device("cpu"), [0.0625], repeats=1))


def test_cpu_run_says_which_path_ran_and_what_it_cannot_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_transfer.main(["--device", "cpu", "--layer-mib", "0.0625", "--repeats",
                                "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "bench_transfer: the per-layer load-back rows need a CUDA device; not run on " \
           "cpu" in out
    assert "path: SyncCopyEngine (copies at submit on the CPU)" in out
    # The CPU engine has one path: asking for the Triton one is one line and exit 2.
    assert bench_transfer.main(["--device", "cpu", "--layer-mib", "0.0625", "--copy-path",
                                "triton"]) == 2
    assert capsys.readouterr().err.startswith("bench_transfer: copy_path: only the cuda")


def test_load_back_rows_check_their_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The load-back table's rows (a GPU table) run here through the synchronous engine:
    one row per page size and size of at least a page, and a copy that lands nothing
    fails it."""
    got = list(bench_transfer.load_back_rows(torch.device("cpu"), 1, kind="sync",
                                             layer_kib=(64, 256), page_sizes=(1, 64)))
    assert [(r[1], r[2]) for r in got] == [("1", "64"), ("1", "256"), ("64", "256")]
    assert all(float(r[4]) > 0 and float(r[5]) > 0 for r in got)
    monkeypatch.setattr(HostKVPool, "copy_to_device_unchecked",
                        lambda self, *args, **kwargs: ())
    with pytest.raises(AssertionError, match="load-back: the device pool does not hold"):
        list(bench_transfer.load_back_rows(torch.device("cpu"), 1, kind="sync",
                                           layer_kib=(64,), page_sizes=(1,)))
