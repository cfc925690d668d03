"""write_backup and writing_check (spec/03-operations.md, "write_backup", "writing_check")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hiradix_model.errors import IllegalChoice, PreconditionError  # noqa: F401 (contracts)
from hiradix_model.invariants import check  # noqa: F401 (used by the contracts)
from hiradix_model.keys import Key
from hiradix_model.ops._ack import acknowledge
from hiradix_model.ops._draft import Draft, add_lock, choose_whole_pages, require, require_key
from hiradix_model.ops._victims import make_host_room
from hiradix_model.state import State, Transfer, pending_count  # noqa: F401 (contracts)


@dataclass(frozen=True)
class Backup:
    """The implementation's report of one backup run.

    ``host_victims`` are the host pages it evicted to make room for the run;
    ``host_slots`` the host slots the run got, root-most page first, or None if the host
    had no room even after evicting every evictable host page.
    """

    host_victims: tuple[Key, ...] = ()
    host_slots: tuple[int, ...] | None = None


def backup_run(draft: Draft, due: Sequence[Key]) -> tuple[Key, ...]:
    """The pages an insert's backup copies (R5): the deepest due page with the pages
    above it that lack a host copy, as ``write_backup`` of that page would copy (DEV-30).
    Due pages lie on one key's path and have no host copy, so the run holds them all."""
    return missing_suffix(draft, due[-1]) if due else ()


def apply_backup(draft: Draft, run: Sequence[Key], report: Backup | None, what: str) -> bool:
    """Back up ``run`` all or nothing, as ``report`` says; True if the copy was issued."""
    if not run:
        if report is not None:
            raise IllegalChoice(f"{what}: reported a backup, but no page is due")
        return False
    if report is None:
        raise IllegalChoice(f"{what}: {len(run)} pages are due for backup; report the outcome")
    need = draft.ps * len(run)
    make_host_room(draft, report.host_victims, need, f"{what}.host_victims")
    slots = report.host_slots
    if slots is None:
        if len(draft.host_free) >= need:
            raise IllegalChoice(f"{what}: reported no host room, but {need} slots are free")
        return False
    if len(slots) != need or len(set(slots)) != need or not set(slots) <= draft.host_free:
        raise IllegalChoice(f"{what}.host_slots: {slots} are not {need} distinct free host slots")
    choose_whole_pages(slots, draft.ps, f"{what}.host_slots")
    draft.host_free.difference_update(slots)
    source: list[int] = []
    for index, page in enumerate(run):
        record = draft.page(page)
        assert record.device is not None
        source.extend(record.device)
        draft.set_page(page, replace(record, host=slots[index * draft.ps:(index + 1) * draft.ps]))
    # One copy, one lock on the deepest page: its root path holds every source page.
    add_lock(draft, run[-1], +1)
    draft.pending.append(Transfer("d2h", tuple(run), tuple(source), slots, run[-1]))
    return True


def write_backup(state: State, page: Key, report: Backup) -> tuple[State, bool]:
    """Back up ``page`` and the pages above it that lack a host copy; False if no room.

    The run is the longest suffix of ``page``'s root path without host copies, so its
    first page's parent always has one (INV-BACKUP-CONTIGUOUS holds by construction).

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] == (len(__return__[0].pending) == len(state.pending) + 1)
    raises: PreconditionError, IllegalChoice
    """
    require_key(page, "page")
    record = state.pages.get(page)
    require(record is not None, "page", f"{page} is not cached")
    assert record is not None
    require(record.device is not None, "page", "is not on device")
    require(record.host is None, "page", "already has a host copy")
    require(isinstance(report, Backup), "report", "must be a Backup")
    draft = Draft(state)
    issued = apply_backup(draft, missing_suffix(draft, page), report, "report")
    return draft.freeze(), issued


def missing_suffix(draft: Draft, page: Key) -> tuple[Key, ...]:
    """The pages at the end of ``page``'s root path that have no host copy, root-most first."""
    run = []
    for key in draft.path(page):
        if draft.page(key).host is not None:
            break
        run.append(key)
    return tuple(reversed(run))


def writing_check(state: State, count: int) -> tuple[State, int]:
    """Acknowledge the oldest ``count`` device-to-host copies: bytes land, locks drop.

    pre: not check(state)
    post: not check(__return__[0])
    post: pending_count(__return__[0], "d2h") == pending_count(state, "d2h") - count
    raises: PreconditionError
    """
    return acknowledge(state, "d2h", count)
