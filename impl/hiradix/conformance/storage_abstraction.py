"""The refinement mapping of the storage tier (spec/09, 9.2): a ``StorageTier`` as the
model's ``StorageState``.

- A stored hash maps to the ``StorageId`` it was computed from; the conformance machine
  knows every key it hashed (``names``), so the map is exact (spec/09, "Page identity").
  Stored content is taken relative to the model, as ``host_kv`` is: a page the backend
  holds keeps the model's content for it, and a page the model does not know becomes
  ``CORRUPT`` (the states then differ). The bytes themselves are checked where they can
  be seen: a fetched page inserted into the tree is a host page, whose bytes the main
  abstraction decodes (INV-PREFETCH-INTEGRITY).
- A prefetch whose I/O has not reported is ``querying``; a prefetch the tier ended or
  stopped while its I/O ran has already queued the slots past its landed pages (DEV-S12),
  so the model's release queue is the tier's, busy slots included.
"""

from __future__ import annotations

from hiradix.storage.backend import StorageBackend
from hiradix.storage.tier import StorageTier, TierSettings
from hiradix_model import Key, State, StorageId, StorageSettings, StorageState
from hiradix_model.storage import Prefetch, StorageWrite

CORRUPT_CONTENT = (Key((-1,), "<corrupt>"),)


def settings_of(settings: TierSettings) -> StorageSettings:
    return StorageSettings(
        prefetch_threshold=settings.prefetch_threshold,
        prefetch_policy=settings.prefetch_policy,
        timeout_base=settings.timeout_base,
        timeout_per_ki_token=settings.timeout_per_ki_token,
        timeout_max=settings.timeout_max,
        prefetch_token_limit=settings.prefetch_token_limit,
    )


def page_key(tokens: tuple[int, ...], namespace: str | None, pages: int,
             page_size: int) -> Key:
    return Key(tokens[:pages * page_size], namespace)


def abstract_storage(tier: StorageTier, model: State, backend: StorageBackend | None,
                     identity: tuple[str, ...], settings: TierSettings | None,
                     names: dict[str, Key]) -> StorageState | None:
    """The model's view of ``tier``. ``backend``, ``identity`` and ``settings`` are the
    last attached ones (kept across a detach, as the model keeps them); ``names`` maps
    each page hash the machine computed to its page."""
    if backend is None or settings is None:
        return None
    size = tier.page_size
    known = {} if model.storage is None else model.storage.stores.get(backend.name, {})
    stored = {}
    for page_hash, page in names.items():
        if backend.has_page(page_hash):
            sid = StorageId(page, identity)
            stored[sid] = known.get(sid, CORRUPT_CONTENT)
    state = tier.state
    prefetches = []
    for prefetch in sorted(state.prefetches.values(), key=lambda p: p.id):
        tokens, namespace = prefetch.key.tokens, prefetch.key.namespace
        reserved = tuple(prefetch.reserved.tolist())
        phase = "querying" if prefetch.io_running and not prefetch.terminated \
            else prefetch.phase
        prefetches.append(Prefetch(
            id=prefetch.id, request=prefetch.request,
            anchor=None if prefetch.anchor == 0 else page_key(tokens, namespace,
                                                              prefetch.anchor, size),
            pages=tuple(page_key(tokens, namespace, prefetch.anchor + i + 1, size)
                        for i in range(prefetch.pages)),
            reserved=reserved, slots=reserved[:prefetch.owned * size], start=prefetch.start,
            phase=phase, hit_pages=prefetch.hit_pages, landed=prefetch.landed,
            terminated=prefetch.terminated))
    writes = tuple(
        StorageWrite(write.id, tuple(page_key(run.key.tokens, run.key.namespace, run.end, size)
                                     for run in write.pages), write.done, write.phase)
        for write in sorted(state.writes.values(), key=lambda w: w.id))
    return StorageState(
        backend=backend.name if tier.attached else None,
        identity=identity,
        settings=settings_of(settings),
        # An empty store is an absent entry until the model has one (after a clear).
        stores={backend.name: stored} if stored or (
            model.storage is not None and backend.name in model.storage.stores) else {},
        prefetches=tuple(prefetches),
        writes=writes,
        revoke_queue=tuple(state.revoke_queue),
        release_queue=tuple(state.release_queue),
        occupied_tokens=state.occupied_tokens,
        loaded_tokens=dict(state.loaded_tokens),
        release_log=tuple(state.release_log),
        next_id=state.next_id,
    )
