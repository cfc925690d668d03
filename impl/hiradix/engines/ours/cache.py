"""The first adapter: hiradix's own HiRadixCache, spoken to as any engine would be.

Copies go through the controlled copy engine and all finish just before each
acknowledgement check -- the way SGLang's copies behave on a CPU -- so the differential
suite sees the same timing from every engine. (The richer conformance machine in
``machine.py`` drives copies to completion in any order; this adapter exists so that
the engine-generic suite and its choice inference are checked on ours too.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from hiradix.clock import ManualClock
from hiradix.conformance.abstraction import abstract, page_keys
from hiradix.conformance.kv import patterns
from hiradix.conformance.scenario import Scenario
from hiradix.keys import RadixKey
from hiradix.transfer import ControlledCopyEngine
from hiradix.tree import TreeNode
from hiradix_model import Config, Key, State, ops

ALL = frozenset({"match_prefix", "insert", "inc_lock_ref", "dec_lock_ref", "alloc", "free",
                 "evict", "evict_host", "write_backup", "writing_check", "load_back",
                 "loading_check", "reset"})


class OursAdapter:
    name = "ours"
    version = "hiradix"
    operations = ALL
    adopted: Mapping[str, str] = {}
    mapped: Mapping[str, str] = {}
    guards: Mapping[str, str] = {}
    avoid: Mapping[str, str] = {}
    inexpressible: Mapping[str, str] = {}

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.config: Config = scenario.model_config()
        self.clock = ManualClock()
        self.cache = scenario.build(self.clock, None)
        engine = self.cache.engine
        assert isinstance(engine, ControlledCopyEngine)
        self.copies = engine

    def _tensor(self, slots: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(slots), dtype=torch.int64)

    def _page_of(self, node: TreeNode) -> Key | None:
        if node is self.cache.root:
            return None
        return page_keys(node, self.cache.page_size)[-1]

    def _node(self, page: Key | None) -> TreeNode:
        if page is None:
            return self.cache.root
        for node in self.cache.nodes():
            if node is not self.cache.root and page_keys(node, self.cache.page_size)[-1] == page:
                return node
        raise KeyError(f"no node ends at {page}")

    def set_time(self, now: int) -> None:
        self.clock.tick = now

    def match_prefix(self, key: Key) -> ops.MatchResult:
        got = self.cache.match_prefix(RadixKey(key.tokens, key.namespace))
        return ops.MatchResult(tuple(got.device_slots.tolist()),
                               self._page_of(got.last_device_node),
                               self._page_of(got.last_host_node), got.host_hit_length)

    def inc_lock_ref(self, page: Key | None) -> int:
        return self.cache.inc_lock_ref(self._node(page))

    def dec_lock_ref(self, page: Key | None) -> int:
        return self.cache.dec_lock_ref(self._node(page))

    def num_free_slots(self) -> int:
        return self.cache.device_pool.num_free_slots

    def alloc(self, num_tokens: int) -> tuple[int, ...] | None:
        slots = self.cache.device_pool.alloc(num_tokens)
        return None if slots is None else tuple(slots.tolist())

    def free(self, slots: Sequence[int]) -> None:
        self.cache.device_pool.free(self._tensor(slots))

    def write_kv(self, slots: Sequence[int], contents: Sequence[Key]) -> None:
        pool = self.cache.device_pool
        pool.write(self._tensor(slots),
                   patterns(list(contents), pool.layers, pool.token_shape, pool.dtype))

    def insert(self, key: Key, slots: Sequence[int], *, priority: int, chunked: bool,
               counted_from: int = 0) -> int:
        return self.cache.insert(RadixKey(key.tokens, key.namespace), self._tensor(slots),
                                 priority=priority, chunked=chunked, counted_from=counted_from)

    def evict(self, num_tokens: int) -> int:
        return self.cache.evict(num_tokens)

    def evict_host(self, num_tokens: int) -> int:
        return self.cache.evict_host(num_tokens)

    def writing_check(self) -> int:
        self.copies.complete("d2h", self.copies.queued("d2h"))
        return self.cache.writing_check()

    def loading_check(self) -> int:
        self.copies.complete("h2d", self.copies.queued("h2d"))
        return self.cache.loading_check()

    def init_load_back(self, page: Key | None,
                       quota: int | None) -> tuple[tuple[int, ...], Key | None]:
        loaded, used = self.cache.init_load_back(self._node(page), quota)
        return tuple(loaded.tolist()), self._page_of(used)

    def reset(self) -> None:
        self.cache.reset()

    def observe(self, model: State) -> State:
        return abstract(self.cache, model)

    def close(self) -> None:
        pass


def probe(engine: str) -> str:
    """Ours is always here."""
    return "hiradix"


def factory(engine: str, scenario: Scenario) -> Callable[[], OursAdapter]:
    return lambda: OursAdapter(scenario)


def scenario_space(engine: str) -> dict[str, tuple[object, ...]]:
    """Every scenario value: no axis is restricted."""
    return {}
