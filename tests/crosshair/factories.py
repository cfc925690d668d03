"""Symbolic *reachable* model states and keys for CrossHair (see plugin.py).

CrossHair cannot invent a State that satisfies every invariant by solving for its
fields, so this plugin teaches it to build one the way the cache does: from the empty
state of a small configuration, through a short request sequence whose tokens,
namespaces and lengths are symbolic. Every State CrossHair hands to an operation is
therefore reachable, and the solver still branches on every token comparison.

"""

from __future__ import annotations

import random

from crosshair import SymbolicFactory, deep_realize, register_patch, register_type
from crosshair.condition_parser import NoEnforce
from crosshair.tracers import NoTracing, ResumedTracing

from hiradix_model import (
    PREFETCH_POLICIES,
    Config,
    Key,
    State,
    StorageSettings,
    choosers,
    initial,
    invariants,
    storage_choosers,
)
from hiradix_model import flat as checked_flat
from hiradix_model import hybrid as checked_hybrid
from hiradix_model import mamba as checked_mamba
from hiradix_model import ops as checked_ops
from hiradix_model.config import STRATEGIES, WRITE_POLICIES
from hiradix_model.flat import FlatConfig, FlatState
from hiradix_model.flat import invariants as flat_invariants
from hiradix_model.hybrid import SwaConfig, SwaState
from hiradix_model.hybrid import invariants as swa_invariants
from hiradix_model.hybrid.state import swa_candidates
from hiradix_model.keys import page_keys
from hiradix_model.mamba import MambaConfig, MambaState
from hiradix_model.mamba import invariants as mamba_invariants
from hiradix_model.mamba.state import state_candidates

ALPHABET = (1, 2)
MAX_TOKENS = 4
MAX_REQUESTS = 3


class _Unchecked:
    """The operations without contract enforcement: building a state is not the analysis
    (each operation's own contract is checked when CrossHair analyses it directly)."""

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return NoEnforce(getattr(checked_ops, name))


ops = _Unchecked()


class _UncheckedHybrid:
    """The hybrid operations (spec/13) without contract enforcement, as ``_Unchecked``."""

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return NoEnforce(getattr(checked_hybrid, name))


hybrid = _UncheckedHybrid()


class _UncheckedMamba:
    """The (FULL, MAMBA) operations (spec/13m) without contract enforcement."""

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return NoEnforce(getattr(checked_mamba, name))


mamba = _UncheckedMamba()


def _choice(factory: SymbolicFactory, options: tuple, suffix: str):  # type: ignore[no-untyped-def]
    index = factory(int, suffix)
    for option_index, option in enumerate(options[:-1]):
        if index == option_index:
            return option
    return options[-1]


def make_key(factory: SymbolicFactory) -> Key:
    length = factory(int, "_len")
    tokens = []
    for position in range(MAX_TOKENS):
        if position >= length:
            break
        tokens.append(_choice(factory, ALPHABET, f"_tok{position}"))
    namespace = _choice(factory, (None, "ns"), "_ns")
    return Key(tuple(tokens), namespace)


def _request(state: State, key: Key, now: int, load: bool, keep_lock: bool) -> State:
    state, match = ops.match_prefix(state, key, now)
    if load and match.host_hit_tokens and match.last_host_page is not None:
        victims, slots = choosers.choose_load(state, match.last_host_page, None,
                                              random.Random(0))
        state, _ = ops.init_load_back(state, match.last_host_page, None,
                                      device_victims=victims, device_slots=slots)
        return state
    if keep_lock and match.last_device_page is not None:
        return ops.inc_lock_ref(state, match.last_device_page)[0]
    cached = len(match.device_slots)
    need = len(key.tokens) - cached
    ps = state.config.page_size
    whole = -(-need // ps) * ps  # an allocator hands out whole pages (spec/03, R7)
    if whole > len(state.device_free):
        shortfall = whole - len(state.device_free)
        state, _ = ops.evict(state, shortfall, choosers.choose_evict(state, shortfall,
                                                                     random.Random(0)))
        state, match = ops.match_prefix(state, key, now)  # the eviction may have taken some
        cached = len(match.device_slots)
        need = len(key.tokens) - cached
        whole = -(-need // ps) * ps
    if whole > len(state.device_free):
        return state
    new = choosers.free_pages(state.device_free, need, random.Random(0), ps)
    state, _ = ops.alloc(state, key, cached, new)
    slots = match.device_slots + new[:need]
    backup = choosers.choose_insert_backup(state, key, slots, now, random.Random(0))
    state, _ = ops.insert(state, key, slots, now, backup=backup)
    return ops.free(state, tuple(s for s in new if s in state.held))[0]


def make_state(factory: SymbolicFactory) -> State:
    page_size = _choice(factory, (1, 2), "_page_size")
    config = Config(
        page_size=page_size,
        device_slots=4 * page_size,
        host_slots=4 * page_size,
        write_policy=_choice(factory, WRITE_POLICIES, "_policy"),
        eviction=_choice(factory, STRATEGIES, "_strategy"),
        load_back_threshold=_choice(factory, (0, 2), "_threshold"),
    )
    state = initial(config)
    storage = _choice(factory, (False, True), "_storage")
    if storage:
        settings = StorageSettings(
            prefetch_threshold=_choice(factory, (0, 2), "_prefetch_threshold"),
            prefetch_policy=_choice(factory, PREFETCH_POLICIES, "_prefetch_policy"),
            timeout_base=2, timeout_per_ki_token=1024, timeout_max=4, prefetch_token_limit=64)
        state, _ = ops.attach_storage(state, "memory", settings=settings)
    requests = factory(int, "_requests")
    for index in range(MAX_REQUESTS):
        if index >= requests:
            break
        load = _choice(factory, (False, True), f"_load{index}")
        keep_lock = _choice(factory, (False, True), f"_lock{index}")
        state = _request(state, make_key(factory), index + 1, load, keep_lock)
        if _choice(factory, (False, True), f"_ack{index}"):
            pending = sum(t.direction == "d2h" for t in state.pending)
            state, _ = ops.writing_check(state, pending)
        if _choice(factory, (False, True), f"_evict{index}"):
            state, _ = ops.evict(state, 2, choosers.choose_evict(state, 2, random.Random(0)))
    if storage:
        state = _storage_activity(factory, state, len(ALPHABET) + MAX_REQUESTS)
    # The solver picked this state (one per path); handing it over concrete keeps the
    # operation's own arguments symbolic without symbolic keys inside dicts.
    return deep_realize(state)


def _storage_activity(factory: SymbolicFactory, state: State, now: int) -> State:
    """Storage writes run and drain, then one prefetch ("p") taken some way through its
    life (spec/09): reserved, queried, fetched."""
    if _choice(factory, (False, True), "_writes"):
        while (left := storage_choosers.running_write(state)) is not None:
            state, _ = ops.io_storage_write(state, left)
        state, _ = ops.drain_storage_queues(state)
    if not _choice(factory, (False, True), "_prefetch"):
        return state
    key = make_key(factory)
    victims, slots = storage_choosers.choose_prefetch(state, key, None, random.Random(0))
    state, reserved = ops.prefetch_from_storage(state, "p", key, None, now,
                                                host_victims=victims, host_slots=slots)
    if not reserved or not _choice(factory, (False, True), "_query"):
        return state
    hits = storage_choosers.hits_available(state, "p")
    state, revoked = ops.io_prefetch_query(state, "p", hits)
    if revoked or not _choice(factory, (False, True), "_fetch"):
        return state
    remaining, _ = storage_choosers.pages_to_fetch(state, "p")
    return ops.io_prefetch_fetch(state, "p", remaining)[0]


def _swa_request(state: SwaState, key: Key, past: int, keep: int) -> SwaState:
    """A request as spec/13 13.4 runs it, taking the lowest free slots of each pool;
    ``keep``: 1 holds it running, 2 also with its window released early."""
    ps = state.config.page_size
    match = hybrid.match_prefix(state, key)
    state = hybrid.inc_lock_ref(state, match.last_page)
    cached = len(match.full_slots)
    whole = -(-(len(key.tokens) - cached) // ps) * ps
    if whole > len(state.full_free) or whole > len(state.swa_free):
        return hybrid.dec_lock_ref(state, match.last_page, False)
    full = tuple(sorted(state.full_free)[:whole])
    state = hybrid.alloc(state, key, cached, full, tuple(sorted(state.swa_free)[:whole]))
    aligned = len(key.tokens) - len(key.tokens) % ps
    evicted = max(cached, min(past * ps, aligned))
    if evicted > cached:
        state = hybrid.free_swa(state, full[:evicted - cached])
    slots = match.full_slots + full[:len(key.tokens) - cached]
    # A locked tombstone (its window released early) that heals keeps its full slots.
    kept = frozenset(
        k for k in page_keys(key, ps) if k in state.pages and not state.pages[k].live
        and state.pages[k].lock and len(k.tokens) - ps >= max(evicted, cached))
    state, _ = hybrid.insert(state, key, slots, evicted, kept)
    leftover = tuple(f for f in full if f in state.held)
    if leftover:
        state = hybrid.free(state, leftover)
    state = hybrid.dec_lock_ref(state, match.last_page, False)
    if keep:
        page = hybrid.match_prefix(state, key).last_page
        state = hybrid.inc_lock_ref(state, page)
        if keep == 2:
            state = hybrid.dec_swa_lock(state, page)
        if keep == 3:  # a load back's lock of its anchor's device path (13.3 inc_path_lock)
            cached = [k for k in page_keys(key, ps) if k in state.pages]
            state = hybrid.dec_lock_ref(state, page, False)
            state = hybrid.inc_path_lock(state, cached[-1] if cached else None)
    return state


def make_swa_state(factory: SymbolicFactory) -> SwaState:
    """A reachable hybrid state: requests, some held running, SWA evictions between."""
    page_size = _choice(factory, (1, 2), "_page_size")
    config = SwaConfig(page_size=page_size, full_slots=6 * page_size,
                       swa_slots=3 * page_size, window=_choice(factory, (1, 2, 3), "_window"))
    state = checked_hybrid.initial(config)
    requests = factory(int, "_requests")
    for index in range(MAX_REQUESTS):
        if index >= requests:
            break
        past = _choice(factory, (0, 1, 2), f"_past{index}")
        keep = _choice(factory, (0, 1, 2, 3), f"_keep{index}")
        state = _swa_request(state, make_key(factory), past, keep)
        candidates = sorted(swa_candidates(state), key=lambda k: (-len(k.tokens), k.tokens))
        if candidates and _choice(factory, (False, True), f"_evict{index}"):
            state, _ = hybrid.evict_swa(state, page_size, candidates[:1])
    return deep_realize(state)


def _mamba_request(state: MambaState, key: Key, keep: bool) -> MambaState:
    """A request as spec/13m 13m.4 runs it, taking the lowest free slots of each pool."""
    ps = state.config.page_size
    if not state.state_free or len(key.tokens) < ps:
        return state
    key = Key(key.tokens[:len(key.tokens) - len(key.tokens) % ps], key.namespace)
    match = mamba.match_prefix(state, key)
    slot = min(state.state_free)
    state = (mamba.fork(state, match.last_page, slot) if match.last_page is not None
             else mamba.alloc_state(state, slot, Key((), key.namespace)))
    state = mamba.inc_lock_ref(state, match.last_page, True)
    cached = len(match.full_slots)
    need = len(key.tokens) - cached
    if need > len(state.full_free):
        state = mamba.dec_lock_ref(state, match.last_page, False)
        return mamba.free_state(state, slot)
    full = tuple(sorted(state.full_free)[:need])
    state = mamba.alloc(state, key, cached, full)
    state = mamba.write_state(state, slot, key)
    state, _, taken = mamba.insert(state, key, match.full_slots + full, slot)
    leftover = tuple(f for f in full if f in state.held_full)
    if leftover:
        state = mamba.free(state, leftover)
    if not taken:
        state = mamba.free_state(state, slot)
    state = mamba.dec_lock_ref(state, match.last_page, False)
    if keep:
        state = mamba.inc_lock_ref(state, mamba.match_prefix(state, key).last_page, True)
    return state


def make_mamba_state(factory: SymbolicFactory) -> MambaState:
    """A reachable (FULL, MAMBA) state: requests, some held running, state evictions."""
    page_size = _choice(factory, (1, 2), "_page_size")
    config = MambaConfig(page_size=page_size, full_slots=6 * page_size, state_slots=3)
    state = checked_mamba.initial(config)
    requests = factory(int, "_requests")
    for index in range(MAX_REQUESTS):
        if index >= requests:
            break
        keep = _choice(factory, (False, True), f"_keep{index}")
        state = _mamba_request(state, make_key(factory), keep)
        candidates = sorted(state_candidates(state), key=lambda k: (-len(k.tokens), k.tokens))
        if candidates and _choice(factory, (False, True), f"_evict{index}"):
            state, _ = mamba.evict_states(state, 1, candidates[:1])
    return deep_realize(state)


def make_flat_state(factory: SymbolicFactory) -> FlatState:
    """A reachable flat-tier state (spec/15 15.5): stores (writes landing in put order)
    and pinned lookups, some released, a clear now and then."""
    config = FlatConfig(chunk_tokens=_choice(factory, (1, 2), "_chunk"),
                        layers=_choice(factory, (1, 2), "_layers"), cpu_objects=4,
                        disk_objects=_choice(factory, (3, 4), "_disk"))
    state = checked_flat.initial(config)
    requests = factory(int, "_requests")
    for index in range(MAX_REQUESTS):
        if index >= requests:
            break
        key = make_key(factory)
        if key.namespace is None and not checked_flat.store_races(state, key):
            arrivals = checked_flat.in_put_order(state, key)
            state = NoEnforce(checked_flat.store)(state, key, arrivals)[0]
        if _choice(factory, (False, True), f"_pin{index}"):
            state = NoEnforce(checked_flat.lookup)(state, key, True, f"l{index}")[0]
            if _choice(factory, (False, True), f"_unpin{index}"):
                state = NoEnforce(checked_flat.unpin)(state, f"l{index}")
        if _choice(factory, (False, True), f"_clear{index}"):
            state = NoEnforce(checked_flat.clear)(state)[0]
    return deep_realize(state)


def _traced(build):  # type: ignore[no-untyped-def]
    # CrossHair calls creators with tracing off; the builders branch on symbolic values,
    # which needs tracing back on.
    def creator(factory: SymbolicFactory):  # type: ignore[no-untyped-def]
        with ResumedTracing():
            return build(factory)

    return creator


def _concrete_check(state: State) -> tuple[str, ...]:
    """invariants.check on the realized state, outside the tracer.

    The invariants read every page; traced symbolically that costs more than a path's
    budget. Realizing first commits the solver to this path's values, which is sound
    for a check (it decides the contract on exactly the state this path produced).
    """
    with NoTracing():
        return _original_check(deep_realize(state))


_original_check = invariants.check


def _concrete_swa_check(state: SwaState) -> list[str]:
    """swa_invariants.check on the realized state, outside the tracer (as above)."""
    with NoTracing():
        return _original_swa_check(deep_realize(state))


_original_swa_check = swa_invariants.check


def _concrete_mamba_check(state: MambaState) -> list[str]:
    """mamba_invariants.check on the realized state, outside the tracer (as above)."""
    with NoTracing():
        return _original_mamba_check(deep_realize(state))


_original_mamba_check = mamba_invariants.check


def _concrete_flat_check(state: FlatState) -> list[str]:
    """flat_invariants.check on the realized state, outside the tracer (as above)."""
    with NoTracing():
        return _original_flat_check(deep_realize(state))


_original_flat_check = flat_invariants.check


def register() -> None:
    register_patch(invariants.check, _concrete_check)
    register_type(Key, _traced(make_key))
    register_type(State, _traced(make_state))
    register_patch(swa_invariants.check, _concrete_swa_check)
    register_type(SwaState, _traced(make_swa_state))
    register_patch(mamba_invariants.check, _concrete_mamba_check)
    register_type(MambaState, _traced(make_mamba_state))
    register_patch(flat_invariants.check, _concrete_flat_check)
    register_type(FlatState, _traced(make_flat_state))
