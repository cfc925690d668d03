"""``hiradix bench``'s parts that run without SGLang: options, the scaling tables on ours,
the bandwidth rows, the profile of ours, and the message when no SGLang is installed."""

from __future__ import annotations

import argparse

import pytest

from hiradix.bench import cache as bench
from hiradix.bench import profile as bench_profile
from hiradix.bench import scale as bench_scale
from hiradix.bench.key_forms import FORMS, key_forms


def test_options_fill_what_an_older_parser_lacks() -> None:
    args = bench.options(argparse.Namespace(page_sizes=[16], scale=1.0, seed=3))
    assert (args.page_sizes, args.scale, args.seed) == ([16], 1.0, 3)
    assert args.large is False and args.large_tokens == 1 << 20 and args.large_only is False
    assert args.torch_threads is None


def test_without_sglang_the_bench_says_what_to_install(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "competitors", lambda page_size: [])
    assert bench.main(argparse.Namespace()) == 2
    err = capsys.readouterr().err
    assert "make sglang-env" in err and "make sglang23-env" in err


def test_the_scaling_rows_time_every_operation_on_ours(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_scale, "competitors", lambda page_size: [])
    monkeypatch.setattr(bench_scale, "SUFFIX", 32)
    monkeypatch.setattr(bench_scale, "PROBES", 3)
    names, rows = bench_scale.scaling(16, 2048, 0, prefixes=(256,))
    assert names == ["ours"]
    checkpoints = bench_scale.checkpoints(2048)
    assert [r[2] for r in rows] == list(bench_scale.SCALED_OPS) * len(checkpoints)
    # Every probe ran: three calls of each operation at each checkpoint, load-backs
    # included (the evicted suffixes come back from host).
    assert all(r[3].endswith("(3)") for r in rows), rows
    cached = [int(r[1].replace(",", "")) for r in rows[::len(bench_scale.SCALED_OPS)]]
    assert all(c >= p for c, p in zip(cached, checkpoints, strict=True)), (cached, checkpoints)


def test_the_key_forms_rows_build_and_match_a_key_from_every_form() -> None:
    rows = key_forms(page_size=4, tokens=64, repeats=2)
    assert [r[0] for r in rows] == list(FORMS)
    assert all(r[3] == "64" and float(r[1]) > 0 and float(r[2]) > 0 for r in rows), rows


def test_the_bandwidth_rows_compare_each_copy_with_memcpy() -> None:
    rows = bench_scale.bandwidth(page_size=16, tokens=256, repeats=2)
    assert [r[0].split(" ")[0] for r in rows] == ["memcpy", "backup:", "load_back:"]
    assert rows[0][1] == "1.0"  # 256 tokens of 4 KiB per layer
    assert rows[0][4] == "1.00" and all(float(r[2]) > 0 for r in rows)


@pytest.mark.skipif(bench.bookkeeping_core() != "native", reason="hiradix._pagebits is "
                    "not built here: no C loops to compare with the torch ops")
def test_the_main_table_times_the_c_loops_against_the_torch_ops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "competitors", lambda page_size: [])
    rows: list[list[str]] = []
    memory: list[list[str]] = []
    floors: list[str] = []
    bench.run(16, 0.02, 0, rows, memory, floors)
    assert memory == []  # one row per SGLang engine, and none is installed
    # The timer's own cost, one figure per engine that served the stream.
    assert len(floors) == 1 and floors[0].startswith("P16 ours "), floors
    assert "ours-python-core " in floors[0], floors
    assert {r[2] for r in rows} == {"ours-python-core"}
    assert [r[1] for r in rows] == list(bench.OPS)
    # Every operation that ran (a run this small never overflows the device) was timed on
    # both cores: ours' mean, then the torch core's.
    ran = {r[1] for r in rows if r[3] != "n/a"}
    assert ran >= {"match_prefix", "insert", "checks", "insert+checks"}, rows
    assert ran == {r[1] for r in rows if r[5] != "n/a"}, rows


@pytest.mark.parametrize(("file", "name", "kind"), [
    ("/x/hiradix/cache.py", "_check_insert_slots", "validation"),
    ("/x/hiradix/cache.py", "_require_key", "validation"),
    ("/x/hiradix/cache.py", "match_prefix", "walk+split"),
    ("/x/hiradix/tree.py", "split", "walk+split"),
    ("/x/hiradix/cache.py", "_refresh", "bookkeeping"),
    ("/x/hiradix/policies.py", "pop", "evict heap"),
    ("~", "<built-in method _heapq.heappop>", "evict heap"),
    ("/x/hiradix/_slots.py", "release_parts", "allocators"),
    ("/x/hiradix/host_pool.py", "copy", "host copies"),
    ("~", "<built-in method hiradix._pagebits.release>", "C loops"),
    ("~", "<method 'clone' of 'torch._C.TensorBase' objects>", "torch"),
    ("/x/hiradix/cache.py", "insert", "body"),
])
def test_the_profile_sorts_each_cost_into_its_kind(file: str, name: str, kind: str) -> None:
    assert bench_profile.kind((file, name)) == kind


def test_the_profile_accounts_for_each_operation_and_its_kernels() -> None:
    result = {op: rest for op, *rest in bench_profile.breakdown(16, 0.02, 0)}
    assert {"key", "match", "insert", "checks"} <= set(result), result
    for op, (calls, shares, micros, *_) in result.items():
        assert calls > 0 and micros > 0, op
        assert abs(sum(shares.values()) - 1) < 1e-9, (op, shares)
    # Every insert clones its slots for the node (a kernel) and each backup copies rows
    # (a C call where built); a match clones the matched slots or returns an empty one.
    assert result["insert"][3] >= 1, result["insert"]
    assert 0 < result["match"][3] <= 1, result["match"]
    if bench.bookkeeping_core() == "native":
        assert result["insert"][4] >= 1, result["insert"]


def test_the_profile_runs_without_sglang(capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "competitors", lambda page_size: [])
    assert bench.main(argparse.Namespace(profile=True, page_sizes=[1], scale=0.02)) == 0
    out = capsys.readouterr().out
    assert out.startswith("Profile of ours, page size 1") and "\ninsert " in out, out
