"""What the storage tier needs from the cache it serves (spec/09): the ``CachePort``.

``StorageTier`` (``hiradix.storage.tier``) is typed against this protocol and never
imports ``hiradix.cache``, so the cache can build its tier at import time without a
cycle, and everything the tier touches of the cache is declared here, under public
names, instead of read out of the cache's private methods. ``HiRadixCache`` implements it
(``attach_storage_backend`` passes the cache as a ``CachePort``, which the type checker
verifies; ``tests/impl/test_cache_port.py`` checks this module's contract).

The tier also edits the tree itself, through ``hiradix.tree`` (``TreeNode``, ``split``):
it hangs the pages a prefetch fetched under their parent (9.3 S-R4) and counts host
protections on nodes (9.2 "Host protection holders"). After each such edit it calls
``refresh_leaf_sets`` (or ``..._around``), so the cache's evictable-leaf sets stay exact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from hiradix.clock import Clock
from hiradix.decisions import PageRef
from hiradix.device_pool import DeviceKVPool
from hiradix.distributed import RankSync
from hiradix.events import EventChannel
from hiradix.host_pool import HostKVPool
from hiradix.keys import RadixKey
from hiradix.transfer import Direction
from hiradix.tree import TreeNode


class CopyInFlight(Protocol):
    """A device-to-host or host-to-device copy the cache has issued and not yet
    acknowledged (spec/03 3.11), as the tier reads it: a d2h copy's pages are backed up
    to storage once it is acknowledged (9.3 S-R1), and their host slots are no source of
    a storage write before (S-R1's source is a landed host copy)."""

    @property
    def ticket(self) -> int:
        """The copy engine's ticket (names the copy in messages)."""

    @property
    def lock_node(self) -> TreeNode:
        """The deepest node the copy covers; its root path is locked until the ack."""

    @property
    def tokens(self) -> int:
        """How many tokens, up the path from ``lock_node``, the copy covers."""

    def nodes(self) -> list[TreeNode] | None:
        """The nodes the copy covers, root-most first (None: no node boundary falls at
        its start, a broken copy)."""


@runtime_checkable
class CachePort(Protocol):
    """The cache as the storage tier sees it (spec/09). Attributes the tier sets are
    the two hooks; everything else it only reads or calls."""

    # The hooks the tier installs (9.4 "Changes to operations of 03").
    on_reset: Callable[[], None] | None
    """Called first by ``reset``, so the tier stops its I/O and drops what it held of the
    old tree (9.4 ``reset``, DEV-S9)."""

    on_write_back: Callable[[TreeNode], None] | None
    """Called with each page a ``write_back`` eviction has just copied to host, so the
    tier backs it up (9.3 S-R1, the eviction case)."""

    @property
    def page_size(self) -> int:
        """P, tokens per page (9.1: a page is the unit of storage)."""

    @property
    def root(self) -> TreeNode:
        """The tree's root: the anchor of a prefetch with no host match (9.2 ``anchor``
        none) and the parent of pages inserted there (S-R4, DEV-S17)."""

    @property
    def clock(self) -> Clock:
        """The cache's logical clock, the timeout clock's default when it is a
        ``ManualClock`` (9.1 "Which clock counts what")."""

    @property
    def sync(self) -> RankSync:
        """The ranks' agreement (spec/12, 12.3): every decision that rests on one rank's
        pools, I/O or store goes through it."""

    @property
    def event_channel(self) -> EventChannel:
        """The KV event channel (spec/11): the tier's storage events and the host pages a
        prefetch inserts (11.3), delivered once each operation has returned (11.7)."""

    @property
    def host_pool(self) -> HostKVPool:
        """The host pool: prefetches reserve and give up its slots (9.3 S-R2), writes
        read from it (S-R1)."""

    @property
    def device_pool(self) -> DeviceKVPool:
        """The device pool: its size bounds the default prefetch limit (9.1)."""

    @property
    def pending(self) -> Mapping[Direction, Sequence[CopyInFlight]]:
        """The copies in flight per direction, oldest first (03 3.11)."""

    def now(self) -> int:
        """Read the cache's logical clock for one operation (recency stamps, 9.1 "Which
        clock counts what"); a clock that went backwards is an error."""

    def require_node(self, node: object, argument: str = "node") -> TreeNode:
        """``node`` if it is a node of this cache's tree now, else ``ForeignNode`` naming
        ``argument`` (a prefetch anchor, 9.4 ``query_storage_hit_length``)."""

    def walk(self, key: RadixKey, stop_at: int) -> list[tuple[TreeNode, int]]:
        """The nodes along ``key``'s first ``stop_at`` tokens and the tokens of each that
        match, without changing the tree (a backup run's check, 9.4 ``backup_pages``)."""

    def descend(self, key: RadixKey, stop_at: int) -> list[TreeNode]:
        """``walk``, splitting the last node where ``key`` leaves it, so the nodes cover
        whole the matched part (a page run's nodes, 9.3 S-R1; the walk of S-R4)."""

    def refresh_leaf_sets(self, node: TreeNode) -> None:
        """Recompute ``node``'s membership of the evictable-leaf sets after the tier
        changed its host protection (9.4: protections keep pages out of ``HL``)."""

    def refresh_leaf_sets_around(self, node: TreeNode) -> None:
        """``refresh_leaf_sets`` on ``node`` and its parent, after the tier split it off
        or hung it there (S-R4)."""

    def make_host_room(self, need: int) -> list[PageRef]:
        """Evict host-only pages until ``need`` host slots are free (or none is left);
        the victims (a prefetch's room for its shortfall, 9.4, DEV-S7)."""

    def page_refs(self, node: TreeNode) -> list[PageRef]:
        """``node``'s pages as (namespace, prefix), deepest first (the tier's audit of
        9.2 "Host protection holders")."""

    def acknowledge_writes(self) -> int:
        """Acknowledge the finished d2h copies without backing them up to storage (the
        tier does that itself, 9.4 "Changes to operations of 03": ``writing_check``)."""

    def nodes(self) -> list[TreeNode]:
        """Every node below the root, parents first (the tier's audit)."""
