"""One corruption per hybrid invariant (spec/13, 13.5), applied to ``healthy()``.

``healthy()`` is a small reachable (FULL, SWA) state: a 12-token path whose first 8
tokens are tombstones, a live 4-token window locked by a running request, and a held
pair. Each corruption breaks exactly what its ID forbids. The host tier's (13.8a) corrupt
``with_host(healthy())``: the same state given host pools and a backup of its path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from hiradix_model import Key
from hiradix_model import hybrid as H

CONFIG = H.SwaConfig(page_size=1, full_slots=16, swa_slots=8, window=4)
PATH = Key(tuple(range(1, 13)))


def healthy() -> H.SwaState:
    s = H.initial(CONFIG)
    s = H.alloc(s, PATH, 0, tuple(range(8)), tuple(range(8)))
    s = H.free_swa(s, tuple(range(8)))
    s = H.alloc(s, PATH, 8, (8, 9, 10, 11), (0, 1, 2, 3))
    s, _ = H.insert(s, PATH, tuple(range(12)), 8)
    s = H.inc_lock_ref(s, PATH)
    return H.alloc(s, Key((7,)), 0, (12,), (4,))


def _page(s: H.SwaState, key: Key, **changes: object) -> H.SwaState:
    return replace(s, pages={**s.pages, key: replace(s.pages[key], **changes)})  # type: ignore[arg-type]


def _deep(n: int) -> Key:
    return Key(PATH.tokens[:n])


def orphan(s: H.SwaState) -> H.SwaState:
    pages = {k: p for k, p in s.pages.items() if k != _deep(1)}
    return replace(s, pages=pages, full_free=s.full_free | set(s.pages[_deep(1)].full))


def swa_without_full(s: H.SwaState) -> H.SwaState:
    return _page(s, _deep(12), full=())


def full_slot_twice(s: H.SwaState) -> H.SwaState:
    return _page(s, _deep(3), full=s.pages[_deep(2)].full)


def swa_leak(s: H.SwaState) -> H.SwaState:
    # A tombstoning that forgot to free the SWA slots it dropped.
    return _page(s, _deep(12), swa=None, swa_lock=0)


def wrong_kv(s: H.SwaState) -> H.SwaState:
    return replace(s, swa_kv={**s.swa_kv, 3: Key((9,))})


def tombstone_in_window(s: H.SwaState) -> H.SwaState:
    swa = s.pages[_deep(11)].swa or ()
    return replace(_page(s, _deep(11), swa=None), swa_free=s.swa_free | set(swa))


def window_lock_leaked(s: H.SwaState) -> H.SwaState:
    # A release that marked the lock's window released without unlocking it: the
    # window stays locked, by no lock that still holds it (13.3 dec_swa_lock).
    return replace(s, released={PATH: 1})


def with_host(s: H.SwaState) -> H.SwaState:
    """``s`` with 16 host full and 8 host SWA slots, its 12-token path backed up root
    first: every page gets a full host copy, the live window's 4 pages SWA host copies."""
    config = replace(s.config, host_full_slots=16, host_swa_slots=8)
    s = replace(s, config=config, host_full_free=frozenset(range(16)),
                host_swa_free=frozenset(range(8)))
    for n in range(1, 13):
        targets = H.swa_backup_targets(s, _deep(n))
        s = H.backup(s, _deep(n), (n - 1,), tuple(sorted(s.host_swa_free))[:len(targets)])
    return s


def _host(s: H.SwaState, key: Key, **changes: object) -> H.SwaState:
    return replace(s, host={**s.host, key: replace(s.host[key], **changes)})  # type: ignore[arg-type]


def host_orphan(s: H.SwaState) -> H.SwaState:
    # A host copy kept for a page whose parent was deleted from both tiers.
    s = with_host(s)
    host = {Key((7, 7)): H.SwaHostPage(full=(12,), swa=None), **s.host}
    return replace(s, host=host, host_full_free=s.host_full_free - {12},
                   host_full_kv={**s.host_full_kv, 12: Key((7, 7))})


def host_swa_without_full(s: H.SwaState) -> H.SwaState:
    # A host eviction that freed a page's full host copy but kept its SWA host copy.
    s = with_host(s)
    return replace(_host(s, _deep(12), full=()),
                   host_full_free=s.host_full_free | set(s.host[_deep(12)].full))


def host_full_slot_twice(s: H.SwaState) -> H.SwaState:
    s = with_host(s)
    return replace(s, host_full_free=s.host_full_free | set(s.host[_deep(5)].full))


def host_swa_leak(s: H.SwaState) -> H.SwaState:
    # A host tombstoning that forgot to free the SWA host slots it dropped.
    return _host(with_host(s), _deep(12), swa=None)


def host_wrong_kv(s: H.SwaState) -> H.SwaState:
    s = with_host(s)
    return replace(s, host_swa_kv={**s.host_swa_kv, 0: Key((9,))})


SWA_MUTANTS: dict[str, Callable[[H.SwaState], H.SwaState]] = {
    "INV-SWA-TREE-WELL-FORMED": orphan,
    "INV-SWA-ONLY-WITH-FULL": swa_without_full,
    "INV-SWA-FULL-POOL": full_slot_twice,
    "INV-SWA-SWA-POOL": swa_leak,
    "INV-SWA-CONTENT": wrong_kv,
    "INV-SWA-LOCKS": tombstone_in_window,
    "INV-SWA-WINDOW-COUNT": window_lock_leaked,
    "INV-SWA-HOST-TREE-WELL-FORMED": host_orphan,
    "INV-SWA-HOST-ONLY-WITH-FULL": host_swa_without_full,
    "INV-SWA-HOST-FULL-POOL": host_full_slot_twice,
    "INV-SWA-HOST-POOL": host_swa_leak,
    "INV-SWA-HOST-CONTENT": host_wrong_kv,
}
