"""``hiradix bench --large``: how each operation's cost grows with the tokens cached and
the length of the shared prefix, memory per cached token, and the host copies against
the machine's memcpy bandwidth.

Scaling: for each shared-prefix length (8, 16, 32 k tokens) every engine is filled, in
step, with groups of requests that share one prefix (``PER_GROUP`` requests of prefix +
``SUFFIX`` tokens each) up to each checkpoint of cached tokens (an eighth, a half, all
of ``--large-tokens``, 1 Mi by default). At each checkpoint ``PROBES`` calls of each
operation are timed on every engine in turn:

- key, match_prefix and insert: a new request behind a cached prefix, as an
  ``array('q')`` of token ids (key: building the match's key from it; match_prefix:
  that key and the match, which finds the prefix; insert: its own key and the
  ``SUFFIX`` new tokens; insert+checks: that insert and the scheduler's next
  ``writing_check``/``loading_check``, where SGLang makes the host copy that ours makes
  in the insert under write-through);
- evict: ``SUFFIX`` tokens (one leaf under LRU, the oldest request's suffix);
- load_back: requests whose suffixes an engine holds on host only, served again (their
  host copies come back); each engine finds its own (eviction orders differ). The call
  counts in the table show where an engine did not load.

Memory: each engine alone, in a process of its own, is filled to an eighth of the
target; the Python heap it grew by (tracemalloc, plus its slot tensors) and the
process's resident memory growth, per cached token (in a second process, without
tracemalloc, whose own records would count). The KV pools are allocated before the
fill; the resident growth includes the host KV pages first written by the fill
(``KV_BYTES`` per token per tier).

Bandwidth: ours with a KV shape of 4 KiB per token per layer, so each copy of
``BANDWIDTH_TOKENS`` tokens moves 4 MiB per layer: backup (``write_backup`` and its
acknowledgement) and load-back (``init_load_back`` and its acknowledgement) against one
contiguous ``copy_`` of the same bytes (the physical limit on this machine), over
``BANDWIDTH_REPEATS`` rounds of one of each (best and median). SGLang's pools are built by
its adapters with a fixed tiny KV shape, so the bandwidth rows are ours only.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import time
from array import array
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hiradix.bench.cache import (
    DEVICE_ONLY,
    DTYPE,
    HEAD_DIM,
    HEADS,
    HOST_LAYOUT,
    KV_LAYOUT,
    LAYERS,
    Ours,
    Timings,
    competitors,
    peers_as_shipped,
)
from hiradix.bench.key_forms import LONG_PROMPT, key_forms
from hiradix.bench.key_forms import REPEATS as KEY_REPEATS
from hiradix.cache import HiRadixCache
from hiradix.clock import CountingClock
from hiradix.config import CacheConfig
from hiradix.device_pool import DeviceKVPool
from hiradix.host_pool import HostKVPool
from hiradix.keys import RadixKey
from hiradix.transfer import make_engine

PREFIXES = (8192, 16384, 32768)
# insert+checks: the insert and the scheduler's next checks together, like for like where
# an engine copies to host in its insert (ours, write-through) or in its checks (SGLang's).
SCALED_OPS = ("key", "match_prefix", "insert", "insert+checks", "evict", "load_back")
HOST_ONLY_ROWS = ("insert+checks", "load_back")  # no row for an engine without a host tier
SUFFIX = 1024
PER_GROUP = 8
PROBES = 8
KV_BYTES = 2 * LAYERS * HEADS * HEAD_DIM * DTYPE.itemsize  # K and V, every layer
BANDWIDTH_HEADS, BANDWIDTH_HEAD_DIM, BANDWIDTH_LAYERS = 8, 128, 4  # 4 KiB/token/layer
BANDWIDTH_TOKENS = 1024
BANDWIDTH_REPEATS = 20


class Tokens:
    """Random token ids from one seeded generator (fast for millions of tokens)."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, n: int) -> array[int]:
        return array("q", torch.randint(1, 32000, (n,), generator=self.gen).tolist())


def checkpoints(target: int) -> list[int]:
    return sorted({max(target // 8, 1), max(target // 2, 1), target})


def capacity(target: int, page_size: int) -> int:
    """Device slots for ``target`` cached tokens plus the probes, page aligned."""
    slots = target + target // 4 + 4 * PROBES * SUFFIX + 65536
    return -(-slots // page_size) * page_size


def _resident() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096


class Group:
    """Requests behind one shared prefix."""

    def __init__(self, prefix: array[int], tokens: Tokens) -> None:
        self.prefix = prefix
        self.requests = [prefix + tokens(SUFFIX) for _ in range(PER_GROUP)]

    @property
    def cached(self) -> int:
        return len(self.prefix) + PER_GROUP * SUFFIX


def _serve(engines: list[Any], request: array[int]) -> None:
    for engine in engines:  # interleaved, as in the main table
        engine.serve(request)


def _on_host(engine: Any, order: list[array[int]]) -> list[array[int]]:
    """The first ``PROBES`` requests of ``order`` whose suffix ``engine`` holds on host
    only (none for a device-only engine)."""
    found: list[array[int]] = []
    if engine.name in DEVICE_ONLY:
        return found
    for request in order:
        if engine.host_hit(request) >= SUFFIX:
            found.append(request)
            if len(found) == PROBES:
                break
    return found


def _phase(engines: list[Any], op: str, samples: dict[str, dict[str, list[float]]],
           body: Callable[[], None]) -> None:
    """Run ``body`` with fresh timings and keep each engine's samples of ``op``. The
    cyclic garbage collector is paused while it runs, as ``timeit`` pauses it: every
    engine's million tokens live in this one process, so a collection would charge
    whichever engine happened to allocate with scanning all of them (issue 13: single
    calls of 1 ms among 0.2 ms ones, the time in a torch.Size allocation)."""
    for engine in engines:
        engine.t = Timings()
    gc.collect()
    gc.disable()
    try:
        body()
    finally:
        gc.enable()
    for engine in engines:
        samples[engine.name].setdefault(op, []).extend(engine.t.samples[op])


def scaling(page_size: int, target: int, seed: int,
            prefixes: tuple[int, ...] = PREFIXES) -> tuple[list[str], list[list[str]]]:
    """The engines' names and the rows: prefix length, cached tokens, operation, then
    each engine's median µs per call (calls), ours first, others with their time over
    ours."""
    names: list[str] = []
    rows: list[list[str]] = []
    for prefix_len in prefixes:
        names = _scale_one(page_size, target, seed + prefix_len, prefix_len, rows)
    return names, rows


def _scale_one(page_size: int, target: int, seed: int, prefix_len: int,
               rows: list[list[str]]) -> list[str]:
    tokens = Tokens(seed)
    device = capacity(target, page_size)
    engines: list[Any] = [Ours(page_size, device, 2 * device),
                          *(make(device, 2 * device) for make in competitors(page_size))]
    groups: list[Group] = []
    order: list[array[int]] = []  # requests served, oldest first
    for checkpoint in checkpoints(target):
        while sum(g.cached for g in groups) < checkpoint:
            groups.append(Group(tokens(prefix_len), tokens))
            for request in groups[-1].requests:
                _serve(engines, request)
                order.append(request)
        samples: dict[str, dict[str, list[float]]] = {e.name: {} for e in engines}
        fresh = [groups[i * len(groups) // PROBES].prefix + tokens(SUFFIX)
                 for i in range(PROBES)]

        def new_requests(fresh: list[array[int]] = fresh) -> None:
            for request in fresh:
                _serve(engines, request)

        def evictions() -> None:
            for _ in range(PROBES):
                for engine in engines:
                    engine.evict_tokens(SUFFIX)

        def reloads() -> None:
            # Each engine's own victims: eviction orders differ (SGLang stamps a split's
            # suffix, DEV-1), so each reloads the first requests it holds on host only.
            targets = [_on_host(engine, order) for engine in engines]
            for index in range(PROBES):
                for engine, mine in zip(engines, targets, strict=True):
                    if index < len(mine):
                        engine.serve(mine[index])

        _phase(engines, "match_prefix", samples, new_requests)
        order.extend(fresh)  # cached now: later evictions may take them first
        for engine in engines:
            for op in ("key", "insert", "insert+checks"):
                samples[engine.name][op] = engine.t.samples.get(op, [])
        _phase(engines, "evict", samples, evictions)
        _phase(engines, "load_back", samples, reloads)
        cached = sum(g.cached for g in groups)
        for op in SCALED_OPS:
            ours = samples["ours"].get(op, [])
            row = [f"{prefix_len:,}", f"{cached:,}", op,
                   _cell(ours, None)]
            for engine in engines[1:]:
                if op in HOST_ONLY_ROWS and engine.name in DEVICE_ONLY:
                    row.append("-")
                else:
                    row.append(_cell(samples[engine.name].get(op, []), ours))
            rows.append(row)
    for engine in engines:
        engine.close()
    return [e.name for e in engines]


def _cell(samples: list[float], ours: list[float] | None) -> str:
    if not samples:
        return "n/a (0)"
    median = statistics.median(samples)
    text = f"{median * 1e6:,.0f} ({len(samples)})"
    if ours:
        text += f" x{median / statistics.median(ours):.2f}"
    return text


def memory(page_size: int, target: int, seed: int) -> Iterator[list[str]]:
    """Rows: engine, cached tokens, Python heap bytes per token (tracemalloc and slot
    tensors), resident memory growth per token. Each engine runs in a process of its
    own: in one process an engine reuses the heap the previous one freed, and the
    resident size does not grow."""
    for index in range(1 + len(competitors(page_size))):
        row = []
        for traced in (1, 0):
            done = subprocess.run([sys.executable, "-m", "hiradix.bench.scale",
                                   str(index), str(page_size), str(target), str(seed),
                                   str(traced)], capture_output=True, text=True, check=True)
            row.append(json.loads(done.stdout.strip().splitlines()[-1]))
        heap, resident = row
        yield [*heap[:3], resident[3]]


def _memory_of(index: int, page_size: int, target: int, seed: int,
               traced: int) -> list[str]:
    """``memory``'s row for engine ``index`` (0: ours, then ``competitors``' order);
    the heap figure only if ``traced``, the resident figure only if not."""
    budget = max(target // 8, 1)
    device = capacity(budget, page_size)
    make = [lambda d, h: Ours(page_size, d, h), *competitors(page_size)][index]
    tokens = Tokens(seed)  # the same requests for every engine
    groups: list[Group] = []
    while sum(g.cached for g in groups) < budget:
        groups.append(Group(tokens(PREFIXES[0]), tokens))
    requests = [r for g in groups for r in g.requests]
    engine = make(device, 2 * device)

    def build() -> None:
        with peers_as_shipped():
            for request in requests:
                engine.serve(request)

    gc.collect()
    before = _resident()
    measured = engine.metadata(build) if traced else build()
    gc.collect()
    grown = _resident() - before
    cached = sum(g.cached for g in groups)
    heap = "n/a (Rust heap)" if measured is None else f"{measured[0] / measured[1]:.1f}"
    if not traced:
        heap = ""
    engine.close()
    return [engine.name, f"{cached:,}", heap, f"{grown / cached:.1f}"]


def bandwidth(page_size: int = 16, tokens: int = BANDWIDTH_TOKENS,
              repeats: int = BANDWIDTH_REPEATS) -> list[list[str]]:
    """Rows: what, MiB per layer per call, GB/s (best, median), share of memcpy (best,
    median)."""
    slots = -(-tokens * (repeats + 2) // page_size) * page_size
    device = DeviceKVPool(num_slots=slots, page_size=page_size, layers=BANDWIDTH_LAYERS,
                          layout=KV_LAYOUT, heads=BANDWIDTH_HEADS,
                          head_dim=BANDWIDTH_HEAD_DIM, dtype=DTYPE, device="cpu")
    host = HostKVPool(device, num_slots=2 * slots, layout=HOST_LAYOUT)
    # Selective write-through: the first insert backs nothing up, so the backup is timed
    # on its own.
    cache = HiRadixCache(CacheConfig(page_size=page_size,
                                     write_policy="write_through_selective"),
                         device, host, make_engine("sync", device, host),
                         clock=CountingClock())
    moved = tokens * device.bytes_per_token
    per_layer = moved / BANDWIDTH_LAYERS / 2 ** 20
    source = torch.randint(0, 255, (moved,), dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch outside the clock
    times: dict[str, list[float]] = {"memcpy": [], "backup": [], "load_back": []}
    key_tokens = Tokens(1)
    for _ in range(repeats):
        # One of each per round, so that a neighbour's burst on a shared machine hits
        # the three alike.
        start = time.perf_counter()
        target.copy_(source)
        times["memcpy"].append(time.perf_counter() - start)
        key = RadixKey(key_tokens(tokens))
        fresh = device.alloc(tokens)
        assert fresh is not None
        device.write(fresh, torch.randn(device.value_shape(tokens)).to(DTYPE))
        cache.insert(key, fresh)
        node = cache.match_prefix(key).last_device_node
        start = time.perf_counter()
        cache.write_backup(node)
        cache.writing_check()
        times["backup"].append(time.perf_counter() - start)
        cache.evict(cache.evictable_size())
        host_node = cache.match_prefix(key).last_host_node
        start = time.perf_counter()
        cache.init_load_back(host_node)
        cache.loading_check()
        times["load_back"].append(time.perf_counter() - start)
        assert cache.match_prefix(key).device_slots.numel() == tokens
    best = {name: min(t) for name, t in times.items()}
    median = {name: statistics.median(t) for name, t in times.items()}
    labels = {"memcpy": "memcpy (one contiguous copy_)",
              "backup": "backup: write_backup + writing_check",
              "load_back": "load_back: init_load_back + loading_check"}
    return [[label, f"{per_layer:.1f}", f"{moved / best[name] / 1e9:.2f}",
             f"{moved / median[name] / 1e9:.2f}", f"{best['memcpy'] / best[name]:.2f}",
             f"{median['memcpy'] / median[name]:.2f}"]
            for name, label in labels.items()]


def _print(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for row in [head, ["-" * w for w in widths], *rows]:
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


def report(page_size: int, target: int, seed: int) -> None:
    """Print the four tables (scaling, memory, key forms, bandwidth)."""
    started = time.perf_counter()
    with peers_as_shipped():
        names, rows = scaling(page_size, target, seed)
    print(f"\nScaling (page size {page_size}; median µs per call (calls); x: their time / "
          "ours, above 1 means ours is faster):")
    _print(["prefix", "cached", "operation", *names], rows)
    print(f"\nMemory per cached token (page size {page_size}; KV is {KV_BYTES} B/token per "
          "tier, not in the heap column):")
    _print(["engine", "cached tokens", "Python heap B/token", "resident growth B/token"],
           list(memory(page_size, target, seed)))
    print(f"\nA key for a {LONG_PROMPT:,}-token prompt from each form its tokens may be in "
          f"(ours, median µs of {KEY_REPEATS}; key+match: a cache holding the prompt):")
    _print(["tokens as", "key µs", "key+match µs", "matched"], key_forms(page_size))
    print("\nHost copies against memcpy (ours; one op moves "
          f"{BANDWIDTH_TOKENS} tokens of {BANDWIDTH_LAYERS} layers):")
    _print(["copy", "MiB per layer", "GB/s best", "GB/s median", "share of memcpy best",
            "share median"], bandwidth(page_size))
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":  # one row of ``memory``, in a process of its own
    print(json.dumps(_memory_of(*(int(value) for value in sys.argv[1:6]))))
