"""The engine's choices, recovered from its state before and after one call.

The model checks nondeterministic choices; it does not make them (spec/03, "Choices").
An engine without a recorder of its decisions still shows them in its state: the pages
that left the device, the host slots a backup took, the device slots a load got. These
functions turn a pair of observed states into the model's choice arguments. They order
victims the way the spec allows -- minimal rank first, ties resolved in favour of the
previous victim's parent (DEV-10) -- and leave the judgement to the model: a set of
victims no legal order explains is passed on as it is, and the model rejects it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

from hiradix_model import Backup, Key, State, Victim
from hiradix_model.keys import page_keys, parent_page, sort_key
from hiradix_model.state import Page, device_evictable_leaves, host_evictable_leaves, subtree
from hiradix_model.strategies import eviction_key

Leaves = Callable[[State], set[Key]]
BUDGET = 4096  # search steps per inference; ties are few in practice


def left_device(before: State, after: State) -> set[Key]:
    """Pages whose device copy is gone."""
    return {k for k, p in before.pages.items() if p.device is not None
            and (k not in after.pages or after.pages[k].device is None)}


def left_host(before: State, after: State) -> set[Key]:
    """Host-only pages that are gone altogether."""
    return {k for k, p in before.pages.items()
            if p.device is None and p.host is not None and k not in after.pages}


def _next(strategy: str, pages: dict[Key, Page], leaves: set[Key], allowed: Iterable[Key],
          previous: Key | None, met: bool, ps: int) -> list[Key]:
    """The pages of ``allowed`` that R1 lets follow ``previous``: minimal-rank leaves
    (minimal among *all* ``leaves``: a victim must outrank those the engine kept too),
    only the previous victim's parent once the target is ``met``, and that parent first
    otherwise (DEV-10: an engine finishes the node it started)."""
    if not leaves:
        return []
    best = min(eviction_key(strategy, pages[k]) for k in leaves)
    ties = sorted((k for k in leaves & set(allowed) if eviction_key(strategy, pages[k]) == best),
                  key=sort_key)
    chain = parent_page(previous, ps) if previous else None
    if met:
        return [chain] if chain in ties else []
    if chain in ties:
        ties.remove(chain)
        ties.insert(0, chain)
    return ties


def _order(model: State, gone: set[Key], leaves_of: Leaves,
           remove: Callable[[dict[Key, Page], Key], None], target: int) -> list[Key]:
    """An order of ``gone`` that R1 allows for ``target`` tokens, found by a bounded
    search over the free ties; if none is found, a greedy order for the model to reject."""
    ps, strategy = model.config.page_size, model.config.eviction
    budget = [BUDGET]

    def search(pages: dict[Key, Page], remaining: frozenset[Key], order: list[Key],
               previous: Key | None) -> list[Key] | None:
        if not remaining:
            return order
        budget[0] -= 1
        leaves = leaves_of(replace(model, pages=pages))
        if not leaves & remaining or budget[0] < 0:
            return None
        for pick in _next(strategy, pages, leaves, remaining, previous,
                          len(order) * ps >= target, ps):
            after = dict(pages)
            remove(after, pick)
            found = search(after, remaining - {pick}, [*order, pick], pick)
            if found is not None:
                return found
        return None

    found = search(dict(model.pages), frozenset(gone), [], None)
    return found if found is not None else sorted(gone, key=sort_key)


def _drop_device(pages: dict[Key, Page], key: Key) -> None:
    if pages[key].host is None:
        del pages[key]
    else:
        pages[key] = replace(pages[key], device=None)


def _drop_host(pages: dict[Key, Page], key: Key) -> None:
    del pages[key]


def device_victims(model: State, before: State, after: State,
                   target: int) -> tuple[Victim, ...]:
    """The device eviction for ``target`` tokens between ``before`` and ``after``.
    Under the write-through policies (or with no host tier) a victim only loses its
    device copy; under ``write_back`` it may be backed up or dropped (``WriteBack``)."""
    gone = left_device(before, after)
    if model.config.write_policy == "write_back" and gone:
        return WriteBack(model, before, after, target).victims(gone)
    return tuple(Victim(k) for k in
                 _order(model, gone, device_evictable_leaves, _drop_device, target))


Outcome = tuple[Victim, dict[Key, Page], frozenset[int]]


class WriteBack:
    """The victims of a ``write_back`` eviction (spec/03 3.8), found by a bounded search
    that replays 3.8 on the model's pages and keeps to what ``after`` shows.

    A victim with a host copy loses its device copy. One without is backed up: first the
    host victims of R2 for the shortfall ``P - |host_free|`` (host-only pages that are gone
    in ``after``; their order by R1, searched over the ties), then either

    - the host slots it holds in ``after``;
    - none, if it is gone and the host still has no room: it is dropped with its subtree
      (every page of which must be gone);
    - or, if it is gone although the host had room, a free host page: it was backed up
      and left the host again within the same call (a later victim's host victim, or
      below a later drop). Those slots are not observable, and the model keeps no bytes
      for freed slots, so the search tries each free host page (one free in ``after``
      first; a later victim may have taken it once it was free again).

    A load (spec/03 3.12) protects its chain from host eviction while it makes room,
    loaded or not, and the caller does not say which chain that is. So when no sequence
    explains ``after`` with every unprotected host leaf ranked, the search runs again
    with the host leaves still cached in ``after`` left out of the ranks. That cannot hide
    an illegal choice: the model, which knows the protections, judges the report.
    """

    def __init__(self, model: State, before: State, after: State, target: int) -> None:
        self.model, self.after, self.target = model, after, target
        self.ps, self.strategy = model.config.page_size, model.config.eviction
        self.vanished = frozenset(k for k in before.pages if k not in after.pages)
        self.budget = BUDGET
        self.relaxed = False

    def victims(self, gone: set[Key]) -> tuple[Victim, ...]:
        for relaxed in (False, True):
            self.relaxed, self.budget = relaxed, BUDGET
            found = self._devices(dict(self.model.pages), frozenset(self.model.host_free),
                                  frozenset(gone), (), None)
            if found is not None:
                return found
        # None explains ``after``: a plain report for the model to reject, with the slots
        # each victim shows.
        return tuple(Victim(k, (), self.after.pages[k].host if k in self.after.pages else None)
                     if self.model.pages[k].host is None else Victim(k)
                     for k in sorted(gone, key=sort_key))

    def _devices(self, pages: dict[Key, Page], host_free: frozenset[int],
                 remaining: frozenset[Key], done: tuple[Victim, ...],
                 previous: Key | None) -> tuple[Victim, ...] | None:
        if not remaining:
            return done if not self.vanished & pages.keys() else None
        self.budget -= 1
        if self.budget < 0:
            return None
        leaves = device_evictable_leaves(replace(self.model, pages=pages))
        for pick in _next(self.strategy, pages, leaves, remaining, previous,
                          len(done) * self.ps >= self.target, self.ps):
            for victim, now, free in self._outcomes(pages, host_free, pick):
                found = self._devices(now, free, remaining - {pick}, (*done, victim), pick)
                if found is not None:
                    return found
        return None

    def _outcomes(self, pages: dict[Key, Page], host_free: frozenset[int],
                  key: Key) -> Iterator[Outcome]:
        """Each way 3.8 lets ``key`` leave the device that ``after`` allows."""
        record = pages[key]
        if record.host is not None:
            yield Victim(key), {**pages, key: replace(record, device=None)}, host_free
            return
        landed = self.after.pages.get(key)
        shortfall = max(0, self.ps - len(host_free))
        for host_victims, now, free in self._host_room(pages, host_free, shortfall, (), None):
            if landed is None and len(free) < self.ps:
                doomed = set(subtree(replace(self.model, pages=now), key))
                if doomed - {key} <= self.vanished:
                    freed = {s for k in doomed for s in now[k].host or ()}
                    yield (Victim(key, host_victims, None),
                           {k: p for k, p in now.items() if k not in doomed}, free | freed)
                continue
            if landed is None:
                choices = self._transient_slots(free)
            elif landed.host is not None and set(landed.host) <= free:
                choices = [landed.host]
            else:
                choices = []
            for slots in choices:
                yield (Victim(key, host_victims, slots),
                       {**now, key: replace(record, device=None, host=slots)},
                       free - set(slots))

    def _host_room(self, pages: dict[Key, Page], host_free: frozenset[int], shortfall: int,
                   done: tuple[Key, ...], previous: Key | None) -> Iterator[tuple[
                       tuple[Key, ...], dict[Key, Page], frozenset[int]]]:
        """The R1 sequences of host victims for ``shortfall`` slots (R2), shortest first."""
        self.budget -= 1
        if self.budget < 0:
            return
        leaves = host_evictable_leaves(replace(self.model, pages=pages))
        if self.relaxed:
            leaves &= self.vanished
        met = len(done) * self.ps >= shortfall
        if met or not leaves:
            yield done, pages, host_free
        for pick in _next(self.strategy, pages, leaves, leaves & self.vanished, previous, met,
                          self.ps):
            slots = pages[pick].host or ()
            rest = {k: p for k, p in pages.items() if k != pick}
            yield from self._host_room(rest, host_free | set(slots), shortfall,
                                       (*done, pick), pick)

    def _transient_slots(self, host_free: frozenset[int]) -> list[tuple[int, ...]]:
        """The free host pages a page backed up and gone again may have held: those free
        in ``after`` first, then those a later victim took once it had left."""
        ps = self.ps
        whole = sorted((s for s in host_free
                        if s % ps == 0 and all(s + j in host_free for j in range(ps))),
                       key=lambda s: (s not in self.after.host_free, s))
        return [tuple(range(s, s + ps)) for s in whole]


def host_victims(model: State, before: State, after: State, target: int) -> tuple[Key, ...]:
    """The host eviction for ``target`` tokens between ``before`` and ``after``."""
    return tuple(_order(model, left_host(before, after), host_evictable_leaves, _drop_host,
                        target))


def backup(model: State, before: State, after: State, run: tuple[Key, ...]) -> Backup | None:
    """The report of the backup run ``run`` (the model's): the host slots its pages got,
    root-most first, or none if the engine backed up none of them."""
    if not run:
        return None
    slots: list[int] = []
    for page in run:
        record = after.pages.get(page)
        if record is None or record.host is None:
            break
        slots.extend(record.host)
    shortfall = len(run) * model.config.page_size - len(before.host_free)
    victims = host_victims(model, before, after, max(0, shortfall))
    if len(slots) != len(run) * model.config.page_size:
        # Part of the run only, or none of it: the model judges a partial report illegal.
        return Backup(victims, tuple(slots) if slots else None)
    return Backup(victims, tuple(slots))


def loaded_slots(before: State, after: State, page: Key) -> tuple[int, ...] | None:
    """The device slots the host-only chain ending at ``page`` got, root-most first."""
    chain = [k for k in page_keys(page, after.config.page_size)
             if k in before.pages and before.pages[k].device is None]
    slots: list[int] = []
    for k in chain:
        record = after.pages.get(k)
        if record is None or record.device is None:
            return None if not slots else tuple(slots)
        slots.extend(record.device)
    return tuple(slots) if slots else None
