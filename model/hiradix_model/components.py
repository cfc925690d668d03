"""What the component models (spec/13 hybrid, spec/13m mamba) share: the page path of a
key, the content a page's slot must hold, the partition of a pool, and the loop that
validates the victims an engine reports for an eviction."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

from hiradix_model.component_args import require, require_key
from hiradix_model.errors import IllegalChoice
from hiradix_model.keys import Key, content_at, page_keys, parent_page

S = TypeVar("S")


class Invariants(Generic[S]):
    """Named predicates over one kind of state, each registered under its spec ID; a
    predicate yields a description of every violation it finds."""

    def __init__(self) -> None:
        self.predicates: dict[str, Callable[[S], Iterator[str]]] = {}

    def __call__(self, spec_id: str) -> Callable[[Callable[[S], Iterator[str]]],
                                                 Callable[[S], Iterator[str]]]:
        def register(predicate: Callable[[S], Iterator[str]]) -> Callable[[S], Iterator[str]]:
            assert spec_id not in self.predicates, spec_id
            self.predicates[spec_id] = predicate
            return predicate

        return register

    def check(self, state: S) -> list[str]:
        """The IDs of the invariants ``state`` violates, in spec order."""
        return [i for i, predicate in self.predicates.items()
                if any(True for _ in predicate(state))]

    def violations(self, state: S) -> list[str]:
        """Every violation, prefixed with its ID."""
        return [f"{i}: {v}" for i, predicate in self.predicates.items() for v in predicate(state)]


def require_cached(pages: Mapping[Key, object], page: Key | None) -> None:
    """``page`` names a cached page, or is None (the root)."""
    if page is not None:
        require_key(page, "page")
        require(page in pages, "page", "is not cached")


class Locked(Protocol):
    @property
    def lock(self) -> int: ...


def locks_taken_at(pages: Mapping[Key, Locked], page: Key, page_size: int) -> int:
    """The locks taken at ``page``: its lock count less its cached children's."""
    return pages[page].lock - sum(record.lock for key, record in pages.items()
                                  if parent_page(key, page_size) == page)


def require_lock_ends_at(pages: Mapping[Key, Locked], page: Key, page_size: int) -> int:
    """A release at ``page`` must release a lock taken there: ``page``'s locks less its
    cached children's (the locks taken at it) are at least 1; returns that count. (A
    release above the lock taken would leave a child locked more than its parent.)"""
    taken = locks_taken_at(pages, page, page_size)
    require(taken >= 1, "page", f"{page} holds {pages[page].lock} locks, its children "
            f"{pages[page].lock - taken}: no lock taken at page to release")
    return taken


def one_page(slots: tuple[int, ...], page_size: int) -> bool:
    """``slots`` are the ``page_size`` slots of one pool page, in order."""
    return (len(slots) == page_size and slots[0] % page_size == 0
            and all(s == slots[0] + i for i, s in enumerate(slots)))


def expected_kv(page: Key, offset: int, page_size: int) -> Key:
    """The KV identity that slot ``offset`` of ``page`` must hold."""
    return content_at(page, len(page.tokens) - page_size + offset)


def path_to_root(page: Key, page_size: int) -> list[Key]:
    """``page`` and its ancestors, deepest first."""
    path: list[Key] = []
    cursor: Key | None = page
    while cursor is not None:
        path.append(cursor)
        cursor = parent_page(cursor, page_size)
    return path


def cached_run(pages: Mapping[Key, object], key: Key, page_size: int) -> list[Key]:
    """The pages along ``key`` that are cached, from the root up to the first that is not."""
    run = []
    for page in page_keys(key, page_size):
        if page not in pages:
            break
        run.append(page)
    return run


def partition(pool: str, size: int, parts: Iterable[tuple[str, Iterable[int]]]) -> Iterator[str]:
    """What keeps ``parts`` (name, slots) from being a partition of slots ``0 .. size-1``:
    a slot in two places, a slot outside the pool, a slot in none (leaked)."""
    seen: Counter[int] = Counter()
    where: dict[int, list[str]] = {}
    for name, slots in parts:
        for slot in slots:
            seen[slot] += 1
            where.setdefault(slot, []).append(name)
    for slot, count in sorted(seen.items()):
        if count > 1:
            yield f"{pool} slot {slot} is in {count} places: {', '.join(where[slot])}"
        if not 0 <= slot < size:
            yield f"{pool} slot {slot} is outside the pool of {size}"
    missing = set(range(size)) - set(seen)
    if missing:
        yield f"{pool} slots {sorted(missing)} are neither free, held nor owned (leaked)"


def run_victims(state: S, target: int, victims: Sequence[Key], *, argument: str,
                page_size: int, allowed: Callable[[S], set[Key]],
                take: Callable[[S, Key], S], freed: Callable[[S, S], int], enough: bool,
                rest_allowed: Callable[[S, Key], bool] = lambda state, page: False,
                ) -> tuple[S, int]:
    """Apply ``take`` to each victim in order, each one ``allowed`` when taken, until
    ``target`` units are ``freed``; past the target only the rest of the previous victim's
    node (its parent page) may follow, and such a page may also be taken where
    ``rest_allowed`` says so. ``enough``: a short eviction must have left nothing to take.
    Raises ``PreconditionError`` on a bad ``target`` (named ``argument``), else
    ``IllegalChoice``."""
    require(isinstance(target, int) and target >= 0, argument, "must be an int >= 0")
    done = 0
    previous: Key | None = None
    for index, victim in enumerate(victims):
        rest = previous is not None and parent_page(previous, page_size) == victim
        if done >= target and not rest:
            raise IllegalChoice(f"victims[{index}]: {victim} taken after {target} were "
                                "freed; only the rest of the previous victim's node may follow")
        if victim not in allowed(state) and not (rest and rest_allowed(state, victim)):
            raise IllegalChoice(f"victims[{index}]: {victim} may not be taken now")
        after = take(state, victim)
        done += freed(state, after)
        state = after
        previous = victim
    if enough and done < target and allowed(state):
        raise IllegalChoice(f"victims: freed {done} < {target} while "
                            f"{len(allowed(state))} pages could still go")
    return state, done


def badly_formed(key: Key, page_size: int,
                 copies: tuple[tuple[str, tuple[int, ...] | None], ...],
                 tiers: tuple[Mapping[Key, object], ...], missing: str) -> Iterator[str]:
    """A page's key is whole pages, its parent is in one of ``tiers``, and each non-empty
    copy (pool name, slots) is one pool page in order: the tree well-formedness of the
    component models' tiers (INV-SWA-TREE-WELL-FORMED, INV-SWA-HOST-TREE-WELL-FORMED,
    INV-MAMBA-HOST-TREE-WELL-FORMED)."""
    if not key.tokens or len(key.tokens) % page_size:
        yield f"{key}: length {len(key.tokens)} is not a positive multiple of {page_size}"
    parent = parent_page(key, page_size)
    if parent is not None and not any(parent in tier for tier in tiers):
        yield f"{key}: its parent page {parent} {missing}"
    for pool, slots in copies:
        if slots and not one_page(slots, page_size):
            yield (f"{key}: {pool} slots {slots} are not the {page_size} slots of one page "
                   "in order")
