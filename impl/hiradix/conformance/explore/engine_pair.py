"""One step of any engine beside the model, through the public adapter protocol, for
the exhaustive refinement of an engine (spec/14-exploration.md, 14.8).

The explorer names a transition as a model ``Action``; its *request* (the operation and
the caller's arguments, ``lockstep.request``) goes to the engine through its
``EngineAdapter``. The engine's choices -- victims, slots, how a backup went -- are
inferred from its states before and after the call (``infer``), exactly as the
differential machine infers them: the calls to both sides are the differential machine's
own (``differential.EngineSteps``). The model judges the choices and steps; after every
step the model takes the adapter's ``adopted`` fields from the engine, and then the
engine's ``observe()`` must equal the model's state, KV bytes included, with every
invariant holding on both (``EngineSteps.compare``).

A request the engine cannot take is *not expressible* and is skipped (``Skipped``), never
approximated: an operation the adapter lacks (or the protocol has no call for), an
argument it declares ``inexpressible``, a situation it ``avoid``s (a known bug) or, unless
``beyond_server``, one its server ``guards`` against, and a call the adapter refuses
(``Refused``: a ``KeyError`` or ``ValueError`` from the adapter that left the engine as it
was -- a lock or a load at a page where the engine has no node end, a ``counted_from``
where it cannot count).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hiradix.conformance.differential import EngineSteps, handed
from hiradix.conformance.tally import Tally
from hiradix.engines.protocol import EngineAdapter
from hiradix_model import Key, State, initial, ops, trace
from hiradix_model.explore import Action
from hiradix_model.keys import content_at

# The situations an adapter may steer around (``avoid``, ``guards``) that the explorer
# knows how to recognise: whether a request from a state is one.
Situation = Callable[[State, Action], bool]
SITUATIONS: dict[str, Situation] = {
    "reset_with_copies_in_flight": lambda state, asked: (
        asked.name == "reset" and bool(state.pending)),
}


def _counted_from_inside(state: State, asked: Action) -> bool:
    """An insert whose ``counted_from`` lies strictly inside the key's aligned part."""
    if asked.name != "insert":
        return False
    key, counted = asked.args[0], dict(asked.options)["counted_from"]
    assert isinstance(key, Key) and isinstance(counted, int)
    return 0 < counted < len(key.tokens) - len(key.tokens) % state.config.page_size


def _cache_slot_after_caller_slot(state: State, asked: Action) -> bool:
    """An insert passing one of the cache's own slots after a slot the caller holds (a
    scheduler passes its matched prefix, the cache's, and then its own: DEV-24)."""
    if asked.name != "insert":
        return False
    slots = asked.args[1]
    assert isinstance(slots, tuple)
    held = [slot in state.held for slot in slots]
    return any(not mine and any(held[:index]) for index, mine in enumerate(held))


# The arguments an adapter may declare ``inexpressible`` that the explorer recognises.
ARGUMENTS: dict[str, Situation] = {
    "counted_from_inside": _counted_from_inside,
    "insert_cache_slot_after_caller_slot": _cache_slot_after_caller_slot,
}
# Operations of spec/03 the explorer offers that the adapter protocol has no call for.
NOT_IN_PROTOCOL = frozenset({"write_backup"})
# Adapter calls that may refuse a request they cannot express (see the module docstring).
REFUSABLE = ("inc_lock_ref", "dec_lock_ref", "init_load_back", "insert")


class Skipped(Exception):
    """A request the engine cannot take from this state; ``reason`` is what the figures
    count it under, the message says which request and why."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class Refused(Skipped):
    """The adapter refused the call with a ``KeyError`` or ``ValueError`` and the engine's
    state is as it was: the request has no counterpart in this engine's state (a node
    boundary the engine lacks, say)."""


def steered(adapter: EngineAdapter, beyond_server: bool) -> dict[str, str]:
    """The situations to steer around, each with its kind (``avoid``, or ``guard`` unless
    ``beyond_server``). A ``ValueError`` naming any the explorer cannot recognise, or an
    ``inexpressible`` argument it cannot (it would issue what the engine cannot take)."""
    found = {name: "avoid" for name in adapter.avoid}
    if not beyond_server:
        found.update({name: "guard" for name in adapter.guards if name not in found})
    unknown = sorted(set(found) - set(SITUATIONS))
    if unknown:
        raise ValueError(f"{adapter.name} steers around {', '.join(unknown)}, which the "
                         f"explorer cannot recognise (it knows {', '.join(SITUATIONS)})")
    unknown = sorted(set(adapter.inexpressible) - set(ARGUMENTS))
    if unknown:
        raise ValueError(f"{adapter.name} cannot express {', '.join(unknown)}, which the "
                         f"explorer cannot recognise (it knows {', '.join(ARGUMENTS)})")
    return found


def not_expressible(adapter: EngineAdapter, steer: Mapping[str, str], state: State,
                    asked: Action) -> Skipped | None:
    """Why ``asked`` cannot be issued to ``adapter`` from ``state``; None if it can."""
    name = asked.name
    if name in NOT_IN_PROTOCOL:
        return Skipped(f"no {name} in the adapter protocol", asked.call())
    if name not in adapter.operations:
        return Skipped(f"{adapter.name} has no {name}", asked.call())
    if name in ("writing_check", "loading_check"):
        direction = "d2h" if name == "writing_check" else "h2d"
        count = asked.args[0]
        if count != sum(t.direction == direction for t in state.pending):
            return Skipped("acknowledges only some copies in flight (an adapter's copies "
                           "all finish before its check)", asked.call())
    for argument in sorted(adapter.inexpressible):
        if ARGUMENTS[argument](state, asked):
            return Skipped(f"inexpressible: {argument}", asked.call())
    for situation, kind in sorted(steer.items()):
        if SITUATIONS[situation](state, asked):
            return Skipped(f"{kind}: {situation}", asked.call())
    return None


class _Refusing:
    """The adapter, its refusals told apart from failures: a ``KeyError`` or
    ``ValueError`` from one of ``REFUSABLE`` becomes ``Refused`` if the engine's state
    is still the model's (the pair's state before the call, which the last comparison
    found equal); anything else passes through unchanged."""

    def __init__(self, adapter: EngineAdapter, pair: EnginePair) -> None:
        self._adapter = adapter
        self._pair = pair

    def __getattr__(self, name: str) -> Any:
        # Only the adapter's own attributes: the proxy adds the refusable calls below.
        return getattr(self._adapter, name)

    def _refusable(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        model = self._pair.model
        try:
            return call(*args, **kwargs)
        except (KeyError, ValueError) as error:
            if self._adapter.observe(model) != model:
                raise  # the engine changed and then failed: a finding, not a refusal
            raise Refused(f"refused by the adapter ({type(error).__name__})",
                          str(error)) from error

    def inc_lock_ref(self, page: Key | None) -> int:
        return int(self._refusable(self._adapter.inc_lock_ref, page))

    def dec_lock_ref(self, page: Key | None) -> int:
        return int(self._refusable(self._adapter.dec_lock_ref, page))

    def init_load_back(self, page: Key | None,
                       quota: int | None) -> tuple[tuple[int, ...], Key | None]:
        loaded: tuple[tuple[int, ...], Key | None] = self._refusable(
            self._adapter.init_load_back, page, quota)
        return loaded

    def insert(self, key: Key, slots: Sequence[int], *, priority: int, chunked: bool,
               counted_from: int = 0) -> int:
        return int(self._refusable(self._adapter.insert, key, slots, priority=priority,
                                   chunked=chunked, counted_from=counted_from))


class EnginePair(EngineSteps):
    """An engine (through its adapter) and the model in the same abstract state."""

    def __init__(self, adapter: EngineAdapter, steer: Mapping[str, str]) -> None:
        self.adapter = adapter
        self.engine = _Refusing(adapter, self)
        self.model = initial(adapter.config)
        self.adopted = frozenset(adapter.adopted)
        self.why = "; ".join(f"{k}: {v}" for k, v in adapter.adopted.items())
        self.steer = dict(steer)
        self.now = 0
        self.caller_locks: list[Key | None] = []
        self.trace: list[trace.Step] = []
        self.counts = Tally()
        self.engine_label = adapter.name

    def restart(self) -> None:
        """The empty cache again, on the same adapter: ``reset()`` and the clock at 0, as
        a fresh adapter starts (whether that is faithful, the caller checks)."""
        self.adapter.reset()
        self.adapter.set_time(0)
        self.model, self.now = initial(self.adapter.config), 0
        self.caller_locks.clear()
        self.trace.clear()

    def issue(self, asked: Action, check: bool = True) -> None:
        """Issue the request ``asked`` to both; then (``check``) compare. ``Skipped`` if
        the engine cannot take it; ``AssertionError`` (or the engine's or the model's
        own error) where they part. Without ``check`` (replaying a path already
        compared) the adopted fields are still taken, so the model ends where it did."""
        skip = not_expressible(self.adapter, self.steer, self.model, asked)
        if skip is not None:
            raise skip
        self._call(asked)
        seen = self.observe()
        if check:
            self.compare(seen)

    def _set_time(self, now: int) -> None:
        self.now = now
        self.adapter.set_time(now)

    def _call(self, asked: Action) -> None:
        name, args, options = asked.name, asked.args, dict(asked.options)
        if name == "match_prefix":
            key, now = args
            assert isinstance(key, Key) and isinstance(now, int)
            self._set_time(now)
            got = self.adapter.match_prefix(key)
            self.agree(got, self.step("match_prefix", ops.match_prefix, key, now))
        elif name in ("inc_lock_ref", "dec_lock_ref"):
            page = args[0]
            assert isinstance(page, Key)
            if name == "inc_lock_ref":
                delta = self.engine.inc_lock_ref(page)
                self.agree(delta, self.step(name, ops.inc_lock_ref, page))
            else:
                delta = self.engine.dec_lock_ref(page)
                self.agree(delta, self.step(name, ops.dec_lock_ref, page))
        elif name == "alloc":
            key, start = args
            assert isinstance(key, Key) and isinstance(start, int)
            self._alloc(key, start)
        elif name == "free":
            held = args[0]
            assert isinstance(held, tuple)
            handed(self.adapter.free, held)
            self.step("free", ops.free, held)
        elif name == "insert":
            self._insert(args, options)
        elif name == "evict":
            self.evict_both(_int(args[0]))
        elif name == "evict_host":
            self.evict_host_both(_int(args[0]))
        elif name == "writing_check":
            self.step("writing_check", ops.writing_check, self.adapter.writing_check())
        elif name == "loading_check":
            self.step("loading_check", ops.loading_check, self.adapter.loading_check())
        elif name == "load_back":
            page, quota = args
            assert isinstance(page, Key) and (quota is None or isinstance(quota, int))
            self.load_both(page, quota)
        elif name == "reset":
            self.do_reset()
            self._set_time(0)  # the model's clock restarts at 0
        else:
            raise ValueError(f"request: unknown operation {name!r}")

    def _alloc(self, key: Key, start: int) -> None:
        ps = self.model.config.page_size
        need = len(key.tokens) - start
        tokens = math.ceil(need / ps) * ps
        new = self.adapter.alloc(tokens)
        if new is None:
            raise AssertionError(f"alloc({tokens}): {self.adapter.name} found no room; the "
                                 f"model has {len(self.model.device_free)} free slots")
        self.step("alloc", ops.alloc, key, start, new)
        contents = [content_at(key, start + i) for i in range(need)]
        handed(lambda given: self.adapter.write_kv(given, contents), new[:need])

    def _insert(self, args: tuple[object, ...], options: dict[str, object]) -> None:
        key, slots, now = args
        assert isinstance(key, Key) and isinstance(slots, tuple) and isinstance(now, int)
        ps = self.model.config.page_size
        self._set_time(now)
        # The caller then frees what it still holds of the pages it passed (duplicates,
        # an unaligned tail), as the differential machine and a scheduler do (DEV-24).
        pages = sorted({s - s % ps + o for s in slots for o in range(ps)})
        self.insert_both(key, slots, now, _int(options["priority"]), bool(options["chunked"]),
                         _int(options["counted_from"]), pages)


def _int(value: object) -> int:
    assert isinstance(value, int), value
    return value
