"""One corruption per (FULL, MAMBA) invariant (spec/13m, 13m.5), applied to ``healthy()``.

``healthy()`` is a small reachable state: an 8-token path with states after 4 and 8
tokens, the 8-token one locked by a running request, a 4-token branch without a state,
and a held state slot. Each corruption breaks exactly what its ID forbids. The host tier's
(13m.8b) corrupt ``with_host(healthy())``: the same state given host pools and a backup of
every page.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from hiradix_model import Key
from hiradix_model import mamba as M
from hiradix_model.components import expected_kv

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


def with_host(s: M.MambaState) -> M.MambaState:
    """``s`` with 12 host full and 4 host state slots, every page backed up root first:
    each gets a full host copy, deep(4), PATH and BRANCH host states (host slots 0, 1, 2)."""
    config = replace(s.config, host_full_slots=12, host_state_slots=4)
    s = replace(s, config=config, host_full_free=frozenset(range(12)),
                host_state_free=frozenset(range(4)))
    for page in (deep(2), deep(4), deep(6), PATH, BRANCH):
        full = tuple(sorted(s.host_full_free)[:2])
        slot = min(s.host_state_free) if M.state_backup_needed(s, page) else None
        s = M.backup(s, page, full, slot)
    return s


def _host(s: M.MambaState, key: Key, **changes: object) -> M.MambaState:
    return replace(s, host={**s.host, key: replace(s.host[key], **changes)})  # type: ignore[arg-type]


def host_orphan(s: M.MambaState) -> M.MambaState:
    # A host copy kept for a page whose parent was deleted from both tiers.
    s = with_host(s)
    key = Key((7, 7, 7, 7))
    return replace(s, host={**s.host, key: M.MambaHostPage(full=(10, 11))},
                   host_full_free=s.host_full_free - {10, 11},
                   host_full_kv={**s.host_full_kv, 10: expected_kv(key, 0, 2),
                                 11: expected_kv(key, 1, 2)})


def host_state_without_full(s: M.MambaState) -> M.MambaState:
    # SGLang's write-back duplicate reclaim (DEV-M13): the full host copy freed, the
    # host state kept.
    s = with_host(s)
    return replace(_host(s, PATH, full=()),
                   host_full_free=s.host_full_free | set(s.host[PATH].full))


def host_full_slot_owned_and_free(s: M.MambaState) -> M.MambaState:
    s = with_host(s)
    return replace(s, host_full_free=s.host_full_free | {s.host[deep(6)].full[0]})


def host_state_leak(s: M.MambaState) -> M.MambaState:
    # A host state eviction that forgot to free the host slot it dropped.
    return _host(with_host(s), deep(4), state=None)


def host_state_at_wrong_page(s: M.MambaState) -> M.MambaState:
    # PATH's host slot written with the state after deep(6) (a backup off by a page).
    s = with_host(s)
    return replace(s, host_state_kv={**s.host_state_kv, s.host[PATH].state: deep(6)})


MAMBA_MUTANTS: dict[str, Callable[[M.MambaState], M.MambaState]] = {
    "INV-MAMBA-TREE-WELL-FORMED": orphan,
    "INV-MAMBA-FULL-POOL": full_slot_owned_and_free,
    "INV-MAMBA-STATE-POOL": state_leak,
    "INV-MAMBA-CONTENT": state_at_wrong_page,
    "INV-MAMBA-LOCKS": state_lock_without_path_lock,
    "INV-MAMBA-HOST-TREE-WELL-FORMED": host_orphan,
    "INV-MAMBA-HOST-ONLY-WITH-FULL": host_state_without_full,
    "INV-MAMBA-HOST-FULL-POOL": host_full_slot_owned_and_free,
    "INV-MAMBA-HOST-POOL": host_state_leak,
    "INV-MAMBA-HOST-CONTENT": host_state_at_wrong_page,
}
