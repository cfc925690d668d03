"""Bugs planted in our implementation, each by replacing one method of an impl class in
process (nothing under impl/ is edited), to compare what the exhaustive refinement of a
tiny scope (``hiradix explore``, spec/14 14.4) finds with what a sampled ``hiradix
check`` finds (issue 32; tests/explore_vs_check.py runs the comparison,
tests/impl/test_impl_mutants.py keeps every one caught).

Each is the kind of slip a cache like SGLang's ships: a shortcut, an off-by-one at a
boundary, a counter a split forgets, a lock an error path leaks, a protection a set
predicate drops. Most replacements wrap the real method and then do what the buggy code
would have done; where the slip sits inside a method, the method is copied with it. Each
docstring says what breaks, when it shows, and which check should see it.

Every mutant names one scope of one family (P = 1; at most 2 device and 2 host pages;
keys of one token over {1, 2}, "siblings", or of up to two tokens over {1}, "a path"):
the smallest member, under the write policy and strategy the bug needs, in which the
refinement finds it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hiradix.cache import HiRadixCache, MatchResult
from hiradix.conformance.explore import Mismatch, refine
from hiradix.decisions import DeviceVictim
from hiradix.keys import RadixKey
from hiradix.policies import EvictionOrder
from hiradix.transfer import ControlledCopyEngine, Direction, TransferEngine
from hiradix.tree import TreeNode, split
from hiradix_model.explore import Scope

# The real methods, taken before anything is planted: the wrappers call them.
REAL_MATCH = HiRadixCache.match_prefix
REAL_INSERT = HiRadixCache.insert
REAL_LOAD_BACK = HiRadixCache.load_back
REAL_SUBMIT = TransferEngine.submit_unchecked
REAL_LOADING_CHECK = HiRadixCache.loading_check


# ----------------------------------------------------------------------------- the bugs


def alloc_refuses_exact_fit(self: HiRadixCache, num_tokens: int) -> torch.Tensor | None:
    """The caller's ``alloc`` compares with ``>=`` where the allocator means ``>``
    (SGLang's ``if need_size > len(self.free_pages)``): a request for exactly the free
    slots is refused, so a scheduler evicts (or waits) with room to spare. Every rank
    makes the same mistake, so the ranks still agree (spec/12).

    Shows only when a request takes the last free page. The refinement sees it at the
    ``alloc`` request (the model has room: "alloc: the implementation had no room").
    """
    pool = self.device_pool
    able = pool.can_alloc(num_tokens) and (num_tokens == 0
                                           or num_tokens < pool.num_free_slots)
    if not self.sync.min(int(able), "alloc"):  # agreed, as the real one is (spec/12 12.3)
        return None
    return pool.alloc(num_tokens)


def match_stamps_deepest_only(self: HiRadixCache, key: RadixKey) -> MatchResult:
    """``match_prefix`` stamps recency on the deepest matched node only (the stamp moved
    out of the walk's loop), not on the nodes above it on the path: LRU ranks a parent
    by its last own match, and evicts a hot prefix once its leaf is gone.

    Shows only when a match runs through two nodes or more. The refinement sees it as a
    ``last_tick`` that differs from the model's after the match (spec/03 3.2).
    """
    before = {id(node): node.last_tick for node in self.nodes()}
    got = REAL_MATCH(self, key)
    path = [node for node, _ in self.walk(key, key.aligned_length(self.page_size))]
    for node in path[:-1]:  # every node above the deepest existed before the match
        node.last_tick = before.get(id(node), node.last_tick)
    return got


def full_hit_insert_skips_hits(self: HiRadixCache, key: RadixKey, slots: torch.Tensor, *,
                               priority: int = 0, chunked: bool = False,
                               counted_from: int = 0) -> int:
    """``insert`` returns early when the whole key is already cached on device ("nothing
    new to insert"), after validating it: the re-inserted pages count no hit, keep their
    old recency and priority, and are not backed up when the hit makes them due.

    Shows only on an insert of a key the device holds whole (a second request for the
    same prompt). The refinement sees hits, ticks and the clock differ (spec/03 3.5).
    """
    key = self._require_key(key)
    checked = self._require_slots(slots, key.length, "slots")
    aligned = key.aligned_length(self.page_size)
    self._require_counted_from(counted_from, aligned)
    walked = self.walk(key, aligned)
    self._check_insert_slots(checked, walked)
    on_device = sum(matched for node, matched in walked if node.device is not None)
    if aligned and on_device == aligned:
        return aligned
    return REAL_INSERT(self, key, slots, priority=priority, chunked=chunked,
                       counted_from=counted_from)


def insert_split_drops_hits(self: HiRadixCache, key: RadixKey, stop_at: int,
                            walked: list[tuple[TreeNode, int]] | None = None
                            ) -> list[TreeNode]:
    """The split an insert makes (where its key, or its ``counted_from``, ends inside a
    node) gives the new upper part no hits: a counter the split forgot to copy (SGLang's
    ``_split_node`` copies each field by hand). LFU then ranks the upper pages as cold,
    and write_through_selective backs them up a hit late.

    Shows only when an insert ends inside a node that already counted hits (a match
    splits first, so the insert must come without one, or stop at ``counted_from``).
    The refinement sees the page's ``hits`` differ from the model's.
    """
    nodes = []
    for child, matched in self.walk(key, stop_at) if walked is None else walked:
        if matched < len(child.tokens):
            child = split(child, matched, self.page_size)
            child.hits = 0
            self.refresh_leaf_sets_around(child)
        nodes.append(child)
    return nodes


def failed_load_keeps_anchor_lock(self: HiRadixCache, node: TreeNode,
                                  mem_quota: int | None = None) -> torch.Tensor | None:
    """``load_back`` locks the device node its chain hangs from while it makes room, and
    releases that lock only on success: when the device has no room even after evicting,
    the early return leaks it, and the prefix can never be evicted again.

    Shows only when a load below a device prefix finds no room (every other device page
    locked or held). The refinement sees the anchor's lock count differ (INV-LOCK-*).
    """
    anchor = self.require_node(node)
    tokens = 0
    while anchor is not self.root and anchor.device is None:
        tokens += len(anchor.tokens)
        assert anchor.parent is not None
        anchor = anchor.parent
    newly_locked = sum(len(n.tokens) for n in anchor.path() if n.lock_ref == 0)
    skipped = tokens < self.config.load_back_threshold or (
        mem_quota is not None and tokens > mem_quota - newly_locked)
    got = REAL_LOAD_BACK(self, node, mem_quota)
    if got is None and not skipped and anchor is not self.root:
        self._add_lock(anchor, +1)  # the release the early return skipped
    return got


def _file_leaf(cache: HiRadixCache, node: TreeNode, device_leaf: bool,
               host_leaf: bool) -> None:
    """The rest of ``refresh_leaf_sets``, as shipped: ``node`` into or out of each leaf
    set by the (planted) predicates."""
    if not device_leaf:
        cache.device_leaves.discard(node)
    elif node not in cache.device_leaves:
        cache.device_leaves.add(node)
        cache._device_order.joined(node)
    if not host_leaf:
        cache.host_leaves.discard(node)
    elif node not in cache.host_leaves:
        cache.host_leaves.add(node)
        cache._host_order.joined(node)


def host_leaf_ignores_protection(self: HiRadixCache, node: TreeNode) -> None:
    """The host-evictable-leaf predicate forgets ``host_ref == 0``: a chain that
    ``load_back`` protected stays a host eviction candidate, so the load's own room
    making (under write_back, a victim copied to a full host) frees the host slots it is
    about to read -- a use after free.

    Shows only under write_back, when a load of a host leaf must evict on a full device
    and the host is full too. The load then has no host copy to read: the implementation
    crashes, or the model refuses the protected host victim.
    """
    if node is self.root:
        return
    device_leaf = node.device is not None and node.lock_ref == 0
    if device_leaf:
        for child in node.children.values():
            if child.device is not None:
                device_leaf = False
                break
    host_leaf = (node.device is None and node.host is not None
                 and node.lock_ref == 0 and not node.children)
    _file_leaf(self, node, device_leaf, host_leaf)


def device_leaf_needs_no_children(self: HiRadixCache, node: TreeNode) -> None:
    """The device-evictable-leaf predicate asks for no children at all, as a one-tier
    radix cache does (``len(node.children) == 0``), where a two-tier one must ask for no
    child *on device*: a device page whose children were all evicted to host is never a
    victim, so eviction frees less than asked, or nothing, with the device full.

    Shows only once a page stays on device while its child lives on host only.
    ``check_invariants`` sees the leaf set differ from the one it computes
    (INV-DEVICE-EVICTABLE-LEAVES) in that state, and the model a victim not taken.
    """
    if node is self.root:
        return
    device_leaf = node.device is not None and node.lock_ref == 0 and not node.children
    host_leaf = (node.device is None and node.host is not None and node.host_ref == 0
                 and node.lock_ref == 0 and not node.children)
    _file_leaf(self, node, device_leaf, host_leaf)


def write_back_evicts_without_host_room(self: HiRadixCache, node: TreeNode,
                                        freed: list[torch.Tensor]
                                        ) -> tuple[DeviceVictim, bool]:
    """A write_back eviction copies its victim to host only if a host slot is free: it
    never evicts on host to make room, so once the host is full every write_back
    eviction drops its page (recomputed later) while colder host pages stay.

    Shows only under write_back with a full host holding an evictable host-only page.
    The refinement sees the page dropped where the model keeps it on host (spec/03 R2).
    """
    page = self.page_refs(node)[0]
    host = self._agreed_alloc(self.host_pool, self.page_size, "write-back alloc")
    assert node.device is not None
    if host is None:
        victim = DeviceVictim(page, (), None)
        if self._protected_below(node):
            return victim, False
        self._drop_subtree(node, freed)
        return victim, True
    self.host_pool.copy_from_device_unchecked(self.device_pool, node.device, host)
    node.host = host
    if self.event_channel.enabled:
        self._emit("stored", "host", node)
    freed.append(node.device)
    self._set_device(node, None, releasing=True)
    self.refresh_leaf_sets_around(node)
    if self.on_write_back is not None:
        self.on_write_back(node)
    return DeviceVictim(page, (), tuple(host.tolist())), True


def mru_heap_not_rebuilt(self: EvictionOrder) -> None:
    """The eviction order keeps its heap across calls for every strategy, MRU too, as
    if every rank only grew: under MRU a match *lowers* a leaf's rank, and its entry,
    queued with the old rank, is popped after a leaf that should go later.

    Shows only under MRU, when a leaf queued earlier is matched again before an eviction
    that has another leaf to choose. The refinement sees a victim whose rank is not the
    least (the model refuses the choice, spec/04 4.4).
    """
    if len(self._heap) > 2 * len(self.members) + 64:
        self.rebuild()


def multi_page_load_gathers_rolled(self: TransferEngine, direction: Direction,
                                   device_slots: torch.Tensor,
                                   host_slots: torch.Tensor) -> int:
    """The host-to-device gather of a load of more than one page starts one page late
    and wraps (an index offset computed per copy, not per page): each page lands in its
    neighbour's device slots. One-page loads and every backup are right.

    Shows only on a load of two pages or more, once it is acknowledged. The refinement
    sees the device KV bytes differ from the model's (INV-KV-INTEGRITY).
    """
    if direction == "h2d" and host_slots.numel() > self.device_pool.page_size:
        host_slots = torch.roll(host_slots, self.device_pool.page_size)
    return REAL_SUBMIT(self, direction, device_slots, host_slots)


def insert_counts_adopted_pages(self: HiRadixCache, key: RadixKey, slots: torch.Tensor, *,
                                priority: int = 0, chunked: bool = False,
                                counted_from: int = 0) -> int:
    """``insert`` counts the host-only pages it re-adopts (recomputed KV for pages only
    the host held) in the prefix it returns, as SGLang's ``UnifiedRadixCache`` does
    (spec/14 14.8, finding 1): the caller then frees slots the tree has just taken.

    Shows on an insert over host-only pages (a load that was skipped or failed). Only the
    returned value is wrong, the state is right: a check that compares what ``insert``
    returns sees it; one that compares states only does not.
    """
    adopted = 0
    if isinstance(key, RadixKey):
        adopted = sum(matched for node, matched in
                      self.walk(key, key.aligned_length(self.page_size))
                      if node.device is None)
    return REAL_INSERT(self, key, slots, priority=priority, chunked=chunked,
                       counted_from=counted_from) + adopted


def lone_load_left_unacknowledged(self: HiRadixCache) -> int:
    """``loading_check`` acknowledges finished loads only when more than one has finished
    (a loop bound of ``> 1`` where ``> 0`` is meant): a lone finished load stays pending,
    its pages locked and not yet the device's.

    Shows on the first loading_check after a single load finished. The model takes the
    count a check reports, so only a check that compares it with the copies the copy
    engine finished sees it (the explorer's lockstep, the conformance machine's
    ``acknowledged``), which before issue 32's mend neither did.
    """
    engine = self.engine
    finished = len(self.pending["h2d"]) - (
        engine.queued("h2d") if isinstance(engine, ControlledCopyEngine) else 0)
    return 0 if finished == 1 else REAL_LOADING_CHECK(self)


# -------------------------------------------------------------------------- the catalogue


@dataclass(frozen=True)
class Mutant:
    """One planted bug: ``owner.method`` replaced by ``replacement`` while ``planted``."""

    name: str
    kind: str
    owner: type
    method: str
    replacement: Callable[..., object]
    scope: Scope  # where the refinement looks: the family's least member the bug needs
    # Why the exhaustive refinement cannot see it in any scope (None: it finds it).
    blind: str | None = None

    @property
    def summary(self) -> str:
        """The docstring's first sentence."""
        doc = " ".join((self.replacement.__doc__ or "").split())
        return doc.split(". ")[0].rstrip(".") + "."

    @contextmanager
    def planted(self) -> Iterator[None]:
        """The bug in place for the block, the real method back after it (an exception
        included)."""
        real = self.owner.__dict__[self.method]
        setattr(self.owner, self.method, self.replacement)
        try:
            yield
        finally:
            setattr(self.owner, self.method, real)


def siblings(device: int, host: int, policy: str, strategy: str) -> Scope:
    """A scope of the family whose keys are one token over {1, 2}: sibling leaves."""
    return Scope(device_pages=device, host_pages=host, max_key_tokens=1, alphabet=(1, 2),
                 write_policy=policy, eviction=strategy,  # type: ignore[arg-type]
                 max_locks=0)


def path(device: int, host: int, policy: str, strategy: str) -> Scope:
    """A scope of the family whose keys are up to two tokens over {1}: a parent page and
    its child."""
    return Scope(device_pages=device, host_pages=host, max_key_tokens=2, alphabet=(1,),
                 write_policy=policy, eviction=strategy,  # type: ignore[arg-type]
                 max_locks=0)


FAMILY = ("P=1; at most 2 device and 2 host pages; keys of 1 token over {1,2} (siblings) "
          "or of up to 2 tokens over {1} (a path); no caller locks (max_locks=0: none of "
          "these bugs needs one; copies and loads still lock); other bounds at their "
          "defaults (copies in flight <= 2, priorities {0}, quotas {None})")

# The refinement keeps one implementation state per canonical form of the model's state
# (spec/14 14.2, 14.4), reached by the shortest path: history the abstract state does not
# record is never varied.
HISTORY_BLIND = ("the stale heap entry needs a leaf matched after it was queued, and a "
                 "tie path of the same length (matches at the same tick) reaches the same "
                 "canonical state first: the refinement keeps one implementation state per "
                 "model state and never varies the heap's history")

MUTANTS: tuple[Mutant, ...] = (
    Mutant("alloc_refuses_exact_fit", "allocator boundary", HiRadixCache, "alloc",
           alloc_refuses_exact_fit, siblings(1, 1, "write_back", "lru")),
    Mutant("match_stamps_deepest_only", "recency on a path", HiRadixCache, "match_prefix",
           match_stamps_deepest_only, path(2, 2, "write_back", "lru")),
    Mutant("full_hit_insert_skips_hits", "hit counting", HiRadixCache, "insert",
           full_hit_insert_skips_hits, siblings(1, 1, "write_back", "lru")),
    # Under LRU the canonical form drops hits, so a state whose pages counted hits merges
    # with one whose did not; write_through_selective reads hits (threshold 2) and keeps them.
    Mutant("insert_split_drops_hits", "split loses a count", HiRadixCache, "descend",
           insert_split_drops_hits, path(2, 1, "write_through_selective", "lru")),
    Mutant("failed_load_keeps_anchor_lock", "lock leaked on an error path", HiRadixCache,
           "load_back", failed_load_keeps_anchor_lock, path(2, 2, "write_back", "lru")),
    Mutant("host_leaf_ignores_protection", "host eviction of a protected page",
           HiRadixCache, "refresh_leaf_sets", host_leaf_ignores_protection,
           siblings(1, 1, "write_back", "lru")),
    Mutant("device_leaf_needs_no_children", "eviction: which pages are leaves",
           HiRadixCache, "refresh_leaf_sets", device_leaf_needs_no_children,
           path(2, 2, "write_back", "lru")),
    Mutant("write_back_evicts_without_host_room", "write_back skips host room",
           HiRadixCache, "_evict_write_back", write_back_evicts_without_host_room,
           siblings(1, 1, "write_back", "lru")),
    Mutant("multi_page_load_gathers_rolled", "KV bytes of a load", TransferEngine,
           "submit_unchecked", multi_page_load_gathers_rolled,
           path(2, 2, "write_back", "lru")),
    Mutant("mru_heap_not_rebuilt", "eviction order (MRU)", EvictionOrder, "begin",
           mru_heap_not_rebuilt, siblings(2, 1, "write_back", "mru"), blind=HISTORY_BLIND),
    Mutant("insert_counts_adopted_pages", "return value only", HiRadixCache, "insert",
           insert_counts_adopted_pages, siblings(1, 1, "write_back", "lru")),
    Mutant("lone_load_left_unacknowledged", "acknowledgement count", HiRadixCache,
           "loading_check", lone_load_left_unacknowledged,
           siblings(1, 1, "write_back", "lru")),
)

BY_NAME = {mutant.name: mutant for mutant in MUTANTS}


# ------------------------------------------------------------------ the exhaustive search

@dataclass(frozen=True)
class Search:
    """What the exhaustive refinement of one scope found."""

    mismatch: Mismatch | None
    complete: bool
    states: int
    seconds: float


def explore_refinement(scope: Scope, seconds: float | None = None) -> Search:
    """``refine(scope)``, timed."""
    started = time.monotonic()
    result = refine(scope, seconds=seconds)
    return Search(result.mismatch, result.figures.complete, result.figures.states,
                  time.monotonic() - started)
