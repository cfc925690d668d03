"""``hiradix bench``: ours against SGLang on the same serving-like operation streams.

Four seeded workloads (shared system prompts, multi-turn conversations, few-shot
prompts, long documents that overflow the device and come back from host) become one
stream of requests. Every request is served by each engine in turn -- ours, then each
SGLang cache the installed version has: 0.5.20's HiRadixCache (and RadixCache for the
device-only rows), and ``UnifiedRadixCache`` with HiCache on its Python tree core
(0.5.20 and 0.5.23) and on its Rust tree core (0.5.23) -- so machine noise hits all of
them alike. A request is what a scheduler does: match, load back a host hit, lock, evict
the shortfall, allocate, insert, free the duplicates, unlock, acknowledge copies. Each
call is timed on its own (the acknowledging checks too, and insert with them: engines
move a backup's bytes in one or the other); the table gives the mean and the median time
per call of each operation, and SGLang's time over ours for both (above 1: ours is
faster); a table of its own gives the tree's metadata bytes per cached token. Medians
are the figure to compare: on a shared machine one scheduler stall moves a mean by tens
of percent and a median by a few. Every engine runs in the same layout (MHA device
pools, ``HOST_LAYOUT`` host pools, the same KV shape), so cache effects favour none. No
engine state is shared. On 0.5.23 a match returns node handles, and the device slots a
scheduler needs are read with ``path_device_indices``: the match row times both, as ours
returns the slots.

What a scheduler pays per call is timed, nothing built before the clock starts (issue
29): a request arrives as its token ids in an ``array('q')``, the form SGLang's
scheduler holds them in (``Req.origin_input_ids`` / ``output_ids``, and 0.5.23's Rust
tree core refuses anything else), and each engine builds its key from that array as its
server does -- ours a ``RadixKey``, SGLang its ``RadixKey`` -- inside the timer, for the
match and again for the insert (the key row times the match's alone; the match_prefix
row is key and match together), and SGLang's parameter objects are built inside the
timers too. The peers run as shipped (``peers_as_shipped``): the real clocks their trees
read, and their own evictable-leaf sets, not the insertion-ordered ones the conformance
adapters put in for deterministic ties. What stays patched is what running on a CPU
needs (unpinned host memory, the ``index_copy_`` stand-in for ``transfer_kv_direct``,
one gloo group: the adapters' docstrings).

Where ours runs on the C bookkeeping loops (``hiradix._pagebits``), ours on the torch
ones (``HIRADIX_CORE=python``) is one more engine of the table, ``ours-python-core``: the
C loops' own speed-up, from the same run.

``--large`` adds the scaling tables (``bench_scale``): a million cached tokens behind
shared prefixes of 8-32 k tokens, memory per cached token, and the host copies' share
of the machine's memcpy bandwidth.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
import tracemalloc
from array import array
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Literal

import torch

from hiradix._slots import CORE_VARIABLE
from hiradix._slots import core as bookkeeping_core
from hiradix.cache import HiRadixCache
from hiradix.clock import CountingClock
from hiradix.config import CacheConfig
from hiradix.conformance.plots import PlotsUnavailable, pyplot, write_bench_plot
from hiradix.device_pool import DeviceKVPool
from hiradix.engines.protocol import EngineUnavailable
from hiradix.host_pool import HostKVPool
from hiradix.keys import RadixKey
from hiradix.transfer import make_engine

OPS = ("key", "match_prefix", "insert", "evict", "load_back", "checks", "insert+checks")
# "key": building the match's key from the request's list; "match_prefix": that key and
# the match together (what a scheduler pays to look a request up).
# Where a backup's bytes move differs: ours copies in insert, SGLang's HiRadixCache in
# writing_check (its start_writing). "checks" times each request's writing_check and
# loading_check; "insert+checks" a request's insert and its checks together, the whole
# write path, so that the insert rows can be read like for like.
HOST_OPS = ("load_back", "checks", "insert+checks")
# The same KV shape for every engine (SGLang's pools are built by its adapter with these):
# insert and load-back move the bytes, so the rows compare the same copies.
LAYERS, HEADS, HEAD_DIM, DTYPE = 2, 2, 2, torch.float16
# One host layout for every engine: SGLang's adapter supports only layer_first (and MHA),
# so ours runs in it too, and neither gains from a friendlier memory layout.
HOST_LAYOUT: Literal["layer_first"] = "layer_first"
KV_LAYOUT: Literal["mha"] = "mha"


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[tuple[int, ...]]


def workloads(seed: int, scale: float) -> list[Workload]:
    """The four request mixes, deterministic for ``seed``."""
    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(1, 32000) for _ in range(n))

    count = max(8, int(400 * scale))
    systems = [tokens(rng.randint(300, 700)) for _ in range(4)]
    shared = [rng.choice(systems) + tokens(rng.randint(32, 256)) for _ in range(count)]
    turns: list[tuple[int, ...]] = []
    chats = [tokens(rng.randint(64, 200)) for _ in range(count // 8)]
    for _ in range(count):
        index = rng.randrange(len(chats))
        chats[index] = chats[index] + tokens(rng.randint(16, 96))  # the next turn
        turns.append(chats[index])
    shots = [tokens(rng.randint(60, 120)) for _ in range(12)]
    fewshot = [sum(rng.sample(shots, 4), ()) + tokens(rng.randint(16, 64))
               for _ in range(count)]
    documents = [tokens(rng.randint(1500, 2500)) for _ in range(6)]
    long_docs = [rng.choice(documents) + tokens(rng.randint(16, 64)) for _ in range(count // 4)]
    return [Workload("system prompts", shared), Workload("multi-turn", turns),
            Workload("few-shot", fewshot), Workload("long documents", long_docs)]


def nothing() -> None:
    """An empty call: timed where each engine times its key (the ``floor``), it is what
    any row's timer costs by itself at that point of a request, cold caches included."""


@dataclass
class Timings:
    samples: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def timed(self, op: str, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = call()
        self.samples[op].append(time.perf_counter() - start)
        return result

    def total(self, op: str, *parts: str) -> None:
        """One sample of ``op``: the sum of the latest sample of each of ``parts``."""
        self.samples[op].append(sum(self.samples[part][-1] for part in parts))

    def calls(self, op: str) -> int:
        return len(self.samples[op])

    def mean(self, op: str) -> float | None:
        """Seconds per call, averaged; None if never called."""
        return statistics.fmean(self.samples[op]) if self.samples[op] else None

    def median(self, op: str) -> float | None:
        """Seconds per call, the median; None if never called."""
        return statistics.median(self.samples[op]) if self.samples[op] else None


class Ours:
    name = "ours"

    def __init__(self, page_size: int, device_slots: int, host_slots: int) -> None:
        device = DeviceKVPool(num_slots=device_slots, page_size=page_size, layers=LAYERS,
                              layout=KV_LAYOUT, heads=HEADS, head_dim=HEAD_DIM, dtype=DTYPE,
                              device="cpu")
        host = HostKVPool(device, num_slots=host_slots, layout=HOST_LAYOUT)
        self.cache = HiRadixCache(CacheConfig(page_size=page_size), device, host,
                                  make_engine("sync", device, host), clock=CountingClock())
        self.pool = device
        self.ps = page_size
        self.t = Timings()

    @classmethod
    def on_python_core(cls, page_size: int, device_slots: int, host_slots: int) -> Ours:
        """Ours with the torch bookkeeping (``HIRADIX_CORE=python``): the C loops' own
        speed-up, measured in the same run as the rest."""
        saved = os.environ.get(CORE_VARIABLE)
        os.environ[CORE_VARIABLE] = "python"
        try:
            engine = cls(page_size, device_slots, host_slots)
        finally:
            if saved is None:
                del os.environ[CORE_VARIABLE]
            else:
                os.environ[CORE_VARIABLE] = saved
        assert engine.pool.allocator.core == "python"
        engine.name = "ours-python-core"
        return engine

    def serve(self, tokens: array[int]) -> None:
        c, t, n = self.cache, self.t, len(tokens)
        t.timed("floor", nothing)
        key = t.timed("key", lambda: RadixKey(tokens))
        got = t.timed("match", lambda: c.match_prefix(key))
        t.total("match_prefix", "key", "match")
        if got.host_hit_length >= c.config.load_back_threshold:
            t.timed("load_back", lambda: c.init_load_back(got.last_host_node, None))
            got = c.match_prefix(key)
        node = got.last_device_node
        c.inc_lock_ref(node)
        cached = len(got.device_slots)
        need = -(-(n - cached) // self.ps) * self.ps
        if need > self.pool.num_free_slots:
            short = need - self.pool.num_free_slots
            t.timed("evict", lambda: c.evict(short))
        new = self.pool.alloc(need) if need else None
        if new is not None:
            slots = torch.cat([got.device_slots, new[: n - cached]])
            prefix = t.timed("insert", lambda: c.insert(RadixKey(tokens), slots))
            extra = torch.cat([slots[cached:prefix], new[n // self.ps * self.ps - cached:]])
            if len(extra):
                self.pool.free(extra)
        c.dec_lock_ref(node)
        t.timed("checks", lambda: (c.writing_check(), c.loading_check()))
        if new is not None:
            t.total("insert+checks", "insert", "checks")

    def evict_tokens(self, n: int) -> None:
        self.t.timed("evict", lambda: self.cache.evict(n))

    def host_hit(self, tokens: array[int]) -> int:
        """Tokens a match of ``tokens`` finds on host only (untimed)."""
        return self.cache.match_prefix(RadixKey(tokens)).host_hit_length

    def close(self) -> None:
        """Nothing to release (the SGLang engines have threads and process groups)."""

    def metadata(self, build: Callable[[], None]) -> tuple[int, int]:
        return _metadata(build, lambda: [(n.device, n.host) for n in self.cache.nodes()],
                         lambda: sum(len(n.tokens) for n in self.cache.nodes()
                                     if n.device is not None or n.host is not None))


def _evict_and_alloc(timings: Timings, cache: Any, alloc: Any, params: Callable[..., Any],
                     tokens: int, page_size: int) -> torch.Tensor | None:
    """An SGLang scheduler's step before insert: room for ``tokens`` new tokens rounded
    up to whole pages (the shortfall evicted, timed, with ``params(num_tokens=...)``, the
    cache's ``EvictParams``), then those slots from ``alloc`` (None if none are needed or
    too few are free)."""
    need = -(-tokens // page_size) * page_size
    if need > alloc.available_size():
        short = need - alloc.available_size()
        # The scheduler builds an EvictParams per call (mem_cache/common.py), so its
        # construction is timed, as ours is timed from the same int.
        timings.timed("evict", lambda: cache.evict(params(num_tokens=short)))
    return alloc.alloc(need) if need else None


def server_key(radix: Any, tokens: array[int]) -> Any:
    """SGLang's key of a request (``radix``: its ``radix_cache`` module), built from the
    request's array of token ids as the server's scheduler builds it
    (``RadixKey(token_ids=..., extra_key=...)``, mem_cache/common.py)."""
    return radix.RadixKey(token_ids=tokens, extra_key=None)


class Sglang:
    def __init__(self, page_size: int, device_slots: int, host_slots: int,
                 hierarchical: bool) -> None:
        from hiradix.conformance.scenario import Scenario
        from hiradix.engines.sglang.radix import SglangAdapter
        scenario = Scenario(page_size=page_size, device_pages=device_slots // page_size,
                            host_pages=host_slots // page_size, host_layout=HOST_LAYOUT,
                            kv_layout=KV_LAYOUT)
        self.adapter = SglangAdapter(scenario, hierarchical, observed=False)
        self.adapter.cache.load_back_threshold = 10  # SGLang's own value, as ours uses
        self.hier = hierarchical
        self.name = "sglang" if hierarchical else "sglang-radix"
        self.m = self.adapter.env.modules["base"]
        self.radix = self.adapter.env.modules["radix"]
        self.ps = page_size
        self.t = Timings()

    def key(self, tokens: array[int]) -> Any:
        return server_key(self.radix, tokens)

    def serve(self, tokens: array[int]) -> None:
        c, m, t, alloc = self.adapter.cache, self.m, self.t, self.adapter.allocator
        n, radix_key = len(tokens), self.key
        t.timed("floor", nothing)
        params = t.timed("key", lambda: m.MatchPrefixParams(key=radix_key(tokens)))
        got = t.timed("match", lambda: c.match_prefix(params))
        t.total("match_prefix", "key", "match")
        if self.hier and got.host_hit_length >= c.load_back_threshold:
            # The scheduler builds an InitLoadBackParams per call (schedule_policy.py):
            # inside the timer.
            t.timed("load_back", lambda: (
                c.init_load_back(m.InitLoadBackParams(best_match_node=got.best_match_node,
                                                      host_hit_length=got.host_hit_length)),
                c.ready_to_load_host_cache()))
            got = c.match_prefix(params)
        node = got.last_device_node
        c.inc_lock_ref(node)
        cached = len(got.device_indices)
        new = _evict_and_alloc(t, c, alloc, m.EvictParams, n - cached, self.ps)
        if new is not None:
            slots = torch.cat([got.device_indices, new[: n - cached]])
            result = t.timed("insert", lambda: c.insert(
                m.InsertParams(key=radix_key(tokens), value=slots)))
            # The duplicates of the cached prefix, and the partial tail page.
            aligned = n // self.ps * self.ps
            extra = torch.cat([slots[cached:result.prefix_len], new[aligned - cached:]])
            if len(extra):
                alloc.free(extra)
        c.dec_lock_ref(node)
        if self.hier:
            t.timed("checks", lambda: (c.writing_check(), c.loading_check()))
            if new is not None:
                t.total("insert+checks", "insert", "checks")

    def metadata(self, build: Callable[[], None]) -> tuple[int, int]:
        nodes = self.adapter._nodes
        return _metadata(build, lambda: [(n.value, n.host_value) for n in nodes()],
                         lambda: sum(len(n.key) for n in nodes()))

    def evict_tokens(self, n: int) -> None:
        # EvictParams is built per call by the server: inside the timer.
        params = self.m.EvictParams
        self.t.timed("evict", lambda: self.adapter.cache.evict(params(num_tokens=n)))

    def host_hit(self, tokens: array[int]) -> int:
        if not self.hier:
            return 0
        got = self.adapter.cache.match_prefix(self.m.MatchPrefixParams(key=self.key(tokens)))
        return int(got.host_hit_length)

    def close(self) -> None:
        self.adapter.close()


class Unified:
    """SGLang's ``UnifiedRadixCache`` with HiCache (the cache its server builds for
    ``--enable-hierarchical-cache``) on tree core ``core``, built by the adapter's
    ``build``; driven as its scheduler drives it (0.5.23: insert's backups are issued by
    ``flush_pending_backups``, timed with the insert, DEV-26; the tree frees the
    duplicates past ``prev_prefix_len`` itself, DEV-24)."""

    def __init__(self, page_size: int, device_slots: int, host_slots: int,
                 core: Literal["python", "rust"]) -> None:
        from hiradix.conformance.scenario import Scenario
        from hiradix.engines.sglang.unified import build, prepare
        self.env = prepare()
        self.v20 = self.env.version == "0.5.20"
        scenario = Scenario(page_size=page_size, device_pages=device_slots // page_size,
                            host_pages=host_slots // page_size, host_layout=HOST_LAYOUT,
                            kv_layout=KV_LAYOUT)
        built = build(self.env, scenario, core)
        self.cache, self.alloc = built.cache, built.allocator
        wanted = {"python": "UnifiedTreeCore", "rust": "RustUnifiedTreeCore"}[core]
        if type(self.cache.tree_core).__name__ != wanted:  # SGLang falls back silently
            raise RuntimeError(f"asked for the {core} tree core, got "
                               f"{type(self.cache.tree_core).__name__}")
        self.cache.load_back_threshold = 10  # SGLang's own value, as ours uses
        self.core = core
        self.name = f"unified-{core}"
        self.m = self.env.modules["base"]
        self.radix = self.env.modules["radix"]
        self.full = self.env.modules["components"].ComponentType.FULL
        self.ps = page_size
        self.t = Timings()

    def key(self, tokens: array[int]) -> Any:
        return server_key(self.radix, tokens)

    def _match(self, params: Any) -> tuple[Any, torch.Tensor]:
        got = self.cache.match_prefix(params)
        if self.v20:
            return got, got.device_indices
        return got, self.cache.path_device_indices(got.last_device_node)

    def serve(self, tokens: array[int]) -> None:
        c, m, t, alloc = self.cache, self.m, self.t, self.alloc
        n, radix_key = len(tokens), self.key
        t.timed("floor", nothing)
        params = t.timed("key", lambda: m.MatchPrefixParams(key=radix_key(tokens)))
        got, device = t.timed("match", lambda: self._match(params))
        t.total("match_prefix", "key", "match")
        if got.host_hit_length >= c.load_back_threshold:
            # What init_load_back reads of the request (FULL is the only component); the
            # server's Req exists before the call, so it stays outside the timer.
            req = SimpleNamespace(rid="bench", last_node=got.last_device_node,
                                  swa_host_hit_length=0, mamba_host_hit_length=0,
                                  kv=SimpleNamespace(mamba_pool_idx=None))
            # The InitLoadBackParams is built per call (schedule_policy.py): inside.
            t.timed("load_back", lambda: (
                c.init_load_back(m.InitLoadBackParams(best_match_node=got.best_match_node,
                                                      host_hit_length=got.host_hit_length,
                                                      mem_quota=None, req=req)),
                c.ready_to_load_host_cache()))
            got, device = self._match(params)
        receipt = c.inc_lock_ref(got.last_device_node)
        cached = len(device)
        new = _evict_and_alloc(t, c, alloc, m.EvictParams, n - cached, self.ps)
        if new is not None:
            value = torch.cat([device, new[: n - cached]])
            t.timed("insert", lambda: (
                c.insert(m.InsertParams(key=radix_key(tokens), value=value,
                                        prev_prefix_len=cached)),
                None if self.v20 else c.flush_pending_backups()))
            tail = new[n // self.ps * self.ps - cached:]  # the partial tail page
            if len(tail):
                alloc.free(tail)
        c.dec_lock_ref(receipt.node_id, receipt.to_dec_params())
        t.timed("checks", lambda: (c.writing_check(), c.loading_check()))
        if new is not None:
            t.total("insert+checks", "insert", "checks")

    def metadata(self, build: Callable[[], None]) -> tuple[int, int] | None:
        """The Python core's heap as for the others; None for the Rust core, whose nodes
        live on a heap tracemalloc does not see."""
        if self.core == "rust":
            build()
            return None

        def nodes() -> list[Any]:
            order, stack = [], list(self.cache.tree_core.root_node.children.values())
            while stack:
                node = stack.pop()
                order.append(node)
                stack.extend(node.children.values())
            return order

        def slots() -> list[tuple[Any, Any]]:
            return [(n.component_data[self.full].value, n.component_data[self.full].host_value)
                    for n in nodes()]
        return _metadata(build, slots, lambda: sum(len(n.key) for n in nodes()))

    def evict_tokens(self, n: int) -> None:
        # EvictParams is built per call by the server: inside the timer.
        params = self.m.EvictParams
        self.t.timed("evict", lambda: self.cache.evict(params(num_tokens=n)))

    def host_hit(self, tokens: array[int]) -> int:
        params = self.m.MatchPrefixParams(key=self.key(tokens))
        return int(self.cache.match_prefix(params).host_hit_length)

    def close(self) -> None:
        self.cache.shutdown()


Factory = Callable[[int, int], Any]  # (device slots, host slots) -> an engine


def competitors(page_size: int) -> list[Factory]:
    """A builder for every SGLang cache the installed SGLang offers: 0.5.20's
    HiRadixCache and RadixCache, UnifiedRadixCache on the Python core (0.5.20, 0.5.23)
    and on the Rust core (0.5.23)."""
    from hiradix.engines.sglang import rust as sglang_rust
    from hiradix.engines.sglang import unified as sglang_unified
    from hiradix.engines.sglang.radix import available
    found: list[Factory] = []
    if available():
        found += [lambda d, h: Sglang(page_size, d, h, hierarchical=True),
                  lambda d, h: Sglang(page_size, d, h, hierarchical=False)]
    for engine, module, core in (("sglang-unified", sglang_unified, "python"),
                                 ("sglang-unified-rust", sglang_rust, "rust")):
        try:
            module.probe(engine)
        except EngineUnavailable:
            continue
        found.append(lambda d, h, core=core: Unified(page_size, d, h, core))
    return found


def _metadata(build: Callable[[], None], tensors: Callable[[], list[tuple[Any, Any]]],
              tokens: Callable[[], int]) -> tuple[int, int]:
    """Python heap bytes the tree grew by while ``build`` ran, plus the bytes of its slot
    tensors (torch storage is not traced), and the tokens cached."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    build()
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    storage = sum(t.nbytes for pair in tensors() for t in pair if isinstance(t, torch.Tensor))
    return grown + storage, tokens()


DEVICE_ONLY = ("sglang-radix",)  # engines without a host tier: no HOST_OPS rows


DEVICE_TOKENS, HOST_TOKENS = 32768, 65536  # the long documents overflow the device


def request_stream(seed: int, scale: float) -> list[array[int]]:
    """The four workloads' requests as one shuffled stream, the order every engine serves;
    each an ``array('q')`` of token ids, as SGLang's scheduler holds a request's tokens."""
    stream = [array("q", r) for w in workloads(seed, scale) for r in w.requests]
    random.Random(seed).shuffle(stream)
    return stream


@contextmanager
def peers_as_shipped() -> Iterator[None]:
    """Every installed SGLang cache as its server runs it, while the block runs (the
    adapters' ``as_shipped``: the real clocks, not the conformance runs' logical ones)."""
    from hiradix.engines.sglang import radix as sglang
    from hiradix.engines.sglang import unified as sglang_unified
    with ExitStack() as stack:
        if sglang.available():
            stack.enter_context(sglang.as_shipped())
        try:
            sglang_unified.probe("sglang-unified")
        except EngineUnavailable:
            pass
        else:
            stack.enter_context(sglang_unified.as_shipped())
        yield


def run(page_size: int, scale: float, seed: int, rows: list[list[str]],
        memory: list[list[str]], floors: list[str]) -> None:
    """Time every operation of the stream on each engine (``rows``) and measure each
    tree's metadata per cached token (``memory``: a figure of another kind, whose ratio
    reads the other way, so kept out of the timing table)."""
    stream = request_stream(seed, scale)
    device, host = DEVICE_TOKENS, HOST_TOKENS
    makers = competitors(page_size)
    ours = Ours(page_size, device, host)
    others = [make(device, host) for make in makers]
    if ours.pool.allocator.core == "native":  # and the C loops against the torch ops
        others.append(Ours.on_python_core(page_size, device, host))
    engines: list[Any] = [ours, *others]
    with peers_as_shipped():
        for index, request in enumerate(stream):
            # Interleaved: the same request on every engine in turn, the first engine
            # rotating, since the first to read a fresh request pays its cache
            # misses (on this stream, a key built first cost 1.6 times one built second).
            first = index % len(engines)
            for engine in engines[first:] + engines[:first]:
                engine.serve(request)
    for op in OPS:
        for other in others:
            if op in HOST_OPS and other.name in DEVICE_ONLY:
                continue
            rows.append([str(page_size), op, other.name, *_per_call(ours.t, op),
                         *_per_call(other.t, op), _ratio(ours.t.mean(op), other.t.mean(op)),
                         _ratio(ours.t.median(op), other.t.median(op))])
    floors.append(f"P{page_size} " + ", ".join(
        f"{e.name} {(e.t.median('floor') or 0) * 1e6:.2f}" for e in engines))
    for other in others:
        other.close()
    # Metadata: a fresh tree of each kind over the shared-prompt workload, no eviction.
    sample = [array("q", r) for r in workloads(seed, scale)[0].requests]
    for make in makers:
        fresh_ours = Ours(page_size, 1 << 18, 1 << 18)
        fresh = make(1 << 18, 1 << 18)
        with peers_as_shipped():
            mine = fresh_ours.metadata(_serve_all(fresh_ours, sample))
            theirs = fresh.metadata(_serve_all(fresh, sample))
        assert mine is not None
        per_ours = mine[0] / max(mine[1], 1)
        if theirs is None:
            memory.append([str(page_size), fresh.name, f"{per_ours:.1f}", "n/a (Rust heap)",
                           "n/a"])
        else:
            per = theirs[0] / max(theirs[1], 1)
            memory.append([str(page_size), fresh.name, f"{per_ours:.1f}", f"{per:.1f}",
                           f"{per / per_ours:.2f}"])
        fresh.close()


def _serve_all(engine: Any, requests: list[array[int]]) -> Callable[[], None]:
    def build() -> None:
        for request in requests:
            engine.serve(request)
    return build


def _per_call(timings: Timings, op: str) -> tuple[str, str]:
    """The mean (with the number of calls) and the median time per call, in µs."""
    mean, median = timings.mean(op), timings.median(op)
    if mean is None or median is None:
        return "n/a", "n/a"
    return f"{mean * 1e6:,.1f} ({timings.calls(op)})", f"{median * 1e6:,.1f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    """SGLang's time per call over ours: above 1, ours is faster."""
    return f"{theirs / ours:.2f}" if ours and theirs else "n/a"


def medians(rows: list[list[str]]) -> list[tuple[int, str, str, float, float]]:
    """The timed rows of ``table``'s input as (page size, operation, engine, ours median
    µs, theirs median µs), for ``plots.write_bench_plot``."""
    return [(int(r[0]), r[1], r[2], float(r[4].replace(",", "")),
             float(r[6].replace(",", ""))) for r in rows]


TIMING_HEAD = ["page", "operation", "vs", "ours mean µs", "ours median µs",
               "theirs mean µs", "theirs median µs", "speed-up (mean)", "speed-up (median)"]
MEMORY_HEAD = ["page", "vs", "ours B/token", "theirs B/token", "theirs / ours"]


def table(rows: list[list[str]], head: list[str] = TIMING_HEAD) -> Iterator[str]:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for row in [head, ["-" * w for w in widths], *rows]:
        yield " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``hiradix bench``'s options (the CLI's ``bench`` parser may take them from here)."""
    parser.add_argument("--page-sizes", type=lambda v: [int(x) for x in v.split(",")],
                        default=[1, 16])
    parser.add_argument("--scale", type=float, default=4.0,
                        help="workload size; 4 (the default) is 5,200 requests per page size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--large", action="store_true",
                        help="also the scaling tables: up to --large-tokens cached tokens "
                             "behind shared prefixes of 8-32 k tokens, memory per cached "
                             "token, host-copy bandwidth against memcpy")
    parser.add_argument("--large-tokens", type=int, default=1 << 20,
                        help="cached tokens the large workload reaches (default 1 Mi)")
    parser.add_argument("--large-only", action="store_true",
                        help="only the scaling tables (implies --large)")
    parser.add_argument("--plot", default=None, metavar="FILE",
                        help="also draw the table's medians, ours beside each engine, as a "
                             "PNG (needs matplotlib: pip install 'hiradix[plots]')")
    parser.add_argument("--profile", action="store_true",
                        help="instead of the table: where ours spends each operation's "
                             "time (cProfile per operation, own time per kind of cost, "
                             "torch kernels and C calls per call); needs no SGLang")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch's intra-op threads for every engine (default: torch's "
                             "own); on a loaded machine a parallel indexing op can wait "
                             "milliseconds for its second thread, 1 avoids that")


def options(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with every bench option: a parser that predates an option gives its
    default."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    return argparse.Namespace(**(vars(parser.parse_args([])) | vars(args)))


def main(args: argparse.Namespace) -> int:
    args = options(args)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    if args.profile:
        from hiradix.bench.profile import report as profile
        print("\n".join(profile(args.page_sizes, args.scale, args.seed)))
        return 0
    if not competitors(1):
        print("hiradix bench needs SGLang: `make sglang-env` (0.5.20: HiRadixCache, "
              "RadixCache, UnifiedRadixCache) or `make sglang23-env` (0.5.23: "
              "UnifiedRadixCache on the Python and Rust tree cores), then "
              "`.venv-sglang/bin/hiradix bench` or `.venv-sglang23/bin/hiradix bench`",
              file=sys.stderr)
        return 2
    if args.plot is not None:
        try:
            pyplot()
        except PlotsUnavailable as missing:
            print(f"hiradix bench --plot: {missing}", file=sys.stderr)
            return 2
    started = time.perf_counter()
    if not args.large_only:
        rows: list[list[str]] = []
        memory: list[list[str]] = []
        floors: list[str] = []
        for page_size in args.page_sizes:
            run(page_size, args.scale, args.seed, rows, memory, floors)
        print("\n".join(table(rows)))
        print(f"(seed {args.seed}, scale {args.scale}, page sizes {args.page_sizes}, "
              f"{torch.get_num_threads()} torch threads, our core {bookkeeping_core()}, "
              f"{time.perf_counter() - started:.0f} s; µs per call, calls in brackets; "
              "speed-up = their time / ours, above 1 means ours is faster; compare medians, "
              "means move with scheduler stalls; every engine in the same layout: "
              f"{KV_LAYOUT.upper()} device pools, {HOST_LAYOUT} host pools)")
        print("(the timer's own cost, an empty call timed where each engine times its key, "
              f"median µs: {'; '.join(floors)}; every row includes it)")
        print("\nTree metadata per cached token (a fresh tree over the shared-prompt "
              "workload: the Python heap it grew by, plus its slot tensors; not the KV):")
        print("\n".join(table(memory, MEMORY_HEAD)))
        print("(theirs / ours above 1 means ours is smaller)")
        if args.plot is not None:
            print(f"(plot: {write_bench_plot(medians(rows), args.plot)})")
    if args.large or args.large_only:
        from hiradix.bench.scale import report
        report(args.page_sizes[-1], args.large_tokens, args.seed)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m hiradix.bench.cache")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
