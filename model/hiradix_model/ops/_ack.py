"""Acknowledging finished copies, shared by writing_check and loading_check."""

from __future__ import annotations

from dataclasses import replace

from hiradix_model.ops._draft import Draft, add_lock, require
from hiradix_model.ops.storage._common import is_attached, issue_write
from hiradix_model.state import Direction, State


def acknowledge(state: State, direction: Direction, count: int) -> tuple[State, int]:
    """Complete the oldest ``count`` copies in ``direction`` (FIFO within a direction)."""
    queued = [t for t in state.pending if t.direction == direction]
    require(isinstance(count, int) and 0 <= count <= len(queued), "count",
            f"must be an int in [0, {len(queued)}] (copies in flight), got {count!r}")
    draft = Draft(state)
    for transfer in queued[:count]:
        if direction == "d2h":
            source, target = draft.device_kv, draft.host_kv
        else:
            source, target = draft.host_kv, draft.device_kv
        for src, dst in zip(transfer.src, transfer.dst, strict=True):
            content = source.get(src)
            if content is None:
                target.pop(dst, None)
            else:
                target[dst] = content
        if direction == "h2d":
            for page in transfer.pages:
                record = draft.page(page)
                draft.set_page(page, replace(record, host_protect=record.host_protect - 1))
        add_lock(draft, transfer.lock, -1)
        draft.pending.remove(transfer)
        if direction == "d2h" and is_attached(draft):
            # The host copy has landed: back it up to storage (spec/09, S-R1).
            issue_write(draft, transfer.pages)
    return draft.freeze(), count
