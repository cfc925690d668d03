"""vLLM 0.33.0/0.34.0's hybrid coordinator with a full-attention and a Mamba group in align mode
through ``adapters.vllm_mamba`` and ``mamba.vllm_machine`` (spec/13m, 13m.8a).

Runs under ``.venv-vllm`` (``make vllm-env``):
``PYTHONPATH=impl:model .venv-vllm/bin/python -m pytest -q -p no:cacheprovider
tests/engines/test_vllm_mamba.py``. Skipped where vLLM is not installed or is another
version (``engine_env.require``). Scripted scenarios walk through what 13m.8a describes;
planted bugs -- private copies of vLLM behaviour, monkeypatched in -- show each check
able to fail.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from hiradix.engines.vllm.hybrid import BlockView, PoolView
from hiradix.engines.vllm.mamba import (
    MAMBA,
    MambaHit,
    MambaSetup,
    MambaView,
    VllmMamba,
)
from hiradix.engines.vllm.mamba_machine import (
    REACH,
    cached_content_problems,
    make_vllm_mamba_machine,
    run_vllm_mamba_campaign,
    running_problems,
)
from hiradix_model import Key

from engine_env import require

ENGINE = "vllm-mamba"
PROMPT = (1, 2, 3, 4, 5, 6, 7, 8)  # four pages of 2


@pytest.fixture(autouse=True)
def vllm_installed() -> str:
    """Skip without vLLM 0.33.0 or 0.34.0; fail where it is installed but does not probe."""
    return require(ENGINE)


def machine(setup: MambaSetup) -> tuple[Any, Counter[str]]:
    reached: Counter[str] = Counter()
    return make_vllm_mamba_machine(setup, reached)(), reached


def peek(m: Any, prompt: Sequence[int]) -> MambaHit:
    """``get_computed_blocks`` for ``prompt`` without scheduling it."""
    request_id = m.engine.new_request(prompt)
    hit: MambaHit = m.engine.lookup_hit(request_id)
    m.engine.free(request_id)
    return hit


def run_prompt(m: Any, prompt: Sequence[int], chunk: int) -> None:
    """Admit ``prompt`` and run its prefill to the end in chunks of ``chunk``; it keeps
    running (decode not begun)."""
    m.admit(prompt=tuple(prompt), chunk=chunk, same_step=False)
    newest = max(m.expected.tables, key=int)
    while m.engine.prompt_left(newest):
        m.advance(index=sorted(m.expected.tables, key=int).index(newest), chunk=chunk,
                  token=1)


def mamba_pages(m: Any) -> set[int]:
    """The token counts of the pages whose state vLLM has cached."""
    view = m.engine.observe()
    return {len(v.page.tokens) for v in view.blocks.values()
            if v.group == MAMBA and v.page is not None}


# -- scripted scenarios ----------------------------------------------------------------

def test_states_cached_at_chunk_ends_and_a_hit_cut_to_the_last_one() -> None:
    """One chunk of the whole prompt is cut at the last cacheable boundary (6 of 8
    tokens) and caches states there and at the end only; a prompt sharing 5 tokens has a
    full hit of 4 but no state there: no hit (cut to the root); one sharing 7 resumes
    after 6."""
    m, reached = machine(MambaSetup(page_size=2, num_blocks=16))
    run_prompt(m, PROMPT, chunk=8)
    assert mamba_pages(m) == {6, 8}
    m.finish(index=0)
    short = peek(m, (1, 2, 3, 4, 5, 9, 9))
    assert (short.tokens, short.full_hit) == (0, 4)
    deep = peek(m, (1, 2, 3, 4, 5, 6, 7, 9, 9))
    assert (deep.tokens, deep.full_hit) == (6, 6) and deep.mamba[:2] == (None, None)
    m.admit(prompt=(1, 2, 3, 4, 5, 9, 9), chunk=8, same_step=False)
    assert reached["hit_cut_to_state"] == 1 and reached["chunk_cut"] >= 1


def test_page_chunks_cache_every_state_and_resumed_blocks_are_released() -> None:
    """Chunks of one page cache the state at every boundary; each block a step resumed
    from goes back to the pool (cached) the step after."""
    m, reached = machine(MambaSetup(page_size=2, num_blocks=16))
    run_prompt(m, PROMPT, chunk=2)
    assert mamba_pages(m) == {2, 4, 6, 8}
    table = m.expected.tables["1"].swa
    assert [b is not None for b in table] == [False, False, True, True]
    assert reached["state_released"] >= 2
    m.advance(index=0, chunk=1, token=3)  # decode: a new state block, 8's kept a step
    m.advance(index=0, chunk=1, token=3)
    assert sum(b is not None for b in m.expected.tables["1"].swa) == 1


def test_a_hit_on_a_state_cached_in_the_same_step_is_refused() -> None:
    """MambaManager defers a request whose hit ends on a state cached this step
    (single_type_kv_cache_manager.py:1704-1712): allocate_slots refuses it."""
    m, reached = machine(MambaSetup(page_size=2, num_blocks=16))
    m.admit(prompt=(1, 2, 3, 4, 5), chunk=4, same_step=False)
    m.admit(prompt=(1, 2, 3, 4, 9), chunk=4, same_step=True)
    assert reached["same_step_refused"] == 1 and len(m.expected.tables) == 1
    m.admit(prompt=(1, 2, 3, 4, 9), chunk=4, same_step=False)
    assert reached["hit"] == 2 and len(m.expected.tables) == 2  # the refused one's too


def test_states_evicted_refusal_preemption_and_finish() -> None:
    m, reached = machine(MambaSetup(page_size=2, num_blocks=6))
    run_prompt(m, PROMPT, chunk=8)
    m.finish(index=0)
    view = m.engine.observe()
    assert view.num_free == 6 and all(v.ref_cnt == 0 for v in view.blocks.values())
    assert reached["finish"] == 1
    m.admit(prompt=tuple(range(20, 30)), chunk=8, same_step=False)  # takes cached blocks
    assert reached["evicted_full"] and reached["evicted_state"]
    m.admit(prompt=tuple(range(40, 50)), chunk=8, same_step=False)  # the pool is short
    assert reached["refused"] == 1
    m.advance(index=0, chunk=8, token=2)  # the rest of its prompt: two blocks, one free
    assert reached["preempted"] == 1 and not m.expected.tables


def test_a_short_campaign_passes_and_reaches_what_13m_8a_describes() -> None:
    campaign = run_vllm_mamba_campaign([1, 2], until=time.monotonic() + 120, examples=60,
                                       seeded=7)
    assert campaign.failure is None, campaign.failure
    assert campaign.reached["checks"] > 200
    missed = campaign.missed()
    assert set(missed) <= {"same_step_refused", "hit_cut_to_state"}, missed
    assert set(REACH) >= set(missed)


# -- planted bugs ------------------------------------------------------------------------

def single_type() -> Any:
    import vllm.v1.core.single_type_kv_cache_manager as single_type_kv_cache_manager
    return single_type_kv_cache_manager


def test_a_hit_on_the_shallowest_state_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Mamba lookup that stops at the first cached state instead of the deepest."""

    def shallowest(cls: Any, block_hashes: Any, max_length: int, kv_cache_group_ids: Any,
                   block_pool: Any, kv_cache_spec: Any, drop_eagle_block: bool,
                   alignment_tokens: int, dcp_world_size: int = 1,
                   pcp_world_size: int = 1) -> Any:
        ps = kv_cache_spec.block_size
        for index in range(max_length // ps):
            found = block_pool.get_cached_block(block_hashes[index], kv_cache_group_ids)
            if found:
                return tuple([block_pool.null_block] * index + [b] for b in found), (
                    index + 1) * ps
        return tuple([] for _ in kv_cache_group_ids), 0

    monkeypatch.setattr(single_type().MambaManager, "find_longest_cache_hit",
                        classmethod(shallowest))
    m, _ = machine(MambaSetup(page_size=2, num_blocks=16))
    run_prompt(m, PROMPT, chunk=2)
    with pytest.raises(AssertionError, match=r"INV-MAMBA-MATCH-STATE.*holds a state"):
        m.admit(prompt=(*PROMPT[:7], 9), chunk=2, same_step=False)


def test_a_state_block_freed_while_resumed_from_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Skipping every computed token: the block a step resumes from goes back to the
    pool before the step; the worker's copy then starts from no state (GARBAGE)."""
    monkeypatch.setattr(single_type().MambaManager, "get_num_skipped_tokens",
                        lambda self, computed: computed)
    m, _ = machine(MambaSetup(page_size=2, num_blocks=16))
    m.admit(prompt=PROMPT, chunk=2, same_step=False)
    garbage = r"resumes from Mamba block \d+, holding Key\(tokens=\(-1,\)"
    with pytest.raises(AssertionError, match=garbage):
        m.advance(index=0, chunk=2, token=1)


def test_resumed_blocks_never_released_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Align mode forgetting to release the blocks a request resumed from: each keeps a
    reference until the request finishes."""
    monkeypatch.setattr(single_type().MambaManager, "remove_skipped_blocks",
                        lambda self, request_id, processed, num_prompt_tokens=None: None)
    m, _ = machine(MambaSetup(page_size=2, num_blocks=16))
    m.admit(prompt=PROMPT, chunk=2, same_step=False)
    m.advance(index=0, chunk=2, token=1)
    with pytest.raises(AssertionError, match="ref_cnt"):
        m.advance(index=0, chunk=2, token=1)


def test_a_state_cached_under_another_pages_hash_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Mamba group registering a chunk's state block under the hash of the chunk's
    first page instead of its last."""
    import vllm.v1.core.block_pool as block_pool
    original = block_pool.BlockPool.cache_full_blocks

    def cache(self: Any, request: Any, blocks: list[Any], num_cached_blocks: int,
              num_full_blocks: int, block_size: int, kv_cache_group_id: int,
              block_mask: list[bool] | None = None) -> None:
        if kv_cache_group_id == MAMBA and num_full_blocks - num_cached_blocks >= 2:
            new = blocks[num_cached_blocks:num_full_blocks][::-1]
            blocks = [*blocks[:num_cached_blocks], *new, *blocks[num_full_blocks:]]
        original(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                 kv_cache_group_id, block_mask)

    monkeypatch.setattr(block_pool.BlockPool, "cache_full_blocks", cache)
    m, _ = machine(MambaSetup(page_size=2, num_blocks=16))
    with pytest.raises(AssertionError, match="INV-MAMBA-CONTENT"):
        # a chunk of 8 short of the prompt's last boundary (10), which vLLM re-keys at
        # the prompt's end anyway (_cache_partial_tail_block)
        m.admit(prompt=(*PROMPT, 9, 9, 9, 9), chunk=8, same_step=False)


def test_the_same_step_guard_forgotten_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Mamba group that lets a request resume from a state the worker writes only in
    this very step."""
    stm = single_type()
    original = stm.MambaManager.cache_blocks

    def cache(self: Any, request: Any, num_tokens: int, retention_interval: Any = None,
              *, replay_boundaries: Sequence[int]) -> None:
        original(self, request, num_tokens, retention_interval,
                 replay_boundaries=replay_boundaries)
        self.cached_blocks_this_step.clear()

    monkeypatch.setattr(stm.MambaManager, "cache_blocks", cache)
    m, _ = machine(MambaSetup(page_size=2, num_blocks=16))
    m.admit(prompt=(1, 2, 3, 4, 5), chunk=4, same_step=False)
    with pytest.raises(AssertionError, match=r"allocated.*same step True"):
        m.admit(prompt=(1, 2, 3, 4, 9), chunk=4, same_step=True)


# -- the predicates on crafted states -----------------------------------------------------

def test_running_predicate_fails_on_a_wrong_state() -> None:
    pool = PoolView(blocks={3: BlockView(1, None, None, False)}, queue=(), num_free=0,
                    kv={}, tables={})
    tokens = (1, 2, 3)
    good = MambaView(pool=pool, states={3: Key(tokens)})
    assert not list(running_problems(good, tokens, 3, [None, 3], 2))
    stale = MambaView(pool=pool, states={3: Key(tokens[:2])})
    assert list(running_problems(stale, tokens, 3, [None, 3], 2))
    assert list(running_problems(good, tokens, 3, [None, None], 2))


def test_cached_content_predicate_fails_on_a_wrong_or_referenced_orphan_state() -> None:
    engine = VllmMamba(MambaSetup(page_size=2, num_blocks=4))
    page = Key((1, 2))
    orphan = PoolView(blocks={2: BlockView(0, MAMBA, page, True)}, queue=(2,), num_free=1,
                      kv={}, tables={})
    assert not list(cached_content_problems(MambaView(orphan, {2: page}), engine))
    wrong = list(cached_content_problems(MambaView(orphan, {2: Key((1,))}), engine))
    assert any("INV-MAMBA-CONTENT" in p for p in wrong)
    held = PoolView(blocks={2: BlockView(1, MAMBA, page, True)}, queue=(), num_free=0,
                    kv={}, tables={})
    assert any("DEV-M6" in p for p in cached_content_problems(MambaView(held, {2: page}),
                                                                 engine))


def test_bad_setups_name_the_argument() -> None:
    for bad, name in ((dict(page_size=0, num_blocks=4), "page_size"),
                      (dict(page_size=2, num_blocks=1), "num_blocks")):
        with pytest.raises(ValueError, match=name):
            MambaSetup(**bad)  # type: ignore[arg-type]
