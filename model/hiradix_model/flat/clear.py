"""clear (spec/15, 15.5.3): drop the CPU tier's unpinned objects; the disk tier stays."""

from __future__ import annotations

from dataclasses import replace

from hiradix_model.flat.invariants import check  # noqa: F401 (contracts)
from hiradix_model.flat.state import FlatState


def clear(state: FlatState) -> tuple[FlatState, int]:
    """Drop every unpinned object of the CPU tier (local_cpu_backend.py:953-973); the
    disk tier has no clear (storage_manager.py:1141-1148). The objects dropped.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[0].disk == state.disk
    post: all(e.pins > 0 for e in __return__[0].cpu.values())
    """
    kept = {obj: entry for obj, entry in state.cpu.items() if entry.pins > 0}
    dropped = len(state.cpu) - len(kept)
    return replace(state, cpu=kept, allocations=state.allocations - dropped), dropped
