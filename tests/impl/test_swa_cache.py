"""The (FULL, SWA) hybrid cache (spec/13) on hand-built cases: tombstones, healing, the
match window rule, exact lock windows, both evictions, the full->SWA mapping, and typed
errors that leave the cache unchanged."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hiradix.clock import ManualClock
from hiradix.config import KVShape
from hiradix.engines.ours.swa import build
from hiradix.errors import (
    ConfigError,
    ForeignNode,
    InvalidArgument,
    InvariantViolation,
    NotLocked,
    SlotError,
)
from hiradix.hybrid import NO_PAIR, SwaCache, SwaNode
from hiradix_model import Key
from hiradix_model.hybrid import SwaConfig

KV = KVShape(layers=2, heads=1, head_dim=1, dtype=torch.float32)


def make(page_size: int = 1, full_slots: int = 16, swa_slots: int = 8, window: int = 2,
         clock: ManualClock | None = None) -> SwaCache:
    tick = clock or ManualClock(1)
    return SwaCache(page_size=page_size, full_slots=full_slots, swa_slots=swa_slots,
                    window=window, clock=tick.now, kv=KV)


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def request(cache: SwaCache, tokens: tuple[int, ...], swa_evicted: int = 0) -> int:
    """A request's life up to insert (13.4): alloc, free_swa of the first swa_evicted
    tokens, insert; the duplicates freed. Returns insert's prefix."""
    full = cache.alloc(len(tokens))
    assert full is not None
    if swa_evicted:
        cache.free_swa(full[:swa_evicted])
    prefix = cache.insert(tokens, full, swa_evicted)
    kept = [s for s in full.tolist() if not cache.pools.owned.tensor[s]]
    if kept:
        cache.free(torch.tensor(kept, dtype=torch.int64))
    cache.check_invariants()
    return prefix


def pages(cache: SwaCache) -> dict[tuple[int, ...], tuple[list[int], list[int] | None, int, int]]:
    """Per page (keyed by its prefix): full slots, SWA slots or None, lock, swa_lock."""
    out: dict[tuple[int, ...], tuple[list[int], list[int] | None, int, int]] = {}
    ps = cache.page_size
    for node in cache.tree.nodes():
        prefix = node.prefix()
        base = len(prefix) - len(node.tokens)
        for start in range(0, len(node.tokens), ps):
            swa = None if node.swa is None else node.swa[start:start + ps].tolist()
            out[prefix[:base + start + ps]] = (node.full[start:start + ps].tolist(), swa,
                                               node.lock_ref, node.swa_lock_ref)
    return out


def live_pages(cache: SwaCache) -> set[tuple[int, ...]]:
    return {k for k, v in pages(cache).items() if v[1] is not None}


def snapshot(cache: SwaCache) -> str:
    pools = cache.pools
    return (cache.dump() + repr(sorted(pools.full.free_slots()))
            + repr(sorted(pools.swa.free_slots())) + repr(pools.mapping.tolist())
            + repr(pools.owned.tensor.nonzero().view(-1).tolist())
            + repr(pools.full.kv.tolist()) + repr(pools.swa.kv.tolist()))


# -- alloc and the mapping ---------------------------------------------------------------

def test_alloc_pairs_pages_and_sets_the_mapping() -> None:
    cache = make(page_size=2, full_slots=8, swa_slots=4)
    full = cache.alloc(4)
    assert full is not None and full.tolist() == [0, 1, 2, 3]
    assert cache.pools.mapping[:4].tolist() == [0, 1, 2, 3]
    before = snapshot(cache)
    assert cache.alloc(2) is None  # the SWA pool is empty: no change to either pool
    assert snapshot(cache) == before
    cache.check_invariants()


def test_mapping_cleared_on_free_swa_free_and_tombstoning() -> None:
    cache = make(page_size=1, window=1)
    full = cache.alloc(3)
    assert full is not None
    cache.free_swa(full[:1])
    assert cache.pools.mapping[:3].tolist() == [NO_PAIR, 1, 2]
    assert 0 in cache.pools.swa.free_slots()
    cache.free(full[1:2])
    assert cache.pools.mapping[:3].tolist() == [NO_PAIR, NO_PAIR, 2]
    assert {0, 1} <= cache.pools.swa.free_slots() and 1 in cache.pools.full.free_slots()
    cache.free(full[0:1])  # no SWA half left: only the full slot goes back
    cache.check_invariants()
    # a tombstoned page drops its entry
    request(cache, (1, 2))
    pair = cache.pools.mapping.clone()
    node = cache.match_prefix((1, 2)).last_node
    cache.inc_lock_ref(node)
    assert cache.evict_swa(1) == 1  # page (1,) is outside the window of (1, 2): tombstoned
    first = cache.node_at((1,))
    assert first is not None and not first.live
    assert cache.pools.mapping[first.full].tolist() == [NO_PAIR]
    assert int(pair[first.full][0]) != NO_PAIR
    cache.check_invariants()


def test_write_kv_writes_both_halves_while_the_pair_has_one() -> None:
    cache = make(page_size=1)
    full = cache.alloc(2)
    assert full is not None
    cache.free_swa(full[:1])
    values = torch.tensor([7.0, 9.0]).view(1, 2, 1, 1, 1).expand(2, 2, 2, 1, 1).contiguous()
    cache.write_kv(full, values)
    assert cache.read_full(full)[0, :, 0, 0, 0].tolist() == [7.0, 9.0]
    assert cache.read_swa(cache.pools.halves(full[1:]))[0, :, 0, 0, 0].tolist() == [9.0]
    assert cache.read_swa(slots(0))[0, 0, 0, 0, 0].item() == 0.0  # the dropped half: untouched


# -- insert: tombstones, duplicates, healing ---------------------------------------------

def test_insert_makes_tombstones_before_swa_evicted() -> None:
    cache = make(page_size=2, full_slots=16, swa_slots=16, window=2)
    assert request(cache, (1, 2, 3, 4, 5, 6), swa_evicted=4) == 0
    got = pages(cache)
    assert got[(1, 2)][1] is None and got[(1, 2, 3, 4)][1] is None
    assert got[(1, 2, 3, 4, 5, 6)] == ([4, 5], [4, 5], 0, 0)
    assert cache.pools.mapping[:6].tolist() == [NO_PAIR] * 4 + [4, 5]


def test_duplicates_stay_the_callers() -> None:
    cache = make(page_size=1, window=4)
    request(cache, (1, 2))
    full = cache.alloc(3)
    assert full is not None
    assert cache.insert((1, 2, 3), full, 0) == 2
    assert cache.pools.owned.tensor[full].tolist() == [False, False, True]
    assert pages(cache)[(1, 2)][0] == [1]  # the cached page kept its own slot
    cache.free(full[:2])
    cache.check_invariants()


def test_healing_takes_the_callers_pair_and_frees_the_old_full_slots() -> None:
    cache = make(page_size=1, full_slots=16, swa_slots=8, window=1)
    request(cache, (1, 2, 3), swa_evicted=2)  # (1,), (1, 2) tombstones on slots 0, 1
    assert live_pages(cache) == {(1, 2, 3)}
    full = cache.alloc(3)  # slots 3, 4, 5; SWA halves 3, 4, 5
    assert full is not None
    cache.free_swa(full[:1])
    # swa_evicted=1: (1,) stays a tombstone (a duplicate), (1, 2) heals, (1, 2, 3) is live
    assert cache.insert((1, 2, 3), full, 1) == 3
    got = pages(cache)
    assert got[(1,)] == ([0], None, 0, 0)
    assert got[(1, 2)] == ([4], [int(cache.pools.mapping[4])], 0, 0)
    assert got[(1, 2, 3)] == ([2], [2], 0, 0)
    assert 1 in cache.pools.full.free_slots()  # the healed page's old full slot
    assert cache.pools.owned.tensor[full].tolist() == [False, True, False]
    cache.free(full[torch.tensor([0, 2])])
    cache.check_invariants()
    assert cache.match_prefix((1, 2)).full_slots.tolist() == [0, 4]


def test_healing_splits_a_tombstone_node_at_swa_evicted() -> None:
    cache = make(page_size=2, full_slots=16, swa_slots=16, window=2)
    request(cache, (1, 2, 3, 4, 5, 6), swa_evicted=6)  # one tombstone node of 3 pages
    full = cache.alloc(6)
    assert full is not None
    cache.free_swa(full[:2])
    assert cache.insert((1, 2, 3, 4, 5, 6), full, 2) == 6
    got = pages(cache)
    assert got[(1, 2)][1] is None
    assert got[(1, 2, 3, 4)][0] == full[2:4].tolist() and got[(1, 2, 3, 4)][1] is not None
    assert live_pages(cache) == {(1, 2, 3, 4), (1, 2, 3, 4, 5, 6)}
    cache.free(full[:2])
    cache.check_invariants()


def test_healing_a_locked_tombstone_keeps_its_full_slots() -> None:
    cache = make(page_size=1, full_slots=16, swa_slots=8, window=1)
    request(cache, (1, 2), swa_evicted=1)  # (1,) a tombstone on full slot 0
    cache.inc_lock_ref(cache.match_prefix((1, 2)).last_node)  # locks the path: (1,) too
    full = cache.alloc(1)
    assert full is not None
    half = int(cache.pools.mapping[full[0]])
    assert cache.insert((1,), full, 0) == 1
    assert pages(cache)[(1,)] == ([0], [half], 1, 0)  # its own full slot, the caller's half
    assert cache.pools.mapping[0].item() == half
    assert cache.pools.mapping[full].tolist() == [NO_PAIR]  # the caller's, without a half
    assert not bool(cache.pools.owned.tensor[full].any())
    cache.free(full)
    cache.check_invariants()


def test_insert_takes_the_matched_pages_own_slots() -> None:
    cache = make(page_size=1, window=4)
    request(cache, (1, 2))
    matched = cache.match_prefix((1, 2, 3))
    more = cache.alloc(1)
    assert more is not None
    assert cache.insert((1, 2, 3), torch.cat([matched.full_slots, more]), 0) == 2
    assert pages(cache)[(1, 2, 3)][0] == more.tolist()
    cache.check_invariants()
    extra = cache.alloc(1)
    assert extra is not None
    before = snapshot(cache)
    with pytest.raises(SlotError, match=r"full_slots: slot 1 .* cached page's"):
        cache.insert((1, 2, 3, 4), torch.cat([slots(1, 0), more, extra]), 0)
    assert snapshot(cache) == before


# -- match_prefix: the window rule ---------------------------------------------------------

def build_chain(window: int, tombstones: set[int], depth: int = 5) -> SwaCache:
    """P=1 pages 1..depth along (1, 2, ..., depth), exactly ``tombstones`` (depths) dead:
    the healing insert of 13.3 builds them from the bottom up."""
    cache = make(page_size=1, full_slots=32, swa_slots=32, window=window)
    request(cache, tuple(range(1, depth + 1)), swa_evicted=depth)  # all tombstones
    for d in range(1, depth + 1):
        if d in tombstones:
            continue
        full = cache.alloc(d)
        assert full is not None
        if d > 1:  # the pages above are cached: their pairs are duplicates
            cache.free_swa(full[:d - 1])
        cache.insert(tuple(range(1, d + 1)), full, d - 1)
        if d > 1:
            cache.free(full[:d - 1])
    assert {len(k) for k in pages(cache) if pages(cache)[k][1] is None} == tombstones
    cache.check_invariants()
    return cache


@pytest.mark.parametrize(("window", "tombstones", "key", "expected_depth"), [
    (2, set(), 5, 5),
    (2, {2}, 5, 5),  # window of 5 is {4, 5}: live
    (2, {2}, 3, 1),  # window of 3 is {2, 3}: 2 dead; 2 itself dead; 1's window {1}: live
    (2, {4}, 4, 3),  # the key's last page is a tombstone: back to 3 (window {2, 3})
    (2, {4}, 5, 3),  # 5's window {4, 5} holds the tombstone 4: 3 it is
    (3, {1}, 5, 5),
    (3, {1}, 3, 0),  # every window up to 3 reaches page 1: the root
    (1, {3, 4}, 5, 5),  # W=1: a page's window is itself
    (1, {5}, 5, 4),
    (3, {3}, 5, 2),  # the windows of 5 and 4 both hold the tombstone 3; 2's is {1, 2}
])
def test_match_window_rule(window: int, tombstones: set[int], key: int,
                           expected_depth: int) -> None:
    cache = build_chain(window, tombstones)
    found = cache.match_prefix((*range(1, key + 1), 99))
    assert len(found.full_slots) == expected_depth
    if expected_depth:
        assert found.last_node.prefix() == tuple(range(1, expected_depth + 1))
    else:
        assert found.last_node is cache.root
    cache.check_invariants()


def test_match_splits_a_node_only_to_end_at_the_answer() -> None:
    cache = make(page_size=2, full_slots=16, swa_slots=16, window=2)
    request(cache, (1, 2, 3, 4, 5, 6))
    found = cache.match_prefix((1, 2, 3, 4, 9, 9))
    assert found.full_slots.tolist() == [0, 1, 2, 3]
    assert found.last_node.tokens == (1, 2, 3, 4)
    assert [n.tokens for n in found.last_node.children.values()] == [(5, 6)]
    cache.check_invariants()


# -- locks: exact windows ---------------------------------------------------------------

def test_lock_window_splits_at_the_window_edge() -> None:
    cache = make(page_size=2, full_slots=16, swa_slots=16, window=3)  # WP = 2 pages
    request(cache, (1, 2, 3, 4, 5, 6, 7, 8))  # one node of 4 pages
    node = cache.match_prefix((1, 2, 3, 4, 5, 6, 7, 8)).last_node
    cache.inc_lock_ref(node)
    got = pages(cache)
    assert [got[k][2:] for k in sorted(got, key=len)] == [(1, 0), (1, 0), (1, 1), (1, 1)]
    assert node.tokens == (5, 6, 7, 8)  # the handle keeps the lower part
    cache.check_invariants()
    # only the two pages outside the window can lose their SWA copies
    assert cache.evict_swa(100) == 4
    assert live_pages(cache) == {(1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 6, 7, 8)}
    cache.dec_swa_lock(node)
    assert all(v[3] == 0 for v in pages(cache).values())
    with pytest.raises(NotLocked, match="node"):
        cache.dec_swa_lock(node)
    assert cache.evict_swa(2) == 2  # the locked leaf becomes a tombstone, not deleted
    assert len(pages(cache)) == 4
    cache.dec_lock_ref(node, True)
    cache.check_invariants()
    assert all(v[2] == 0 for v in pages(cache).values())


def test_each_lock_releases_its_window_once() -> None:
    """Two locks at one node (13.3): each may release its window early once; a third
    release, and releasing a lock that kept its window as if it had not, are refused
    with nothing changed -- either would leave the window counts wrong for good."""
    cache = make(page_size=1, window=2)
    request(cache, (1, 2, 3))
    node = cache.match_prefix((1, 2, 3)).last_node
    cache.inc_lock_ref(node)
    with pytest.raises(NotLocked) as raised:
        cache.dec_lock_ref(node, True)
    assert raised.value.argument == "swa_released"
    cache.inc_lock_ref(node)
    cache.dec_swa_lock(node)
    cache.dec_swa_lock(node)
    assert (node.anchored_locks, node.released_locks) == (2, 2)
    before = snapshot(cache)
    with pytest.raises(NotLocked) as raised:
        cache.dec_swa_lock(node)
    assert raised.value.argument == "node"
    with pytest.raises(NotLocked) as raised:
        cache.dec_lock_ref(node, False)
    assert raised.value.argument == "swa_released"
    assert snapshot(cache) == before and node.released_locks == 2
    cache.dec_lock_ref(node, True)
    cache.dec_lock_ref(node, True)
    assert (node.anchored_locks, node.released_locks, node.lock_ref) == (0, 0, 0)
    cache.check_invariants()


def test_lock_refuses_a_window_with_a_tombstone() -> None:
    cache = make(page_size=1, window=2)
    request(cache, (1, 2), swa_evicted=1)
    node = cache.node_at((1, 2))
    assert node is not None
    before = snapshot(cache)
    with pytest.raises(InvalidArgument, match="node: its window has a tombstone"):
        cache.inc_lock_ref(node)
    assert snapshot(cache) == before


# -- eviction ------------------------------------------------------------------------------

def test_evict_swa_tombstones_internal_and_deletes_a_leaf() -> None:
    clock = ManualClock(1)
    cache = make(page_size=1, full_slots=16, swa_slots=16, window=1, clock=clock)
    request(cache, (1, 2))
    clock.advance()
    request(cache, (1, 2, 3))  # (1, 2, 3) newer
    clock.advance()
    cache.match_prefix((1, 2, 3))  # the whole path touched: ties broken by node id
    # (1,) and (1, 2) are internal: they become tombstones; (1, 2, 3) is a leaf
    assert cache.evict_swa(2) == 2
    got = pages(cache)
    assert got[(1,)][1] is None and got[(1, 2)][1] is None and got[(1, 2, 3)][1] is not None
    assert cache.evict_swa(1) == 1
    assert set(pages(cache)) == {(1,), (1, 2)}  # the leaf deleted, both copies freed
    assert cache.pools.full.num_free_slots == 16 - 2
    assert cache.pools.swa.num_free_slots == 16
    cache.check_invariants()


def test_evict_takes_exactly_enough_pages_of_a_node() -> None:
    cache = make(page_size=1, full_slots=16, swa_slots=16, window=1)
    request(cache, (1, 2, 3, 4))
    assert cache.evict_full(1) == 1  # only the last page of the 4-page leaf
    assert set(pages(cache)) == {(1,), (1, 2), (1, 2, 3)}
    assert cache.evict_swa(2) == 2  # the leaf (1, 2, 3): its last 2 pages deleted
    assert set(pages(cache)) == {(1,)} and live_pages(cache) == {(1,)}
    cache.check_invariants()
    assert cache.evict_swa(0) == 0 and cache.evict_full(0) == 0


def test_evict_full_is_lru_and_skips_locked_leaves() -> None:
    clock = ManualClock(1)
    cache = make(page_size=1, full_slots=16, swa_slots=16, window=1, clock=clock)
    request(cache, (1,))
    clock.advance()
    request(cache, (2,))
    clock.advance()
    request(cache, (3,))
    clock.advance()
    cache.match_prefix((1,))  # (1,) now the newest
    cache.inc_lock_ref(cache.match_prefix((2,)).last_node)
    assert cache.evict_full(1) == 1
    assert set(pages(cache)) == {(1,), (2,)}
    assert cache.evict_full(5) == 1  # (2,) is locked: only (1,) is left to take
    assert set(pages(cache)) == {(2,)}
    cache.check_invariants()


# -- bad input: typed errors, nothing changed ---------------------------------------------

def held_cache() -> tuple[SwaCache, torch.Tensor]:
    cache = make(page_size=2, full_slots=16, swa_slots=8, window=2)
    request(cache, (1, 2, 3, 4))
    full = cache.alloc(4)
    assert full is not None
    return cache, full


Call = Callable[[SwaCache, torch.Tensor], object]


@pytest.mark.parametrize(("call", "error", "argument"), [
    (lambda c, f: c.alloc(3), SlotError, "num_tokens"),
    (lambda c, f: c.alloc(-2), SlotError, "num_tokens"),
    (lambda c, f: c.free_swa(f[:1]), SlotError, "full_slots"),  # not a whole page
    (lambda c, f: c.free_swa(slots(0, 1)), SlotError, "full_slots"),  # the tree's
    (lambda c, f: c.free_swa(slots(8, 9)), SlotError, "full_slots"),  # free
    (lambda c, f: c.free(f.to(torch.int32)), SlotError, "full_slots"),
    (lambda c, f: c.free(torch.cat([f[:2], f[:2]])), SlotError, "full_slots"),
    (lambda c, f: c.free(slots(2, 3)), SlotError, "full_slots"),
    (lambda c, f: c.free(slots(99, 100)), SlotError, "full_slots"),
    (lambda c, f: c.insert((1, 2, 3, 4), f, 1), InvalidArgument, "swa_evicted"),
    (lambda c, f: c.insert((1, 2, 3, 4), f, 6), InvalidArgument, "swa_evicted"),
    (lambda c, f: c.insert((1, 2, 3, 4), f, True), InvalidArgument, "swa_evicted"),
    (lambda c, f: c.insert((1, 2, 3, 4), f, 2), SlotError, "full_slots"),  # halves left
    (lambda c, f: c.insert((1, 2, 3), f, 0), SlotError, "full_slots"),
    (lambda c, f: c.insert((5, 6, 7, 8), f.flip(0), 0), SlotError, "full_slots"),  # order
    (lambda c, f: c.insert((1, 2, 3, 4), slots(2, 3, 0, 1), 0), SlotError, "full_slots"),
    (lambda c, f: c.insert([1, 2, "3", 4], f, 0), InvalidArgument, "key_tokens"),
    (lambda c, f: c.insert("1234", f, 0), InvalidArgument, "key_tokens"),
    (lambda c, f: c.insert((5, 6, 7, 8), slots(0, 1, 2, 3), 0), SlotError, "full_slots"),
    (lambda c, f: c.match_prefix(None), InvalidArgument, "key_tokens"),
    (lambda c, f: c.node_at((1,)), InvalidArgument, "key_tokens"),
    (lambda c, f: c.write_kv(f, torch.zeros(2, 3, 2, 1, 1)), SlotError, "values"),
    (lambda c, f: c.write_kv(slots(0), torch.zeros(2, 1, 2, 1, 1)), SlotError, "full_slots"),
    (lambda c, f: c.inc_lock_ref("node"), ForeignNode, "node"),
    (lambda c, f: c.inc_lock_ref(make().root), ForeignNode, "node"),
    (lambda c, f: c.dec_lock_ref(c.node_at((1, 2, 3, 4)), False), NotLocked, "node"),
    (lambda c, f: c.dec_lock_ref(c.node_at((1, 2, 3, 4)), 1), InvalidArgument,
     "swa_released"),
    (lambda c, f: c.dec_swa_lock(c.node_at((1, 2, 3, 4))), NotLocked, "node"),
    (lambda c, f: c.evict_full(-1), InvalidArgument, "num_tokens"),
    (lambda c, f: c.evict_swa(1.5), InvalidArgument, "num_tokens"),
    (lambda c, f: c.evict_swa(False), InvalidArgument, "num_tokens"),
])
def test_bad_arguments_raise_and_change_nothing(call: Call, error: type[Exception],
                                                argument: str) -> None:
    cache, full = held_cache()
    before = snapshot(cache)
    with pytest.raises(error) as raised:
        call(cache, full)
    assert getattr(raised.value, "argument", None) == argument
    assert snapshot(cache) == before


def test_an_evicted_node_is_refused() -> None:
    cache = make(page_size=1)
    request(cache, (1,))
    node = cache.match_prefix((1,)).last_node
    assert cache.evict_full(1) == 1
    with pytest.raises(ForeignNode, match="node"):
        cache.inc_lock_ref(node)


@pytest.mark.parametrize(("changes", "argument"), [
    ({"page_size": 0}, "page_size"),
    ({"full_slots": 3, "page_size": 2}, "full_slots"),
    ({"swa_slots": 0}, "swa_slots"),
    ({"window": 0}, "window"),
])
def test_bad_config_is_refused(changes: dict[str, int], argument: str) -> None:
    settings = {"page_size": 1, "full_slots": 4, "swa_slots": 4, "window": 1, **changes}
    with pytest.raises(ConfigError) as raised:
        SwaCache(page_size=settings["page_size"], full_slots=settings["full_slots"],
                 swa_slots=settings["swa_slots"], window=settings["window"],
                 clock=ManualClock().now)
    assert raised.value.argument == argument


# -- check_invariants names what broke ----------------------------------------------------

def test_check_invariants_names_the_broken_invariant() -> None:
    cache = make(page_size=1, window=1)
    request(cache, (1, 2), swa_evicted=1)
    tombstone = cache.node_at((1,))
    assert tombstone is not None
    cache.pools.mapping[tombstone.full] = 5  # a stale entry for a tombstone's slot
    with pytest.raises(InvariantViolation) as raised:
        cache.check_invariants()
    assert raised.value.spec_id == "INV-SWA-ONLY-WITH-FULL"
    cache.pools.mapping[tombstone.full] = NO_PAIR
    tombstone.swa_lock_ref = 1
    with pytest.raises(InvariantViolation) as raised:
        cache.check_invariants()
    assert raised.value.spec_id == "INV-SWA-LOCKS"
    tombstone.swa_lock_ref = 0
    live = cache.node_at((1, 2))
    assert live is not None and live.swa is not None
    live.released_locks = 1  # a window released by no lock taken there
    with pytest.raises(InvariantViolation) as raised:
        cache.check_invariants()
    assert raised.value.spec_id == "INV-SWA-WINDOW-COUNT"
    live.released_locks = 0
    cache.inc_lock_ref(live)
    cache.check_invariants()
    live.swa_lock_ref += 1  # a window count no lock holds: its SWA KV pinned for good
    with pytest.raises(InvariantViolation) as raised:
        cache.check_invariants()
    assert raised.value.spec_id == "INV-SWA-WINDOW-COUNT"
    live.swa_lock_ref -= 1
    cache.dec_lock_ref(live, False)
    cache.pools.swa.kv[0, 0, int(live.swa[0])] = 3.0  # the copies disagree
    with pytest.raises(InvariantViolation) as raised:
        cache.check_invariants()
    assert raised.value.spec_id == "INV-SWA-CONTENT"


# -- the conformance adapter ---------------------------------------------------------------

def test_adapter_observes_every_page_of_every_node() -> None:
    engine = build(SwaConfig(page_size=2, full_slots=16, swa_slots=8, window=3))
    assert (engine.name, engine.lock_granularity) == ("ours", "page")
    key = Key((1, 2, 3, 4, 5, 6), None)
    full = engine.alloc(6)
    assert full is not None
    engine.write_kv(full, [11, 12, 13, 14, 15, 16])
    engine.free_swa(full[:2])
    assert engine.insert(key, full, 2) == 0
    view = engine.observe()
    assert view.own_check is None
    assert set(view.pages) == {Key(key.tokens[:n], None) for n in (2, 4, 6)}
    assert view.pages[Key((1, 2), None)].swa is None
    assert view.pages[Key((1, 2, 3, 4), None)].full == (2, 3)
    assert dict(view.pairs) == {2: 2, 3: 3, 4: 4, 5: 5}
    assert [view.full_kv[s] for s in full] == [11, 12, 13, 14, 15, 16]
    assert view.swa_kv[0] == 11  # a dropped half keeps its bytes until reused
    assert view.full_kv[6] == 0  # never written: a fresh pool's 0, no content
    slots_, page = engine.match_prefix(Key((1, 2, 3, 4, 5, 6, 7), None))
    assert (slots_, page) == (full, key)
    receipt = engine.lock(page)
    assert isinstance(receipt, SwaNode)
    view = engine.observe()
    assert [view.pages[Key(key.tokens[:n], None)].swa_lock for n in (2, 4, 6)] == [0, 1, 1]
    engine.release_swa(receipt)
    engine.unlock(receipt, True)
    assert engine.evict_full(6) == 6 and engine.observe().pages == {}
    engine.close()


def test_a_release_must_release_a_lock_taken_at_that_node() -> None:
    """A lock taken at (1, 1, 2) cannot be released at its parent: NotLocked, no change."""
    cache = make(window=1)
    request(cache, (1, 1, 2))
    request(cache, (1, 1, 3))
    lower = cache.node_at((1, 1, 2))
    upper = cache.node_at((1, 1))
    assert lower is not None and upper is not None and lower.parent is upper
    cache.inc_lock_ref(lower)
    before = snapshot(cache)
    with pytest.raises(NotLocked, match="no lock taken there"):
        cache.dec_lock_ref(upper, True)
    assert snapshot(cache) == before
    cache.dec_lock_ref(lower, False)
    cache.check_invariants()
