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

from dataclasses import dataclass, replace

from hiradix.conformance.host_judge import HostTier
from hiradix_model import Key
from hiradix_model import hybrid as model
from hiradix_model.errors import PreconditionError
from hiradix_model.hybrid import SwaState
from hiradix_model.hybrid.state import root_path


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
