"""A load back an engine made, as 13.8a's ``load_back`` (spec/13).

The machine matches a key whose path reaches KV on the host only (a host-only page, or
a device tombstone's SWA host copy), then has the engine act on the host hit as its
server does (``HostLoadingSwaEngine.load_back``). Where the load
goes is the engine's choice (the device slots it allocates); what it loads is not: the
host-only pages of the anchor's path (full KV) and the pages of the anchor's window
without device SWA KV (SWA KV), where the anchor is where 13.8a's ``match_prefix_host``
ends. ``expected_load`` reads the engine's slot choices off its state after the call,
has the model make the same load, and says what in the engine's report disagrees; the
machine then compares the whole two-tier state with the model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hiradix.conformance.host_judge import HostTier
from hiradix_model import Key
from hiradix_model import hybrid as model
from hiradix_model.errors import IllegalChoice, PreconditionError
from hiradix_model.hybrid import SwaState
from hiradix_model.hybrid.state import root_path
from hiradix_model.keys import page_keys


@dataclass(frozen=True)
class LoadPlan:
    """What a load back of ``key``'s match must do from a state (13.8a)."""

    anchor: Key | None  # where match_prefix_host ends: the request's prefix after the load
    device_end: Key | None  # where the device match ends: the prefix without a load
    full: tuple[Key, ...]  # pages whose full KV comes back, root first
    swa: tuple[Key, ...]  # pages whose SWA KV comes back, root first
    # The most DEV-H12 may add: the run right above the window's top, where that page is
    # loaded, of pages with an SWA host copy and no device SWA KV, nearest first.
    beyond: tuple[Key, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.full and not self.swa

    @property
    def hit_tokens(self) -> int:
        """The tokens the request's prefix grows by: from the device match to the anchor."""
        start = 0 if self.device_end is None else len(self.device_end.tokens)
        return 0 if self.anchor is None else len(self.anchor.tokens) - start

    def fits(self, state: SwaState) -> bool:
        """Whether both device pools have the slots the load takes, free already, with
        room in the SWA pool for SGLang's whole-node load too (DEV-H12, which declines a
        load whose window fits and whose nodes do not): the load then evicts nothing."""
        ps = state.config.page_size
        return (ps * len(self.full) <= len(state.full_free)
                and ps * (len(self.swa) + len(self.beyond)) <= len(state.swa_free))

    def full_short(self, state: SwaState) -> int:
        """The full tokens the load must evict first (SGLang's ``_load_back_transfers``
        evicts the shortfall, unified_radix_cache.py:1901-1908)."""
        return max(0, state.config.page_size * len(self.full) - len(state.full_free))

    def swa_tokens(self, state: SwaState, extra: int) -> int:
        """The SWA slots the load allocates where DEV-H12 adds ``extra`` pages of
        ``beyond`` (its SWA walk covers whole nodes, components/swa.py:1170-1203)."""
        return state.config.page_size * (len(self.swa) + extra)


def plan_for_key(state: SwaState, key: Key) -> LoadPlan:
    """The load back of ``key``'s match with host hits in ``state``."""
    anchor = model.match_prefix_host(state, key).last_page
    full, swa = ([], []) if anchor is None else model.load_plan(state, anchor)
    beyond: list[Key] = []
    if anchor is not None and swa and swa[0] == model.window(state, anchor)[-1]:
        for page in root_path(state, anchor)[state.config.window_pages:]:
            host, device = state.host.get(page), state.pages.get(page)
            if host is None or host.swa is None or (device is not None and device.live):
                break
            beyond.append(page)
    return LoadPlan(anchor=anchor, device_end=model.match_prefix(state, key).last_page,
                    full=tuple(full), swa=tuple(swa), beyond=tuple(beyond))


def expected_load(before: SwaState, plan: LoadPlan, loaded: int, page: Key | None,
                  after: SwaState) -> tuple[SwaState, list[str]]:
    """The model's state after ``plan``'s load from ``before``, with the device slots the
    engine chose (read off ``after``), and what is wrong with the engine's report that it
    loaded ``loaded`` full tokens and left the request's prefix ending at ``page``. With
    nothing to load, the state must not change and the prefix is the device match's."""
    if plan.empty:
        if (loaded, page) == (0, plan.device_end):
            return before, []
        return before, [f"nothing to load back (the match ends on the device at "
                        f"{plan.device_end}), yet the engine reports {loaded} tokens loaded "
                        f"and a prefix ending at {page}"]
    problems = []
    if (loaded, page) != (plan.hit_tokens, plan.anchor):
        problems.append(f"load back to {plan.anchor}: the engine reports {loaded} tokens "
                        f"and a prefix ending at {page}; the model {plan.hit_tokens} tokens, "
                        f"ending at {plan.anchor}")
    missing = [k.tokens for k in plan.full if k not in after.pages]
    missing += [k.tokens for k in plan.swa if k not in after.pages or not after.pages[k].live]
    if missing:
        return before, [
            *problems,
            f"load back to {plan.anchor} (full KV of {[k.tokens for k in plan.full]}, SWA "
            f"KV of {[k.tokens for k in plan.swa]}, both pools with room): pages {missing} "
            "are not on the device after it"]
    full = tuple(s for k in plan.full for s in after.pages[k].full)
    swa = tuple(s for k in plan.swa for s in after.pages[k].swa or ())
    assert plan.anchor is not None  # a plan with pages has an anchor
    try:
        expected = model.load_back(before, plan.anchor, full, swa)
    except PreconditionError as refused:
        return before, [*problems, f"load back to {plan.anchor} into full slots {full}, "
                                   f"SWA slots {swa}: the model refuses it: {refused}"]
    expected, whole_node = _whole_node_swa(before, plan, after, expected)
    return expected, problems + whole_node


def dev_h12_pages(before: SwaState, plan: LoadPlan, after: SwaState) -> list[Key]:
    """The pages a load back gave device SWA KV beyond ``plan``'s (DEV-H12: SGLang
    loads the SWA KV of the whole node that covers the window's top), root first."""
    return sorted((k for k, p in after.pages.items() if p.live and k not in plan.swa
                   and not (k in before.pages and before.pages[k].live)),
                  key=lambda k: len(k.tokens))


def _whole_node_swa(before: SwaState, plan: LoadPlan, after: SwaState,
                    expected: SwaState) -> tuple[SwaState, list[str]]:
    """``expected`` with the DEV-H12 pages of the load given the SWA KV the engine loaded
    for them, and what is wrong with them: they must continue the load above the
    window's top page (``plan.beyond``), into SWA slots free before."""
    extra = dev_h12_pages(before, plan, after)
    if not extra:
        return expected, []
    if extra[::-1] != list(plan.beyond[:len(extra)]):
        return expected, [f"load back to {plan.anchor} gave device SWA KV to "
                          f"{[k.tokens for k in extra]}, which neither its window (loaded: "
                          f"{[k.tokens for k in plan.swa]}) nor the rest of the node "
                          "covering the window's top (DEV-H12) accounts for"]
    pages, swa_kv, problems = dict(expected.pages), dict(expected.swa_kv), []
    taken: set[int] = set()
    for key in extra:
        source, mine = before.host[key].swa, after.pages[key].swa
        assert source is not None and mine is not None  # a page of ``beyond``, now live
        pages[key] = replace(pages[key], swa=mine)
        # As the model's load: INV-SWA-HOST-CONTENT holds of the engine's host tier.
        swa_kv.update({d: before.host_swa_kv[h] for d, h in zip(mine, source, strict=True)})
        taken.update(mine)
    if not taken <= expected.swa_free:
        problems.append(f"DEV-H12 pages {[k.tokens for k in extra]} got SWA slots "
                        f"{sorted(taken - expected.swa_free)} that were not free")
    return replace(expected, pages=pages, swa_free=expected.swa_free - taken,
                   swa_kv=swa_kv), problems


HOST_TIER: HostTier[SwaState] = HostTier(
    ("host", "host_full_free", "host_swa_free", "host_full_kv", "host_swa_kv"))


def path_end(state: SwaState, plan: LoadPlan) -> Key | None:
    """The deepest page on the anchor's path that is on the device (None: none is)."""
    assert plan.anchor is not None  # a load short of slots has pages to load
    on_device = [k for k in page_keys(plan.anchor, state.config.page_size) if k in state.pages]
    return on_device[-1] if on_device else None


def window_held_past_match(state: SwaState, plan: LoadPlan) -> list[Key]:
    """The live device pages of the anchor's window outside the device match's. SGLang's
    lock of the anchor holds their SWA KV (it counts the window's nodes, tombstones and
    host-only ones included, components/swa.py:849-901); no lock of the model can hold a
    window that is not live, so a load short of slots with such pages is not judged."""
    assert plan.anchor is not None
    held = set(model.window(state, plan.device_end)) if plan.device_end is not None else set()
    return [k for k in model.window(state, plan.anchor)
            if k in state.pages and state.pages[k].live and k not in held]


def evicted_for_load(device: SwaState, plan: LoadPlan, victims: Sequence[Key], split: int,
                     extra: int, *, enough: bool = True) -> tuple[SwaState, bool]:
    """The device tier ``device`` after the evictions a load back short of slots makes,
    of ``victims`` in order, and whether the load goes on; ``extra``: the DEV-H12 pages
    the load's SWA transfer adds.

    What is locked meanwhile: the device match with its window (the scheduler's
    ``_lock_node(req.last_node)``, schedule_policy.py:1431) and the anchor's device path
    (the scheduler's lock of the best match, :1475, and the load's own,
    unified_radix_cache.py:1833), up to ``path_end``, which may lie past the device match:
    in the model ``inc_lock_ref`` of the one and ``inc_path_lock`` of the other (the SWA
    part of the anchor's lock adds nothing where ``window_held_past_match`` is empty).
    Then, as SGLang: the full shortfall's ``evict_for_alloc`` (the first ``split``
    victims, :1901-1904), the load called off if the full pool is still short
    (:1905-1908); then the SWA transfer's allocation, short of room, evicts its SWA
    shortfall (the rest, ``_evict_swa_for_device_alloc``, hybrid_pool_assembler.py:62-68,
    from hybrid_cache_controller.py:1884-1887), the load called off if the SWA pool is
    still short (:1888-1891). ``IllegalChoice`` where the model refuses the victims."""
    if not 0 <= split <= len(victims):
        raise IllegalChoice(f"split {split} outside the {len(victims)} victims")
    end = path_end(device, plan)
    locked = model.inc_path_lock(model.inc_lock_ref(device, plan.device_end), end)
    full_need = plan.full_short(device)
    state, freed = model.evict_for_alloc(locked, full_need, 0, victims[:split], split)
    goes_on = freed >= full_need
    if not goes_on and split < len(victims):
        raise IllegalChoice(f"the load was called off short of {full_need - freed} full "
                            "slots, yet its SWA walk took pages")
    if goes_on:
        swa = plan.swa_tokens(device, extra)
        state, _ = model.evict_for_alloc(state, 0, max(0, swa - len(state.swa_free)),
                                         victims[split:], 0, enough=enough)
        goes_on = len(state.swa_free) >= swa
    return model.dec_lock_ref(model.dec_lock_ref(state, end, True), plan.device_end,
                              False), goes_on


def called_off(plan: LoadPlan) -> LoadPlan:
    """``plan`` with nothing to load: what a load called off for want of room did."""
    return replace(plan, full=(), swa=(), beyond=())
