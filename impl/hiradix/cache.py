"""HiRadixCache: the two-tier radix KV cache (spec/03 transcribed onto a radix tree).

The tree holds token segments; each node's device and host slots are int64 tensors.
Bookkeeping that SGLang keeps and ships bugs in is kept here explicitly and audited by
``check_invariants()``: lock refs (INV-LOCK-MONOTONE), host protection counts
(INV-HOST-PROTECT), the evictable/protected token counters (INV-ACCOUNTING), the two
evictable-leaf sets (INV-DEVICE-/HOST-EVICTABLE-LEAVES) and the copies in flight
(INV-TRANSFER-PINNED).

Every public method validates its arguments before it changes anything, so a typed
error from ``hiradix.errors`` leaves the cache as it was.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

from hiradix import checker
from hiradix._slots import SlotMarks, is_int
from hiradix.clock import Clock, CountingClock
from hiradix.config import CacheConfig, KVShape
from hiradix.decisions import BackupDecision, DeviceVictim, LoadDecision, PageRef, Recorder
from hiradix.device_pool import DeviceKVPool
from hiradix.distributed import LocalSync, RankSync, check_sync
from hiradix.errors import (
    ConfigError,
    EventSinkError,
    ForeignNode,
    InvalidArgument,
    NotLocked,
    RankSyncError,
    SlotError,
)
from hiradix.events import (
    EventChannel,
    EventKind,
    EventSink,
    KVEvent,
    Medium,
    check_sink,
    delivering,
)
from hiradix.host_pool import HostKVPool, HostLayout
from hiradix.keys import TOKEN_BYTES, RadixKey, child_key, common_pages, holds_at
from hiradix.policies import EvictionOrder, Strategy, WritePolicy, backup_threshold
from hiradix.storage.backend import StorageBackend
from hiradix.storage.tier import StorageTier, TierSettings
from hiradix.transfer import Direction, EngineKind, TransferEngine, make_engine
from hiradix.tree import TreeNode, split

EMPTY = torch.empty(0, dtype=torch.int64)


def check_clock(clock: object) -> None:
    """None or a ``Clock`` (a callable ``now``), else ``ConfigError`` naming ``clock``."""
    if clock is not None and not (isinstance(clock, Clock) and callable(clock.now)):
        raise ConfigError("clock", f"must be None or a Clock (a now() -> int method), got "
                                   f"{type(clock).__name__}")


class MatchResult(NamedTuple):
    """What ``match_prefix`` found (a named tuple: the cheapest immutable record to build,
    and one is built per request, issue 13)."""

    device_slots: torch.Tensor  # slots of the leading run of device pages
    last_device_node: TreeNode  # deepest node of that run (the root if none)
    last_host_node: TreeNode  # deepest matched node with a host copy (the root if none)
    host_hit_length: int  # tokens of matched host-only pages after the device run


@dataclass
class PendingCopy:
    """A copy in flight: its tokens end at ``lock_node`` (the deepest page) and run up
    the path from there; ``lock_node``'s root path is locked until acknowledged."""

    ticket: int
    seq: int  # issue order across both directions
    lock_node: TreeNode
    tokens: int
    src: torch.Tensor
    dst: torch.Tensor

    def nodes(self) -> list[TreeNode] | None:
        """The nodes the copy covers, root-most first: ``tokens`` tokens up the path from
        ``lock_node``. None if no node boundary falls exactly there (a broken copy).

        Splits keep this exact: the lower part of a split keeps the node object.
        """
        nodes, covered = [], 0
        for node in self.lock_node.path():
            if covered >= self.tokens:
                break
            nodes.append(node)
            covered += node.length
        return nodes[::-1] if covered == self.tokens else None


class HiRadixCache:
    """The two-tier radix KV cache. ``create`` builds one with its pools in one call; the
    constructor takes pools built by hand. Method names follow SGLang's ``HiRadixCache``
    (``match_prefix``, ``insert``, ``inc_lock_ref``, ``init_load_back``, ``writing_check``,
    ``evictable_size``, ``attach_storage_backend``); README.md tabulates the differences.
    """

    @classmethod
    def create(
        cls,
        *,
        device_slots: int,
        page_size: int = 1,
        host_ratio: float | None = 2.0,
        host_bytes: int | None = None,
        kv: KVShape | None = None,
        device: torch.device | str = "cpu",
        write_policy: WritePolicy = "write_through",
        eviction: Strategy = "lru",
        host_layout: HostLayout = "layer_first",
        load_back_threshold: int = 10,
        transfer: EngineKind = "auto",
        clock: Clock | None = None,
        sync: RankSync | None = None,
        events: EventSink | None = None,
    ) -> HiRadixCache:
        """A cache with its device pool (``device_slots`` token slots of ``kv`` on
        ``device``), its host pool (``host_ratio`` times the device slots, or
        ``host_bytes``, as SGLang's ``--hicache-ratio`` / ``--hicache-size``; give
        ``host_bytes`` and ``host_ratio=None``) and its copy engine (``auto``: CUDA streams
        on a CUDA device, else synchronous copies). Every argument is checked before
        anything is allocated; a bad one raises ``ConfigError`` naming it. ``events``
        receives the KV events (spec/11; ``hiradix.events``)."""
        config = CacheConfig(page_size=page_size, write_policy=write_policy, eviction=eviction,
                             load_back_threshold=load_back_threshold)
        check_clock(clock)
        check_sync(sync)
        check_sink(events)
        if not is_int(device_slots) or device_slots < page_size \
                or device_slots % page_size:
            raise ConfigError("device_slots", f"must be an int, a positive multiple of "
                                              f"page_size {page_size}, got {device_slots!r}")
        shape = KVShape() if kv is None else kv
        if not isinstance(shape, KVShape):
            raise ConfigError("kv", f"must be a KVShape, got {type(kv).__name__}")
        renamed = {"ratio": "host_ratio", "size_bytes": "host_bytes",
                   "ratio/size_bytes": "host_ratio/host_bytes", "layout": "host_layout",
                   "kind": "transfer"}
        try:
            device_pool = DeviceKVPool(
                num_slots=device_slots, page_size=page_size, layers=shape.layers,
                layout=shape.layout, heads=shape.heads, head_dim=shape.head_dim,
                latent_dim=shape.latent_dim, dtype=shape.dtype, device=device)
            host_pool = HostKVPool.for_device(device_pool, ratio=host_ratio,
                                              size_bytes=host_bytes, layout=host_layout)
            engine = make_engine(transfer, device_pool, host_pool)
        except SlotError as error:  # the pools' argument names, in this method's words
            raise ConfigError(renamed.get(error.argument, error.argument),
                              error.reason) from error
        if host_pool.num_slots <= device_pool.num_slots:
            # SGLang refuses it too: the host tier holds every device page's backup, and
            # storage prefetch gets 4/5 of the host beyond the device (spec/09, 9.4).
            raise ConfigError("host_ratio" if host_ratio is not None else "host_bytes",
                              f"gives {host_pool.num_slots} host slots, not more than the "
                              f"{device_pool.num_slots} device slots (SGLang needs "
                              "host_ratio > 1)")
        return cls(config, device_pool, host_pool, engine, clock=clock, sync=sync,
                   events=events)

    def __init__(
        self,
        config: CacheConfig,
        device_pool: DeviceKVPool,
        host_pool: HostKVPool,
        engine: TransferEngine,
        *,
        clock: Clock | None = None,
        sync: RankSync | None = None,
        recorder: Recorder | None = None,
        events: EventSink | None = None,
    ) -> None:
        if device_pool.page_size != config.page_size or host_pool.page_size != config.page_size:
            raise InvalidArgument("device_pool/host_pool", "page sizes differ from the config")
        check_clock(clock)
        check_sync(sync)
        # The KV event channel (spec/11, 11.7): events reach the sink after each
        # operation, its state whole; None: no events, and nothing is built for them.
        self.event_channel = EventChannel(events)
        self.config = config
        self.page_size = config.page_size
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.engine = engine
        self.clock: Clock = clock or CountingClock()
        self.sync: RankSync = sync or LocalSync()
        self.recorder = recorder
        # Called with each node a write_back eviction has just copied to host (one page,
        # host copy complete), so a storage tier can back it up (spec/09, S-R1).
        self.on_write_back: Callable[[TreeNode], None] | None = None
        # Called first by reset, so a storage tier stops its I/O before the pools are
        # reset under it and drops what it held of the old tree (spec/09, 9.4).
        self.on_reset: Callable[[], None] | None = None
        self._storage: StorageTier | None = None  # attach_storage_backend's tier
        self._in_tier_writing_check = False
        self._threshold = backup_threshold(config.write_policy)
        try:
            self.reset()
        except EventSinkError as error:  # the cache is built: the caller gets it there
            error.result = self
            raise

    @property
    def events(self) -> EventSink | None:
        """The KV event sink (spec/11), or None. Settable: None or a callable taking a
        ``KVEvent``, else ``ConfigError`` naming ``events`` and nothing changed."""
        return self.event_channel.sink

    @events.setter
    def events(self, sink: EventSink | None) -> None:
        self.event_channel.sink = sink

    # ------------------------------------------------------------------ state

    @delivering
    def reset(self) -> None:
        """Drop everything, including copies in flight and slots callers hold."""
        if self.on_reset is not None:
            self.on_reset()
        self.engine.reset()
        self.device_pool.reset()
        self.host_pool.reset()
        self.root = TreeNode(self, None, b"", None)  # owns no slots, is never evicted
        # Which device slots a node owns: tells a caller's slot from the tree's in O(1).
        self._device_owned = SlotMarks(self.device_pool.num_slots)
        # The pools' own ``free`` refuses the tree's slots from now on (issue 34).
        self.device_pool.claim(self._device_owned)
        self.host_pool.claim("all")
        self.evictable_tokens = 0
        self.protected_tokens = 0
        self.device_leaves: set[TreeNode] = set()
        self.host_leaves: set[TreeNode] = set()
        # The two sets in eviction order, kept across calls (not heapified per evict).
        self._device_order = EvictionOrder(self.config.eviction, self.device_leaves)
        self._host_order = EvictionOrder(self.config.eviction, self.host_leaves)
        self.pending: dict[Direction, deque[PendingCopy]] = {"d2h": deque(), "h2d": deque()}
        self._issued = 0
        self.last_tick = 0
        if self.event_channel.enabled:  # spec/11 11.3: reset empties device and host
            self.event_channel.emit(KVEvent("cleared", "device"))
            self.event_channel.emit(KVEvent("cleared", "host"))

    @property
    def device_owned(self) -> SlotMarks:
        """Which device slots a node owns (the checker audits it against the tree,
        INV-DEVICE-POOL-CONSERVATION). Read only: the cache keeps it."""
        return self._device_owned

    def evictable_size(self) -> int:
        return self.evictable_tokens

    def protected_size(self) -> int:
        return self.protected_tokens

    def now(self) -> int:
        """The cache's logical clock read for one operation (spec/09, 9.1 "Which clock
        counts what": recency stamps are always this clock), recorded as ``last_tick``;
        ``InvalidArgument`` on ``clock`` if it went backwards (INV-CLOCK-MONOTONE)."""
        tick = self.clock.now()
        if tick < self.last_tick:
            raise InvalidArgument("clock", f"went backwards ({tick} < {self.last_tick})")
        self.last_tick = tick
        return tick

    # Every change of a node's device presence or lock count goes through these two, so
    # the counters cannot drift (INV-ACCOUNTING).
    def _count(self, node: TreeNode, sign: int) -> None:
        if node.device is not None:
            if node.lock_ref == 0:
                self.evictable_tokens += sign * node.length
            else:
                self.protected_tokens += sign * node.length

    def _set_device(self, node: TreeNode, slots: torch.Tensor | None, *,
                    releasing: bool = False) -> None:
        """``releasing``: the old slots go to an eviction's ``freed``, whose release
        (``release_parts`` at its end) clears their ownership for all its nodes in one call."""
        if self.event_channel.enabled and (node.device is None) != (slots is None):
            self._emit("stored" if slots is not None else "removed", "device", node)
        self._count(node, -1)
        if node.device is not None and not releasing:
            self._device_owned.set(node.device, False)
        node.device = slots
        if slots is not None:
            self._device_owned.set(slots, True)
        self._count(node, +1)

    def _emit(self, kind: EventKind, medium: Medium, node: TreeNode) -> None:
        """One event per page of ``node``, root-most first (spec/11, 11.1), to the
        channel (delivered when the operation is done, 11.7)."""
        self.event_channel.emit_pages(kind, medium, node.namespace, node.prefix(),
                                      node.length, self.page_size)

    def _add_lock(self, node: TreeNode, delta: int) -> int:
        """Add ``delta`` to the lock of ``node`` and its ancestors; return evictable change."""
        before = self.evictable_tokens
        for n in node.path():
            self._count(n, -1)
            n.lock_ref += delta
            self._count(n, +1)
            self.refresh_leaf_sets(n)
        return self.evictable_tokens - before

    def refresh_leaf_sets(self, node: TreeNode) -> None:
        """Recompute ``node``'s membership of the two evictable-leaf sets, after a change
        of its tiers, counters or children (INV-DEVICE-/HOST-EVICTABLE-LEAVES; the storage
        tier's host protections keep pages out of them, spec/09 9.4 "Changes to
        operations of 03").

        ``_drop_device_copy`` writes these rules out for eviction's one case, for speed:
        a change to either set's rule here must be made there too."""
        if node is self.root:
            return
        device_leaf = node.device is not None and node.lock_ref == 0
        if device_leaf:
            for child in node.children.values():  # a loop: cheaper than any() on a genexpr
                if child.device is not None:
                    device_leaf = False
                    break
        host_leaf = (node.device is None and node.host is not None and node.host_ref == 0
                     and node.lock_ref == 0 and not node.children)
        if not device_leaf:
            self.device_leaves.discard(node)
        elif node not in self.device_leaves:
            self.device_leaves.add(node)
            self._device_order.joined(node)
        if not host_leaf:
            self.host_leaves.discard(node)
        elif node not in self.host_leaves:
            self.host_leaves.add(node)
            self._host_order.joined(node)

    def refresh_leaf_sets_around(self, node: TreeNode) -> None:
        """``refresh_leaf_sets`` on ``node`` and its parent: after ``node`` was split off
        or hung under it (spec/09, 9.3 S-R4's insert)."""
        self.refresh_leaf_sets(node)
        if node.parent is not None:
            self.refresh_leaf_sets(node.parent)

    def page_refs(self, node: TreeNode) -> list[PageRef]:
        """The node's pages as (namespace, full prefix), deepest first: how a decision
        record and the storage tier's audit name a page (spec/09, 9.2 "Host protection
        holders")."""
        prefix = node.prefix()
        end = len(prefix)
        start = end - node.length
        return [(node.namespace, prefix[:n])
                for n in range(end, start, -self.page_size)]

    # ------------------------------------------------------------------ validation

    def _require_key(self, key: object) -> RadixKey:
        if not isinstance(key, RadixKey):
            raise InvalidArgument("key", f"must be a RadixKey, got {type(key).__name__}")
        return key

    def require_node(self, node: object, argument: str = "node") -> TreeNode:
        """``node`` if it is a node of this cache's tree now, else ``ForeignNode`` naming
        ``argument`` (another cache's, removed, or from before a reset); also the storage
        tier's check of a prefetch anchor (spec/09, 9.4 ``query_storage_hit_length``)."""
        if not isinstance(node, TreeNode):
            raise ForeignNode(argument, f"must be a TreeNode, got {type(node).__name__}")
        if node.owner is not self:
            raise ForeignNode(argument, f"{node!r} belongs to another cache")
        cursor = node
        while cursor.parent is not None:
            if cursor.parent.children.get(cursor.child_key(self.page_size)) is not cursor:
                raise ForeignNode(argument, f"{node!r} was removed from the cache")
            cursor = cursor.parent
        if cursor is not self.root:
            raise ForeignNode(argument, f"{node!r} was removed from the cache (or reset)")
        return node

    def _require_slots(self, slots: object, length: int, argument: str) -> torch.Tensor:
        if not isinstance(slots, torch.Tensor) or slots.dtype != torch.int64 or slots.dim() != 1:
            raise InvalidArgument(argument, "must be a 1-D torch.int64 tensor")
        if slots.device.type == "meta":
            raise InvalidArgument(argument, "is on the meta device, which holds no values")
        if slots.numel() != length:
            raise InvalidArgument(argument, f"must hold {length} slots, got {slots.numel()}")
        return slots.to("cpu")

    @staticmethod
    def _require_count(value: object, argument: str, *, optional: bool = False) -> None:
        """An int >= 0 (None too if ``optional``); a bool is no count."""
        if optional and value is None:
            return
        if not is_int(value) or value < 0:  # type: ignore[operator]
            raise InvalidArgument(argument, f"must be {'None or ' if optional else ''}"
                                            f"an int >= 0, got {value!r}")

    # ------------------------------------------------------------------ match

    def walk(self, key: RadixKey, stop_at: int) -> list[tuple[TreeNode, int]]:
        """The nodes along ``key``'s first ``stop_at`` tokens (without splitting) and how
        many tokens of each match: a read-only walk (the storage tier checks a backup run
        with it, spec/09 9.4 ``backup_pages``)."""
        walked = []
        node, start = self.root, 0
        packed = key.packed
        while start < stop_at:
            child = node.children.get(child_key(key.namespace, packed, start, self.page_size))
            if child is None:
                break
            matched = common_pages(child.packed, packed, start, self.page_size, stop_at)
            walked.append((child, matched))
            if matched < child.length:
                break
            node, start = child, start + matched
        return walked

    def descend(self, key: RadixKey, stop_at: int,
                walked: list[tuple[TreeNode, int]] | None = None) -> list[TreeNode]:
        """Like ``walk``, but split the last node where the key leaves it, so the nodes
        returned cover whole the matched part of ``key[:stop_at]`` (splits are
        unobservable, spec/06; the storage tier resolves page runs with it, spec/09 9.3
        S-R1 and S-R4). ``walked``: this very walk, done before with nothing changed since
        (it saves a second walk)."""
        nodes = []
        for child, matched in self.walk(key, stop_at) if walked is None else walked:
            if matched < child.length:
                child = split(child, matched, self.page_size)
                self.refresh_leaf_sets_around(child)
            nodes.append(child)
        return nodes

    def match_prefix(self, key: RadixKey) -> MatchResult:
        """The longest cached page prefix of ``key``; stamps the matched pages (spec/03.2)."""
        key = self._require_key(key)
        now = self.now()
        # One pass down the matched path (issue 13): ``descend``'s walk, each node taken
        # as it is reached. Device nodes come first on the path (INV-DEVICE-PREFIX-
        # CLOSED), the host-only ones after.
        # Positions in bytes of ``key.packed`` (issue 29): a child's key is a slice of
        # them (``keys.child_key``), and the common case along a cached path, a segment
        # that matches whole, is one memcmp in place (``holds_at``, on bytes or a borrowed
        # view alike); only where the key leaves a segment are pages counted.
        size, packed, namespace = self.page_size, key.packed, key.namespace
        page = size * TOKEN_BYTES
        end = (key.length - key.length % size) * TOKEN_BYTES
        parts: list[torch.Tensor] = []
        node = last_device = last_host = self.root
        host_hit = offset = 0
        while offset < end:
            child = node.children.get((namespace, bytes(packed[offset:offset + page])))
            if child is None:
                break
            segment = child.packed
            if len(segment) <= end - offset and holds_at(packed, offset, segment):
                matched, leaves = len(segment), False
            else:  # the key leaves the path inside child
                matched = common_pages(segment, packed, offset // TOKEN_BYTES, size,
                                       end // TOKEN_BYTES) * TOKEN_BYTES
                leaves = True
                child = split(child, matched // TOKEN_BYTES, size)
                self.refresh_leaf_sets_around(child)
            child.last_tick = now
            if child.device is not None:
                parts.append(child.device)
                last_device = child
            else:
                host_hit += matched // TOKEN_BYTES
            if child.host is not None:
                last_host = child
            if leaves:
                break
            node, offset = child, offset + matched
        # The caller's own tensor (a copy even for one node: issue 17).
        slots = EMPTY if not parts else parts[0].clone() if len(parts) == 1 else torch.cat(parts)
        return MatchResult(slots, last_device, last_host, host_hit)

    # ------------------------------------------------------------------ insert

    def _check_runs(self, slots: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The first half of spec/03, R7 (each run of P positions, and the partial tail,
        is the slots of one page in order) for ``slots[start:]`` (``start`` a page
        multiple): each run goes on in order from its first slot. One comparison with
        what such runs would be (the partial tail compares with its run's first slots).
        Returns each run's first slot (``slots[start:]`` itself at page size 1), for the
        checks that follow; that these start pages is ``_check_page_starts``'s (or
        ``held_once``'s: a slot that starts no page is no allocated page's head)."""
        size = self.page_size
        part = slots[start:] if start else slots
        if size == 1:
            return part
        heads = part[::size]
        whole = self.device_pool.allocator.slots_from(heads)
        if torch.equal(part, whole if len(part) % size == 0 else whole[:len(part)]):
            return heads
        self._explain_not_whole_pages(slots)
        raise AssertionError("unreachable: the vectorised check and the loop disagree")

    def _check_page_starts(self, slots: torch.Tensor, heads: torch.Tensor) -> None:
        """The rest of R7: each run's first slot (``heads``) starts a page. The tree,
        copies and ``release`` are page-granular, so anything else would free one page
        twice and leak another (issue 16)."""
        if self.page_size > 1 and bool(heads.remainder(self.page_size).any()):
            self._explain_not_whole_pages(slots)
            raise AssertionError("unreachable: the vectorised check and the loop disagree")

    def _explain_not_whole_pages(self, slots: torch.Tensor) -> None:
        """Raise ``InvalidArgument`` at the first run of ``slots`` that is not one
        page's slots in order (only on failure: a loop)."""
        size = self.page_size
        for start in range(0, len(slots), size):
            run = slots[start:start + size].tolist()
            if run[0] % size:
                raise InvalidArgument(f"slots[{start}]", f"starts a page run at slot {run[0]}, "
                                      f"not at a page start (a multiple of {size}); caller "
                                      "slots must be whole pages in order (spec/03, R7)")
            for offset, slot in enumerate(run):
                if slot != run[0] + offset:
                    raise InvalidArgument(f"slots[{start + offset}]", f"is {slot}, not "
                                          f"{run[0] + offset}: slots[{start}:{start + size}] = "
                                          f"{run} are not one page's slots in order; caller "
                                          "slots must be whole pages in order (spec/03, R7)")

    def _check_insert_slots(self, slots: torch.Tensor,
                            walked: list[tuple[TreeNode, int]]) -> None:
        """Whole pages in order (R7), and every slot is the cache's own slot at that
        position or held by the caller (allocated and owned by no node). Vectorised, no
        tree scan; ownership and duplicates are checked only where the slots are not the
        cache's own (a node's slots are distinct and owned, so a caller's slot can equal
        none of them), which keeps a long shared prefix cheap."""
        own = self._own_prefix(slots, walked)
        # The common case: R7 and the caller's hold checked past the cache's own run only
        # (a node's slots are whole pages in order, INV-TREE-WELL-FORMED; issue 13: R7
        # over a 32 k-token prefix was a quarter of such an insert).
        if own is not None and self._caller_pages_held(self._check_runs(slots, own)):
            return
        # The general case, and every failure (explained here, slot by slot).
        heads = self._check_runs(slots)
        self._check_page_starts(slots, heads)
        reuse = torch.zeros(len(slots), dtype=torch.bool)
        start = 0
        for node, matched in walked:
            if node.device is not None:
                reuse[start:start + matched] = slots[start:start + matched] == \
                    node.device[:matched]
            start += matched
        positions = (~reuse).nonzero().flatten()
        if not len(positions):
            return
        others = slots.index_select(0, positions)
        in_range = (others >= 0) & (others < self.device_pool.num_slots)
        held = torch.zeros(len(others), dtype=torch.bool)
        safe = others[in_range]
        held[in_range] = (self.device_pool.allocator.allocated(safe)
                          & ~self._device_owned.tensor.index_select(0, safe))
        if not bool(held.all()):
            position = int(positions[int((~held).nonzero()[0])])
            raise InvalidArgument(f"slots[{position}]",
                                  f"slot {int(slots[position])} is neither held by the caller "
                                  "nor the cache's own slot for this position")
        if torch.unique(others).numel() != len(others):
            raise InvalidArgument("slots", "holds a slot twice")

    @staticmethod
    def _own_prefix(slots: torch.Tensor, walked: list[tuple[TreeNode, int]]) -> int | None:
        """How many leading ``slots`` are the cache's own for the walked device run (what
        ``match_prefix`` returned): the run's length if they all are, else None (and None
        if a device node follows a host-only one on the walk); both send the caller to
        the general check."""
        own: list[torch.Tensor] = []
        end = 0
        for node, matched in walked:
            if node.device is None:
                break
            own.append(node.device if matched == node.length else node.device[:matched])
            end += matched
        if any(node.device is not None for node, _ in walked[len(own):]):
            return None
        if own and not torch.equal(slots[:end], own[0] if len(own) == 1 else torch.cat(own)):
            return None
        return end

    def _caller_pages_held(self, heads: torch.Tensor) -> bool:
        """Whether the runs past the cache's own prefix are pages the caller holds: each
        of ``heads`` (their first slots, each run in order from it: ``_check_runs``) an
        allocated page's head, owned by no node, none twice. Then a slot is in range,
        held by the caller, owned by a node or repeated iff its page is (a node owns
        whole pages), the partial tail's included. False sends the caller to the general
        check, which finds any error."""
        if not len(heads):
            return True
        if self._device_owned.any(heads) is not False:  # owned, or out of range
            return False
        return self.device_pool.allocator.held_once(heads)

    @delivering
    def insert(self, key: RadixKey, slots: torch.Tensor, *, priority: int = 0,
               chunked: bool = False, counted_from: int = 0) -> int:
        """Cache ``key`` (KV in ``slots``); return the tokens that were already cached.

        The caller frees its own slots for those tokens (the duplicates) and for the
        partial tail page. Pages that reach the policy's hit threshold are backed up.
        ``counted_from`` (a page multiple, at most the page-aligned length) is what this
        request inserted before: pages ending there or earlier count no hit and are not
        due; ``chunked`` counts none at all (spec/03 3.5).
        """
        key = self._require_key(key)
        slots = self._require_slots(slots, key.length, "slots")
        if not is_int(priority):
            raise InvalidArgument("priority", f"must be an int, got {priority!r}")
        if not isinstance(chunked, bool):
            raise InvalidArgument("chunked", f"must be a bool, got {chunked!r}")
        aligned = key.aligned_length(self.page_size)
        self._require_counted_from(counted_from, aligned)
        walked = self.walk(key, aligned)
        self._check_insert_slots(slots, walked)
        now = self.now()
        counted = aligned if chunked else counted_from
        if 0 < counted < aligned:
            # Hits are per node: put a node boundary at ``counted`` (splits are unobservable).
            self.descend(key, counted)
            walked = self.walk(key, aligned)  # the split changed the path
        touched = self.descend(key, aligned, walked)
        counting: list[TreeNode] = []  # the nodes this insert counts: those from ``counted`` on
        prefix = 0
        start = 0
        for node in touched:
            node.last_tick = now
            node.priority = max(node.priority, priority)
            if node.device is not None:
                prefix += node.length
                if start >= counted:
                    node.hits += 1
            else:  # host-only: adopt the recomputed KV; not a hit, not a cached prefix
                self._set_device(node, slots[start:start + node.length].clone())
                self.refresh_leaf_sets_around(node)
            if start >= counted:
                counting.append(node)
            start += node.length
        parent = touched[-1] if touched else self.root
        # The new tail: one leaf, or two where ``counted`` falls inside it.
        for end in (counted, aligned) if start < counted else (aligned,):
            if start < end:
                parent = self._add_leaf(key, parent, start, end, slots, now, priority,
                                        1 if start >= counted else 0)
                if start >= counted:
                    counting.append(parent)
                start = end
        if self._threshold is not None:
            due = [n for n in counting if n.hits >= self._threshold and n.host is None]
            if due:
                try:
                    self._backup(self._missing_suffix(due[-1]))
                except RankSyncError as error:  # the insert is done, its backup is not
                    error.result = prefix
                    raise
        return prefix

    def _require_counted_from(self, counted_from: object, aligned: int) -> None:
        if not isinstance(counted_from, int) or isinstance(counted_from, bool):
            raise InvalidArgument("counted_from", "must be an int")
        if counted_from % self.page_size:
            raise InvalidArgument("counted_from",
                                  f"must be a multiple of the page size {self.page_size}")
        if not 0 <= counted_from <= aligned:
            raise InvalidArgument("counted_from",
                                  f"must be between 0 and the page-aligned length {aligned}")

    def _add_leaf(self, key: RadixKey, parent: TreeNode, start: int, end: int,
                  slots: torch.Tensor, now: int, priority: int, hits: int) -> TreeNode:
        """A new node for ``key.tokens[start:end]`` under ``parent``."""
        node = TreeNode(self, key.namespace, key.packed_span(start, end), parent, now,
                        priority)
        node.hits = hits
        parent.children[node.child_key(self.page_size)] = node
        self._set_device(node, slots[start:end].clone())
        self.refresh_leaf_sets_around(node)
        return node

    # ------------------------------------------------------------------ backup

    def _missing_suffix(self, node: TreeNode) -> list[TreeNode]:
        """``node`` with the nodes above it that lack a host copy, root-most first: what
        ``write_backup(node)`` copies, and an insert's backup run for its deepest due
        node (R5, DEV-30: due nodes lie on one key's path, so the run holds them all)."""
        run: list[TreeNode] = []
        walk: TreeNode | None = node
        while walk is not None and walk is not self.root and walk.host is None:
            run.append(walk)
            walk = walk.parent
        run.reverse()
        return run

    def _backup(self, run: list[TreeNode]) -> bool:
        """Back up ``run`` (a chain, root-most first) all or nothing, in one copy."""
        single = len(run) == 1  # the common case, without generators or lists
        need = run[0].length if single else sum(n.length for n in run)
        victims = self.make_host_room(need)
        host = self._agreed_alloc(self.host_pool, need, "backup alloc")
        if host is None:
            self._record_backup(victims, None)
            return False
        if single:  # the allocation is the node's tensor
            run[0].host = host
            source = run[0].device
            assert source is not None
        else:
            start = 0
            for node in run:  # views of the one allocation (tree.py: never written)
                node.host = host[start:start + node.length]
                start += node.length
            sources = [n.device for n in run if n.device is not None]
            source = sources[0] if len(sources) == 1 else torch.cat(sources)
        ticket = self.engine.submit_unchecked("d2h", source, host)
        self._add_lock(run[-1], +1)  # the device source must outlive the copy
        self._issued += 1
        self.pending["d2h"].append(PendingCopy(ticket, self._issued, run[-1], need, source, host))
        self._record_backup(victims, host)
        return True

    def _record_backup(self, victims: list[PageRef], host: torch.Tensor | None) -> None:
        if self.recorder is not None:
            self.recorder.backups.append(BackupDecision(
                tuple(victims), None if host is None else tuple(host.tolist())))

    @delivering
    def write_backup(self, node: TreeNode) -> bool:
        """Back up ``node`` and the ancestors above it that lack a host copy, in one copy.

        Returns False if the host has no room for them even after evicting on host.
        """
        node = self.require_node(node)
        if node is self.root or node.device is None or node.host is not None:
            raise InvalidArgument("node", "must be on device and not yet backed up")
        return self._backup(self._missing_suffix(node))

    @delivering
    def writing_check(self) -> int:
        """Acknowledge the device-to-host copies that finished (FIFO); return how many.

        With a backend attached by ``attach_storage_backend`` this is also where the
        acknowledged pages the backend lacks are written to storage (spec/09, S-R1), as
        SGLang's ``writing_check`` does: the one call an engine makes. It runs the tier's
        ``writing_check``, whose call back into this one then only acknowledges. (Calling
        ``storage.writing_check()`` directly on such a cache writes each page twice until
        the tier acknowledges through ``acknowledge_writes``.) Not thread-safe: one
        scheduler thread calls the cache.
        """
        tier = self._storage
        if tier is None or not tier.attached or self._in_tier_writing_check:
            return self.acknowledge_writes()
        self._in_tier_writing_check = True
        try:
            return tier.writing_check()
        finally:
            self._in_tier_writing_check = False

    @delivering
    def acknowledge_writes(self) -> int:
        """``writing_check`` without the storage backups: acknowledge the device-to-host
        copies that finished (FIFO); return how many. For the storage tier, which backs
        the acknowledged pages up itself."""
        return self._acknowledge("d2h")

    @delivering
    def loading_check(self) -> int:
        """Acknowledge the host-to-device copies that finished (FIFO); return how many."""
        return self._acknowledge("h2d")

    def _acknowledge(self, direction: Direction) -> int:
        # Every rank acknowledges the same number of copies (the minimum finished), and
        # asks even with nothing in flight: a skipped collective hangs the others (12.3).
        count = self.sync.min(self.engine.finished(direction), f"ack {direction}")
        for ticket in self.engine.acknowledge(direction, count):
            copy = self.pending[direction].popleft()
            assert copy.ticket == ticket, (copy.ticket, ticket)
            if direction == "h2d":
                covered = copy.nodes()
                assert covered is not None, f"copy {copy.ticket} lost its nodes"
                for node in covered:
                    node.host_ref -= 1
                    self.refresh_leaf_sets(node)
            elif self.event_channel.enabled:  # the backup landed: its pages are on host
                landed = copy.nodes()
                assert landed is not None, f"copy {copy.ticket} lost its nodes"
                for node in landed:
                    self._emit("stored", "host", node)
            self._add_lock(copy.lock_node, -1)
        return count

    # ------------------------------------------------------------------ locks

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and its ancestors against eviction; return the evictable change."""
        node = self.require_node(node)
        if node is self.root:
            return 0
        if node.device is None:
            raise InvalidArgument("node", f"{node!r} is not on device; load it back first")
        node.anchored_locks += 1
        return self._add_lock(node, +1)

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Release one caller lock taken by inc_lock_ref at ``node``; return the evictable
        change. ``NotLocked`` on ``node`` and nothing changed if no lock was taken there
        (spec/03 3.7): every lock is one at its anchor and on each page above, so a lock
        taken at ``node`` leaves a caller lock on every page of its path, and none is a
        copy's, a lock taken below ``node`` or another caller's at a sibling."""
        node = self.require_node(node)
        if node is self.root:
            return 0
        if node.anchored_locks < 1:  # O(1): the count inc_lock_ref keeps (issue 30)
            raise NotLocked("node", f"{node!r} holds no lock taken there by inc_lock_ref "
                                    "(its locks, if any, are held below it or by copies in "
                                    "flight)")
        node.anchored_locks -= 1
        return self._add_lock(node, -1)

    # ------------------------------------------------------------------ eviction

    @delivering
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens in rank order (or all evictable)."""
        if type(num_tokens) is not int or num_tokens < 0:  # the check, inline on success
            self._require_count(num_tokens, "num_tokens")
        evicted, victims = self._evict(num_tokens)
        if self.recorder is not None:
            self.recorder.device_victims.extend(victims)
        return evicted

    def _evict(self, target: int) -> tuple[int, list[DeviceVictim]]:
        """Victims in rank order until ``target`` tokens are freed (or none is left);
        returns the tokens freed and the victims. The loop is inline: a scheduler evicts
        on most steps, one or two nodes at a time (issue 29: a call less per eviction)."""
        order = self._device_order
        order.begin()
        write_back = self.config.write_policy == "write_back"
        recorder = self.recorder
        victims: list[DeviceVictim] = []
        kept: set[TreeNode] = set()  # write_back victims neither copied nor droppable
        freed: list[torch.Tensor] = []  # device slots, released in one call at the end
        evicted = 0
        try:
            while evicted < target:
                node = order.pop()
                if node is None:
                    break
                if node in kept:  # popped again after a compaction requeued it
                    continue
                assert node.parent is not None
                if node.host is not None or not write_back:
                    if recorder is not None:  # page refs cost O(prefix) to build
                        victims.extend(DeviceVictim(p) for p in self.page_refs(node))
                    evicted += self._drop_device_copy(node, freed)
                    continue
                if node.length > self.page_size:
                    # write_back moves one page at a time, so that a host that fills up
                    # half way through a node drops only what did not fit.
                    upper = split(node, node.length - self.page_size, self.page_size)
                    self.refresh_leaf_sets_around(upper)
                victim, moved = self._evict_write_back(node, freed)
                victims.append(victim)
                if moved:
                    evicted += self.page_size
                else:
                    kept.add(node)
        finally:  # also when a write_back victim's collective failed (spec/12, 12.6)
            for node in kept:  # still evictable leaves: back in the order for later calls
                if node in self.device_leaves:
                    order.push_back(node)
            # The nodes dropped their slots ``releasing``: their ownership flags are
            # cleared here, with the release, in one call for the whole eviction (the
            # allocator's own, not the pool's forwarding one: issue 29).
            self.device_pool.allocator.release_parts(freed, self._device_owned)
        return evicted, victims

    def _drop_device_copy(self, node: TreeNode, freed: list[torch.Tensor]) -> int:
        """Drop ``node``'s device copy; its slots go to ``freed``, for the caller to
        release (the whole eviction's slots in one checked call).

        ``_set_device(node, None, releasing=True)`` and ``refresh_leaf_sets_around`` written out
        for the one case eviction has (issue 13: an unlocked device leaf losing its
        copy), so each counter and leaf set is touched once: the node was an evictable
        device leaf, and only it and its parent can change leaf sets. The two rules below
        are ``refresh_leaf_sets``' own, specialised: change them together."""
        device = node.device
        assert device is not None and node.lock_ref == 0
        if self.event_channel.enabled:
            self._emit("removed", "device", node)
        freed.append(device)
        node.device = None
        self.evictable_tokens -= node.length  # INV-ACCOUNTING: it was unlocked
        self.device_leaves.discard(node)
        if node.host is None:
            assert not node.children, f"{node!r}: a device-only leaf with children"
            self._detach(node)
            return node.length
        # refresh_leaf_sets(node), for what can have changed: it is a host leaf now if
        # nothing protects its copy and no child hangs below (it was no host leaf
        # while it was on device, and it is unlocked).
        if node.host_ref == 0 and not node.children and node not in self.host_leaves:
            self.host_leaves.add(node)
            self._host_order.joined(node)
        # refresh_leaf_sets(parent), likewise: it keeps a child, so it stays no host
        # leaf; it was no device leaf (node was a device child of it) and is one now if
        # it is an unlocked device node whose children are all off the device.
        parent = node.parent
        assert parent is not None
        if parent is self.root or parent.device is None or parent.lock_ref:
            return node.length
        for child in parent.children.values():  # a loop: cheaper than any() on a genexpr
            if child.device is not None:
                return node.length
        if parent not in self.device_leaves:
            self.device_leaves.add(parent)
            self._device_order.joined(parent)
        return node.length

    def _detach(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.child_key(self.page_size)]
        self.device_leaves.discard(node)
        self.host_leaves.discard(node)
        node.parent = None
        self.refresh_leaf_sets(parent)

    def _evict_write_back(self, node: TreeNode,
                          freed: list[torch.Tensor]) -> tuple[DeviceVictim, bool]:
        """Copy a one-page device leaf to host on its way out, or drop it if no room; or,
        if no room and its host-only subtree holds a protected copy, keep it on device
        (spec/09, S-R5). Returns the victim and whether the device page was freed (its
        device slots, and any of the subtree, go to ``freed``)."""
        page = self.page_refs(node)[0]
        host_victims = self.make_host_room(self.page_size)
        host = self._agreed_alloc(self.host_pool, self.page_size, "write-back alloc")
        assert node.device is not None
        if host is None:
            victim = DeviceVictim(page, tuple(host_victims), None)
            if self._protected_below(node):
                return victim, False
            self._drop_subtree(node, freed)
            return victim, True
        # Eviction under write_back waits for its copy (SGLang blocks in writing_check),
        # so it copies directly rather than through the asynchronous engine.
        self.host_pool.copy_from_device_unchecked(self.device_pool, node.device, host)
        node.host = host
        if self.event_channel.enabled:
            self._emit("stored", "host", node)
        freed.append(node.device)
        self._set_device(node, None, releasing=True)
        self.refresh_leaf_sets_around(node)
        if self.on_write_back is not None:
            self.on_write_back(node)
        return DeviceVictim(page, tuple(host_victims), tuple(host.tolist())), True

    @staticmethod
    def _protected_below(node: TreeNode) -> bool:
        """Whether a node of ``node``'s subtree holds a host protection."""
        stack = [node]
        while stack:
            n = stack.pop()
            if n.host_ref:
                return True
            stack.extend(n.children.values())
        return False

    def _drop_subtree(self, node: TreeNode, freed: list[torch.Tensor]) -> None:
        """Remove ``node``'s subtree: its host slots are released here (the caller's
        next host allocation counts on them), its device slots go to ``freed``."""
        stack, doomed = [node], []
        while stack:
            n = stack.pop()
            doomed.append(n)
            stack.extend(n.children.values())
        assert not any(n.host_ref for n in doomed), "dropping a protected host copy"
        host_freed = []
        for n in doomed:
            if n.host is not None:
                if self.event_channel.enabled:
                    self._emit("removed", "host", n)
                host_freed.append(n.host)
                n.host = None
            if n.device is not None:
                freed.append(n.device)
                self._set_device(n, None, releasing=True)
            self.device_leaves.discard(n)
            self.host_leaves.discard(n)
        self.host_pool.release_parts(host_freed)
        self._detach(node)

    @delivering
    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens of host-only pages (or all evictable)."""
        self._require_count(num_tokens, "num_tokens")
        evicted, victims = self._evict_host(num_tokens)
        if self.recorder is not None:
            self.recorder.host_victims.extend(victims)
        return evicted

    def make_host_room(self, need: int) -> list[PageRef]:
        """Evict host-only pages until ``need`` host slots are free, or none is left;
        return the victims, deepest page first per node (spec/03 R2; a prefetch makes room
        for its shortfall only, spec/09 9.4 ``prefetch_from_storage`` and DEV-S7)."""
        # The room is agreed (spec/12, 12.3): every rank evicts the same pages.
        shortfall = need - self.sync.min(self.host_pool.num_free_slots, "host room")
        return self._evict_host(shortfall)[1] if shortfall > 0 else []

    def _agreed_alloc(self, pool: DeviceKVPool | HostKVPool, tokens: int,
                      what: str) -> torch.Tensor | None:
        """``tokens`` slots of ``pool`` on every rank or on none (spec/12, 12.3): a rank
        whose pool is fuller must not leave the others with a copy it lacks. The
        consensus comes before the allocation it decides (12.6): a failing collective
        leaves the pool as it was."""
        able = pool.can_alloc(tokens)  # checks ``tokens`` as alloc does
        if not self.sync.min(int(able), what):
            return None
        slots = pool.alloc(tokens)
        assert slots is not None, "can_alloc said yes and nothing ran since"
        return slots

    def _evict_host(self, target: int) -> tuple[int, list[PageRef]]:
        order = self._host_order
        order.begin()
        evicted = 0
        victims: list[PageRef] = []
        freed: list[torch.Tensor] = []
        while evicted < target:
            node = order.pop()
            if node is None:
                break
            assert node.parent is not None and node.host is not None
            if self.recorder is not None:
                victims.extend(self.page_refs(node))
            if self.event_channel.enabled:
                self._emit("removed", "host", node)
            freed.append(node.host)
            evicted += node.length
            node.host = None
            self._detach(node)
        self.host_pool.release_parts(freed)
        return evicted, victims

    # ------------------------------------------------------------------ load back

    @delivering
    def load_back(self, node: TreeNode, mem_quota: int | None = None) -> torch.Tensor | None:
        """Start copying the host-only chain ending at ``node`` to device, all or nothing.

        Returns the device slots, or None when the load is below the threshold, over
        ``mem_quota``, or finds no device room even after evicting.
        """
        node = self.require_node(node)
        if node is self.root or node.device is not None:
            raise InvalidArgument("node", "must be a node whose KV is only on host")
        self._require_count(mem_quota, "mem_quota", optional=True)
        chain = []
        cursor: TreeNode = node
        while cursor is not self.root and cursor.device is None:
            chain.append(cursor)
            assert cursor.parent is not None
            cursor = cursor.parent
        chain.reverse()
        anchor = cursor
        tokens = sum(n.length for n in chain)
        newly_locked = sum(n.length for n in anchor.path() if n.lock_ref == 0)
        if tokens < self.config.load_back_threshold or (
                mem_quota is not None and tokens > mem_quota - newly_locked):
            self._record_load([], None)
            return None
        # The room is agreed before the chain is protected (spec/12, 12.6): a failing
        # collective here leaves nothing to undo.
        shortfall = tokens - self.sync.min(self.device_pool.num_free_slots, "load room")
        for n in chain:  # host eviction while making room must not take the chain
            n.host_ref += 1
            self.refresh_leaf_sets(n)
        if anchor is not self.root:
            self._add_lock(anchor, +1)
        locked = anchor is not self.root
        try:
            victims = self._evict(shortfall)[1] if shortfall > 0 else []
            if locked:
                self._add_lock(anchor, -1)
                locked = False
            device = self._agreed_alloc(self.device_pool, tokens, "load alloc")
        except BaseException:  # a collective failed (RankSyncError): no protection leaks
            if locked:
                self._add_lock(anchor, -1)
            for n in chain:
                n.host_ref -= 1
                self.refresh_leaf_sets(n)
            raise
        if device is None:
            for n in chain:
                n.host_ref -= 1
                self.refresh_leaf_sets(n)
            self._record_load(victims, None)
            return None
        if len(chain) == 1:  # the common case: the allocation is the node's tensor
            self._set_device(chain[0], device)
        else:
            start = 0
            for n in chain:  # views of the one allocation (tree.py: never written)
                self._set_device(n, device[start:start + n.length])
                start += n.length
        for n in chain:
            self.refresh_leaf_sets_around(n)
        sources = [n.host for n in chain if n.host is not None]
        source = sources[0] if len(sources) == 1 else torch.cat(sources)
        ticket = self.engine.submit_unchecked("h2d", device, source)
        self._add_lock(node, +1)  # released by loading_check
        self._issued += 1
        self.pending["h2d"].append(PendingCopy(ticket, self._issued, node, tokens, source, device))
        self._record_load(victims, device)
        # The caller's own tensor: the copy in flight keeps ``device``, so a caller that
        # reuses the returned buffer cannot move the copy's slots (issue 17).
        return device.clone()

    def _record_load(self, victims: list[DeviceVictim], device: torch.Tensor | None) -> None:
        if self.recorder is not None:
            self.recorder.loads.append(LoadDecision(
                tuple(victims), None if device is None else tuple(device.tolist())))

    @delivering
    def init_load_back(self, node: TreeNode,
                       mem_quota: int | None = None) -> tuple[torch.Tensor, TreeNode]:
        """Load ``node`` back if it is host-only; return the slots and the node to use."""
        node = self.require_node(node)
        self._require_count(mem_quota, "mem_quota", optional=True)
        if node is self.root or node.device is not None:
            return EMPTY, node
        loaded = self.load_back(node, mem_quota)
        if loaded is not None:
            return loaded, node
        while node is not self.root and node.device is None:
            assert node.parent is not None
            node = node.parent
        return EMPTY, node

    # ------------------------------------------------------------------ caller slots

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """``num_tokens`` (a page multiple) free device slots for the caller, or None if
        too few are free (call ``evict`` and retry). SGLang's
        ``token_to_kv_pool_allocator.alloc``."""
        return self._agreed_alloc(self.device_pool, num_tokens, "alloc")

    def free(self, slots: torch.Tensor) -> None:
        """Give back device slots the caller holds (whole pages; the partial tail page and
        the duplicates ``insert`` reports). Slots a node owns are refused with
        ``SlotError`` (an ``InvalidArgument``) on ``slots`` and nothing is freed: freeing
        them would let the next ``alloc`` hand out the tree's KV (issue 12). SGLang's
        allocator ``free``."""
        # The pool refuses the tree's slots itself (``claim`` at reset): one guard for
        # this call and for ``device_pool.free`` (issue 34).
        self.device_pool.free(slots)  # whole pages, allocated, none twice: else SlotError

    # ------------------------------------------------------------------ storage

    @property
    def storage(self) -> StorageTier | None:
        """The storage tier ``attach_storage_backend`` made (None before the first
        attach; kept after ``detach_storage_backend``, detached). Prefetching goes
        through it: ``query_storage_hit_length``, ``prefetch_from_storage``,
        ``check_prefetch_progress``, ``drain_storage_queues`` (spec/09, 9.4)."""
        return self._storage

    def attach_storage_backend(self, backend: StorageBackend, model_identity: str,
                               settings: TierSettings | None = None, *, threaded: bool = True,
                               batch_pages: int = 1
                               ) -> Literal["attached", "policies updated"]:
        """Attach a storage tier below the host tier (spec/09, 9.4 ``attach_storage``);
        from then on ``writing_check`` backs acknowledged pages up to it and
        ``check_invariants`` counts the host slots it holds. Re-attaching the same backend
        only updates the prefetch policy. Typed errors leave everything as it was."""
        tier = self._storage
        previous_reset = self.on_reset
        if tier is None:
            tier = StorageTier(self)  # it installs its reset hook
        try:
            outcome = tier.attach(backend, model_identity, settings, threaded=threaded,
                                  batch_pages=batch_pages)
        except BaseException:
            self.on_reset = previous_reset  # a failed first attach leaves no tier behind
            raise
        self._storage = tier
        return outcome

    @delivering
    def detach_storage_backend(self) -> bool:
        """Detach the storage tier (spec/09, 9.4 ``detach_storage``): its I/O drains and
        stops, every slot it held is given back. False if none was attached."""
        if self._storage is None or not self._storage.attached:
            return False
        self._storage.detach()
        return True

    # ------------------------------------------------------------------ inspection

    def nodes(self) -> list[TreeNode]:
        """Every node below the root, parents before children."""
        order, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        return order

    def _tree_device_slots(self) -> set[int]:
        return {s for n in self.nodes() if n.device is not None for s in n.device.tolist()}

    def check_invariants(self) -> None:
        """Check every invariant of spec/05 on the concrete tree; raise InvariantViolation.

        With a storage tier made by ``attach_storage_backend``, host slots it holds
        (reserved by a prefetch, or queued for release) count as its own, not leaked
        (spec/09, 9.2); ``storage.check()`` audits the tier's own bookkeeping."""
        checker.check(self)

    def dump(self) -> str:
        """The tree, one node per line, for error messages."""
        lines = [f"evictable={self.evictable_tokens} protected={self.protected_tokens} "
                 f"pending d2h={len(self.pending['d2h'])} h2d={len(self.pending['h2d'])}"]

        def show(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                device = None if child.device is None else child.device.tolist()
                host = None if child.host is None else child.host.tolist()
                lines.append(f"{'  ' * depth}{child!r} device={device} host={host} "
                             f"tick={child.last_tick}/{child.insert_tick} prio={child.priority}")
                show(child, depth + 1)

        show(self.root, 0)
        return "\n".join(lines)
