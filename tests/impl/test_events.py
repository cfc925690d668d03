"""KV events (spec/11): every emit site is needed, and INV-EVENTS-REPLAY catches a
forgotten one.

Each tour drives a conformance machine by hand through the operations that change
residency, checking after every step as a campaign does. A ``Forgetful`` log, planted
with monkeypatch where the machine attaches its sink, drops the events one site of the
implementation emits (a function of ``cache.py`` or ``storage/tier.py``), as a path
that forgets its event would; the tour must then fail naming INV-EVENTS-REPLAY.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable

import pytest
import torch

import hiradix.conformance.events as watched
from hiradix.cache import HiRadixCache
from hiradix.conformance.machine import make_machine
from hiradix.conformance.scenario import Scenario
from hiradix.conformance.storage_machine import make_storage_machine
from hiradix.events import EventLog, KVEvent
from hiradix.keys import RadixKey

Site = tuple[str, str, str]  # (function that emits, kind, medium)
PLUMBING = ("_emit", "_set_device")


def emitting_site() -> str:
    """The function that emitted the event being logged: the first caller of the sink
    that is not the emit plumbing."""
    frame = sys._getframe(2)
    while frame.f_code.co_name in PLUMBING:
        assert frame.f_back is not None
        frame = frame.f_back
    return frame.f_code.co_name


def forgetful(forget: Site | None, seen: Counter[Site]) -> type[EventLog]:
    class Forgetful(EventLog):
        def __call__(self, event: KVEvent) -> None:
            site = (emitting_site(), event.kind, event.medium)
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
    monkeypatch.setattr(watched, "EventLog", forgetful(None, seen))
    TOURS[tour]()
    missed = [site for site, where in SITES.items() if where == tour and not seen[site]]
    assert not missed, f"the tour never reached {missed}; it reached {dict(seen)}"


@pytest.mark.parametrize("site", sorted(SITES), ids=" ".join)
def test_a_forgotten_event_fails_the_replay(site: Site,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    seen: Counter[Site] = Counter()
    monkeypatch.setattr(watched, "EventLog", forgetful(site, seen))
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
