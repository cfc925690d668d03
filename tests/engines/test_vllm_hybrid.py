"""vLLM 0.33.0/0.34.0's hybrid coordinator (a full and a sliding-window group over one pool)
through ``adapters.vllm_hybrid`` and ``hybrid.vllm_machine`` (spec/13, 13.9).

Runs under ``.venv-vllm`` (``make vllm-env``):
``PYTHONPATH=impl:model .venv-vllm/bin/python -m pytest -q -p no:cacheprovider
tests/engines/test_vllm_hybrid.py``. Skipped where vLLM is not installed or is another
version (``engine_env.require``). Scripted scenarios walk through what 13.9 describes;
planted bugs -- private copies of vLLM behaviour, monkeypatched in -- show each check
able to fail.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from hiradix.engines.vllm.hybrid import (
    FULL,
    SWA,
    BlockView,
    Hit,
    HybridSetup,
    PoolView,
    VllmHybrid,
)
from hiradix.engines.vllm.hybrid_machine import (
    REACH,
    content_problems,
    make_vllm_hybrid_machine,
    orphan_problems,
    run_vllm_hybrid_campaign,
    window_problems,
)
from hiradix_model import Key
from hiradix_model import hybrid as model

from engine_env import require

ENGINE = "vllm-hybrid"


@pytest.fixture(autouse=True)
def vllm_installed() -> str:
    """Skip without vLLM 0.33.0 or 0.34.0; fail where it is installed but does not probe."""
    return require(ENGINE)


def machine(setup: HybridSetup) -> tuple[Any, Counter[str]]:
    reached: Counter[str] = Counter()
    return make_vllm_hybrid_machine(setup, reached)(), reached


def flush(m: Any, base: int) -> None:
    """A request of fresh tokens that takes the whole free queue in one chunk (every
    free cached block is evicted), then finishes."""
    ps = m.engine.ps
    filler = tuple(range(base, base + ps * (len(m.expected.queue) // 2)))
    m.admit(prompt=filler, chunk=len(filler))
    m.finish(index=len(m.expected.tables) - 1)


def peek(m: Any, prompt: Sequence[int]) -> Hit:
    """``get_computed_blocks`` for ``prompt`` without scheduling it."""
    request_id = m.engine.new_request(prompt)
    hit: Hit = m.engine.lookup(request_id)
    m.engine.free(request_id)
    return hit


def pages(prompt: Sequence[int], ps: int) -> list[Key]:
    return [Key(tuple(prompt[:end])) for end in range(ps, len(prompt) + 1, ps)]


# -- scripted scenarios ----------------------------------------------------------------

def test_window_release_tombstones_and_healing() -> None:
    """Decode past the window drops the SWA blocks' references (the window lock), lazy
    eviction then makes those pages tombstones, a hit stops short of them, and the
    request that recomputes them heals them, keeping the cached full copies."""
    setup = HybridSetup(page_size=2, num_blocks=16, window=5)
    m, reached = machine(setup)
    prompt = tuple(range(1, 10))
    p0, p1, p2 = pages(prompt, 2)[:3]
    m.admit(prompt=prompt, chunk=9)
    assert m.state.pages[p0].swa_lock == 1
    m.advance(index=0, chunk=1, token=1)  # 9 tokens computed: the first 2 blocks skipped
    assert reached["window_release"] == 1
    assert m.state.pages[p0].live and m.state.pages[p0].swa_lock == 0
    assert m.state.pages[p2].swa_lock == 1 and m.state.pages[p0].lock == 1
    flush(m, 100)
    assert not m.state.pages[p0].live and not m.state.pages[p1].live  # tombstones
    assert m.state.pages[p2].live and m.state.pages[p0].lock == 1
    assert reached["evicted_swa"] >= 2
    m.finish(index=0)
    full_before = m.state.pages[p0].full
    assert peek(m, prompt[:7]).tokens == 0  # 3 full pages cached, no live window
    m.admit(prompt=prompt[:7], chunk=7)
    assert reached["hit_cut_by_window"] == 1
    assert m.state.pages[p0].live and m.state.pages[p1].live and reached["healed"] == 2
    assert m.state.pages[p0].full == full_before  # healing keeps the full copy
    view = m.engine.observe()
    assert sum(v.group == FULL and v.page == p0 for v in view.blocks.values()) == 2


def test_healing_under_a_running_requests_lock_keeps_the_locked_full_copy() -> None:
    """A tombstone healed while the request that made it still runs: its full copy is
    locked (13.3 forbids replacing it), and vLLM keeps it; both requests lock the page,
    one through the first block, one through its duplicate."""
    setup = HybridSetup(page_size=2, num_blocks=16, window=5)
    m, reached = machine(setup)
    prompt = tuple(range(1, 10))
    p0 = pages(prompt, 2)[0]
    m.admit(prompt=prompt, chunk=9)
    m.advance(index=0, chunk=1, token=1)
    flush(m, 100)
    assert not m.state.pages[p0].live and m.state.pages[p0].lock == 1
    full_before = m.state.pages[p0].full
    m.admit(prompt=prompt[:5], chunk=5)  # A still runs
    assert reached["healed"] >= 1 and m.state.pages[p0].live
    assert m.state.pages[p0].full == full_before and m.state.pages[p0].lock == 2


def test_match_window_is_cdiv_w_minus_1_pages() -> None:
    """W = 5, P = 2: vLLM resumes after two live pages, where 13.3's ceil(W / P) asks
    for three (DEV-H6); the machine's model runs with W - 1."""
    setup = HybridSetup(page_size=2, num_blocks=15, window=5)  # 8 left free: flush takes all
    m, _ = machine(setup)
    prompt = tuple(range(1, 8))
    m.admit(prompt=prompt, chunk=7)
    m.advance(index=0, chunk=1, token=1)  # 7 computed: the first block skipped
    flush(m, 100)
    m.finish(index=0)
    p0, _, p2 = pages(prompt, 2)
    assert not m.state.pages[p0].live and m.state.pages[p2].live
    assert peek(m, prompt).tokens == 6
    key = Key(prompt[:6])
    assert model.match_prefix(m.state, key).last_page == p2
    spec = replace(m.state, config=replace(m.state.config, window=setup.window))
    assert model.match_prefix(spec, key).last_page is None
    m.admit(prompt=prompt, chunk=7)  # the machine's own match check agrees


def test_eviction_leaves_swa_copies_without_full_ones() -> None:
    """``free`` queues the full blocks before the SWA ones, so lazy eviction takes the
    full copies first: SWA blocks stay cached without a page (DEV-H8), unreferenced,
    and a request cannot hit them."""
    setup = HybridSetup(page_size=2, num_blocks=10, window=3)
    m, reached = machine(setup)
    prompt = tuple(range(1, 9))
    m.admit(prompt=prompt, chunk=8)
    m.finish(index=0)
    m.admit(prompt=tuple(range(100, 106)), chunk=6)  # 6 blocks: the 2 fresh, 4 full copies
    assert reached["evicted_full"] == 4 and reached["swa_without_full"] >= 1
    assert not any(k in m.state.pages for k in pages(prompt, 2))
    orphans = [b for b, v in m.engine.observe().blocks.items()
               if v.group == SWA and v.page in pages(prompt, 2)]
    assert len(orphans) == 4
    assert peek(m, prompt).tokens == 0
    m.finish(index=0)
    m.admit(prompt=tuple(range(200, 206)), chunk=6)  # now the orphans go first
    assert reached["evicted_swa"] >= 4


def test_a_refused_request_and_a_preempted_one() -> None:
    setup = HybridSetup(page_size=2, num_blocks=6, window=3)
    m, reached = machine(setup)
    m.admit(prompt=tuple(range(1, 7)), chunk=6)  # 3 full + 3 SWA: the whole pool
    m.admit(prompt=(50, 51, 52), chunk=3)
    assert reached["refused"] == 1 and len(m.expected.tables) == 1
    for token in range(1, 4):
        m.advance(index=0, chunk=1, token=token)
    assert reached["preempted"] == 1 and not m.expected.tables


def test_a_short_campaign_passes_and_reaches_what_13_9_describes() -> None:
    result = run_vllm_hybrid_campaign([1, 2, 4], until=time.monotonic() + 120, examples=120,
                                      seeded=3)
    assert result.failure is None, result.failure
    missed = [name for name in REACH if not result.reached[name]]
    assert not missed, result.describe()
    assert result.reached["checks"] > result.reached["examples"]


# -- the checks fail on bugs planted in private copies of vLLM --------------------------

def caught(page_sizes: Sequence[int] = (2,)) -> str:
    result = run_vllm_hybrid_campaign(page_sizes, until=time.monotonic() + 60,
                                      examples=150, seeded=7)
    assert result.failure is not None, "the planted bug went unnoticed"
    return result.failure


def coordinator() -> Any:
    import vllm.v1.core.kv_cache_coordinator as module
    return module.HybridKVCacheCoordinator


def single_type() -> Any:
    import vllm.v1.core.single_type_kv_cache_manager as module
    return module


def test_a_free_that_forgets_the_swa_group_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def free(self: Any, request_id: str) -> None:
        self.single_type_managers[0].free(request_id)
        self.single_type_managers[1].pop_blocks_for_free(request_id)  # never returned

    monkeypatch.setattr(coordinator(), "free", free)
    failure = caught()
    assert "running requests hold it" in failure and "free queue" in failure


def test_a_hit_check_ignoring_the_window_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def one_block(cls: Any, window_size: int, block_size: int, use_eagle: bool) -> int:
        return 1  # any live SWA page ends a hit, whatever the window

    monkeypatch.setattr(single_type().SlidingWindowManager, "_contiguous_blocks_for_hit",
                        classmethod(one_block))
    m, _ = machine(HybridSetup(page_size=2, num_blocks=16, window=5))
    prompt = tuple(range(1, 10))
    m.admit(prompt=prompt, chunk=9)
    m.advance(index=0, chunk=1, token=1)
    flush(m, 100)  # pages 0 and 1 tombstones, page 2 live
    with pytest.raises(AssertionError, match=r"INV-SWA-MATCH-LIVE.*whose window is not live"):
        m.admit(prompt=prompt[:7], chunk=7)


def test_a_skip_that_leaves_its_ref_count_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    def remove(self: Any, request_id: str, first: int, last: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        for index in range(first, min(last, len(blocks or ()))):
            blocks[index] = self._null_block  # dropped from the table, ref_cnt kept

    monkeypatch.setattr(single_type().SingleTypeKVCacheManager, "_remove_blocks_in_range",
                        remove)
    failure = caught()
    assert "running requests hold it 0" in failure


def test_a_window_released_too_early_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    original = single_type().SlidingWindowManager.get_num_skipped_tokens

    def skipped(self: Any, num_computed_tokens: int) -> int:
        return int(original(self, num_computed_tokens + self.block_size))

    monkeypatch.setattr(single_type().SlidingWindowManager, "get_num_skipped_tokens", skipped)
    failure = caught()
    assert "INV-SWA-LOCKS" in failure


def test_cached_blocks_reused_first_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.v1.core.block_pool as block_pool

    def free_blocks(self: Any, ordered: Any) -> None:
        gone = []
        for block in ordered:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                gone.append(block)
        self.free_block_queue.prepend_n(gone)  # MRU first: cached blocks go first

    monkeypatch.setattr(block_pool.BlockPool, "free_blocks", free_blocks)
    assert "free queue" in caught()


def test_swa_blocks_cached_under_each_others_hash_are_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.v1.core.block_pool as block_pool
    original = block_pool.BlockPool.cache_full_blocks

    def cache(self: Any, request: Any, blocks: list[Any], num_cached_blocks: int,
              num_full_blocks: int, block_size: int, kv_cache_group_id: int,
              block_mask: list[bool] | None = None) -> None:
        if kv_cache_group_id == SWA and num_full_blocks - num_cached_blocks >= 2:
            new = blocks[num_cached_blocks:num_full_blocks][::-1]  # hashes go to the wrong KV
            blocks = [*blocks[:num_cached_blocks], *new, *blocks[num_full_blocks:]]
        original(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                 kv_cache_group_id, block_mask)

    monkeypatch.setattr(block_pool.BlockPool, "cache_full_blocks", cache)
    m, _ = machine(HybridSetup(page_size=2, num_blocks=16, window=5))
    with pytest.raises(AssertionError, match="INV-SWA-CONTENT"):
        m.admit(prompt=(1, 2, 3, 4, 5), chunk=5)


# -- the predicates on crafted states -----------------------------------------------------

def crafted(blocks: dict[int, BlockView], kv: dict[int, Key]) -> PoolView:
    return PoolView(blocks=blocks, queue=(), num_free=0, kv=kv, tables={})


def test_content_and_orphan_predicates_fail_on_what_they_name() -> None:
    setup = HybridSetup(page_size=2, num_blocks=4, window=3)
    engine = VllmHybrid(setup)
    page = Key((1, 2))
    good = {0: Key((1,)), 1: Key((1, 2))}
    view = crafted({1: BlockView(0, SWA, page, True)}, good)
    state = model.initial(setup.model_config())
    assert not list(content_problems(view, engine, 2))
    assert not list(orphan_problems(view, state))
    wrong = crafted({1: BlockView(1, SWA, page, True)}, {0: Key((1,)), 1: Key((1, 3))})
    assert any("INV-SWA-CONTENT" in p for p in content_problems(wrong, engine, 2))
    assert any("DEV-H8" in p for p in orphan_problems(wrong, state))


def test_window_predicate_fails_on_an_unlocked_window() -> None:
    setup = HybridSetup(page_size=2, num_blocks=8, window=3)
    tokens = (1, 2, 3, 4, 5)
    locked = model.SwaState(
        config=setup.model_config(),
        pages={Key((1, 2)): model.SwaPage((0, 1), (2, 3), 1, 0),
               Key((1, 2, 3, 4)): model.SwaPage((4, 5), (6, 7), 1, 1)},
        full_free=frozenset(), swa_free=frozenset(), held={}, full_kv={}, swa_kv={})
    assert not list(window_problems(locked, setup, tokens, 5))
    pages_ = dict(locked.pages)
    pages_[Key((1, 2, 3, 4))] = model.SwaPage((4, 5), (6, 7), 1, 0)
    unlocked = replace(locked, pages=pages_)
    assert any("INV-SWA-LOCKS" in p for p in window_problems(unlocked, setup, tokens, 5))


def test_bad_setups_name_the_argument() -> None:
    for bad, name in ((dict(page_size=0, num_blocks=4, window=3), "page_size"),
                      (dict(page_size=2, num_blocks=4, window=1), "window")):
        with pytest.raises(ValueError, match=name):
            HybridSetup(**bad)  # type: ignore[arg-type]

