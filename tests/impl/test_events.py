"""KV events (spec/11): every emit site is needed, and INV-EVENTS-REPLAY catches a
forgotten one.

Each tour drives a conformance machine by hand through the operations that change
residency, checking after every step as a campaign does. A ``Forgetful`` log, planted
with monkeypatch where the machine attaches its sink, drops the events one site of the
implementation emits (a function of ``cache.py`` or ``storage/tier.py``), as a path
that forgets its event would; the tour must then fail naming INV-EVENTS-REPLAY. Events
reach the sink after their operation (spec/11, 11.7), so the site is taken where the
event enters the channel (``EventChannel.emit``), not where the sink is called.

The second half holds a sink that raises (issue 34) to spec/11 11.7: the operation
completes, every event is offered in order, then ``EventSinkError`` carries the result.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable

import pytest
import torch

import hiradix.conformance.events as watched
import hiradix.events
from hiradix.cache import HiRadixCache
from hiradix.conformance.machine import make_machine
from hiradix.conformance.scenario import Scenario
from hiradix.conformance.storage_machine import make_storage_machine
from hiradix.errors import EventSinkError
from hiradix.events import EventLog, KVEvent
from hiradix.keys import RadixKey

Site = tuple[str, str, str]  # (function that emits, kind, medium)
PLUMBING = ("_emit", "_set_device", "emit_pages")


def emitting_site() -> str:
    """The function that emitted the event entering the channel: the first caller of
    ``EventChannel.emit`` that is not the emit plumbing."""
    frame = sys._getframe(2)
    while frame.f_code.co_name in PLUMBING:
        assert frame.f_back is not None
        frame = frame.f_back
    return frame.f_code.co_name


def forgetful(forget: Site | None, seen: Counter[Site],
              monkeypatch: pytest.MonkeyPatch) -> type[EventLog]:
    """A log class that drops the events of ``forget``; every event's site is noted as
    it enters the channel (by identity: an event is alive until delivered)."""
    sites: dict[int, str] = {}
    emit = hiradix.events.EventChannel.emit

    def noting(channel: hiradix.events.EventChannel, event: KVEvent) -> None:
        sites[id(event)] = emitting_site()
        emit(channel, event)

    monkeypatch.setattr(hiradix.events.EventChannel, "emit", noting)

    class Forgetful(EventLog):
        def __call__(self, event: KVEvent) -> None:
            site = (sites.pop(id(event)), event.kind, event.medium)
            seen[site] += 1
            if site != forget:
                super().__call__(event)

    return Forgetful


def request(machine: object, tokens: tuple[int, ...], **changes: object) -> None:
    arguments: dict[str, object] = dict(namespace=None, dt=1, chunked=False, priority=0,
                                        keep_lock=False, quota=None)
    arguments.update(changes)
    machine.request(tokens=tokens, **arguments)  # type: ignore[attr-defined]
    machine.refines_the_model()  # type: ignore[attr-defined]


def two_tiers() -> None:
    """write_through: insert, backup and acknowledgement, evictions, a refused load (the
    insert adopts the host-only pages), a load, host eviction, reset."""
    machine = make_machine(Scenario())()
    request(machine, (1, 2, 3, 4))
    machine.finish_copies("d2h", 3)
    machine.writing_check()
    machine.refines_the_model()
    machine.evict(12)
    machine.refines_the_model()
    request(machine, (1, 2, 3, 4), quota=0)
    machine.evict(12)
    machine.refines_the_model()
    machine.load_back(index=0, quota=None)
    machine.refines_the_model()
    machine.finish_copies("h2d", 3)
    machine.loading_check()
    machine.refines_the_model()
    machine.evict(12)
    machine.evict_host(12)
    machine.refines_the_model()
    request(machine, (5, 6))
    machine.finish_copies("d2h", 3)
    machine.writing_check()  # something on host for the reset to clear
    machine.reset(go=0)
    machine.refines_the_model()


def write_back() -> None:
    """write_back: eviction copies a page to host; with the host full of a locked page's
    copy, a victim is dropped."""
    machine = make_machine(Scenario(write_policy="write_back", host_pages=2))()
    request(machine, (1, 2, 3, 4))
    machine.evict(4)
    machine.refines_the_model()
    machine = make_machine(Scenario(write_policy="write_back", host_pages=1))()
    request(machine, (1, 2), keep_lock=True)
    machine.write_backup(index=0)
    machine.refines_the_model()
    request(machine, (3, 4, 5, 6))
    machine.evict(12)
    machine.refines_the_model()


def storage(fault: str | None, end: str) -> Callable[[], None]:
    def tour() -> None:
        """A round trip through storage (written, evicted, prefetched back, inserted),
        its fetch taking ``fault`` at the first page; then ``end``: clear or detach."""
        machine = make_storage_machine(Scenario())()
        try:
            machine.cycle(request="r0", index=0, evict=24, use_anchor=False, dt=0, run=True,
                          fresh=(tuple(range(1, 9)), None),
                          fetch_fault=None if fault is None else (fault, 0))
            machine.refines_the_model()
            (machine.clear if end == "clear" else machine.detach)(go=0)
            machine.refines_the_model()
        finally:
            machine.teardown()

    return tour


TOURS: dict[str, Callable[[], None]] = {
    "two tiers": two_tiers, "write_back": write_back,
    "storage, clear": storage(None, "clear"), "storage, detach": storage(None, "detach"),
    "storage, corrupt fetch": storage("corrupt", "clear"),
}
SITES: dict[Site, str] = {
    ("_add_leaf", "stored", "device"): "two tiers",
    ("insert", "stored", "device"): "two tiers",
    ("load_back", "stored", "device"): "two tiers",
    ("_drop_device_copy", "removed", "device"): "two tiers",
    ("_acknowledge", "stored", "host"): "two tiers",
    ("_evict_host", "removed", "host"): "two tiers",
    ("reset", "cleared", "device"): "two tiers",
    ("reset", "cleared", "host"): "two tiers",
    ("_evict_write_back", "stored", "host"): "write_back",
    ("_evict_write_back", "removed", "device"): "write_back",
    ("_drop_subtree", "removed", "device"): "write_back",
    ("_insert_landed", "stored", "host"): "storage, clear",
    ("_on_backup", "stored", "storage"): "storage, clear",
    ("clear", "cleared", "storage"): "storage, clear",
    ("detach", "cleared", "storage"): "storage, detach",
    ("_on_prefetch", "removed", "storage"): "storage, corrupt fetch",
}


@pytest.mark.parametrize("tour", sorted(TOURS))
def test_each_tour_keeps_the_stream_exact(tour: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: Counter[Site] = Counter()
    monkeypatch.setattr(watched, "EventLog", forgetful(None, seen, monkeypatch))
    TOURS[tour]()
    missed = [site for site, where in SITES.items() if where == tour and not seen[site]]
    assert not missed, f"the tour never reached {missed}; it reached {dict(seen)}"


@pytest.mark.parametrize("site", sorted(SITES), ids=" ".join)
def test_a_forgotten_event_fails_the_replay(site: Site,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    seen: Counter[Site] = Counter()
    monkeypatch.setattr(watched, "EventLog", forgetful(site, seen, monkeypatch))
    with pytest.raises(AssertionError, match="INV-EVENTS-REPLAY"):
        TOURS[SITES[site]]()
    assert seen[site], f"{site} never emitted"


def test_the_public_sink_gets_one_event_per_page_root_most_first() -> None:
    log = EventLog()
    cache = HiRadixCache.create(device_slots=16, page_size=2, transfer="sync", events=log)
    assert [e.kind for e in log.take()] == ["cleared", "cleared"]  # the fresh cache's reset
    slots = cache.alloc(6)
    assert slots is not None
    cache.insert(RadixKey((1, 2, 3, 4, 5, 6)), slots)
    assert log.take() == [KVEvent("stored", "device", None, (1, 2)),
                          KVEvent("stored", "device", None, (1, 2, 3, 4)),
                          KVEvent("stored", "device", None, (1, 2, 3, 4, 5, 6))]
    cache.writing_check()  # the synchronous copy has landed: now on host
    assert [(e.kind, e.medium, len(e.tokens)) for e in log.take()] == [
        ("stored", "host", 2), ("stored", "host", 4), ("stored", "host", 6)]
    cache.evict(2)  # the whole node goes
    assert [(e.kind, e.medium, len(e.tokens)) for e in log.take()] == [
        ("removed", "device", 2), ("removed", "device", 4), ("removed", "device", 6)]


def test_without_a_sink_nothing_is_emitted() -> None:
    cache = HiRadixCache.create(device_slots=8, page_size=1, transfer="sync")
    assert cache.events is None
    slots = cache.alloc(3)
    assert slots is not None
    cache.insert(RadixKey((1, 2, 3)), slots)
    cache.writing_check()
    assert cache.evict(3) == 3
    assert torch.equal(cache.match_prefix(RadixKey((1, 2, 3))).device_slots,
                       torch.empty(0, dtype=torch.int64))


# -- a sink that raises (issue 34; spec/11, 11.7) -------------------------------------------

Prepared = Callable[[HiRadixCache], object]


def fresh(events: object) -> HiRadixCache:
    return HiRadixCache.create(device_slots=16, page_size=2, transfer="sync",
                               load_back_threshold=0, events=events)  # type: ignore[arg-type]


def cached(cache: HiRadixCache, *keys: tuple[int, ...]) -> None:
    for tokens in keys:
        match = cache.match_prefix(RadixKey(tokens))
        more = cache.alloc(len(tokens) - len(match.device_slots))
        assert more is not None
        cache.insert(RadixKey(tokens), torch.cat([match.device_slots, more]))


def on_host_only(cache: HiRadixCache) -> None:
    """Two keys cached, backed up (write_through, synchronous copies) and evicted."""
    cached(cache, (1, 2, 3, 4), (1, 2, 5, 6))
    cache.insert(RadixKey((1, 2, 3, 4)), cache.match_prefix(RadixKey((1, 2, 3, 4))).device_slots)
    cache.writing_check()
    cache.evict(16)


def insert(cache: HiRadixCache) -> object:
    slots = cache.alloc(6)
    assert slots is not None
    return cache.insert(RadixKey((1, 2, 3, 4, 5, 6)), slots)


def load(cache: HiRadixCache) -> object:
    node = max((n for n in cache.nodes() if n.device is None), key=lambda n: len(n.prefix()))
    return cache.load_back(node)


def with_storage(cache: HiRadixCache) -> None:
    from hiradix import MemoryBackend

    cache.attach_storage_backend(MemoryBackend(), "m", threaded=False)
    cached(cache, (1, 2, 3, 4))
    cache.insert(RadixKey((1, 2, 3, 4)), cache.match_prefix(RadixKey((1, 2, 3, 4))).device_slots)


def storage_write(cache: HiRadixCache) -> object:
    """The acknowledgement's host events, then the tier's storage events (S-R1)."""
    acknowledged = cache.writing_check()
    assert cache.storage is not None
    cache.storage.drain_storage_queues()
    return acknowledged


# name: (prepare, operation); every operation emits events.
OPERATIONS: dict[str, tuple[Prepared, Prepared]] = {
    "insert": (lambda c: None, insert),
    "evict": (lambda c: (cached(c, (1, 2, 3, 4), (1, 2, 5, 6)), c.writing_check()),
              lambda c: c.evict(16)),
    "writing_check": (lambda c: cached(c, (1, 2, 3, 4), (1, 2, 3, 4)),
                      lambda c: c.writing_check()),
    "load_back": (on_host_only, load),
    "evict_host": (on_host_only, lambda c: c.evict_host(16)),
    "reset": (lambda c: cached(c, (1, 2, 3, 4)), lambda c: c.reset()),
    "storage write": (with_storage, storage_write),
    "storage clear": (lambda c: (with_storage(c), storage_write(c)),
                      lambda c: c.storage.clear() if c.storage else None),
}


def snapshot(cache: HiRadixCache) -> tuple[object, ...]:
    """The state without node ids (two caches built alike compare equal)."""
    nodes = sorted((n.namespace or "", n.prefix(), None if n.device is None else
                    n.device.tolist(), None if n.host is None else n.host.tolist(),
                    n.lock_ref, n.host_ref, n.hits) for n in cache.nodes())
    return (nodes, sorted(cache.device_pool.free_slots()), sorted(cache.host_pool.free_slots()),
            {d: len(q) for d, q in cache.pending.items()}, cache.evictable_size(),
            cache.protected_size())


def plain(result: object) -> object:
    """A result comparable with ``==`` (a tensor as its list)."""
    return result.tolist() if isinstance(result, torch.Tensor) else result


class Raising(EventLog):
    """Logs every event offered to it, and raises ``error`` on the ``at``-th (from 0;
    -1: never)."""

    def __init__(self, at: int, error: BaseException) -> None:
        super().__init__()
        self.at, self.error = at, error

    def __call__(self, event: KVEvent) -> None:
        super().__call__(event)
        if len(self.events) - 1 == self.at:
            raise self.error


def reference(name: str) -> tuple[object, list[KVEvent], tuple[object, ...]]:
    """The operation's result, events and state with a sink that does not raise."""
    prepare, operation = OPERATIONS[name]
    log = EventLog()
    cache = fresh(log)
    prepare(cache)
    log.take()
    result = operation(cache)
    cache.check_invariants()
    return result, log.take(), snapshot(cache)


@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_a_raising_sink_gets_every_event_and_a_typed_error_after_the_operation(
        name: str, where: str) -> None:
    """The operation completes (the same state and result as with a quiet sink), every
    event is still offered in order, then EventSinkError carries the result with the
    sink's exception as its cause."""
    result, events, state = reference(name)
    assert events, f"{name} emits nothing: the row tests nothing"
    sink = Raising(-1, OSError("socket gone"))  # quiet while the cache is prepared
    cache = fresh(sink)
    prepare, operation = OPERATIONS[name]
    prepare(cache)
    sink.take()
    sink.at = 0 if where == "first" else len(events) - 1
    with pytest.raises(EventSinkError) as raised:
        operation(cache)
    assert raised.value.__cause__ is sink.error
    assert plain(raised.value.result) == plain(result)
    assert (raised.value.failures, raised.value.offered) == (1, len(events))
    assert sink.take() == events
    assert snapshot(cache) == state
    cache.check_invariants()


@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_a_keyboard_interrupt_from_the_sink_comes_after_the_state_is_whole(name: str) -> None:
    """A BaseException propagates at once; the state is the completed operation's, and
    the operation's events after the one that raised are dropped (spec/11, 11.7)."""
    _, events, state = reference(name)
    sink = Raising(-1, KeyboardInterrupt())
    cache = fresh(sink)
    prepare, operation = OPERATIONS[name]
    prepare(cache)
    sink.take()
    sink.at = 0
    with pytest.raises(KeyboardInterrupt):
        operation(cache)
    assert sink.take() == events[:1]
    assert snapshot(cache) == state
    cache.check_invariants()
    sink.at = -1  # quiet again: the next operation's events all arrive
    cache.evict(16)
    cache.check_invariants()


def test_the_sink_is_checked_wherever_it_is_set() -> None:
    from hiradix import ConfigError

    with pytest.raises(ConfigError) as raised:
        fresh(5)
    assert raised.value.argument == "events"
    log = EventLog()
    cache = fresh(log)
    before = snapshot(cache)
    with pytest.raises(ConfigError) as raised:
        cache.events = 5  # type: ignore[assignment]
    assert raised.value.argument == "events"
    assert cache.events is log and snapshot(cache) == before
    with pytest.raises(ConfigError) as raised:
        HiRadixCache(cache.config, cache.device_pool, cache.host_pool, cache.engine,
                     events="sink")  # type: ignore[arg-type]
    assert raised.value.argument == "events"
    insert(cache)  # the refused assignment left a working cache
    cache.check_invariants()


def test_a_sink_raising_at_creation_hands_over_the_built_cache() -> None:
    sink = Raising(0, RuntimeError("not yet connected"))
    with pytest.raises(EventSinkError) as raised:
        fresh(sink)
    cache = raised.value.result
    assert isinstance(cache, HiRadixCache) and cache.events is sink
    assert [e.kind for e in sink.take()] == ["cleared", "cleared"]
    sink.at = -1
    insert(cache)
    cache.check_invariants()


def test_an_operation_the_sink_runs_queues_its_events_behind_the_current_ones() -> None:
    """A sink that calls the cache (a router probing it) does not reorder the stream."""
    seen: list[KVEvent] = []
    cache = fresh(None)

    def probing(event: KVEvent) -> None:
        seen.append(event)
        if event.kind == "stored" and event.medium == "device" and len(event.tokens) == 2:
            cache.writing_check()  # runs during delivery: its events come after these

    cache.events = probing
    insert(cache)
    assert [(e.kind, e.medium) for e in seen] == [("stored", "device")] * 3 + [
        ("stored", "host")] * 3
    cache.check_invariants()
