"""The transfer benchmark runs on CPU (its CUDA figures come from a GPU run), checks the
bytes it copied, and fails when the engine does not copy them."""

from __future__ import annotations

import pytest
import torch

from hiradix.conformance import bench_transfer
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
