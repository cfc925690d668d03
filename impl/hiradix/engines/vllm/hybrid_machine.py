"""The request-level machine for vLLM's hybrid coordinator (spec/13, 13.9): a full and a
sliding-window group over one shared block pool, driven as vLLM's scheduler drives them.

vLLM's hybrid cache is no ``SwaEngine``: it has no pairs, no insert and no SWA lock of
its own (13.9). So, as ``vllm_machine`` does for the full-attention cache (spec/10), this
machine issues vLLM's own calls -- ``get_computed_blocks``, ``allocate_slots`` per prefill
chunk and per decode token, ``free`` -- and after every call checks two things:

- **vLLM against the machine's own account of its pool** (``Expected``): which blocks
  each running request holds (its two block tables, the SWA one losing the blocks its
  window passed), the reference counts they make, the free queue in order (touch,
  lazy eviction from the front, cached blocks freed to the back and uncached ones to the
  front), the hashes registered per group, and whether vLLM refuses an allocation.
  This is the differential part: ``pool_problems``.
- **the hybrid model's rules on vLLM's state** (``abstract``: vLLM's pool as an
  ``SwaState``): INV-SWA-TREE-WELL-FORMED, INV-SWA-ONLY-WITH-FULL, INV-SWA-CONTENT and
  INV-SWA-LOCKS; INV-SWA-FULL-POOL and INV-SWA-SWA-POOL as one partition of the shared
  pool (DEV-H7); the window of every running request kept live and SWA-locked (the
  INV-SWA-LOCKS counterpart of vLLM's window lock, ``window_problems``); an SWA copy
  without its full copy only unreferenced (DEV-H8); and every hit against the model's
  ``match_prefix`` and INV-SWA-MATCH-LIVE, under vLLM's window of cdiv(W - 1, P) pages
  (DEV-H6).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hiradix.conformance.batches import run_campaign_of
from hiradix.conformance.hybrid.campaign import HybridCampaign
from hiradix.engines.vllm.hybrid import (
    FULL,
    SWA,
    Hit,
    HybridSetup,
    PoolView,
    VllmHybrid,
    cdiv,
)
from hiradix_model import Key
from hiradix_model import hybrid as model
from hiradix_model.components import expected_kv
from hiradix_model.hybrid import SwaPage, SwaState
from hiradix_model.hybrid.invariants import SWA_INVARIANTS

# The model's invariants that hold on one shared pool as stated; the two per-pool
# partitions are replaced by ``pool_problems`` (DEV-H7).
SHARED_POOL_INVARIANTS = ("INV-SWA-TREE-WELL-FORMED", "INV-SWA-ONLY-WITH-FULL",
                          "INV-SWA-CONTENT", "INV-SWA-LOCKS")
MAX_TOKENS = 24  # a request finishes once this long (prompt and decoded tokens)
prompts = st.lists(st.integers(1, 3), min_size=1, max_size=16).map(tuple)
# What a campaign should reach; the summary lists the ones it did not.
REACH: tuple[str, ...] = ("hit", "hit_cut_by_window", "healed", "window_release", "evicted_full",
         "evicted_swa", "swa_without_full", "refused", "preempted", "finish")


# -- vLLM's pool as the model's state ---------------------------------------------------

def page_blocks(view: PoolView, page: Key, group: int) -> list[int]:
    return [b for b, v in view.blocks.items() if v.group == group and v.page == page]


def abstract(view: PoolView, setup: HybridSetup, adapter: VllmHybrid) -> SwaState:
    """vLLM's pool as an ``SwaState`` (13.9): a page per hash registered in the full
    group, with its primary block's slots as its full copy and the primary SWA block of
    the same hash, if any, as its SWA copy (none: a tombstone); ``lock`` and ``swa_lock``
    are the reference counts of every block registered under the hash in that group
    (duplicates included: a request that recomputed a page holds it through its own
    block). Both copies live in one slot space, so ``full_kv`` and ``swa_kv`` are the one
    map the forward pass wrote, and ``full_free``/``swa_free`` are the free queue's slots
    (read by no predicate checked here: the pool is checked by ``pool_problems``)."""
    pages: dict[Key, SwaPage] = {}
    for block, seen in view.blocks.items():
        if seen.group != FULL or not seen.primary or seen.page is None:
            continue
        live = [b for b in page_blocks(view, seen.page, SWA) if view.blocks[b].primary]
        pages[seen.page] = SwaPage(
            full=adapter.slots(block),
            swa=adapter.slots(live[0]) if live else None,
            lock=sum(view.blocks[b].ref_cnt for b in page_blocks(view, seen.page, FULL)),
            swa_lock=sum(view.blocks[b].ref_cnt for b in page_blocks(view, seen.page, SWA)))
    free = frozenset(s for b in view.queue for s in adapter.slots(b))
    return SwaState(config=setup.model_config(), pages=pages, full_free=free, swa_free=free,
                    held={}, full_kv=dict(view.kv), swa_kv=dict(view.kv))


def model_problems(state: SwaState) -> list[str]:
    return [f"{spec_id}: {v}" for spec_id in SHARED_POOL_INVARIANTS
            for v in SWA_INVARIANTS[spec_id](state)]


# -- the machine's own account of vLLM's pool ---------------------------------------------

@dataclass
class Table:
    """The blocks a running request holds, per group (None: a null block)."""

    full: list[int]
    swa: list[int | None]


@dataclass
class Expected:
    """vLLM's pool as the machine predicts it from the calls it made (13.9)."""

    queue: list[int]
    registered: dict[int, tuple[int, Key]] = field(default_factory=dict)
    tables: dict[str, Table] = field(default_factory=dict)

    def refs(self) -> Counter[int]:
        counts: Counter[int] = Counter()
        for table in self.tables.values():
            counts.update(table.full)
            counts.update(b for b in table.swa if b is not None)
        return counts

    def release(self, blocks: Sequence[int]) -> None:
        """``free_blocks`` of blocks already out of their tables, in eviction order: the
        unreferenced ones join the queue, cached ones at the back, others at the front."""
        refs = self.refs()
        gone = [b for b in blocks if refs[b] == 0]
        self.queue = ([b for b in gone if b not in self.registered] + self.queue
                      + [b for b in gone if b in self.registered])

    def touch(self, blocks: Sequence[int]) -> None:
        held = set(blocks)
        self.queue = [b for b in self.queue if b not in held]

    def take(self, count: int) -> list[int]:
        """Blocks from the front of the queue; a cached one loses its hash (eviction)."""
        taken, self.queue = self.queue[:count], self.queue[count:]
        for block in taken:
            self.registered.pop(block, None)
        return taken

    def skip(self, request_id: str, skipped: int) -> list[int]:
        """``remove_skipped_blocks``: the SWA blocks before ``skipped`` leave the table,
        the last first, stopping at a null block; the blocks released."""
        table = self.tables[request_id].swa
        freed = []
        for index in range(min(skipped, len(table)) - 1, -1, -1):
            block = table[index]
            if block is None:
                break
            freed.append(block)
            table[index] = None
        self.release(freed)
        return freed

    def register(self, request_id: str, tokens: Sequence[int], computed: int,
                 page_size: int) -> None:
        """``cache_blocks``: every full block of both tables gets its page's hash."""
        table = self.tables[request_id]
        for index in range(computed // page_size):
            page = Key(tuple(tokens[:(index + 1) * page_size]))
            for group, blocks in ((FULL, table.full), (SWA, table.swa)):
                block = blocks[index] if index < len(blocks) else None
                if block is not None and block not in self.registered:
                    self.registered[block] = (group, page)


def pool_problems(view: PoolView, expected: Expected) -> Iterator[str]:
    """vLLM's pool against the machine's account, and the shared pool's partition
    (DEV-H7: every block is queued exactly when no request references it)."""
    refs = expected.refs()
    if len(set(view.queue)) != len(view.queue):
        yield f"the free queue holds a block twice: {list(view.queue)}"
    if view.num_free != len(view.queue):
        yield f"num_free_blocks {view.num_free}, free queue {len(view.queue)} blocks"
    for block, seen in sorted(view.blocks.items()):
        if (block in view.queue) != (seen.ref_cnt == 0):
            yield f"block {block}: ref_cnt {seen.ref_cnt}, queued {block in view.queue}"
        if seen.ref_cnt != refs[block]:
            yield f"block {block}: ref_cnt {seen.ref_cnt}, running requests hold it {refs[block]}"
        registered = (seen.group, seen.page) if seen.group is not None else None
        if registered != expected.registered.get(block):
            yield (f"block {block}: registered as {registered}, expected "
                   f"{expected.registered.get(block)}")
    if list(view.queue) != expected.queue:
        yield f"free queue {list(view.queue)}, expected {expected.queue}"
    for request_id, (full, swa) in sorted(view.tables.items()):
        table = expected.tables.get(request_id)
        if table is None or (list(full), list(swa)) != (table.full, table.swa):
            yield f"request {request_id}: tables {full} / {swa}, expected {table}"
    if set(view.tables) != set(expected.tables):
        yield f"running requests {sorted(view.tables)}, expected {sorted(expected.tables)}"


def content_problems(view: PoolView, adapter: VllmHybrid, page_size: int) -> Iterator[str]:
    """INV-SWA-CONTENT on every cached block, duplicates and SWA-only ones included: a
    block is registered under the hash of the tokens its KV is of."""
    for block, seen in sorted(view.blocks.items()):
        if seen.page is None:
            continue
        for offset, slot in enumerate(adapter.slots(block)):
            want = expected_kv(seen.page, offset, page_size)
            if view.kv.get(slot) != want:
                yield (f"INV-SWA-CONTENT: block {block} (group {seen.group}) is cached as "
                       f"{seen.page.tokens}; slot {slot} holds {view.kv.get(slot)}")


def orphan_problems(view: PoolView, state: SwaState) -> Iterator[str]:
    """DEV-H8: an SWA copy whose full copy went is no page; it must be unreferenced."""
    for block, seen in sorted(view.blocks.items()):
        if seen.group == SWA and seen.page not in state.pages and seen.ref_cnt:
            yield (f"DEV-H8: SWA block {block} of {seen.page} has no full copy, ref_cnt "
                   f"{seen.ref_cnt}")


def window_problems(state: SwaState, setup: HybridSetup, tokens: Sequence[int],
                    computed: int) -> Iterator[str]:
    """INV-SWA-LOCKS as vLLM locks: the pages of a running request's window (the whole
    pages among the W - 1 tokens before its next one) are cached, live and SWA-locked,
    and its deepest computed page is locked."""
    ps = setup.page_size
    first = max(0, computed - setup.window + 1) // ps
    for index in range(first, computed // ps):
        page = state.pages.get(Key(tuple(tokens[:(index + 1) * ps])))
        if page is None or not page.live or page.swa_lock == 0:
            yield (f"INV-SWA-LOCKS: page {index} of a request {computed} tokens in is in its "
                   f"window but is {page}")
    if computed >= ps:
        deepest = state.pages.get(Key(tuple(tokens[:computed // ps * ps])))
        if deepest is None or deepest.lock == 0:
            yield f"INV-SWA-LOCKS: the deepest page of a running request is {deepest}"


def match_problems(state: SwaState, setup: HybridSetup, adapter: VllmHybrid,
                   tokens: Sequence[int], hit: Hit) -> list[str]:
    """The hit against the model's ``match_prefix`` of all but the last token under
    vLLM's window (DEV-H6) and INV-SWA-MATCH-LIVE; the SWA hit must be the SWA copies of
    exactly the matched page's window."""
    key = Key(tuple(tokens[:-1]))
    want = model.match_prefix(state, key)
    got = tuple(s for b in hit.full for s in adapter.slots(b))
    end = Key(tuple(tokens[:hit.tokens])) if hit.tokens else None
    problems = [f"INV-SWA-MATCH-LIVE: {p}" for p in model.match_problems(state, key, end)]
    if (got, hit.tokens) != (want.full_slots, len(want.full_slots)):
        problems.append(f"hit {hit.tokens} tokens, full slots {got}; model "
                        f"{want.last_page} {want.full_slots}")
        return problems
    window = model.window(state, want.last_page) if want.last_page is not None else []
    want_swa = {len(k.tokens) // setup.page_size - 1: state.pages[k].swa for k in window}
    got_swa = {i: adapter.slots(b) for i, b in enumerate(hit.swa) if b is not None}
    if got_swa != want_swa or len(hit.swa) != len(hit.full):
        problems.append(f"SWA hit {list(hit.swa)}, the window's SWA copies {want_swa}")
    return problems


# -- the machine ------------------------------------------------------------------------

def make_vllm_hybrid_machine(setup: HybridSetup, reached: Counter[str] | None = None,
                             build: Callable[[HybridSetup], VllmHybrid] = VllmHybrid,
                             ) -> type[RuleBasedStateMachine]:
    """A machine class driving a fresh ``build(setup)`` per example; ``reached`` counts
    what the examples exercised."""
    seen = reached if reached is not None else Counter()
    ps = setup.page_size

    class VllmHybridMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.engine = build(setup)
            self.expected = Expected(queue=list(range(1, setup.num_blocks + 1)))
            self.state = abstract(self.engine.observe(), setup, self.engine)
            seen["examples"] += 1
            self.check("the initial state")

        def teardown(self) -> None:
            self.engine.close()

        # -- checking -------------------------------------------------------------------
        def check(self, step: str) -> None:
            seen["checks"] += 1
            view = self.engine.observe()
            before = self.state
            state = self.state = abstract(view, setup, self.engine)
            problems = list(pool_problems(view, self.expected))
            problems += model_problems(state)
            problems += content_problems(view, self.engine, ps)
            problems += orphan_problems(view, state)
            for request_id in self.expected.tables:
                problems += window_problems(state, setup, self.engine.tokens(request_id),
                                            self.engine.computed(request_id))
            assert not problems, f"after {step}:\n  " + "\n  ".join(problems)
            seen["healed"] += sum(not p.live and k in state.pages and state.pages[k].live
                                  for k, p in before.pages.items())
            seen["swa_without_full"] += any(v.group == SWA and v.page not in state.pages
                                            for v in view.blocks.values())

        def taken(self, blocks: Sequence[int]) -> None:
            """Count the cached blocks an allocation took (lazy eviction)."""
            for block in blocks:
                group = self.expected.registered.get(block, (None,))[0]
                if group == FULL:
                    seen["evicted_full"] += 1
                elif group == SWA:
                    seen["evicted_swa"] += 1

        def allocate(self, request_id: str, num_new: int, hit: Hit | None) -> bool:
            """One ``allocate_slots`` and its prediction; whether vLLM allocated."""
            table = self.expected.tables[request_id]
            computed = self.engine.computed(request_id) + (hit.tokens if hit else 0)
            if hit is None and self.expected.skip(request_id, setup.skipped_blocks(computed)):
                seen["window_release"] += 1
            needed = cdiv(computed + num_new, ps)
            new_full = max(0, needed - len(table.full))
            new_swa = max(0, needed - len(table.swa))
            touched = [] if hit is None else [b for b in (*hit.full, *table.swa)
                                              if b is not None and b in self.expected.queue]
            refuse = new_full + new_swa + len(touched) > len(self.expected.queue)
            got = self.engine.schedule(request_id, num_new, hit)
            assert (got is None) == refuse, (
                f"allocate_slots({num_new}) {'refused' if got is None else 'allocated'}: "
                f"{new_full} + {new_swa} new blocks, {len(touched)} touched, "
                f"{len(self.expected.queue)} free")
            if got is None:
                return False
            self.expected.touch(touched)
            self.taken(self.expected.queue[:new_full + new_swa])
            want_full = self.expected.take(new_full)
            want_swa = self.expected.take(new_swa)
            assert got == (tuple(want_full), tuple(want_swa)), (
                f"allocate_slots({num_new}) took {got}, the free queue's front is "
                f"{want_full} / {want_swa}")
            table.full += want_full
            table.swa += want_swa
            self.expected.register(request_id, self.engine.tokens(request_id),
                                   computed + num_new, ps)
            return True

        def free(self, request_id: str) -> None:
            table = self.expected.tables.pop(request_id)
            self.engine.free(request_id)
            self.expected.release(table.full[::-1])
            self.expected.release([b for b in table.swa[::-1] if b is not None])

        # -- rules ----------------------------------------------------------------------
        @rule(prompt=prompts, chunk=st.integers(1, 8))
        def admit(self, prompt: tuple[int, ...], chunk: int) -> None:
            """A waiting request: the hit, then its first prefill chunk."""
            request_id = self.engine.new_request(prompt)
            hit = self.engine.lookup(request_id)
            problems = match_problems(self.state, setup, self.engine, prompt, hit)
            assert not problems, f"get_computed_blocks({prompt}):\n  " + "\n  ".join(problems)
            seen["hit"] += bool(hit.tokens)
            cached = 0
            while Key(prompt[:(cached + 1) * ps]) in self.state.pages and (
                    cached + 1) * ps < len(prompt):
                cached += 1
            seen["hit_cut_by_window"] += hit.tokens < cached * ps
            skipped = setup.skipped_blocks(hit.tokens)
            swa: list[int | None] = [None] * skipped
            self.expected.tables[request_id] = Table(list(hit.full),
                                                     swa + list(hit.swa[skipped:]))
            num_new = min(chunk, len(prompt) - hit.tokens)
            if not self.allocate(request_id, num_new, hit):
                seen["refused"] += 1
                del self.expected.tables[request_id]
                self.engine.free(request_id)  # the scheduler drops a request it never ran
            self.check(f"admit({prompt}, chunk {chunk}) after a hit of {hit.tokens} tokens")

        @precondition(lambda self: bool(self.expected.tables))
        @rule(index=st.integers(0, 63), chunk=st.integers(1, 8), token=st.integers(1, 3))
        def advance(self, index: int, chunk: int, token: int) -> None:
            """One scheduler step of a running request: a prefill chunk, else a decode
            token; a request the pool cannot hold is preempted (freed)."""
            request_id = sorted(self.expected.tables, key=int)[index % len(self.expected.tables)]
            left = self.engine.prompt_left(request_id)
            if not left:
                if len(self.engine.tokens(request_id)) >= MAX_TOKENS:
                    self.finish_request(request_id)
                    return
                self.engine.append_token(request_id, token)
            num_new = min(chunk, left) if left else 1
            if not self.allocate(request_id, num_new, None):
                seen["preempted"] += 1
                self.free(request_id)
            self.check(f"advance(request {request_id}, {num_new} tokens)")

        def finish_request(self, request_id: str) -> None:
            self.free(request_id)
            seen["finish"] += 1
            self.check(f"free(request {request_id})")

        @precondition(lambda self: bool(self.expected.tables))
        @rule(index=st.integers(0, 63))
        def finish(self, index: int) -> None:
            self.finish_request(sorted(self.expected.tables, key=int)[
                index % len(self.expected.tables)])

        @invariant()
        def checked(self) -> None:
            """Every rule checks after each vLLM call; this counts the states seen."""
            seen["states"] += 1

    VllmHybridMachine.__name__ = f"VllmHybridMachine_{ps}_{setup.window}_{setup.num_blocks}"
    return VllmHybridMachine


# -- a bounded campaign ------------------------------------------------------------------

def vllm_hybrid_setups(page_sizes: Sequence[int]) -> list[HybridSetup]:
    """Windows of one token over a page (the match window one page), of just over two
    pages, and of three pages exactly (cdiv(W - 1, P) one page short of ceil(W / P));
    pools of 10 and 16 blocks, so that allocations run short and both copies get evicted."""
    return [HybridSetup(page_size=ps, num_blocks=blocks, window=window)
            for ps in page_sizes for window in sorted({ps + 1, 2 * ps + 1, max(2, 3 * ps)})
            for blocks in (10, 16)]


class VllmHybridCampaign(HybridCampaign):
    reach = REACH


def run_vllm_hybrid_campaign(page_sizes: Sequence[int], *, until: float,
                             examples: int | None = None, steps: int = 30, batch: int = 3,
                             seeded: int | None = None,
                             clock: Callable[[], float] = time.monotonic,
                             build: Callable[[HybridSetup], VllmHybrid] = VllmHybrid,
                             ) -> VllmHybridCampaign:
    """Batches of ``batch`` examples cycling through the setups until ``until`` (or
    ``examples`` ran); stops at the first failure (``batches.run_batches``)."""
    def machine(setup: object, reached: Counter[str]) -> type[RuleBasedStateMachine]:
        assert isinstance(setup, HybridSetup)
        return make_vllm_hybrid_machine(setup, reached, build)

    return run_campaign_of(VllmHybridCampaign("vllm-hybrid"), vllm_hybrid_setups(page_sizes),
                           machine, until=until, examples=examples, steps=steps, batch=batch,
                           seeded=seeded, clock=clock)
