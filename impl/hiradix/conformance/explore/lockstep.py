"""One step of the implementation beside the model, for exhaustive refinement
(spec/14-exploration.md, 14.4).

The explorer names a transition as a model ``Action``. Its *request* -- the operation and
the caller's arguments -- goes to the implementation; the implementation's own choices
(victims, slots, how a backup went; ``hiradix.decisions``) become the model's choice
arguments, the model judges them (``IllegalChoice``: the implementation chose what the
spec forbids) and steps, and the implementation's abstraction must then equal the
model's state, KV bytes included (``abstraction.abstract``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hiradix.cache import HiRadixCache
from hiradix.clock import ManualClock
from hiradix.conformance.abstraction import abstract, page_keys
from hiradix.conformance.kv import patterns
from hiradix.conformance.scenario import Scenario
from hiradix.decisions import DeviceVictim, PageRef, Recorder
from hiradix.keys import RadixKey
from hiradix.transfer import ControlledCopyEngine
from hiradix.tree import TreeNode, split
from hiradix_model import Backup, IllegalChoice, Key, State, Victim, initial, ops
from hiradix_model.explore import Action, Scope
from hiradix_model.keys import content_at
from hiradix_model.ops import InsertResult

# The operations whose return value is an observation of spec/03 the implementation must
# give as the model does (the rest return nothing, or what the model took as its choice).
OBSERVED = frozenset({"insert", "evict", "evict_host", "inc_lock_ref", "dec_lock_ref",
                      "write_backup", "writing_check", "loading_check"})
# The arguments of each action that are choices the implementation makes, not requests.
CHOICES = {"alloc": (2,), "evict": (1,), "evict_host": (1,), "write_backup": (1,)}
CHOICE_OPTIONS = {"insert": ("backup",), "load_back": ("device_victims", "device_slots")}


def request(action: Action) -> Action:
    """``action`` without the choices: what a caller asks the implementation."""
    drop = CHOICES.get(action.name, ())
    args = tuple(a for i, a in enumerate(action.args) if i not in drop)
    options = tuple((k, v) for k, v in action.options
                    if k not in CHOICE_OPTIONS.get(action.name, ()))
    return Action(action.name, args, options)


class Disagreement(AssertionError):
    """The implementation and the model differ after a step (or it chose illegally)."""


def _int(value: object) -> int:
    assert isinstance(value, int), value
    return value


def _key(ref: PageRef) -> Key:
    return Key(ref[1], ref[0])


def _victims(decisions: list[DeviceVictim] | tuple[DeviceVictim, ...]) -> tuple[Victim, ...]:
    return tuple(Victim(_key(d.page), tuple(map(_key, d.host_victims)), d.host_slots)
                 for d in decisions)


def scenario_for(scope: Scope) -> Scenario:
    return Scenario(page_size=scope.page_size, write_policy=scope.write_policy,
                    eviction=scope.eviction, device_pages=scope.device_pages,
                    host_pages=scope.host_pages,
                    threshold_pages=scope.load_back_threshold_pages)


@dataclass
class Pair:
    """The implementation and the model in the same abstract state."""

    cache: HiRadixCache
    clock: ManualClock
    recorder: Recorder
    model: State

    @classmethod
    def fresh(cls, scope: Scope) -> Pair:
        clock, recorder = ManualClock(), Recorder()
        cache = scenario_for(scope).build(clock, recorder)
        return cls(cache, clock, recorder, initial(scope.config))

    def node(self, page: Key) -> TreeNode:
        """The node ending at ``page``, splitting the node that holds it (node
        boundaries are invisible to the abstraction, spec/06)."""
        ps = self.cache.page_size
        for node in self.cache.nodes():
            if node is self.cache.root:
                continue
            pages = page_keys(node, ps)
            if page in pages:
                at = (pages.index(page) + 1) * ps
                return node if at == len(node.tokens) else split(node, at, ps)
        raise KeyError(f"{page} is not cached in the implementation")

    def _tensor(self, slots: tuple[int, ...]) -> torch.Tensor:
        return torch.tensor(list(slots), dtype=torch.int64)

    def step(self, asked: Action) -> Action:
        """Issue ``asked`` (a request) to both; return the action the model took, with
        the implementation's choices. Raises ``Disagreement``."""
        taken, got = self._issue(asked)
        try:
            self.model, observed = taken.run(self.model)
        except IllegalChoice as error:
            raise Disagreement(f"the implementation chose what the model forbids: {error}") \
                from error
        want = observed.prefix_tokens if isinstance(observed, InsertResult) else observed
        if taken.name in OBSERVED and got != want:
            raise Disagreement(f"{taken.call()} returned {got!r}, the model {want!r}")
        self.cache.check_invariants()
        seen = abstract(self.cache, self.model)
        if seen != self.model:
            raise Disagreement(f"after {taken.call()}: the abstraction differs from the model")
        return taken

    def _issue(self, asked: Action) -> tuple[Action, object]:
        """Issue ``asked``: the action with the implementation's choices, and what it
        returned (None where the operation observes nothing)."""
        cache, name, args, options = self.cache, asked.name, asked.args, dict(asked.options)
        engine = cache.engine
        assert isinstance(engine, ControlledCopyEngine)
        self.recorder.take()
        if name == "match_prefix":
            key, now = args
            assert isinstance(key, Key) and isinstance(now, int)
            self.clock.tick = now
            got = cache.match_prefix(RadixKey(key.tokens, key.namespace))
            _, want = ops.match_prefix(self.model, key, now)
            if tuple(got.device_slots.tolist()) != want.device_slots:
                raise Disagreement(f"match_prefix({key}) device slots differ")
            return asked, None
        if name in ("inc_lock_ref", "dec_lock_ref"):
            page = args[0]
            assert isinstance(page, Key)
            node = self.node(page)
            return asked, (cache.inc_lock_ref if name == "inc_lock_ref"
                           else cache.dec_lock_ref)(node)
        if name == "alloc":
            key, start = args
            assert isinstance(key, Key) and isinstance(start, int)
            need = len(key.tokens) - start
            got_slots = cache.alloc(-(-need // cache.page_size) * cache.page_size)
            if got_slots is None:
                raise Disagreement("alloc: the implementation had no room the model has")
            slots = tuple(got_slots.tolist())
            pool = cache.device_pool
            contents = [content_at(key, start + i) for i in range(need)]
            pool.write(self._tensor(slots[:need]),
                       patterns(contents, pool.layers, pool.token_shape, pool.dtype))
            return Action("alloc", (key, start, slots)), None
        if name == "free":
            held = args[0]
            assert isinstance(held, tuple)
            cache.free(self._tensor(held))
            return asked, None
        if name == "insert":
            key, given, now = args
            assert isinstance(key, Key) and isinstance(given, tuple) and isinstance(now, int)
            self.clock.tick = now
            prefix = cache.insert(RadixKey(key.tokens, key.namespace), self._tensor(given),
                                  priority=_int(options["priority"]),
                                  chunked=bool(options["chunked"]),
                                  counted_from=_int(options["counted_from"]))
            made = self.recorder.take().backups
            backup = Backup(tuple(map(_key, made[0].host_victims)), made[0].host_slots) \
                if made else None
            return Action("insert", args, (*asked.options, ("backup", backup))), prefix
        if name == "evict":
            freed = cache.evict(_int(args[0]))
            victims = _victims(self.recorder.take().device_victims)
            return Action("evict", (args[0], victims)), freed
        if name == "evict_host":
            freed = cache.evict_host(_int(args[0]))
            chosen = tuple(map(_key, self.recorder.take().host_victims))
            return Action("evict_host", (args[0], chosen)), freed
        if name == "write_backup":
            page = args[0]
            assert isinstance(page, Key)
            started = cache.write_backup(self.node(page))
            made = self.recorder.take().backups
            report = Backup(tuple(map(_key, made[0].host_victims)), made[0].host_slots)
            return Action("write_backup", (page, report)), started
        if name in ("writing_check", "loading_check"):
            # The request is the number of copies the copy engine finished; the model
            # acknowledges that many, and the count the implementation acknowledged is
            # its observation, compared with the model's (not the model's argument: that
            # would only catch a count the model refuses).
            if name == "writing_check":
                engine.complete("d2h", _int(args[0]))
                acked = cache.writing_check()
            else:
                engine.complete("h2d", _int(args[0]))
                acked = cache.loading_check()
            return asked, acked
        if name == "load_back":
            page, quota = args
            assert isinstance(page, Key) and (quota is None or isinstance(quota, int))
            cache.load_back(self.node(page), quota)
            loads = self.recorder.take().loads
            victims = _victims(loads[0].device_victims) if loads else ()
            loaded = loads[0].device_slots if loads else None
            return Action("load_back", args, (("device_victims", victims),
                                              ("device_slots", loaded))), None
        if name == "reset":
            cache.reset()
            return asked, None
        raise ValueError(f"unknown operation {name!r}")
