"""The states where cache bugs live, as named predicates over the model's state.

``hiradix check`` counts, after every rule step, how many steps reached each of these
(beside the per-invariant counts of ``machine.EXERCISED``) and ``--require-coverage``
fails a campaign in which one of them was never reached. Each predicate reads the
model's abstract state only, so it means the same for every engine and every machine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from hiradix_model import Key, State
from hiradix_model.storage import timed_out


def _parent(key: Key, page_size: int) -> Key | None:
    return None if len(key.tokens) <= page_size else Key(key.tokens[:-page_size],
                                                         key.namespace)


def _host_only(state: State) -> Iterator[Key]:
    return (k for k, p in state.pages.items() if p.device is None)


def host_full(state: State) -> bool:
    """The host pool has no free slot: a backup or a write_back eviction must evict
    on host first, or fail."""
    return state.config.host_slots > 0 and not state.host_free


def host_all_protected(state: State) -> bool:
    """Every page with a host copy is protected: host eviction can take nothing."""
    hosted = [p for p in state.pages.values() if p.host is not None]
    return bool(hosted) and all(p.host_protect for p in hosted)


def device_full(state: State) -> bool:
    """No free device slot: the next allocation must evict."""
    return not state.device_free


def copies_in_flight(state: State) -> bool:
    """Two copies or more in flight at once (acknowledgement order matters)."""
    return len(state.pending) >= 2


def load_and_backup_in_flight(state: State) -> bool:
    """A load and a backup in flight at once."""
    return len({t.direction for t in state.pending}) == 2


def host_only_branching(state: State) -> bool:
    """A host-only page with two host-only children or more: host eviction must pick
    leaves of a branching host-only subtree (issue 17)."""
    ps = state.config.page_size
    children: dict[Key, int] = {}
    for key in _host_only(state):
        parent = _parent(key, ps)
        if parent is not None and state.pages[parent].device is None:
            children[parent] = children.get(parent, 0) + 1
    return any(count >= 2 for count in children.values())


def prefetch_in_flight(state: State) -> bool:
    """A prefetch whose I/O has not finished."""
    return state.storage is not None and any(
        p.phase in ("querying", "fetching") for p in state.storage.prefetches)


def prefetch_timed_out_while_running(state: State) -> bool:
    """A prefetch still running past its timeout: the progress check must give up on
    it while the I/O still owns slots."""
    storage = state.storage
    if storage is None:
        return False
    tokens = state.config.page_size
    return any(p.phase in ("querying", "fetching")
               and timed_out(storage.settings, state.clock - p.start, tokens * len(p.pages))
               for p in storage.prefetches)


def prefetch_revoked(state: State) -> bool:
    """A revoked prefetch waits in the revoke queue."""
    return state.storage is not None and bool(state.storage.revoke_queue)


def storage_write_in_flight(state: State) -> bool:
    """A write to storage still running: its pages are protected on host."""
    return state.storage is not None and any(w.phase == "running"
                                             for w in state.storage.writes)


def slots_awaiting_release(state: State) -> bool:
    """Host slots the I/O gave back and nobody has freed yet."""
    return state.storage is not None and bool(state.storage.release_queue)


THREADED_IO_STEP = "threaded I/O step"


def counted_by_the_machine(state: State) -> bool:
    """A state of the run, not of the model (``THREADED_IO_STEP``: a step in which a
    result of the threaded I/O, let through the controlled backend's gate, was
    reported): the storage machine counts it itself."""
    return False


COVERAGE: dict[str, Callable[[State], bool]] = {
    "device full": device_full,
    "host full": host_full,
    "host pages all protected": host_all_protected,
    "two copies in flight": copies_in_flight,
    "load and backup in flight": load_and_backup_in_flight,
    "branching host-only subtree": host_only_branching,
    "prefetch in flight": prefetch_in_flight,
    "prefetch timed out while running": prefetch_timed_out_while_running,
    "prefetch revoked, queued": prefetch_revoked,
    "storage write in flight": storage_write_in_flight,
    "host slots awaiting release": slots_awaiting_release,
    THREADED_IO_STEP: counted_by_the_machine,
}
# Reached only with a storage tier attached: a campaign without one does not miss them.
STORAGE_ONLY = frozenset({"prefetch in flight", "prefetch timed out while running",
                          "prefetch revoked, queued", "storage write in flight",
                          "host slots awaiting release", THREADED_IO_STEP})


def tally_states(counts: Counter[str], state: State) -> None:
    """Count ``state`` in every interesting state it is in."""
    for name, reached in COVERAGE.items():
        if reached(state):
            counts[name] += 1
