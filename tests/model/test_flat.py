"""The flat-tier model (spec/15, 15.5): operations, invariants and their failing tests."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from flat_mutants import A1, CONFIG, FLAT_MUTANTS, A, B, healthy, put
from hypothesis import given, settings
from hypothesis import strategies as st

from hiradix_model import Key
from hiradix_model import flat as F
from hiradix_model.errors import ConfigError, IllegalChoice, PreconditionError
from hiradix_model.keys import content_at


def order(entries: Any) -> list[tuple[tuple[int, ...], int]]:
    """A tier's objects, least recently used first, as (chunk tokens, layer)."""
    return [(o.chunk.tokens, o.layer) for o in F.lru(entries)]


def test_the_healthy_state_breaks_nothing() -> None:
    assert F.violations(healthy()) == []


@pytest.mark.parametrize("spec_id", sorted(FLAT_MUTANTS))
def test_each_corruption_fails_its_invariant(spec_id: str) -> None:
    assert F.check(FLAT_MUTANTS[spec_id](healthy())) == [spec_id]


def test_every_invariant_has_a_corruption() -> None:
    assert set(FLAT_MUTANTS) == set(F.FLAT_INVARIANTS)


# -- store -------------------------------------------------------------------------------


def test_a_store_writes_every_layer_of_every_new_chunk_through_to_both_tiers() -> None:
    s, result = F.store(F.initial(CONFIG), A, F.in_put_order(F.initial(CONFIG), A))
    assert result.stored == (A1, A) and not result.cpu_victims + result.disk_victims
    objects = {F.Obj(c, layer) for c in (A1, A) for layer in (0, 1)}
    assert set(s.cpu) == set(s.disk) == objects and s.allocations == 4
    # Layer by layer, chunk by chunk (cache_engine.py:772-777).
    assert order(s.cpu) == [((1, 2), 0), ((1, 2, 3, 4), 0), ((1, 2), 1), ((1, 2, 3, 4), 1)]


def test_a_chunk_whose_layer_0_either_tier_holds_is_not_stored_again() -> None:
    s = healthy()  # A's second chunk is on the disk tier only
    assert F.store_plan(s, A) == ()
    after, result = F.store(s, A, F.in_put_order(s, A))
    assert result.stored == () and after == s


def test_the_cpu_tier_evicts_its_least_recently_used_unpinned_whole_chunk() -> None:
    s = healthy()  # CPU: A1 (pinned), B
    after, result = F.store(s, Key((7, 8)), F.in_put_order(s, Key((7, 8))))
    assert result.cpu_victims == (B,) and F.Obj(B, 0) not in after.cpu
    assert F.holds(after, "cpu", A1) and F.holds(after, "cpu", Key((7, 8)))


def test_a_store_with_no_cpu_room_stops_and_stores_nothing_further() -> None:
    s = healthy()
    s, _ = F.lookup(s, B, True, "b")  # every CPU object pinned
    key = Key((7, 8, 9, 9))
    after, result = F.store(s, key, F.in_put_order(s, key))
    # Not even the disk tier gets the chunks: objects come from CPU allocations.
    assert result.stored == () and after.disk == s.disk


def test_the_disk_tier_evicts_object_by_object_and_skips_what_it_has_no_room_for() -> None:
    config = replace(CONFIG, cpu_objects=8, disk_objects=3)
    s = put(F.initial(config), Key((1, 2)))  # 2 objects on disk
    s, result = F.store(s, Key((5, 6)), F.in_put_order(s, Key((5, 6))))
    # The second write evicts the least recently used object: (1, 2)'s layer 0.
    assert result.disk_victims == (F.Obj(A1, 0),) and not result.disk_skipped
    assert F.Obj(A1, 1) in s.disk and not F.holds(s, "disk", A1)  # a partial chunk
    # With every disk object pinned, the disk tier skips the next chunk: a partial store.
    s, _ = F.lookup(s, Key((5, 6)), True, "b")  # pins B on the CPU tier only
    pins = tuple(F.Pin("disk", o) for o in s.disk)
    pinned = replace(s, disk={o: replace(e, pins=1) for o, e in s.disk.items()},
                     lookups={**s.lookups, "d": pins})
    nine = Key((9, 9))
    after, result = F.store(pinned, nine, F.in_put_order(pinned, nine))
    assert result.disk_skipped == (F.Obj(nine, 0), F.Obj(nine, 1))
    assert F.holds(after, "cpu", nine) and after.disk == pinned.disk


def test_arrivals_are_checked_against_the_writes() -> None:
    s = F.initial(CONFIG)
    writes = F.in_put_order(s, A)
    swapped = tuple(tuple(reversed(layer)) for layer in writes)
    after, _ = F.store(s, A, swapped)  # writes may land in any order
    assert order(after.disk)[:2] == [((1, 2, 3, 4), 0), ((1, 2), 0)]
    with pytest.raises(IllegalChoice, match=r"arrivals\[0\]"):
        F.store(s, A, (writes[0][:1], writes[1]))
    with pytest.raises(PreconditionError, match="arrivals"):
        F.store(s, A, writes[:1])


def test_a_disk_put_racing_its_own_layer_is_refused() -> None:
    config = replace(CONFIG, cpu_objects=8, disk_objects=1)
    s = F.initial(config)
    # Layer 0's second write must evict, and only layer 0's first write could go.
    assert F.store_races(s, A)
    with pytest.raises(PreconditionError, match="races"):
        F.store(s, A, ((), ()))
    assert not F.store_races(s, A1)


# -- lookup, retrieve, unpin, clear ----------------------------------------------------------


def test_lookup_counts_the_leading_chunks_each_held_whole_by_one_tier() -> None:
    s = healthy()  # A1 on both tiers, A on the disk tier only
    assert F.run(s, A) == ((A1, "cpu"), (A, "disk"))
    assert F.lookup(s, A, False) == (s, 4)
    assert F.lookup(s, Key((1, 2, 9, 9)), False)[1] == 2
    assert F.lookup(s, Key((9, 9)), False)[1] == 0


def test_a_pinned_lookup_pins_and_touches_in_reverse_so_prefixes_stay_longest() -> None:
    s, tokens = F.lookup(healthy(), A, True, "r")
    assert tokens == 4 and len(s.lookups["r"]) == 4
    assert s.cpu[F.Obj(A1, 0)].pins == 2 and s.disk[F.Obj(A, 1)].pins == 1
    assert order(s.disk)[-2:] == [((1, 2, 3, 4), 1), ((1, 2, 3, 4), 0)]
    assert order(s.cpu)[-2:] == [((1, 2), 1), ((1, 2), 0)]
    with pytest.raises(PreconditionError, match="live already"):
        F.lookup(s, A, True, "r")


def test_retrieve_serves_each_chunk_from_its_pinned_tier_without_promotion() -> None:
    s, _ = F.lookup(F.clear(healthy())[0], A, True, "r")  # room for 2 staging buffers
    after, served = F.retrieve(s, A, "r")
    assert served == F.Retrieved(4, ((A1, "cpu"), (A, "disk")))
    assert after.cpu == s.cpu and after.allocations == s.allocations  # no promotion
    assert order(after.disk)[-2:] == [((1, 2, 3, 4), 0), ((1, 2, 3, 4), 1)]


def test_retrieve_refuses_what_its_lookup_did_not_pin() -> None:
    s, _ = F.lookup(healthy(), A, True, "r")
    with pytest.raises(PreconditionError, match="chunks 'r' pinned"):
        F.retrieve(s, A1, "r")
    with pytest.raises(PreconditionError, match="not a live lookup"):
        F.retrieve(s, A, "nobody")
    everything = replace(s, cpu={o: replace(e, pins=e.pins + 1) for o, e in s.cpu.items()},
                         lookups={**s.lookups, "all": tuple(F.Pin("cpu", o) for o in s.cpu)})
    with pytest.raises(PreconditionError, match="staging"):
        F.retrieve(everything, A, "r")  # the CPU tier full and pinned: no room


def test_staging_for_a_disk_serve_evicts_single_cpu_objects_least_recent_first() -> None:
    s, _ = F.lookup(healthy(), A, True, "r")  # the CPU tier full: A1 pinned, B not
    after, served = F.retrieve(s, A, "r")
    assert served.cpu_victims == (F.Obj(B, 0), F.Obj(B, 1))
    assert after.allocations == 2 and F.Obj(B, 0) not in after.cpu


def test_unpin_releases_every_pin_and_with_no_lookup_left_every_pin_is_zero() -> None:
    s, _ = F.lookup(healthy(), A, True, "r")
    s = F.unpin(F.unpin(s, "r"), "held")
    assert not s.lookups and all(e.pins == 0 for e in (*s.cpu.values(), *s.disk.values()))
    with pytest.raises(PreconditionError, match="lookup_id"):
        F.unpin(s, "r")


def test_clear_drops_the_unpinned_cpu_objects_and_keeps_the_disk_tier() -> None:
    s = healthy()
    after, dropped = F.clear(s)
    assert dropped == 2 and set(after.cpu) == {F.Obj(A1, 0), F.Obj(A1, 1)}
    assert after.disk == s.disk and after.allocations == 2


def test_bytes_problems_see_a_short_serve_and_another_keys_kv() -> None:
    served = {(layer, p): content_at(A, p) for layer in (0, 1) for p in range(4)}
    assert list(F.bytes_problems(A, 2, 4, 4, served)) == []
    assert list(F.bytes_problems(A, 2, 4, 2, served))  # served less than counted
    swapped = {**served, (1, 3): content_at(B, 1)}
    assert any("position 3" in p for p in F.bytes_problems(A, 2, 4, 4, swapped))


@pytest.mark.parametrize(("call", "argument"), [
    (lambda s: F.lookup(s, (1, 2), False), "key"),  # type: ignore[arg-type]
    (lambda s: F.lookup(s, A, "yes"), "pin"),  # type: ignore[arg-type]
    (lambda s: F.lookup(s, A, True, ""), "lookup_id"),
    (lambda s: F.store(s, A, "x"), "arrivals"),  # type: ignore[arg-type]
    (lambda s: F.unpin(s, 3), "lookup_id"),  # type: ignore[arg-type]
    (lambda s: F.retrieve(s, A, "nobody"), "lookup_id"),
])
def test_bad_calls_name_the_argument(call: Callable[[F.FlatState], object],
                                     argument: str) -> None:
    s = healthy()
    with pytest.raises(PreconditionError) as raised:
        call(s)
    assert raised.value.argument == argument and s == healthy()


def test_config_refuses_bad_fields() -> None:
    for field, value in (("chunk_tokens", 0), ("layers", True), ("cpu_objects", 65),
                         ("disk_objects", 0)):
        with pytest.raises(ConfigError, match=field):
            F.FlatConfig(**{field: value})


# -- a random walk with every operation's contract checked --------------------------------


def posts(function: Callable[..., object]) -> list[str]:
    doc = inspect.getdoc(function) or ""
    return [line.split(":", 1)[1].strip() for line in doc.splitlines()
            if line.strip().startswith("post:")]


def checked(function: Callable[..., Any], state: F.FlatState, *args: object) -> Any:
    """``function(state, *args)`` with its docstring's pre (no invariant broken) and
    every post evaluated on the result."""
    assert F.check(state) == []
    result = function(state, *args)
    names = dict(zip(inspect.signature(function).parameters, (state, *args), strict=False))
    scope = {**function.__globals__, **names, "__return__": result}
    for expression in posts(function):
        assert eval(expression, scope), f"{function.__name__}: post {expression}"
    return result


keys = st.lists(st.integers(1, 2), min_size=1, max_size=6).map(lambda t: Key(tuple(t)))
steps = st.lists(st.tuples(st.sampled_from(["store", "hold", "load", "release", "clear",
                                             "peek"]), keys), max_size=14)
configs = st.builds(F.FlatConfig, chunk_tokens=st.integers(1, 2), layers=st.integers(1, 2),
                    cpu_objects=st.integers(1, 6), disk_objects=st.integers(1, 6))


@settings(max_examples=150, deadline=None)
@given(configs, steps)
def test_random_walks_keep_every_invariant_and_contract(config: F.FlatConfig,
                                                        walk: list[tuple[str, Key]]) -> None:
    s = F.initial(config)
    for index, (kind, key) in enumerate(walk):
        name = f"l{index}"
        if kind == "store" and not F.store_races(s, key):
            s, _ = checked(F.store, s, key, F.in_put_order(s, key))
        elif kind == "hold":
            s, _ = checked(F.lookup, s, key, True, name)
        elif kind == "peek":
            checked(F.lookup, s, key, False, None)
        elif kind == "load":
            s, tokens = checked(F.lookup, s, key, True, name)
            prefix = Key(key.tokens[:tokens])
            unpinned = sum(e.pins == 0 for e in s.cpu.values())
            disk = sum(t == "disk" for _, t in F.pinned_run(s, name)) * config.layers
            if disk <= config.cpu_objects - s.allocations + unpinned:  # room for staging
                s, served = checked(F.retrieve, s, prefix, name)
                assert served.tokens == tokens
            s = checked(F.unpin, s, name)
        elif kind == "release" and s.lookups:
            s = checked(F.unpin, s, sorted(s.lookups)[0])
        elif kind == "clear":
            s, _ = checked(F.clear, s)
    assert F.check(s) == []
