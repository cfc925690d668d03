"""An engine's host tier held to its component model's host invariants, state by state:
the judge the SWA machine (spec/13 13.8a) and the Mamba machine (spec/13m 13m.8b) share,
with the two-tier bookkeeping both machines' load backs use (``HostTier``).

The machine abstracts the engine's host pools into the model's host fields (``host``:
page -> its host copies, the host free sets, the host content maps) and asks each host
predicate about that state. A labelled deviation of the engine's configuration may take
named pages out of a per-page invariant (they are counted by the machine, not failed);
a pool's partition is a statement about the whole pool, which no page leaves.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from hiradix_model import Key
from hiradix_model.hybrid import SwaState
from hiradix_model.mamba import MambaState

State = TypeVar("State", SwaState, MambaState)


def judge_host(state: State, ids: Sequence[str],
               predicates: Mapping[str, Callable[[State], Iterator[str]]],
               exempt: Mapping[str, frozenset[Key]], per_page: frozenset[str]) -> list[str]:
    """What ``state`` breaks of the host invariants ``ids`` (each as ``ID: why``), each
    judged without the host pages ``exempt`` takes out of it; only ``per_page``
    invariants take exemptions."""
    assert set(exempt) <= per_page, f"only per-page invariants take exemptions: {exempt}"
    failures: list[str] = []
    for spec_id in ids:
        out = exempt.get(spec_id, frozenset())
        judged = replace(state, host={k: p for k, p in state.host.items() if k not in out}) \
            if out else state
        failures += (f"{spec_id}: {found}" for found in predicates[spec_id](judged))
    return failures


def assert_host_match(key: Key, page: Key | None, want: Key | None, device: Key | None,
                      problems: Iterable[str], seen: Counter[str]) -> None:
    """An engine's match with host hits of ``key`` ended at ``page``; the model's host
    match ends at ``want`` and its device match at ``device``; ``problems``: what the
    model's match postcondition says of ``page``. Counts the match (and a host hit, where
    the host match goes past the device one) in ``seen``."""
    seen["host_matches"] += 1
    seen["host_hits"] += want != device
    found = list(problems)
    if page != want:
        found.append(f"engine ends at {page}, model at {want}")
    assert not found, f"match_prefix({key.tokens}) with host hits:\n  " + "\n  ".join(found)


@dataclass(frozen=True)
class HostTier(Generic[State]):
    """The fields of a component model's state that make its host tier (``fields``).

    The machines keep a model of the device tier only, held to the engine step by step;
    the host tier they read off the engine and hold to the model's host invariants. A load
    back joins the two (``two_tier``), is judged on the whole, and hands the machine back
    its device part (``device_part``)."""

    fields: tuple[str, ...]

    def two_tier(self, device_model: State, engine_state: State) -> State:
        """The model's device tier with the engine's host tier (and host pool sizes): the
        state a load back starts from."""
        return replace(device_model, config=engine_state.config,
                       **{name: getattr(engine_state, name) for name in self.fields})

    def device_part(self, state: State, device_model: State) -> State:
        """``state`` with the host tier (and config) of ``device_model``."""
        return replace(state, config=device_model.config,
                       **{name: getattr(device_model, name) for name in self.fields})

    def problems(self, engine_state: State, expected: State) -> list[str]:
        """Where the engine's host tier differs from the model's."""
        return [f"{name}: model {getattr(expected, name)}, engine "
                f"{getattr(engine_state, name)}"
                for name in self.fields if getattr(expected, name) != getattr(engine_state, name)]


def load_starts(state: State, device_lacks: Callable[[Key], bool]) -> list[Key]:
    """The host pages a load back may start from, in token order: those on the host only
    (a full load) and those whose host copy holds a component that ``device_lacks``
    (a load of that component alone)."""
    return sorted((k for k in state.host if k not in state.pages or device_lacks(k)),
                  key=lambda k: k.tokens)
