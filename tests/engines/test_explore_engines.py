"""SGLang's caches refined exhaustively through their adapters (spec/14-exploration.md,
14.8): every transition of a small scope, the engine's choices inferred and judged by the
model, its observed state compared after each.

Runs in the SGLang 0.5.23 environment (``PYTHONPATH=impl:model:tests/sglang_env
.venv-sglang23/bin/python -m pytest tests/engines/test_explore_engines.py``); skipped
where an engine is absent (``engine_env.require``). Each scope finishes in seconds on the
development machine.

The first run of the HiCache scope (1 device page; SGLang builds 2 host pages for it)
stopped at an insert that re-adopts a host-only page: SGLang's ``UnifiedRadixCache`` counts
it in the insert's prefix (DEV-H4 of spec/13) and as a hit (spec/07 DEV-33); the
``sglang-unified`` adapter now maps both, and the scope completes. So do the same scope
without copies in flight, and the Rust core's device tier.
"""

from __future__ import annotations

from hiradix.conformance.explore import EngineRefinement, open_engine, refine_engine
from hiradix_model.explore import Scope

from engine_env import require

SECONDS = 60.0  # a bound on each search, far above what each takes


def run(engine: str, scope: Scope) -> tuple[EngineRefinement, str]:
    require(engine)
    opened = open_engine(engine, scope)
    try:
        result = refine_engine(opened, seconds=SECONDS)
        return result, "" if result.mismatch is None else result.mismatch.reproducer(opened)
    finally:
        opened.close()


def test_the_rust_core_agrees_on_every_transition_of_a_small_scope() -> None:
    result, _ = run("sglang-unified-rust", Scope(device_pages=2, host_pages=0))
    assert result.mismatch is None and result.figures.complete
    assert 1 < result.figures.states < result.figures.transitions
    assert set(result.skipped) == {"no write_backup in the adapter protocol"}


def test_unified_radix_cache_agrees_without_copies_in_flight() -> None:
    """The Python core with HiCache, copies cut (so no page reaches the host): every
    transition agrees, and it visits what our cache's adapter visits in the same scope
    (SGLang builds 2 host pages for 1; ours is given them)."""
    result, _ = run("sglang-unified", Scope(device_pages=2, host_pages=1, max_in_flight=0))
    assert result.mismatch is None and result.figures.complete
    assert result.scope.host_pages == 2
    ours = open_engine("ours", result.scope)
    try:
        reference = refine_engine(ours)
    finally:
        ours.close()
    assert set(result.visited) == set(reference.visited)
    assert result.figures.transitions == reference.figures.transitions


def test_unified_radix_cache_with_copies_agrees_on_every_transition() -> None:
    """With copies in flight, pages backed up, evicted and re-adopted: every transition
    agrees once DEV-H4 and DEV-33 are mapped (the path that found them included: alloc,
    insert, writing_check, evict, alloc, insert)."""
    result, script = run("sglang-unified", Scope(device_pages=1, host_pages=1))
    assert result.mismatch is None and result.figures.complete, script
    assert result.figures.states > 10
