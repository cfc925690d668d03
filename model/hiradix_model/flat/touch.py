"""Recency and pin updates the flat-tier operations share (spec/15, 15.5.3)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from hiradix_model.flat.state import Entry, FlatState, Obj, Pin, Tier


def touched(state: FlatState, tier: Tier, order: Iterable[Obj]) -> FlatState:
    """``tier``'s objects in ``order`` made most recent, the last the most recent of all."""
    entries = dict(state.cpu if tier == "cpu" else state.disk)
    clock = state.clock
    for obj in order:
        entries[obj] = replace(entries[obj], tick=clock)
        clock += 1
    return _with(state, tier, entries, clock)


def pinned(state: FlatState, pins: Iterable[Pin], delta: int) -> FlatState:
    """Each pin's object's pin count moved by ``delta``; an object no longer resident is
    passed over, as LMCache's unpin of a key it lacks (local_cpu_backend.py:266-272)."""
    cpu: dict[Obj, Entry] = dict(state.cpu)
    disk: dict[Obj, Entry] = dict(state.disk)
    for pin in pins:
        entries = cpu if pin.tier == "cpu" else disk
        if pin.obj in entries:
            entries[pin.obj] = replace(entries[pin.obj], pins=entries[pin.obj].pins + delta)
    return replace(state, cpu=cpu, disk=disk)


def _with(state: FlatState, tier: Tier, entries: Mapping[Obj, Entry], clock: int
          ) -> FlatState:
    if tier == "cpu":
        return replace(state, cpu=entries, clock=clock)
    return replace(state, disk=entries, clock=clock)
