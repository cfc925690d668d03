"""Shrunk sequences the conformance suite produced while it was built, kept as tests.

Each is the reproducer `hiradix check` printed for a deliberately injected bug (named in
the test); on the real implementation every one of them must pass.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from hiradix._slots import PageAllocator
from hiradix.cache import HiRadixCache
from hiradix.clock import ManualClock
from hiradix.conformance.machine import make_machine
from hiradix.conformance.scenario import Scenario
from hiradix.conformance.storage_machine import make_storage_machine
from hiradix.conformance.tally import Tally
from hiradix.errors import InvalidArgument, InvariantViolation, SlotError
from hiradix.keys import RadixKey
from hiradix.storage.tier import TierSettings
from hiradix.transfer import ControlledCopyEngine


def test_backup_of_a_node_whose_parent_has_no_host_copy() -> None:
    # Injected bug: write_backup backed up the node alone, skipping the parent check.
    state = make_machine(Scenario(page_size=2, write_policy="write_through_selective",
                                  eviction="lfu", host_layout="page_first"))()
    state.request(chunked=False, dt=0, keep_lock=False, namespace=None, priority=0,
                  quota=None, tokens=(1, 1))
    state.refines_the_model()
    state.request(chunked=True, dt=0, keep_lock=False, namespace=None, priority=0,
                  quota=None, tokens=(1, 1, 1, 1))
    state.refines_the_model()
    state.write_backup(index=1)
    state.refines_the_model()
    assert [n.host is not None for n in state.cache.nodes()] == [True, True]
    state.teardown()


def test_load_back_protects_its_host_source() -> None:
    # Injected bug: load_back did not protect the chain's host copies while in flight.
    state = make_machine(Scenario(page_size=2, write_policy="write_back", eviction="slru",
                                  host_layout="page_first", kv_layout="mla"))()
    state.request(chunked=False, dt=0, keep_lock=False, namespace=None, priority=0,
                  quota=None, tokens=(1, 1))
    state.evict(num_tokens=1)
    state.load_back(index=0, quota=None)
    state.refines_the_model()
    assert state.cache.nodes()[0].host_ref == 1
    state.finish_copies(direction="h2d", count=1)
    state.loading_check()
    state.refines_the_model()
    assert state.cache.nodes()[0].host_ref == 0
    state.teardown()


def test_a_load_protects_its_host_pages_before_it_makes_room() -> None:
    # Injected bug: load_back protected its chain's host pages only after making room on
    # the device, so that the write_back victims' copies to a full host evicted a page the
    # load was about to read (torch.cat of no sources). Shrunk by pytest (issue 15).
    state = make_machine(Scenario(page_size=4, write_policy="write_back", eviction="lru",
                                  host_layout="layer_first", kv_layout="mla"))()
    state.swarm(seed=1)
    state.evict(num_tokens=0)
    state.grow_branches(evict_host_pages=0, namespace=None, stem_pages=2, tail_pages=2,
                        tails=[1, 2, 3])
    state.refines_the_model()
    state.request_again(evict_first=0, index=0, quota=None, settle=False)
    state.refines_the_model()
    state.scrambled_insert_slots(how="interleaved", namespace=None, tokens=(1, 1, 1, 1))
    state.refines_the_model()
    state.load_back(index=0, leaf=False, quota=None)
    state.refines_the_model()
    state.teardown()


def test_backup_source_stays_locked_until_acknowledged() -> None:
    # Injected bug: the backup's source node was not locked, so it could be evicted (and
    # its slots reused) while the copy was in flight.
    state = make_machine(Scenario(page_size=2, write_policy="write_through_selective",
                                  eviction="lfu", kv_layout="mla"))()
    state.request(chunked=False, dt=0, keep_lock=False, namespace=None, priority=0,
                  quota=None, tokens=(1, 1))
    state.write_backup(index=0)
    state.refines_the_model()
    assert state.cache.evict(2) == 0  # pinned by the copy in flight
    state.refines_the_model()
    state.teardown()


def test_split_of_a_node_whose_load_is_in_flight() -> None:
    # A match that splits the node being loaded must keep the copy's bookkeeping exact.
    state = make_machine(Scenario(page_size=1, write_policy="write_through"))()
    state.request(chunked=False, dt=1, keep_lock=False, namespace=None, priority=0,
                  quota=None, tokens=(1, 2, 3, 4))
    state.finish_copies(direction="d2h", count=1)
    state.writing_check()
    state.evict(num_tokens=4)
    state.load_back(index=0, quota=None)
    state.refines_the_model()
    state.request(chunked=False, dt=1, keep_lock=False, namespace=None, priority=0,
                  quota=None, tokens=(1, 2, 9))  # splits the loading node at 2
    state.refines_the_model()
    assert len(state.cache.nodes()) == 3  # (1, 2) / (3, 4) / (9,)
    state.finish_copies(direction="h2d", count=1)
    state.loading_check()
    state.finish_copies(direction="d2h", count=1)  # the backup of (9,)
    state.writing_check()
    state.refines_the_model()
    assert all(n.host_ref == 0 and n.lock_ref == 0 for n in state.cache.nodes())
    state.teardown()


# -- issue 16: caller slots that are not whole pages in order (spec/03, R7) -------------
# Found while profiling, not by the suite; the machine's scrambled_insert_slots rule now
# finds it (on the old cache.py it shrinks to a one-token insert into slot 1 at P = 2).

def _snapshot(cache: HiRadixCache) -> tuple[object, ...]:
    """What an insert could change: the tree, both free lists, the counters, the copies."""
    nodes = tuple((n.namespace, n.tokens, None if n.device is None else n.device.tolist(),
                   None if n.host is None else n.host.tolist(), n.lock_ref, n.hits)
                  for n in cache.nodes())
    return (nodes, cache.device_pool.free_slots(), cache.host_pool.free_slots(),
            cache.evictable_tokens, cache.protected_tokens,
            tuple(len(q) for q in cache.pending.values()))


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_interleaved_insert_slots_are_rejected_before_anything_changes(policy: str) -> None:
    # Issue 16: insert accepted [0, 2, 1, 3] at page size 2, so the node's device slots
    # were half of page 0 and half of page 1. Eviction then released "page 0" twice:
    # under write_back the allocator's assertion fired; under write_through page 0 went
    # onto the free list twice and page 1 leaked.
    cache = Scenario(page_size=2, write_policy=policy).build(ManualClock(), None)  # type: ignore[arg-type]
    held = cache.device_pool.alloc(4)
    assert held is not None and held.tolist() == [0, 1, 2, 3]
    before = _snapshot(cache)
    rejected = None
    try:
        cache.insert(RadixKey((1, 2, 3, 4)), torch.tensor([0, 2, 1, 3], dtype=torch.int64))
    except InvalidArgument as error:
        rejected = error
    engine = cache.engine
    assert isinstance(engine, ControlledCopyEngine)
    engine.complete("d2h", engine.queued("d2h"))  # a write-through backup lands first
    cache.writing_check()
    cache.evict(4)  # today's main: AssertionError in PageAllocator.release (write_back)
    cache.check_invariants()
    pool = cache.device_pool  # today's main, write_through: page 0 on the free list twice
    assert pool.num_free_slots == len(pool.free_slots()), "a page was freed twice"
    assert rejected is not None, "insert accepted slots that are not whole pages in order"
    assert rejected.argument == "slots[1]" and "page" in rejected.reason
    assert _snapshot(cache) == before
    cache.device_pool.free(held)  # the caller still holds both pages, whole
    assert cache.device_pool.num_free_slots == cache.device_pool.num_slots


def test_partial_tail_page_must_start_its_page() -> None:
    # The tail (tokens past the last whole page) is the first slots of one page, in order.
    cache = Scenario(page_size=4).build(ManualClock(), None)
    held = cache.device_pool.alloc(8)
    assert held is not None
    before = _snapshot(cache)
    with pytest.raises(InvalidArgument, match=r"^slots\[4\]"):
        cache.insert(RadixKey((1, 2, 3, 4, 5, 6)),
                     torch.tensor([0, 1, 2, 3, 5, 6], dtype=torch.int64))
    assert _snapshot(cache) == before
    cache.insert(RadixKey((1, 2, 3, 4, 5, 6)), torch.tensor([4, 5, 6, 7, 0, 1]))
    cache.check_invariants()


def test_a_page_repeated_within_one_free_or_release() -> None:
    # #10: a double free inside one call must raise, like a double free across calls.
    allocator = PageAllocator(8, 2)
    slots = allocator.alloc(4)
    assert slots is not None and slots.tolist() == [0, 1, 2, 3]
    with pytest.raises(SlotError, match="more than once"):
        allocator.free(torch.tensor([0, 1, 0, 1], dtype=torch.int64))
    assert allocator.num_free_slots == 4  # the checked path changed nothing
    with pytest.raises(AssertionError):
        allocator.release(torch.tensor([2, 3, 2, 3], dtype=torch.int64))
    with pytest.raises(AssertionError):
        allocator.release(torch.tensor([0, 2, 1, 3], dtype=torch.int64))  # not whole pages
    assert allocator.num_free_slots == 4
    allocator.release(slots)
    assert allocator.num_free_slots == 8


def test_a_copy_out_of_page_order_is_found_by_check_invariants_not_release() -> None:
    # #13: release checks page heads only (their counts find a run that starts no
    # page, a page twice, a free page); the slots behind a head are the audit's.
    cache = Scenario(page_size=4).build(ManualClock(), None)
    slots = cache.device_pool.alloc(8)
    assert slots is not None and slots.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    cache.insert(RadixKey(tuple(range(1, 9))), slots)
    cache.check_invariants()
    node = cache.nodes()[0]
    assert node.device is not None
    node.device = node.device[[0, 1, 3, 2, 4, 5, 6, 7]]  # a slip: same pages, same slots
    with pytest.raises(InvariantViolation) as raised:
        cache.check_invariants()
    assert raised.value.spec_id == "INV-TREE-WELL-FORMED"
    assert "not whole pages in order" in str(raised.value)
    allocator = PageAllocator(8, 4)
    taken = allocator.alloc(8)
    assert taken is not None
    allocator.release(taken[[0, 1, 3, 2, 4, 5, 6, 7]])  # heads 0 and 4: accepted
    assert allocator.num_free_slots == 8


# -- issue 17: tensors handed across the API are the other side's to reuse ---------------

def test_the_caller_may_reuse_what_init_load_back_returned() -> None:
    # The machine's scribble rule found it: the caller writes into the returned slots
    # (its next batch's buffer) and the h2d copy in flight moved with them.
    state = make_machine(Scenario(page_size=1, write_policy="write_through"))()
    state.request(chunked=False, dt=1, keep_lock=False, namespace=None, priority=0,
                  quota=None, tokens=(1, 2))
    state.finish_copies(direction="d2h", count=1)
    state.writing_check()
    state.evict(num_tokens=2)
    state.refines_the_model()
    node = next(n for n in state.cache.nodes() if n.device is None)
    loaded, _ = state.cache.init_load_back(node)
    assert loaded.numel() == 2
    loaded.add_(1)  # the caller's buffer, reused
    state.cache.check_invariants()


# -- issue 15: storage-tier bugs planted by hand, kept as deterministic reproducers ------

TOKENS = (1, 2, 3, 1, 2, 3, 1, 2)


def _storage_machine(tally: Tally) -> Any:
    return make_storage_machine(Scenario(), tally, Counter())()


def test_a_prefetch_times_out_while_its_io_runs() -> None:
    # Planted bug: check_prefetch_progress waited for a running I/O under the timeout
    # policy (returned False) although the timeout had passed.
    tally = Tally()
    state = _storage_machine(tally)
    state.reattach(settings=TierSettings(prefetch_threshold=0, prefetch_policy="timeout",
                                         timeout_base=0, timeout_per_ki_token=0,
                                         timeout_max=0, prefetch_token_limit=100))
    state.cycle(request="r0", index=0, evict=24, use_anchor=False, dt=1, run=False,
                fresh=(TOKENS, None), fetch_fault=None)
    state.refines_the_model()
    assert tally.ops["progress: timed out while the I/O ran"] >= 1, dict(tally.ops)
    state.teardown()


def test_a_revoked_prefetch_gives_up_its_slots_once_and_ends() -> None:
    # Planted bugs: the drain left a revoked prefetch in place (never ended), and a
    # prefetch's slots queued for release stayed counted as its own (released twice).
    tally = Tally()
    state = _storage_machine(tally)
    state.request(tokens=TOKENS, namespace=None, dt=0, chunked=False, priority=0,
                  keep_lock=False, quota=None)
    state.refines_the_model()
    state.prefetch(request="r0", index=0, use_anchor=False, dt=0)  # nothing stored yet
    state.refines_the_model()
    state.run_io()
    state.refines_the_model()
    assert tally.states["prefetch revoked, queued"] >= 1, dict(tally.states)
    state.drain()
    state.refines_the_model()
    assert not state.tier.state.prefetches
    state.teardown()


def test_a_write_back_victim_with_a_protected_page_below_stays() -> None:
    # Planted bug: write_back eviction, with no host room, dropped a device leaf whose
    # host-only child was protected by a storage write in flight (spec/09 S-R5).
    tally = Tally()
    state = make_storage_machine(Scenario(write_policy="write_back", host_pages=1), tally,
                                 Counter())()
    state.request(tokens=(1, 2, 3, 1), namespace=None, dt=1, chunked=False, priority=0,
                  keep_lock=False, quota=None)
    state.evict(num_tokens=2)  # (3, 1) to host, the host full, its write to storage queued
    state.refines_the_model()
    assert tally.states["host pages all protected"] >= 1, dict(tally.states)
    state.evict(num_tokens=2)  # (1, 2): no host room, S-R5 keeps it on device
    state.refines_the_model()
    assert [n.device is not None for n in state.cache.nodes()] == [True, False]
    state.teardown()


@pytest.mark.parametrize(("rest", "argument", "reason"), [
    ([4, 6, 5, 7, 8], "slots[5]", "not one page's slots in order"),  # interleaved
    ([5, 6, 8, 9, 10], "slots[4]", "not at a page start"),  # a run across two pages
    ([0, 1, 8, 9, 10], "slots[4]", "neither held by the caller"),  # a node's page
    ([4, 5, 4, 5, 8], "slots", "holds a slot twice"),  # the caller's page twice
    ([12, 13, 8, 9, 10], "slots[4]", "neither held by the caller"),  # a free page
])
def test_the_slots_past_a_cached_prefix_are_checked_as_the_whole_insert_was(
        rest: list[int], argument: str, reason: str) -> None:
    # Issue 13: insert checks R7 and the caller's hold past the cache's own prefix only
    # (a node's slots are whole pages in order). Past it, every error is still found, at
    # its position in the whole argument, and the cache is left as it was.
    cache = Scenario(page_size=2, device_pages=8).build(ManualClock(), None)
    first = cache.device_pool.alloc(4)
    assert first is not None and first.tolist() == [0, 1, 2, 3]
    cache.insert(RadixKey((1, 2, 3, 4)), first)
    held = cache.device_pool.alloc(6)
    assert held is not None and held.tolist() == [4, 5, 6, 7, 8, 9]
    key = RadixKey((1, 2, 3, 4, 5, 6, 7, 8, 9))
    own = cache.match_prefix(key).device_slots
    assert own.tolist() == [0, 1, 2, 3]
    before = _snapshot(cache)
    with pytest.raises(InvalidArgument) as caught:
        cache.insert(key, torch.cat([own, torch.tensor(rest, dtype=torch.int64)]))
    assert (caught.value.argument, reason in caught.value.reason) == (argument, True), \
        caught.value
    assert _snapshot(cache) == before
    # The same rest after the caller's own duplicate of the prefix (the general check).
    assert cache.insert(key, torch.cat([own, held[:4], held[4:5]])) == 4
    cache.check_invariants()
