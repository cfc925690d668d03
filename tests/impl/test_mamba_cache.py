"""The (FULL, MAMBA) hybrid cache (spec/13m) on hand-built cases: each operation of
13m.3, splits that keep the state on the last page (13m.8), state tombstones and their
refill, fork copying real bytes, LRU evictions under locks, typed errors that leave the
cache unchanged, and the checker catching a planted corruption per invariant of 13m.5."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from hiradix.clock import ManualClock
from hiradix.config import KVShape
from hiradix.engines.ours.mamba import OursMambaAdapter, build
from hiradix.errors import (
    ConfigError,
    ForeignNode,
    InvalidArgument,
    InvariantViolation,
    NotLocked,
    SlotError,
)
from hiradix.mamba import MambaCache, MambaNode
from hiradix_model import Key
from hiradix_model.mamba import MambaConfig

KV = KVShape(layers=2, heads=1, head_dim=1, dtype=torch.float32)
STATE_DIM = 3
PageRow = tuple[list[int], int | None, int, int]  # full slots, state, lock, state_lock


def make(page_size: int = 1, full_slots: int = 16, state_slots: int = 4,
         clock: ManualClock | None = None) -> MambaCache:
    tick = clock or ManualClock(1)
    return MambaCache(page_size=page_size, full_slots=full_slots, state_slots=state_slots,
                      clock=tick.now, kv=KV, state_dim=STATE_DIM)


def slots(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def state_values(code: float) -> torch.Tensor:
    return torch.full((KV.layers, STATE_DIM), code, dtype=torch.float32)


def request(cache: MambaCache, tokens: tuple[int, ...], code: float = 1.0) -> tuple[int, bool]:
    """A request's life up to insert (13m.4) without a hit: alloc full slots and a state,
    the forward pass (KV and the state written), insert; the duplicates and an untaken
    state freed. Returns insert's (prefix, taken)."""
    full = cache.alloc(len(tokens))
    state = cache.alloc_state()
    assert full is not None and state is not None
    values = torch.arange(len(tokens), dtype=torch.float32).view(1, -1, 1, 1, 1) + code
    cache.write_kv(full, values.expand(KV.layers, len(tokens), 2, 1, 1).contiguous())
    cache.write_state(state, state_values(code))
    prefix, taken = cache.insert(tokens, full, state)
    kept = [s for s in full.tolist() if not cache.pools.owned.tensor[s]]
    if kept:
        cache.free(torch.tensor(kept, dtype=torch.int64))
    if not taken:
        cache.free_state(state)
    cache.check_invariants()
    return prefix, taken


def pages(cache: MambaCache) -> dict[tuple[int, ...], PageRow]:
    """Per page (keyed by its prefix), as 13m.8 reads a node: its full slots, the node's
    lock; the state and the state lock on the node's last page only."""
    out: dict[tuple[int, ...], PageRow] = {}
    ps = cache.page_size
    for node in cache.tree.nodes():
        prefix = node.prefix()
        base = len(prefix) - len(node.tokens)
        for start in range(0, len(node.tokens), ps):
            last = start + ps == len(node.tokens)
            out[prefix[:base + start + ps]] = (
                node.full[start:start + ps].tolist(), node.state if last else None,
                node.lock_ref, node.state_lock_ref if last else 0)
    return out


def with_state(cache: MambaCache) -> set[tuple[int, ...]]:
    return {k for k, v in pages(cache).items() if v[1] is not None}


def snapshot(cache: MambaCache) -> str:
    pools = cache.pools
    return (cache.dump() + repr(sorted(pools.full.free_slots()))
            + repr(sorted(pools.states.free_slots())) + repr(sorted(pools.states.owned))
            + repr(pools.owned.tensor.nonzero().view(-1).tolist())
            + repr(pools.full.kv.tolist()) + repr(pools.states.states.tolist())
            + repr(pages(cache)))


# -- the pools: alloc, free, states, fork ----------------------------------------------------

def test_alloc_and_free_full_slots_in_pages() -> None:
    cache = make(page_size=2, full_slots=8)
    full = cache.alloc(6)
    assert full is not None and full.tolist() == [0, 1, 2, 3, 4, 5]
    before = snapshot(cache)
    assert cache.alloc(4) is None  # short: no change
    assert snapshot(cache) == before
    cache.free(full[2:4])
    assert cache.pools.full.free_slots() == {2, 3, 6, 7}
    cache.check_invariants()


def test_state_slots_alloc_write_free() -> None:
    cache = make(state_slots=2)
    first, second = cache.alloc_state(), cache.alloc_state()
    assert {first, second} == {0, 1}
    assert cache.alloc_state() is None
    assert first is not None
    cache.write_state(first, state_values(7.0))
    assert torch.equal(cache.read_state(first), state_values(7.0))
    cache.free_state(first)
    assert cache.pools.states.free_slots() == {first}
    with pytest.raises(SlotError, match=r"slot: state slot .* is free"):
        cache.free_state(first)
    cache.check_invariants()


def test_fork_copies_the_cached_bytes_and_the_copy_evolves_alone() -> None:
    cache = make(state_slots=3)
    request(cache, (1, 2), code=5.0)
    node = cache.match_prefix((1, 2, 3)).last_node
    assert node.state is not None
    copy = cache.fork(node)
    assert copy is not None and copy != node.state
    assert torch.equal(cache.read_state(copy), state_values(5.0))
    cache.write_state(copy, state_values(9.0))  # the request's copy moves on
    assert torch.equal(cache.read_state(node.state), state_values(5.0))
    cache.check_invariants()
    assert cache.fork(node) is not None
    before = snapshot(cache)
    assert cache.fork(node) is None  # the pool is full: nothing changes
    assert snapshot(cache) == before


# -- insert: nodes, splits, duplicates, state tombstones ---------------------------------

def test_insert_caches_new_pages_with_the_state_on_the_last() -> None:
    cache = make(page_size=2)
    assert request(cache, (1, 2, 3, 4)) == (0, True)
    assert pages(cache) == {(1, 2): ([0, 1], None, 0, 0), (1, 2, 3, 4): ([2, 3], 0, 0, 0)}
    assert cache.pools.states.owned == {0}


def test_insert_of_a_prefix_splits_and_puts_the_state_on_the_upper_part() -> None:
    cache = make(page_size=2)
    request(cache, (1, 2, 3, 4, 5, 6))
    lower = cache.node_at((1, 2, 3, 4, 5, 6))
    assert lower is not None and lower.state == 0
    assert request(cache, (1, 2, 3, 4)) == (4, True)
    got = pages(cache)
    assert got[(1, 2, 3, 4)] == ([2, 3], 1, 0, 0) and got[(1, 2, 3, 4, 5, 6)][1] == 0
    assert lower.tokens == (5, 6) and lower.state == 0  # the handle kept the lower part
    assert lower.parent is not None and lower.parent.tokens == (1, 2, 3, 4)


def test_insert_past_a_divergence_splits_and_adds_a_branch() -> None:
    cache = make(page_size=1)
    request(cache, (1, 2, 3))
    assert request(cache, (1, 2, 9)) == (2, True)
    got = pages(cache)
    assert got[(1, 2)][1] is None  # the split's upper part: no state
    assert with_state(cache) == {(1, 2, 3), (1, 2, 9)}


def test_a_cached_last_page_with_a_state_does_not_take_it() -> None:
    cache = make(page_size=1)
    request(cache, (1, 2))
    full = cache.alloc(2)
    state = cache.alloc_state()
    assert full is not None and state is not None
    assert cache.insert((1, 2), full, state) == (2, False)
    assert not bool(cache.pools.owned.tensor[full].any())  # duplicates: the caller's
    assert state not in cache.pools.states.owned
    cache.free(full)
    cache.free_state(state)
    cache.check_invariants()


def test_insert_takes_the_matched_pages_own_slots() -> None:
    cache = make(page_size=1)
    request(cache, (1, 2))
    matched = cache.match_prefix((1, 2, 3))
    more, state = cache.alloc(1), cache.alloc_state()
    assert more is not None and state is not None
    assert cache.insert((1, 2, 3), torch.cat([matched.full_slots, more]), state) == (2, True)
    assert pages(cache)[(1, 2, 3)] == (more.tolist(), state, 0, 0)
    cache.check_invariants()


def test_a_state_tombstone_is_matched_through_and_refilled() -> None:
    clock = ManualClock(1)
    cache = make(page_size=1, clock=clock)
    request(cache, (1, 2))
    clock.advance()
    request(cache, (1, 2, 3, 4))
    assert cache.evict_states(1) == 1  # (1, 2): the least recent, internal: a tombstone
    assert with_state(cache) == {(1, 2, 3, 4)}
    found = cache.match_prefix((1, 2, 7))
    assert found.last_node is cache.root and found.full_hit == 2
    assert request(cache, (1, 2), code=3.0) == (2, True)  # the refill
    assert with_state(cache) == {(1, 2), (1, 2, 3, 4)}
    assert len(cache.match_prefix((1, 2, 7)).full_slots) == 2


# -- match_prefix: the deepest state of the full hit (INV-MAMBA-MATCH-STATE) ------------

def chain(states: set[int], depth: int = 5) -> MambaCache:
    """P=1 pages 1..depth along (1, ..., depth), states exactly at ``states`` (depths)."""
    cache = make(page_size=1, full_slots=32, state_slots=8)
    for d in sorted(states | {depth}, reverse=True):
        request(cache, tuple(range(1, d + 1)))
    if depth not in states:
        node = cache.node_at(tuple(range(1, depth + 1)))
        assert node is not None
        cache.inc_lock_ref(node, False)  # keep the leaf while its state goes
        assert cache.evict_states(len(states) + 1) == len(states) + 1
        cache.dec_lock_ref(node, True)
        for d in sorted(states, reverse=True):
            request(cache, tuple(range(1, d + 1)))
    assert with_state(cache) == {tuple(range(1, d + 1)) for d in states}
    return cache


@pytest.mark.parametrize(("states", "key", "expected_depth", "full_hit"), [
    ({5}, (1, 2, 3, 4, 5, 9), 5, 5),
    ({2, 5}, (1, 2, 3, 4, 9), 2, 4),  # 5 lies past the hit
    ({2, 5}, (1, 2, 3, 4, 5), 5, 5),
    ({3}, (1, 2, 3, 4, 5), 3, 5),  # a tombstone at the end: back to 3
    (set(), (1, 2, 3), 0, 3),  # no state on the way: the root
    ({1, 4}, (1, 2, 3), 1, 3),
])
def test_match_ends_at_the_deepest_state_of_the_full_hit(
        states: set[int], key: tuple[int, ...], expected_depth: int, full_hit: int) -> None:
    cache = chain(states)
    nodes = len(list(cache.tree.nodes()))
    found = cache.match_prefix(key)
    assert len(found.full_slots) == expected_depth and found.full_hit == full_hit
    if expected_depth:
        assert found.last_node.prefix() == key[:expected_depth]
        assert found.last_node.state is not None
    else:
        assert found.last_node is cache.root
    assert len(list(cache.tree.nodes())) == nodes  # a match splits nothing
    cache.check_invariants()


def test_a_state_past_the_end_of_a_partly_matched_node_is_not_used() -> None:
    cache = make(page_size=2)
    request(cache, (1, 2, 3, 4))
    found = cache.match_prefix((1, 2, 9, 9))
    assert found.last_node is cache.root and found.full_hit == 2


# -- locks -------------------------------------------------------------------------------

def test_locks_count_on_the_path_and_the_state_lock_on_the_node() -> None:
    cache = make(page_size=1)
    request(cache, (1, 2, 3))
    request(cache, (1,))
    node = cache.node_at((1, 2, 3))
    assert node is not None
    cache.inc_lock_ref(node, True)
    got = pages(cache)
    assert [got[k][2:] for k in ((1,), (1, 2), (1, 2, 3))] == [(1, 0), (1, 0), (1, 1)]
    cache.dec_state_lock(node)
    with pytest.raises(NotLocked, match="node"):
        cache.dec_state_lock(node)
    with pytest.raises(NotLocked, match="node"):
        cache.dec_lock_ref(node, False)  # its state part is gone already
    cache.dec_lock_ref(node, True)
    assert all(v[2:] == (0, 0) for v in pages(cache).values())
    cache.check_invariants()


def test_a_state_lock_is_counted_on_a_page_without_a_state_and_survives_a_split() -> None:
    cache = make(page_size=1)
    request(cache, (1, 2, 3))
    node = cache.node_at((1, 2, 3))
    assert node is not None
    cache.inc_lock_ref(node, True)
    assert cache.evict_states(1) == 0  # its only state is locked
    request(cache, (1, 2))  # splits the locked node: (1, 2) gets the path lock only
    assert pages(cache)[(1, 2)] == ([1], 1, 1, 0)
    assert node.tokens == (3,) and node.state_lock_ref == 1  # the handle: the lower part
    assert cache.evict_states(1) == 1  # (1, 2): state lock 0, locked path: a tombstone
    assert pages(cache)[(1, 2)][1] is None and len(pages(cache)) == 3
    cache.dec_lock_ref(node, False)
    cache.check_invariants()


def test_state_released_needs_a_lock_without_its_state_part() -> None:
    cache = make(page_size=1)
    request(cache, (1,))
    node = cache.node_at((1,))
    assert node is not None
    cache.inc_lock_ref(node, True)
    before = snapshot(cache)
    with pytest.raises(InvalidArgument) as raised:
        cache.dec_lock_ref(node, True)
    assert raised.value.argument == "state_released"
    assert snapshot(cache) == before
    cache.inc_lock_ref(node, False)
    cache.dec_lock_ref(node, True)
    cache.dec_lock_ref(node, False)
    cache.check_invariants()


# -- eviction: LRU, victims, locks ---------------------------------------------------------

def test_evict_full_is_lru_whole_nodes_and_frees_their_states() -> None:
    clock = ManualClock(1)
    cache = make(page_size=1, clock=clock)
    request(cache, (1, 2))
    clock.advance()
    request(cache, (3,))
    clock.advance()
    request(cache, (4,))
    clock.advance()
    cache.match_prefix((1, 2))  # (1, 2) now the newest
    assert cache.evict_full(1) == 1
    assert set(pages(cache)) == {(1,), (1, 2), (4,)}
    assert cache.evict_full(1) == 1
    assert set(pages(cache)) == {(1,), (1, 2)}
    assert cache.evict_full(1) == 2  # the whole node of two pages
    assert pages(cache) == {}
    assert len(cache.pools.states.free_slots()) == 4
    assert cache.evict_full(0) == 0
    cache.check_invariants()


def test_evict_full_takes_a_parent_once_its_last_child_went() -> None:
    clock = ManualClock(1)
    cache = make(page_size=1, clock=clock)
    request(cache, (1, 2))
    clock.advance()
    request(cache, (1, 3))  # (1,) is the split's upper part
    clock.advance()
    request(cache, (5,))
    assert cache.evict_full(3) == 3  # (1, 2), (1, 3), then (1,)
    assert set(pages(cache)) == {(5,)}
    cache.check_invariants()


def test_evictions_leave_locked_pages_alone() -> None:
    cache = make(page_size=1)
    request(cache, (1, 2))
    request(cache, (1, 2, 3))
    request(cache, (7,))
    node = cache.node_at((1, 2, 3))
    assert node is not None
    cache.inc_lock_ref(node, True)
    assert cache.evict_full(100) == 1  # only (7,)
    assert set(pages(cache)) == {(1,), (1, 2), (1, 2, 3)}
    assert cache.evict_states(100) == 1  # (1, 2) loses its state; (1, 2, 3)'s is locked
    assert with_state(cache) == {(1, 2, 3)} and len(pages(cache)) == 3
    cache.dec_state_lock(node)
    assert cache.evict_states(1) == 1 and len(pages(cache)) == 3  # locked path: tombstone
    cache.dec_lock_ref(node, True)
    assert cache.evict_full(100) == 3
    cache.check_invariants()


def test_evict_states_is_lru_and_deletes_a_full_leaf_whole() -> None:
    clock = ManualClock(1)
    cache = make(page_size=2, clock=clock)
    request(cache, (1, 2))
    clock.advance()
    request(cache, (1, 2, 3, 4, 5, 6))
    clock.advance()
    request(cache, (7, 8))
    clock.advance()
    cache.match_prefix((7, 8))
    clock.advance()
    cache.match_prefix((1, 2))  # LRU: (1..6), then (7, 8), then (1, 2)
    assert cache.evict_states(1) == 1
    assert set(pages(cache)) == {(1, 2), (7, 8)}  # a full leaf: both its pages went
    assert cache.evict_states(1) == 1
    assert set(pages(cache)) == {(1, 2)}
    assert cache.evict_states(5) == 1 and pages(cache) == {}
    assert cache.pools.full.num_free_slots == 16
    cache.check_invariants()


# -- bad input: typed errors, nothing changed ---------------------------------------------

def held_cache() -> tuple[MambaCache, torch.Tensor, int]:
    """A cache with (1, 2, 3, 4) cached (P=2, a node of two pages, state slot 0), four
    held full slots and a held state slot."""
    cache = make(page_size=2, full_slots=16, state_slots=4)
    request(cache, (1, 2, 3, 4))
    full, state = cache.alloc(4), cache.alloc_state()
    assert full is not None and state is not None
    return cache, full, state


def cached_node(cache: MambaCache) -> MambaNode:
    node = cache.node_at((1, 2, 3, 4))
    assert node is not None
    return node


Call = Callable[[MambaCache, torch.Tensor, int], object]
BAD: list[tuple[Call, type[Exception], str]] = [
    (lambda c, f, s: c.alloc(3), SlotError, "num_tokens"),
    (lambda c, f, s: c.alloc(-2), SlotError, "num_tokens"),
    (lambda c, f, s: c.free(f[:1]), SlotError, "full_slots"),  # not a whole page
    (lambda c, f, s: c.free(slots(0, 1)), SlotError, "full_slots"),  # the tree's
    (lambda c, f, s: c.free(slots(8, 9)), SlotError, "full_slots"),  # free
    (lambda c, f, s: c.free(f.to(torch.int32)), SlotError, "full_slots"),
    (lambda c, f, s: c.free(torch.cat([f[:2], f[:2]])), SlotError, "full_slots"),
    (lambda c, f, s: c.free(f.flip(0)), SlotError, "full_slots"),  # page order
    (lambda c, f, s: c.write_kv(f, torch.zeros(2, 3, 2, 1, 1)), SlotError, "values"),
    (lambda c, f, s: c.write_kv(slots(0, 1), torch.zeros(2, 2, 2, 1, 1)), SlotError,
     "full_slots"),
    (lambda c, f, s: c.write_state(0, state_values(1.0)), SlotError, "slot"),  # cached
    (lambda c, f, s: c.write_state(3, state_values(1.0)), SlotError, "slot"),  # free
    (lambda c, f, s: c.write_state(True, state_values(1.0)), SlotError, "slot"),
    (lambda c, f, s: c.write_state(s, torch.zeros(2, 2)), SlotError, "values"),
    (lambda c, f, s: c.write_state(s, state_values(1.0).double()), SlotError, "values"),
    (lambda c, f, s: c.free_state(0), SlotError, "slot"),
    (lambda c, f, s: c.free_state(9), SlotError, "slot"),
    (lambda c, f, s: c.free_state("1"), SlotError, "slot"),
    (lambda c, f, s: c.read_state(-1), SlotError, "slot"),
    (lambda c, f, s: c.read_full(slots(99)), SlotError, "slots"),
    (lambda c, f, s: c.fork("node"), ForeignNode, "node"),
    (lambda c, f, s: c.fork(c.root), InvalidArgument, "node"),  # no state there
    (lambda c, f, s: c.insert((1, 2, 3), f[:3], s), InvalidArgument, "key_tokens"),
    (lambda c, f, s: c.insert((), f[:0], s), InvalidArgument, "key_tokens"),
    (lambda c, f, s: c.insert([1, 2, "3", 4], f, s), InvalidArgument, "key_tokens"),
    (lambda c, f, s: c.insert("1234", f, s), InvalidArgument, "key_tokens"),
    (lambda c, f, s: c.insert((5, 6), f, s), SlotError, "full_slots"),  # length
    (lambda c, f, s: c.insert((5, 6, 7, 8), f.flip(0), s), SlotError, "full_slots"),
    (lambda c, f, s: c.insert((5, 6, 7, 8), slots(0, 1, 2, 3), s), SlotError,
     "full_slots"),  # another page's slots
    (lambda c, f, s: c.insert((1, 2, 3, 4), slots(2, 3, 0, 1), s), SlotError,
     "full_slots"),  # cached slots at the wrong position
    (lambda c, f, s: c.insert((1, 2, 3, 4), torch.cat([slots(0), f[1:]]), s), SlotError,
     "full_slots"),  # a page mixing its own slot with a held one
    (lambda c, f, s: c.insert((5, 6, 7, 8), slots(8, 9, 10, 11), s), SlotError,
     "full_slots"),  # free slots
    (lambda c, f, s: c.insert((5, 6, 7, 8), f, 0), SlotError, "state"),  # cached state
    (lambda c, f, s: c.insert((5, 6, 7, 8), f, 3), SlotError, "state"),  # free state
    (lambda c, f, s: c.insert((5, 6, 7, 8), f, None), SlotError, "state"),
    (lambda c, f, s: c.match_prefix(None), InvalidArgument, "key_tokens"),
    (lambda c, f, s: c.node_at((1,)), InvalidArgument, "key_tokens"),
    (lambda c, f, s: c.inc_lock_ref("node", True), ForeignNode, "node"),
    (lambda c, f, s: c.inc_lock_ref(make().root, True), ForeignNode, "node"),
    (lambda c, f, s: c.inc_lock_ref(cached_node(c), 1), InvalidArgument, "with_state"),
    (lambda c, f, s: c.dec_state_lock(cached_node(c)), NotLocked, "node"),
    (lambda c, f, s: c.dec_state_lock(make().root), ForeignNode, "node"),
    (lambda c, f, s: c.dec_lock_ref(None, False), ForeignNode, "node"),
    (lambda c, f, s: c.dec_lock_ref(cached_node(c), False), NotLocked, "node"),
    (lambda c, f, s: c.dec_lock_ref(cached_node(c), None), InvalidArgument,
     "state_released"),
    (lambda c, f, s: c.evict_full(-1), InvalidArgument, "num_tokens"),
    (lambda c, f, s: c.evict_full(1.5), InvalidArgument, "num_tokens"),
    (lambda c, f, s: c.evict_states(-1), InvalidArgument, "num_states"),
    (lambda c, f, s: c.evict_states(False), InvalidArgument, "num_states"),
]


@pytest.mark.parametrize(("call", "error", "argument"), BAD)
def test_bad_arguments_raise_and_change_nothing(call: Call, error: type[Exception],
                                                argument: str) -> None:
    cache, full, state = held_cache()
    before = snapshot(cache)
    with pytest.raises(error) as raised:
        call(cache, full, state)
    assert getattr(raised.value, "argument", None) == argument
    assert snapshot(cache) == before


def test_an_evicted_node_is_refused() -> None:
    cache = make(page_size=1)
    request(cache, (1,))
    node = cache.match_prefix((1,)).last_node
    assert cache.evict_full(1) == 1
    for call in (lambda: cache.inc_lock_ref(node, False), lambda: cache.fork(node)):
        with pytest.raises(ForeignNode, match="node"):
            call()


@pytest.mark.parametrize(("changes", "argument"), [
    ({"page_size": 0}, "page_size"),
    ({"full_slots": 3, "page_size": 2}, "full_slots"),
    ({"state_slots": 0}, "state_slots"),
    ({"state_dim": 0}, "state_dim"),
    ({"state_dtype": torch.int32}, "state_dtype"),
    ({"clock": 5}, "clock"),
    ({"kv": "mha"}, "kv"),
    ({"checksums": 1}, "checksums"),
])
def test_bad_config_is_refused(changes: dict[str, object], argument: str) -> None:
    settings: dict[str, object] = {"page_size": 1, "full_slots": 4, "state_slots": 2,
                                   "clock": ManualClock().now, **changes}
    with pytest.raises(ConfigError) as raised:
        MambaCache(**settings)  # type: ignore[arg-type]
    assert raised.value.argument == argument


def test_a_bad_device_is_refused() -> None:
    with pytest.raises(SlotError) as raised:
        MambaCache(page_size=1, full_slots=4, state_slots=2, clock=ManualClock().now,
                   device="nonsense")
    assert raised.value.argument == "device"


def test_a_clock_that_returns_no_int_is_refused_before_any_change() -> None:
    ticks: list[object] = [1]
    cache = MambaCache(page_size=1, full_slots=4, state_slots=2, kv=KV, state_dim=STATE_DIM,
                       clock=lambda: ticks[0])  # type: ignore[arg-type, return-value]
    request(cache, (1,))
    ticks[0] = "late"
    before = snapshot(cache)
    with pytest.raises(ConfigError, match="clock"):
        cache.match_prefix((1,))
    assert snapshot(cache) == before


# -- the checker names what broke (13m.5) ------------------------------------------------

def corrupt_tree(cache: MambaCache) -> None:
    node = cache.node_at((1, 2))
    assert node is not None
    node.full = node.full.flip(0)  # a page's slots out of order


def corrupt_full_pool(cache: MambaCache) -> None:
    node = cache.node_at((1, 2))
    assert node is not None
    cache.pools.full.allocator.release(node.full[:2])  # freed while the tree owns it


def corrupt_state_pool(cache: MambaCache) -> None:
    upper, lower = cache.node_at((1, 2)), cache.node_at((1, 2, 3, 4))
    assert upper is not None and lower is not None
    upper.state = lower.state  # one state slot owned by two pages


def corrupt_content(cache: MambaCache) -> None:
    node = cache.node_at((1, 2, 3, 4))
    assert node is not None and node.state is not None
    cache.pools.states.states[node.state] += 1.0  # a decode wrote into a cached state


def corrupt_kv(cache: MambaCache) -> None:
    node = cache.node_at((1, 2))
    assert node is not None
    cache.pools.full.kv[1, 0, int(node.full[1])] = -4.0  # another layer's K changed


def corrupt_locks(cache: MambaCache) -> None:
    node = cache.node_at((1, 2, 3, 4))
    assert node is not None
    node.state_lock_ref = 1  # a state lock without its path lock


@pytest.mark.parametrize(("corrupt", "spec_id"), [
    (corrupt_tree, "INV-MAMBA-TREE-WELL-FORMED"),
    (corrupt_full_pool, "INV-MAMBA-FULL-POOL"),
    (corrupt_state_pool, "INV-MAMBA-STATE-POOL"),
    (corrupt_content, "INV-MAMBA-CONTENT"),
    (corrupt_kv, "INV-MAMBA-CONTENT"),
    (corrupt_locks, "INV-MAMBA-LOCKS"),
])
def test_the_checker_names_each_planted_corruption(corrupt: Callable[[MambaCache], None],
                                                   spec_id: str) -> None:
    cache = make(page_size=2)
    request(cache, (1, 2, 3, 4))
    request(cache, (1, 2))  # two nodes, two states
    assert cache.violations() == []
    corrupt(cache)
    assert spec_id in {i for i, _ in cache.violations()}
    with pytest.raises(InvariantViolation) as raised:
        cache.check_invariants()
    assert raised.value.spec_id == spec_id


def test_without_checksums_only_the_content_check_is_skipped() -> None:
    cache = MambaCache(page_size=2, full_slots=16, state_slots=4, clock=ManualClock().now,
                       kv=KV, state_dim=STATE_DIM, checksums=False)
    request(cache, (1, 2, 3, 4))
    request(cache, (1, 2))
    corrupt_content(cache)
    assert cache.violations() == []  # nothing to compare the state's bytes with
    corrupt_locks(cache)
    assert {i for i, _ in cache.violations()} == {"INV-MAMBA-LOCKS"}


# -- the conformance adapter ---------------------------------------------------------------

def test_adapter_observes_pages_with_the_state_on_each_nodes_last_page() -> None:
    engine = build(MambaConfig(page_size=2, full_slots=16, state_slots=3))
    key = Key((1, 2, 3, 4, 5, 6), None)
    full, state = engine.alloc(6), engine.alloc_state()
    assert full is not None and state is not None
    engine.write_kv(full, [11, 12, 13, 14, 15, 16])
    engine.write_state(state, 40)
    assert engine.insert(key, full, state) == (0, True)
    view = engine.observe()
    assert view.own_check is None
    assert set(view.pages) == {Key(key.tokens[:n], None) for n in (2, 4, 6)}
    assert [view.pages[Key(key.tokens[:n], None)].state for n in (2, 4, 6)] == [None, None, 0]
    assert [view.full_kv[s] for s in full] == [11, 12, 13, 14, 15, 16]
    assert view.state_kv[state] == 40 and view.state_kv[1] == 0  # 0: never written
    hit = engine.match_prefix(Key((1, 2, 3, 4, 5, 6, 7), None))
    assert (hit.full, hit.page, hit.full_hit) == (full, key, 6)
    receipt = engine.lock(hit.page, True)
    forked = engine.fork(key)
    assert forked is not None and engine.observe().state_kv[forked] == 40
    view = engine.observe()
    assert [view.pages[Key(key.tokens[:n], None)].state_lock for n in (2, 4, 6)] == [0, 0, 1]
    assert [view.pages[Key(key.tokens[:n], None)].lock for n in (2, 4, 6)] == [1, 1, 1]
    engine.release_state(receipt)
    engine.unlock(receipt, True)
    engine.free_state(forked)
    assert engine.evict_states(1) == 1 and engine.observe().pages == {}
    engine.close()


AdapterCall = Callable[[OursMambaAdapter], object]


@pytest.mark.parametrize(("call", "argument"), [
    (lambda e: e.match_prefix(Key((1,), "tenant")), "key"),
    (lambda e: e.match_prefix((1,)), "key"),
    (lambda e: e.lock(Key((7,), None), True), "page"),  # not cached
    (lambda e: e.fork(Key((7,), None)), "page"),
    (lambda e: e.unlock("receipt", False), "receipt"),
    (lambda e: e.release_state(None), "receipt"),
    (lambda e: e.write_kv((0,), (1, 2)), "codes"),
    (lambda e: e.write_kv((0,), (True,)), "codes[0]"),
    (lambda e: e.write_state(0, 2 ** 25), "code"),
])
def test_adapter_refuses_bad_input_by_name(call: AdapterCall, argument: str) -> None:
    engine = build(MambaConfig(page_size=1, full_slots=4, state_slots=2))
    full, state = engine.alloc(1), engine.alloc_state()
    assert full is not None and state is not None
    engine.insert(Key((1,), None), full, state)
    before = engine.observe()
    with pytest.raises(InvalidArgument) as raised:
        call(engine)
    assert raised.value.argument == argument
    assert engine.observe() == before


def test_adapter_refuses_a_config_of_another_kind() -> None:
    with pytest.raises(InvalidArgument) as raised:
        OursMambaAdapter("P=1")  # type: ignore[arg-type]
    assert raised.value.argument == "config"


def test_adapter_reports_its_checker_as_own_check() -> None:
    engine = build(MambaConfig(page_size=1, full_slots=4, state_slots=2))
    full, state = engine.alloc(1), engine.alloc_state()
    assert full is not None and state is not None
    engine.insert(Key((1,), None), full, state)
    node = engine.cache.node_at((1,))
    assert node is not None
    node.lock_ref = -1
    own = engine.observe().own_check
    assert own is not None and "INV-MAMBA-LOCKS" in own


def test_a_release_must_release_a_lock_taken_at_that_node() -> None:
    """A lock taken at (1, 1, 2) cannot be released at its parent: NotLocked, no change."""
    cache = make()
    request(cache, (1, 1, 2))
    request(cache, (1, 1, 3))
    lower = cache.node_at((1, 1, 2))
    upper = cache.node_at((1, 1))
    assert lower is not None and upper is not None and lower.parent is upper
    cache.inc_lock_ref(lower, False)
    before = snapshot(cache)
    with pytest.raises(NotLocked, match="no lock taken there"):
        cache.dec_lock_ref(upper, True)
    assert snapshot(cache) == before
    cache.dec_lock_ref(lower, True)
    cache.check_invariants()
