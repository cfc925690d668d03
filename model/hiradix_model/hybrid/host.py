"""The host tier of the (FULL, SWA) cache (spec/13, 13.8a): backup, evict_host_full,
evict_host_swa, load_back, and match_prefix_host with its host hits."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from hiradix_model.component_args import require, require_free, require_key
from hiradix_model.components import cached_run, run_victims
from hiradix_model.errors import IllegalChoice, PreconditionError  # noqa: F401 (contracts)
from hiradix_model.hybrid.invariants import check  # noqa: F401 (contracts)
from hiradix_model.hybrid.state import (
    SwaHostPage,
    SwaPage,
    SwaState,
    host_only,
    root_path,
    swa_somewhere,
    window,
    window_somewhere,
)
from hiradix_model.keys import Key, page_keys, parent_page


def swa_backup_targets(state: SwaState, page: Key) -> list[Key]:
    """The pages whose SWA KV ``backup(page)`` copies to the host, root first (13.8a):
    walking ``page``'s window from ``page`` up to the first page with SWA KV on no tier,
    each device-live page without an SWA host copy that has (or, ``page`` itself, gets)
    a full host copy."""
    targets = []
    for key in window(state, page):
        if not swa_somewhere(state, key):
            break  # SGLang's walk stops here too (components/swa.py:136-138)
        device, host = state.pages.get(key), state.host.get(key)
        if device is not None and device.live and (host is None or host.swa is None) \
                and (host is not None or key == page):
            targets.append(key)
    return targets[::-1]


def backup(state: SwaState, page: Key, full: tuple[int, ...], swa: tuple[int, ...]) -> SwaState:
    """Copy the device page ``page`` to the host: its full KV into ``full`` (P host full
    slots, or none where it has a full host copy already), and the SWA KV of
    ``swa_backup_targets(page)`` into ``swa`` (P host SWA slots each, root first).

    pre: not check(state)
    post: not check(__return__)
    post: page in __return__.host
    raises: PreconditionError
    """
    require_key(page, "page")
    require(page in state.pages, "page", "is not on the device")
    ps = state.config.page_size
    require_free(full, state.host_full_free, 0 if page in state.host else ps, "full", ps)
    targets = swa_backup_targets(state, page)
    require_free(swa, state.host_swa_free, ps * len(targets), "swa", ps)
    host, full_kv, swa_kv = dict(state.host), dict(state.host_full_kv), dict(state.host_swa_kv)
    if full:
        host[page] = SwaHostPage(full=full, swa=None)
        full_kv.update({h: state.full_kv[d] for h, d in zip(full, state.pages[page].full,
                                                             strict=True)})
    for index, key in enumerate(targets):
        mine, device = swa[index * ps:(index + 1) * ps], state.pages[key].swa
        assert device is not None  # a target is device-live
        host[key] = replace(host[key], swa=mine)
        swa_kv.update({h: state.swa_kv[d] for h, d in zip(mine, device, strict=True)})
    return replace(state, host=host, host_full_free=state.host_full_free - set(full),
                   host_swa_free=state.host_swa_free - set(swa), host_full_kv=full_kv,
                   host_swa_kv=swa_kv)


def host_leaves(state: SwaState) -> set[Key]:
    """Host pages with no host-only child: what a host eviction may delete (13.8a)."""
    parents = {parent_page(k, state.config.page_size) for k in host_only(state)}
    return set(state.host) - parents


def _delete_host(state: SwaState, page: Key) -> SwaState:
    record = state.host[page]
    return replace(state, host={k: p for k, p in state.host.items() if k != page},
                   host_full_free=state.host_full_free | set(record.full),
                   host_swa_free=state.host_swa_free | set(record.swa or ()))


def _host_full_freed(before: SwaState, after: SwaState) -> int:
    return len(after.host_full_free) - len(before.host_full_free)


def _host_swa_freed(before: SwaState, after: SwaState) -> int:
    return len(after.host_swa_free) - len(before.host_swa_free)


def evict_host_full(state: SwaState, num_tokens: int,
                    victims: Sequence[Key]) -> tuple[SwaState, int]:
    """Delete host leaves' host copies (both), in the reported order, until
    ``num_tokens`` host full tokens are free. Observation: host full tokens freed.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] == len(__return__[0].host_full_free) - len(state.host_full_free)
    raises: PreconditionError, IllegalChoice
    """
    return _run(state, num_tokens, victims, host_leaves, _delete_host, _host_full_freed)


def _run(state: SwaState, num_tokens: int, victims: Sequence[Key],
         allowed: Callable[[SwaState], set[Key]], take: Callable[[SwaState, Key], SwaState],
         freed: Callable[[SwaState, SwaState], int]) -> tuple[SwaState, int]:
    """A host eviction: 13.3's victim rules (``run_victims``) over host copies."""
    return run_victims(state, num_tokens, victims, argument="num_tokens",
                       page_size=state.config.page_size, allowed=allowed, take=take,
                       freed=freed, enough=True)


def _with_swa_host(state: SwaState) -> set[Key]:
    return {k for k, p in state.host.items() if p.swa is not None}


def _take_swa_host(state: SwaState, page: Key) -> SwaState:
    """A host-only host leaf goes whole (SGLang's ``_evict_host_leaf``); any other page
    keeps its full host copy and becomes a host tombstone."""
    if page in host_leaves(state) and page not in state.pages:
        return _delete_host(state, page)
    record = state.host[page]
    return replace(state, host={**state.host, page: replace(record, swa=None)},
                   host_swa_free=state.host_swa_free | set(record.swa or ()))


def evict_host_swa(state: SwaState, num_tokens: int,
                   victims: Sequence[Key]) -> tuple[SwaState, int]:
    """Take SWA host copies, in the reported order, until ``num_tokens`` host SWA tokens
    are free. Observation: host SWA tokens freed.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] == len(__return__[0].host_swa_free) - len(state.host_swa_free)
    raises: PreconditionError, IllegalChoice
    """
    return _run(state, num_tokens, victims, _with_swa_host, _take_swa_host, _host_swa_freed)


def load_plan(state: SwaState, page: Key) -> tuple[list[Key], list[Key]]:
    """What ``load_back(page)`` loads, root first: the host-only pages of its path (full
    KV), and its window's pages without device SWA KV (SWA KV). Changes nothing."""
    path = root_path(state, page)[::-1]
    full = [k for k in path if k not in state.pages]
    swa = [k for k in window(state, page)[::-1]
           if k not in state.pages or not state.pages[k].live]
    return full, swa


def load_back(state: SwaState, page: Key, full: tuple[int, ...],
              swa: tuple[int, ...]) -> SwaState:
    """Copy ``page``'s path and window back to the device: the full host KV of each
    host-only page of its path into ``full``, the SWA host KV of each page of its window
    without device SWA KV into ``swa`` (P free device slots each, root first). Refused
    where the window has a page with SWA KV on no tier.

    pre: not check(state)
    post: not check(__return__)
    post: page in __return__.pages
    raises: PreconditionError
    """
    require_key(page, "page")
    require(all(k in state.pages or k in state.host for k in root_path(state, page)),
            "page", "has a page of its path on no tier")
    require(window_somewhere(state, page), "page",
            "has a page in its window with SWA KV on no tier: no load can resume after it")
    to_full, to_swa = load_plan(state, page)
    require(bool(to_full or to_swa), "page", "has nothing to load: its path and window "
            "are on the device")
    ps = state.config.page_size
    require_free(full, state.full_free, ps * len(to_full), "full", ps)
    require_free(swa, state.swa_free, ps * len(to_swa), "swa", ps)
    pages, full_kv, swa_kv = dict(state.pages), dict(state.full_kv), dict(state.swa_kv)
    for index, key in enumerate(to_full):
        mine = full[index * ps:(index + 1) * ps]
        pages[key] = SwaPage(full=mine, swa=None)
        full_kv.update({d: state.host_full_kv[h] for d, h in zip(mine, state.host[key].full,
                                                                 strict=True)})
    for index, key in enumerate(to_swa):
        mine, source = swa[index * ps:(index + 1) * ps], state.host[key].swa
        assert source is not None  # window_somewhere: no device SWA, so a host copy
        pages[key] = replace(pages[key], swa=mine)
        swa_kv.update({d: state.host_swa_kv[h] for d, h in zip(mine, source, strict=True)})
    return replace(state, pages=pages, full_free=state.full_free - set(full),
                   swa_free=state.swa_free - set(swa), full_kv=full_kv, swa_kv=swa_kv)


@dataclass(frozen=True)
class SwaHostMatch:
    device_slots: tuple[int, ...]  # full slots of the matched path's device pages, root first
    load: tuple[Key, ...]  # the matched path's host-only pages, root first (the host hit)
    last_page: Key | None  # the deepest matched page; None: the root


def match_prefix_host(state: SwaState, key: Key) -> SwaHostMatch:
    """The longest prefix of ``key`` a request can resume after once loaded back: cached
    on either tier, ending in a page whose window has SWA KV on some tier (13.8a).
    Without a host copy anywhere it is ``match_prefix``. Changes nothing.

    pre: not check(state)
    post: __return__.last_page is None or window_somewhere(state, __return__.last_page)
    raises: PreconditionError
    """
    require_key(key)
    cached = cached_run({**state.pages, **state.host}, key, state.config.page_size)
    while cached and not window_somewhere(state, cached[-1]):
        cached.pop()
    device = [k for k in cached if k in state.pages]
    return SwaHostMatch(device_slots=tuple(s for k in device for s in state.pages[k].full),
                        load=tuple(k for k in cached if k not in state.pages),
                        last_page=cached[-1] if cached else None)


def host_match_problems(state: SwaState, key: Key, page: Key | None) -> Iterator[str]:
    """INV-SWA-HOST-MATCH-LIVE (13.8a): what is wrong with ``page`` as the end of a match
    of ``key`` with host hits: its window must have SWA KV on some tier, and no deeper
    page of the key cached on either tier may have such a window."""
    if page is not None and not window_somewhere(state, page):
        yield f"the host match of {key} ends at {page}, whose window has SWA KV on no tier"
    depth = 0 if page is None else len(page.tokens)
    for deeper in page_keys(key, state.config.page_size):
        if deeper not in state.pages and deeper not in state.host:
            break
        if len(deeper.tokens) > depth and window_somewhere(state, deeper):
            yield (f"the host match of {key} ends at {page}, but {deeper} is cached with "
                   "SWA KV across its window")
            break


HOST_MATCH_INVARIANT = "INV-SWA-HOST-MATCH-LIVE"
