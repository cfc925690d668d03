"""Reference choices: one legal resolution of each nondeterministic choice.

The model *checks* choices; these functions *make* them, breaking ties with a caller's
``random.Random`` so that tests and the model walk explore different legal outcomes.
They work on a private Draft and apply each step with the model's own step functions,
so a choice built here is, by construction, one the model accepts.
"""

from __future__ import annotations

import random

from hiradix_model.keys import Key, sort_key
from hiradix_model.ops._draft import Draft, add_lock, page_fault
from hiradix_model.ops._victims import (
    device_leaves,
    drop_device_copy,
    evict_host_page,
    host_leaves,
)
from hiradix_model.ops.backup import Backup, apply_backup, backup_run, missing_suffix
from hiradix_model.ops.evict import Victim, _evict_write_back
from hiradix_model.ops.insert import insert_pages
from hiradix_model.ops.load import _protect, plan_load
from hiradix_model.state import State
from hiradix_model.strategies import eviction_key


def _lowest(draft: Draft, leaves: set[Key], rng: random.Random) -> Key:
    """A leaf of minimal rank, ties broken by ``rng``."""
    strategy = draft.config.eviction
    best = min(eviction_key(strategy, draft.page(k)) for k in leaves)
    ties = sorted((k for k in leaves if eviction_key(strategy, draft.page(k)) == best),
                  key=sort_key)
    return rng.choice(ties)


def _slots(pool: set[int] | frozenset[int], count: int, rng: random.Random,
           ps: int) -> tuple[int, ...]:
    """``count`` slots (a multiple of ``ps``) as random free pages of ``pool``, each in
    order: what a page allocator hands out (spec/03, R7)."""
    pages = sorted(s // ps for s in pool if s % ps == 0 and all(
        s + offset in pool for offset in range(ps)))
    return tuple(page * ps + offset for page in rng.sample(pages, count // ps)
                 for offset in range(ps))


def free_pages(pool: set[int] | frozenset[int], count: int, rng: random.Random,
               ps: int) -> tuple[int, ...]:
    """Slots for ``count`` tokens as random whole free pages (the tail of the last one
    unused), or () if too few pages are free."""
    need = -(-count // ps) * ps
    whole = sum(1 for s in pool if s % ps == 0 and all(s + o in pool for o in range(ps)))
    return _slots(pool, need, rng, ps) if whole * ps >= need else ()


def _host_room(draft: Draft, need: int, rng: random.Random) -> tuple[Key, ...]:
    victims = []
    while len(draft.host_free) < need and (leaves := host_leaves(draft)):
        victim = _lowest(draft, leaves, rng)
        evict_host_page(draft, victim)
        victims.append(victim)
    return tuple(victims)


def _device_victims(
    draft: Draft, num_tokens: int, rng: random.Random, overshoot: bool
) -> tuple[Victim, ...]:
    victims: list[Victim] = []
    kept: set[Key] = set()  # write_back victims that had to stay (spec/09, S-R5)
    evicted = 0
    while evicted < num_tokens and (leaves := device_leaves(draft) - kept):
        page = _lowest(draft, leaves, rng)
        victim, tokens = _evict_one(draft, page, rng, kept)
        victims.append(victim)
        evicted += tokens
    # Finish the last victim's chain now and then, as whole-node eviction does.
    while overshoot and victims and rng.random() < 0.5:
        parent = draft.parent(victims[-1].page)
        leaves = device_leaves(draft) - kept
        if parent is None or parent not in leaves:
            break
        strategy = draft.config.eviction
        if eviction_key(strategy, draft.page(parent)) != min(
            eviction_key(strategy, draft.page(k)) for k in leaves
        ):
            break
        victims.append(_evict_one(draft, parent, rng, kept)[0])
    return tuple(victims)


def _evict_one(draft: Draft, page: Key, rng: random.Random, kept: set[Key]) -> tuple[Victim, int]:
    if draft.config.write_policy != "write_back" or draft.page(page).host is not None:
        return Victim(page), drop_device_copy(draft, page)
    host_victims = _host_room(draft, draft.ps, rng)
    room = len(draft.host_free) >= draft.ps
    slots = _slots(draft.host_free, draft.ps, rng, draft.ps) if room else None
    victim = Victim(page, host_victims, slots)
    return victim, _evict_write_back(draft, Victim(page, (), slots), "chooser", kept)


def choose_evict(
    state: State, num_tokens: int, rng: random.Random, overshoot: bool = True
) -> tuple[Victim, ...]:
    """A legal victim sequence for ``evict(state, num_tokens, ...)``."""
    return _device_victims(Draft(state), num_tokens, rng, overshoot)


def choose_evict_host(state: State, num_tokens: int, rng: random.Random) -> tuple[Key, ...]:
    """A legal victim sequence for ``evict_host(state, num_tokens, ...)``."""
    draft = Draft(state)
    victims = []
    evicted = 0
    while evicted < num_tokens and (leaves := host_leaves(draft)):
        victim = _lowest(draft, leaves, rng)
        evicted += evict_host_page(draft, victim)
        victims.append(victim)
    return tuple(victims)


def _report_for(draft: Draft, run: tuple[Key, ...], rng: random.Random) -> Backup | None:
    if not run:
        return None
    need = draft.ps * len(run)
    host_victims = _host_room(draft, need, rng)
    if len(draft.host_free) < need:
        return Backup(host_victims, None)
    slots = _slots(draft.host_free, need, rng, draft.ps)
    apply_backup(draft, run, Backup((), slots), "chooser")  # the victims are gone already
    return Backup(host_victims, slots)


def choose_insert_backup(
    state: State,
    key: Key,
    slots: tuple[int, ...],
    now: int,
    rng: random.Random,
    *,
    priority: int = 0,
    chunked: bool = False,
    counted_from: int = 0,
) -> Backup | None:
    """The backup report for ``insert(state, key, slots, now, ...)``."""
    draft = Draft(state)
    _, due = insert_pages(draft, key, slots, now, priority, chunked, counted_from)
    return _report_for(draft, backup_run(draft, due), rng)


def choose_write_backup(state: State, page: Key, rng: random.Random) -> Backup:
    """The report for a standalone ``write_backup`` of ``page``."""
    draft = Draft(state)
    report = _report_for(draft, missing_suffix(draft, page), rng)
    assert report is not None  # the suffix holds at least ``page``
    return report


def choose_load(
    state: State, page: Key, mem_quota: int | None, rng: random.Random
) -> tuple[tuple[Victim, ...], tuple[int, ...] | None]:
    """``(device_victims, device_slots)`` for ``load_back(state, page, mem_quota, ...)``."""
    draft = Draft(state)
    plan = plan_load(draft, page, mem_quota)
    if plan.skip:
        return (), None
    victims: tuple[Victim, ...] = ()
    _protect(draft, plan.chain, +1)  # as load_back does before making room
    shortfall = plan.tokens - len(draft.device_free)
    if shortfall > 0:
        if plan.anchor is not None:
            add_lock(draft, plan.anchor, +1)
        victims = _device_victims(draft, shortfall, rng, overshoot=False)
        if plan.anchor is not None:
            add_lock(draft, plan.anchor, -1)
    if len(draft.device_free) < plan.tokens:
        return victims, None
    return victims, _slots(draft.device_free, plan.tokens, rng, draft.ps)


# Caller slot layouts for the misuse rules of the state machines (spec/03, R7): each
# rearranges whole pages handed out by an allocator into the slots of one insert.
LAYOUTS = ("interleaved", "shifted", "reversed", "tail", "pages")


def scramble(pages: tuple[int, ...], count: int, ps: int, how: str) -> tuple[int, ...]:
    """``count`` of the slots ``pages`` (whole pages, in order, enough for ``count``)
    laid out as ``how`` says: ``interleaved`` takes offset 0 of every page, then offset
    1, ... ([0, 2, 1, 3]); ``shifted`` starts one slot into the first page; ``reversed``
    reverses each page; ``tail`` puts the partial tail at the end of its page, not the start;
    ``pages`` puts whole pages in reverse page order (legal at every page size). At page
    size 1 every layout is legal."""
    groups = [pages[i : i + ps] for i in range(0, len(pages), ps)]
    if how == "interleaved":
        laid = tuple(g[offset] for offset in range(ps) for g in groups)
    elif how == "shifted":
        laid = pages[1:] + pages[:1]
    elif how == "reversed":
        laid = tuple(s for g in groups for s in reversed(g))
    elif how == "tail":
        whole, tail = divmod(count, ps)
        if tail and whole < len(groups):
            return pages[: whole * ps] + groups[whole][ps - tail :]
        laid = pages
    elif how == "pages":
        laid = tuple(s for g in reversed(groups) for s in g)
    else:
        raise ValueError(f"unknown layout {how!r}")
    return laid[:count]


__all__ = ["LAYOUTS", "choose_evict", "choose_evict_host", "choose_insert_backup", "choose_load",
           "choose_write_backup", "free_pages", "page_fault", "scramble"]
