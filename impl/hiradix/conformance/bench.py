"""``hiradix bench``: ours against SGLang 0.5.20 on the same serving-like operation streams.

Four seeded workloads (shared system prompts, multi-turn conversations, few-shot prompts,
long documents that overflow the device and come back from host) become one stream of
requests. Every request is served by each engine in turn -- ours, SGLang's HiRadixCache,
and for the device-only rows SGLang's RadixCache -- so machine noise hits all of them
alike. A request is what a scheduler does: match, load back a host hit, lock, evict the
shortfall, allocate, insert, free the duplicates, unlock, acknowledge copies. Each call
is timed on its own; the table gives the mean and the median time per call of each
operation, and SGLang's time over ours for both (above 1: ours is faster), plus the tree's
metadata bytes per cached token. Medians are the figure to compare: on a shared machine
one scheduler stall moves a mean by tens of percent and a median by a few. Every engine
runs in the same layout (MHA device pools, ``HOST_LAYOUT`` host pools, the same KV
shape), so cache effects favour none. No engine state is shared; keys and slot tensors
are built before the clock starts.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
import tracemalloc
from array import array
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from hiradix.cache import HiRadixCache
from hiradix.clock import CountingClock
from hiradix.config import CacheConfig
from hiradix.device_pool import DeviceKVPool
from hiradix.host_pool import HostKVPool
from hiradix.keys import RadixKey
from hiradix.transfer import make_engine

OPS = ("match_prefix", "insert", "evict", "load_back")
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


@dataclass
class Timings:
    samples: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def timed(self, op: str, call: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = call()
        self.samples[op].append(time.perf_counter() - start)
        return result

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

    def key(self, tokens: tuple[int, ...]) -> RadixKey:
        return RadixKey(tokens)

    def serve(self, key: RadixKey, n: int) -> None:
        c, t = self.cache, self.t
        got = t.timed("match_prefix", lambda: c.match_prefix(key))
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
            prefix = t.timed("insert", lambda: c.insert(key, slots))
            extra = torch.cat([slots[cached:prefix], new[n // self.ps * self.ps - cached:]])
            if len(extra):
                self.pool.free(extra)
        c.dec_lock_ref(node)
        c.writing_check()
        c.loading_check()

    def metadata(self, build: Callable[[], None]) -> tuple[int, int]:
        return _metadata(build, lambda: [(n.device, n.host) for n in self.cache.nodes()],
                         lambda: sum(len(n.tokens) for n in self.cache.nodes()
                                     if n.device is not None or n.host is not None))


class Sglang:
    def __init__(self, page_size: int, device_slots: int, host_slots: int,
                 hierarchical: bool) -> None:
        from hiradix.conformance.adapters.sglang import SglangAdapter
        from hiradix.conformance.scenario import Scenario
        scenario = Scenario(page_size=page_size, device_pages=device_slots // page_size,
                            host_pages=host_slots // page_size, host_layout=HOST_LAYOUT,
                            kv_layout=KV_LAYOUT)
        self.adapter = SglangAdapter(scenario, hierarchical)
        self.adapter.cache.load_back_threshold = 10  # SGLang's own value, as ours uses
        self.hier = hierarchical
        self.name = "sglang" if hierarchical else "sglang-radix"
        self.m = self.adapter.env.modules["base"]
        self.radix = self.adapter.env.modules["radix"]
        self.ps = page_size
        self.t = Timings()

    def key(self, tokens: tuple[int, ...]) -> Any:
        return self.radix.RadixKey(token_ids=array("q", tokens), extra_key=None)

    def serve(self, key: Any, n: int) -> None:
        c, m, t, alloc = self.adapter.cache, self.m, self.t, self.adapter.allocator
        self.adapter.env.clock.now += 1
        params = m.MatchPrefixParams(key=key)
        got = t.timed("match_prefix", lambda: c.match_prefix(params))
        if self.hier and got.host_hit_length >= c.load_back_threshold:
            load = m.InitLoadBackParams(best_match_node=got.best_match_node,
                                        host_hit_length=got.host_hit_length)
            t.timed("load_back", lambda: (c.init_load_back(load),
                                          c.ready_to_load_host_cache()))
            got = c.match_prefix(params)
        node = got.last_device_node
        c.inc_lock_ref(node)
        cached = len(got.device_indices)
        need = -(-(n - cached) // self.ps) * self.ps
        if need > alloc.available_size():
            evict = m.EvictParams(num_tokens=need - alloc.available_size())
            t.timed("evict", lambda: c.evict(evict))
        new = alloc.alloc(need) if need else None
        if new is not None:
            slots = torch.cat([got.device_indices, new[: n - cached]])
            insert = m.InsertParams(key=key, value=slots)
            result = t.timed("insert", lambda: c.insert(insert))
            # The duplicates of the cached prefix, and the partial tail page.
            aligned = n // self.ps * self.ps
            extra = torch.cat([slots[cached:result.prefix_len], new[aligned - cached:]])
            if len(extra):
                alloc.free(extra)
        c.dec_lock_ref(node)
        if self.hier:
            c.writing_check()
            c.loading_check()

    def metadata(self, build: Callable[[], None]) -> tuple[int, int]:
        nodes = self.adapter._nodes
        return _metadata(build, lambda: [(n.value, n.host_value) for n in nodes()],
                         lambda: sum(len(n.key) for n in nodes()))

    def close(self) -> None:
        self.adapter.close()


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


def run(page_size: int, scale: float, seed: int, rows: list[list[str]]) -> None:
    stream = [r for w in workloads(seed, scale) for r in w.requests]
    random.Random(seed).shuffle(stream)
    device, host = 32768, 65536  # tokens: the long documents overflow the device
    engines: list[Any] = [Ours(page_size, device, host),
                          Sglang(page_size, device, host, hierarchical=True),
                          Sglang(page_size, device, host, hierarchical=False)]
    keys = {e.name: [e.key(r) for r in stream] for e in engines}
    for index, request in enumerate(stream):
        for engine in engines:  # interleaved: the same request on every engine in turn
            engine.serve(keys[engine.name][index], len(request))
    ours, hi, radix = engines
    for op in OPS:
        base = radix if op in ("match_prefix", "insert", "evict") else None
        for other in (hi, base):
            if other is None:
                continue
            rows.append([str(page_size), op, other.name, *_per_call(ours.t, op),
                         *_per_call(other.t, op), _ratio(ours.t.mean(op), other.t.mean(op)),
                         _ratio(ours.t.median(op), other.t.median(op))])
    # Metadata: a fresh tree of each kind over the shared-prompt workload, no eviction.
    sample = workloads(seed, scale)[0].requests
    for other_kind in (True, False):
        fresh_ours = Ours(page_size, 1 << 18, 1 << 18)
        fresh = Sglang(page_size, 1 << 18, 1 << 18, hierarchical=other_kind)
        per = []
        for engine in (fresh_ours, fresh):
            size, cached = engine.metadata(_serve_all(engine, sample))
            per.append(size / max(cached, 1))
        rows.append([str(page_size), "metadata bytes/token", fresh.name, f"{per[0]:.1f}",
                     "", f"{per[1]:.1f}", "", f"{per[1] / per[0]:.2f}", ""])
        fresh.close()
    for engine in (hi, radix):
        engine.close()


def _serve_all(engine: Any, requests: list[tuple[int, ...]]) -> Callable[[], None]:
    keys = [engine.key(r) for r in requests]

    def build() -> None:
        for key, request in zip(keys, requests, strict=True):
            engine.serve(key, len(request))
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


def table(rows: list[list[str]]) -> Iterator[str]:
    head = ["page", "operation", "vs", "ours mean µs", "ours median µs", "SGLang mean µs",
            "SGLang median µs", "speed-up (mean)", "speed-up (median)"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for row in [head, ["-" * w for w in widths], *rows]:
        yield " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))


def main(args: argparse.Namespace) -> int:
    from hiradix.conformance.adapters.sglang import available
    if not available():
        print("hiradix bench needs SGLang 0.5.20: `make sglang-env`, then "
              "`.venv-sglang/bin/hiradix bench`", file=sys.stderr)
        return 2
    rows: list[list[str]] = []
    started = time.perf_counter()
    for page_size in args.page_sizes:
        run(page_size, args.scale, args.seed, rows)
    print("\n".join(table(rows)))
    print(f"(seed {args.seed}, scale {args.scale}, page sizes {args.page_sizes}, "
          f"{time.perf_counter() - started:.0f} s; µs per call, calls in brackets; "
          "speed-up = SGLang's time / ours, above 1 means ours is faster; compare medians, "
          "means move with scheduler stalls; every engine in the same layout: "
          f"{KV_LAYOUT.upper()} device pools, {HOST_LAYOUT} host pools; metadata: "
          "ratio is SGLang/ours, above 1 means ours is smaller)")
    return 0
