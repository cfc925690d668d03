"""An engine's ``MambaView`` as the model's ``MambaState`` (spec/13m, 13m.8).

Pages, free sets and locks are read as reported; a held slot is one neither free nor
owned by a page; KV and state codes go back to content keys through the machine's two
``Codes`` (one for KV, one for states: the code of a state is that of its prefix).
"""

from __future__ import annotations

from hiradix.conformance.hybrid.abstraction import Codes
from hiradix.conformance.mamba.engine import MambaView
from hiradix_model.mamba import MambaConfig, MambaPage, MambaState


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
