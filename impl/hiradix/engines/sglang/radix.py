"""Adapters for SGLang 0.5.20: ``RadixCache`` (device only) and ``HiRadixCache``.

SGLang must be importable (``make sglang-env`` builds ``.venv-sglang``). Running its
caches on a CPU-only machine takes, besides pools built by hand, four explicit steps
(``_prepare``), none of which changes a cache decision, and a fifth per cache that fixes
which of several tied leaves is evicted, a choice SGLang leaves to object addresses:

1. ``time`` in ``radix_cache`` / ``hiradix_cache`` reads the suite's logical clock
   (``monotonic`` only; ``perf_counter`` stays real), so recency is deterministic (DEV-2).
2. ``MHATokenToKVPoolHost`` defaults to ``pin_memory=False``: pinning needs CUDA.
3. The ``direct`` I/O backend's ``transfer_kv_direct`` -- imported from ``sgl_kernel`` on
   CUDA only -- is given as a plain ``index_copy_`` per layer buffer.
4. One process group (gloo, world size 1) and published ``ServerArgs``: HiRadixCache
   all-reduces its acknowledgement counts and reads its settings from the runtime context.
5. Each cache's sets of evictable leaves become insertion-ordered (``InsertionOrdered``):
   SGLang heapifies them, so among tied leaves the victim would follow object addresses
   and two runs of one example would evict differently (DEV-20).

On CPU torch, SGLang's streams and events are no-ops: a copy is finished by the next
check, so copies in flight are observed only between an operation and its check.

Pools: MHA (``MHATokenToKVPool`` + ``MHATokenToKVPoolHost``) or MLA
(``MLATokenToKVPool`` + ``MLATokenToKVPoolHost``: one latent buffer per layer), as the
scenario's ``kv_layout`` says. Host layouts: ``layer_first``, and the scenario's
``page_first`` as SGLang's ``page_first_direct`` -- SGLang's own server turns
``page_first`` with the ``direct`` I/O backend into ``page_first_direct``
(``resolve_layout_io_compatibility``); ``page_first`` proper needs the CUDA kernels. The
``direct`` backend's two page-first copies (``sgl_kernel``, CUDA only) are given as plain
indexing of the ``[page, layer, offset, ...]`` host buffer, so on CPU the layout's
buffer shape, allocation and index handling are SGLang's, the element copies ours.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from hiradix.conformance.abstraction import decode_kv
from hiradix.conformance.kv import patterns
from hiradix.conformance.scenario import Scenario
from hiradix.engines.determinism import InsertionOrdered, LogicalTime
from hiradix.engines.protocol import EngineAdapter, EngineUnavailable, probe_engine
from hiradix_model import Config, Key, Page, State, Transfer, ops

LAYERS, HEADS, HEAD_DIM = 2, 2, 2
DTYPE = torch.float16
TOKEN_SHAPE = (2, HEADS, HEAD_DIM)  # MHA: K and V
KV_LORA_RANK, QK_ROPE_DIM = 2, 1
MLA_TOKEN_SHAPE = (1, KV_LORA_RANK + QK_ROPE_DIM)  # MLA: one latent vector
# The scenario's host layout -> SGLang's, with the ``direct`` I/O backend (module docstring).
HOST_LAYOUTS = {"layer_first": "layer_first", "page_first": "page_first_direct"}
KV_LAYOUTS = ("mha", "mla")
RADIX_OPS = frozenset({"match_prefix", "insert", "inc_lock_ref", "dec_lock_ref", "alloc",
                       "free", "evict", "reset"})
# Under write_back (spec/07 DEV-32): an eviction backs a node up as one copy, making
# host room for the whole node (DEV-8 here: evict_host(len(node.value))) before any of its
# pages leaves the device. The key is for the differential suite to take the host pages an
# eviction took as an evict_host step before it; the suite does not read it yet, so
# write_back campaigns are not run (spec/07 7.1).
WRITE_BACK_MAPPED: Mapping[str, str] = {
    "write_back_host_room_per_node": "DEV-32 (DEV-8 in HiRadixCache): a write-back eviction "
                                     "makes host room for a whole node before copying it; "
                                     "the model takes it as an evict_host step first",
}


# write_backup is left out on purpose: SGLang's refuses a node whose parent has no host
# copy, the spec's backs up the missing suffix (DEV-7); they are different operations.
HI_OPS = RADIX_OPS | {"evict_host", "writing_check", "load_back", "loading_check"}


# An insert passing one of the cache's own slots after a caller slot: `hiradix explore`
# offers it, no scheduler makes it, every SGLang cache would free the cache's slot too.
CACHE_SLOT_AFTER_CALLER_SLOT: dict[str, str] = {
    "insert_cache_slot_after_caller_slot": "no scheduler passes one of the cache's own slots "
                                           "after a slot of its own (DEV-24); SGLang frees "
                                           "every slot past prev_prefix_len, the cache's "
                                           "included",
}


@dataclass(frozen=True)
class _Run:
    """The SGLang backups one insert issued: one spec run (DEV-7)."""

    seq: int  # issue order among all copies
    ids: tuple[int, ...]  # SGLang's ack ids (node ids)
    pages: tuple[Key, ...]  # root-most first
    lock_pages: tuple[Key, ...]  # the deepest page of each node SGLang locked


def _on_path(page: Key, deeper: Key) -> bool:
    """Whether ``page`` lies on the root path of ``deeper``."""
    return page.namespace == deeper.namespace and deeper.tokens[:len(page.tokens)] == page.tokens


@dataclass
class _Sglang:
    """The imported SGLang modules and the process-wide state they need."""

    clock: LogicalTime
    modules: dict[str, Any] = field(default_factory=dict)
    group: Any = None


_ENV: _Sglang | None = None


def _transfer_kv_direct(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                        src_indices: torch.Tensor, dst_indices: torch.Tensor,
                        page_size: int) -> None:
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst.index_copy_(0, dst_indices.to(torch.int64), src.index_select(0, src_indices))


def _page_first(index: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A host token index as (page, offset) of a ``page_first_direct`` buffer."""
    index = index.to(torch.int64)
    return index // page_size, index % page_size


def _transfer_pf_to_lf(src_ptrs: Sequence[torch.Tensor], dst_ptrs: Sequence[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor, layer_id: int,
                       page_size: int) -> None:
    """``transfer_kv_per_layer_direct_pf_lf`` on CPU: one layer of a load, from host
    buffers ``[page, layer, offset, ...]`` into the device layer buffers."""
    page, offset = _page_first(src_indices, page_size)
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        dst.index_copy_(0, dst_indices.to(torch.int64), src[page, layer_id, offset])


def _transfer_lf_to_pf(src_ptrs: Sequence[torch.Tensor], dst_ptrs: Sequence[torch.Tensor],
                       src_indices: torch.Tensor, dst_indices: torch.Tensor,
                       page_size: int) -> None:
    """``transfer_kv_all_layer_direct_lf_pf`` on CPU: a backup of every layer; the
    source is each destination's device layers in turn (K layers, then V layers)."""
    layers = len(src_ptrs) // len(dst_ptrs)
    page, offset = _page_first(dst_indices, page_size)
    source = src_indices.to(torch.int64)
    for i, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            dst[page, layer, offset] = src_ptrs[i * layers + layer].index_select(0, source)


def token_shape(kv_layout: str) -> tuple[int, ...]:
    """One token's KV in one layer, as the suite's test patterns shape it."""
    return MLA_TOKEN_SHAPE if kv_layout == "mla" else TOKEN_SHAPE


def check_layouts(scenario: Scenario, engine: str) -> None:
    """The pools this module builds: MHA or MLA; ``layer_first`` or ``page_first``."""
    if scenario.kv_layout not in KV_LAYOUTS or scenario.host_layout not in HOST_LAYOUTS:
        raise ValueError(f"scenario: {engine} takes kv_layout in {KV_LAYOUTS} and "
                         f"host_layout in {tuple(HOST_LAYOUTS)}")


def write_device_kv(kv: Any, index: torch.Tensor, values: torch.Tensor) -> None:
    """Store ``values`` (``[layers, n, *token_shape]``) at device slots ``index``."""
    for layer in range(LAYERS):
        if hasattr(kv, "kv_buffer"):  # MLA: one latent buffer per layer
            kv.kv_buffer[layer][index] = values[layer]
        else:
            kv.k_buffer[layer][index] = values[layer, :, 0]
            kv.v_buffer[layer][index] = values[layer, :, 1]


def read_device_kv(kv: Any, index: torch.Tensor) -> torch.Tensor:
    """The KV at device slots ``index``: ``[layers, n, *token_shape]``."""
    if hasattr(kv, "kv_buffer"):
        return torch.stack([kv.kv_buffer[layer][index] for layer in range(LAYERS)])
    return torch.stack([torch.stack([kv.k_buffer[layer][index], kv.v_buffer[layer][index]],
                                    dim=1) for layer in range(LAYERS)])


def read_host_kv(host: Any, slots: Sequence[int], kv_layout: str) -> torch.Tensor:
    """The KV at host slots ``slots`` (``[layers, n, *token_shape]``), read through the
    host pool's layout: ``[layer, token, ...]`` or ``[page, layer, offset, ...]``."""
    index = torch.tensor(list(slots), dtype=torch.int64)
    buffers = [host.kv_buffer] if kv_layout == "mla" else [host.k_buffer, host.v_buffer]
    if host.layout == "layer_first":
        parts = [[buffer[layer][index] for buffer in buffers] for layer in range(LAYERS)]
    elif host.layout == "page_first_direct":
        page, offset = _page_first(index, host.page_size)
        parts = [[buffer[page, layer, offset] for buffer in buffers] for layer in range(LAYERS)]
    else:
        raise ValueError(f"host layout {host.layout!r} is not adapted")
    if kv_layout == "mla":
        return torch.stack([layer[0] for layer in parts])
    return torch.stack([torch.stack(layer, dim=1) for layer in parts])


def chunked_only(key: Key, page_size: int, chunked: bool, counted_from: int,
                 engine: str) -> bool:
    """``chunked`` for an engine whose insert takes only that (DEV-25):
    ``counted_from`` = the page-aligned length is ``chunked``, 0 is not; anything between
    has no counterpart, and is refused rather than approximated."""
    aligned = len(key.tokens) - len(key.tokens) % page_size
    if 0 < counted_from < aligned:
        raise ValueError(f"{engine}: counted_from={counted_from} inside a key of {aligned} "
                         "tokens has no counterpart in this engine's insert (DEV-25)")
    return chunked or 0 < counted_from == aligned


def device_pools(modules: Mapping[str, Any], page_size: int, device_pages: int,
                 kv_layout: str = "mha") -> tuple[Any, Any]:
    """SGLang's device KV pool (MHA or MLA) and its allocator (token or paged), built by
    hand on the CPU as every SGLang adapter needs them: ``(kv, allocator)``."""
    device_slots = device_pages * page_size
    if kv_layout == "mla":
        kv = modules["pool"].MLATokenToKVPool(device_slots, page_size, DTYPE, KV_LORA_RANK,
                                              QK_ROPE_DIM, LAYERS, device="cpu",
                                              enable_memory_saver=False)
    else:
        kv = modules["pool"].MHATokenToKVPool(device_slots, page_size, DTYPE, HEADS, HEAD_DIM,
                                              LAYERS, device="cpu", enable_memory_saver=False)
    if page_size == 1:
        allocator = modules["token"].TokenToKVPoolAllocator(device_slots, DTYPE, "cpu", kv,
                                                            False)
    else:
        allocator = modules["paged"].PagedTokenToKVPoolAllocator(device_slots, page_size,
                                                                 DTYPE, "cpu", kv, False)
    return kv, allocator


def patch_for_cpu(host_module: Any) -> Any:
    """Steps 2 to 4 of the module docstring, shared by every SGLang adapter: host pools
    (MHA, and MLA from ``pool_host.mla``) unpinned, the direct transfers as plain
    indexing, one gloo rank. The process group the caches all-reduce over."""
    import importlib
    mla_module = importlib.import_module("sglang.srt.mem_cache.pool_host.mla")
    for module, host_cls in [(host_module, host_module.MHATokenToKVPoolHost),
                             (mla_module, mla_module.MLATokenToKVPoolHost)]:
        if host_cls.__init__.__code__.co_varnames[6] != "pin_memory":
            raise AttributeError(f"{host_cls.__name__}'s first default is not pin_memory")
        defaults = list(host_cls.__init__.__defaults__)
        defaults[0] = False  # pin_memory: pinning needs CUDA
        host_cls.__init__.__defaults__ = tuple(defaults)
        module.transfer_kv_direct = _transfer_kv_direct
        module.transfer_kv_per_layer_direct_pf_lf = _transfer_pf_to_lf
        module.transfer_kv_all_layer_direct_lf_pf = _transfer_lf_to_pf
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                             rank=0, world_size=1)
    return torch.distributed.new_group([0], backend="gloo")


def _prepare() -> _Sglang:
    global _ENV
    if _ENV is not None:
        return _ENV
    import importlib

    names = {
        "radix": "sglang.srt.mem_cache.radix_cache",
        "hi": "sglang.srt.mem_cache.hiradix_cache",
        "base": "sglang.srt.mem_cache.base_prefix_cache",
        "params": "sglang.srt.mem_cache.cache_init_params",
        "pool": "sglang.srt.mem_cache.memory_pool",
        "token": "sglang.srt.mem_cache.allocator.token",
        "paged": "sglang.srt.mem_cache.allocator.paged",
        "host": "sglang.srt.mem_cache.pool_host.mha",
        "args": "sglang.srt.server_args",
        "context": "sglang.srt.runtime_context",
    }
    env = _Sglang(LogicalTime(), {k: importlib.import_module(v) for k, v in names.items()})
    env.modules["radix"].time = env.clock
    env.modules["hi"].time = env.clock
    env.group = patch_for_cpu(env.modules["host"])
    _ENV = env
    return env


SETUP = "make sglang-env, then run .venv-sglang/bin/hiradix"
VERSIONS = ("0.5.20",)  # HiRadixCache is gone from 0.5.22 on


@contextmanager
def as_shipped() -> Iterator[None]:
    """SGLang's caches as its server runs them while the block runs (``hiradix bench``,
    issue 29): ``time`` in ``radix_cache`` / ``hiradix_cache`` is the real module again.
    Step 1 is there for deterministic recency, which a timing run does not need; steps
    2-4 stay (without them nothing runs on a CPU; none makes a cache decision); step 5 is
    per cache, left out by ``SglangAdapter(..., observed=False)``."""
    env = _prepare()
    modules = (env.modules["radix"], env.modules["hi"])
    for module in modules:
        module.time = time
    try:
        yield
    finally:
        for module in modules:
            module.time = env.clock


def probe(engine: str) -> str:
    """The installed SGLang version, if this adapter can drive it (spec/07 7.1)."""
    return probe_engine(engine, "sglang", VERSIONS, "HiRadixCache", SETUP, _prepare)


def available() -> bool:
    """Whether SGLang 0.5.20 can be driven here."""
    try:
        probe("sglang")
    except EngineUnavailable:
        return False
    return True


class SglangAdapter:
    """One SGLang cache (``RadixCache`` if ``hierarchical`` is False) for one scenario.
    ``observed=False``: its evictable-leaf sets stay SGLang's own (step 5 is for
    comparing runs with the model; a benchmark drives the cache as shipped)."""

    def __init__(self, scenario: Scenario, hierarchical: bool, *,
                 observed: bool = True) -> None:
        check_layouts(scenario, "sglang")
        self.env = _prepare()
        self.env.clock.now = 0  # not the previous cache's last tick
        m = self.env.modules
        self.hierarchical = hierarchical
        self.name = "sglang" if hierarchical else "sglang-radix"
        self.version = probe(self.name)
        ps = self.ps = scenario.page_size
        device_slots = scenario.device_pages * ps
        self.kv_layout = scenario.kv_layout
        self.token_shape = token_shape(scenario.kv_layout)
        self.kv, self.allocator = device_pools(m, ps, scenario.device_pages,
                                               scenario.kv_layout)
        params = m["params"].CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.allocator,
            page_size=ps, eviction_policy=scenario.eviction, tp_cache_group=self.env.group)
        if hierarchical:
            args = m["args"].ServerArgs(
                model_path="dummy", device="cpu", page_size=ps,
                enable_hierarchical_cache=True,
                hicache_ratio=scenario.host_pages / scenario.device_pages, hicache_size=0,
                hicache_mem_layout=HOST_LAYOUTS[scenario.host_layout],
                hicache_write_policy=scenario.write_policy,
                hicache_io_backend="direct", hicache_storage_backend=None)
            m["context"].publish(args, role="test")
            self.cache = m["hi"].HiRadixCache(params, args)
            # A configuration attribute SGLang fixes at 10 tokens (spec/01).
            self.cache.load_back_threshold = scenario.threshold_pages * ps
            host_slots = self.cache.token_to_kv_pool_host.logical_size
            self.operations = HI_OPS
        else:
            self.cache = m["radix"].RadixCache(params)
            host_slots = 0
            self.operations = RADIX_OPS
        if observed:
            self.cache.evictable_leaves = InsertionOrdered(self.cache.evictable_leaves)
        if observed and hierarchical:
            self.cache.evictable_host_leaves = InsertionOrdered(
                self.cache.evictable_host_leaves)
        self.config = Config(page_size=ps, device_slots=device_slots, host_slots=host_slots,
                             write_policy=scenario.write_policy if hierarchical
                             else "write_through",
                             eviction=scenario.eviction,
                             load_back_threshold=scenario.threshold_pages * ps)
        self.adopted: Mapping[str, str] = {
            "last_tick": "DEV-1 (ticks stamped before the match), DEV-4 (fresh ticks on split)",
            "insert_tick": "DEV-4 (a split's upper half is created anew)",
        }
        if hierarchical and scenario.write_policy == "write_back":
            self.adopted = {**self.adopted,
                            "hits": "DEV-3 (no hits are counted under write_back)"}
        self.mapped: Mapping[str, str] = {
            "slot ids": f"SGLang reserves device page 0 for padding: spec slot = SGLang slot "
                        f"- {ps}",
            "lock": "DEV-7: one lock per backed-up node is folded into one lock per run",
            "host_protect": "DEV-5: a load's sources count as protected until acknowledged",
            "evict_for_whole_load": "DEV-8: load_back evicts len(host_indices) with the "
                                    "anchor locked; the model takes those steps explicitly",
            "start loads": "init_load_back is followed by ready_to_load_host_cache(), which "
                           "starts the queued copy, as the scheduler does before a batch",
            "evict_host_for_whole_node": "DEV-8: write_backup evicts len(node.value) on host; "
                                         "the model takes it as an evict_host step",
            "last_host_page": "RadixCache has no host tier: its last_host_node is not a host "
                              "page" if not hierarchical else "as SGLang reports it",
        }
        if hierarchical and scenario.write_policy == "write_back":
            self.mapped = {**self.mapped, **WRITE_BACK_MAPPED}
        # What SGLang's scheduler never does (spec/07 Reach lines); campaigns respect it
        # unless --beyond-server. DEV-19's own reproducer test drives it.
        self.guards: Mapping[str, str] = {
            "reset_with_copies_in_flight": "DEV-19 (reset_when_idle): flush_cache resets "
                                           "only when is_fully_idle(), scheduler.py:4983, "
                                           "which needs no copy in flight, :4858-4859",
        } if hierarchical else {}
        self.avoid: Mapping[str, str] = {}
        self.inexpressible: Mapping[str, str] = {
            "counted_from_inside": "DEV-25: insert takes only chunked (all pages or none)",
            **CACHE_SLOT_AFTER_CALLER_SLOT,
        }
        # Backups issued by one insert form one spec run (DEV-7); loads remember their pages.
        self.runs: list[_Run] = []
        self.loads: dict[int, tuple[int, tuple[Key, ...]]] = {}  # ack -> (seq, pages)
        self.issued = 0

    # -- plumbing ---------------------------------------------------------------------

    def _key(self, key: Key) -> Any:
        return self.env.modules["radix"].RadixKey(token_ids=array("q", key.tokens),
                                                  extra_key=key.namespace)

    def _to_engine(self, slots: Sequence[int]) -> torch.Tensor:
        return torch.tensor([s + self.ps for s in slots], dtype=torch.int64)

    def _from_engine(self, slots: torch.Tensor) -> tuple[int, ...]:
        return tuple(s - self.ps for s in slots.tolist())

    def _prefix(self, node: Any) -> Key:
        parts = []
        cursor = node
        # Up to a root: this tree's, or that of a tree reset() discarded (DEV-19).
        while cursor is not self.cache.root_node and cursor.parent is not None:
            parts.append(tuple(cursor.key.token_ids))
            cursor = cursor.parent
        tokens = tuple(t for part in reversed(parts) for t in part)
        return Key(tokens, node.key.extra_key)

    def _page_of(self, node: Any) -> Key | None:
        return None if node is self.cache.root_node else self._prefix(node)

    def _node(self, page: Key | None) -> Any:
        """The node that ends at ``page`` (a match has put a boundary there)."""
        node = self.cache.root_node
        if page is None:
            return node
        done = 0
        while done < len(page.tokens):
            child = node.children.get(self._child_key(page, done))
            if child is None:
                raise KeyError(f"{self.name}: no node on the path of {page}")
            node, done = child, done + len(child.key)
        if done != len(page.tokens):
            raise KeyError(f"{self.name}: no node ends at {page}")
        return node

    def _child_key(self, page: Key, start: int) -> Any:
        return self._key(Key(page.tokens[start:], page.namespace)).child_key(self.ps)

    def _nodes(self) -> list[Any]:
        found, stack = [], list(self.cache.root_node.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found

    # -- the operations -----------------------------------------------------------------

    def set_time(self, now: int) -> None:
        self.env.clock.now = now

    def match_prefix(self, key: Key) -> ops.MatchResult:
        got = self.cache.match_prefix(self.env.modules["base"].MatchPrefixParams(
            key=self._key(key)))
        last_host = self._page_of(got.last_host_node) if self.hierarchical else None
        return ops.MatchResult(self._from_engine(got.device_indices),
                               self._page_of(got.last_device_node), last_host,
                               got.host_hit_length if self.hierarchical else 0)

    def inc_lock_ref(self, page: Key | None) -> int:
        return int(self.cache.inc_lock_ref(self._node(page)).delta)

    def dec_lock_ref(self, page: Key | None) -> int:
        return int(self.cache.dec_lock_ref(self._node(page)).delta)

    def num_free_slots(self) -> int:
        return int(self.allocator.available_size())

    def alloc(self, num_tokens: int) -> tuple[int, ...] | None:
        slots = self.allocator.alloc(num_tokens)
        return None if slots is None else self._from_engine(slots)

    def free(self, slots: Sequence[int]) -> None:
        self.allocator.free(self._to_engine(slots))

    def write_kv(self, slots: Sequence[int], contents: Sequence[Key]) -> None:
        values = patterns(list(contents), LAYERS, self.token_shape, DTYPE)
        write_device_kv(self.kv, self._to_engine(slots), values)

    def insert(self, key: Key, slots: Sequence[int], *, priority: int, chunked: bool,
               counted_from: int = 0) -> int:
        # By entry, not id: reset() restarts node ids but keeps stale entries (DEV-19).
        pending = dict(self.cache.ongoing_write_through) if self.hierarchical else {}
        result = self.cache.insert(self.env.modules["base"].InsertParams(
            key=self._key(key), value=self._to_engine(slots), priority=priority,
            chunked=chunked_only(key, self.ps, chunked, counted_from, self.name)))
        if self.hierarchical:
            issued = [i for i, entry in self.cache.ongoing_write_through.items()
                      if pending.get(i) is not entry]
            if issued:
                self._record_run(issued,
                                 [self.cache.ongoing_write_through[i][0] for i in issued])
        return int(result.prefix_len)

    def _record_run(self, ids: list[int], nodes: list[Any]) -> None:
        """The backups one insert issued (SGLang ack ``ids``, their ``nodes``) as one spec
        run, root-most node first (DEV-7)."""
        nodes = sorted(nodes, key=lambda n: len(self._prefix(n).tokens))
        self.issued += 1
        self.runs.append(_Run(self.issued, tuple(ids),
                              tuple(k for n in nodes for k in self._page_keys(n)),
                              tuple(self._prefix(n) for n in nodes)))

    def evict(self, num_tokens: int) -> int:
        result = self.cache.evict(self.env.modules["base"].EvictParams(num_tokens=num_tokens))
        return int(result.num_tokens_evicted)

    def evict_host(self, num_tokens: int) -> int:
        # SGLang's evict_host returns nothing: the count is read off the host pool.
        before = self.cache.token_to_kv_pool_host.available_size()
        self.cache.evict_host(num_tokens)
        return int(self.cache.token_to_kv_pool_host.available_size() - before)

    def _pending_writes(self) -> list[int]:
        return list(self.cache.ongoing_write_through)

    def writing_check(self) -> int:
        self.cache.writing_check()
        still = set(self._pending_writes())
        acked = 0
        while self.runs and not still & set(self.runs[0].ids):
            self.runs.pop(0)
            acked += 1
        return acked

    def loading_check(self) -> int:
        before = set(self.cache.ongoing_load_back)
        self.cache.loading_check()
        done = before - set(self.cache.ongoing_load_back)
        for ack in done:
            self.loads.pop(ack, None)
        return len(done)

    def init_load_back(self, page: Key | None,
                       quota: int | None) -> tuple[tuple[int, ...], Key | None]:
        node = self._node(page)
        chain = []
        cursor = node
        while cursor is not self.cache.root_node and cursor.evicted:
            chain.insert(0, cursor)
            cursor = cursor.parent
        m = self.env.modules["base"]
        host_hit = sum(len(n.host_value) for n in chain)
        loaded, last = self.cache.init_load_back(m.InitLoadBackParams(
            best_match_node=node, host_hit_length=host_hit, mem_quota=quota))
        if len(loaded):
            # SGLang queues a load and starts it when the scheduler says the batch is
            # ready; the spec's load_back issues the copy: both halves, as a scheduler does.
            self.cache.ready_to_load_host_cache()
            self.issued += 1
            self.loads[node.id] = (self.issued,
                                   tuple(k for n in chain for k in self._page_keys(n)))
        return self._from_engine(loaded), self._page_of(last)

    def reset(self) -> None:
        self.cache.reset()
        self.allocator.clear()
        if self.hierarchical:
            self.cache.token_to_kv_pool_host.clear()
        self.runs.clear()
        self.loads.clear()

    # -- the abstraction ------------------------------------------------------------------

    def _page_keys(self, node: Any) -> list[Key]:
        prefix = self._prefix(node)
        start = len(prefix.tokens) - len(node.key)
        return [Key(prefix.tokens[:end], prefix.namespace)
                for end in range(start + self.ps, len(prefix.tokens) + 1, self.ps)]

    def _in_flight(self, pages: dict[Key, Page]) -> tuple[Transfer, ...]:
        """The copies in flight in spec terms, issue order. Pages, not nodes: a split
        while a copy is in flight changes SGLang's nodes, not the copy's pages."""
        copies: list[tuple[int, Transfer]] = []
        for run in self.runs:
            if set(run.ids) & set(self.cache.ongoing_write_through):
                copies.append((run.seq, Transfer(
                    "d2h", run.pages, tuple(s for k in run.pages for s in pages[k].device or ()),
                    tuple(s for k in run.pages for s in pages[k].host or ()), run.pages[-1])))
        for ack, (seq, chain) in self.loads.items():
            if ack in self.cache.ongoing_load_back:
                copies.append((seq, Transfer(
                    "h2d", chain, tuple(s for k in chain for s in pages[k].host or ()),
                    tuple(s for k in chain for s in pages[k].device or ()), chain[-1])))
        # Entries no copy of ours explains (left behind by reset, DEV-19) are copies SGLang
        # still waits for: shown as such, so that the comparison reports them.
        known = {i for run in self.runs for i in run.ids}
        for ack, entry in self.cache.ongoing_write_through.items():
            if ack not in known:
                copies.append((-1, self._stale("d2h", entry[2])))
        for ack, node in self.cache.ongoing_load_back.items():
            if ack not in self.loads:
                copies.append((-1, self._stale("h2d", [node])))
        return tuple(t for _, t in sorted(copies, key=lambda c: c[0]))

    def _stale(self, direction: str, nodes: list[Any]) -> Transfer:
        pages = tuple(k for n in nodes for k in self._page_keys(n))
        device = tuple(s for n in nodes if n.value is not None for s in self._from_engine(n.value))
        host = tuple(s for n in nodes if n.host_value is not None for s in n.host_value.tolist())
        src, dst = (device, host) if direction == "d2h" else (host, device)
        return Transfer(direction, pages, src, dst, pages[-1])  # type: ignore[arg-type]

    def _corrected(self, key: Key, page: Page) -> Page:
        """DEV-7: SGLang locks the root path of every node of a run, the spec that of the
        run's deepest page once. DEV-5: a load's sources stay protected until acknowledged."""
        lock, protect = page.lock, page.host_protect
        for run in self.runs:
            if set(run.ids) & set(self.cache.ongoing_write_through):
                below = sum(_on_path(key, q) for q in run.lock_pages)
                lock -= max(0, below - 1)
        for ack, (_, chain) in self.loads.items():
            if ack in self.cache.ongoing_load_back and key in chain:
                protect += 1
        return Page(page.device, page.host, lock, protect, page.hits, page.last_tick,
                    page.insert_tick, page.priority)

    def _free_device(self) -> frozenset[int]:
        pages = self.allocator.free_pages.tolist()
        if self.ps == 1:
            slots = pages + self.allocator.release_pages.tolist()
        else:
            slots = [p * self.ps + i for p in pages for i in range(self.ps)]
        return frozenset(s - self.ps for s in slots)

    def _read_device(self, slots: list[int]) -> torch.Tensor:
        return read_device_kv(self.kv, self._to_engine(slots))

    def _read_host(self, slots: list[int]) -> torch.Tensor:
        return read_host_kv(self.cache.token_to_kv_pool_host, slots, self.kv_layout)

    def observe(self, model: State) -> State:
        pages: dict[Key, Page] = {}
        for node in self._nodes():
            device = None if node.value is None else self._from_engine(node.value)
            host = None if node.host_value is None else tuple(node.host_value.tolist())
            for index, key in enumerate(self._page_keys(node)):
                cut = slice(index * self.ps, (index + 1) * self.ps)
                pages[key] = Page(
                    device=None if device is None else device[cut],
                    host=None if host is None else host[cut],
                    lock=node.lock_ref, host_protect=node.host_ref_counter,
                    hits=node.hit_count, last_tick=int(node.last_access_time),
                    insert_tick=int(node.creation_time), priority=node.priority)
        if self.hierarchical:
            pages = {k: self._corrected(k, p) for k, p in pages.items()}
        pending = self._in_flight(pages) if self.hierarchical else ()
        arriving = {d: {s for t in pending if t.direction == d for s in t.dst}
                    for d in ("d2h", "h2d")}
        device_free = self._free_device()
        owned = {s for p in pages.values() for s in p.device or ()}
        held = frozenset(set(range(self.config.device_slots)) - device_free - owned)
        visible_device = sorted((owned | held) - arriving["h2d"])
        device_kv = decode_kv(self._read_device(visible_device), dict(model.device_kv),
                              visible_device, LAYERS, self.token_shape, DTYPE)
        if self.hierarchical:
            host_pool = self.cache.token_to_kv_pool_host
            host_pool._merge_release_slots()
            host_free = frozenset(host_pool.free_slots.tolist())
            visible_host = sorted({s for p in pages.values() for s in p.host or ()}
                                  - arriving["d2h"])
            host_kv = decode_kv(self._read_host(visible_host), dict(model.host_kv),
                                visible_host, LAYERS, self.token_shape, DTYPE)
        else:
            host_free, host_kv = frozenset(), {}
        return State(config=model.config, pages=pages, device_free=device_free,
                     host_free=host_free, held=held, device_kv=device_kv, host_kv=host_kv,
                     pending=pending, clock=model.clock,
                     evictable_tokens=int(self.cache.evictable_size_),
                     protected_tokens=int(self.cache.protected_size_))

    def close(self) -> None:
        if self.hierarchical:
            self.cache.shutdown()


def factory(engine: str, scenario: Scenario) -> Callable[[], EngineAdapter]:
    hierarchical = engine == "sglang"
    if not hierarchical:
        scenario = Scenario(**{**scenario.__dict__, "write_policy": "write_through"})
    return lambda: SglangAdapter(scenario, hierarchical)


def scenario_space(engine: str) -> dict[str, tuple[object, ...]]:
    """The scenario values the SGLang adapters take (the suite's CLI uses it).
    RadixCache has no host tier: one host layout, one write policy stand for all."""
    if engine == "sglang-radix":
        return {"host_layout": ("layer_first",), "kv_layout": KV_LAYOUTS,
                "write_policy": ("write_through",)}
    return {"host_layout": tuple(HOST_LAYOUTS), "kv_layout": KV_LAYOUTS,
            "write_policy": ("write_through", "write_through_selective", "write_back")}

