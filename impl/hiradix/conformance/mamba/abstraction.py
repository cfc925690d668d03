"""An engine's ``MambaView`` as the model's ``MambaState`` (spec/13m, 13m.8).

Pages, free sets and locks are read as reported; a held slot is one neither free nor
owned by a page; KV and state codes go back to content keys through the machine's two
``Codes`` (one for KV, one for states: the code of a state is that of its prefix).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from hiradix.conformance.host_judge import judge_host
from hiradix.conformance.hybrid.abstraction import Codes
from hiradix.conformance.mamba.engine import MambaHostView, MambaView
from hiradix_model import Key
from hiradix_model.mamba import (
    HOST_INVARIANTS,
    MAMBA_INVARIANTS,
    MambaConfig,
    MambaHostPage,
    MambaPage,
    MambaState,
)

# The per-page host invariants a deviation may exempt pages from (host_judge).
PER_PAGE = frozenset({"INV-MAMBA-HOST-TREE-WELL-FORMED", "INV-MAMBA-HOST-ONLY-WITH-FULL",
                      "INV-MAMBA-HOST-CONTENT"})


def abstract(view: MambaView, config: MambaConfig, kv_codes: Codes,
             state_codes: Codes) -> MambaState:
    """The model state this view stands for."""
    pages = {key: MambaPage(full=p.full, state=p.state, lock=p.lock, state_lock=p.state_lock)
             for key, p in view.pages.items()}
    owned_full = {s for p in view.pages.values() for s in p.full}
    owned_states = {p.state for p in view.pages.values() if p.state is not None}
    held_full = frozenset(s for s in range(config.full_slots)
                          if s not in owned_full and s not in view.full_free)
    held_states = frozenset(s for s in range(config.state_slots)
                            if s not in owned_states and s not in view.state_free)
    return MambaState(config=config, pages=pages, full_free=view.full_free,
                      state_free=view.state_free, held_full=held_full,
                      held_states=held_states, full_kv=kv_codes.decode(view.full_kv),
                      state_kv=state_codes.decode(view.state_kv))


def with_host(state: MambaState, host: MambaHostView, kv_codes: Codes,
              state_codes: Codes) -> MambaState:
    """``state`` (a device abstraction) with the host tier ``host`` reports (13m.8b)."""
    config = replace(state.config, host_full_slots=host.full_slots,
                     host_state_slots=host.state_slots)
    return replace(state, config=config,
                   host={key: MambaHostPage(full=p.full, state=p.state)
                         for key, p in host.pages.items()},
                   host_full_free=host.full_free, host_state_free=host.state_free,
                   host_full_kv=kv_codes.decode(host.full_kv),
                   host_state_kv=state_codes.decode(host.state_kv))


def host_problems(state: MambaState, exempt: Mapping[str, frozenset[Key]]) -> list[str]:
    """The host invariants ``state`` breaks (13m.8b), each judged without the host pages
    ``exempt`` takes out of it (a labelled deviation's)."""
    return judge_host(state, HOST_INVARIANTS, MAMBA_INVARIANTS, exempt, PER_PAGE)
