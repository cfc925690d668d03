"""alloc, free_swa and free: the caller's side of both pools (spec/13, 13.3)."""

from __future__ import annotations

from dataclasses import replace

from hiradix_model.component_args import require, require_key, require_slots, require_whole_pages
from hiradix_model.errors import PreconditionError  # noqa: F401 (contracts)
from hiradix_model.hybrid.invariants import check  # noqa: F401 (contracts)
from hiradix_model.hybrid.state import SwaState
from hiradix_model.keys import Key, content_at


def alloc(state: SwaState, key: Key, start: int, full: tuple[int, ...],
          swa: tuple[int, ...]) -> SwaState:
    """Take pairs ``full[i] -> swa[i]`` and write into both the KV of ``key`` at
    ``start + i`` (none past its end).

    pre: not check(state)
    post: not check(__return__)
    post: set(__return__.held) == set(state.held) | set(full)
    raises: PreconditionError
    """
    require_key(key)
    require_slots(full, "full")
    require_slots(swa, "swa")
    ps = state.config.page_size
    require(len(full) == len(swa), "swa", "must pair one SWA slot with each full slot")
    require_whole_pages(full, ps, "full")
    require_whole_pages(swa, ps, "swa")
    require(set(full) <= state.full_free, "full", "are not all free full slots")
    require(set(swa) <= state.swa_free, "swa", "are not all free SWA slots")
    require(isinstance(start, int) and 0 <= start <= len(key.tokens), "start",
            "must be an int within key")
    full_kv, swa_kv = dict(state.full_kv), dict(state.swa_kv)
    for offset, (f, s) in enumerate(zip(full, swa, strict=True)):
        if start + offset < len(key.tokens):
            full_kv[f] = swa_kv[s] = content_at(key, start + offset)
        else:
            full_kv.pop(f, None)
            swa_kv.pop(s, None)
    return replace(
        state,
        full_free=state.full_free - set(full),
        swa_free=state.swa_free - set(swa),
        held={**state.held, **dict(zip(full, swa, strict=True))},
        full_kv=full_kv,
        swa_kv=swa_kv,
    )


def free_swa(state: SwaState, full: tuple[int, ...]) -> SwaState:
    """Drop the SWA halves of these held pairs; the pairs stay held (13.3).

    pre: not check(state)
    post: not check(__return__)
    post: len(__return__.swa_free) == len(state.swa_free) + len(full)
    raises: PreconditionError
    """
    require_slots(full, "full")
    require_whole_pages(full, state.config.page_size, "full")
    require(all(state.held.get(f) is not None for f in full), "full",
            "are not all held pairs with an SWA half")
    halves = {state.held[f] for f in full}
    return replace(state, held={**state.held, **dict.fromkeys(full)},
                   swa_free=state.swa_free | {s for s in halves if s is not None})


def free(state: SwaState, full: tuple[int, ...]) -> SwaState:
    """Return these held pairs, whole pages, to both pools (13.3).

    pre: not check(state)
    post: not check(__return__)
    post: __return__.full_free == state.full_free | set(full)
    raises: PreconditionError
    """
    require_slots(full, "full")
    require_whole_pages(full, state.config.page_size, "full")
    require(set(full) <= set(state.held), "full", "are not all held by the caller")
    halves = {state.held[f] for f in full} - {None}
    held = {f: s for f, s in state.held.items() if f not in set(full)}
    return replace(state, held=held, full_free=state.full_free | set(full),
                   swa_free=state.swa_free | {s for s in halves if s is not None})
