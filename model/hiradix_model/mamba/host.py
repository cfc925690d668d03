"""The host tier of the (FULL, MAMBA) cache (spec/13m, 13m.8b): backup, evict_host_full,
evict_host_states, load_back, and match_prefix_host with its host hits."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from hiradix_model.component_args import require, require_free, require_key, require_optional_slot
from hiradix_model.components import cached_run, run_victims
from hiradix_model.errors import IllegalChoice, PreconditionError  # noqa: F401 (contracts)
from hiradix_model.keys import Key, parent_page
from hiradix_model.mamba.invariants import check  # noqa: F401 (contracts)
from hiradix_model.mamba.state import (
    MambaHostPage,
    MambaPage,
    MambaState,
    host_only,
    root_path,
    state_somewhere,
)


def state_backup_needed(state: MambaState, page: Key) -> bool:
    """Whether ``backup(page)`` copies a state (13m.8b): ``page`` holds a device state
    and no host state (SGLang's ``needs_incremental_backup``, components/mamba.py:90-92)."""
    device, host = state.pages.get(page), state.host.get(page)
    return device is not None and device.state is not None and (host is None or host.state is None)


def backup(state: MambaState, page: Key, full: tuple[int, ...], slot: int | None) -> MambaState:
    """Copy the device page ``page`` to the host: its full KV into ``full`` (P free host
    full slots, or none where it has a host copy already) and, where
    ``state_backup_needed``, its state into the free host state ``slot`` (else None).
    Nothing to copy is no change (SGLang skips such a backup).

    pre: not check(state)
    post: not check(__return__)
    post: page in __return__.host
    raises: PreconditionError
    """
    require_key(page, "page")
    require(page in state.pages, "page", "is not on the device")
    ps = state.config.page_size
    require_free(full, state.host_full_free, 0 if page in state.host else ps, "full", ps)
    needed = state_backup_needed(state, page)
    require_optional_slot(slot, state.host_state_free, needed, "slot")
    record = state.pages[page]
    host_page = state.host.get(page, MambaHostPage(full=full))
    full_kv, state_kv = dict(state.host_full_kv), dict(state.host_state_kv)
    if full:  # a page backed up before has its full host copy already
        full_kv.update({h: state.full_kv[d] for h, d in zip(full, record.full, strict=True)})
    if slot is not None:
        assert record.state is not None  # state_backup_needed
        host_page = replace(host_page, state=slot)
        state_kv[slot] = state.state_kv[record.state]
    return replace(state, host={**state.host, page: host_page},
                   host_full_free=state.host_full_free - set(full),
                   host_state_free=state.host_state_free - ({slot} if slot is not None else set()),
                   host_full_kv=full_kv, host_state_kv=state_kv)


def host_leaves(state: MambaState) -> set[Key]:
    """Host pages with no host-only child: what a host eviction may delete (13m.8b)."""
    parents = {parent_page(k, state.config.page_size) for k in host_only(state)}
    return set(state.host) - parents


def _delete_host(state: MambaState, page: Key) -> MambaState:
    """A page's host copies go, both: its host full slots and its host state."""
    record = state.host[page]
    states = set() if record.state is None else {record.state}
    return replace(state, host={k: p for k, p in state.host.items() if k != page},
                   host_full_free=state.host_full_free | set(record.full),
                   host_state_free=state.host_state_free | states)


def _host_full_freed(before: MambaState, after: MambaState) -> int:
    return len(after.host_full_free) - len(before.host_full_free)


def _host_states_freed(before: MambaState, after: MambaState) -> int:
    return len(after.host_state_free) - len(before.host_state_free)


def _run(state: MambaState, target: int, victims: Sequence[Key],
         allowed: Callable[[MambaState], set[Key]],
         take: Callable[[MambaState, Key], MambaState],
         freed: Callable[[MambaState, MambaState], int]) -> tuple[MambaState, int]:
    """A host eviction: 13m.3's victim rules (``run_victims``) over host copies."""
    return run_victims(state, target, victims, argument="target",
                       page_size=state.config.page_size, allowed=allowed, take=take,
                       freed=freed, enough=True)


def evict_host_full(state: MambaState, target: int,
                    victims: Sequence[Key]) -> tuple[MambaState, int]:
    """Delete host leaves' host copies (full and state), in the reported order, until
    ``target`` host full tokens are free. Observation: host full tokens freed.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] == len(__return__[0].host_full_free) - len(state.host_full_free)
    raises: PreconditionError, IllegalChoice
    """
    return _run(state, target, victims, host_leaves, _delete_host, _host_full_freed)


def _with_host_state(state: MambaState) -> set[Key]:
    return {k for k, p in state.host.items() if p.state is not None}


def _take_host_state(state: MambaState, page: Key) -> MambaState:
    """A host-only host leaf goes whole (SGLang's ``_evict_host_leaf``); any other page
    keeps its full host copy and loses its host state (a host state tombstone)."""
    if page in host_leaves(state) and page not in state.pages:
        return _delete_host(state, page)
    record = state.host[page]
    assert record.state is not None  # _with_host_state
    return replace(state, host={**state.host, page: replace(record, state=None)},
                   host_state_free=state.host_state_free | {record.state})


def evict_host_states(state: MambaState, target: int,
                      victims: Sequence[Key]) -> tuple[MambaState, int]:
    """Take host states, in the reported order, until ``target`` host state slots are
    free. Observation: host state slots freed.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] == len(__return__[0].host_state_free) - len(state.host_state_free)
    raises: PreconditionError, IllegalChoice
    """
    return _run(state, target, victims, _with_host_state, _take_host_state,
                _host_states_freed)


def load_plan(state: MambaState, page: Key) -> tuple[list[Key], bool]:
    """What ``load_back(page)`` loads: the host-only pages of its path, root first (full
    KV), and whether ``page``'s state (its state only, no ancestor's). Changes nothing."""
    full = [k for k in root_path(state, page)[::-1] if k not in state.pages]
    device = state.pages.get(page)
    return full, device is None or device.state is None


def load_back(state: MambaState, page: Key, full: tuple[int, ...],
              slot: int | None) -> MambaState:
    """Copy ``page``'s path back to the device: the full host KV of each host-only page of
    its path into ``full`` (P free device full slots each, root first) and, where
    ``page`` holds no device state, its host state into the free state ``slot`` (else
    None). Refused where ``page``'s state is on no tier.

    pre: not check(state)
    post: not check(__return__)
    post: __return__.pages[page].state is not None
    raises: PreconditionError
    """
    require_key(page, "page")
    require(bool(page.tokens), "page", "must not be the root")
    require(all(k in state.pages or k in state.host for k in root_path(state, page)),
            "page", "has a page of its path on no tier")
    require(state_somewhere(state, page), "page",
            "holds a state on no tier: no load can resume after it")
    to_full, to_state = load_plan(state, page)
    require(bool(to_full) or to_state, "page",
            "has nothing to load: its path and state are on the device")
    ps = state.config.page_size
    require_free(full, state.full_free, ps * len(to_full), "full", ps)
    require_optional_slot(slot, state.state_free, to_state, "slot")
    pages, full_kv, state_kv = dict(state.pages), dict(state.full_kv), dict(state.state_kv)
    for index, key in enumerate(to_full):
        mine = full[index * ps:(index + 1) * ps]
        pages[key] = MambaPage(full=mine)  # no state: only ``page``'s is loaded
        full_kv.update({d: state.host_full_kv[h] for d, h in zip(mine, state.host[key].full,
                                                                 strict=True)})
    if slot is not None:
        source = state.host[page].state
        assert source is not None  # state_somewhere, and no device state
        pages[page] = replace(pages[page], state=slot)
        state_kv[slot] = state.host_state_kv[source]
    return replace(state, pages=pages, full_free=state.full_free - set(full),
                   state_free=state.state_free - ({slot} if slot is not None else set()),
                   full_kv=full_kv, state_kv=state_kv)


@dataclass(frozen=True)
class MambaHostMatch:
    device_slots: tuple[int, ...]  # full slots of the matched path's device pages, root first
    load: tuple[Key, ...]  # the matched path's host-only pages, root first (the host hit)
    last_page: Key | None  # the deepest matched page; None: the root
    load_state: bool  # whether last_page's state is on the host only (a load restores it)
    full_hit: int  # tokens of the key in the longest run of pages cached on either tier


def match_prefix_host(state: MambaState, key: Key) -> MambaHostMatch:
    """The longest prefix of ``key`` a request can resume after once loaded back: cached
    on either tier, ending at a page whose state is on some tier (13m.8b). Without a
    host copy anywhere it is ``match_prefix``. Changes nothing.

    pre: not check(state)
    post: __return__.last_page is None or state_somewhere(state, __return__.last_page)
    post: __return__.full_hit >= len(__return__.device_slots)
    raises: PreconditionError
    """
    require_key(key)
    cached = cached_run({**state.pages, **state.host}, key, state.config.page_size)
    full_hit = len(cached) * state.config.page_size
    while cached and not state_somewhere(state, cached[-1]):
        cached.pop()
    last = cached[-1] if cached else None
    device = [k for k in cached if k in state.pages]
    load_state = last is not None and (last not in state.pages or state.pages[last].state is None)
    return MambaHostMatch(device_slots=tuple(s for k in device for s in state.pages[k].full),
                          load=tuple(k for k in cached if k not in state.pages),
                          last_page=last, load_state=load_state, full_hit=full_hit)


def host_match_problems(state: MambaState, key: Key, page: Key | None,
                        full_hit: int | None = None) -> Iterator[str]:
    """INV-MAMBA-HOST-MATCH-STATE (13m.8b): what is wrong with ``page`` as the end of a
    match of ``key`` with host hits: it must hold a state on some tier, no deeper page of
    the key cached on either tier may hold one, and ``full_hit`` (when given) must be the
    run cached on either tier."""
    if page is not None and not state_somewhere(state, page):
        yield f"the host match of {key} ends at {page}, which holds a state on no tier"
    depth = 0 if page is None else len(page.tokens)
    run = cached_run({**state.pages, **state.host}, key, state.config.page_size)
    for deeper in run:
        if len(deeper.tokens) > depth and state_somewhere(state, deeper):
            yield f"the host match of {key} ends at {page}, but {deeper} holds a state"
            break
    longest = len(run) * state.config.page_size
    if full_hit is not None and full_hit != longest:
        yield (f"the host match of {key} reports a full hit of {full_hit}, the two tiers "
               f"hold {longest}")


HOST_MATCH_INVARIANT = "INV-MAMBA-HOST-MATCH-STATE"
