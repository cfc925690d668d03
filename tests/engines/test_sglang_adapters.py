"""SGLang 0.5.20's RadixCache and HiRadixCache against the model (skipped without SGLang).

Run from the SGLang environment: ``make sglang-env``, then
``.venv-sglang/bin/python -m pytest tests/engines``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from hiradix.cli import main
from hiradix.conformance.adapters import factory
from hiradix.conformance.adapters.sglang import SglangAdapter
from hiradix.conformance.differential import make_differential
from hiradix.conformance.scenario import Scenario
from hiradix_model import Key, initial, trace

from engine_env import require
from fixed_runs import drive


@pytest.fixture(autouse=True)
def sglang_0_5_20() -> None:
    """HiRadixCache and RadixCache of SGLang 0.5.20 (skip or fail: see conftest)."""
    require("sglang")

SCENARIOS = [Scenario(page_size=ps, write_policy=policy, eviction=strategy)  # type: ignore[arg-type]
             for ps, policy, strategy in [
                 (1, "write_through", "lru"), (2, "write_through_selective", "lfu"),
                 (4, "write_through", "fifo"), (1, "write_through_selective", "slru"),
                 (2, "write_through", "priority"), (4, "write_through", "mru"),
                 (1, "write_through", "filo")]]


def bounded() -> settings:
    current = settings()
    return settings(current, max_examples=max(1, current.max_examples // 15))


@pytest.mark.parametrize("engine", ["sglang-radix", "sglang"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.slug())
def test_sglang_refines_the_model(engine: str, scenario: Scenario) -> None:
    run_state_machine_as_test(make_differential(factory(engine, scenario)), settings=bounded())


def test_dev19_reset_keeps_stale_write_acks() -> None:
    """spec/07 DEV-19, reproduced: a reset with a backup in flight leaves the backup's
    acknowledgement entry behind, and restarts node ids so a new node reuses its id.
    If this test fails, SGLang fixed it: update DEV-19 and drop the adapter's `avoid`."""
    adapter = SglangAdapter(Scenario(page_size=1), hierarchical=True)
    model = initial(adapter.config)
    slots = adapter.alloc(2)
    assert slots is not None
    adapter.insert(Key((1, 2)), slots, priority=0, chunked=False)  # write_through: backup
    assert adapter.cache.ongoing_write_through, "the insert issued no backup"
    adapter.reset()
    stale = dict(adapter.cache.ongoing_write_through)
    assert stale, "reset cleared the pending backup: DEV-19 is fixed upstream"
    seen = adapter.observe(model)
    assert seen.pending and not seen.pages, "the abstraction must show the stale copy"
    adapter.close()


def test_a_trace_recorded_from_sglang_replays_clean(tmp_path: Path) -> None:
    """spec/08: SGLang's run as a trace, adopt directives included, that the model accepts."""
    path = tmp_path / "sglang.jsonl"
    assert main(["check", "--engine", "sglang", "--examples", "8", "--steps", "30",
                 "--page-sizes", "1", "--record", str(path)]) == 0
    lines = path.read_text().splitlines()
    assert '"engine": "sglang 0.5.20"' in lines[0]
    applied, finding = trace.replay(lines)
    assert finding is None, finding
    assert applied == len(lines) - 1


def test_a_fixed_sglang_run_replays_clean() -> None:
    lines = drive(Scenario(page_size=1), "sglang")
    assert trace.replay(lines) == (len(lines) - 1, None)


def _survivors_of_a_tie(hierarchical: bool, tier: str) -> tuple[tuple[int, ...], ...]:
    """Three leaves inserted at one tick (a tie in every rank), then one evicted from
    ``tier``: the leaves still on that tier."""
    adapter = SglangAdapter(Scenario(page_size=1, eviction="fifo"), hierarchical=hierarchical)
    adapter.set_time(0)
    for tokens in [(1,), (2,), (3,)]:
        slots = adapter.alloc(1)
        assert slots is not None
        adapter.insert(Key(tokens), slots, priority=0, chunked=False)
    if hierarchical:
        adapter.writing_check()  # the backups' locks released
    if tier == "host":
        assert adapter.evict(3) == 3
        assert adapter.evict_host(1) == 1
    else:
        assert adapter.evict(1) == 1
    pages = adapter.observe(initial(adapter.config)).pages
    kept = tuple(sorted(k.tokens for k, p in pages.items()
                        if (p.host if tier == "host" else p.device) is not None))
    adapter.close()
    return kept


@pytest.mark.parametrize("hierarchical, tier", [(False, "device"), (True, "device"),
                                                (True, "host")])
def test_a_tie_among_leaves_is_broken_the_same_way_in_every_run(hierarchical: bool,
                                                                 tier: str) -> None:
    """spec/07 DEV-20: SGLang keeps evictable leaves in a set hashed by object address;
    the adapter orders it, so that an example replays (Hypothesis needs that to shrink).
    Other objects are kept alive between runs so that the caches' addresses differ."""
    ballast: list[object] = []
    seen = set()
    for run in range(30):
        seen.add(_survivors_of_a_tie(hierarchical, tier))
        ballast.append([object() for _ in range(7 * run)])
    assert len(seen) == 1, f"one tie, {len(seen)} outcomes: {sorted(seen)}"
    assert len(next(iter(seen))) == 2


@pytest.mark.parametrize("hierarchical", [False, True])
def test_adopted_fields_are_adoptable_and_each_names_a_deviation(hierarchical: bool) -> None:
    adapter = SglangAdapter(Scenario(page_size=1), hierarchical=hierarchical)
    assert set(adapter.adopted) <= set(trace.ADOPTABLE)
    assert all("DEV-" in why for why in adapter.adopted.values())
    adapter.close()


@pytest.mark.parametrize("hierarchical", [False, True])
def test_dev25_counted_from_inside_the_key_is_refused_not_approximated(
        hierarchical: bool) -> None:
    """spec/07 DEV-25: 0.5.20's insert takes only ``chunked``. counted_from = the aligned
    length is chunked; inside the key it has no counterpart: declared inexpressible (the
    differential suite never asks) and refused by the adapter, the cache untouched."""
    adapter = SglangAdapter(Scenario(page_size=1), hierarchical=hierarchical)
    assert "counted_from_inside" in adapter.inexpressible
    slots = adapter.alloc(2)
    assert slots is not None
    with pytest.raises(ValueError, match="DEV-25"):
        adapter.insert(Key((1, 2)), slots, priority=0, chunked=False, counted_from=1)
    assert adapter.observe(initial(adapter.config)).pages == {}
    adapter.insert(Key((1, 2)), slots, priority=0, chunked=False, counted_from=2)
    assert {p.hits for p in adapter.observe(initial(adapter.config)).pages.values()} == {0}
    adapter.close()
