"""SGLang's ``LMCRadixCache`` (device tree over LMCache's CPU and disk tiers) beside the
flat model of spec/15 15.5, checked after every step (spec/15 15.9).

Each request runs as SGLang's scheduler runs it: ``match_prefix`` (which, past the
device hit, looks LMCache up with pins and starts a layerwise load into fresh device
slots), the forward pass (whose per-layer reads finish the load and unpin), then
``cache_finished_req`` (insert into the tree; LMCache's store: lookup with pins, store,
unpin). Evictions of the device tree interleave.

Checked after the match, after the forward pass and after the finish:

- LMCache's tiers, abstracted as by the flat machine (``abstraction``), equal the flat
  model's state, every flat invariant holding on both: INV-FLAT-ALLOCATIONS is issue 31's
  LMC-STAGING (allocations = resident objects + what a live load stages), INV-FLAT-PINS-HELD
  its LMC-PINS (with no lookup live, every pin is 0).
- The device tree, as the model's ``State`` of a device-only cache, satisfies every
  device invariant of spec/05 (prefix closure, locks, accounting, pool conservation, KV
  integrity: each cached slot holds its own prefix's KV).
- LMC-BYTES: the match's slots hold the key's own KV at every layer, and LMCache loaded
  exactly what its lookup counted past the device hit.
- Between requests no device slot is held outside the tree.

LMCache's calls map onto the flat model's operations (``lookup``, ``retrieve``,
``unpin``, ``store``); a load past a device hit retrieves only the chunks after it
(SGLang masks the first ``offset`` tokens, ``sglang_adapter.py:318-319``; LMCache skips
whole masked chunks, ``token_database.py:419-422``): ``masked_retrieve``. Known bugs the
engine ``avoid``s are steered around before the request starts (the model is run
ahead), by the flat machine's situation names.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

import hiradix_model
from hiradix.conformance.flat.abstraction import LayerCodes, abstract
from hiradix.conformance.flat.engine import RadixConfig, RadixEngine, Served, codes_of
from hiradix.conformance.flat.machine import (
    LOOKUP_AT_A_PARTIAL_CHUNK,
    RETRIEVE_ACROSS_TIERS,
    RETRIEVE_FROM_DISK,
    pins_a_miss,
    state_problems,
)
from hiradix_model import Key
from hiradix_model import flat as model
from hiradix_model.errors import IllegalChoice
from hiradix_model.flat import FlatState, Pin
from hiradix_model.keys import content_at

MAX_KEY_TOKENS = 16
# A load whose device slots LMCRadixCache must evict for: its eviction may take the
# match's own, unlocked, prefix (spec/15 DEV-L5). Steered round by evicting first.
LOAD_EVICTS_ITS_MATCH = "load_evicts_its_match"
tokens = st.lists(st.integers(1, 2), min_size=1, max_size=9).map(tuple)


def masked_retrieve(state: FlatState, key: Key, lookup_id: str, skipped: int
                    ) -> tuple[FlatState, model.Retrieved]:
    """``retrieve`` of the chunks ``lookup_id`` pinned past the first ``skipped``: those
    are neither read nor staged nor touched (LMCache skips masked chunks), so the model's
    retrieve runs with their pins taken as CPU pins (which it neither stages nor touches)
    and the lookup's pins are then restored."""
    pins = state.lookups[lookup_id]
    masked = set(model.chunks(state, key)[:skipped])
    derived = replace(state, lookups={**state.lookups, lookup_id: tuple(
        Pin("cpu", p.obj) if p.obj.chunk in masked else p for p in pins)})
    after, served = model.retrieve(derived, key, lookup_id)
    return replace(after, lookups=state.lookups), served


def make_radix_machine(build: Callable[[RadixConfig], RadixEngine], config: RadixConfig,
                       reached: Counter[str] | None = None) -> type[RuleBasedStateMachine]:
    """A machine class driving a fresh ``build(config)`` per example."""
    seen = reached if reached is not None else Counter()
    flat = config.flat
    ps, size, layers = config.page_size, flat.chunk_tokens, flat.layers

    class RadixMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.engine = build(config)
            self.model = model.initial(flat)
            self.codes = LayerCodes()
            self.steered = frozenset(self.engine.avoid)
            self.keys: list[Key] = []
            self.ids = itertools.count()
            seen["examples"] += 1
            self.check("the initial state", idle=True)

        def teardown(self) -> None:
            self.engine.close()

        # -- checking ---------------------------------------------------------------------
        def check(self, step: str, idle: bool, arriving: dict[int, Key] | None = None
                  ) -> None:
            seen["checks"] += 1
            view = self.engine.tiers()
            problems = [f"LMCache's own check: {view.own_check}"] if view.own_check else []
            tiers = abstract(view, flat, self.codes)
            problems += [f"LMCache {v}" for v in model.violations(tiers)]
            problems += [f"model {v}" for v in model.violations(self.model)]
            problems += state_problems(tiers, self.model)
            device = self.engine.device_state(self.codes.content, arriving)
            problems += [f"device tree {i}: {m}" for i, ms in
                         hiradix_model.invariants.violations(device).items() for m in ms]
            if idle and device.held:
                problems.append(f"device slots {sorted(device.held)} held with no request")
            assert not problems, f"after {step}:\n  " + "\n  ".join(problems)

        def steer(self, situation: str) -> bool:
            if situation in self.steered:
                seen[f"steered {situation}"] += 1
                return True
            return False

        # -- one request ---------------------------------------------------------------------
        def plan_load(self, key: Key, device_hit: int) -> tuple[FlatState, str | None]:
            """The model run ahead through the load LMCRadixCache would start (if its
            allocation succeeds): the state after it and the situation to steer clear
            of, if any."""
            if device_hit >= len(key.tokens):
                return self.model, None
            if pins_a_miss(self.model, key):
                return self.model, LOOKUP_AT_A_PARTIAL_CHUNK
            state, counted = model.lookup(self.model, key, True, "plan")
            offset = device_hit - device_hit % size
            sources = model.pinned_run(state, "plan")[offset // size:]
            if counted > offset and sources:
                if len({tier for _, tier in sources}) > 1:
                    return state, RETRIEVE_ACROSS_TIERS
                if sources[0][1] == "disk":
                    return state, RETRIEVE_FROM_DISK
            return model.unpin(state, "plan"), None

        def request_key(self, key: Key) -> None:
            aligned = Key(key.tokens[:len(key.tokens) - len(key.tokens) % ps])
            device_hit = self.engine.device_hit(key.tokens)
            ahead, situation = self.plan_load(aligned, device_hit)
            if situation is None and pins_a_miss(ahead, key):
                situation = LOOKUP_AT_A_PARTIAL_CHUNK  # the store's own lookup
            if situation is None:
                looked, _ = model.lookup(ahead, key, True, "plan")
                if model.store_races(looked, key):
                    seen["racing_stores"] += 1  # not yet specified (spec/15 15.5.3)
                    return
            if situation is not None and self.steer(situation):
                return
            short = len(aligned.tokens) - device_hit - self.engine.device_available()
            if device_hit < len(aligned.tokens) and short > 0 \
                    and self.steer(LOAD_EVICTS_ITS_MATCH):
                self.engine.evict(short)  # the scheduler's room, before the match
                self.check(f"evict({short}) before the match", idle=True)
                device_hit = self.engine.device_hit(key.tokens)
                ahead, situation = self.plan_load(aligned, device_hit)
                if situation is None and pins_a_miss(ahead, key):
                    situation = LOOKUP_AT_A_PARTIAL_CHUNK
                if situation is not None and self.steer(situation):
                    return
            self.keys.append(key)
            served, node = self.match(key, aligned, device_hit)
            if self.engine.finish(key.tokens, served, node,
                                  codes_of(key, layers, self.codes.code)):
                self.store(key)
            else:
                seen["requests_short_of_device_slots"] += 1
            self.check(f"finish({key.tokens})", idle=True)

        def match(self, key: Key, aligned: Key, device_hit: int) -> tuple[Served, object]:
            before = set(self.engine.live_lookups())
            loads = self.engine.loads_started
            served, node = self.engine.match_prefix(key.tokens)
            load_id = None
            if self.engine.loads_started != loads:
                live = set(self.engine.live_lookups()) - before
                name = live.pop() if live else f"done{next(self.ids)}"
                self.model, counted = model.lookup(self.model, aligned, True, name)
                offset = device_hit - device_hit % size
                if counted > offset:
                    self.model, _ = masked_retrieve(self.model, Key(aligned.tokens[:counted]),
                                                    name, offset // size)
                    tiers = Counter(t for _, t in model.pinned_run(self.model, name))
                    seen["cpu_hits"] += tiers["cpu"]
                    seen["disk_hits"] += tiers["disk"]
                    seen["loads"] += 1
                    load_id = name
                else:
                    self.model = model.unpin(self.model, name)
                want = max(0, counted - device_hit) if counted > offset else 0
                assert served.loaded == want, \
                    f"match({key.tokens}): LMCache loaded {served.loaded} tokens, " \
                    f"its lookup counted {counted} past a device hit of {device_hit}"
            seen["device_hits"] += bool(served.device_hit)
            # The load's later layers land in the forward pass: its slots are in flight.
            self.check(f"match_prefix({key.tokens})", idle=False, arriving={
                slot: content_at(key, served.device_hit + i)
                for i, slot in enumerate(served.slots[served.device_hit:])})
            self.engine.forward()
            if load_id is not None:
                self.model = model.unpin(self.model, load_id)
            self.served_bytes(key, served)
            self.check(f"forward({key.tokens})", idle=False)
            return served, node

        def served_bytes(self, key: Key, served: Served) -> None:
            """LMC-BYTES: every slot of the match holds the key's own KV, every layer."""
            got = self.engine.read(served.slots, self.codes.content)
            want = [content_at(key, p) for p in range(len(served.slots))]
            bad = [(p, g) for p, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
            assert not bad, f"match({key.tokens}): positions served the wrong KV: {bad}"

        def store(self, key: Key) -> None:
            name = f"s{next(self.ids)}"
            looked, _ = model.lookup(self.model, key, True, name)
            plan = model.store_plan(looked, key)
            orders = list(self.engine.disk_orders) + [()] * layers
            arrivals = tuple(tuple(o for o in orders[layer] if o.layer == layer
                                   and o.chunk in plan) for layer in range(layers))
            try:
                stored, result = model.store(looked, key, arrivals)
            except IllegalChoice as illegal:
                raise AssertionError(f"store({key.tokens}): {illegal}") from None
            self.model = model.unpin(stored, name)
            seen["stored_chunks"] += len(result.stored)
            seen["cpu_victims"] += len(result.cpu_victims)
            seen["disk_victims"] += len(result.disk_victims)

        # -- the rules ------------------------------------------------------------------------
        @rule(ids=tokens)
        def request(self, ids: tuple[int, ...]) -> None:
            self.request_key(Key(ids))

        @precondition(lambda self: bool(self.keys))
        @rule(data=st.data(), more=st.lists(st.integers(1, 2), max_size=6).map(tuple))
        def request_again(self, data: st.DataObject, more: tuple[int, ...]) -> None:
            """A request sharing a previous one's prefix (a system prompt, a next turn)."""
            key = data.draw(st.sampled_from(self.keys))
            cut = data.draw(st.integers(1, len(key.tokens)))
            self.request_key(Key((key.tokens[:cut] + more)[:MAX_KEY_TOKENS]))

        @rule(num_tokens=st.integers(1, 16))
        def evict(self, num_tokens: int) -> None:
            """Device eviction (it first drops the stores' deferred locks)."""
            seen["device_evicted"] += self.engine.evict(num_tokens)
            self.check(f"evict({num_tokens})", idle=True)

    RadixMachine.__name__ = (f"LMCRadixMachine_{ps}_{size}_{flat.cpu_objects}_"
                             f"{flat.disk_objects}")
    return RadixMachine
