"""vLLM 0.33.0/0.34.0's hybrid coordinator (spec/13, 13.9): ``KVCacheManager`` over one
``FullAttentionSpec`` group (0) and one ``SlidingWindowSpec`` group (1), spoken to per
request as vLLM's scheduler speaks to it.

vLLM builds it unpatched on CPU (``HybridKVCacheCoordinator``, both groups drawing blocks
from one ``BlockPool``). A request does ``get_computed_blocks`` once, then
``allocate_slots`` per scheduler step: each prefill chunk and each decode token, each
call first dropping the SWA blocks its window has passed (``remove_skipped_blocks``),
then touching the hit, taking fresh blocks from the front of the free queue (lazy
eviction) and registering every full block under its hash; ``free`` returns the full
group's blocks, then the SWA group's, tail first. The adapter's forward pass writes,
per computed position, the position's content key into the full block and the SWA block
the request's block table names for it (vLLM keeps block ids, not bytes).

What ``observe`` reads, per block (all public state: ``blocks``, ``ref_cnt``,
``block_hash``, ``get_cached_block``, the free queue's ``get_all_free_blocks`` and
``get_num_free_blocks``): its reference count, the (group, page) it is registered
under, whether a lookup of that hash returns it (the *primary* block, DEV-V1's rule for
duplicates), the free queue in order, and the free counter. Spec slot = P x (block id
- 1) + offset (block 0 is vLLM's null block); the full and SWA copies share this one slot
space.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hiradix.engines.protocol import probe_engine
from hiradix_model import Key
from hiradix_model.hybrid import SwaConfig
from hiradix_model.keys import content_at

VERSIONS = ("0.33.0", "0.34.0")  # the releases whose coordinator this adapter drives
SETUP = "make vllm-env, then run .venv-vllm/bin/hiradix"
MODULES = {
    "manager": "vllm.v1.core.kv_cache_manager",
    "coordinator": "vllm.v1.core.kv_cache_coordinator",
    "utils": "vllm.v1.core.kv_cache_utils",
    "spec": "vllm.v1.kv_cache_interface",
    "request": "vllm.v1.request",
    "sampling": "vllm.sampling_params",
    "hashing": "vllm.utils.hashing",
}
HASH = "sha256_cbor"  # vLLM derives its root hash from a fixed seed: a run replays
FULL, SWA = 0, 1  # the two KV cache groups, in vLLM's order (full attention first)
MAX_MODEL_LEN = 1024

@functools.cache
def _modules() -> dict[str, Any]:
    """vLLM's modules, imported once, with its root hash seeded for ``HASH``."""
    loaded = {name: importlib.import_module(path) for name, path in MODULES.items()}
    loaded["hash_fn"] = loaded["hashing"].get_hash_fn_by_name(HASH)
    loaded["utils"].init_none_hash(loaded["hash_fn"])
    return loaded


def probe() -> str:
    """The installed vLLM version, if this adapter can drive it (spec/13, 13.9)."""
    return probe_engine("vllm-hybrid", "vllm", VERSIONS, "its HybridKVCacheCoordinator",
                        SETUP, _modules)


@dataclass(frozen=True)
class HybridSetup:
    """One vLLM hybrid cache: block size P, blocks in the pool (the null block aside) and
    the sliding window W in tokens."""

    page_size: int
    num_blocks: int
    window: int

    def __post_init__(self) -> None:
        for name, least in (("page_size", 1), ("num_blocks", 2), ("window", 2)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < least:
                raise ValueError(f"{name}: must be an int >= {least}, got {value!r}")

    @property
    def match_window_pages(self) -> int:
        """The pages a hit must end on, SWA-live (``_contiguous_blocks_for_hit``,
        single_type_kv_cache_manager.py:958: cdiv(W - 1, P), DEV-H6)."""
        return -(-(self.window - 1) // self.page_size)

    def model_config(self) -> SwaConfig:
        """The model's constants: one slot space for both copies, and the window W - 1,
        whose ceil((W - 1) / P) pages are vLLM's match window (DEV-H6)."""
        slots = self.page_size * self.num_blocks
        return SwaConfig(page_size=self.page_size, full_slots=slots, swa_slots=slots,
                         window=self.window - 1)

    def skipped_blocks(self, computed: int) -> int:
        """SWA blocks wholly before the window of the token after ``computed`` ones
        (``get_num_skipped_tokens``, single_type_kv_cache_manager.py:1148)."""
        return max(0, computed - self.window + 1) // self.page_size


@dataclass(frozen=True)
class BlockView:
    """One block of the shared pool as vLLM holds it."""

    ref_cnt: int
    group: int | None  # the group it is registered (cached) under; None: no hash
    page: Key | None  # the page its hash names
    primary: bool  # a lookup of its (hash, group) returns this block


@dataclass(frozen=True)
class PoolView:
    """vLLM's shared pool: every block but the null block, the free queue, the counter."""

    blocks: Mapping[int, BlockView]
    queue: tuple[int, ...]
    num_free: int
    kv: Mapping[int, Key]  # slot -> the content the forward pass wrote there
    tables: Mapping[str, tuple[tuple[int | None, ...], tuple[int | None, ...]]]
    # request id -> its (full, SWA) block tables as vLLM holds them (None: null block)


@dataclass(frozen=True)
class Hit:
    """``get_computed_blocks``: the hit per group (None: a null block) and its length."""

    full: tuple[int, ...]
    swa: tuple[int | None, ...]
    tokens: int
    blocks: Any  # vLLM's KVCacheBlocks, handed back to allocate_slots


class VllmHybrid:
    """vLLM's ``KVCacheManager`` with a full-attention and a sliding-window group."""

    name = "vllm-hybrid"

    def __init__(self, setup: HybridSetup) -> None:
        self.setup = setup
        swa = _modules()["spec"].SlidingWindowSpec(
            block_size=setup.page_size, num_kv_heads=1, head_size=1, dtype=_float16(),
            sliding_window=setup.window)
        self.build_manager(setup.page_size, setup.num_blocks, ("swa.0", swa))

    def build_manager(self, page_size: int, num_blocks: int, second: tuple[str, Any]) -> None:
        """A ``KVCacheManager`` over a full-attention group and ``second`` (its layer name
        and spec) drawing on one pool of ``num_blocks`` blocks (the null block aside)."""
        m = _modules()
        self.version = probe()
        ps = self.ps = page_size
        full = m["spec"].FullAttentionSpec(block_size=ps, num_kv_heads=1, head_size=1,
                                           dtype=_float16())
        groups = [m["spec"].KVCacheGroupSpec(["full.0"], full),
                  m["spec"].KVCacheGroupSpec([second[0]], second[1])]
        kv_config = m["spec"].KVCacheConfig(num_blocks=num_blocks + 1,
                                            kv_cache_tensors=[], kv_cache_groups=groups)
        self.manager = m["manager"].KVCacheManager(kv_config, max_model_len=MAX_MODEL_LEN,
                                                   scheduler_block_size=ps,
                                                   hash_block_size=ps, enable_caching=True)
        coordinator = self.manager.coordinator
        if not isinstance(coordinator, m["coordinator"].HybridKVCacheCoordinator):
            raise TypeError(f"{self.name}: vLLM built a {type(coordinator).__name__}, not "
                            f"the HybridKVCacheCoordinator")
        self.pool = self.manager.block_pool
        self.hasher = m["utils"].get_request_block_hasher(ps, m["hash_fn"])
        self.pages_by_hash: dict[bytes, Key] = {}
        self.kv: dict[int, Key] = {}
        self.requests: dict[str, Any] = {}
        self.next_id = 0

    # -- plumbing ---------------------------------------------------------------------

    def slots(self, block_id: int) -> tuple[int, ...]:
        return tuple(range((block_id - 1) * self.ps, block_id * self.ps))

    def _learn(self, request: Any) -> None:
        """Name every hash the request has by the page of its tokens."""
        tokens = tuple(request.all_token_ids)
        for index, digest in enumerate(request.block_hashes):
            self.pages_by_hash[bytes(digest)] = Key(tokens[:(index + 1) * self.ps])

    def _ids(self, blocks: Sequence[Any]) -> tuple[int | None, ...]:
        return tuple(None if b.is_null else int(b.block_id) for b in blocks)

    def tokens(self, request_id: str) -> tuple[int, ...]:
        return tuple(self.requests[request_id].all_token_ids)

    def computed(self, request_id: str) -> int:
        return int(self.requests[request_id].num_computed_tokens)

    def prompt_left(self, request_id: str) -> int:
        request = self.requests[request_id]
        return max(0, int(request.num_prompt_tokens - request.num_computed_tokens))

    # -- what the scheduler does with a request ------------------------------------------

    def new_request(self, tokens: Sequence[int]) -> str:
        """A waiting request for the prompt ``tokens``; its id."""
        m = _modules()
        self.next_id += 1
        request_id = str(self.next_id)
        request = m["request"].Request(request_id, list(tokens),
                                       m["sampling"].SamplingParams(max_tokens=MAX_MODEL_LEN),
                                       None, arrival_time=0.0, block_hasher=self.hasher)
        self.requests[request_id] = request
        self._learn(request)
        return request_id

    def lookup(self, request_id: str) -> Hit:
        """``get_computed_blocks`` (the scheduler caps it at all but the last token)."""
        blocks, hit, _ = self.manager.get_computed_blocks(self.requests[request_id])
        full, swa = blocks.blocks
        return Hit(tuple(int(b.block_id) for b in full), self._ids(swa), int(hit), blocks)

    def schedule(self, request_id: str, num_new: int,
                 hit: Hit | None = None) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """``allocate_slots`` for ``num_new`` tokens (with the hit on a request's first
        step), then the forward pass; the new (full, SWA) blocks, None if vLLM refused."""
        request = self.requests[request_id]
        if hit is None:
            new = self.manager.allocate_slots(request, num_new)
        else:
            new = self.manager.allocate_slots(request, num_new, hit.tokens, hit.blocks)
        if new is None:
            return None
        start = request.num_computed_tokens + (hit.tokens if hit is not None else 0)
        full, swa = self.manager.get_blocks(request_id).blocks
        tokens = Key(tuple(request.all_token_ids))
        for position in range(start, start + num_new):  # the forward pass
            for table in (full, swa):
                block = table[position // self.ps]
                if not block.is_null:
                    self.kv[self.slots(block.block_id)[position % self.ps]] = content_at(
                        tokens, position)
        request.num_computed_tokens = start + num_new
        new_full, new_swa = new.blocks
        return (tuple(int(b.block_id) for b in new_full),
                tuple(int(b.block_id) for b in new_swa))

    def append_token(self, request_id: str, token: int) -> None:
        """The sampled token joins the request (its next decode step computes it)."""
        request = self.requests[request_id]
        request.append_output_token_ids(token)
        self._learn(request)

    def free(self, request_id: str) -> None:
        """``free``: a finished (or preempted) request returns its blocks."""
        self.manager.free(self.requests.pop(request_id))

    # -- the state ---------------------------------------------------------------------

    def observe(self) -> PoolView:
        m = _modules()
        utils = m["utils"]
        blocks: dict[int, BlockView] = {}
        for block in self.pool.blocks[1:]:
            stored = block.block_hash
            if stored is None:
                blocks[block.block_id] = BlockView(block.ref_cnt, None, None, False)
                continue
            digest = bytes(utils.get_block_hash(stored))
            group = int(utils.get_group_id(stored))
            if digest not in self.pages_by_hash:
                raise AssertionError(f"vllm-hybrid: block {block.block_id} is cached under "
                                     f"a hash no request of this run produced")
            found = self.pool.get_cached_block(utils.BlockHash(digest), [group])
            primary = found is not None and found[0].block_id == block.block_id
            blocks[block.block_id] = BlockView(block.ref_cnt, group,
                                               self.pages_by_hash[digest], primary)
        queue = tuple(int(b.block_id)
                      for b in self.pool.free_block_queue.get_all_free_blocks())
        tables = {}
        for request_id in self.requests:
            full, swa = self.manager.get_blocks(request_id).blocks
            tables[request_id] = (self._ids(full), self._ids(swa))
        return PoolView(blocks=blocks, queue=queue, num_free=int(self.pool.get_num_free_blocks()),
                        kv=dict(self.kv), tables=tables)

    def close(self) -> None:
        self.requests.clear()


def _float16() -> Any:
    import torch
    return torch.float16


def cdiv(a: int, b: int) -> int:
    """Whole blocks of ``b`` tokens that hold ``a`` tokens (vLLM's ``cdiv``)."""
    return -(-a // b)


def modules() -> dict[str, Any]:
    """vLLM's modules as this adapter imports them (its root hash seeded), for the other
    vLLM adapters over the same coordinator (``vllm_mamba``)."""
    return _modules()


def float16() -> Any:
    """torch's float16, the dtype the adapters' KV cache specs name."""
    return _float16()
