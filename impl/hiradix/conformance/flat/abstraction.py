"""An engine's ``FlatView`` as the model's ``FlatState`` (spec/15, 15.5.5).

Entries are read in the engine's LRU order, a tick being the position in that order;
an object's content is the chunk whose KV its codes spell (None where they spell none).
``canonical`` puts a model state in the same form, so that the two compare equal when
they agree on every object, its recency order, pins and content, the live lookups'
pins (as multisets) and the allocations.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hiradix.conformance.flat.engine import FlatView, ObjView
from hiradix_model import Key
from hiradix_model.flat import Entry, FlatConfig, FlatState, Obj, Pin, lru
from hiradix_model.keys import content_at


class LayerCodes:
    """A float-exact code per (content key, layer): what the machine writes as KV."""

    def __init__(self) -> None:
        self._code: dict[tuple[Key, int], int] = {}
        self._content: dict[int, tuple[Key, int]] = {}

    def code(self, content: Key, layer: int) -> int:
        if (content, layer) not in self._code:
            value = len(self._code) + 1  # 0 is what a fresh pool holds: no content
            assert value < 2 ** 24, "codes must stay exact in float32"
            self._code[(content, layer)] = value
            self._content[value] = (content, layer)
        return self._code[(content, layer)]

    def codes(self, key: Key, layers: int) -> tuple[tuple[int, ...], ...]:
        """Per layer, the code of each position of ``key``."""
        return tuple(tuple(self.code(content_at(key, p), layer)
                           for p in range(len(key.tokens))) for layer in range(layers))

    def content(self, code: int | None, layer: int) -> Key | None:
        """The content ``code`` stands for at ``layer``; None for no code or another layer's."""
        found = None if code is None else self._content.get(code)
        return found[0] if found is not None and found[1] == layer else None

    def chunk(self, view: ObjView, chunk_tokens: int) -> Key | None:
        """The chunk whose KV (at ``view``'s layer) ``view``'s codes spell, if any."""
        contents = [self.content(code, view.obj.layer) for code in view.codes]
        last = contents[-1] if contents else None
        if last is None or len(view.codes) != chunk_tokens:
            return None
        start = len(last.tokens) - chunk_tokens
        want = [content_at(last, start + i) for i in range(chunk_tokens)]
        return last if contents == want else None


def _entries(views: Sequence[ObjView], codes: LayerCodes, chunk_tokens: int
             ) -> dict[Obj, Entry]:
    return {view.obj: Entry(tick=index, pins=view.pins, content=codes.chunk(view, chunk_tokens))
            for index, view in enumerate(views)}


def abstract(view: FlatView, config: FlatConfig, codes: LayerCodes) -> FlatState:
    """The model state this view stands for."""
    return FlatState(config=config, cpu=_entries(view.cpu, codes, config.chunk_tokens),
                     disk=_entries(view.disk, codes, config.chunk_tokens),
                     lookups=dict(view.lookups), allocations=view.allocations,
                     clock=max(len(view.cpu), len(view.disk)))


@dataclass(frozen=True)
class Canonical:
    """What the machine compares: ranks for ticks, pins as multisets, no empty lookups."""

    cpu: Mapping[Obj, Entry]
    disk: Mapping[Obj, Entry]
    lookups: Mapping[str, Counter[Pin]]
    allocations: int


def _ranked(entries: Mapping[Obj, Entry]) -> dict[Obj, Entry]:
    return {obj: Entry(tick=rank, pins=entries[obj].pins, content=entries[obj].content)
            for rank, obj in enumerate(lru(entries))}


def canonical(state: FlatState) -> Canonical:
    return Canonical(cpu=_ranked(state.cpu), disk=_ranked(state.disk),
                     lookups={k: Counter(v) for k, v in state.lookups.items() if v},
                     allocations=state.allocations)
