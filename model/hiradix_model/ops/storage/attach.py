"""attach_storage, detach_storage and clear_storage (spec/09-storage.md, 9.4)."""

from __future__ import annotations

from dataclasses import replace

from hiradix_model.errors import PreconditionError  # noqa: F401 (contracts)
from hiradix_model.invariants import check  # noqa: F401 (used by the contracts)
from hiradix_model.ops._draft import Draft, require
from hiradix_model.ops.storage._common import (
    end_prefetch,
    give_up,
    release_write,
    storage_of,
    update,
)
from hiradix_model.ops.storage.queues import drain_in
from hiradix_model.state import State
from hiradix_model.storage import StorageSettings, StorageState

DEFAULT_SETTINGS = StorageSettings()


def attach_storage(
    state: State,
    backend: str,
    *,
    identity: tuple[str, ...] = (),
    settings: StorageSettings = DEFAULT_SETTINGS,
    retained: bool = True,
) -> tuple[State, str]:
    """Attach a storage backend, or update the prefetch policy of the attached one.

    Validation comes first and changes nothing. With ``backend`` already attached only
    ``settings.prefetch_policy`` is applied; a different backend or identity is refused
    until the attached one is detached. ``retained`` reports whether the backend still holds what
    this cache wrote to it before (a file backend does; a fresh memory backend does not).

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[0].storage is not None and __return__[0].storage.backend == backend
    post: __return__[1] in ("attached", "policies updated")
    raises: PreconditionError
    """
    require(isinstance(backend, str) and backend != "", "backend", "must be a non-empty str")
    require(isinstance(identity, tuple) and all(isinstance(x, str) for x in identity),
            "identity", "must be a tuple of str")
    require(isinstance(settings, StorageSettings), "settings", "must be a StorageSettings")
    require(isinstance(retained, bool), "retained", "must be a bool")
    current = state.storage if state.storage is not None else StorageState()
    if current.backend is not None:
        require(current.backend == backend, "backend",
                f"{current.backend!r} is attached; detach it before attaching {backend!r}")
        # Another model's pages hash apart from the ones in flight (9.1, page identity).
        require(identity == current.identity, "identity",
                f"{current.identity!r} is attached; detach before attaching {identity!r}")
        policy = replace(current.settings, prefetch_policy=settings.prefetch_policy)
        return replace(state, storage=replace(current, settings=policy)), "policies updated"
    stores = dict(current.stores)
    if not retained:
        stores[backend] = {}
    attached = replace(current, backend=backend, identity=identity, settings=settings,
                       stores=stores)
    return replace(state, storage=attached), "attached"


def detach_storage(state: State) -> tuple[State, None]:
    """Drain the control queues, release every prefetch and backup, detach the backend.

    A prefetch's own slots go back to the free list (each exactly once); its landed
    pages are not inserted. A write's pages lose its protection; what it wrote stays.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[0].storage is None or __return__[0].storage.backend is None
    post: state.storage is not None or __return__[0] is state
    """
    if state.storage is None:
        return state, None
    draft = Draft(state)
    drain_in(draft, None, None, None)
    for prefetch in storage_of(draft).prefetches:
        end_prefetch(draft, give_up(draft, prefetch, 0, "free"))
    for write in storage_of(draft).writes:
        release_write(draft, write)
    update(draft, backend=None)
    return draft.freeze(), None


def clear_storage(state: State) -> tuple[State, bool]:
    """Empty the attached backend; False (nothing changes) when none is attached.

    Ongoing prefetches keep their slots; pages they have not fetched yet are now misses.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] == (state.storage is not None and state.storage.backend is not None)
    post: __return__[0].storage is None or not __return__[0].storage.stored
    """
    storage = state.storage
    if storage is None or storage.backend is None:
        return state, False
    stores = {**storage.stores, storage.backend: {}}
    return replace(state, storage=replace(storage, stores=stores)), True
