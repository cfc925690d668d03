"""Many ranks run for real (spec/12-ranks.md): one cache per rank, skewed on purpose,
and the rank invariants checked after every step.

Every rank runs the same scheduler (``RankWorkload``: the same seeded operations, in
the same order) against its own cache. The ranks differ where real ranks differ
(``Skew``): one rank's pools are fuller (slots the rank's caller holds), one rank's
copies finish later, one rank's storage misses pages. Each decision a rank could take
alone goes through the cache's ``RankSync`` (wrapped in a ``Ledger`` that records every
collective). After every step the ranks exchange ``RankRecord``s (their view and their
collectives) and each checks ``check_ranks``: INV-RANKS-AGREE, INV-RANKS-COLLECTIVES,
INV-RANKS-CONSENSUS.

The exchange is not a cache collective (it is the checker's): a ``LocalRanks`` group in
one process, ``all_gather_object`` over gloo across processes (``run_rank_process``).
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

from hiradix.cache import HiRadixCache, MatchResult, PendingCopy
from hiradix.conformance.abstraction import page_keys
from hiradix.distributed import CollectiveMismatch, Ledger, LocalRanks, LocalSync, RankSync
from hiradix.errors import RankSyncError
from hiradix.keys import RadixKey
from hiradix.policies import WritePolicy
from hiradix.storage.config import PrefetchPolicy
from hiradix.storage.memory import MemoryBackend
from hiradix.storage.tier import TierSettings
from hiradix.transfer import ControlledCopyEngine
from hiradix.tree import TreeNode
from hiradix_model import Key
from hiradix_model.ranks import (
    Collective,
    PageView,
    PrefetchView,
    RankRecord,
    RankView,
    check_ranks,
    rank_violations,
)

PAGE = 2
DEVICE_SLOTS = 48
HOST_SLOTS = 64


@dataclass(frozen=True)
class Skew:
    """Which rank is skewed how (None: no rank). The fuller rank's caller holds ``held``
    device slots for the whole run, and its host pool is ``held`` slots smaller (host
    slots nobody owns would be a leak)."""

    fuller_pool: int | None = None
    slow_copies: int | None = None
    storage_misses: int | None = None
    slow_io: int | None = None  # this rank's storage I/O runs on half the steps
    held: int = 12
    # The run's policies, the same on every rank (not skews).
    prefetch_policy: PrefetchPolicy = "best_effort"
    write_policy: WritePolicy = "write_through"

    def kinds(self) -> int:
        return sum(r is not None for r in (self.fuller_pool, self.slow_copies,
                                           self.storage_misses, self.slow_io))


@dataclass
class RankReport:
    """What one rank saw (JSON-able, for the parent of a multi-process run)."""

    rank: int
    steps: int = 0
    collectives: int = 0  # collectives the cache issued (a vector one counts once)
    decisions: int = 0  # values agreed on (a vector collective counts each element)
    disagreements: int = 0  # collectives whose result differed from this rank's proposal
    failure: str | None = None  # the first violated rank invariant, or the exception
    ops: dict[str, int] = field(default_factory=dict)


class RankFailure(AssertionError):
    """A rank invariant failed after a step, or a collective went wrong."""


# ------------------------------------------------------------------ the view


def _copy_pages(copy: PendingCopy) -> tuple[Key, ...]:
    nodes = copy.nodes()
    assert nodes is not None
    return tuple(k for n in nodes for k in page_keys(n, PAGE))


def rank_view(cache: HiRadixCache) -> RankView:
    """The cache as the model's ``RankView``: what every rank must agree on."""
    size = cache.page_size
    pages: list[tuple[Key, PageView]] = []
    for node in cache.nodes():
        page = PageView(node.device is not None, node.host is not None, node.lock_ref,
                        node.host_ref, node.hits, node.last_tick, node.insert_tick,
                        node.priority)
        pages.extend((key, page) for key in page_keys(node, size))
    pages.sort(key=lambda item: (item[0].namespace or "", item[0].tokens))
    copies = sorted(((c.seq, d, c) for d, queue in cache.pending.items() for c in queue),
                    key=lambda item: item[0])
    pending = tuple((d, _copy_pages(c)) for _, d, c in copies)
    tier = cache.storage
    if tier is None:
        return RankView(tuple(pages), pending, cache.last_tick)
    prefetches = tuple(sorted(
        (PrefetchView(p.request, Key(p.key.tokens[:p.anchor * size], p.key.namespace)
                      if p.anchor else None, p.pages)
         for p in tier.state.prefetches.values()), key=lambda p: p.request))
    loaded = tuple(sorted(tier.state.loaded_tokens.items()))
    return RankView(tuple(pages), pending, cache.last_tick, prefetches, loaded)


def record(cache: HiRadixCache, ledger: Ledger, since: int = 0) -> RankRecord:
    """The cache's view and the collectives of ``ledger`` from the ``since``-th on."""
    return RankRecord(rank_view(cache), tuple(Collective(c.name, c.proposed, c.result)
                                              for c in ledger.log[since:]))


# ------------------------------------------------------------------ the workload


class LossyBackend(MemoryBackend):
    """A memory store that can lose pages it was given (a rank's store that misses)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.written: list[str] = []
        self.lost = 0

    def write_page(self, page_hash: str, payload: bytes, page_checksum: bytes) -> None:
        super().write_page(page_hash, payload, page_checksum)
        self.written.append(page_hash)

    def lose(self, rng: random.Random, count: int) -> None:
        for _ in range(min(count, len(self.written))):
            self.discard_page(self.written.pop(rng.randrange(len(self.written))))
            self.lost += 1


class RankWorkload:
    """One rank's cache and scheduler. Every rank draws its operations from the same
    seed, so the ranks differ only where ``skew`` (and nothing else) makes them."""

    OPS = ("request", "request", "progress", "progress", "copies", "copies", "storage_io",
           "storage_io", "evict", "evict_host", "lock")

    def __init__(self, rank: int, sync: RankSync, skew: Skew, seed: int) -> None:
        self.rank = rank
        self.skew = skew
        self.ledger = Ledger(sync)
        fuller = skew.fuller_pool == rank
        host_slots = HOST_SLOTS - (skew.held if fuller else 0)
        self.cache = HiRadixCache.create(device_slots=DEVICE_SLOTS, page_size=PAGE,
                                         host_ratio=host_slots / DEVICE_SLOTS,
                                         load_back_threshold=PAGE, transfer="controlled",
                                         write_policy=skew.write_policy, sync=self.ledger)
        self.backend = LossyBackend(f"rank{rank}")
        # The rate limit is given: its default derives from the pool sizes (9.1), which
        # would let the fuller rank skip a collective the others issue.
        self.cache.attach_storage_backend(
            self.backend, "ranks-test",
            TierSettings(prefetch_threshold=PAGE, prefetch_policy=skew.prefetch_policy,
                         prefetch_token_limit=HOST_SLOTS // 2),
            threaded=False)
        if fuller:
            assert self.cache.device_pool.alloc(skew.held) is not None
        self.shared = random.Random(seed)  # the scheduler: the same on every rank
        self.local = random.Random(seed * 1000 + rank)  # this rank's own timing
        self.waiting: list[tuple[str, RadixKey]] = []  # requests whose prefetch runs
        self.locked: list[TreeNode] = []
        self.history: list[tuple[int, ...]] = []
        self.requests = 0
        self.ops: dict[str, int] = {}

    def step(self) -> str:
        """One operation, drawn from the shared seed; returns its name."""
        op = self.shared.choice(self.OPS)
        self.apply(op)
        return op

    def apply(self, op: str) -> None:
        """Operation ``op`` (one of ``OPS``); its arguments come from the shared seed."""
        if op not in self.OPS:
            raise ValueError(f"unknown operation {op!r}; one of {sorted(set(self.OPS))}")
        self.ops[op] = self.ops.get(op, 0) + 1
        getattr(self, "_" + op)()

    # -- operations ---------------------------------------------------------------------

    def _request(self) -> None:
        # A small alphabet and a shared first token: prefixes repeat and branch; half the
        # requests come back to an earlier one (a conversation's next turn).
        if self.history and self.shared.random() < 0.5:
            base = self.history[self.shared.randrange(len(self.history))]
            extra = self.shared.randint(0, 2) * PAGE
        else:
            base, extra = (1,), self.shared.randint(1, 5) * PAGE - 1
        tokens = base + tuple(self.shared.randint(2, 4) for _ in range(extra))
        self.history = ([*self.history, tokens])[-16:]
        key = RadixKey(tokens)
        self.requests += 1
        request = f"r{self.requests}"
        match = self._load(key)
        anchor = match.last_host_node
        depth = len(match.device_slots) + match.host_hit_length
        if depth < len(tokens) and (anchor is self.cache.root or anchor.host is not None):
            tier = self.cache.storage
            assert tier is not None
            if tier.query_storage_hit_length(key, anchor) > 0 and \
                    tier.prefetch_from_storage(request, key, anchor) > 0:
                self.waiting.append((request, key))
                return
        self._finish(key)

    def _load(self, key: RadixKey) -> MatchResult:
        match = self.cache.match_prefix(key)
        if match.host_hit_length:
            self.cache.init_load_back(match.last_host_node)
            match = self.cache.match_prefix(key)
        return match

    def _finish(self, key: RadixKey) -> None:
        """Compute the rest of ``key`` and insert it (the caller's part of a request)."""
        match = self.cache.match_prefix(key)
        if match.host_hit_length:  # a prefetch landed it on host: load it
            self._load(key)
            match = self.cache.match_prefix(key)
        cached = len(match.device_slots)
        need = len(key.tokens) - cached
        if need == 0:
            return
        anchor = match.last_device_node
        self.cache.inc_lock_ref(anchor)  # the matched prefix must survive the eviction
        try:
            slots = self.cache.alloc(need)
            if slots is None:
                self.cache.evict(need)
                slots = self.cache.alloc(need)
            if slots is None:
                return  # no room on some rank: every rank skips it
            prefix = self.cache.insert(key, torch.cat([match.device_slots, slots]))
            if prefix > cached:  # duplicates: the caller's slots for tokens already cached
                self.cache.free(slots[:prefix - cached])
        finally:
            self.cache.dec_lock_ref(anchor)

    def _progress(self) -> None:
        tier = self.cache.storage
        assert tier is not None
        self._run_io()  # the I/O ran meanwhile (on a slow rank, maybe not)
        still = []
        for request, key in self.waiting:
            if tier.check_prefetch_progress(request):
                tier.pop_prefetch_loaded_tokens(request)
                self._finish(key)
            else:
                still.append((request, key))
        self.waiting = still

    def _copies(self) -> None:
        engine = self.cache.engine
        assert isinstance(engine, ControlledCopyEngine)
        for direction in ("d2h", "h2d"):
            queued = engine.queued(direction)
            if self.skew.slow_copies == self.rank:  # this rank's copies finish later
                queued = self.local.randint(0, queued)
            engine.complete(direction, queued)
        self.cache.writing_check()
        self.cache.loading_check()

    def _run_io(self) -> None:
        tier = self.cache.storage
        assert tier is not None and tier.io is not None
        if self.skew.storage_misses == self.rank:
            # This rank's store lost pages (another node's disk, an eviction there).
            self.backend.lose(self.local, self.local.randint(0, 2))
        if self.skew.slow_io != self.rank or self.local.random() < 0.5:
            tier.io.run_pending()

    def _storage_io(self) -> None:
        tier = self.cache.storage
        assert tier is not None
        self._run_io()
        tier.drain_storage_queues()

    def _evict(self) -> None:
        self.cache.evict(PAGE * self.shared.randint(1, 6))

    def _evict_host(self) -> None:
        self.cache.evict_host(PAGE * self.shared.randint(1, 6))

    def _lock(self) -> None:
        if self.locked and self.shared.random() < 0.6:
            self.cache.dec_lock_ref(self.locked.pop(0))
            return
        nodes = [n for n in self.cache.nodes() if n.device is not None]
        if nodes:
            node = nodes[self.shared.randrange(len(nodes))]
            self.cache.inc_lock_ref(node)
            self.locked.append(node)


# ------------------------------------------------------------------ a run


# Every rank's record, given this rank's: the views, and the collectives since the last
# exchange (the full logs are rebuilt on each rank, so the exchange stays small).
Gather = Callable[[RankRecord], Sequence[RankRecord]]


def run_rank(rank: int, sync: RankSync, gather: Gather, skew: Skew, seed: int,
             steps: int, checked: frozenset[str] | None = None) -> RankReport:
    """Run ``steps`` steps on this rank, checking the rank invariants (``checked``: only
    those IDs) after each; the report's ``failure`` names the first violation (and the
    step and operation)."""
    workload = RankWorkload(rank, sync, skew, seed)
    report = RankReport(rank)
    logs: list[list[Collective]] = []
    sent = 0
    try:
        for step in range(steps):
            op = workload.step()
            workload.cache.check_invariants()
            got = gather(record(workload.cache, workload.ledger, sent))
            sent = len(workload.ledger.log)
            logs = logs or [[] for _ in got]
            for log, mine in zip(logs, got, strict=True):
                log.extend(mine.collectives)
            records = tuple(RankRecord(r.view, tuple(log)) for r, log in zip(got, logs,
                                                                            strict=True))
            report.steps = step + 1
            failed = [i for i in check_ranks(records) if checked is None or i in checked]
            if failed:
                found = rank_violations(records)
                raise RankFailure(f"step {step} ({op}): {failed[0]}: "
                                  f"{found[failed[0]][0]}")
    except Exception as error:  # reported to the caller, which fails the test
        report.failure = f"{type(error).__name__}: {error}"
        if not isinstance(error, RankFailure):
            report.failure += "\n" + "".join(traceback.format_exception(error)[-4:])
    report.collectives = workload.ledger.calls
    report.decisions = len(workload.ledger.log)
    report.disagreements = sum(c.proposed != c.result for c in workload.ledger.log)
    report.ops = dict(workload.ops)
    return report


def run_local(world: int, skew: Skew, seed: int, steps: int, *,
              sync_of: Callable[[int, RankSync], RankSync] | None = None,
              checked: frozenset[str] | None = None,
              timeout_s: float = 20.0) -> list[RankReport]:
    """The ranks as threads of this process, in lockstep through ``LocalRanks`` (whose
    meetings also carry the checker's exchange, so a rank that skips a collective meets
    another rank's exchange and both fail at once, naming both). ``sync_of(rank,
    sync)``: the sync rank ``rank``'s cache gets instead (a test breaks consensus)."""
    group = LocalRanks(world, timeout_s)
    reports: list[RankReport | None] = [None] * world

    def body(rank: int) -> None:
        sync: RankSync = group.sync(rank)
        if sync_of is not None:
            sync = sync_of(rank, sync)

        def gather(mine: RankRecord) -> list[RankRecord]:
            got = group.gather(rank, mine, "exchange of rank records")
            return [g for g in got if isinstance(g, RankRecord)]

        report = run_rank(rank, sync, gather, skew, seed, steps, checked)
        reports[rank] = report
        # A rank invariant fails on every rank at once (they check the same records);
        # any other failure is this rank's: the others must not wait for it.
        if report.failure and not report.failure.startswith(RankFailure.__name__):
            group.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s * (steps + 1))
    return [r if r is not None else RankReport(i, failure="no report (hung)")
            for i, r in enumerate(reports)]


RANK_INVARIANTS = ("INV-RANKS-AGREE", "INV-RANKS-COLLECTIVES", "INV-RANKS-CONSENSUS")


@dataclass(frozen=True)
class RankRun:
    """One lockstep run of the main job's rank campaign; its repr replays it."""

    world: int
    skew: Skew
    seed: int
    steps: int = 60

    def run(self) -> list[RankReport]:
        return run_local(self.world, self.skew, self.seed, self.steps)


def draw_rank_run(rng: random.Random) -> RankRun:
    """A world of 2 to 4 ranks with every skew of ``Skew`` given to some rank (several
    to one rank where the world is small) and the run's policies, as
    ``test_local_ranks_agree_under_any_skew`` draws them."""
    world = rng.choice((2, 3, 4))
    fuller, slow, misses, io = (role % world for role in rng.sample(range(4), 4))
    return RankRun(world, Skew(fuller_pool=fuller, slow_copies=slow, storage_misses=misses,
                               slow_io=io,
                               prefetch_policy=rng.choice(("best_effort", "wait_complete")),
                               write_policy=rng.choice(("write_through", "write_back"))),
                   seed=rng.randrange(1_000_000))


# ------------------------------------------------------------------ across processes


def run_rank_process(rank: int, world: int, port: int, skew: Skew, seed: int, steps: int,
                     out: str, pp_size: int = 1, consensus: bool = True,
                     checked: frozenset[str] | None = None, hang_at: int | None = None,
                     skip_idle_acks: bool = False, timeout_s: float = 10.0) -> None:
    """One process of a gloo run on 127.0.0.1:``port``; writes its ``RankReport`` as
    JSON to ``out``/rank<r>.json. ``pp_size`` > 1 splits the world into stages of
    ``world // pp_size`` tensor-parallel ranks (stage-major). ``stop_after``: this rank
    hang_at``: this rank goes silent at its ``hang_at``-th collective (a rank that hangs),
    to prove that the collective the others wait in times out as a failure naming it.
    ``skip_idle_acks``: this rank skips an acknowledgement's collective when it has
    nothing finished (SGLang's old bug), to prove the ranks fail naming it."""
    import torch.distributed as dist

    from hiradix.distributed import TorchDistributedSync

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    report = RankReport(rank)
    try:
        tp = world // pp_size
        stage, tp_rank = divmod(rank, tp)
        wait = timedelta(seconds=timeout_s)  # a new group does not inherit the default's
        tp_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp)), timeout=wait)
                     for s in range(pp_size)]
        pp_groups = [dist.new_group([s * tp + t for s in range(pp_size)], timeout=wait)
                     for t in range(tp)]
        inner = TorchDistributedSync(tp_groups[stage], pp_group=pp_groups[tp_rank],
                                     pp_rank=stage, pp_size=pp_size)
        # Without consensus each rank decides alone (LocalSync): the run must fail.
        sync: RankSync = _Named(inner) if consensus else LocalSync()
        if hang_at is not None:
            sync = _HangAt(sync, hang_at, timeout_s + 2)
        if skip_idle_acks:
            sync = SkipIdleAcks(sync)

        def gather(mine: RankRecord) -> list[RankRecord]:
            got: list[RankRecord | None] = [None] * world
            try:
                inner.check("exchange of rank records")  # pairs with no collective
                dist.all_gather_object(got, mine)
            except CollectiveMismatch:
                raise
            except (RankSyncError, RuntimeError) as error:
                raise CollectiveTimeout(f"the checker's exchange of rank records failed "
                                        f"(a rank hung up): {str(error).splitlines()[0]}"
                                        ) from error
            return [g for g in got if g is not None]

        report = run_rank(rank, sync, gather, skew, seed, steps, checked)
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(asdict(report)))
    if report.failure is not None:
        os._exit(1)  # a failed rank leaves at once: a gloo teardown could wait on the others
    dist.destroy_process_group()


class _Named:
    """A sync whose failures name the collective: a gloo timeout (a rank never came) or
    any error inside the collective is re-raised as ``CollectiveTimeout`` with ``what``."""

    def __init__(self, inner: RankSync) -> None:
        self.inner = inner

    def min(self, value: int, what: str = "") -> int:
        return self.min_all((value,), what)[0]

    def min_all(self, values: Sequence[int], what: str = "") -> tuple[int, ...]:
        try:
            return self.inner.min_all(values, what)
        except CollectiveMismatch:
            raise  # it names the collective already
        except (RankSyncError, RuntimeError) as error:  # a collective failed, or a hang
            raise CollectiveTimeout(f"collective {what!r} failed (a rank skipped it or "
                                    f"hung): {str(error).splitlines()[0]}") from error


class SkipIdleAcks:
    """SGLang's old bug: a rank with nothing finished skips the acknowledgement's
    collective (its ``writing_check`` returned early on an empty queue)."""

    def __init__(self, inner: RankSync) -> None:
        self.inner = inner

    def min(self, value: int, what: str = "") -> int:
        if what.startswith("ack") and value == 0:
            return 0
        return self.inner.min(value, what)

    def min_all(self, values: Sequence[int], what: str = "") -> tuple[int, ...]:
        return self.inner.min_all(values, what)


class _HangAt:
    """``inner`` until the ``at``-th collective, where this rank sleeps ``seconds`` (alive,
    silent) and then fails, naming it."""

    def __init__(self, inner: RankSync, at: int, seconds: float) -> None:
        self.inner = inner
        self.at = at
        self.seconds = seconds
        self.calls = 0

    def min(self, value: int, what: str = "") -> int:
        return self.min_all((value,), what)[0]

    def min_all(self, values: Sequence[int], what: str = "") -> tuple[int, ...]:
        self.calls += 1
        if self.calls == self.at:
            time.sleep(self.seconds)
            raise HungOnPurpose(f"hung on purpose at collective #{self.at} {what!r}")
        return self.inner.min_all(values, what)


class HungOnPurpose(RuntimeError):
    """The rank ``_HangAt`` made hang."""


class CollectiveTimeout(RuntimeError):
    """A collective the ranks did not all reach in time."""

