"""What the storage I/O reports (spec/09-storage.md, 9.5): the answer of a prefetch's
hit query, pages fetched into the reserved slots, pages written to storage.

These are the implementation's background threads (SGLang ``prefetch_thread_func``,
``prefetch_io_aux_func``, ``backup_thread_func``) seen at operation boundaries. Every
argument is a report; faults are reports too, and each is legal only where it can
happen. A report the backend could not have produced (a page it does not hold) is an
illegal choice.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal, get_args

from hiradix_model.errors import IllegalChoice, PreconditionError
from hiradix_model.invariants import check  # noqa: F401 (used by the contracts)
from hiradix_model.keys import Key
from hiradix_model.ops._draft import Draft, require
from hiradix_model.ops.storage._common import give_up, put, require_request, storage_of, update
from hiradix_model.state import State
from hiradix_model.storage import Prefetch, StorageId, WritePhase, stored_run

# The faults a report may carry (spec/09, 9.5). The operations take them as plain str
# (validated against these tuples), which CrossHair can generate.
# raise: the backend raised, nothing of the batch arrived; short: it returned fewer
# pages than asked; corrupt: the next page's bytes failed verification; slow: nothing
# arrived yet; dead: the I/O died after the pages reported, and releases nothing.
FetchFault = Literal["raise", "short", "corrupt", "slow", "dead"]
WriteFault = Literal["raise", "short", "slow", "dead"]
FETCH_FAULTS: tuple[FetchFault, ...] = get_args(FetchFault)
WRITE_FAULTS: tuple[WriteFault, ...] = get_args(WriteFault)


def _ongoing(state: State, request: str, phase: str) -> Prefetch:
    require_request(request)
    prefetch = None if state.storage is None else state.storage.prefetch_of(request)
    require(prefetch is not None, "request", f"{request!r} has no ongoing prefetch")
    assert prefetch is not None
    require(prefetch.phase == phase, "request",
            f"{request!r}'s prefetch is {prefetch.phase}, not {phase}")
    return prefetch


def io_prefetch_query(state: State, request: str, hit_pages: int) -> tuple[State, bool]:
    """The hit query of ``request``'s prefetch answered ``hit_pages``; True if revoked.

    Below the threshold (or no hit) the prefetch is revoked: every slot goes to the
    release queue and the prefetch to the revoke queue. Otherwise the slots of the pages
    past the hits go to the release queue and fetching starts. A backend that raised
    answers 0; one that returned fewer answers fewer.

    pre: not check(state)
    post: not check(__return__[0])
    raises: PreconditionError, IllegalChoice
    """
    prefetch = _ongoing(state, request, "querying")
    assert state.storage is not None
    most = stored_run(state.storage, prefetch.pages)
    if not (isinstance(hit_pages, int) and 0 <= hit_pages <= most):
        raise IllegalChoice(f"hit_pages: {hit_pages!r} is not in [0, {most}] (pages stored)")
    draft = Draft(state)
    threshold = state.storage.settings.prefetch_threshold
    revoked = hit_pages == 0 or draft.ps * hit_pages < threshold
    if revoked:
        smaller = give_up(draft, prefetch, 0, "queue")
        put(draft, replace(smaller, phase="revoked", hit_pages=0))
        update(draft, revoke_queue=(*storage_of(draft).revoke_queue, prefetch.id))
    else:
        smaller = give_up(draft, prefetch, hit_pages, "queue")
        put(draft, replace(smaller, phase="fetching", hit_pages=hit_pages))
    return draft.freeze(), revoked


def _check_count(count: int, remaining: int, fault: str | None, faults: tuple[str, ...],
                 what: str) -> None:
    """The legal counts for each fault kind (spec/09, 9.5, "Faults")."""
    if fault is not None and fault not in faults:
        raise PreconditionError("fault", f"must be None or one of {faults}, got {fault!r}")
    if not (isinstance(count, int) and 0 <= count <= remaining):
        raise IllegalChoice(f"{what}: {count!r} is not in [0, {remaining}] (pages left)")
    if fault is None and count == 0:
        raise IllegalChoice(f"{what}: no fault and no progress; report fault='slow'")
    if fault in ("raise", "slow") and count:
        raise IllegalChoice(f"{what}: nothing arrives when the fault is {fault!r}")
    if fault in ("short", "corrupt", "dead") and count == remaining:
        raise IllegalChoice(f"{what}: every page arrived; {fault!r} needs one missing")


def io_prefetch_fetch(
    state: State, request: str, landed: int, *, fault: str | None = None
) -> tuple[State, int]:
    """``landed`` more pages of ``request``'s prefetch arrived intact, then ``fault``.

    Each landed page must be in storage now. When the last page lands, or the fetch
    ends by a fault other than slow or dead, the I/O releases the slots it will not
    fill; a corrupt page's slots hold garbage and are among them, and the backend
    forgets that page (it must be stored: an absent page is a miss). Returns ``landed``.

    pre: not check(state)
    post: not check(__return__[0]) and __return__[1] == landed
    raises: PreconditionError, IllegalChoice
    """
    prefetch = _ongoing(state, request, "fetching")
    assert state.storage is not None and prefetch.hit_pages is not None
    remaining = prefetch.hit_pages - prefetch.landed
    _check_count(landed, remaining, fault, FETCH_FAULTS, "landed")
    storage, ps = state.storage, state.config.page_size
    arriving = prefetch.pages[prefetch.landed: prefetch.landed + landed]
    missing = [k for k in arriving if storage.sid(k) not in storage.stored]
    if missing:
        raise IllegalChoice(f"landed: {missing[0]} is not in storage; it cannot arrive")
    total = prefetch.landed + landed
    damaged = prefetch.pages[total] if fault == "corrupt" else None
    if damaged is not None and storage.sid(damaged) not in storage.stored:
        raise IllegalChoice(f"fault: {damaged} is not in storage, so it is a miss "
                            f"('short'), not 'corrupt'")
    draft = Draft(state)
    for index, page in enumerate(arriving, start=prefetch.landed):
        content = storage.stored[storage.sid(page)]
        for slot, kv in zip(prefetch.slots[index * ps:(index + 1) * ps], content, strict=True):
            _write(draft.host_kv, slot, kv)
    if damaged is not None:
        for slot in prefetch.slots[total * ps:(total + 1) * ps]:
            draft.host_kv.pop(slot, None)  # garbage: never inserted, released below
        _discard(draft, storage.sid(damaged))
    grown = replace(prefetch, landed=total)
    put(draft, grown)
    if fault == "dead":
        put(draft, replace(grown, phase="dead"))
    elif fault in ("raise", "short", "corrupt") or total == prefetch.hit_pages:
        put(draft, replace(give_up(draft, grown, total, "queue"), phase="stopped"))
    return draft.freeze(), landed


def _discard(draft: Draft, page: StorageId) -> None:
    """The backend forgets a page that failed verification (DEV-S11), so a later backup
    can store it again."""
    storage = storage_of(draft)
    assert storage.backend is not None
    kept = {sid: content for sid, content in storage.stored.items() if sid != page}
    update(draft, stores={**storage.stores, storage.backend: kept})


def _write(kv: dict[int, Key], slot: int, content: Key | None) -> None:
    if content is None:
        kv.pop(slot, None)
    else:
        kv[slot] = content


def io_storage_write(
    state: State, pages: int, *, fault: str | None = None
) -> tuple[State, int]:
    """The oldest running storage write handled ``pages`` more pages, then ``fault``.

    A handled page the backend lacks is stored with its host copy's current bytes; one
    it already holds is left as it is (only missing pages are written). The write is
    acknowledged (queued for drain) when it finishes or fails; a dead one never is.

    pre: not check(state)
    post: not check(__return__[0]) and __return__[1] == pages
    raises: PreconditionError, IllegalChoice
    """
    running = [] if state.storage is None else [
        w for w in state.storage.writes if w.phase == "running"]
    require(bool(running), "pages", "no storage write is running")
    write = running[0]  # one backup thread, one FIFO queue
    _check_count(pages, len(write.pages) - write.done, fault, WRITE_FAULTS, "pages")
    draft = Draft(state)
    storage = storage_of(draft)
    assert storage.backend is not None
    store = dict(storage.stored)
    for page in write.pages[write.done: write.done + pages]:
        host = draft.page(page).host
        assert host is not None  # INV-STORAGE-WRITE-PROTECT
        store.setdefault(storage.sid(page), tuple(draft.host_kv.get(s) for s in host))
    done = write.done + pages
    phase: WritePhase = "running"
    if fault == "dead":
        phase = "dead"
    elif fault in ("raise", "short") or done == len(write.pages):
        phase = "acked"
    finished = replace(write, done=done, phase=phase)
    update(draft, stores={**storage.stores, storage.backend: store},
           writes=tuple(finished if w.id == write.id else w for w in storage.writes))
    return draft.freeze(), pages

