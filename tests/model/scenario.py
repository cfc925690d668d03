"""A small, fixed, reachable state with something of everything in it.

Two host-only pages, a chain being loaded back (h2d in flight, protected, locked), a
page whose backup is in flight (d2h, locked), a caller lock and caller-held slots.
The invariant tests corrupt copies of it one field at a time.
"""

from __future__ import annotations

from hiradix_model import Backup, Config, Key, State, StorageSettings, initial, ops

CONFIG = Config(page_size=2, device_slots=12, host_slots=12, write_policy="write_through",
                eviction="lru", load_back_threshold=0)
LOADED = Key((1, 2, 3, 4))  # and its parent (1, 2): on device again, h2d in flight
HOST_ONLY = Key((7, 8))  # evicted from device, host copy only
BACKING_UP = Key((5, 6))  # on device, d2h in flight


def _insert(state: State, key: Key, now: int, host_slots: tuple[int, ...]) -> State:
    slots = tuple(sorted(state.device_free)[: len(key.tokens)])
    state, _ = ops.alloc(state, key, 0, slots)
    return ops.insert(state, key, slots, now, backup=Backup((), host_slots))[0]


def build() -> State:
    s = initial(CONFIG)
    s = _insert(s, LOADED, 1, (0, 1, 2, 3))
    s = _insert(s, HOST_ONLY, 2, (4, 5))
    s, _ = ops.writing_check(s, 2)
    s, _ = ops.evict(s, 6, tuple(ops.Victim(k) for k in (LOADED, Key((1, 2)), HOST_ONLY)))
    s = _insert(s, BACKING_UP, 3, (6, 7))  # its copy stays in flight
    s, _ = ops.load_back(s, LOADED, None, device_slots=(8, 9, 10, 11))
    s, _ = ops.inc_lock_ref(s, BACKING_UP)  # a caller's lock
    s, _ = ops.alloc(s, Key((9, 9)), 0, tuple(sorted(s.device_free)[:2]))  # held slots
    return s


# -- With a storage tier (spec/09) ----------------------------------------------------------

STORAGE = StorageSettings(prefetch_threshold=2, prefetch_policy="best_effort",
                          timeout_base=4, timeout_per_ki_token=1024, timeout_max=10,
                          prefetch_token_limit=64)
IDENTITY = ("model-a", "bf16", "layer_first")


def build_storage(base: State | None = None) -> State:
    """``build()`` (or ``base``, a state built by it) with a backend attached and one of
    each storage holder.

    BACKING_UP's backup landed, so its storage write ran and sits acknowledged in the
    ack queue (the page stays protected); prefetch "landed" fetched BACKING_UP from
    storage and waits for check_prefetch_progress; prefetch "revoked" (anchored at
    BACKING_UP) found no hit, so its slots wait in the release queue.
    """
    start = build() if base is None else base
    s, _ = ops.attach_storage(start, "memory", identity=IDENTITY, settings=STORAGE)
    s, _ = ops.writing_check(s, 1)  # issues the storage write of BACKING_UP
    s, _ = ops.io_storage_write(s, 1)
    s, _ = ops.prefetch_from_storage(s, "landed", BACKING_UP, None, s.clock,
                                     host_slots=(8, 9))
    s, _ = ops.io_prefetch_query(s, "landed", 1)
    s, _ = ops.io_prefetch_fetch(s, "landed", 1)
    s, _ = ops.prefetch_from_storage(s, "revoked", Key((5, 6, 9, 9)), BACKING_UP, s.clock,
                                     host_slots=(10, 11))
    s, _ = ops.io_prefetch_query(s, "revoked", 0)
    return s
