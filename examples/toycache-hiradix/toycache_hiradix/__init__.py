"""toycache_hiradix: the hiradix adapter for toycache (spec/16-your-engine.md).

What a toycache developer ships to hold toycache to hiradix's model: an ``EngineAdapter``
that speaks the spec's operations (spec/03) to a ``ToyCache`` and reads it back as the
model's ``State`` (spec/06), and two engine records, registered as entry points of the
``hiradix.engines`` group (pyproject.toml):

- ``ENGINE`` (``--engine toycache``): toycache as shipped, with its known bug;
- ``ENGINE_FIXED`` (``--engine toycache-fixed``): ``ToyCache(..., fixed=True)``.

toycache is device-only: it has no host tier, so the adapter offers no host operation
and the model's configuration has ``host_slots = 0``; it evicts LRU only and has one
allocator, so the campaign's other strategies, write policies and layouts are left out
(``scenario_space``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING

from hiradix.engines import CacheEngine, EngineAdapter, probe_engine, unsupported
from hiradix_model import Config, Key, Page, State, ops

if TYPE_CHECKING:
    from toycache import Node, ToyCache

    from hiradix.conformance.scenario import Scenario

SETUP = "pip install examples/toycache"
VERSIONS = ("0.1.0",)  # the toycache releases this adapter was written against
OPERATIONS = frozenset({"match_prefix", "insert", "inc_lock_ref", "dec_lock_ref", "alloc",
                        "free", "evict", "reset"})
# What a slot the forward pass never wrote holds, as the model's KV identities go.
UNWRITTEN = Key((-1,), "<unwritten>")


def probe(engine: str) -> str:
    """The installed toycache version; ``EngineUnavailable`` naming ``SETUP`` if absent."""
    return probe_engine(engine, "toycache", VERSIONS, "ToyCache", SETUP,
                        lambda: importlib.import_module("toycache").ToyCache)


class ToyCacheAdapter:
    """One ``ToyCache`` for one scenario, spoken to in the model's vocabulary."""

    operations = OPERATIONS
    # toycache counts no hits: with no host tier to write through to and LRU eviction,
    # hits decide nothing, so the model takes toycache's (none) before each comparison.
    # That is also why chunked inserts and counted_from, which only decide hits, have
    # an exact counterpart (ignoring them) and nothing is inexpressible.
    adopted: Mapping[str, str] = {"hits": "toycache keeps no hit counts (device only, LRU)"}
    mapped: Mapping[str, str] = {
        "ticks": "toycache stamps what its clock returns; the adapter's clock returns the "
                 "suite's logical tick",
        "device_kv": "toycache's KV pool holds opaque entries: write_kv stores each slot's "
                     "content Key there, observe reads it back",
        "last_host_page": "no host tier: a match reports no host page and no host hit",
    }
    avoid: Mapping[str, str] = {}  # the known bug is the finding, not something to steer round
    guards: Mapping[str, str] = {}  # toycache ships no server, so nothing is refused upstream
    inexpressible: Mapping[str, str] = {}

    def __init__(self, scenario: Scenario, name: str, fixed: bool) -> None:
        import toycache

        self.name, self.version = name, probe(name)
        self.page_size = ps = scenario.page_size
        self.now = 0
        self.cache: ToyCache = toycache.ToyCache(scenario.device_pages * ps, ps,
                                                 clock=self._clock, fixed=fixed)
        self.config = Config(page_size=ps, device_slots=scenario.device_pages * ps,
                             host_slots=0, write_policy="write_through", eviction="lru",
                             load_back_threshold=scenario.threshold_pages * ps)

    def _clock(self) -> float:
        return float(self.now)

    def _prefix(self, node: Node) -> tuple[int, ...]:
        parts: list[tuple[int, ...]] = []
        cursor = node
        while cursor.parent is not None:  # up to the root, which has none
            parts.append(cursor.tokens)
            cursor = cursor.parent
        return tuple(t for part in reversed(parts) for t in part)

    def _page_of(self, node: Node) -> Key | None:
        return None if node is self.cache.root else Key(self._prefix(node), node.namespace)

    def _node(self, page: Key | None) -> Node:
        """The node whose edge ends at ``page`` (a match has put a boundary there)."""
        if page is None:
            return self.cache.root
        for node in self.cache.nodes():
            if node.namespace == page.namespace and self._prefix(node) == page.tokens:
                return node
        raise KeyError(f"{self.name}: no node ends at {page}")

    # -- the operations (spec/03) ------------------------------------------------------

    def set_time(self, now: int) -> None:
        self.now = now

    def match_prefix(self, key: Key) -> ops.MatchResult:
        slots, node = self.cache.match_prefix(key.tokens, key.namespace)
        return ops.MatchResult(tuple(slots), self._page_of(node), None, 0)

    def inc_lock_ref(self, page: Key | None) -> int:
        return self.cache.inc_lock_ref(self._node(page))

    def dec_lock_ref(self, page: Key | None) -> int:
        return self.cache.dec_lock_ref(self._node(page))

    def num_free_slots(self) -> int:
        return self.cache.allocator.available()

    def alloc(self, num_tokens: int) -> tuple[int, ...] | None:
        slots = self.cache.allocator.alloc(num_tokens)
        return None if slots is None else tuple(slots)

    def free(self, slots: Sequence[int]) -> None:
        self.cache.allocator.free(list(slots))

    def write_kv(self, slots: Sequence[int], contents: Sequence[Key]) -> None:
        for slot, content in zip(slots, contents, strict=True):
            self.cache.kv[slot] = content

    def insert(self, key: Key, slots: Sequence[int], *, priority: int, chunked: bool,
               counted_from: int = 0) -> int:
        # chunked and counted_from decide hits only, which toycache does not count.
        return self.cache.insert(key.tokens, list(slots), key.namespace, priority)

    def evict(self, num_tokens: int) -> int:
        return self.cache.evict(num_tokens)

    def evict_host(self, num_tokens: int) -> int:
        raise unsupported(self, "evict_host")

    def writing_check(self) -> int:
        raise unsupported(self, "writing_check")

    def loading_check(self) -> int:
        raise unsupported(self, "loading_check")

    def init_load_back(self, page: Key | None,
                       quota: int | None) -> tuple[tuple[int, ...], Key | None]:
        raise unsupported(self, "load_back")

    def reset(self) -> None:
        self.cache.reset()

    # -- the abstraction (spec/06) -----------------------------------------------------

    def _pages(self) -> dict[Key, Page]:
        """Every cached page; the pages of one node share its lock, ticks and priority."""
        ps, pages = self.page_size, {}
        for node in self.cache.nodes():
            prefix = self._prefix(node)
            start = len(prefix) - len(node.tokens)
            for index, end in enumerate(range(start + ps, len(prefix) + 1, ps)):
                pages[Key(prefix[:end], node.namespace)] = Page(
                    device=tuple(node.slots[index * ps:(index + 1) * ps]), host=None,
                    lock=node.lock_ref, last_tick=int(node.last_access),
                    insert_tick=int(node.created), priority=node.priority)
        return pages

    def observe(self, model: State) -> State:
        ps, pages = self.page_size, self._pages()
        device_free = frozenset(page * ps + offset for page in self.cache.allocator.free_pages
                                for offset in range(ps))
        owned = {s for p in pages.values() for s in p.device or ()}
        held = frozenset(set(range(self.config.device_slots)) - device_free - owned)
        # The model supplies the identities it expects; a slot a page or a caller holds
        # shows what toycache's pool really has there. Free slots are garbage either way.
        device_kv = dict(model.device_kv)
        for slot in owned | held:
            if slot in device_kv:
                found = self.cache.kv[slot]
                device_kv[slot] = found if isinstance(found, Key) else UNWRITTEN
        return State(config=model.config, pages=pages, device_free=device_free,
                     host_free=frozenset(), held=held, device_kv=device_kv, host_kv={},
                     pending=(), clock=model.clock,
                     evictable_tokens=self.cache.evictable_size,
                     protected_tokens=self.cache.protected_size)

    def close(self) -> None:
        pass  # toycache holds no threads or devices


def factory(name: str, fixed: bool, scenario: Scenario) -> Callable[[], EngineAdapter]:
    """Fresh adapters of ``name`` for ``scenario``, one per example."""
    return lambda: ToyCacheAdapter(scenario, name, fixed)


def scenario_space() -> dict[str, tuple[object, ...]]:
    """One strategy, no host tier, one pool: the configurations toycache has."""
    return {"eviction": ("lru",), "write_policy": ("write_through",),
            "host_layout": ("layer_first",), "kv_layout": ("mha",)}


ENGINE = CacheEngine(name="toycache", family="toycache", probe=partial(probe, "toycache"),
                     factory=partial(factory, "toycache", False),
                     scenario_space=scenario_space,
                     description="toycache as shipped (with its known eviction bug)")
ENGINE_FIXED = CacheEngine(name="toycache-fixed", family="toycache",
                           probe=partial(probe, "toycache-fixed"),
                           factory=partial(factory, "toycache-fixed", True),
                           scenario_space=scenario_space,
                           description="toycache with fixed=True")

__all__ = ["ENGINE", "ENGINE_FIXED", "ToyCacheAdapter", "probe"]
