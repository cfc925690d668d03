"""hiradix's own (FULL, SWA) hybrid cache (``hiradix.hybrid.SwaCache``) as an ``SwaEngine``
for the hybrid machine (spec/13).

Pages are keyed by ``Key(prefix tokens, None)``. KV codes are written as float32 values
into a tiny pool (1 layer, 1 head, head_dim 1; K and V both hold the code) and read back
from layer 0 of each pool (spec/13, 13.8), every slot: a fresh pool holds 0, which the
machine's codes leave to "no content".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import hiradix
from hiradix.clock import CountingClock
from hiradix.config import KVShape
from hiradix.conformance.hybrid.engine import LockGranularity, SwaPageView, SwaView
from hiradix.errors import InvalidArgument, InvariantViolation
from hiradix.hybrid import NO_PAIR, SwaCache, SwaNode
from hiradix_model import Key
from hiradix_model.hybrid import SwaConfig

CODE_LIMIT = 2 ** 24  # float32 holds every int of magnitude up to this exactly
TINY_KV = KVShape(layers=1, heads=1, head_dim=1, dtype=torch.float32)


def _slots(full_slots: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(full_slots), dtype=torch.int64)


def _codes_of(pool_layer: torch.Tensor) -> dict[int, int]:
    """slot -> code of one pool's layer 0 (``[2, num_slots, 1, 1]``; K holds the code)."""
    return dict(enumerate(pool_layer[0, :, 0, 0].to(torch.int64).tolist()))


def probe() -> str:
    """The version under test: hiradix is always importable beside its own adapter."""
    return hiradix.__version__


class OursSwaAdapter:
    """``SwaEngine`` over ``SwaCache`` (page-exact SWA locks, hence ``"page"``)."""

    name = "ours"
    version = hiradix.__version__
    lock_granularity: LockGranularity = "page"

    def __init__(self, config: SwaConfig) -> None:
        if not isinstance(config, SwaConfig):
            raise InvalidArgument("config", f"must be a SwaConfig, got {type(config).__name__}")
        self.config = config
        clock = CountingClock()
        self.cache = SwaCache(page_size=config.page_size, full_slots=config.full_slots,
                              swa_slots=config.swa_slots, window=config.window,
                              clock=clock.now, kv=TINY_KV)

    @staticmethod
    def _tokens(key: Key, argument: str) -> tuple[int, ...]:
        if not isinstance(key, Key):
            raise InvalidArgument(argument, f"must be a Key, got {type(key).__name__}")
        if key.namespace is not None:
            raise InvalidArgument(argument, "this adapter keys pages without a namespace")
        tokens: tuple[int, ...] = key.tokens
        return tokens

    def _page(self, node: SwaNode) -> Key | None:
        return None if node is self.cache.root else Key(node.prefix(), None)

    def alloc(self, num_tokens: int) -> tuple[int, ...] | None:
        slots = self.cache.alloc(num_tokens)
        return None if slots is None else tuple(slots.tolist())

    def write_kv(self, full_slots: Sequence[int], codes: Sequence[int]) -> None:
        if len(codes) != len(full_slots):
            raise InvalidArgument("codes", f"has {len(codes)} codes for {len(full_slots)} slots")
        for index, code in enumerate(codes):
            if not isinstance(code, int) or isinstance(code, bool) or abs(code) > CODE_LIMIT:
                raise InvalidArgument("codes", f"[{index}] = {code!r} is not an int float32 "
                                               f"holds exactly (|code| <= {CODE_LIMIT})")
        values = torch.tensor(list(codes), dtype=torch.float32).view(1, -1, 1, 1, 1)
        self.cache.write_kv(_slots(full_slots), values.expand(1, len(codes), 2, 1, 1))

    def free_swa(self, full_slots: Sequence[int]) -> None:
        self.cache.free_swa(_slots(full_slots))

    def free(self, full_slots: Sequence[int]) -> None:
        self.cache.free(_slots(full_slots))

    def match_prefix(self, key: Key) -> tuple[tuple[int, ...], Key | None]:
        found = self.cache.match_prefix(self._tokens(key, "key"))
        return tuple(found.full_slots.tolist()), self._page(found.last_node)

    def insert(self, key: Key, full_slots: Sequence[int], swa_evicted: int) -> int:
        return self.cache.insert(self._tokens(key, "key"), _slots(full_slots), swa_evicted)

    def lock(self, page: Key | None) -> object:
        tokens = () if page is None else self._tokens(page, "page")
        node = self.cache.node_at(tokens)
        if node is None:
            raise InvalidArgument("page", f"{page} is not cached")
        self.cache.inc_lock_ref(node)
        return node

    def _receipt(self, receipt: object) -> SwaNode:
        if not isinstance(receipt, SwaNode):
            raise InvalidArgument("receipt", f"must be what lock() returned, got "
                                             f"{type(receipt).__name__}")
        return receipt

    def release_swa(self, receipt: object) -> None:
        self.cache.dec_swa_lock(self._receipt(receipt))

    def unlock(self, receipt: object, swa_released: bool) -> None:
        self.cache.dec_lock_ref(self._receipt(receipt), swa_released)

    def evict_full(self, num_tokens: int) -> int:
        return self.cache.evict_full(num_tokens)

    def evict_swa(self, num_tokens: int) -> int:
        return self.cache.evict_swa(num_tokens)

    def observe(self) -> SwaView:
        ps = self.config.page_size
        pages: dict[Key, SwaPageView] = {}
        stack: list[tuple[SwaNode, tuple[int, ...]]] = [(self.cache.root, ())]
        while stack:
            parent, prefix = stack.pop()
            for node in parent.children.values():
                tokens = prefix + node.tokens
                full = node.full.tolist()
                swa = None if node.swa is None else node.swa.tolist()
                base = len(prefix)
                for start in range(0, len(node.tokens), ps):  # a node of k pages: k views
                    pages[Key(tokens[:base + start + ps], None)] = SwaPageView(
                        full=tuple(full[start:start + ps]),
                        swa=None if swa is None else tuple(swa[start:start + ps]),
                        lock=node.lock_ref, swa_lock=node.swa_lock_ref)
                stack.append((node, tokens))
        pools = self.cache.pools
        mapping = pools.mapping
        paired = (mapping != NO_PAIR).nonzero().view(-1)
        try:
            self.cache.check_invariants()
            own_check = None
        except InvariantViolation as violation:
            own_check = str(violation)
        return SwaView(
            pages=pages,
            full_free=pools.full.free_slots(),
            swa_free=pools.swa.free_slots(),
            pairs=dict(zip(paired.tolist(), mapping[paired].tolist(), strict=True)),
            full_kv=_codes_of(pools.full.layer_view(0)),
            swa_kv=_codes_of(pools.swa.layer_view(0)),
            own_check=own_check,
        )

    def close(self) -> None:
        """Nothing to release: the pools are CPU tensors the collector takes back."""


def build(config: SwaConfig) -> OursSwaAdapter:
    """A fresh adapter over an empty cache of ``config``."""
    return OursSwaAdapter(config)
