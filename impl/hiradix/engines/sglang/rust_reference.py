"""The Python tree core as the Rust-core adapter's reference (spec/07r DEV-R1, "reading
the stamps off the reference core").

The Rust core hides each node's recency, creation time, hit count and priority. The
Python core keeps the same fields in Python. ``PythonReference`` is a device-tier
``UnifiedRadixCache`` on the Python core, built like the adapter's Rust-core cache, that
the adapter gives every call it gives the Rust core (match, lock, alloc, insert, free,
evict, reset), with the suite's clock as its time counter (DEV-21, ``UnifiedClock``) and
its leaf sets insertion-ordered (DEV-20). ``HostReference`` is the same with HiCache
(write-through), for the host-tier engine: it also mirrors the backups an insert queues,
their acknowledgement, load back and its acknowledgement, and host eviction, is
compared on host slots and free host slots too, and gives each page's host lock count
for ``host_protect`` (DEV-R3, DEV-22 mapped).

The adapter then checks, after every step, that the two cores hold the same pages at
the same device slots with the same lock counts, and that every call returned the same
(``Parted`` otherwise: the Rust core differs from its reference, a finding of its own).
Only then does it read the four hidden fields off the reference, per page. So an
eviction the Rust core makes is judged by the model under the stamps the Python core
gave the same pages, as the Python-core adapter judges it (DEV-1 adopted); a Rust core
whose recency differed from the Python core's would evict otherwise and part from the
reference.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hiradix.conformance.scenario import Scenario
from hiradix.engines.determinism import InsertionOrdered
from hiradix.engines.sglang.radix import device_pools
from hiradix.engines.sglang.unified import (
    UnifiedClock,
    UnifiedEnv,
    build,
    load_back_params,
    load_host_locks,
    node_ending_at,
    radix_key,
)
from hiradix_model import Key


class Parted(AssertionError):
    """The Rust core and the Python reference core answered the same call differently,
    or hold different trees."""


@dataclass(frozen=True)
class Stamps:
    """A page's hidden fields, as the Python core keeps them."""

    hits: int
    last_tick: int
    insert_tick: int
    priority: int


class PythonReference:
    """A device-tier ``UnifiedRadixCache`` on the Python tree core, for one scenario."""

    def __init__(self, env: UnifiedEnv, scenario: Scenario) -> None:
        m = env.modules
        self.env, self.ps = env, scenario.page_size
        env.clock.now = 0  # not the previous cache's last tick
        self.full = m["components"].ComponentType.FULL
        self._build(scenario)
        self.tree = self.cache.tree_core
        if type(self.tree) is not m["core"].UnifiedTreeCore:
            raise Parted(f"the reference is not the Python tree core: {type(self.tree)}")
        self._order_leaf_sets()
        self.receipts: dict[Key | None, list[Any]] = {}

    def _build(self, scenario: Scenario) -> None:
        """The allocator and the cache: the device tier only."""
        m = self.env.modules
        _, self.allocator = device_pools(m, self.ps, scenario.device_pages,
                                         scenario.kv_layout)
        self.cache = m["urc"].UnifiedRadixCache(m["params"].CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.allocator,
            page_size=self.ps, eviction_policy=scenario.eviction,
            tree_components=(self.full,), tree_core_backend="python"))

    def _order_leaf_sets(self) -> None:
        """DEV-20: leaf sets hashed by address, rebuilt on reset: ordered again."""
        self.tree.evictable_device_leaves = InsertionOrdered(self.tree.evictable_device_leaves)
        self.tree.evictable_host_leaves = InsertionOrdered(self.tree.evictable_host_leaves)

    @staticmethod
    def agree(what: str, rust: object, python: object) -> None:
        if rust != python:
            raise Parted(f"{what}: the Rust core gives {rust}, the Python core {python} "
                         f"(spec/07r: the Rust core parts from its reference)")

    # -- the calls, mirrored ------------------------------------------------------------

    def set_time(self, now: int) -> None:
        self.env.clock.now = now

    def _node(self, page: Key | None) -> Any:
        """The node that ends at ``page``."""
        node = node_ending_at(self.tree.root_node, page)
        if node is None:
            raise Parted(f"the Python core has no node ending at {page}")
        return node

    def match_prefix(self, key: Key) -> tuple[int, int]:
        """The device prefix and the host hit (0 on the device tier)."""
        got = self.cache.match_prefix(self.env.modules["base"].MatchPrefixParams(
            key=radix_key(self.env, key)))
        return int(got.device_prefix_len), int(got.host_hit_length)

    def inc_lock_ref(self, page: Key | None) -> int:
        result = self.cache.inc_lock_ref(self._node(page).id)
        self.receipts.setdefault(page, []).append(result.to_dec_params())
        return int(result.delta or 0)

    def dec_lock_ref(self, page: Key | None) -> int:
        receipt = self.receipts[page].pop()
        before = int(self.cache.evictable_size())
        self.cache.dec_lock_ref(receipt.node_id, receipt)
        return int(self.cache.evictable_size()) - before

    def alloc(self, num_tokens: int) -> list[int] | None:
        slots = self.allocator.alloc(num_tokens)
        return None if slots is None else slots.tolist()

    def free(self, engine_slots: torch.Tensor) -> None:
        self.allocator.free(engine_slots)

    def insert(self, params: Any) -> int:
        return int(self.cache.insert(params).prefix_len)

    def evict(self, num_tokens: int) -> int:
        result = self.cache.evict(self.env.modules["base"].EvictParams(num_tokens=num_tokens))
        return int(result.num_tokens_evicted)

    def reset(self) -> None:
        self.cache.reset()
        self._order_leaf_sets()
        self.allocator.clear()
        self.receipts.clear()

    # -- what it shows ------------------------------------------------------------------

    def _walk(self) -> Iterator[tuple[Any, list[Key]]]:
        """Each node of the tree (after its parent), with the keys of the pages it ends."""
        stack: list[tuple[Any, tuple[int, ...]]] = [(self.tree.root_node, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                tokens = prefix + tuple(child.key.token_ids)
                yield child, [Key(tokens[:end], child.key.extra_key)
                              for end in range(len(prefix) + self.ps, len(tokens) + 1,
                                               self.ps)]
                stack.append((child, tokens))

    def pages(self) -> dict[Key, tuple[tuple[int, ...] | None, tuple[int, ...] | None, int,
                                       Stamps]]:
        """Each page's SGLang device slots and host slots (None where it has none),
        lock count and stamps."""
        found: dict[Key, tuple[tuple[int, ...] | None, tuple[int, ...] | None, int,
                               Stamps]] = {}
        for node, keys in self._walk():
            data = node.component_data[self.full]
            values: list[Sequence[int] | None] = [
                None if v is None else v.tolist() for v in (data.value, data.host_value)]
            stamps = Stamps(node.hit_count, UnifiedClock.tick_of(node.last_access_time),
                            UnifiedClock.tick_of(node.creation_time), node.priority)
            for index, key in enumerate(keys):
                cut = slice(index * self.ps, (index + 1) * self.ps)
                device, host = (None if v is None else tuple(v[cut]) for v in values)
                found[key] = (device, host, data.lock_ref, stamps)
        return found

    def totals(self) -> tuple[int, ...]:
        """Evictable and protected tokens, free slots."""
        return (int(self.cache.evictable_size()), int(self.cache.protected_size()),
                int(self.allocator.available_size()))

    def close(self) -> None:
        self.receipts.clear()


class HostReference(PythonReference):
    """``PythonReference`` with HiCache (write-through), for the host-tier engine
    (spec/07r "The host tier"): the cache is built as ``sglang_unified.build`` builds
    it, and the host tier's calls are mirrored too: the backups an insert queues
    (``flush_pending_backups``, DEV-26), their acknowledgement, a load back and its
    start, its acknowledgement, host eviction. Its host lock counts stand in for the
    Rust core's, which no accessor shows (DEV-R3)."""

    def _build(self, scenario: Scenario) -> None:
        built = build(self.env, scenario, "python")
        self.cache, self.allocator, self.host = built.cache, built.allocator, built.host
        self.cache.load_back_threshold = scenario.threshold_pages * self.ps

    def insert(self, params: Any) -> int:
        prefix = super().insert(params)
        self.cache.flush_pending_backups()  # DEV-26, as the adapter does after its insert
        return prefix

    def writing_check(self) -> int:
        """Backups still in flight after the check."""
        self.cache.writing_check()
        return len(self.cache.ongoing_write_through)

    def loading_check(self) -> int:
        """Loads still in flight after the check."""
        self.cache.loading_check()
        return len(self.cache.ongoing_load_back)

    def evict_host(self, num_tokens: int) -> int:
        return int(self.cache.evict_host(num_tokens))

    def init_load_back(self, page: Key | None, quota: int | None) -> tuple[int, Key | None]:
        """The tokens loaded and the page the load ends at (None: the root), the load
        started as the adapter starts it."""
        node = self._node(page)
        cursor, host_hit = node, 0
        while cursor is not self.tree.root_node and cursor.evicted:
            host_hit += len(cursor.component_data[self.full].host_value)
            cursor = cursor.parent
        got, last = self.cache.init_load_back(load_back_params(self.env, node.id, cursor.id,
                                                               host_hit, quota))
        if node.id in self.cache.ongoing_load_back:
            self.cache.ready_to_load_host_cache()
        return int(got), self._page_of(self.tree.node_by_id(last))

    def _page_of(self, node: Any) -> Key | None:
        """The last page of ``node``'s path; None for a root."""
        if node.parent is None:
            return None
        namespace, tokens = node.key.extra_key, []
        while node.parent is not None:
            tokens[:0] = node.key.token_ids
            node = node.parent
        return Key(tuple(tokens), namespace)

    def host_locks(self) -> dict[Key, int]:
        """Each page's host lock count less the locks its loads in flight hold on its
        node (DEV-22, ``sglang_unified.load_host_locks``, as the Python-core adapter
        reads it): what the spec's ``host_protect`` is before the adapter protects each
        page of a load's chain (DEV-5)."""
        held = load_host_locks(self.cache, self.full, self.cache.ongoing_load_back,
                               v20=False)
        return {key: node.component_data[self.full].host_lock_ref - held.get(node.id, 0)
                for node, keys in self._walk() for key in keys}

    def totals(self) -> tuple[int, ...]:
        """Evictable and protected tokens, free device slots, free host slots."""
        self.host._merge_release_slots()
        return (*super().totals(), len(self.host.free_slots))

    def close(self) -> None:
        super().close()
        self.cache.shutdown()
