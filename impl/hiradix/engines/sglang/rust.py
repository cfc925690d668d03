"""Adapter for SGLang 0.5.23's ``UnifiedRadixCache`` on its Rust tree core (engine
``sglang-unified-rust``).

SGLang must be importable at 0.5.23 (``make sglang23-env`` builds ``.venv-sglang23``)
with its compiled ``sglang/srt/mem_cache/rust_tree_core/mem_cache.*.so``. The core is
selected explicitly, per cache, with ``CacheInitParams(tree_core_backend="rust")``
(the process-wide default is ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND``, "rust");
SGLang silently falls back to the Python core when the Rust one cannot run
(``tree_core_registry.resolve_tree_core_backend``), so the adapter checks the core's
class after construction and refuses a fallback.

Scope: the device tier only (``tree_components=(FULL,)``, no ``init_hicache``): the
operations RadixCache has. The host tier is ``sglang_rust_hicache``'s (spec/07r). Shared with
``sglang_unified``: ``prepare`` (CPU patches), ``radix_key``, ``to_engine``/``from_engine``;
its ``build`` always attaches HiCache, so the device-tier cache is built here.

What the Rust core shows to Python (0.5.23, read off ``rust_tree_core/adapter.py`` and
the binding, then tried here):

==============================  ==========================================================
what                             how it is observed
==============================  ==========================================================
core selection                   ``CacheInitParams.tree_core_backend`` ("rust"); the core's
                                 class is ``RustUnifiedTreeCore`` (checked)
match_prefix                     ``device_prefix_len`` and node *handles* (ints):
                                 ``last_device_node``, ``last_host_node``,
                                 ``best_match_node``; ``host_hit_length``. Device slots:
                                 ``collect_full_device_indices(last_device_node, root)``
inc_lock_ref                     ``IncLockRefResult``: ``delta`` (evictable tokens) and a
                                 receipt (``to_dec_params()``) that dec_lock_ref requires
dec_lock_ref                     returns nothing: the delta is read off
                                 ``evictable_size()`` before and after
evictable / protected tokens     ``evictable_size()`` / ``protected_size()``
free device slots                the allocator (Python): ``free_pages``/``release_pages``
nodes                            no iteration API. Handles are small ints minted in order
                                 and never re-minted; ``collect_path_info([h])`` answers a
                                 live handle (parent, path span, device length) and raises
                                 KeyError otherwise: the adapter scans handles from the
                                 root's up
device slots per node            ``get_component_device_value(h, FULL)``
host slots per node              ``build_storage_backup_spec(h, False).host_value`` (a
                                 backed-up node; read-only); unused on the device tier
lock refs per node               only in ``pretty_print()`` (Rust stdout:
                                 ``[h] len full_lock=N Full=yes``): parsed from fd 1
                                 (DEV-R2); ``walk_for_kv_canary(True)`` only tells
                                 locked from unlocked slots
host lock refs per node          not exposed (unused on the device tier)
tokens / namespace per node      not exposed: decoded from the KV bytes at the node's
                                 slots, which name their content (spec/06 KV codebook)
hits, ticks, priority            not exposed anywhere (no accessor, not in pretty_print,
                                 the clock is Rust's own): spec/07r DEV-R1
KV bytes                         the device pool's ``k_buffer``/``v_buffer`` (MHA) or
                                 ``kv_buffer`` (MLA) (Python)
==============================  ==========================================================

How ``observe`` is built (partial observation): the suite compares whole ``State``\\s,
but four per-page fields (``hits``, ``last_tick``, ``insert_tick``, ``priority``: the
adapter's ``unobservable``) cannot be read from the Rust core. ``observe`` therefore

1. reads every field it can from the engine -- the pages (from the node scan and the KV
   bytes), their device slots and lock counts, free and held slots, the KV bytes at
   every slot a page or a caller holds, the evictable and protected totals;
2. checks, with assertions, what the engine's own counters say about that reading:
   the evictable and protected totals recomputed from the node scan equal
   ``evictable_size()``/``protected_size()``, the tree's slots equal
   ``all_values_flatten()``, the free count equals ``available_size()``, and no slot is
   both in the tree and on the free list;
3. fills only the ``unobservable`` fields: from the Python reference core
   (``sglang_rust_reference``: a Python-core cache given every call the Rust core gets,
   checked to answer alike and to hold the same pages, slots, locks and totals, or
   ``Parted``), adopting its recency as the Python-core adapter does (DEV-1, DEV-21);
   without a reference (``_reference`` returns None: tests),
   from the model's page of the same key (zero for a page the model lacks, which the
   comparison then reports anyway).

So a wrong recency, hit count or priority in the Rust core is seen through its
consequences: which pages an eviction removes (the suite infers victims from observed
pages and the model checks the choice under the reference's stamps), and where the
Rust core parts from the Python core. Without a reference, DEV-1 / DEV-4 cannot be
adopted, and a choice that ties on recency after a split is reported as a divergence
(spec/07r DEV-R1).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hiradix.conformance.abstraction import decode_kv
from hiradix.conformance.kv import patterns
from hiradix.conformance.scenario import Scenario
from hiradix.engines.protocol import EngineAdapter, EngineUnavailable, probe_engine
from hiradix.engines.sglang.radix import (
    CACHE_SLOT_AFTER_CALLER_SLOT,
    DTYPE,
    KV_LAYOUTS,
    LAYERS,
    chunked_only,
    device_pools,
    read_device_kv,
    token_shape,
    write_device_kv,
)
from hiradix.engines.sglang.rust_reference import PythonReference, Stamps
from hiradix.engines.sglang.unified import (
    from_engine,
    prepare,
    radix_key,
    to_engine,
)
from hiradix_model import Config, Key, Page, State, ops
from hiradix_model.keys import page_keys

OPERATIONS = frozenset({"match_prefix", "insert", "inc_lock_ref", "dec_lock_ref", "alloc",
                        "free", "evict", "reset"})
SETUP = "make sglang23-env, then run .venv-sglang23/bin/hiradix"
VERSIONS = ("0.5.23",)  # the Rust tree core ships with 0.5.23
# A scan past the highest handle seen: more than one step ever mints (a split and a leaf).
HANDLE_MARGIN = 256
_LOCK_LINE = re.compile(r"^\s*\[(\d+)\]\s+(\d+)\s+full_lock=(\d+)\s")

UNOBSERVABLE: Mapping[str, str] = {
    "hits": "the Rust core keeps hit counts in its nodes with no accessor; pretty_print "
            "omits them",
    "last_tick": "recency is a Rust-side field with no accessor (and its clock is not "
                 "Python's time, so the suite's logical clock cannot reach it)",
    "insert_tick": "creation time is a Rust-side field with no accessor",
    "priority": "the node priority is a Rust-side field with no accessor",
}


# Modules the shared preparation (``sglang_unified.prepare``) does not import.
_RUST_MODULES = {
    "rust": "sglang.srt.mem_cache.rust_tree_core.adapter",
    "urc": "sglang.srt.mem_cache.unified_radix_cache",
}


def _prepare() -> Any:
    """The shared CPU preparation (``sglang_unified.prepare``: imports, pin_memory,
    transfer stand-in, gloo group), plus the Rust core's own modules."""
    import importlib
    env = prepare()
    for name, module in _RUST_MODULES.items():
        env.modules.setdefault(name, importlib.import_module(module))
    return env


def probe(engine: str) -> str:
    """The installed SGLang version, if it has the Rust tree core this adapter drives."""
    def load() -> None:
        import importlib.util
        if importlib.util.find_spec("sglang.srt.mem_cache.rust_tree_core.mem_cache") is None:
            raise ImportError("the compiled rust_tree_core/mem_cache extension is missing")
        _prepare()
    return probe_engine(engine, "sglang", VERSIONS, "the Rust tree core", SETUP, load)


@dataclass(frozen=True)
class _Node:
    """One node of the Rust tree as the adapter reads it."""

    handle: int
    parent: int
    start: int  # path offsets from the root, in tokens
    end: int
    device: tuple[int, ...] | None  # SGLang slots
    lock: int
    host: tuple[int, ...] | None = None  # host slots (a backed-up node; host tier only)


def stdout_of(call: Callable[[], None]) -> str:
    """What ``call`` writes to file descriptor 1 (Rust's stdout)."""
    sys.stdout.flush()
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(1)
        try:
            os.dup2(sink.fileno(), 1)
            call()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        return sink.read().decode()


def _fingerprint(values: torch.Tensor) -> bytes:
    """One token's KV in all layers (``[layers, 2, ...]``) as a lookup key."""
    return bytes(values.contiguous().view(torch.uint8).flatten().tolist())


class SglangRustAdapter:
    """``UnifiedRadixCache`` with ``RustUnifiedTreeCore``, device tier, one scenario."""

    name = "sglang-unified-rust"

    def __init__(self, scenario: Scenario) -> None:
        if scenario.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"scenario: the SGLang Rust-core adapter takes {KV_LAYOUTS}")
        self.env = _prepare()
        m = self.env.modules
        self.version = probe(self.name)
        ps = self.ps = scenario.page_size
        device_slots = scenario.device_pages * ps
        self.token_shape = token_shape(scenario.kv_layout)
        self.full = m["components"].ComponentType.FULL
        self._build(scenario)
        if not isinstance(self.cache.tree_core, m["rust"].RustUnifiedTreeCore):
            raise EngineUnavailable(f"{self.name}: SGLang fell back to "
                                    f"{type(self.cache.tree_core).__name__} ({SETUP})")
        self.core = self.cache.tree_core
        self.operations = OPERATIONS
        self.config = Config(page_size=ps, device_slots=device_slots, host_slots=0,
                             write_policy="write_through", eviction=scenario.eviction,
                             load_back_threshold=scenario.threshold_pages * ps)
        self.reference = self._reference(scenario)
        # Recency and hit counts cannot be read off the Rust core. With the Python core as
        # reference they are read off it, and its recency is adopted as the Python-core
        # adapter adopts it; without, the model's are kept and nothing is adopted.
        self.adopted: Mapping[str, str] = {} if self.reference is None else {
            "last_tick": "DEV-1 (a split stamps the unmatched suffix), DEV-21 (stamps from a "
                         "global counter): read off the Python reference core given the same "
                         "calls, which holds the same pages, slots and locks (DEV-R1)",
        }
        self.unobservable: Mapping[str, str] = UNOBSERVABLE
        self.mapped: Mapping[str, str] = {
            "slot ids": f"SGLang reserves device page 0 for padding: spec slot = SGLang slot "
                        f"- {ps}",
            "last_host_page": "no host tier: SGLang's last_host_node is not a host page",
            "lock deltas": "inc_lock_ref: SGLang reports the tokens protected, the spec the "
                           "evictable delta (negated); dec_lock_ref: SGLang returns none, "
                           "read off evictable_size()",
            "lock receipts": "dec_lock_ref takes the receipt of an inc_lock_ref on the same "
                             "node; the adapter keeps them per node, last in first out",
            "prev_prefix_len": "DEV-24: insert passes the caller's matched device prefix; the "
                               "tree frees the duplicate slots past it, so the caller's "
                               "free of those slots is already done",
            "chunked": "DEV-25: chunked=True is inserted_len=len(key) (page-aligned), "
                       "False is 0",
            "pages": "keys decoded from the KV bytes at each node's slots (spec/06)",
        }
        self.guards: Mapping[str, str] = {}  # none verified (spec/07 Reach lines)
        self.avoid: Mapping[str, str] = {}
        self.inexpressible: Mapping[str, str] = {
            "counted_from_inside": "DEV-25: inserted_len inside the key is only checked on "
                                   "the Python tree core (spec/07r)",
            **CACHE_SLOT_AFTER_CALLER_SLOT,
        }
        self.receipts: dict[int, list[Any]] = {}
        self.freed_by_tree: set[int] = set()
        self.contents: dict[bytes, Key] = {}  # KV fingerprint -> the content written
        self.high_handle = int(self.core.root_node_handle(None))

    def _reference(self, scenario: Scenario) -> PythonReference | None:
        """The Python core given the same calls (``sglang_rust_reference``)."""
        return PythonReference(self.env, scenario)

    def _build(self, scenario: Scenario) -> None:
        """The pools and the cache: the device tier only."""
        m, ps = self.env.modules, scenario.page_size
        args = m["args"].ServerArgs(model_path="dummy", device="cpu", page_size=ps)
        m["context"].publish(args, role="test")
        self.kv, self.allocator = device_pools(m, ps, scenario.device_pages,
                                               scenario.kv_layout)
        params = m["params"].CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.allocator,
            page_size=ps, eviction_policy=scenario.eviction, tree_components=(self.full,),
            tree_core_backend="rust")
        self.cache = m["urc"].UnifiedRadixCache(params)

    # -- plumbing ---------------------------------------------------------------------

    def _key(self, key: Key) -> Any:
        return radix_key(self.env, key)

    def _to_engine(self, slots: Sequence[int]) -> torch.Tensor:
        return to_engine(slots, self.ps)

    def _from_engine(self, slots: torch.Tensor) -> tuple[int, ...]:
        return from_engine(slots, self.ps)

    def _seen(self, *handles: int) -> None:
        self.high_handle = max(self.high_handle, *handles)

    def _locks(self) -> dict[int, int]:
        """Lock refs per node handle, from the core's debug print."""
        locks = {}
        for line in stdout_of(self.core.pretty_print).splitlines():
            found = _LOCK_LINE.match(line)
            if found:
                locks[int(found.group(1))] = int(found.group(3))
        return locks

    def _scan(self) -> dict[int, _Node]:
        """Every live non-root node, found by asking for each handle's path."""
        root = int(self.core.root_node_handle(None))
        locks = self._locks()
        nodes: dict[int, _Node] = {}
        for handle in range(root + 1, self.high_handle + HANDLE_MARGIN):
            try:
                (path,) = self.core.collect_path_info([handle])
            except KeyError:
                continue
            info = path[-1]
            assert info.node_id == handle
            value = self.core.get_component_device_value(handle, self.full)
            nodes[handle] = _Node(handle, int(info.parent_id), int(info.path_start),
                                  int(info.path_end),
                                  None if value is None else tuple(value.tolist()),
                                  locks[handle], self._host_value(handle))
        if nodes:
            self._seen(*nodes)
        assert set(locks) == set(nodes) | {root}, "pretty_print and the handle scan disagree"
        return nodes

    def _host_value(self, handle: int) -> tuple[int, ...] | None:
        """A node's host slots: none on the device tier."""
        return None

    def _handle(self, page: Key | None) -> int:
        """The handle of the node that ends at ``page`` (a match has put a boundary
        there): found with the scan, not a match, which would touch recency."""
        root = int(self.core.root_node_handle(page.namespace if page else None))
        if page is None:
            return root
        for node in self._scan().values():
            if node.end == len(page.tokens) and self._node_keys(node)[-1] == page:
                return node.handle
        raise KeyError(f"{self.name}: no node ends at {page}")

    def _node_keys(self, node: _Node) -> list[Key]:
        """The keys of a node's pages, read off the KV bytes at each page's last slot
        (device, or host for a node that has left the device): a page's key is the
        prefix its last token's KV depends on."""
        keys = []
        for cut in range(self.ps - 1, node.end - node.start, self.ps):
            key = (self._content(node.device[cut]) if node.device is not None
                   else self._host_content(node.host[cut]) if node.host is not None
                   else None)
            where = "device" if node.device is not None else "host"
            assert key is not None, f"node {node.handle}: {where} KV nobody wrote"
            assert len(key.tokens) == node.start + cut + 1, (key, node)
            keys.append(key)
        return keys

    def _host_content(self, slot: int) -> Key | None:
        raise AssertionError(f"{self.name}: a node with neither device nor host value")

    def _read_device(self, engine_slots: Sequence[int]) -> torch.Tensor:
        """``[layers, len(slots), *token_shape]``."""
        return read_device_kv(self.kv, torch.tensor(list(engine_slots), dtype=torch.int64))

    def _content(self, engine_slot: int) -> Key | None:
        """Whose KV the device slot holds, if the adapter wrote it."""
        read = self._read_device([engine_slot])[:, 0]
        return self.contents.get(_fingerprint(read))

    # -- the operations -----------------------------------------------------------------

    def set_time(self, now: int) -> None:
        # The Rust core's recency clock is its own (UNOBSERVABLE): nothing to set there.
        self.now = now
        if self.reference is not None:
            self.reference.set_time(now)

    def match_prefix(self, key: Key) -> ops.MatchResult:
        got = self.cache.match_prefix(self.env.modules["base"].MatchPrefixParams(
            key=self._key(key)))
        self._seen(int(got.last_device_node))
        root = self.core.root_node_handle(key.namespace)
        slots = self.core.collect_full_device_indices(got.last_device_node, root)
        assert len(slots) == got.device_prefix_len, (len(slots), got.device_prefix_len)
        if self.reference is not None:
            self.reference.agree(f"match_prefix({key}) device prefix, host hit",
                                 (int(got.device_prefix_len), int(got.host_hit_length)),
                                 self.reference.match_prefix(key))
        last = None
        if got.device_prefix_len:
            last = Key(key.tokens[:got.device_prefix_len], key.namespace)
        return ops.MatchResult(self._from_engine(slots), last, None, 0)

    def inc_lock_ref(self, page: Key | None) -> int:
        handle = self._handle(page)
        result = self.cache.inc_lock_ref(handle)
        self.receipts.setdefault(handle, []).append(result.to_dec_params())
        if self.reference is not None:
            self.reference.agree(f"inc_lock_ref({page})", int(result.delta),
                                 self.reference.inc_lock_ref(page))
        return -int(result.delta)  # the tokens it protected: the evictable size drops

    def dec_lock_ref(self, page: Key | None) -> int:
        handle = self._handle(page)
        before = int(self.cache.evictable_size())
        self.cache.dec_lock_ref(handle, self.receipts[handle].pop())
        delta = int(self.cache.evictable_size()) - before
        if self.reference is not None:
            self.reference.agree(f"dec_lock_ref({page})", delta,
                                 self.reference.dec_lock_ref(page))
        return delta

    def num_free_slots(self) -> int:
        return int(self.allocator.available_size())

    def alloc(self, num_tokens: int) -> tuple[int, ...] | None:
        slots = self.allocator.alloc(num_tokens)
        if self.reference is not None:
            self.reference.agree(f"alloc({num_tokens})", None if slots is None
                                 else slots.tolist(), self.reference.alloc(num_tokens))
        return None if slots is None else self._from_engine(slots)

    def free(self, slots: Sequence[int]) -> None:
        # DEV-24: the duplicates the tree freed in the last insert are not freed twice.
        rest = [s for s in slots if s not in self.freed_by_tree]
        self.freed_by_tree.difference_update(slots)
        if rest:
            self.allocator.free(self._to_engine(rest))
            if self.reference is not None:
                self.reference.free(self._to_engine(rest))

    def write_kv(self, slots: Sequence[int], contents: Sequence[Key]) -> None:
        values = patterns(list(contents), LAYERS, self.token_shape, DTYPE)
        write_device_kv(self.kv, self._to_engine(slots), values)
        for i, content in enumerate(contents):
            self.contents[_fingerprint(values[:, i])] = content

    def insert(self, key: Key, slots: Sequence[int], *, priority: int, chunked: bool,
               counted_from: int = 0) -> int:
        # DEV-24: the scheduler passes the device prefix its match found, which the
        # request still uses; the tree frees the caller's duplicates past it. Read off
        # the node scan, not a match, which would touch recency.
        read = self._pages(self._scan())
        cached = [s for k in page_keys(key, self.ps) if k in read and read[k][0] is not None
                  for s in self._from_engine(torch.tensor(read[k][0]))]
        prev = 0
        while prev < min(len(cached), len(slots)) and slots[prev] == cached[prev]:
            prev += 1
        aligned = len(key.tokens) - len(key.tokens) % self.ps
        free_before = self._free_device()
        inserted = aligned if chunked_only(key, self.ps, chunked, counted_from,
                                           self.name) else 0  # DEV-25

        def params() -> Any:
            return self.env.modules["base"].InsertParams(
                key=self._key(key), value=self._to_engine(slots), priority=priority,
                prev_prefix_len=prev, inserted_len=inserted)
        result = self.cache.insert(params())
        if self.reference is not None:
            self.reference.agree(f"insert({key}) prefix", int(result.prefix_len),
                                 self.reference.insert(params()))
        self.freed_by_tree = set(slots) & (self._free_device() - free_before)
        self._seen(int(result.last_device_node))
        return int(result.prefix_len)

    def evict(self, num_tokens: int) -> int:
        result = self.cache.evict(self.env.modules["base"].EvictParams(num_tokens=num_tokens))
        if self.reference is not None:
            self.reference.agree(f"evict({num_tokens})", int(result.num_tokens_evicted),
                                 self.reference.evict(num_tokens))
        return int(result.num_tokens_evicted)

    def evict_host(self, num_tokens: int) -> int:
        raise NotImplementedError(f"{self.name} has no evict_host (device tier only)")

    def writing_check(self) -> int:
        raise NotImplementedError(f"{self.name} has no writing_check (device tier only)")

    def loading_check(self) -> int:
        raise NotImplementedError(f"{self.name} has no loading_check (device tier only)")

    def init_load_back(self, page: Key | None,
                       quota: int | None) -> tuple[tuple[int, ...], Key | None]:
        raise NotImplementedError(f"{self.name} has no load_back (device tier only)")

    def reset(self) -> None:
        self.cache.reset()
        self.allocator.clear()
        if self.reference is not None:
            self.reference.reset()
        self.receipts.clear()
        self.freed_by_tree.clear()
        self.high_handle = max(self.high_handle, int(self.core.root_node_handle(None)))

    # -- the abstraction ------------------------------------------------------------------

    def _free_device(self) -> frozenset[int]:
        if self.ps == 1:
            slots = self.allocator.free_pages.tolist() + self.allocator.release_pages.tolist()
        else:
            pages = self.allocator.get_all_free_pages().tolist()
            slots = [p * self.ps + i for p in pages for i in range(self.ps)]
        return frozenset(s - self.ps for s in slots)

    def _pages(self, nodes: dict[int, _Node]) -> dict[Key, tuple[tuple[int, ...] | None,
                                                                 tuple[int, ...] | None, int]]:
        """Each page's device slots (SGLang's), host slots and lock count."""
        found = {}
        for node in nodes.values():
            for value in (node.device, node.host):
                assert value is None or len(value) == node.end - node.start, node
            for index, key in enumerate(self._node_keys(node)):
                cut = slice(index * self.ps, (index + 1) * self.ps)
                found[key] = (None if node.device is None else node.device[cut],
                              None if node.host is None else node.host[cut], node.lock)
        return found

    def observe(self, model: State) -> State:
        nodes = self._scan()
        read = self._pages(nodes)
        stamps = self._stamps(read)
        pages: dict[Key, Page] = {}
        for key, (slots, _, lock) in read.items():
            assert slots is not None, f"{key}: a device-tier page off the device"
            known = stamps.get(key) or model.pages.get(key) or Page(None, None)
            pages[key] = Page(device=self._from_engine(torch.tensor(slots)), host=None,
                              lock=lock, host_protect=0,  # no host tier: nothing to protect
                              hits=known.hits,
                              last_tick=known.last_tick, insert_tick=known.insert_tick,
                              priority=known.priority)
        device_free = self._free_device()
        owned = {s for p in pages.values() for s in p.device or ()}
        self._audit(nodes, owned, device_free)
        held = frozenset(set(range(self.config.device_slots)) - device_free - owned)
        visible = sorted(owned | held)
        device_kv = decode_kv(self._read_device([s + self.ps for s in visible]),
                              dict(model.device_kv), visible, LAYERS, self.token_shape,
                              DTYPE)
        return State(config=model.config, pages=pages, device_free=device_free,
                     host_free=frozenset(), held=held, device_kv=device_kv, host_kv={},
                     pending=(), clock=model.clock,
                     evictable_tokens=int(self.cache.evictable_size()),
                     protected_tokens=int(self.cache.protected_size()))

    def _stamps(self, read: Mapping[Key, tuple[tuple[int, ...] | None,
                                               tuple[int, ...] | None, int]]
                ) -> Mapping[Key, Stamps]:
        """The hidden fields per page, off the reference core, once it is shown to hold
        the same pages at the same slots with the same locks and totals; none without a
        reference."""
        if self.reference is None:
            return {}
        ref = self.reference.pages()
        self.reference.agree("pages (device slots, host slots, lock)", dict(read),
                             {k: (d, h, lock) for k, (d, h, lock, _) in ref.items()})
        self.reference.agree("evictable, protected, free", self._totals(),
                             self.reference.totals())
        return {k: s for k, (_, _, _, s) in ref.items()}

    def _totals(self) -> tuple[int, ...]:
        """What ``PythonReference.totals`` gives: evictable and protected tokens, free
        device slots."""
        return (int(self.cache.evictable_size()), int(self.cache.protected_size()),
                int(self.allocator.available_size()))

    def _audit(self, nodes: dict[int, _Node], owned: set[int],
               device_free: frozenset[int]) -> None:
        """The engine's own counters agree with the node-by-node reading."""
        evictable = sum(len(n.device or ()) for n in nodes.values() if n.lock == 0)
        protected = sum(len(n.device or ()) for n in nodes.values() if n.lock > 0)
        assert evictable == self.cache.evictable_size(), (evictable, self.cache.evictable_size())
        assert protected == self.cache.protected_size(), (protected, self.cache.protected_size())
        flat = set(self._from_engine(self.core.all_values_flatten()))
        assert flat == owned, f"all_values_flatten {sorted(flat)} != nodes {sorted(owned)}"
        assert len(device_free) == self.allocator.available_size()
        both = sorted(owned & device_free)
        assert not both, f"slots {both} are in the tree and on the free list"

    def close(self) -> None:
        self.receipts.clear()
        if self.reference is not None:
            self.reference.close()


def factory(engine: str, scenario: Scenario) -> Callable[[], EngineAdapter]:
    scenario = Scenario(**{**scenario.__dict__, "write_policy": "write_through"})
    return lambda: SglangRustAdapter(scenario)


def scenario_space(engine: str) -> dict[str, tuple[object, ...]]:
    """The scenario values the Rust-core adapter takes (the suite's CLI uses it)."""
    return {"host_layout": ("layer_first",), "kv_layout": KV_LAYOUTS,
            "write_policy": ("write_through",),
            "eviction": ("lru", "lfu", "fifo", "mru", "filo", "priority")}
