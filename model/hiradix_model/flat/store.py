"""store (spec/15, 15.5.3): write-through of a key's new chunks to both tiers.

Two phases, as LMCache's layerwise store runs them (cache_engine.py:669-797): the
allocation phase reserves CPU allocations chunk by chunk, evicting whole chunks from the
CPU tier, and stops at the first chunk it cannot place; the put phase then puts each
layer's objects on the CPU tier and on the disk tier, which evicts object by object or
skips an object it has no room for. The one nondeterministic choice is the order in
which a layer's disk writes finish (``arrivals``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hiradix_model.component_args import require, require_key
from hiradix_model.errors import IllegalChoice, PreconditionError
from hiradix_model.flat.invariants import check  # noqa: F401 (contracts)
from hiradix_model.flat.state import Entry, FlatState, Obj, chunks, lru, objects
from hiradix_model.keys import Key


@dataclass(frozen=True)
class StoreResult:
    """What a store did."""

    stored: tuple[Key, ...]  # the chunks that got allocations, in order
    cpu_victims: tuple[Key, ...]  # chunks evicted from the CPU tier, in order
    disk_victims: tuple[Obj, ...]  # objects evicted from the disk tier, in order
    disk_skipped: tuple[Obj, ...]  # objects the disk tier had no room for


@dataclass(frozen=True)
class _Plan:
    """The allocation phase's outcome."""

    cpu: dict[Obj, Entry]
    stored: tuple[Key, ...]
    victims: tuple[Key, ...]


def _cpu_victim(state: FlatState, cpu: dict[Obj, Entry]) -> Key | None:
    """The chunk of the least recently used unpinned CPU object whose every layer is on
    the CPU tier unpinned (local_cpu_backend.py:800-845); None if there is none."""
    for obj in lru(cpu):
        if cpu[obj].pins:
            continue
        if all(o in cpu and cpu[o].pins == 0 for o in objects(state, obj.chunk)):
            return obj.chunk
    return None


def _plan(state: FlatState, key: Key) -> _Plan:
    """The allocation phase (cache_engine.py:680-725)."""
    layers, capacity = state.config.layers, state.config.cpu_objects
    cpu = dict(state.cpu)
    stored: list[Key] = []
    victims: list[Key] = []
    for chunk in chunks(state, key):
        first = Obj(chunk, 0)
        if first in cpu or first in state.disk:  # only layer 0 is looked at (:695-700)
            continue
        while capacity - (len(cpu) + layers * len(stored)) < layers:
            victim = _cpu_victim(state, cpu)
            if victim is None:  # "choosing to not store": this chunk and the rest (:714)
                return _Plan(cpu, tuple(stored), tuple(victims))
            for obj in objects(state, victim):
                del cpu[obj]
            victims.append(victim)
        stored.append(chunk)
    return _Plan(cpu, tuple(stored), tuple(victims))


def store_plan(state: FlatState, key: Key) -> tuple[Key, ...]:
    """The chunks a store of ``key`` would allocate and put. Changes nothing."""
    require_key(key)
    return _plan(state, key).stored


class _Race(Exception):
    """A disk put whose outcome depends on which of its layer's writes have finished."""


def _disk_layer(state: FlatState, disk: dict[Obj, Entry], stored: Sequence[Key], layer: int,
                clock: int) -> tuple[int, list[Obj], list[Obj], list[Obj], list[Obj]]:
    """One layer's disk puts (local_disk_backend.py:333-437): the clock after them, the
    objects touched, admitted, evicted and skipped. Admitted objects are not in ``disk``
    yet: they enter it when their writes finish."""
    capacity = state.config.disk_objects
    start = clock
    touched: list[Obj] = []
    admitted: list[Obj] = []
    evicted: list[Obj] = []
    skipped: list[Obj] = []
    for chunk in stored:
        obj = Obj(chunk, layer)
        if obj in disk:  # on disk already: touched, not written again (:352-355)
            disk[obj] = replace(disk[obj], tick=clock)
            clock += 1
            touched.append(obj)
            continue
        need = len(disk) + len(admitted) + 1 - capacity
        if need > 0:
            evictable = [o for o in lru(disk) if disk[o].pins == 0]
            older = [o for o in evictable if disk[o].tick < start]
            if admitted and len(older) < need:
                raise _Race(f"{obj} must evict {need} while {admitted} may have landed")
            if len(evictable) < need:  # a partial store (:386-403)
                skipped.append(obj)
                continue
            for victim in evictable[:need]:  # least recently used first (:405-418)
                del disk[victim]
                evicted.append(victim)
        admitted.append(obj)
    return clock, touched, admitted, evicted, skipped


def _land(disk: dict[Obj, Entry], touched: list[Obj], admitted: list[Obj],
          order: Sequence[Obj], layer: int, clock: int) -> int:
    """Give the layer's touched and written objects their recency in ``order``, the
    order the engine reports; ``IllegalChoice`` unless the writes allow it: touches in
    put order, and a write after the touch of every earlier chunk (it is submitted after
    them, local_disk_backend.py:428-437)."""
    kept = [o for o in touched if o in disk]
    if len(order) != len(kept) + len(admitted) or set(order) != set(kept) | set(admitted):
        raise IllegalChoice(f"arrivals[{layer}]: {list(order)} are not the layer's touched "
                            f"and written objects {kept + admitted}")
    if [o for o in order if o in kept] != kept:
        raise IllegalChoice(f"arrivals[{layer}]: the touched objects out of put order")
    position = {obj: index for index, obj in enumerate(order)}
    for obj in admitted:
        for earlier in kept:  # chunks of one key are put shortest first
            if (len(earlier.chunk.tokens) < len(obj.chunk.tokens)
                    and position[earlier] > position[obj]):
                raise IllegalChoice(f"arrivals[{layer}]: {obj} lands before the touch of "
                                    f"{earlier}, put earlier")
    for obj in order:
        previous = disk.get(obj)
        disk[obj] = Entry(tick=clock, pins=previous.pins if previous else 0,
                          content=previous.content if previous else obj.chunk)
        clock += 1
    return clock


def store_races(state: FlatState, key: Key) -> bool:
    """Whether a store of ``key`` reaches a disk put whose outcome depends on which of
    its layer's writes have finished (not yet specified: ``store`` refuses it)."""
    require_key(key)
    try:
        _put_all(state, key, None)
    except _Race:
        return True
    return False


def in_put_order(state: FlatState, key: Key) -> tuple[tuple[Obj, ...], ...]:
    """The ``arrivals`` of a store of ``key`` whose disk writes land in put order (one
    writer thread), for callers that make the choice themselves. Changes nothing.
    ``PreconditionError`` where the store races (``store_races``)."""
    require_key(key)
    try:
        return _put_all(state, key, None)[2]
    except _Race as race:
        raise PreconditionError("key", f"a disk put races its own layer's writes ({race})"
                                ) from None


def _put_all(state: FlatState, key: Key, arrivals: Sequence[Sequence[Obj]] | None
             ) -> tuple[FlatState, StoreResult, tuple[tuple[Obj, ...], ...]]:
    """The put phase after the allocation phase; ``arrivals`` None: every write lands
    in put order. Also the arrivals used."""
    plan = _plan(state, key)
    used: list[tuple[Obj, ...]] = []
    cpu, disk, clock = plan.cpu, dict(state.disk), state.clock
    inserted = 0
    victims: list[Obj] = []
    skipped: list[Obj] = []
    for layer in range(state.config.layers):
        for chunk in plan.stored:  # the CPU tier first (storage_manager.py:412-431)
            obj = Obj(chunk, layer)
            if obj not in cpu:  # present: skipped, untouched (local_cpu_backend.py:164)
                cpu[obj] = Entry(tick=clock, content=chunk)
                clock += 1
                inserted += 1
        clock, touched, admitted, evicted, skip = _disk_layer(state, disk, plan.stored,
                                                              layer, clock)
        victims += evicted
        skipped += skip
        order = (tuple(arrivals[layer]) if arrivals is not None
                 else tuple([o for o in touched if o in disk] + admitted))
        clock = _land(disk, touched, admitted, order, layer, clock)
        used.append(order)
    # Every allocation the CPU tier did not take is freed (storage_manager.py:433-435).
    allocations = state.allocations - state.config.layers * len(plan.victims) + inserted
    after = replace(state, cpu=cpu, disk=disk, allocations=allocations, clock=clock)
    result = StoreResult(plan.stored, plan.victims, tuple(victims), tuple(skipped))
    return after, result, tuple(used)


def store(state: FlatState, key: Key,
          arrivals: Sequence[Sequence[Obj]]) -> tuple[FlatState, StoreResult]:
    """Store ``key``'s full chunks that neither tier has (layer 0 decides), write-through
    to both tiers. ``arrivals[l]``: the order in which layer ``l``'s touched and newly
    written disk objects that are still on disk took their recency.

    pre: not check(state)
    post: not check(__return__[0])
    post: set(__return__[1].stored) <= set(chunks(state, key))
    raises: PreconditionError, IllegalChoice
    """
    require_key(key)
    layers = state.config.layers
    require(isinstance(arrivals, (list, tuple)) and len(arrivals) == layers
            and all(isinstance(order, (list, tuple))
                    and all(isinstance(o, Obj) for o in order) for order in arrivals),
            "arrivals", f"must be {layers} sequences of objects, one per layer")
    try:
        after, result, _ = _put_all(state, key, arrivals)
        return after, result
    except _Race as race:
        raise PreconditionError("key", f"a disk put races its own layer's writes ({race}): "
                                "not yet specified (spec/15 15.5.3)") from None
