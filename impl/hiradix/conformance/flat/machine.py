"""The flat machine: a pair of flat tiers beside the model of spec/15 15.5, checked after
every engine call.

Requests run as LMCache's SGLang connector runs them (sglang_adapter.py:297-425): a
*load* looks up with pins, retrieves exactly the run its lookup counted, and unpins; a
*store* looks up with pins, stores, and unpins (or, bare, only stores). Lookups held
across steps (requests waiting), lookups without pins, and clears interleave.

After every call the engine's view is abstracted and compared with the model's state;
every model invariant holds on both and the engine's own bookkeeping agrees. A store's
victims are the model's (LMCache's LRU is deterministic given the recency order, which
the comparison checks); the one nondeterministic choice, the order in which a layer's
disk writes land, is read from the engine after each layer and validated by the model.
A retrieve's bytes must be the key's own (INV-FLAT-BYTES). Known engine bugs the engine
``avoid``s are steered around, by the situation names below.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from hiradix.conformance.flat.abstraction import LayerCodes, abstract, canonical
from hiradix.conformance.flat.engine import FlatEngine
from hiradix_model import Key
from hiradix_model import flat as model
from hiradix_model.errors import IllegalChoice, PreconditionError
from hiradix_model.flat import FlatConfig, FlatState, Obj

Build = Callable[[FlatConfig], FlatEngine]
MAX_KEY_TOKENS = 16  # keys the machine hands an engine; a continued key is cut there
tokens = st.lists(st.integers(1, 2), min_size=1, max_size=8).map(tuple)
rare = st.integers(0, 7).map(lambda n: n == 0)  # about one in eight

# The situations an engine may ``avoid`` (each a known bug, spec/15 15.3).
RETRIEVE_FROM_DISK = "retrieve_from_disk"  # a load whose run starts on the disk tier
RETRIEVE_ACROSS_TIERS = "retrieve_across_tiers"  # a load whose run is in both tiers
LOOKUP_AT_A_PARTIAL_CHUNK = "lookup_at_a_partial_chunk"  # a pinned lookup DEV-L4 meets
SITUATIONS = (RETRIEVE_FROM_DISK, RETRIEVE_ACROSS_TIERS, LOOKUP_AT_A_PARTIAL_CHUNK)


def pins_a_miss(state: FlatState, key: Key) -> bool:
    """Whether LMCache's pinned lookup of ``key`` meets the first chunk it does not
    count with some of its leading layers resident, which it then pins (spec/15 DEV-L4):
    on the CPU tier from layer 0, or else on the disk tier from layer 0."""
    found, every = model.run(state, key), model.chunks(state, key)
    if len(found) == len(every):
        return False
    first = Obj(every[len(found)], 0)
    return first in state.cpu or first in state.disk


def state_problems(engine_state: FlatState, expected: FlatState) -> list[str]:
    """Where the abstracted engine state differs from the model's."""
    mine, theirs = canonical(expected), canonical(engine_state)
    problems = []
    for tier in ("cpu", "disk"):
        want, got = getattr(mine, tier), getattr(theirs, tier)
        if want == got:
            continue
        names = ({o: (o.chunk.tokens, o.layer) for o in want}
                 | {o: (o.chunk.tokens, o.layer) for o in got})
        problems.append(f"{tier} LRU order: model {[names[o] for o in model.lru(want)]}, "
                        f"engine {[names[o] for o in model.lru(got)]}")
        for obj in sorted(set(want) & set(got), key=lambda o: names[o]):
            a, b = want[obj], got[obj]
            if (a.pins, a.content) != (b.pins, b.content):
                problems.append(f"{tier} {names[obj]}: model pins {a.pins} content "
                                f"{a.content}, engine pins {b.pins} content {b.content}")
    if mine.lookups != theirs.lookups:
        problems.append(f"lookups: model {dict(mine.lookups)}, engine {dict(theirs.lookups)}")
    if mine.allocations != theirs.allocations:
        problems.append(f"allocations: model {mine.allocations}, engine {theirs.allocations}")
    return problems


def make_flat_machine(build: Build, config: FlatConfig,
                      reached: Counter[str] | None = None) -> type[RuleBasedStateMachine]:
    """A machine class driving a fresh ``build(config)`` per example; ``reached`` counts
    what the examples exercised."""
    seen = reached if reached is not None else Counter()
    layers = config.layers

    class FlatMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.engine = build(config)
            self.model = model.initial(config)
            self.codes = LayerCodes()
            self.steered = frozenset(self.engine.avoid)
            self.held: list[str] = []
            self.keys: list[Key] = []
            self.ids = itertools.count()
            seen["examples"] += 1
            self.check("the initial state")

        def teardown(self) -> None:
            self.engine.close()

        # -- checking -------------------------------------------------------------------
        def check(self, step: str) -> None:
            seen["checks"] += 1
            view = self.engine.observe()
            problems = [f"engine's own check: {view.own_check}"] if view.own_check else []
            engine_state = abstract(view, config, self.codes)
            problems += [f"engine {v}" for v in model.violations(engine_state)]
            problems += model.violations(self.model)
            problems += state_problems(engine_state, self.model)
            assert not problems, f"after {step}:\n  " + "\n  ".join(problems)

        def steer(self, situation: str) -> bool:
            """Whether to steer clear of ``situation`` (a known bug of this engine)."""
            if situation in self.steered:
                seen[f"steered {situation}"] += 1
                return True
            return False

        # -- the operations ---------------------------------------------------------------
        def pinned_lookup(self, key: Key) -> tuple[str, int] | None:
            if pins_a_miss(self.model, key) and self.steer(LOOKUP_AT_A_PARTIAL_CHUNK):
                return None
            name = f"l{next(self.ids)}"
            got = self.engine.lookup(key, True, name)
            self.model, want = model.lookup(self.model, key, True, name)
            tiers = Counter(tier for _, tier in model.pinned_run(self.model, name))
            seen["cpu_hits"] += tiers["cpu"]
            seen["disk_hits"] += tiers["disk"]
            self.check(f"lookup({key.tokens}, pin, {name!r}) = {got}")
            assert got == want, f"lookup({key.tokens}) counted {got} tokens, the model {want}"
            return name, want

        def unpin(self, name: str) -> None:
            self.engine.unpin(name)
            self.model = model.unpin(self.model, name)
            self.check(f"unpin({name!r})")

        def store_key(self, key: Key) -> None:
            if model.store_races(self.model, key):
                seen["racing_stores"] += 1  # not yet specified (spec/15 15.5.3)
                return
            plan = model.store_plan(self.model, key)
            orders = self.engine.store(key, self.codes.codes(key, layers))
            arrivals = tuple(tuple(o for o in orders[layer] if o.layer == layer
                                   and o.chunk in plan) for layer in range(layers))
            try:
                self.model, result = model.store(self.model, key, arrivals)
            except IllegalChoice as illegal:
                raise AssertionError(f"store({key.tokens}): {illegal}") from None
            seen["stored_chunks"] += len(result.stored)
            seen["cpu_victims"] += len(result.cpu_victims)
            seen["disk_victims"] += len(result.disk_victims)
            seen["disk_skipped"] += len(result.disk_skipped)
            seen["partial_disk_chunks"] += any(
                not model.holds(self.model, "disk", o.chunk) for o in self.model.disk)
            self.check(f"store({key.tokens}) = {result}")

        def retrieve(self, key: Key, name: str) -> None:
            sources = model.pinned_run(self.model, name)
            if sources[0][1] == "disk" and self.steer(RETRIEVE_FROM_DISK):
                return
            if len({tier for _, tier in sources}) > 1 and self.steer(RETRIEVE_ACROSS_TIERS):
                return
            try:
                after, expected = model.retrieve(self.model, key, name)
            except PreconditionError:
                seen["retrieves_short_of_staging"] += 1  # not yet specified
                return
            served, codes = self.engine.retrieve(key)
            contents = {(layer, p): self.codes.content(code, layer)
                        for layer in range(layers) for p, code in enumerate(codes[layer])}
            problems = list(model.bytes_problems(key, layers, expected.tokens, served,
                                                 contents))
            assert not problems, f"retrieve({key.tokens}):\n  " + "\n  ".join(problems)
            self.model = after
            seen["retrieves"] += 1
            self.check(f"retrieve({key.tokens}) = {served}")

        # -- the rules --------------------------------------------------------------------
        @rule(ids=tokens, pinned=st.booleans(), clear_first=rare)
        def store(self, ids: tuple[int, ...], pinned: bool, clear_first: bool) -> None:
            """A store as the connector makes it (lookup with pins, store, unpin:
            sglang_adapter.py:376-409), or bare; now and then after a clear."""
            if clear_first:
                self.clear()
            key = Key(ids)
            self.keys.append(key)
            held = self.pinned_lookup(key) if pinned else None
            if pinned and held is None:
                return
            self.store_key(key)
            if held is not None:
                self.unpin(held[0])

        def load_key(self, key: Key) -> None:
            """A load as the connector makes it: lookup with pins, retrieve what it
            counted, unpin once every layer is loaded (sglang_adapter.py:277-346)."""
            held = self.pinned_lookup(key)
            if held is None:
                return
            name, counted = held
            if counted:
                self.retrieve(Key(key.tokens[:counted]), name)
            self.unpin(name)

        @rule(ids=tokens)
        def load(self, ids: tuple[int, ...]) -> None:
            self.load_key(Key(ids))

        @precondition(lambda self: bool(self.keys))
        @rule(data=st.data())
        def load_again(self, data: st.DataObject) -> None:
            """A request sharing a stored key's prefix (a system prompt), or all of it."""
            key = data.draw(st.sampled_from(self.keys))
            self.load_key(Key(key.tokens[:data.draw(st.integers(1, len(key.tokens)))]))

        @precondition(lambda self: bool(self.keys))
        @rule(data=st.data(), more=tokens)
        def store_again(self, data: st.DataObject, more: tuple[int, ...]) -> None:
            """A store extending a stored key (the next turn of a conversation)."""
            key = data.draw(st.sampled_from(self.keys))
            self.store((key.tokens + more)[:MAX_KEY_TOKENS], data.draw(st.booleans()), False)

        def hold_key(self, key: Key) -> None:
            """A lookup whose request waits: its pins stay until ``release``."""
            held = self.pinned_lookup(key)
            if held is not None:
                self.held.append(held[0])
                seen["pinned_lookups"] += 1

        @rule(ids=tokens)
        def hold(self, ids: tuple[int, ...]) -> None:
            self.hold_key(Key(ids))

        @precondition(lambda self: bool(self.keys))
        @rule(data=st.data())
        def hold_again(self, data: st.DataObject) -> None:
            """A waiting request that shares a stored key (its pins keep it from eviction)."""
            self.hold_key(data.draw(st.sampled_from(self.keys)))

        @precondition(lambda self: bool(self.held))
        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            self.unpin(self.held.pop(data.draw(st.integers(0, len(self.held) - 1))))
            seen["releases"] += 1

        @rule(ids=tokens)
        def peek(self, ids: tuple[int, ...]) -> None:
            key = Key(ids)
            got = self.engine.lookup(key, False, None)
            _, want = model.lookup(self.model, key, False)
            self.check(f"lookup({key.tokens}) = {got}")
            assert got == want, f"lookup({key.tokens}) counted {got} tokens, the model {want}"

        def clear(self) -> None:
            self.engine.clear()
            self.model, dropped = model.clear(self.model)
            seen["clears"] += 1
            self.check(f"clear() dropping {dropped}")

    FlatMachine.__name__ = (f"FlatMachine_{config.chunk_tokens}_{config.cpu_objects}_"
                            f"{config.disk_objects}")
    return FlatMachine
