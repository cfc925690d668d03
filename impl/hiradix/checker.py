"""check_invariants(): every invariant of spec/05 on the concrete tree.

Written against the tree, not the model (the implementation never imports the model), so
it is a second, independent statement of each invariant. It is cheap enough to call
after every step in tests: one pass over the nodes plus set operations.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hiradix.errors import InvariantViolation
from hiradix.keys import TOKEN_BYTES
from hiradix.tree import TreeNode

if TYPE_CHECKING:
    from hiradix.cache import HiRadixCache

Problems = list[str]


def _tree(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    ps, found = cache.page_size, []
    for node in nodes:
        parent = node.parent
        # The segment is its packed bytes, which matching compares (keys.common_pages):
        # the tree's own, never a view of a caller's buffer (a borrowed key's, issue 29).
        if type(node.packed) is not bytes or len(node.packed) != node.length * TOKEN_BYTES:
            found.append(f"{node!r}: its segment is not {node.length} tokens of bytes of "
                         f"its own ({type(node.packed).__name__})")
        if not node.length or node.length % ps:
            found.append(f"{node!r}: segment length {node.length} is not a page multiple")
        if parent is None or parent.children.get(node.child_key(ps)) is not node:
            found.append(f"{node!r}: not reachable from its parent under its child key")
        for tier, slots in (("device", node.device), ("host", node.host)):
            if slots is not None and (slots.dtype != torch.int64 or slots.dim() != 1
                                      or slots.numel() != node.length):
                found.append(f"{node!r}: {tier} slots are not one int64 per token")
            elif (slots is not None and node.length % ps == 0
                  and not _whole_pages_in_order(slots, ps)):
                # Release trusts this and checks page heads only (_slots.release).
                found.append(f"{node!r}: {tier} slots {slots.tolist()} are not whole pages "
                             "in order (R7)")
    return found


def _whole_pages_in_order(slots: torch.Tensor, page_size: int) -> bool:
    runs = slots.view(-1, page_size)
    heads = runs[:, :1]
    return not bool((heads % page_size).any()) and torch.equal(
        runs, heads + torch.arange(page_size, dtype=torch.int64))


def _resident(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    return [f"{n!r}: on neither tier" for n in nodes if n.device is None and n.host is None]


def _in_flight(cache: HiRadixCache, direction: str) -> set[int]:
    return {s for copy in cache.pending[direction] for s in copy.dst.tolist()}  # type: ignore[index]


def _evicted_has_host(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    arriving = _in_flight(cache, "d2h")
    return [f"{n!r}: evicted while its host copy is in flight" for n in nodes
            if n.device is None and n.host is not None and set(n.host.tolist()) & arriving]


def _device_prefix_closed(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    return [f"{n!r}: on device below a node that is not" for n in nodes
            if n.device is not None and n.parent is not cache.root
            and n.parent is not None and n.parent.device is None]


def _backup_contiguous(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    if cache.config.write_policy == "write_back":
        return []
    return [f"{n!r}: backed up below a node that is not" for n in nodes
            if n.host is not None and n.parent is not cache.root
            and n.parent is not None and n.parent.host is None]


def _lock_on_device(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    return [f"{n!r}: locked but not on device" for n in nodes
            if n.lock_ref > 0 and n.device is None]


def _lock_monotone(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    found = [f"{n!r}: negative count" for n in nodes if n.lock_ref < 0 or n.host_ref < 0]
    found += [f"{n!r}: lock exceeds its parent's {n.parent!r}" for n in nodes
              if n.parent is not cache.root and n.parent is not None
              and n.parent.lock_ref < n.lock_ref]
    return found + _anchors(cache, nodes)


def _anchors(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    """Every lock is taken at one node (its anchor) and counted there and on each node
    above (``_add_lock``), so a node's lock is exactly the caller locks taken at it
    (``anchored_locks``, what ``dec_lock_ref`` may release, spec/03 3.7), the copies in
    flight locked at it, and its children's locks. Between operations nothing else holds
    a lock (``load_back``'s hold on its anchor ends inside the call)."""
    copies: Counter[TreeNode] = Counter(copy.lock_node for queue in cache.pending.values()
                                        for copy in queue)
    found = []
    for node in nodes:
        below = sum(child.lock_ref for child in node.children.values())
        if node.anchored_locks < 0 or \
                node.lock_ref != node.anchored_locks + copies[node] + below:
            found.append(f"{node!r}: lock {node.lock_ref} is not its caller locks taken "
                         f"there ({node.anchored_locks}) + copies in flight locked there "
                         f"({copies[node]}) + its children's locks ({below})")
    return found


def _accounting(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    unlocked = sum(n.length for n in nodes if n.device is not None and n.lock_ref == 0)
    locked = sum(n.length for n in nodes if n.device is not None and n.lock_ref > 0)
    found = []
    if cache.evictable_tokens != unlocked:
        found.append(f"evictable_tokens {cache.evictable_tokens} != unlocked device tokens "
                     f"{unlocked}")
    if cache.protected_tokens != locked:
        found.append(f"protected_tokens {cache.protected_tokens} != locked device tokens {locked}")
    return found


def _ownership(owned: list[int], free: frozenset[int], capacity: int, what: str) -> Problems:
    found = []
    twice = sorted(s for s, n in Counter(owned).items() if n > 1)
    if twice:
        found.append(f"{what} slots owned twice by the tree: {twice}")
    on_free_list = sorted(set(owned) & free)
    if on_free_list:
        found.append(f"{what} slots owned by the tree and on the free list: {on_free_list}")
    outside = sorted(s for s in owned if not 0 <= s < capacity)
    if outside:
        found.append(f"{what} slots outside the pool: {outside}")
    return found


def _device_pool(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    owned = [s for n in nodes if n.device is not None for s in n.device.tolist()]
    found = _ownership(owned, cache.device_pool.free_slots(), cache.device_pool.num_slots,
                       "device")
    marked = set(cache.device_owned.tensor.nonzero().flatten().tolist())
    if marked != set(owned):
        found.append(f"ownership map disagrees with the tree: marked only "
                     f"{sorted(marked - set(owned))}, unmarked {sorted(set(owned) - marked)}")
    return found


def _host_pool(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    owned = [s for n in nodes if n.host is not None for s in n.host.tolist()]
    pool = cache.host_pool
    found = _ownership(owned, pool.free_slots(), pool.num_slots, "host")
    # Only the tree and the storage tier (spec/09, 9.2: slots a prefetch reserved, or
    # queued for release) allocate host slots: every allocated one is exactly one's.
    outside = set(range(pool.num_slots)) - pool.free_slots() - set(owned)
    tier = cache.storage
    held = [] if tier is None else tier.host_slots_owned()
    leaked = sorted(outside - set(held))
    if leaked:
        found.append(f"host slots allocated but owned by nobody (leaked): {leaked}")
    claimed = sorted(set(held) - outside)
    if claimed:
        found.append(f"host slots the storage tier holds that are free or the tree's: "
                     f"{claimed}")
    twice = sorted(s for s, n in Counter(held).items() if n > 1)
    if twice:
        found.append(f"host slots the storage tier holds twice: {twice}")
    return found


def _device_leaves(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    expected = {n for n in nodes if n.device is not None and n.lock_ref == 0
                and not any(c.device is not None for c in n.children.values())}
    found = []
    if cache.device_leaves != expected:
        missing = sorted(expected - cache.device_leaves, key=id)
        extra = sorted(cache.device_leaves - expected, key=id)
        found.append(f"evictable device leaves: missing {missing}, extra {extra}")
    if cache.evictable_tokens > 0 and not expected:
        found.append("tokens are evictable but no device leaf is")
    return found


def _host_leaves(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    expected = {n for n in nodes if n.device is None and n.host is not None
                and n.host_ref == 0 and n.lock_ref == 0 and not n.children}
    if cache.host_leaves != expected:
        return [f"evictable host leaves: missing {sorted(expected - cache.host_leaves, key=id)}"
                f", extra {sorted(cache.host_leaves - expected, key=id)}"]
    return []


def _host_protect(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    free = cache.host_pool.free_slots()
    found = [f"{n!r}: protected without a host copy" for n in nodes
             if n.host_ref > 0 and n.host is None]
    found += [f"{n!r}: protected host copy is on the free list" for n in nodes
              if n.host_ref > 0 and n.host is not None and set(n.host.tolist()) & free]
    return found


def _transfer_pinned(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    found = []
    held: Counter[TreeNode] = Counter()
    for direction, queue in cache.pending.items():
        for copy in queue:
            covered = copy.nodes()
            if covered is None:
                found.append(f"{direction} copy {copy.ticket}: its {copy.tokens} tokens no "
                             f"longer end at {copy.lock_node!r}")
                continue
            none = torch.empty(0, dtype=torch.int64)
            device = torch.cat([none if n.device is None else n.device for n in covered])
            host = torch.cat([none if n.host is None else n.host for n in covered])
            src, dst = (device, host) if direction == "d2h" else (host, device)
            if not (torch.equal(src, copy.src) and torch.equal(dst, copy.dst)):
                found.append(f"{direction} copy {copy.ticket}: its slots moved while in flight")
            if direction == "h2d" and any(n.host_ref < 1 for n in covered):
                found.append(f"h2d copy {copy.ticket}: a source host copy is not protected")
            held.update(copy.lock_node.path())
    found += [f"{n!r}: lock {n.lock_ref} below the {k} its copies in flight hold"
              for n, k in held.items() if n.lock_ref < k]
    return found


def _kv_integrity(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    # The implementation cannot know what KV a prefix should have; it can check that a
    # page's two copies agree wherever no copy is still moving bytes into either.
    arriving = _in_flight(cache, "d2h") | _in_flight(cache, "h2d")
    found = []
    for node in nodes:
        if node.device is None or node.host is None:
            continue
        if set(node.device.tolist()) & arriving or set(node.host.tolist()) & arriving:
            continue
        if not torch.equal(cache.device_pool.read(node.device).cpu(),
                           cache.host_pool.read(node.host)):
            found.append(f"{node!r}: device and host copies differ")
    return found


def _namespace(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    return [f"{n!r}: namespace differs from its parent's" for n in nodes
            if n.parent is not cache.root and n.parent is not None
            and n.parent.namespace != n.namespace]


def _clock(cache: HiRadixCache, nodes: list[TreeNode]) -> Problems:
    return [f"{n!r}: ticks out of order ({n.insert_tick}, {n.last_tick}, clock "
            f"{cache.last_tick})" for n in nodes
            if not n.insert_tick <= n.last_tick <= cache.last_tick]


CHECKS: dict[str, Callable[[HiRadixCache, list[TreeNode]], Problems]] = {
    "INV-TREE-WELL-FORMED": _tree,
    "INV-RESIDENT": _resident,
    "INV-EVICTED-HAS-HOST": _evicted_has_host,
    "INV-DEVICE-PREFIX-CLOSED": _device_prefix_closed,
    "INV-BACKUP-CONTIGUOUS": _backup_contiguous,
    "INV-LOCK-ON-DEVICE": _lock_on_device,
    "INV-LOCK-MONOTONE": _lock_monotone,
    "INV-ACCOUNTING": _accounting,
    "INV-DEVICE-POOL-CONSERVATION": _device_pool,
    "INV-HOST-POOL-CONSERVATION": _host_pool,
    "INV-DEVICE-EVICTABLE-LEAVES": _device_leaves,
    "INV-HOST-EVICTABLE-LEAVES": _host_leaves,
    "INV-HOST-PROTECT": _host_protect,
    "INV-TRANSFER-PINNED": _transfer_pinned,
    "INV-KV-INTEGRITY": _kv_integrity,
    "INV-NAMESPACE-ISOLATION": _namespace,
    "INV-CLOCK-MONOTONE": _clock,
}


def failures(cache: HiRadixCache) -> dict[str, Problems]:
    """Every failing spec ID with what was found."""
    nodes = cache.nodes()
    found = {spec_id: check(cache, nodes) for spec_id, check in CHECKS.items()}
    return {spec_id: problems for spec_id, problems in found.items() if problems}


def check(cache: HiRadixCache) -> None:
    """Raise InvariantViolation for the first failing invariant, with the tree dumped."""
    found = failures(cache)
    if found:
        spec_id, problems = next(iter(found.items()))
        others = [f"(also failing: {other})" for other in found if other != spec_id]
        raise InvariantViolation(spec_id, problems + others, cache.dump())
