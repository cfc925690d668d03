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

from collections.abc import Callable
from dataclasses import replace

from hiradix_model import Backup, Key, State, Victim
from hiradix_model.keys import page_keys, parent_page, sort_key
from hiradix_model.state import Page, device_evictable_leaves, host_evictable_leaves
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
        # Minimal among *all* evictable leaves: a victim must outrank those the engine
        # kept too, or this order is not the one it took.
        best = min(eviction_key(strategy, pages[k]) for k in leaves)
        ties = sorted((k for k in leaves & remaining
                       if eviction_key(strategy, pages[k]) == best), key=sort_key)
        chain = parent_page(previous, ps) if previous else None
        if len(order) * ps >= target:  # target met: only the previous victim's chain
            ties = [chain] if chain in ties else []
        elif chain in ties:
            ties.remove(chain)
            ties.insert(0, chain)
        for pick in ties:
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
    """The device eviction for ``target`` tokens between ``before`` and ``after``
    (write-through policies, or no host tier: a victim only loses its device copy)."""
    gone = left_device(before, after)
    return tuple(Victim(k) for k in
                 _order(model, gone, device_evictable_leaves, _drop_device, target))


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
