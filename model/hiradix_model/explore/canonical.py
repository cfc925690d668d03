"""The canonical form of a state (spec/14-exploration.md, 14.2).

Two states with the same canonical form behave alike: the same operations are enabled
with the same arguments, their successors have equal canonical forms, and every invariant
gives the same verdict. The form applies four reductions, each argued in spec/14:

* slot renaming (pool symmetry): device and host pages are renumbered in the order a
  fixed walk of the state first meets them; free pages become a count;
* tick order: logical ticks become their rank among the ticks the model still reads;
* saturation: ``hits`` is cut at the highest threshold the configuration reads (not
  under LFU, which compares hits between pages), ``priority`` dropped unless the
  strategy reads it;
* dead data: the KV of free slots and of copies' destinations, never read before it is
  overwritten, is dropped; so is the tick a strategy never reads, kept only as whether
  INV-CLOCK-MONOTONE holds for it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

from hiradix_model.keys import Key, sort_key
from hiradix_model.state import State, in_flight
from hiradix_model.strategies import SLRU_PROTECTED_HITS

Renaming = dict[int, int]


def _rename_pages(order: Iterable[int], ps: int) -> Renaming:
    """Slot -> new slot, renaming whole pages in first-seen order of ``order``'s slots;
    the offset inside a page is kept, so R7 (whole pages in order) is preserved."""
    page_of: dict[int, int] = {}
    for slot in order:
        page_of.setdefault(slot // ps, len(page_of))
    return {page * ps + offset: new * ps + offset
            for page, new in page_of.items() for offset in range(ps)}


def _content(kv: Mapping[int, Key], slots: Iterable[int]) -> tuple[tuple[object, ...], ...]:
    """A sortable signature of the KV ``slots`` hold (None first)."""
    return tuple(() if kv.get(s) is None else (sort_key(kv[s]),) for s in slots)


def _held_pages(state: State) -> list[tuple[int, ...]]:
    """Held device pages, ordered by what they hold: pages with equal contents are
    interchangeable, so any order among them gives the same form."""
    ps = state.config.page_size
    starts = sorted({s - s % ps for s in state.held})
    pages = [tuple(range(start, start + ps)) for start in starts]
    return sorted(pages, key=lambda slots: _content(state.device_kv, slots))


def renamings(state: State, keys: list[Key]) -> tuple[Renaming, Renaming]:
    """The device and host slot renamings of ``state`` (pages in ``keys`` order)."""
    ps = state.config.page_size
    device: list[int] = []
    host: list[int] = []
    for key in keys:
        page = state.pages[key]
        device.extend(page.device or ())
        host.extend(page.host or ())
    for transfer in state.pending:
        device.extend(transfer.src if transfer.direction == "d2h" else transfer.dst)
        host.extend(transfer.dst if transfer.direction == "d2h" else transfer.src)
    for slots in _held_pages(state):
        device.extend(slots)
    # Slots owned by nobody and not free break pool conservation; name them all the same.
    device.extend(sorted(set(range(state.config.device_slots)) - state.device_free))
    host.extend(sorted(set(range(state.config.host_slots)) - state.host_free))
    device.extend(sorted(state.device_free))
    host.extend(sorted(state.host_free))
    return _rename_pages(device, ps), _rename_pages(host, ps)


def _hits_cap(state: State) -> int | None:
    """The highest hit count the configuration tells apart; None: all (LFU)."""
    config = state.config
    if config.eviction == "lfu":
        return None
    caps = [config.write_through_threshold or 0]
    if config.eviction == "slru":
        caps.append(SLRU_PROTECTED_HITS)
    return max(caps)


def canonical(state: State) -> Hashable:
    """The canonical form of ``state`` (spec/14, 14.2); storage and events are out of
    scope and must be absent."""
    assert state.storage is None and not state.events, "storage and events are out of scope"
    config = state.config
    keys = sorted(state.pages, key=sort_key)
    dev, host = renamings(state, keys)
    reads_last = config.eviction not in ("fifo", "filo")
    reads_insert = config.eviction in ("fifo", "filo")
    ticks = {state.clock}
    for page in state.pages.values():
        if reads_last:
            ticks.add(page.last_tick)
        if reads_insert:
            ticks.add(page.insert_tick)
    rank = {tick: index for index, tick in enumerate(sorted(ticks))}
    cap = _hits_cap(state)
    reads_priority = config.eviction == "priority"
    pages = []
    for key in keys:
        page = state.pages[key]
        # The unread tick only matters to INV-CLOCK-MONOTONE: keep whether it holds.
        monotone = page.insert_tick <= page.last_tick <= state.clock
        pages.append((
            key,
            None if page.device is None else tuple(dev[s] for s in page.device),
            None if page.host is None else tuple(host[s] for s in page.host),
            page.lock, page.host_protect,
            page.hits if cap is None else min(page.hits, cap),
            rank[page.last_tick] if reads_last else monotone,
            rank[page.insert_tick] if reads_insert else monotone,
            page.priority if reads_priority else 0,
        ))
    dead_device = state.device_free | in_flight(state, "h2d")
    dead_host = state.host_free | in_flight(state, "d2h")
    device_kv = tuple(sorted((dev[s], sort_key(k)) for s, k in state.device_kv.items()
                             if s not in dead_device and s in dev))
    host_kv = tuple(sorted((host[s], sort_key(k)) for s, k in state.host_kv.items()
                           if s not in dead_host and s in host))
    pending = tuple(
        (t.direction, t.pages, t.lock,
         tuple((dev if t.direction == "d2h" else host)[s] for s in t.src),
         tuple((host if t.direction == "d2h" else dev)[s] for s in t.dst))
        for t in state.pending)
    held = tuple(sorted(dev[s] for s in state.held))
    return (tuple(pages), len(state.device_free), len(state.host_free), held, device_kv,
            host_kv, pending, rank[state.clock], state.evictable_tokens,
            state.protected_tokens)
