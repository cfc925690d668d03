"""LMCache 0.5.6's CPU and disk tiers held to the flat tier model (spec/15 15.5-15.7;
issue 31; skipped without LMCache).

Run from its environment: ``make lmcache-env``, then
``PYTHONPATH=impl:model .venv-lmcache/bin/python -m pytest -q
tests/engines/test_lmcache_flat.py``.

The adapter (``hiradix.engines.lmcache.flat``) steers around three known bugs; a bounded
campaign with them avoided passes, and without the avoid of DEV-L3 and DEV-L4 it stops at
one of them. DEV-L3 and DEV-L4 have reproducers here (they pass while the bug is there);
DEV-L1 and DEV-L2 keep theirs in ``test_lmcache.py``. Bugs planted in a private copy (this
test's engine instance only) fail the machine.
"""

from __future__ import annotations

import importlib
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import FlakyFailure
from hypothesis.stateful import run_state_machine_as_test

from hiradix.conformance.flat.abstraction import LayerCodes, abstract
from hiradix.conformance.flat.campaign import run_campaign
from hiradix.conformance.flat.machine import (
    LOOKUP_AT_A_PARTIAL_CHUNK,
    RETRIEVE_ACROSS_TIERS,
    RETRIEVE_FROM_DISK,
    make_flat_machine,
    state_problems,
)
from hiradix.engines.lmcache import env as lmcache_env
from hiradix.engines.lmcache import flat
from hiradix.engines.lmcache.flat import LMCacheFlat
from hiradix_model import Key
from hiradix_model import flat as F

from engine_env import require

CONFIG = F.FlatConfig(chunk_tokens=2, layers=2, cpu_objects=4, disk_objects=5)
A = Key((1, 2, 1, 1))  # two chunks of 2
BLOCK_GB = flat.BLOCK_BYTES / flat.GB


@pytest.fixture
def adapter() -> Iterator[LMCacheFlat]:
    require("lmcache")
    made = flat.build(CONFIG)
    try:
        yield made
    finally:
        made.close()


def stored(adapter: LMCacheFlat, codes: LayerCodes, state: F.FlatState,
           key: Key) -> F.FlatState:
    """``key`` stored on the engine and in the model, with the engine's arrivals."""
    plan = F.store_plan(state, key)
    orders = adapter.store(key, codes.codes(key, CONFIG.layers))
    arrivals = tuple(tuple(o for o in orders[layer] if o.layer == layer and o.chunk in plan)
                     for layer in range(CONFIG.layers))
    return F.store(state, key, arrivals)[0]


def test_a_store_is_seen_on_both_tiers_with_its_own_bytes(adapter: LMCacheFlat) -> None:
    codes = LayerCodes()
    model = stored(adapter, codes, F.initial(CONFIG), A)
    seen = abstract(adapter.observe(), CONFIG, codes)
    assert F.violations(seen) == [] and state_problems(seen, model) == []
    assert len(seen.cpu) == len(seen.disk) == 4 and seen.allocations == 4
    assert {e.content for e in seen.disk.values()} == {Key((1, 2)), A}


def test_a_cpu_hit_serves_the_stored_bytes(adapter: LMCacheFlat) -> None:
    codes = LayerCodes()
    stored(adapter, codes, F.initial(CONFIG), A)
    assert adapter.lookup(A, True, "r") == 4
    served, read = adapter.retrieve(A)
    adapter.unpin("r")
    contents = {(layer, p): codes.content(code, layer)
                for layer in range(CONFIG.layers) for p, code in enumerate(read[layer])}
    assert served == 4 and list(F.bytes_problems(A, CONFIG.layers, 4, served, contents)) == []
    assert adapter.observe().lookups == {}


def test_bad_keys_are_refused_naming_the_argument(adapter: LMCacheFlat) -> None:
    codes = LayerCodes()
    stored(adapter, codes, F.initial(CONFIG), A)
    before = adapter.observe()
    for key in (Key((1, 2), "ns"), Key(()), Key(tuple([1] * (flat.MAX_TOKENS + 1)))):
        with pytest.raises(ValueError, match="key"):
            adapter.lookup(key, False, None)
        with pytest.raises(ValueError, match="key"):
            adapter.store(key, ((), ()))
    assert adapter.observe() == before


# -- campaigns -------------------------------------------------------------------------


def test_lmcache_refines_the_flat_model_with_its_known_bugs_avoided() -> None:
    """A bounded campaign (about 25 examples of 30 steps, under 60 s on an idle machine)
    with DEV-L1, DEV-L3 and DEV-L4 steered around: no divergence."""
    require("lmcache")
    campaign = run_campaign(flat.NAME, flat.build, (2,), until=time.monotonic() + 50,
                            examples=24, seeded=0)
    assert campaign.failure is None, campaign.failure
    reached = campaign.reached
    assert reached["examples"] >= 3, campaign.describe()
    for name in ("stored_chunks", "cpu_victims", "disk_victims", "cpu_hits", "retrieves"):
        assert reached[name] > 0, campaign.describe()


def narrowed(keep: set[str]) -> Callable[[F.FlatConfig], LMCacheFlat]:
    """Adapters that avoid only ``keep`` of the known bugs."""
    def build(config: F.FlatConfig) -> LMCacheFlat:
        made = flat.build(config)
        made.avoid = {k: v for k, v in LMCacheFlat.avoid.items() if k in keep}
        return made
    return build


def first_failure(build: Callable[[F.FlatConfig], LMCacheFlat], examples: int) -> str:
    """The first failure of the machine over ``build`` (no shrinking: each example builds
    an engine), or ""."""
    quick = settings(max_examples=examples, stateful_step_count=30, deadline=None,
                     database=None, phases=(Phase.explicit, Phase.generate),
                     derandomize=True,  # the same examples every run: no flake
                     suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    try:
        run_state_machine_as_test(make_flat_machine(build, CONFIG), settings=quick)
    except AssertionError as failure:
        return str(failure)
    except FlakyFailure as flaky:
        # LMCache's asynchronous disk puts can make the final replay of a failing example
        # pass (seen in CI): the failure Hypothesis first met is what was found.
        return "\n".join(str(e) for e in flaky.exceptions if isinstance(e, AssertionError))
    return ""


def test_without_its_avoid_the_campaign_stops_at_dev_l3_or_dev_l4() -> None:
    """With only DEV-L1 avoided the machine meets DEV-L3 (LMCache's assert) or DEV-L4
    (a pin no lookup holds) -- real findings, not planted."""
    require("lmcache")
    found = first_failure(narrowed({RETRIEVE_FROM_DISK}), 60)
    assert ("should be from the same location" in found
            or "INV-FLAT-PINS-HELD" in found), found


# -- the reproducers ---------------------------------------------------------------------


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[lmcache_env.Rig]:
    """LMCache's rig under SGLang's instance id (for its connector): chunks of 4 tokens,
    two layers, a CPU tier of 4 objects (two chunks) and a disk tier of 8."""
    require("lmcache")
    made = lmcache_env.build(lmcache_env.RigConfig(cpu_gb=4 * BLOCK_GB, disk_gb=8 * BLOCK_GB),
                             str(tmp_path))
    try:
        yield made
    finally:
        made.close()


def put(rig: lmcache_env.Rig, tokens: list[int]) -> None:
    slots = torch.arange(len(tokens))
    lmcache_env.fill(rig, slots, seed=tokens[0])
    lmcache_env.store(rig, tokens, slots)
    lmcache_env.wait_for_disk_puts(rig)


def test_dev_l3_a_run_across_tiers_raises_in_0_5_6(rig: lmcache_env.Rig) -> None:
    """DEV-L3 (spec/15), as LMCache 0.5.6 ships; passes while the bug is there. After a
    pinned lookup the LRU evicts a key's suffix first, so a further store leaves its
    first chunk on the CPU tier and its second on disk only. LMCache's SGLang connector
    looks up 8 tokens and its retrieve raises on them; the lookup's pins stay."""
    key = list(range(8))
    put(rig, key)
    assert rig.engine.lookup(torch.tensor(key), lookup_id="touch", pin=True) == 8
    rig.engine.lookup_unpin("touch")
    put(rig, [50, 51, 52, 53])  # the CPU tier evicts the key's second chunk
    connector = lmcache_env.sglang_connector(rig)
    with pytest.raises(AssertionError, match="should be from the same location"):
        lmcache_env.sglang_load(rig, connector, key, torch.arange(16, 24))
    after = lmcache_env.balance(rig)
    assert (after.cpu_pins, after.disk_pins) == (2, 2)  # the first chunk's, the second's


def test_dev_l4_a_lookup_pins_a_chunk_it_does_not_count_in_0_5_6(tmp_path: Path) -> None:
    """DEV-L4 (spec/15), as LMCache 0.5.6 ships; passes while the bug is there. A disk
    tier of 5 objects comes to hold a chunk's layer 0 without its layer 1; a pinned
    lookup of that chunk counts 0 tokens, pins the layer 0 and never releases it."""
    require("lmcache")
    rig = lmcache_env.build(lmcache_env.RigConfig(cpu_gb=2 * BLOCK_GB, disk_gb=5 * BLOCK_GB),
                            str(tmp_path), f"t-{uuid.uuid4()}")
    try:
        first = [0, 1, 2, 3]
        put(rig, first)
        put(rig, [10, 11, 12, 13])  # the CPU tier keeps this one only
        assert rig.engine.lookup(torch.tensor(first), lookup_id="a", pin=True) == 4
        rig.engine.lookup_unpin("a")  # its touch left layer 0 the more recent
        put(rig, [20, 21, 22, 23])
        put(rig, [30, 31, 32, 33])  # evicts the first key's layer 1, not its layer 0
        assert rig.engine.lookup(torch.tensor(first), lookup_id="b", pin=True) == 0
        rig.engine.lookup_unpin("b")
        assert lmcache_env.balance(rig).disk_pins == 1  # no lookup holds it
        assert "b" not in rig.engine.lookup_pins
    finally:
        rig.close()


# -- bugs planted in a private copy --------------------------------------------------------


def skip_the_disk_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk tier drops every put of the last layer: a store that skips a tier for
    half of each chunk."""
    local_disk = importlib.import_module("lmcache.v1.storage_backend.local_disk_backend")
    put_one = local_disk.LocalDiskBackend.submit_put_task

    def submit(self: Any, key: Any, memory_obj: Any, on_complete_callback: Any = None
               ) -> None:
        if key.layer_id != CONFIG.layers - 1:
            put_one(self, key, memory_obj, on_complete_callback)

    monkeypatch.setattr(local_disk.LocalDiskBackend, "submit_put_task", submit)


def evictable_while_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU objects count as evictable while pinned (the pin check dropped from
    ``TensorMemoryObj.can_evict``, memory_management.py:923-928): the CPU tier's LRU
    eviction and its clear take pinned objects."""
    memory = importlib.import_module("lmcache.v1.memory_management")
    monkeypatch.setattr(memory.TensorMemoryObj, "can_evict",
                        property(lambda self: self.get_ref_count() == 1))


@pytest.mark.parametrize(("plant", "seen"), [
    (skip_the_disk_tier, r"arrivals\[1\]: \[\] are not|disk LRU order"),
    (evictable_while_pinned, r"INV-FLAT-PINS|cpu LRU order"),
], ids=["a store skips a tier", "the LRU evicts a pinned object"])
def test_a_bug_planted_in_lmcache_fails_the_machine(
        plant: Callable[[pytest.MonkeyPatch], None], seen: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each planted for this test only (monkeypatch undoes it); the machine, with the
    known bugs avoided, stops at it."""
    require("lmcache")
    plant(monkeypatch)
    found = first_failure(narrowed(set(LMCacheFlat.avoid)), 40)
    assert found, "the planted bug went unseen"
    assert re.search(seen, found), found


def test_the_adapter_avoids_exactly_the_known_bugs() -> None:
    assert set(LMCacheFlat.avoid) == {RETRIEVE_FROM_DISK, RETRIEVE_ACROSS_TIERS,
                                      LOOKUP_AT_A_PARTIAL_CHUNK}
    assert all(why.startswith(("DEV-L1:", "DEV-L3:", "DEV-L4:"))
               for why in LMCacheFlat.avoid.values())
