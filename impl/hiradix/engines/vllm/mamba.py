"""vLLM 0.33.0/0.34.0's hybrid coordinator over a full-attention group (0) and a Mamba group
(1) in ``mamba_cache_mode="align"`` (spec/13m, 13m.8a), spoken to per request as vLLM's
scheduler speaks to it.

vLLM builds it unpatched on CPU (``HybridKVCacheCoordinator``, both groups drawing blocks
from one ``BlockPool``). A Mamba block holds one state. In align mode a request's Mamba
block table is indexed by position like the full one, but holds at most the block of its
running state (index cdiv(computed, P) - 1) and the one it resumed from, the rest being
the null block; a block whose index ends on a page boundary when the request has
computed that far is registered under that page's hash, as the state after it. The
scheduler cuts prefill chunks so that they end on a page boundary
(``_mamba_block_aligned_split``, sched/scheduler.py:546-662), and ``new_step_starts``
opens each scheduler step.

The adapter is ``VllmHybrid``'s plumbing (requests, the hash -> page map, ``observe``,
``free``) over a Mamba group in place of the sliding window; its forward pass writes per
computed position the position's content key into the full block, and per chunk the
state it computes into the Mamba block of the chunk's end: the state it resumed from
(the Mamba block of the chunk's start) moved on by the chunk's tokens. A state resumed
from the wrong block therefore shows as wrong content wherever vLLM caches it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hiradix.engines.protocol import probe_engine
from hiradix.engines.vllm.hybrid import (
    SETUP,
    VERSIONS,
    PoolView,
    VllmHybrid,
    cdiv,
    float16,
    modules,
)
from hiradix_model import Key
from hiradix_model.keys import content_at
from hiradix_model.mamba import MambaConfig

FULL, MAMBA = 0, 1  # the two KV cache groups, in vLLM's order (full attention first)
GARBAGE = Key((-1,))  # the "state" a forward pass resumed from no state computes


def probe() -> str:
    """The installed vLLM version, if this adapter can drive it (spec/13m, 13m.8a)."""
    return probe_engine("vllm-mamba", "vllm", VERSIONS,
                        "its HybridKVCacheCoordinator with a MambaSpec group", SETUP,
                        modules)


@dataclass(frozen=True)
class MambaSetup:
    """One vLLM (FULL, MAMBA) cache: block size P and the blocks of the shared pool (the
    null block aside)."""

    page_size: int
    num_blocks: int

    def __post_init__(self) -> None:
        for name, least in (("page_size", 1), ("num_blocks", 2)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name}: must be an int >= {least}, got {value!r}")

    def model_config(self) -> MambaConfig:
        """The model's constants: P slots per block for full KV, one state slot per
        block (slot = block id - 1); both pools are views of the one shared pool."""
        return MambaConfig(page_size=self.page_size,
                           full_slots=self.page_size * self.num_blocks,
                           state_slots=self.num_blocks)


@dataclass(frozen=True)
class MambaHit:
    """``get_computed_blocks``: the hit per group (None: a null block), its length, and
    the longest full-attention hit (``shared_prefix_boundary`` or the hit)."""

    full: tuple[int, ...]
    mamba: tuple[int | None, ...]
    tokens: int
    full_hit: int
    blocks: Any  # vLLM's KVCacheBlocks, handed back to allocate_slots


@dataclass(frozen=True)
class MambaView:
    """The shared pool (``VllmHybrid.observe``; its tables are (full, Mamba)) and the
    state each block holds (block id -> the prefix it is the state after)."""

    pool: PoolView
    states: Mapping[int, Key]


def _ids(blocks: Sequence[Any]) -> tuple[int | None, ...]:
    return tuple(None if b.is_null else int(b.block_id) for b in blocks)


class VllmMamba(VllmHybrid):
    """vLLM's ``KVCacheManager`` with a full-attention and a Mamba group (align mode)."""

    name = "vllm-mamba"

    def __init__(self, setup: MambaSetup) -> None:
        self.mamba_setup = setup
        mamba = modules()["spec"].MambaSpec(block_size=setup.page_size, shapes=((1,),),
                                            dtypes=(float16(),), mamba_cache_mode="align")
        self.build_manager(setup.page_size, setup.num_blocks, ("mamba.0", mamba))
        self.states: dict[int, Key] = {}

    # -- what the scheduler does with a request ------------------------------------------

    def step(self) -> None:
        """``new_step_starts``: a new scheduler step (Mamba forgets the hashes it cached
        in the last one, single_type_kv_cache_manager.py:2025)."""
        self.manager.new_step_starts()

    def lookup_hit(self, request_id: str) -> MambaHit:
        """``get_computed_blocks``; as the scheduler does (sched/scheduler.py:1122-1127),
        the request keeps the shared-prefix boundary it returns."""
        request = self.requests[request_id]
        blocks, hit, boundary = self.manager.get_computed_blocks(request)
        request.shared_prefix_boundary = boundary
        full, mamba = blocks.blocks
        return MambaHit(tuple(int(b.block_id) for b in full), _ids(mamba), int(hit),
                        int(boundary) or int(hit), blocks)

    def aligned_chunk(self, request_id: str, wanted: int, hit: int = 0) -> int:
        """The tokens the scheduler computes of ``wanted`` (already capped at what the
        request has left) in align mode: ``_mamba_block_aligned_split``
        (sched/scheduler.py:546-662) with no EAGLE, no lookahead, no partial hits, no
        internal checkpoint and a prefill budget above P. 0: none this step."""
        request = self.requests[request_id]
        ps = self.ps
        start = int(request.num_computed_tokens) + hit
        prefill_end = max(int(request.num_prompt_tokens), int(request.num_tokens) - 1)
        if start >= prefill_end:
            return wanted
        end = start + wanted
        if end < prefill_end:
            end = end // ps * ps
        junction = int(request.shared_prefix_boundary)
        stops = (
            (start // ps + 1) * ps if start % ps else 0,
            (int(request.num_tokens) - 1) // ps * ps,  # the last cacheable boundary
            start + (junction - start) // ps * ps if start < junction < end else 0,
        )
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)

    def schedule_mamba(self, request_id: str, num_new: int, hit: MambaHit | None = None,
                       ) -> tuple[tuple[int | None, ...], tuple[int | None, ...]] | None:
        """``allocate_slots`` for ``num_new`` tokens (with the hit on a request's first
        step), then the forward pass; the new (full, Mamba) blocks (None: a null block),
        None if refused."""
        request = self.requests[request_id]
        if hit is None:
            new = self.manager.allocate_slots(request, num_new)
        else:
            new = self.manager.allocate_slots(request, num_new, hit.tokens, hit.blocks)
        if new is None:
            return None
        start = request.num_computed_tokens + (hit.tokens if hit is not None else 0)
        end = start + num_new
        full, mamba = self.manager.get_blocks(request_id).blocks
        tokens = Key(tuple(request.all_token_ids))
        for position in range(start, end):  # the full layers' forward pass
            block = full[position // self.ps]
            self.kv[self.slots(block.block_id)[position % self.ps]] = content_at(
                tokens, position)
        self.states[int(mamba[cdiv(end, self.ps) - 1].block_id)] = self._resumed(
            mamba, tokens, start, end)
        request.num_computed_tokens = end
        new_full, new_mamba = new.blocks
        return _ids(new_full), _ids(new_mamba)

    def _resumed(self, mamba: Sequence[Any], tokens: Key, start: int, end: int) -> Key:
        """The Mamba layers' forward pass: the state after ``end`` if the block of
        ``start`` (the worker's copy source) holds the state after ``start``."""
        if start == 0:
            return Key(tokens.tokens[:end])
        source = mamba[cdiv(start, self.ps) - 1]
        if source.is_null or self.states.get(int(source.block_id)) != Key(
                tokens.tokens[:start]):
            return GARBAGE
        return Key(tokens.tokens[:end])

    def observe_mamba(self) -> MambaView:
        return MambaView(pool=self.observe(), states=dict(self.states))
