"""drain_storage_queues (spec/09-storage.md, 9.4): the scheduler's side of the three
control queues the storage I/O fills (SGLang ``drain_storage_control_queues``)."""

from __future__ import annotations

from hiradix_model.errors import PreconditionError  # noqa: F401 (contracts)
from hiradix_model.invariants import check  # noqa: F401 (used by the contracts)
from hiradix_model.ops._draft import Draft, require
from hiradix_model.ops.storage._common import end_prefetch, release_write, storage_of, update
from hiradix_model.state import State


def drain_storage_queues(
    state: State,
    *,
    revokes: int | None = None,
    acks: int | None = None,
    releases: int | None = None,
) -> tuple[State, tuple[int, int, int]]:
    """Process the oldest ``revokes``, ``acks`` and ``releases`` entries (None: all).

    Revokes end revoked prefetches; acks release finished writes' host protection;
    releases put the slots the I/O gave back on the host free list. The counts are what
    the scheduler saw queued (entries may arrive after it looked); returns them.

    pre: not check(state)
    post: not check(__return__[0])
    post: state.storage is not None or __return__ == (state, (0, 0, 0))
    raises: PreconditionError
    """
    if state.storage is None:
        for name, count in (("revokes", revokes), ("acks", acks), ("releases", releases)):
            require(count in (None, 0), name, "no storage queue exists")
        return state, (0, 0, 0)
    storage = state.storage
    acked = sum(w.phase == "acked" for w in storage.writes)
    for name, count, queued in (("revokes", revokes, len(storage.revoke_queue)),
                                ("acks", acks, acked),
                                ("releases", releases, len(storage.release_queue))):
        require(count is None or (isinstance(count, int) and 0 <= count <= queued), name,
                f"must be None or an int in [0, {queued}] (entries queued), got {count!r}")
    draft = Draft(state)
    done = drain_in(draft, revokes, acks, releases)
    return draft.freeze(), done


def drain_in(draft: Draft, revokes: int | None, acks: int | None,
             releases: int | None) -> tuple[int, int, int]:
    """The body of drain_storage_queues, on a draft (detach drains everything first)."""
    storage = storage_of(draft)
    revoked = storage.revoke_queue[:revokes]
    for prefetch_id in revoked:
        # A revoked prefetch that check_prefetch_progress already ended is gone: skip it.
        prefetch = next((p for p in storage_of(draft).prefetches if p.id == prefetch_id), None)
        if prefetch is not None:
            end_prefetch(draft, prefetch)
    update(draft, revoke_queue=storage.revoke_queue[len(revoked):])
    finished = [w for w in storage.writes if w.phase == "acked"][:acks]
    for write in finished:
        release_write(draft, write)
    queue = storage_of(draft).release_queue
    freed = queue[:releases]
    draft.host_free.update(freed)
    update(draft, release_queue=queue[len(freed):])
    return len(revoked), len(finished), len(freed)
