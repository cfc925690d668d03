"""Tensor- and pipeline-parallel ranks, really run (spec/12-ranks.md).

Ranks are skewed on purpose (a fuller pool, copies that finish later, a store that
misses) and the rank invariants are checked after every step: in one process (threads
in lockstep, ``LocalRanks``) and across processes (torch.multiprocessing, gloo on
127.0.0.1). Each run that must fail is shown to fail: without consensus, with a rank
that skips a collective on an empty queue, with a rank that hangs up.
"""

from __future__ import annotations

import json
import re
import socket
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch.multiprocessing
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from hiradix.conformance.abstraction import abstract
from hiradix.conformance.ranks import (
    RankReport,
    RankWorkload,
    Skew,
    SkipIdleAcks,
    rank_view,
    run_local,
    run_rank_process,
)
from hiradix.distributed import (
    CollectiveMismatch,
    Ledger,
    LocalRanks,
    LocalSync,
    RankSync,
)
from hiradix.policies import WritePolicy
from hiradix.storage.config import PrefetchPolicy
from hiradix_model import Config, initial
from hiradix_model.ranks import view

from stats import SUMMARY

SKEW_2 = Skew(fuller_pool=1, slow_copies=0, storage_misses=1, slow_io=0)
SKEW_4 = Skew(fuller_pool=3, slow_copies=1, storage_misses=2, slow_io=0,
              prefetch_policy="wait_complete", write_policy="write_back")
AGREE = frozenset({"INV-RANKS-AGREE"})

# Each decision of 12.3, with consensus removed for it alone, and a run (write policy,
# prefetch policy, seed) where that breaks agreement: every consensus is needed.
ABLATIONS = [
    ("alloc", "write_through", "best_effort", 0),
    ("load room", "write_through", "best_effort", 1),
    ("load alloc", "write_through", "best_effort", 0),
    ("host room", "write_through", "best_effort", 0),
    ("backup alloc", "write_through", "best_effort", 11),
    ("write-back alloc", "write_back", "best_effort", 13),
    ("ack d2h", "write_through", "best_effort", 0),
    ("ack h2d", "write_through", "best_effort", 0),
    ("storage hit", "write_through", "best_effort", 0),
    ("prefetch room", "write_through", "best_effort", 3),
    ("prefetch may end", "write_through", "wait_complete", 0),
    ("prefetch landed", "write_through", "best_effort", 0),
    ("prefetch kept", "write_through", "best_effort", 3),
    ("stored", "write_through", "best_effort", 0),
    ("write acked", "write_through", "best_effort", 0),
]


def _summarise(label: str, reports: Sequence[RankReport], skew: Skew) -> None:
    first = reports[0]
    SUMMARY.append(f"ranks {label}: {len(reports)} ranks x {first.steps} steps, "
                   f"{first.collectives} collectives ({first.decisions} values) per rank, "
                   f"{skew.kinds()} skews, proposals overruled per rank "
                   f"{[r.disagreements for r in reports]}")


def _agreeing(reports: Sequence[RankReport], steps: int) -> None:
    assert [r.failure for r in reports] == [None] * len(reports), reports
    assert {r.steps for r in reports} == {steps}
    assert len({r.collectives for r in reports}) == 1
    assert first_nonzero(reports), "the skews never made a rank propose another value"


def first_nonzero(reports: Sequence[RankReport]) -> bool:
    return any(r.disagreements for r in reports)


# ------------------------------------------------------------------ one process


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_the_rank_view_is_the_models_view_of_the_abstract_state(
        write_policy: WritePolicy) -> None:
    """``rank_view`` (read off the tree) equals the model's ``view`` of the refinement
    mapping's abstract state (spec/06), after every step of a single rank's run."""
    workload = RankWorkload(0, LocalSync(), Skew(write_policy=write_policy), seed=5)
    cache = workload.cache
    config = Config(page_size=cache.page_size, device_slots=cache.device_pool.num_slots,
                    host_slots=cache.host_pool.num_slots, write_policy=write_policy,
                    load_back_threshold=cache.config.load_back_threshold)
    for _ in range(120):
        workload.step()
        mine, models = rank_view(cache), view(abstract(cache, initial(config)))
        assert (mine.pages, mine.pending, mine.clock) == \
            (models.pages, models.pending, models.clock)


@pytest.mark.parametrize(("world", "skew"), [(2, SKEW_2), (4, SKEW_4)])
def test_local_ranks_agree_after_every_step(world: int, skew: Skew) -> None:
    reports = run_local(world, skew, seed=7, steps=200)
    _agreeing(reports, 200)
    _summarise(f"local {world}", reports, skew)


class WithoutConsensusOn:
    """``inner``, except that decision ``name`` is taken by each rank alone."""

    def __init__(self, inner: RankSync, name: str) -> None:
        self.inner = inner
        self.name = name

    def min(self, value: int, what: str = "") -> int:
        return value if what == self.name else self.inner.min(value, what)

    def min_all(self, values: Sequence[int], what: str = "") -> tuple[int, ...]:
        return tuple(values) if what == self.name else self.inner.min_all(values, what)


@pytest.mark.parametrize(("decision", "write_policy", "prefetch_policy", "seed"), ABLATIONS,
                         ids=[a[0].replace(" ", "-") for a in ABLATIONS])
def test_each_consensus_is_needed(decision: str, write_policy: WritePolicy,
                                  prefetch_policy: PrefetchPolicy, seed: int) -> None:
    """Without consensus on ``decision`` alone, the ranks' trees part (INV-RANKS-AGREE)
    or their collectives do (a rank meets another's different collective)."""
    skew = replace(SKEW_2, write_policy=write_policy, prefetch_policy=prefetch_policy)
    healthy = run_local(2, skew, seed, 200, timeout_s=3.0)
    assert [r.failure for r in healthy] == [None, None], healthy
    broken = run_local(2, skew, seed, 200, checked=AGREE, timeout_s=3.0,
                       sync_of=lambda rank, sync: WithoutConsensusOn(sync, decision))
    failures = [r.failure for r in broken if r.failure]
    assert failures, f"removing consensus on {decision!r} went unnoticed"
    assert "INV-RANKS-AGREE" in failures[0] or "CollectiveMismatch" in failures[0], failures


def test_local_ranks_without_consensus_diverge() -> None:
    """The check can fail: each rank deciding alone, and only the views compared."""
    reports = run_local(2, SKEW_2, seed=7, steps=200,
                        sync_of=lambda rank, sync: LocalSync(), checked=AGREE)
    failures = [r.failure for r in reports if r.failure]
    assert failures and "INV-RANKS-AGREE" in failures[0], reports
    SUMMARY.append(f"ranks without consensus: {failures[0][:120]}")


def test_local_rank_skipping_an_idle_collective_is_named() -> None:
    reports = run_local(2, SKEW_2, seed=7, steps=200, timeout_s=3.0,
                        sync_of=lambda rank, sync: SkipIdleAcks(sync) if rank else sync)
    failures = " | ".join(r.failure or "" for r in reports)
    assert "CollectiveMismatch" in failures and "'ack " in failures, failures


@hsettings(max_examples=12)
@given(seed=st.integers(0, 10_000), world=st.sampled_from([2, 3, 4]),
       roles=st.permutations(range(4)))
def test_local_ranks_agree_under_any_skew(seed: int, world: int, roles: list[int]) -> None:
    fuller, slow, misses, io = (r % world for r in roles)
    skew = Skew(fuller_pool=fuller, slow_copies=slow, storage_misses=misses, slow_io=io,
                prefetch_policy="wait_complete" if seed % 2 else "best_effort",
                write_policy="write_back" if seed % 3 == 0 else "write_through")
    reports = run_local(world, skew, seed=seed, steps=60)
    assert [r.failure for r in reports] == [None] * world, reports


def test_local_ranks_report_a_rank_that_never_comes() -> None:
    group = LocalRanks(2, timeout_s=0.2)
    with pytest.raises(CollectiveMismatch, match=r"'ack d2h'.*not every rank"):
        group.sync(0).min(3, "ack d2h")


def test_ledger_counts_every_collective_and_value() -> None:
    ledger = Ledger(LocalSync())
    assert ledger.min(3, "a") == 3
    assert ledger.min_all([1, 0], "b") == (1, 0)
    assert ledger.calls == 2 and [c.name for c in ledger.log] == ["a", "b[0]", "b[1]"]


# ------------------------------------------------------------------ across processes


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _run_processes(world: int, skew: Skew, steps: int, *, pp_size: int = 1,
                   consensus: bool = True, checked: frozenset[str] | None = None,
                   hang_at: dict[int, int] | None = None, skip_idle_acks: int | None = None,
                   gloo_timeout_s: float = 10.0,
                   join_s: float = 40.0) -> list[RankReport]:
    """Start ``world`` ranks; a rank that has not ended ``join_s`` after the start is
    killed by its pid and reported as hung. The ranks fork from a forkserver that has
    imported torch and hiradix once (a spawn per rank costs seconds each on CI)."""
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["hiradix.conformance.ranks"])
    port = _free_port()
    with tempfile.TemporaryDirectory() as out:
        processes = [context.Process(
            target=run_rank_process,
            args=(rank, world, port, skew, 11, steps, out, pp_size, consensus, checked,
                  (hang_at or {}).get(rank), rank == skip_idle_acks, gloo_timeout_s),
            daemon=True)
            for rank in range(world)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + join_s
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        hung = [p for p in processes if p.is_alive()]
        for process in hung:
            process.kill()
            process.join(5)
        reports = []
        for rank in range(world):
            path = Path(out, f"rank{rank}.json")
            if path.exists():
                reports.append(RankReport(**json.loads(path.read_text())))
            else:
                reports.append(RankReport(rank, failure=f"hung: killed after {join_s} s "
                                                        f"(pid {processes[rank].pid})"))
        return reports


@pytest.mark.parametrize(("world", "pp_size", "skew"),
                         [(2, 1, SKEW_2), (4, 2, SKEW_4)], ids=["tp2", "tp2xpp2"])
def test_gloo_ranks_agree_after_every_step(world: int, pp_size: int, skew: Skew) -> None:
    reports = _run_processes(world, skew, 120, pp_size=pp_size)
    _agreeing(reports, 120)
    _summarise(f"gloo {world} (pp {pp_size})", reports, skew)


def test_gloo_ranks_without_consensus_diverge() -> None:
    reports = _run_processes(2, SKEW_2, 120, consensus=False, checked=AGREE)
    failures = [r.failure for r in reports if r.failure]
    assert failures and all("INV-RANKS-AGREE" in f for f in failures), reports


def test_gloo_rank_that_hangs_fails_naming_the_collective() -> None:
    """Rank 1 goes silent at its 20th collective; rank 0 waits in that collective until
    gloo's timeout and fails naming it, instead of hanging the run."""
    reports = _run_processes(2, SKEW_2, 60, hang_at={1: 20}, gloo_timeout_s=3.0)
    hung = re.search(r"hung on purpose at collective #20 ('[^']*')", reports[1].failure or "")
    assert hung, reports[1]
    failure = reports[0].failure or ""
    assert f"CollectiveTimeout: collective {hung.group(1)} failed" in failure, failure
    assert "Timed out" in failure, failure  # gloo's timeout, before rank 1 woke up
    SUMMARY.append(f"ranks gloo deadlock caught: {failure.splitlines()[0][:160]}")


def test_gloo_rank_skipping_an_idle_collective_fails_naming_it() -> None:
    """Rank 1 skips the acknowledgement's all-reduce when it has nothing finished; the
    name check that travels with every collective makes both ranks fail at once, each
    naming its own collective, instead of pairing the wrong values."""
    reports = _run_processes(2, SKEW_2, 60, skip_idle_acks=1, gloo_timeout_s=3.0)
    failures = [r.failure or "" for r in reports]
    assert all("CollectiveMismatch: collective '" in f for f in failures), failures
    assert any("'ack " in f for f in failures), failures
    SUMMARY.append("ranks gloo skipped collective caught: "
                   + " / ".join(f.splitlines()[0][:90] for f in failures))
