"""One corruption per flat-tier invariant (spec/15, 15.5.4), applied to ``healthy()``.

``healthy()`` is a small reachable state: a 4-token key A stored (two chunks, both
layers, both tiers), a live lookup pinning A's first chunk on the CPU tier, then a
2-token key B stored, for which the CPU tier evicted A's unpinned second chunk (the disk
tier keeps it). Each corruption breaks exactly what its ID forbids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from hiradix_model import Key
from hiradix_model import flat as F

CONFIG = F.FlatConfig(chunk_tokens=2, layers=2, cpu_objects=4, disk_objects=6)
A = Key((1, 2, 3, 4))
A1 = Key((1, 2))
B = Key((5, 6))


def put(state: F.FlatState, key: Key) -> F.FlatState:
    """``key`` stored, its disk writes landing in put order."""
    return F.store(state, key, F.in_put_order(state, key))[0]


def healthy() -> F.FlatState:
    s = put(F.initial(CONFIG), A)
    s, _ = F.lookup(s, A1, True, "held")
    return put(s, B)


def _entry(s: F.FlatState, tier: F.Tier, obj: F.Obj, **changes: object) -> F.FlatState:
    entries = dict(s.cpu if tier == "cpu" else s.disk)
    entries[obj] = replace(entries[obj], **changes)  # type: ignore[arg-type]
    return replace(s, cpu=entries) if tier == "cpu" else replace(s, disk=entries)


def repeated_tick(s: F.FlatState) -> F.FlatState:
    # Two disk objects with one recency: the LRU order between them is undefined.
    return _entry(s, "disk", F.Obj(B, 1), tick=s.disk[F.Obj(B, 0)].tick)


def over_capacity(s: F.FlatState) -> F.FlatState:
    # A put that forgot to evict: a seventh object on a disk tier of six.
    extra = F.Obj(Key((7, 8)), 0)
    return replace(s, disk={**s.disk, extra: F.Entry(tick=s.clock, content=extra.chunk)},
                   clock=s.clock + 1)


def pin_nobody_holds(s: F.FlatState) -> F.FlatState:
    # A lookup pinned B's layer 0 without recording it (DEV-L4's shape).
    return _entry(s, "cpu", F.Obj(B, 0), pins=1)


def pin_on_an_evicted_object(s: F.FlatState) -> F.FlatState:
    # A lookup still holding a pin on a CPU object the CPU tier no longer has.
    pins = (*s.lookups["held"], F.Pin("cpu", F.Obj(Key((1, 2, 3, 4)), 0)))
    return replace(s, lookups={"held": pins})


def leaked_staging(s: F.FlatState) -> F.FlatState:
    # A staging buffer never freed (DEV-L1's shape).
    return replace(s, allocations=s.allocations + 1)


def wrong_bytes(s: F.FlatState) -> F.FlatState:
    # The disk file of A's second chunk holding B's KV.
    return _entry(s, "disk", F.Obj(A, 0), content=B)


FLAT_MUTANTS: dict[str, Callable[[F.FlatState], F.FlatState]] = {
    "INV-FLAT-WELL-FORMED": repeated_tick,
    "INV-FLAT-CAPACITY": over_capacity,
    "INV-FLAT-PINS-HELD": pin_nobody_holds,
    "INV-FLAT-PINS-RESIDENT": pin_on_an_evicted_object,
    "INV-FLAT-ALLOCATIONS": leaked_staging,
    "INV-FLAT-CONTENT": wrong_bytes,
}
