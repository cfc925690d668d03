"""``hiradix show``: draw a demo cache, or the cache a trace (spec/08) leads to.

The pictures come from ``hiradix.render``; this module sits in the conformance layer
because replaying a trace reads it with the model's trace parser.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from hiradix.cache import HiRadixCache
from hiradix.clock import ManualClock
from hiradix.config import CacheConfig
from hiradix.conformance.outputs import (
    BadCommandLine,
    OneLineParser,
    UnwritableOutput,
    check_file,
)
from hiradix.device_pool import DeviceKVPool
from hiradix.errors import HiradixError
from hiradix.host_pool import HostKVPool
from hiradix.keys import RadixKey, child_key, pack
from hiradix.render import render_svg, render_text
from hiradix.storage.memory import MemoryBackend
from hiradix.storage.tier import StorageTier, TierSettings
from hiradix.transfer import make_engine
from hiradix.tree import TreeNode
from hiradix_model import trace
from hiradix_model.trace import TraceFormatError


def _build(page_size: int, device_slots: int, host_slots: int, write_policy: str = "write_through",
           eviction: str = "lru", load_back_threshold: int = 0,
           clock: ManualClock | None = None) -> HiRadixCache:
    device = DeviceKVPool(num_slots=device_slots, page_size=page_size, layers=2, layout="mha",
                          heads=2, head_dim=2, dtype=torch.float16, device="cpu")
    host = HostKVPool(device, num_slots=host_slots, layout="layer_first")
    config = CacheConfig(page_size=page_size, write_policy=write_policy,  # type: ignore[arg-type]
                         eviction=eviction,  # type: ignore[arg-type]
                         load_back_threshold=load_back_threshold)
    return HiRadixCache(config, device, host, make_engine("sync", device, host),
                        clock=clock or ManualClock(1))


def _cache_tokens(cache: HiRadixCache, tokens: Sequence[int],
                  namespace: str | None = None) -> TreeNode:
    """Insert ``tokens`` with fresh device slots as a scheduler would; return the node
    that ends the key."""
    key = RadixKey(tuple(tokens), namespace)
    got = cache.match_prefix(key)
    cached = len(got.device_slots)
    new = cache.device_pool.alloc(len(tokens) - cached)
    assert new is not None, "the demo cache is sized to fit"
    cache.insert(key, torch.cat([got.device_slots, new]))
    return cache.match_prefix(key).last_device_node


def demo(storage: bool = True) -> tuple[HiRadixCache, StorageTier | None]:
    """A small cache that shows every kind of node: shared prefixes on device and host,
    a host-only branch (evicted), a locked request, a host-protected page (a storage
    write in flight) and, with ``storage``, pages backed up to a memory backend."""
    clock = ManualClock(1)
    # write_through_selective: pages are backed up at their second hit, so the newest
    # request's pages are still device-only.
    cache = _build(page_size=2, device_slots=32, host_slots=48,
                   write_policy="write_through_selective", clock=clock)
    tier = None
    if storage:
        tier = StorageTier(cache)
        tier.attach(MemoryBackend(), "demo-model", TierSettings(prefetch_threshold=2),
                    threaded=False)
    system = (1, 2, 3, 4, 5, 6)
    _cache_tokens(cache, (*system, 11, 12, 13, 14))
    _cache_tokens(cache, (*system, 21, 22))
    old = _cache_tokens(cache, (7, 8, 9, 10, 31, 32))
    _cache_tokens(cache, (7, 8, 9, 10, 31, 32))  # a second hit: backed up
    _cache_tokens(cache, (*system, 11, 12, 41, 42, 43, 44), namespace=None)
    (tier or cache).writing_check()
    if tier is not None:
        assert tier.io is not None
        tier.io.run_pending()
        tier.drain_storage_queues()
    clock.advance(1)  # the older requests become the least recently used
    _cache_tokens(cache, (*system, 21, 22, 51, 52))
    _cache_tokens(cache, (1, 2, 3, 4), namespace="lora-a")
    cache.inc_lock_ref(cache.match_prefix(RadixKey((*system, 21, 22, 51, 52))).last_device_node)
    # Evict the oldest request's pages: they stay on host only.
    free = cache.device_pool.num_free_slots
    cache.evict(len(old.prefix()) + max(0, 4 - free))
    (tier or cache).writing_check()
    if tier is not None:
        # One more request backed up but its write not yet drained: host-protected.
        _cache_tokens(cache, (*system, 61, 62))
        _cache_tokens(cache, (*system, 61, 62))
        tier.writing_check()
    _cache_tokens(cache, (*system, 71, 72, 73, 74))  # one hit: device only
    return cache, tier


def replay_on_impl(path: str) -> tuple[HiRadixCache, list[str]]:
    """Apply a trace's operations (spec/08) to a fresh implementation cache, making our
    own choices (slots, victims); return the cache and notes on what was skipped or
    refused. A picture of where the trace leads, not a check: ``hiradix replay`` checks."""
    notes: list[str] = []
    with trace.open_trace(path) as handle:
        config, _, steps = trace.read(trace.bounded_lines(handle))
        if config.host_slots == 0:
            raise ValueError("a trace without a host tier (host_slots 0) is not drawn")
        cache = _build(config.page_size, config.device_slots, config.host_slots,
                       config.write_policy, config.eviction, config.load_back_threshold)
        slots: dict[int, int] = {}  # the trace's device slot -> ours
        for number, step in steps:
            refusal = _apply(cache, step.op, step.args, slots)
            if refusal:
                notes.append(f"{path}:{number}: {step.op}: {refusal}")
    return cache, notes


def _node_at(cache: HiRadixCache, page: dict[str, object] | None) -> TreeNode:
    """The node holding the last token of a page key from a trace (the root for None)."""
    node = cache.root
    if page is None:
        return node
    tokens = tuple(page["tokens"])  # type: ignore[arg-type]
    namespace = page["namespace"]
    position = 0
    while position < len(tokens):
        child = node.children.get(child_key(namespace, pack(tokens), position,  # type: ignore[arg-type]
                                            cache.page_size))
        if child is None:
            raise ValueError("page not cached here")
        node = child
        position += len(child.tokens)
    return node


def _apply(cache: HiRadixCache, op: str, args: dict[str, object],
           slots: dict[int, int]) -> str | None:
    """One trace step on the implementation; a note if it was skipped or refused."""
    def key(value: object) -> RadixKey:
        assert isinstance(value, dict)
        return RadixKey(tuple(value["tokens"]), value["namespace"])

    try:
        if op == "match_prefix":
            cache.match_prefix(key(args["key"]))
        elif op == "alloc":
            wanted = list(args["slots"])  # type: ignore[call-overload]
            got = cache.device_pool.alloc(len(wanted))
            if got is None:
                return "no free device slots here"
            slots.update(zip(wanted, got.tolist(), strict=True))
        elif op == "free":
            mine = [slots.pop(s) for s in args["slots"] if s in slots]  # type: ignore[attr-defined]
            if mine:
                cache.device_pool.free(torch.tensor(mine, dtype=torch.int64))
        elif op == "insert":
            mapped = [slots.get(s, -1) for s in args["slots"]]  # type: ignore[attr-defined]
            if -1 in mapped:
                return "slots not allocated here"
            cache.insert(key(args["key"]), torch.tensor(mapped, dtype=torch.int64),
                         priority=int(args.get("priority", 0)),  # type: ignore[call-overload]
                         chunked=bool(args.get("chunked", False)),
                         counted_from=int(args.get("counted_from", 0)))  # type: ignore[call-overload]
        elif op in ("inc_lock_ref", "dec_lock_ref"):
            getattr(cache, op)(_node_at(cache, args["page"]))  # type: ignore[arg-type]
        elif op == "evict":
            cache.evict(int(args["num_tokens"]))  # type: ignore[call-overload]
        elif op == "evict_host":
            cache.evict_host(int(args["num_tokens"]))  # type: ignore[call-overload]
        elif op == "write_backup":
            cache.write_backup(_node_at(cache, args["page"]))  # type: ignore[arg-type]
        elif op == "writing_check":
            cache.writing_check()
        elif op == "loading_check":
            cache.loading_check()
        elif op in ("load_back", "init_load_back"):
            getattr(cache, op)(_node_at(cache, args["page"]), args["mem_quota"])  # type: ignore[arg-type]
        elif op == "reset":
            cache.reset()
            slots.clear()
        else:
            return "not an operation of the cache (skipped)"
    except (HiradixError, ValueError) as refused:
        return f"refused here: {refused}"
    return None


def show_main(argv: Sequence[str] | None = None) -> int:
    """``hiradix show [TRACE] [--svg FILE] [--no-storage]``: draw the demo cache, or the
    cache a trace leads to, as text (stdout) or SVG (a file)."""
    parser = OneLineParser(prog="hiradix show",
                                     description="draw a cache's tree by tier")
    parser.add_argument("trace", nargs="?", help="a JSONL trace (spec/08) to replay on the "
                                                 "implementation; default: a demo cache")
    parser.add_argument("--svg", default=None, help="write an SVG picture here")
    parser.add_argument("--no-storage", action="store_true",
                        help="the demo without a storage tier")
    try:  # before any work: not a traceback after the replay
        args = parser.parse_args(argv)
        check_file("--svg", args.svg)
    except BadCommandLine as usage:
        print(usage, file=sys.stderr)
        return 2
    except UnwritableOutput as unwritable:
        print(f"hiradix show: {unwritable}", file=sys.stderr)
        return 2
    tier: StorageTier | None = None
    if args.trace is None:
        cache, tier = demo(storage=not args.no_storage)
    else:
        try:
            cache, notes = replay_on_impl(args.trace)
        except TraceFormatError as broken:
            print(f"{args.trace}:{broken.line}: {broken.reason}", file=sys.stderr)
            return 2
        except (OSError, UnicodeDecodeError, ValueError) as unreadable:
            print(f"{args.trace}:0: {unreadable}", file=sys.stderr)
            return 2
        for note in notes[:20]:
            print(note, file=sys.stderr)
        if len(notes) > 20:
            print(f"({len(notes) - 20} more notes)", file=sys.stderr)
    if args.svg:
        with open(args.svg, "w", encoding="utf-8") as handle:
            handle.write(render_svg(cache, tier))
        print(f"(tree of {len(cache.nodes())} nodes written to {args.svg})")
    else:
        print(render_text(cache, tier), end="")
    return 0


__all__ = ["demo", "replay_on_impl", "show_main"]
