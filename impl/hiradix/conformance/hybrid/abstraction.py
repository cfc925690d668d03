"""An engine's ``SwaView`` as the model's ``SwaState`` (spec/13, 13.8).

Pages, free sets and locks are read as reported; ``held`` is every full slot neither free
nor owned, with its mapping entry as its SWA half; KV codes go back to content keys
through the machine's ``Codes``. What the mapping holds beyond that (an entry for a free
full slot, for a tombstone, or one that disagrees with a page's SWA copy) is reported by
``mapping_problems`` under the invariant it breaks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace

from hiradix.conformance.host_judge import judge_host
from hiradix.conformance.hybrid.engine import SwaHostView, SwaView
from hiradix_model import Key
from hiradix_model.hybrid import (
    HOST_INVARIANTS,
    SWA_INVARIANTS,
    SwaConfig,
    SwaHostPage,
    SwaPage,
    SwaState,
)


class Codes:
    """A float-exact code per KV content key: what the machine writes into the pools."""

    def __init__(self) -> None:
        self._code: dict[Key, int] = {}
        self._key: dict[int, Key] = {}

    def code(self, content: Key) -> int:
        if content not in self._code:
            value = len(self._code) + 1  # 0 is what a fresh pool holds: no content
            assert value < 2 ** 24, "codes must stay exact in float32"
            self._code[content] = value
            self._key[value] = content
        return self._code[content]

    def content(self, code: int) -> Key | None:
        return self._key.get(code)

    def decode(self, kv: Mapping[int, int]) -> dict[int, Key]:
        return {slot: key for slot, code in kv.items() if (key := self.content(code)) is not None}


def abstract(view: SwaView, config: SwaConfig, codes: Codes) -> SwaState:
    """The model state this view stands for."""
    pages = {key: SwaPage(full=p.full, swa=p.swa, lock=p.lock, swa_lock=p.swa_lock)
             for key, p in view.pages.items()}
    owned = {s for p in view.pages.values() for s in p.full}
    held = {slot: view.pairs.get(slot) for slot in range(config.full_slots)
            if slot not in owned and slot not in view.full_free}
    return SwaState(config=config, pages=pages, full_free=view.full_free,
                    swa_free=view.swa_free, held=held, full_kv=codes.decode(view.full_kv),
                    swa_kv=codes.decode(view.swa_kv))


def mapping_problems(view: SwaView) -> Iterator[str]:
    """Mapping entries that no live pair accounts for, each under its invariant."""
    for key, page in view.pages.items():
        for offset, slot in enumerate(page.full):
            entry = view.pairs.get(slot)
            if page.swa is None and entry is not None:
                yield (f"INV-SWA-ONLY-WITH-FULL: tombstone {key} full slot {slot} still maps "
                       f"to SWA slot {entry}")
            elif page.swa is not None and entry != page.swa[offset]:
                yield (f"INV-SWA-SWA-POOL: {key} full slot {slot} maps to {entry}, its SWA "
                       f"copy is slot {page.swa[offset]}")
    for slot in sorted(view.full_free):
        if slot in view.pairs:
            yield (f"INV-SWA-SWA-POOL: free full slot {slot} still maps to SWA slot "
                   f"{view.pairs[slot]}")


def with_host(state: SwaState, host: SwaHostView, codes: Codes) -> SwaState:
    """``state`` (a device abstraction) with the host tier ``host`` reports (13.8a)."""
    config = replace(state.config, host_full_slots=host.full_slots,
                     host_swa_slots=host.swa_slots)
    return replace(state, config=config,
                   host={key: SwaHostPage(full=p.full, swa=p.swa)
                         for key, p in host.pages.items()},
                   host_full_free=host.full_free, host_swa_free=host.swa_free,
                   host_full_kv=codes.decode(host.full_kv),
                   host_swa_kv=codes.decode(host.swa_kv))


# The per-page host invariants a deviation may exempt pages from (host_judge).
PER_PAGE = frozenset({"INV-SWA-HOST-TREE-WELL-FORMED", "INV-SWA-HOST-ONLY-WITH-FULL",
                      "INV-SWA-HOST-CONTENT"})


def host_problems(state: SwaState, exempt: Mapping[str, frozenset[Key]]) -> list[str]:
    """The host invariants ``state`` breaks (13.8a), each judged without the host pages
    ``exempt`` takes out of it (a labelled deviation's)."""
    return judge_host(state, HOST_INVARIANTS, SWA_INVARIANTS, exempt, PER_PAGE)
