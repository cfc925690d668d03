"""A load back an engine made, as 13m.8b's ``load_back`` (spec/13m), for the Mamba machine.

As the SWA machine's (``conformance/hybrid/load_back.py``): the machine matches a key
whose path reaches host-only KV and has the engine act on the host hit as its server does
(``HostLoadingMambaEngine.load_back``). What it loads is the host-only pages of the
anchor's path (full KV) and, where the anchor holds no device state, the anchor's host
state, where the anchor is where 13m.8b's ``match_prefix_host`` ends; the device slots
are the engine's choice, read off its state after the call. A load that restores a state
also hands the request a copy of it (DEV-M14): the model's ``fork`` after its
``load_back``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hiradix.conformance.host_judge import HostTier
from hiradix_model import Key
from hiradix_model import mamba as model
from hiradix_model.errors import PreconditionError
from hiradix_model.keys import page_keys
from hiradix_model.mamba import MambaState


@dataclass(frozen=True)
class MambaLoadPlan:
    """What a load back of ``key``'s match must do from a state (13m.8b)."""

    anchor: Key | None  # where match_prefix_host ends: the request's prefix after the load
    device_end: Key | None  # where the device match ends: the prefix without a load
    full: tuple[Key, ...]  # pages whose full KV comes back, root first
    state: bool  # whether the anchor's state comes back (and a copy to the request)

    @property
    def empty(self) -> bool:
        return not self.full and not self.state

    @property
    def hit_tokens(self) -> int:
        """The tokens the request's prefix grows by: from the device match to the anchor."""
        start = 0 if self.device_end is None else len(self.device_end.tokens)
        return 0 if self.anchor is None else len(self.anchor.tokens) - start

    def fits(self, state: MambaState) -> bool:
        """Whether the full pool has the slots the load takes and the state pool two (the
        node's and the request's, DEV-M14), free already: the load evicts nothing."""
        return self.full_short(state) == 0 and self.states_fit(state)

    def states_fit(self, state: MambaState) -> bool:
        """Whether the state pool has the slots the load takes free already."""
        return (2 if self.state else 0) <= len(state.state_free)

    def full_short(self, state: MambaState) -> int:
        """The full tokens the load must evict first (SGLang's ``_load_back_transfers``
        evicts the shortfall, unified_radix_cache.py:1901-1908)."""
        return max(0, state.config.page_size * len(self.full) - len(state.full_free))


def plan_for_key(state: MambaState, key: Key) -> MambaLoadPlan:
    """The load back of ``key``'s match with host hits in ``state``."""
    anchor = model.match_prefix_host(state, key).last_page
    full, restores = ([], False) if anchor is None else model.load_plan(state, anchor)
    return MambaLoadPlan(anchor=anchor, device_end=model.match_prefix(state, key).last_page,
                         full=tuple(full), state=restores)


def expected_load(before: MambaState, plan: MambaLoadPlan, loaded: int, page: Key | None,
                  slot: int | None, after: MambaState) -> tuple[MambaState, list[str]]:
    """The model's state after ``plan``'s load from ``before``, into the device slots the
    engine chose (read off ``after``), the request's copy into ``slot``; and what is
    wrong with the engine's report (``loaded`` full tokens, the prefix ending at
    ``page``, the request's state ``slot``). With nothing to load, nothing may change."""
    report = (loaded, page, slot)
    if plan.empty:
        if report == (0, plan.device_end, None):
            return before, []
        return before, [f"nothing to load back (the match ends on the device at "
                        f"{plan.device_end}), yet the engine reports {loaded} tokens loaded, "
                        f"a prefix ending at {page} and request state slot {slot}"]
    problems = []
    if (loaded, page, slot is not None) != (plan.hit_tokens, plan.anchor, plan.state):
        problems.append(f"load back to {plan.anchor}: the engine reports {loaded} tokens, a "
                        f"prefix ending at {page} and request state slot {slot}; the model "
                        f"{plan.hit_tokens} tokens, ending at {plan.anchor}, "
                        f"{'a' if plan.state else 'no'} request state")
    missing = [k.tokens for k in plan.full if k not in after.pages]
    assert plan.anchor is not None  # a plan with pages or a state has an anchor
    node = after.pages.get(plan.anchor)
    if plan.state and (node is None or node.state is None):
        missing.append(plan.anchor.tokens)
    if missing:
        return before, [*problems,
                        f"load back to {plan.anchor} (full KV of "
                        f"{[k.tokens for k in plan.full]}, "
                        f"{'its' if plan.state else 'no'} state, both pools with room): "
                        f"{missing} are not on the device after it"]
    full = tuple(s for k in plan.full for s in after.pages[k].full)
    node_slot = after.pages[plan.anchor].state if plan.state else None
    try:
        expected = model.load_back(before, plan.anchor, full, node_slot)
        if slot is not None:
            expected = model.fork(expected, plan.anchor, slot)  # DEV-M14
    except PreconditionError as refused:
        return before, [*problems, f"load back to {plan.anchor} into full slots {full}, "
                                   f"state slot {node_slot}, request state slot {slot}: "
                                   f"the model refuses it: {refused}"]
    return expected, problems


def evicted_for_load(before: MambaState, plan: MambaLoadPlan,
                     victims: list[Key]) -> tuple[MambaState, bool]:
    """``before`` after the eviction a load back short of full slots makes first, of
    ``victims`` in order, and whether it freed enough for the load to go on.

    What is locked meanwhile: the device match with its state (the scheduler's
    ``_lock_node(req.last_node)``, schedule_policy.py:1431), and the anchor's path (the
    scheduler's lock of the best match, :1475, and the load's own,
    unified_radix_cache.py:1833), whose device part ends at ``path_end``: the deepest
    device page on it, which may lie past the device match (pages without a state do
    not end a match). Its Mamba lock sits on the anchor, which holds no device state. In
    the model: ``inc_lock_ref`` of the device match with its state and of ``path_end``
    without. The eviction is then the allocator's ``evict_for_alloc`` of the shortfall
    (13m.3), and the locks go; where it freed too little, SGLang calls the load off
    (:1905-1908) and nothing is loaded."""
    need = plan.full_short(before)
    end = path_end(before, plan)
    locked = model.inc_lock_ref(model.inc_lock_ref(before, plan.device_end, True), end, False)
    evicted, freed = model.evict_for_alloc(locked, need, 0, victims)
    unlocked = model.dec_lock_ref(model.dec_lock_ref(evicted, end, True), plan.device_end,
                                  False)
    return unlocked, freed >= need


def path_end(state: MambaState, plan: MambaLoadPlan) -> Key | None:
    """The deepest page on the anchor's path that is on the device (None: none is)."""
    assert plan.anchor is not None  # a load short of slots has pages to load
    on_device = [k for k in page_keys(plan.anchor, state.config.page_size) if k in state.pages]
    return on_device[-1] if on_device else None


def called_off(plan: MambaLoadPlan) -> MambaLoadPlan:
    """``plan`` with nothing to load: what a load called off for want of room did."""
    return replace(plan, full=(), state=False)


HOST_TIER: HostTier[MambaState] = HostTier(
    ("host", "host_full_free", "host_state_free", "host_full_kv", "host_state_kv"))
