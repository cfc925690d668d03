"""One corruption per (FULL, MAMBA) invariant (spec/13m, 13m.5), applied to ``healthy()``.

``healthy()`` is a small reachable state: an 8-token path with states after 4 and 8
tokens, the 8-token one locked by a running request, a 4-token branch without a state,
and a held state slot. Each corruption breaks exactly what its ID forbids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from hiradix_model import Key
from hiradix_model import mamba as M

CONFIG = M.MambaConfig(page_size=2, full_slots=16, state_slots=4)
PATH = Key((1, 2, 3, 4, 5, 6, 7, 8))
BRANCH = Key((1, 2, 3, 4, 9, 9))


def deep(n: int) -> Key:
    return Key(PATH.tokens[:n])


def healthy() -> M.MambaState:
    s = M.initial(CONFIG)
    s = M.alloc(s, PATH, 0, tuple(range(8)))
    s = M.alloc_state(s, 0, deep(4))
    s, _, _ = M.insert(s, deep(4), tuple(range(4)), 0)
    s = M.alloc_state(s, 1, PATH)
    s, _, _ = M.insert(s, PATH, tuple(range(8)), 1)
    s = M.inc_lock_ref(s, PATH, True)
    s = M.alloc(s, BRANCH, 4, (8, 9))
    s = M.alloc_state(s, 2, BRANCH)
    s, _, _ = M.insert(s, BRANCH, (0, 1, 2, 3, 8, 9), 2)
    return M.alloc_state(s, 3, Key(()))


def _page(s: M.MambaState, key: Key, **changes: object) -> M.MambaState:
    return replace(s, pages={**s.pages, key: replace(s.pages[key], **changes)})  # type: ignore[arg-type]


def orphan(s: M.MambaState) -> M.MambaState:
    pages = {k: p for k, p in s.pages.items() if k != deep(2)}
    return replace(s, pages=pages, full_free=s.full_free | set(s.pages[deep(2)].full))


def full_slot_owned_and_free(s: M.MambaState) -> M.MambaState:
    return replace(s, full_free=s.full_free | {s.pages[deep(6)].full[0]})


def state_leak(s: M.MambaState) -> M.MambaState:
    # A state eviction that forgot to free the slot it dropped.
    return _page(s, deep(4), state=None)


def state_at_wrong_page(s: M.MambaState) -> M.MambaState:
    # The state after 8 tokens inserted one page early.
    moved = _page(s, deep(6), state=s.pages[PATH].state)
    return _page(moved, PATH, state=None)


def state_lock_without_path_lock(s: M.MambaState) -> M.MambaState:
    return _page(s, BRANCH, state_lock=1)


MAMBA_MUTANTS: dict[str, Callable[[M.MambaState], M.MambaState]] = {
    "INV-MAMBA-TREE-WELL-FORMED": orphan,
    "INV-MAMBA-FULL-POOL": full_slot_owned_and_free,
    "INV-MAMBA-STATE-POOL": state_leak,
    "INV-MAMBA-CONTENT": state_at_wrong_page,
    "INV-MAMBA-LOCKS": state_lock_without_path_lock,
}
