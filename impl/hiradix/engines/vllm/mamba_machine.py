"""The request-level machine for vLLM's (FULL, MAMBA) coordinator in align mode (spec/13m,
13m.8a): a full-attention and a Mamba group over one shared block pool, driven as vLLM's
scheduler drives them.

vLLM's coordinator is no ``MambaEngine``: it has no insert, fork or lock calls of its own
(13m.8a). As ``hybrid.vllm_machine`` does for the sliding window, this machine issues
vLLM's calls -- ``new_step_starts``, ``get_computed_blocks``, ``allocate_slots`` per
align-mode prefill chunk and per decode token, ``free`` -- and after every call checks:

- **vLLM against the machine's account of its pool** (``MambaExpected``, an
  ``hybrid.vllm_machine.Expected`` whose second table is the Mamba one): each running
  request's two block tables (the Mamba one holding its running-state block, the block
  it resumed from until the next step frees it, and null blocks), the reference counts,
  the free queue in order, the hashes registered per group, and whether vLLM refuses an
  allocation (a hit on a state cached in the same step included, DEV-M7). Checked by
  ``hybrid.vllm_machine.pool_problems``: one partition of the shared pool (DEV-M5).
- **the Mamba model's rules on vLLM's state** (``abstract``: vLLM's pool as a
  ``MambaState``): INV-MAMBA-TREE-WELL-FORMED, INV-MAMBA-CONTENT and INV-MAMBA-LOCKS; every
  Mamba block cached under a hash holds the state after that hash's page, whether or not
  its full copy is cached (DEV-M6), and one whose full copy went is unreferenced; every
  running request's state block holds the state after what it computed; and every hit
  against the model's ``match_prefix`` and INV-MAMBA-MATCH-STATE.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hiradix.conformance.batches import ComponentCampaign, run_campaign_of
from hiradix.engines.vllm.hybrid import cdiv
from hiradix.engines.vllm.hybrid_machine import (
    MAX_TOKENS,
    Expected,
    Table,
    pool_problems,
    prompts,
)
from hiradix.engines.vllm.mamba import (
    FULL,
    MAMBA,
    MambaHit,
    MambaSetup,
    MambaView,
    VllmMamba,
)
from hiradix_model import Key
from hiradix_model import mamba as model
from hiradix_model.components import expected_kv
from hiradix_model.mamba import MambaPage, MambaState

# The model's invariants that hold on one shared pool as stated; the two per-pool
# partitions are replaced by ``pool_problems`` (DEV-M5).
SHARED_POOL_INVARIANTS = ("INV-MAMBA-TREE-WELL-FORMED", "INV-MAMBA-CONTENT",
                          "INV-MAMBA-LOCKS")
# What a campaign should reach; the summary lists the ones it did not.
REACH: tuple[str, ...] = ("hit", "hit_cut_to_state", "chunk_cut", "state_released", "evicted_full",
         "evicted_state", "state_without_full", "same_step_refused", "refused",
         "preempted", "finish")


# -- vLLM's pool as the model's state ---------------------------------------------------

def abstract(view: MambaView, setup: MambaSetup, adapter: VllmMamba) -> MambaState:
    """vLLM's pool as a ``MambaState`` (13m.8a): a page per hash registered in the full
    group, its primary block's slots as its full copy and the primary Mamba block of the
    same hash, if any, as its state (state slot = block id - 1; none: a tombstone);
    ``lock`` and ``state_lock`` are the reference counts of every block registered under
    the hash in that group (duplicates included). ``full_free``/``state_free`` are the
    free queue's blocks (read by no predicate checked here: ``pool_problems`` checks the
    shared pool, DEV-M5)."""
    pool = view.pool
    by_page: dict[tuple[int, Key], list[int]] = {}
    for block, seen in pool.blocks.items():
        if seen.page is not None and seen.group is not None:
            by_page.setdefault((seen.group, seen.page), []).append(block)
    pages: dict[Key, MambaPage] = {}
    for block, seen in pool.blocks.items():
        if seen.group != FULL or not seen.primary or seen.page is None:
            continue
        states = [b for b in by_page.get((MAMBA, seen.page), []) if pool.blocks[b].primary]
        pages[seen.page] = MambaPage(
            full=adapter.slots(block),
            state=states[0] - 1 if states else None,
            lock=sum(pool.blocks[b].ref_cnt for b in by_page[(FULL, seen.page)]),
            state_lock=sum(pool.blocks[b].ref_cnt
                           for b in by_page.get((MAMBA, seen.page), [])))
    return MambaState(
        config=setup.model_config(), pages=pages,
        full_free=frozenset(s for b in pool.queue for s in adapter.slots(b)),
        state_free=frozenset(b - 1 for b in pool.queue), held_full=frozenset(),
        held_states=frozenset(), full_kv=dict(pool.kv),
        state_kv={b - 1: k for b, k in view.states.items()})


def model_problems(state: MambaState) -> list[str]:
    return [f"{spec_id}: {v}" for spec_id in SHARED_POOL_INVARIANTS
            for v in model.MAMBA_INVARIANTS[spec_id](state)]


def cached_content_problems(view: MambaView, adapter: VllmMamba) -> Iterator[str]:
    """INV-MAMBA-CONTENT on every cached block, duplicates and orphans included: a full
    block holds the KV of its hash's page, a Mamba block the state after it; an orphan
    Mamba block (its full copy gone, DEV-M6) is unreferenced."""
    pool = view.pool
    full_pages = {v.page for v in pool.blocks.values() if v.group == FULL}
    for block, seen in sorted(pool.blocks.items()):
        if seen.page is None:
            continue
        if seen.group == MAMBA:
            if view.states.get(block) != seen.page:
                yield (f"INV-MAMBA-CONTENT: Mamba block {block} is cached as the state "
                       f"after {seen.page.tokens}; it holds {view.states.get(block)}")
            if seen.page not in full_pages and seen.ref_cnt:
                yield (f"DEV-M6: Mamba block {block} of {seen.page} has no full copy, "
                       f"ref_cnt {seen.ref_cnt}")
            continue
        for offset, slot in enumerate(adapter.slots(block)):
            if pool.kv.get(slot) != expected_kv(seen.page, offset, adapter.ps):
                yield (f"INV-MAMBA-CONTENT: full block {block} is cached as "
                       f"{seen.page.tokens}; slot {slot} holds {pool.kv.get(slot)}")


def running_problems(view: MambaView, tokens: Sequence[int], computed: int,
                     table: Sequence[int | None], page_size: int) -> Iterator[str]:
    """A running request resumes its next step from the block of its last computed
    token, which must hold the state after everything it computed (13m.4)."""
    if computed == 0:
        return
    block = table[cdiv(computed, page_size) - 1] if len(table) >= cdiv(
        computed, page_size) else None
    want = Key(tuple(tokens[:computed]))
    if block is None or view.states.get(block) != want:
        yield (f"a request {computed} tokens in resumes from Mamba block {block}, holding "
               f"{None if block is None else view.states.get(block)}")


def match_problems(state: MambaState, adapter: VllmMamba, tokens: Sequence[int],
                   hit: MambaHit) -> list[str]:
    """The hit against the model's ``match_prefix`` of all but the last token and
    INV-MAMBA-MATCH-STATE; the Mamba hit is null blocks and then the matched page's
    state block."""
    key = Key(tuple(tokens[:-1]))
    want = model.match_prefix(state, key)
    got = tuple(s for b in hit.full for s in adapter.slots(b))
    end = Key(tuple(tokens[:hit.tokens])) if hit.tokens else None
    problems = [f"{model.MATCH_INVARIANT}: {p}"
                for p in model.match_problems(state, key, end, hit.full_hit)]
    if (got, hit.tokens) != (want.full_slots, len(want.full_slots)):
        problems.append(f"hit {hit.tokens} tokens, full slots {got}; model "
                        f"{want.last_page} {want.full_slots}")
        return problems
    pages = len(hit.full)
    want_mamba: list[int | None] = [None] * pages
    if want.last_page is not None:
        slot = state.pages[want.last_page].state
        want_mamba[-1] = None if slot is None else slot + 1
    if list(hit.mamba) != want_mamba:
        problems.append(f"Mamba hit {list(hit.mamba)}, expected {want_mamba}")
    return problems


# -- the machine's own account of vLLM's pool ---------------------------------------------

@dataclass
class MambaExpected(Expected):
    """vLLM's pool as predicted, with MambaManager's per-request align bookkeeping
    (single_type_kv_cache_manager.py:1453-1467): whether a request was allocated blocks,
    the index of the state block it resumed from, and how many leading blocks it
    retired."""

    allocated: set[str] = field(default_factory=set)
    last_state: dict[str, int] = field(default_factory=dict)
    retired: dict[str, int] = field(default_factory=dict)

    def release_states(self, request_id: str, computed: int, page_size: int) -> int:
        """``remove_skipped_blocks`` (single_type_kv_cache_manager.py:1608-1657): the
        non-null blocks before index (computed - 1) // P, tail first, then the block it
        resumed from once the request is past it; the blocks freed."""
        table = self.tables[request_id].swa
        freed = 0
        skipped = min(max(0, computed - 1) // page_size, len(table)) if computed > 1 else 0
        first = self.retired.get(request_id, 0)
        if first < skipped:
            gone = [b for b in table[first:skipped][::-1] if b is not None]
            table[first:skipped] = [None] * (skipped - first)
            self.release(gone)
            freed += len(gone)
            self.retired[request_id] = skipped
        index = self.last_state.get(request_id)
        block = table[index] if index is not None else None
        if index is not None and block is not None and index < cdiv(computed, page_size) - 1:
            table[index] = None
            self.release([block])
            freed += 1
        return freed

    def new_state_blocks(self, request_id: str, tokens: int, page_size: int) -> int:
        """``allocate_new_blocks`` in align mode (:1797-1925) up to taking blocks: the
        table grows by null blocks to one short of cdiv(tokens, P); the blocks to take."""
        table = self.tables[request_id].swa
        required = cdiv(tokens, page_size)
        if required <= len(table):
            self.allocated.add(request_id)
            return 0
        if table:
            self.last_state[request_id] = len(table) - 1
        table.extend([None] * max(0, required - 1 - len(table)))
        self.allocated.add(request_id)
        return required - len(table)

    def forget(self, request_id: str) -> None:
        """``pop_blocks_for_free`` (:1952-1969) drops the align bookkeeping."""
        self.allocated.discard(request_id)
        self.last_state.pop(request_id, None)
        self.retired.pop(request_id, None)


# -- the machine ------------------------------------------------------------------------

def make_vllm_mamba_machine(setup: MambaSetup, reached: Counter[str] | None = None,
                            build: Callable[[MambaSetup], VllmMamba] = VllmMamba,
                            ) -> type[RuleBasedStateMachine]:
    """A machine class driving a fresh ``build(setup)`` per example; ``reached`` counts
    what the examples exercised."""
    seen = reached if reached is not None else Counter()
    ps = setup.page_size

    class VllmMambaMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.engine = build(setup)
            self.expected = MambaExpected(queue=list(range(1, setup.num_blocks + 1)))
            self.state = abstract(self.engine.observe_mamba(), setup, self.engine)
            self.this_step: set[Key] = set()  # pages whose state was cached this step
            seen["examples"] += 1
            self.check("the initial state")

        def teardown(self) -> None:
            self.engine.close()

        # -- checking -------------------------------------------------------------------
        def check(self, step: str) -> None:
            seen["checks"] += 1
            view = self.engine.observe_mamba()
            state = self.state = abstract(view, setup, self.engine)
            problems = list(pool_problems(view.pool, self.expected))
            problems += model_problems(state)
            problems += cached_content_problems(view, self.engine)
            for request_id, table in self.expected.tables.items():
                problems += running_problems(view, self.engine.tokens(request_id),
                                             self.engine.computed(request_id), table.swa, ps)
            assert not problems, f"after {step}:\n  " + "\n  ".join(problems)
            seen["state_without_full"] += any(
                v.group == MAMBA and v.page not in state.pages for v in view.pool.blocks.values())

        def new_step(self) -> None:
            self.engine.step()
            self.this_step.clear()

        def taken(self, blocks: Sequence[int]) -> None:
            """Count the cached blocks an allocation took (lazy eviction)."""
            for block in blocks:
                group = self.expected.registered.get(block, (None,))[0]
                seen["evicted_full" if group == FULL else "evicted_state"] += (
                    group is not None)

        def allocate(self, request_id: str, num_new: int, hit: MambaHit | None) -> bool:
            """One ``allocate_slots`` and its prediction; whether vLLM allocated."""
            expected = self.expected
            table = expected.tables[request_id]
            computed = self.engine.computed(request_id) + (hit.tokens if hit else 0)
            if hit is None and expected.release_states(request_id, computed, ps):
                seen["state_released"] += 1
            needed = cdiv(computed + num_new, ps)
            new_full = max(0, needed - len(table.full))
            new_mamba = min(1, needed - len(table.swa))
            touched = [] if hit is None else [b for b in (*hit.full, *hit.mamba)
                                              if b is not None and b in expected.queue]
            same_step = hit is not None and hit.tokens > 0 and (
                Key(tuple(self.engine.tokens(request_id)[:hit.tokens])) in self.this_step)
            refuse = same_step or new_full + max(0, new_mamba) + len(touched) > len(
                expected.queue)
            got = self.engine.schedule_mamba(request_id, num_new, hit)
            assert (got is None) == refuse, (
                f"allocate_slots({num_new}) {'refused' if got is None else 'allocated'}: "
                f"{new_full} + {new_mamba} new blocks, {len(touched)} touched, "
                f"{len(expected.queue)} free, same step {same_step}")
            if got is None:
                seen["same_step_refused"] += same_step
                return False
            expected.touch(touched)
            grown = len(table.swa)
            taking = new_full + expected.new_state_blocks(request_id, computed + num_new, ps)
            self.taken(expected.queue[:taking])
            want_full = expected.take(new_full)
            table.full += want_full
            table.swa += expected.take(taking - new_full)
            # vLLM returns the Mamba table's new tail, the null blocks it padded included
            want = (tuple(want_full), tuple(table.swa[grown:]))
            assert got == want, (f"allocate_slots({num_new}) returned {got}, expected {want} "
                                 f"(null blocks as None)")
            before = set(expected.registered)
            tokens = self.engine.tokens(request_id)
            expected.register(request_id, tokens, min(computed + num_new, len(tokens)), ps)
            self.this_step |= {page for block, (group, page) in expected.registered.items()
                               if group == MAMBA and block not in before}
            return True

        def free(self, request_id: str) -> None:
            table = self.expected.tables.pop(request_id)
            self.engine.free(request_id)
            self.expected.forget(request_id)
            self.expected.release(table.full[::-1])
            self.expected.release([b for b in table.swa[::-1] if b is not None])

        # -- rules ----------------------------------------------------------------------
        @rule(prompt=prompts, chunk=st.integers(1, 8), same_step=st.booleans())
        def admit(self, prompt: tuple[int, ...], chunk: int, same_step: bool) -> None:
            """A waiting request: the hit, then its first prefill chunk (in the step of
            the last call if ``same_step``)."""
            if not same_step:
                self.new_step()
            request_id = self.engine.new_request(prompt)
            hit = self.engine.lookup_hit(request_id)
            problems = match_problems(self.state, self.engine, prompt, hit)
            assert not problems, f"get_computed_blocks({prompt}):\n  " + "\n  ".join(problems)
            seen["hit"] += bool(hit.tokens)
            seen["hit_cut_to_state"] += hit.tokens < hit.full_hit
            wanted = min(chunk, len(prompt) - hit.tokens)
            num_new = self.engine.aligned_chunk(request_id, wanted, hit.tokens)
            seen["chunk_cut"] += num_new < wanted
            if num_new == 0:  # the scheduler leaves it waiting; it never ran
                self.engine.free(request_id)
                return
            self.expected.tables[request_id] = Table(list(hit.full), list(hit.mamba))
            if not self.allocate(request_id, num_new, hit):
                seen["refused"] += 1
                del self.expected.tables[request_id]
                self.expected.forget(request_id)
                self.engine.free(request_id)  # the scheduler drops a request it never ran
            self.check(f"admit({prompt}, chunk {chunk}) after a hit of {hit.tokens} tokens")

        @precondition(lambda self: bool(self.expected.tables))
        @rule(index=st.integers(0, 63), chunk=st.integers(1, 8), token=st.integers(1, 3))
        def advance(self, index: int, chunk: int, token: int) -> None:
            """One scheduler step of a running request: an aligned prefill chunk, else a
            decode token; a request the pool cannot hold is preempted (freed)."""
            self.new_step()
            request_id = sorted(self.expected.tables, key=int)[index % len(self.expected.tables)]
            left = self.engine.prompt_left(request_id)
            if not left:
                if len(self.engine.tokens(request_id)) >= MAX_TOKENS:
                    self.finish_request(request_id)
                    return
                self.engine.append_token(request_id, token)
            num_new = self.engine.aligned_chunk(request_id, min(chunk, left) if left else 1)
            seen["chunk_cut"] += bool(left) and num_new < min(chunk, left)
            if num_new == 0:
                return
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

    VllmMambaMachine.__name__ = f"VllmMambaMachine_{ps}_{setup.num_blocks}"
    return VllmMambaMachine


# -- a bounded campaign ------------------------------------------------------------------

def vllm_mamba_setups(page_sizes: Sequence[int]) -> list[MambaSetup]:
    """Pools of 8 and 14 blocks, so that allocations run short and both full blocks and
    states get evicted."""
    return [MambaSetup(page_size=ps, num_blocks=blocks) for ps in page_sizes
            for blocks in (8, 14)]


class VllmMambaCampaign(ComponentCampaign):
    components = "(FULL, MAMBA)"
    reach = REACH


def run_vllm_mamba_campaign(page_sizes: Sequence[int], *, until: float,
                            examples: int | None = None, steps: int = 30, batch: int = 3,
                            seeded: int | None = None,
                            clock: Callable[[], float] = time.monotonic,
                            build: Callable[[MambaSetup], VllmMamba] = VllmMamba,
                            ) -> VllmMambaCampaign:
    """Batches of ``batch`` examples cycling through the setups until ``until`` (or
    ``examples`` ran); stops at the first failure (``batches.run_batches``)."""
    def machine(setup: object, reached: Counter[str]) -> type[RuleBasedStateMachine]:
        assert isinstance(setup, MambaSetup)
        return make_vllm_mamba_machine(setup, reached, build)

    return run_campaign_of(VllmMambaCampaign("vllm-mamba"), vllm_mamba_setups(page_sizes),
                           machine, until=until, examples=examples, steps=steps, batch=batch,
                           seeded=seeded, clock=clock)
