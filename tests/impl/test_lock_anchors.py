"""``dec_lock_ref`` releases only a lock taken at that node (spec/03 3.7, 13.3, 13m.3),
decided in O(1) by ``anchored_locks`` (issue 30) in all three caches: the count stays with
the lower part of a split (the node object a caller holds), a release at the new upper
part or at a parent of several locked children or of a copy's lock is refused (typed,
nothing changed), and each cache's checker catches a planted wrong count or a split that
moves it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from test_mamba_cache import make as mamba  # the hybrid caches' own tests' builders
from test_mamba_cache import request as mamba_request
from test_swa_cache import make as swa_cache
from test_swa_cache import request as swa_request

from hiradix import tree as plain_tree
from hiradix.cache import HiRadixCache
from hiradix.clock import ManualClock
from hiradix.errors import InvalidArgument, InvariantViolation, NotLocked
from hiradix.hybrid import SwaCache
from hiradix.keys import RadixKey
from hiradix.mamba import MambaCache
from hiradix.tree import TreeNode

# -- the two-tier cache ------------------------------------------------------------------

def plain(page_size: int, write_policy: str = "write_back") -> HiRadixCache:
    return HiRadixCache.create(device_slots=32, page_size=page_size,
                               write_policy=write_policy,  # type: ignore[arg-type]
                               clock=ManualClock(1))


def put(cache: HiRadixCache, tokens: tuple[int, ...]) -> TreeNode:
    """Insert ``tokens`` (whole pages) with fresh slots, free the duplicates; the node
    that ends at them."""
    slots = cache.alloc(len(tokens))
    assert slots is not None
    prefix = cache.insert(RadixKey(tokens), slots)
    if prefix:
        cache.free(slots[:prefix])
    return cache.match_prefix(RadixKey(tokens)).last_device_node


def state(cache: HiRadixCache) -> str:
    """Everything a refused call must leave as it was, the lock counts included."""
    counts = [(n.prefix(), n.lock_ref, n.anchored_locks) for n in cache.nodes()]
    return (cache.dump() + repr(sorted(counts)) + repr(sorted(cache.device_pool.free_slots()))
            + repr(sorted(cache.host_pool.free_slots())))


@pytest.mark.parametrize("page_size", [1, 2])
def test_a_lock_stays_with_the_lower_part_of_a_split(page_size: int) -> None:
    p = page_size
    cache = plain(p)
    deep = put(cache, tuple(range(1, 4 * p + 1)))  # one node of 4 pages
    cache.inc_lock_ref(deep)
    put(cache, (*range(1, 2 * p + 1), *range(90, 90 + p)))  # branches after 2 pages
    upper = deep.parent
    assert upper is not None and upper is not cache.root and len(deep.tokens) == 2 * p
    assert (upper.anchored_locks, deep.anchored_locks) == (0, 1)
    cache.check_invariants()
    before = state(cache)
    with pytest.raises(NotLocked, match="no lock taken there") as refused:
        cache.dec_lock_ref(upper)
    assert refused.value.argument == "node" and state(cache) == before
    assert cache.dec_lock_ref(deep) == 4 * p  # the whole path is evictable again
    assert all(n.lock_ref == 0 and n.anchored_locks == 0 for n in cache.nodes())
    cache.check_invariants()


def test_a_parent_of_two_locked_children_holds_no_lock_of_its_own() -> None:
    """Accepted before (the parent held more locks than each child): releasing it and
    then one child left the other child locked under an unlocked parent."""
    cache = plain(1)
    left, right = put(cache, (1, 1)), put(cache, (1, 2))
    parent = left.parent
    assert parent is right.parent and parent is not None
    cache.inc_lock_ref(left)
    cache.inc_lock_ref(right)
    assert parent.lock_ref == 2
    before = state(cache)
    with pytest.raises(NotLocked, match="no lock taken there"):
        cache.dec_lock_ref(parent)
    assert state(cache) == before
    cache.dec_lock_ref(left)
    cache.dec_lock_ref(right)
    cache.check_invariants()


def test_a_copys_lock_below_a_caller_lock_is_not_the_callers() -> None:
    """write_through: each insert's backup locks its node until acknowledged. A caller
    lock at the child and the two copies' locks let the old path check pass at the
    parent; no caller lock was taken there, so the release is refused."""
    cache = plain(1, "write_through")
    parent = put(cache, (1, 2))
    child = put(cache, (1, 2, 3))
    assert child.parent is parent and len(cache.pending["d2h"]) == 2
    cache.inc_lock_ref(child)
    before = state(cache)
    with pytest.raises(NotLocked):
        cache.dec_lock_ref(parent)
    assert state(cache) == before
    cache.check_invariants()
    cache.dec_lock_ref(child)
    assert cache.writing_check() == 2
    assert all(n.lock_ref == 0 for n in cache.nodes())
    cache.check_invariants()


def test_the_checker_catches_a_wrong_anchor_count() -> None:
    cache = plain(1)
    node = put(cache, (1, 2, 3))
    cache.inc_lock_ref(node)
    cache.check_invariants()
    node.anchored_locks += 1
    with pytest.raises(InvariantViolation) as caught:
        cache.check_invariants()
    assert caught.value.spec_id == "INV-LOCK-MONOTONE"


def test_the_checker_catches_a_split_that_moves_the_anchor_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted bug: the split gives the locks taken at the node to its upper part."""
    def wrong(node: TreeNode, at: int, page_size: int) -> TreeNode:
        upper = plain_tree.split(node, at, page_size)
        upper.anchored_locks, node.anchored_locks = node.anchored_locks, 0
        return upper

    monkeypatch.setattr("hiradix.cache.split", wrong)
    cache = plain(1)
    deep = put(cache, (1, 2, 3, 4))
    cache.inc_lock_ref(deep)
    put(cache, (1, 2, 9))
    with pytest.raises(InvariantViolation) as caught:
        cache.check_invariants()
    assert caught.value.spec_id == "INV-LOCK-MONOTONE"


# -- the (FULL, SWA) and (FULL, MAMBA) caches ---------------------------------------------

def swa() -> SwaCache:
    return swa_cache(window=1)


Hybrid = SwaCache | MambaCache
FAMILIES: dict[str, tuple[Callable[[], Hybrid], Callable[..., object], str]] = {
    "swa": (swa, swa_request, "INV-SWA-LOCKS"),  # the requests check the invariants
    "mamba": (mamba, mamba_request, "INV-MAMBA-LOCKS"),
}


def hybrid_state(cache: Hybrid) -> str:
    counts = sorted((n.prefix(), n.lock_ref, n.anchored_locks) for n in cache.tree.nodes())
    return cache.dump() + repr(counts)


def lock(cache: Hybrid, node: object) -> None:
    if isinstance(cache, SwaCache):
        cache.inc_lock_ref(node)  # type: ignore[arg-type]
    else:
        cache.inc_lock_ref(node, True)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_caches_keep_a_lock_with_the_lower_part_of_a_split(family: str) -> None:
    make, put_tokens, _ = FAMILIES[family]
    cache = make()
    put_tokens(cache, (1, 1, 2, 3))
    deep = cache.node_at((1, 1, 2, 3))
    assert deep is not None
    lock(cache, deep)
    put_tokens(cache, (1, 1, 5))  # splits the path after (1, 1)
    upper = cache.node_at((1, 1))
    assert upper is not None and upper is not deep and deep.anchored_locks == 1
    assert upper.anchored_locks == 0 and upper.lock_ref == 1
    cache.check_invariants()
    before = hybrid_state(cache)
    with pytest.raises(NotLocked, match="no lock taken there") as refused:
        cache.dec_lock_ref(upper, False)  # type: ignore[arg-type]
    assert refused.value.argument == "node" and hybrid_state(cache) == before
    cache.dec_lock_ref(deep, False)  # type: ignore[arg-type]
    assert all(n.lock_ref == 0 for n in cache.tree.nodes())
    cache.check_invariants()


@pytest.mark.parametrize("family", FAMILIES)
def test_hybrid_checkers_catch_a_wrong_anchor_count(family: str) -> None:
    make, put_tokens, spec_id = FAMILIES[family]
    cache = make()
    put_tokens(cache, (1, 2, 3))
    node = cache.node_at((1, 2, 3))
    assert node is not None
    lock(cache, node)
    cache.check_invariants()
    node.anchored_locks -= 1
    with pytest.raises(InvariantViolation) as caught:
        cache.check_invariants()
    assert caught.value.spec_id == spec_id


def test_a_state_free_release_needs_a_state_free_lock_taken_there() -> None:
    """Mamba: a lock with its state at (1, 1) and one without below it. Before, a
    release at (1, 1) with ``state_released`` passed (its lock, 2, exceeded its state
    locks, 1) and left a state lock nobody would release (INV-MAMBA-LOCKS)."""
    cache = mamba()
    mamba_request(cache, (1, 1, 2))
    mamba_request(cache, (1, 1, 3))
    upper, lower = cache.node_at((1, 1)), cache.node_at((1, 1, 2))
    assert upper is not None and lower is not None and lower.parent is upper
    cache.inc_lock_ref(upper, True)
    cache.inc_lock_ref(lower, False)
    before = hybrid_state(cache)
    with pytest.raises(InvalidArgument) as refused:
        cache.dec_lock_ref(upper, True)
    assert refused.value.argument == "state_released" and hybrid_state(cache) == before
    cache.dec_lock_ref(upper, False)
    cache.dec_lock_ref(lower, True)
    cache.check_invariants()
    assert all(n.lock_ref == n.state_lock_ref == 0 for n in cache.tree.nodes())
