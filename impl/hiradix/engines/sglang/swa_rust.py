"""Adapter for SGLang 0.5.23's (FULL, SWA) ``UnifiedRadixCache`` on its Rust tree core
(engine ``sglang-swa-rust``).

0.5.23 builds this core by default (``tree_core_registry.select_tree_core_backend``:
``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` defaults to "rust") and keeps it for
``tree_components=(FULL, SWA)``: ``_rust_fallback_reason`` falls back to Python only for
components outside {FULL, SWA, MAMBA}, session caching, custom components, a non-Linux
host or an unsupported torch or device. The adapter asks for it by name
(``CacheInitParams.tree_core_backend="rust"``) and refuses a fallback.

It drives the cache as ``SglangSwaAdapter`` does (same pools and allocator, slot shift,
DEV-24, the scheduler's free paths; see that module's docstring) and reads the tree
through the Rust binding, which has no Python nodes (``node_by_id``/``root_node`` raise
NotImplementedError). It composes rather than subclasses ``SglangSwaAdapter``: that class
builds a Python-core cache in its constructor, and is the reference here.

What the binding shows, and where each field of ``SwaView`` comes from:

=========================  ==================================================================
field                      how it is observed
=========================  ==================================================================
nodes                      handle scan: ``collect_path_info([h])`` answers a live handle
                           (parent, path span) and raises KeyError otherwise (spec/07r)
page full / SWA slots      ``get_component_device_value(h, FULL / SWA)`` (SWA None: a
                           tombstone node); directly
page keys                  the tokens are not exposed on the device tier
                           (``build_storage_backup_spec`` is None for a node never backed
                           up). A page's key is the content its last full slot was
                           inserted with, as the adapter recorded at ``insert``; its
                           length is checked against the node's path span
page ``lock``              ``pretty_print`` (``[h] len full_lock=N Full=.. Swa=..``),
                           parsed from fd 1 as ``sglang_rust`` does (DEV-R2); directly
page ``swa_lock``          NOT exposed as a count. Directly observed: whether it is zero,
                           for live nodes (``walk_for_kv_canary(unlocked_only=True,
                           swa_resident_only=True)`` lists the full slots of live nodes
                           whose SWA lock is 0), and the SWA evictable/protected totals.
                           The count is read off the reference core (below)
free sets, mapping, KV     the allocator and pools (Python): directly, as ``sglang_swa``
own check                  the binding's ``sanity_check``, the per-pool balance, and the
                           totals recomputed from the scan (full and SWA evictable and
                           protected) against the binding's counters
=========================  ==================================================================

The reference: an ``SglangSwaAdapter`` (Python tree core, its own pools) given every call
this adapter gets. Every call must answer alike (the slots allocated, the match, the
insert's prefix, the tokens each eviction frees), and at every observation both must hold
the same pages with the same full and SWA slots and full locks, the same radix-node
partition (SWA locks cover whole nodes, DEV-H1: ``swa_lock`` read per page is only
meaningful if the nodes agree), the same pages with a zero SWA lock, and the same free
sets, mapping and KV; otherwise ``Parted``. Only then is each page's ``swa_lock`` taken
from the reference.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from hiradix.conformance.hybrid.engine import LockGranularity, SwaPageView, SwaView
from hiradix.engines.protocol import EngineUnavailable
from hiradix.engines.sglang.rust import stdout_of
from hiradix.engines.sglang.rust_reference import Parted
from hiradix.engines.sglang.swa import SglangSwaAdapter, SwaPoolPair
from hiradix.engines.sglang.swa import probe as probe_python_core
from hiradix.engines.sglang.unified import prepare, radix_key
from hiradix_model import Key
from hiradix_model.hybrid import SwaConfig

NAME = "sglang-swa-rust"
SETUP = "make sglang23-env (the wheel ships rust_tree_core/mem_cache.*.so)"
RUST_MODULE = "sglang.srt.mem_cache.rust_tree_core.mem_cache"
POOL_MODULE = "sglang.srt.mem_cache.swa_memory_pool"
ALLOCATOR_MODULE = "sglang.srt.mem_cache.allocator.swa"
RUST_ADAPTER_MODULE = "sglang.srt.mem_cache.rust_tree_core.adapter"
# A scan past the highest handle seen: more than one step ever mints.
HANDLE_MARGIN = 256
_LOCK_LINE = re.compile(
    r"^\s*\[(\d+)\]\s+(\d+)\s+full_lock=(\d+)\s+Full=(yes|no)\s+Swa=(yes|no)\s*$")


def probe(engine: str = NAME) -> str:
    """The installed SGLang version if it has the Rust tree core and the (FULL, SWA) API
    ``SglangSwaAdapter`` drives; ``EngineUnavailable`` otherwise."""
    version = probe_python_core(engine)
    if importlib.util.find_spec(RUST_MODULE) is None:
        raise EngineUnavailable(f"{engine}: the compiled {RUST_MODULE} is missing ({SETUP})",
                                "api")
    return version


@dataclass(frozen=True)
class RustNode:
    """One node of the Rust tree, as the binding shows it (SGLang slot ids)."""

    handle: int
    parent: int
    start: int  # path offsets from the root, in tokens
    end: int
    full: tuple[int, ...]
    swa: tuple[int, ...] | None  # None: a tombstone node
    lock: int  # the full lock count (pretty_print)
    # Whether its SWA lock is positive (walk_for_kv_canary); None for a tombstone node,
    # which the canary walk leaves out whatever its count.
    swa_locked: bool | None


@dataclass(frozen=True)
class Receipt:
    """A lock on both cores."""

    rust: Any  # UnifiedRadixCache.lock's TreeLock (node handle and DecLockRefParams)
    python: object  # the reference adapter's receipt, opaque


class SglangSwaRustAdapter:
    """One (FULL, SWA) ``UnifiedRadixCache`` on ``RustUnifiedTreeCore``, device tier,
    checked call by call against a Python-core ``SglangSwaAdapter``.

    The reference is used through its ``SwaEngine`` interface only (and its tree's public
    SGLang nodes, for the node partition): this adapter keeps its own pools and
    allocator and makes the allocator-side calls as ``SglangSwaAdapter`` makes them (the
    scheduler's paths, named at each call), so that the two stay independent."""

    name = NAME
    lock_granularity: LockGranularity = "node"  # DEV-H1, as on the Python core

    def __init__(self, config: SwaConfig) -> None:
        self.version = probe()
        self.config = config
        self.reference = SglangSwaAdapter(config)
        self.env = prepare()
        self.m = self.env.modules
        ps = self.ps = config.page_size
        self.pools = SwaPoolPair(config, importlib.import_module(POOL_MODULE),
                                 importlib.import_module(ALLOCATOR_MODULE))
        self.allocator = self.pools.allocator
        self.held = self.pools.held  # caller-held full slot -> has its SWA half
        types = self.m["components"].ComponentType
        self.full_ct, self.swa_ct = types.FULL, types.SWA
        params = self.m["params"].CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.allocator,
            page_size=ps, eviction_policy="lru", tp_cache_group=self.env.group,
            tree_components=(self.full_ct, self.swa_ct), sliding_window_size=config.window,
            tree_core_backend="rust")
        self.cache = self.m["uni"].UnifiedRadixCache(params)
        self.tree = self.cache.tree_core
        rust_core = importlib.import_module(RUST_ADAPTER_MODULE)
        if type(self.tree) is not rust_core.RustUnifiedTreeCore:
            raise EngineUnavailable(f"{NAME}: asked for the Rust tree core, got "
                                    f"{type(self.tree).__name__} ({SETUP})")
        self.freed_by_tree: set[int] = set()  # DEV-24: duplicates the last insert freed
        self.contents: dict[int, Key] = {}  # SGLang full slot -> the content inserted there
        self.root = int(self.tree.root_node_handle(None))
        self.high_handle = self.root

    def _out(self, slots: Iterable[int]) -> tuple[int, ...]:
        return self.pools.to_model(slots)

    @staticmethod
    def agree(what: str, rust: object, python: object) -> None:
        if rust != python:
            raise Parted(f"{what}: the Rust core gives {rust}, the Python core {python}")

    # -- the Rust tree, read ---------------------------------------------------------------

    def _rust_locks(self) -> dict[int, tuple[int, int, bool, bool]]:
        """handle -> (key length, full lock, Full=yes, Swa=yes) from ``pretty_print``."""
        found: dict[int, tuple[int, int, bool, bool]] = {}
        for line in stdout_of(self.tree.pretty_print).splitlines():
            if not line.strip():
                continue
            parsed = _LOCK_LINE.match(line)
            if parsed is None:
                raise AssertionError(f"{NAME}: pretty_print line not understood: {line!r}")
            handle, length, lock, full, swa = parsed.groups()
            found[int(handle)] = (int(length), int(lock), full == "yes", swa == "yes")
        return found

    def _rust_scan(self) -> dict[int, RustNode]:
        """Every live node but the root, by handle."""
        printed = self._rust_locks()
        canary = self.tree.walk_for_kv_canary(True, True)
        swa_unlocked = set(canary.slot_indices.tolist())
        nodes: dict[int, RustNode] = {}
        for handle in range(self.root + 1, self.high_handle + HANDLE_MARGIN):
            try:
                (path,) = self.tree.collect_path_info([handle])
            except KeyError:
                continue
            info = path[-1]
            assert info.node_id == handle, (info, handle)
            full = self.tree.get_component_device_value(handle, self.full_ct)
            swa = self.tree.get_component_device_value(handle, self.swa_ct)
            assert full is not None, f"{NAME}: node {handle} has no full value (device tier)"
            full_slots = tuple(int(s) for s in full.tolist())
            unlocked = {s in swa_unlocked for s in full_slots}
            assert len(unlocked) <= 1, f"{NAME}: node {handle} is partly SWA-locked"
            length, lock, has_full, has_swa = printed[handle]
            assert (length, has_full, has_swa) == (int(info.path_end - info.path_start),
                                                   True, swa is not None), (
                f"{NAME}: pretty_print {printed[handle]} disagrees with node {handle}")
            nodes[handle] = RustNode(
                handle, int(info.parent_id), int(info.path_start), int(info.path_end),
                full_slots, None if swa is None else tuple(int(s) for s in swa.tolist()),
                lock, None if swa is None else unlocked == {False})
        assert set(printed) == set(nodes) | {self.root}, (
            f"{NAME}: pretty_print handles {sorted(printed)}, scan {sorted(nodes)}")
        if nodes:
            self.high_handle = max(self.high_handle, *nodes)
        return nodes

    def _rust_pages(self, nodes: Mapping[int, RustNode]
                    ) -> dict[Key, tuple[RustNode, tuple[int, ...], tuple[int, ...] | None]]:
        """Each page's node and its full and SWA slots (SGLang's)."""
        pages = {}
        for node in nodes.values():
            parent_end = 0 if node.parent == self.root else nodes[node.parent].end
            if node.start != parent_end:
                raise AssertionError(f"{NAME}: node {node} does not start where its parent "
                                     f"ends ({parent_end})")
            if len(node.full) != node.end - node.start or len(node.full) % self.ps:
                raise AssertionError(f"{NAME}: node {node} is not whole pages of its span")
            if node.swa is not None and len(node.swa) != len(node.full):
                raise AssertionError(f"{NAME}: node {node} has a partial SWA value")
            for cut in range(0, len(node.full), self.ps):
                span = slice(cut, cut + self.ps)
                key = self.contents.get(node.full[span][-1])
                assert key is not None, f"{NAME}: node {node.handle} holds a slot never inserted"
                assert len(key.tokens) == node.start + cut + self.ps, (key, node)
                pages[key] = (node, node.full[span],
                              None if node.swa is None else node.swa[span])
        return pages

    def _handle_of(self, page: Key) -> int | None:
        for key, (node, _, _) in self._rust_pages(self._rust_scan()).items():
            if key == page and node.end == len(page.tokens):
                return node.handle
        return None

    # -- the operations, on both cores ------------------------------------------------------

    def alloc(self, num_tokens: int) -> tuple[int, ...] | None:
        answer = self.pools.alloc(num_tokens, self.freed_by_tree)
        self.agree(f"alloc({num_tokens})", answer, self.reference.alloc(num_tokens))
        return answer

    def write_kv(self, full_slots: Sequence[int], codes: Sequence[int]) -> None:
        self.pools.write_kv(full_slots, codes)
        self.reference.write_kv(full_slots, codes)

    def free_swa(self, full_slots: Sequence[int]) -> None:
        self.pools.free_swa(full_slots)
        self.reference.free_swa(full_slots)

    def free(self, full_slots: Sequence[int]) -> None:
        self.pools.free(full_slots, self.freed_by_tree)
        self.reference.free(full_slots)

    def match_prefix(self, key: Key) -> tuple[tuple[int, ...], Key | None]:
        got = self.cache.match_prefix(self.m["base"].MatchPrefixParams(
            key=radix_key(self.env, key)))
        handle = int(got.last_device_node)
        self.high_handle = max(self.high_handle, handle)
        slots = self.tree.collect_full_device_indices(handle, self.root).tolist()
        assert len(slots) == int(got.device_prefix_len), (slots, got.device_prefix_len)
        page = Key(key.tokens[:len(slots)], key.namespace) if slots else None
        answer = (self._out(int(s) for s in slots), page)
        self.agree(f"match_prefix({key.tokens})", answer, self.reference.match_prefix(key))
        return answer

    def insert(self, key: Key, full_slots: Sequence[int], swa_evicted: int) -> int:
        mine = self.pools.to_sglang(full_slots)
        pages = self._rust_pages(self._rust_scan())
        # DEV-24: the caller's leading run of the tree's own slots, page by page.
        cached: list[int] = []
        for end in range(self.ps, len(key.tokens) + 1, self.ps):
            found = pages.get(Key(key.tokens[:end], key.namespace))
            if found is None:
                break
            cached.extend(found[1])
        prev = 0
        while prev < min(len(cached), len(mine)) and mine[prev] == cached[prev]:
            prev += 1
        for position, slot in enumerate(mine):
            self.contents[slot] = Key(key.tokens[:position + 1], key.namespace)
        free_before = self.pools.full_free()
        result = self.cache.insert(self.m["base"].InsertParams(
            key=radix_key(self.env, key), value=torch.tensor(mine, dtype=torch.int64),
            prev_prefix_len=prev,
            component_evicted_seqlens={self.swa_ct: swa_evicted}))
        freed = self.pools.full_free() - free_before
        self.freed_by_tree = set(mine[prev:]) & freed
        taken = {int(s) for s in self.tree.all_values_flatten().tolist()}
        for slot in mine:
            if slot in taken or slot in self.freed_by_tree:
                self.held.pop(slot, None)
        self.high_handle = max(self.high_handle, int(result.last_device_node))
        prefix = int(result.prefix_len)
        self.agree(f"insert({key.tokens}) prefix", prefix,
                   self.reference.insert(key, full_slots, swa_evicted))
        return prefix

    def lock(self, page: Key | None) -> object:
        handle = self.root if page is None else self._handle_of(page)
        if handle is None and page is not None:
            # The server locks the node its match ended at; a match splits there (as
            # SglangSwaAdapter.lock, whose own match the reference makes below).
            self.cache.match_prefix(self.m["base"].MatchPrefixParams(
                key=radix_key(self.env, page)))
            handle = self._handle_of(page)
        if handle is None:
            raise KeyError(f"{NAME}: {page} is not cached")
        return Receipt(self.cache.lock(handle), self.reference.lock(page))

    def release_swa(self, receipt: object) -> None:
        if not isinstance(receipt, Receipt):
            raise TypeError(f"{NAME}: a receipt is a Receipt from lock(), got {receipt!r}")
        # UnifiedRadixCache.release_swa: dec_swa_lock_only, then its frees applied.
        self.cache.release_swa(receipt.rust)
        self.reference.release_swa(receipt.python)

    def unlock(self, receipt: object, swa_released: bool) -> None:
        if not isinstance(receipt, Receipt):
            raise TypeError(f"{NAME}: a receipt is a Receipt from lock(), got {receipt!r}")
        self.cache.dec_lock_ref(receipt.rust.node, receipt.rust.receipt,
                               skip_swa=swa_released)
        self.reference.unlock(receipt.python, swa_released)

    def evict_full(self, num_tokens: int) -> int:
        got = self.cache.evict(self.m["base"].EvictParams(num_tokens=num_tokens))
        freed = int(got.num_tokens_evicted)
        self.agree(f"evict_full({num_tokens})", freed, self.reference.evict_full(num_tokens))
        return freed

    def evict_swa(self, num_tokens: int) -> int:
        got = self.cache.evict(self.m["base"].EvictParams(swa_num_tokens=num_tokens))
        freed = int(got.swa_num_tokens_evicted)
        self.agree(f"evict_swa({num_tokens})", freed, self.reference.evict_swa(num_tokens))
        return freed

    def evict_for_alloc(self, full_need: int, swa_need: int) -> int:
        # The server allocator's call (spec/13 13.3): UnifiedRadixCache.evict_for_alloc is
        # Python over the tree core, so the Rust core's walk answers it; the reference
        # takes the same call so that its recency and SWA locks stay the Rust core's.
        got = self.cache.evict_for_alloc(
            self.m["base"].EvictParams(num_tokens=full_need, swa_num_tokens=swa_need))
        freed = int(got.num_tokens_evicted)
        self.agree(f"evict_for_alloc({full_need}, {swa_need})", freed,
                   self.reference.evict_for_alloc(full_need, swa_need))
        return freed

    # -- the view ---------------------------------------------------------------------------

    def observe(self) -> SwaView:
        nodes = self._rust_scan()
        read = self._rust_pages(nodes)
        # swa_lock is a placeholder here (1: positive, 0: zero or a tombstone); the count
        # comes from the reference in _with_reference_swa_locks.
        pages = {key: SwaPageView(full=self._out(full),
                                  swa=None if swa is None else self._out(swa),
                                  lock=node.lock, swa_lock=int(bool(node.swa_locked)))
                 for key, (node, full, swa) in read.items()}
        view = SwaView(
            pages=pages, **self.pools.view_fields(),
            own_check=self._rust_own_check(nodes))
        return self._with_reference_swa_locks(view, nodes, read)

    def _with_reference_swa_locks(
            self, view: SwaView, nodes: Mapping[int, RustNode],
            read: Mapping[Key, tuple[RustNode, tuple[int, ...], tuple[int, ...] | None]]
    ) -> SwaView:
        """``view`` with each page's SWA lock count taken off the reference, once the
        reference is shown to hold the same tree (module docstring); ``Parted`` if not."""
        ref = self.reference.observe()
        for name in ("full_free", "swa_free", "pairs", "full_kv", "swa_kv"):
            self.agree(name, getattr(view, name), getattr(ref, name))
        self.agree("pages (full, SWA, full lock, SWA lock positive where live)",
                   {k: (p.full, p.swa, p.lock, read[k][0].swa_locked)
                    for k, p in view.pages.items()},
                   {k: (p.full, p.swa, p.lock, None if p.swa is None else p.swa_lock > 0)
                    for k, p in ref.pages.items()})
        self.agree("radix nodes (full slots)",
                   sorted(self._out(n.full) for n in nodes.values()),
                   sorted(self._reference_nodes()))
        pages = {k: replace(p, swa_lock=ref.pages[k].swa_lock) for k, p in view.pages.items()}
        # The Rust core's own check first; the reference's (the Python core's sanity_check
        # and balance) is reported too, since its counts are now part of the view.
        own = view.own_check or (None if ref.own_check is None
                                 else f"reference (Python core): {ref.own_check}")
        return replace(view, pages=pages, own_check=own)

    def _reference_nodes(self) -> list[tuple[int, ...]]:
        """The full slots of each node of the reference's Python tree (model ids)."""
        found = []
        stack = list(self.reference.tree.root_node.children.values())
        while stack:
            node = stack.pop()
            found.append(self._out(node.component_data[self.full_ct].value.tolist()))
            stack.extend(node.children.values())
        return found

    def _rust_own_check(self, nodes: Mapping[int, RustNode]) -> str | None:
        """The binding's ``sanity_check``; the totals the scan gives against the binding's
        counters; the per-pool balance (available + evictable + protected + held by callers
        = capacity), as ``SglangSwaAdapter`` checks it on the Python core."""
        try:
            self.cache.sanity_check()
        except AssertionError as failed:
            return f"sanity_check: {failed}"
        scanned = {
            "full evictable": sum(len(n.full) for n in nodes.values() if n.lock == 0),
            "full protected": sum(len(n.full) for n in nodes.values() if n.lock > 0),
            "swa evictable": sum(len(n.full) for n in nodes.values() if n.swa_locked is False),
            "swa protected": sum(len(n.full) for n in nodes.values() if n.swa_locked),
        }
        counted = {"full evictable": self.cache.full_evictable_size(),
                   "full protected": self.cache.full_protected_size(),
                   "swa evictable": self.cache.swa_evictable_size(),
                   "swa protected": self.cache.swa_protected_size()}
        for what, total in scanned.items():
            if total != int(counted[what]):
                return f"{what}: the nodes give {total}, the binding counts {counted[what]}"
        flat = {int(s) for s in self.tree.all_values_flatten().tolist()}
        owned = {s for n in nodes.values() for s in n.full}
        if flat != owned:
            return f"all_values_flatten {sorted(flat)} != the nodes' {sorted(owned)}"
        return self.pools.balance_problem(
            (counted["full evictable"], counted["full protected"]),
            (counted["swa evictable"], counted["swa protected"]))

    def close(self) -> None:
        self.cache.shutdown()
        self.reference.close()


def build(config: SwaConfig) -> SglangSwaRustAdapter:
    """An ``SglangSwaRustAdapter`` for ``config``."""
    return SglangSwaRustAdapter(config)
