"""The transitions of a state: every operation of spec/03 with every argument in scope
and every legal choice up to symmetry (spec/14-exploration.md, 14.3).

An ``Action`` names a model operation and the exact arguments it is called with, so a
path of actions from the initial state replays the exploration step for step, and prints
as a runnable reproducer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from hiradix_model import ops
from hiradix_model.explore.scope import Scope
from hiradix_model.explore.victims import device_runs, host_room, host_runs, lowest_pages
from hiradix_model.keys import Key, content_at, page_keys, parent_page
from hiradix_model.ops._draft import Draft, add_lock
from hiradix_model.ops.backup import Backup, backup_run, missing_suffix
from hiradix_model.ops.insert import insert_pages
from hiradix_model.ops.load import plan_load
from hiradix_model.state import State

Operation = Callable[..., tuple[State, object]]
OPERATIONS: dict[str, Operation] = {
    "match_prefix": ops.match_prefix, "inc_lock_ref": ops.inc_lock_ref,
    "dec_lock_ref": ops.dec_lock_ref, "alloc": ops.alloc, "free": ops.free,
    "insert": ops.insert, "evict": ops.evict, "evict_host": ops.evict_host,
    "write_backup": ops.write_backup, "writing_check": ops.writing_check,
    "load_back": ops.load_back, "loading_check": ops.loading_check, "reset": ops.reset,
}


@dataclass(frozen=True)
class Action:
    """``ops.<name>(state, *args, **dict(options))``."""

    name: str
    args: tuple[object, ...] = ()
    options: tuple[tuple[str, object], ...] = ()

    def apply(self, state: State) -> State:
        return self.run(state)[0]

    def run(self, state: State) -> tuple[State, object]:
        """The state after and the operation's observation (what it returns)."""
        after, observed = OPERATIONS[self.name](state, *self.args, **dict(self.options))
        return after, observed

    def call(self, state: str = "s") -> str:
        """The Python call, as a reproducer line prints it."""
        parts = [state, *map(repr, self.args), *(f"{k}={v!r}" for k, v in self.options)]
        return f"ops.{self.name}({', '.join(parts)})"


def within(state: State, scope: Scope) -> bool:
    """The state constraints of the scope (14.1): copies in flight, held pages, caller
    locks taken at each page, and (LFU) hits."""
    if len(state.pending) > scope.max_in_flight:
        return False
    if scope.max_held_pages is not None and (
            len(state.held) > scope.max_held_pages * state.config.page_size):
        return False
    below = locks_below(state)
    for key, page in state.pages.items():
        if caller_locks(state, key, below) > scope.max_locks:
            return False
        if scope.eviction == "lfu" and page.hits > scope.max_hits:
            return False
    return True


def locks_below(state: State) -> dict[Key, int]:
    """For each page, the locks its children hold (each counts its own subtree's)."""
    below: dict[Key, int] = {}
    for key, page in state.pages.items():
        parent = parent_page(key, state.config.page_size)
        if parent is not None:
            below[parent] = below.get(parent, 0) + page.lock
    return below


def caller_locks(state: State, page: Key, below: dict[Key, int]) -> int:
    """The inc_lock_ref calls outstanding *at* ``page``: its lock count less its
    children's and less the copies in flight locked at it."""
    copies = sum(t.lock == page for t in state.pending)
    return state.pages[page].lock - below.get(page, 0) - copies


def cached_prefix(state: State, key: Key) -> tuple[Key, ...]:
    """The leading pages of ``key`` cached on either tier (what match_prefix stamps)."""
    found = []
    for page in page_keys(key, state.config.page_size):
        if page not in state.pages:
            break
        found.append(page)
    return tuple(found)


def device_prefix(state: State, key: Key) -> tuple[Key, ...]:
    """The leading pages of ``key`` cached on device (what match_prefix returns)."""
    found = []
    for page in page_keys(key, state.config.page_size):
        record = state.pages.get(page)
        if record is None or record.device is None:
            break
        found.append(page)
    return tuple(found)


def _held_runs(state: State, key: Key, start: int, length: int) -> list[tuple[int, ...]]:
    """Held pages whose first ``length`` slots hold ``key``'s KV from ``start`` on, one
    per distinct content (equal ones are interchangeable)."""
    ps = state.config.page_size
    want = tuple(content_at(key, start + i) for i in range(length))
    runs = []
    for first in sorted(s for s in state.held if s % ps == 0):
        run = tuple(range(first, first + length))
        if all(s in state.held for s in run) and tuple(
                state.device_kv.get(s) for s in run) == want:
            runs.append(run)
    return runs[:1]


def insert_slots(state: State, key: Key) -> Iterator[tuple[int, ...]]:
    """Every slot tuple an insert of ``key`` may pass, up to symmetry: per page the
    cache's own device slots or a held page with that page's KV (a duplicate)."""
    ps = state.config.page_size
    options: list[list[tuple[int, ...]]] = []
    for start in range(0, len(key.tokens), ps):
        length = min(ps, len(key.tokens) - start)
        choice = _held_runs(state, key, start, length)
        record = state.pages.get(Key(key.tokens[: start + ps], key.namespace))
        if length == ps and record is not None and record.device is not None:
            choice = [record.device, *choice]
        if not choice:
            return
        options.append(choice)
    for combo in itertools.product(*options):
        slots = tuple(s for part in combo for s in part)
        if len(set(slots)) == len(slots):
            yield slots


def _backups(state: State, key: Key, slots: tuple[int, ...], now: int, priority: int,
             chunked: bool, counted_from: int) -> Iterator[Backup | None]:
    draft = Draft(state)
    _, due = insert_pages(draft, key, slots, now, priority, chunked, counted_from)
    run = backup_run(draft, due)
    if not run:
        yield None
        return
    for victims, host in host_room(draft.view(), state.config.page_size * len(run)):
        yield Backup(victims, host)


def _inserts(state: State, scope: Scope) -> Iterator[Action]:
    ps = state.config.page_size
    for key in scope.caller_keys():
        aligned = len(key.tokens) - len(key.tokens) % ps
        offered = range(0, aligned + 1, ps) if scope.partial_inserts else range(1)
        counts = [(True, 0)] + [(False, c) for c in offered]
        for slots in insert_slots(state, key):
            for now, priority, (chunked, counted) in itertools.product(
                    (state.clock, state.clock + 1), scope.priorities, counts):
                for backup in _backups(state, key, slots, now, priority, chunked, counted):
                    yield Action("insert", (key, slots, now), (
                        ("priority", priority), ("chunked", chunked),
                        ("counted_from", counted), ("backup", backup)))


def _loads(state: State, scope: Scope) -> Iterator[Action]:
    ps = state.config.page_size
    for page in sorted((k for k, p in state.pages.items() if p.device is None),
                       key=lambda k: (k.namespace or "", k.tokens)):
        for quota in scope.mem_quotas:
            draft = Draft(state)
            plan = plan_load(draft, page, quota)
            if plan.skip:
                continue  # load_back leaves the state as it is
            # What load_back evicts from: the chain protected, the anchor's path locked.
            for key in plan.chain:
                record = draft.page(key)
                draft.set_page(key, replace(record, host_protect=record.host_protect + 1))
            if plan.anchor is not None:
                add_lock(draft, plan.anchor, +1)
            shortfall = max(0, plan.tokens - len(draft.device_free))
            for run in device_runs(draft.view(), shortfall):
                slots = lowest_pages(run.after.device_free, plan.tokens, ps)
                yield Action("load_back", (page, quota), (
                    ("device_victims", run.victims), ("device_slots", slots)))


def actions(state: State, scope: Scope) -> Iterator[Action]:
    """Every transition of ``state`` in ``scope`` (some may be precondition failures,
    which the explorer skips; see ``explore``)."""
    ps = state.config.page_size
    keys = scope.caller_keys()
    cached = sorted(state.pages, key=lambda k: (k.namespace or "", k.tokens))
    below = locks_below(state)
    # A match's effect is the pages it stamps: one key per distinct matched run stands
    # for all keys with that run (their successors are equal, not just alike).
    matched: dict[tuple[Key, ...], Key] = {}
    for key in keys:
        matched.setdefault(cached_prefix(state, key), key)
    for run, key in matched.items():
        for now in (state.clock, state.clock + 1):
            if run or now != state.clock:  # else the state stays as it is
                yield Action("match_prefix", (key, now))
    for page in cached:
        if state.pages[page].device is not None:
            yield Action("inc_lock_ref", (page,))
        # A caller releases only a lock it took at that page (spec/03, dec_lock_ref).
        if caller_locks(state, page, below) >= 1:
            yield Action("dec_lock_ref", (page,))
    for key in keys:
        start = ps * len(device_prefix(state, key))
        if start < len(key.tokens):
            slots = lowest_pages(state.device_free, len(key.tokens) - start, ps)
            if slots is not None:
                yield Action("alloc", (key, start, slots))
    seen: set[object] = set()
    for start in sorted(s for s in state.held if s % ps == 0):
        page_slots = tuple(range(start, start + ps))
        signature = tuple(state.device_kv.get(s) for s in page_slots)
        if signature not in seen:
            seen.add(signature)
            yield Action("free", (page_slots,))
    yield from _inserts(state, scope)
    for tokens in range(ps, state.config.device_slots + 1, ps):
        for device_run in device_runs(state, tokens):
            if device_run.victims:
                yield Action("evict", (tokens, device_run.victims))
    for tokens in range(ps, state.config.host_slots + 1, ps):
        for host_run in host_runs(state, tokens):
            if host_run.victims:  # nothing to evict: the state stays as it is
                yield Action("evict_host", (tokens, host_run.victims))
    for page in cached:
        record = state.pages[page]
        if record.device is not None and record.host is None:
            need = ps * len(missing_suffix(Draft(state), page))
            for victims, host in host_room(state, need):
                yield Action("write_backup", (page, Backup(victims, host)))
    for direction, name in (("d2h", "writing_check"), ("h2d", "loading_check")):
        for count in range(1, sum(t.direction == direction for t in state.pending) + 1):
            yield Action(name, (count,))
    yield from _loads(state, scope)
    yield Action("reset")

