"""hiradix's own (FULL, MAMBA) hybrid cache (``hiradix.mamba.MambaCache``) as a
``MambaEngine`` for the Mamba machine (spec/13m).

Pages are keyed by ``Key(prefix tokens, None)``. KV codes are written as float32 values
into a tiny full pool (1 layer, 1 head, head_dim 1; K and V both hold the code), state
codes into a tiny state pool (1 layer, state_dim 1); both are read back from layer 0
(13m.8), every slot: a fresh pool holds 0, which the machine's codes leave to "no
content". A node of k pages is read as k pages, its state and state lock on the last.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import hiradix
from hiradix.clock import CountingClock
from hiradix.conformance.mamba.engine import MambaHit, MambaPageView, MambaView
from hiradix.engines.ours.swa import CODE_LIMIT, TINY_KV
from hiradix.errors import InvalidArgument
from hiradix.mamba import MambaCache, MambaNode
from hiradix_model import Key
from hiradix_model.mamba import MambaConfig

STATE_DIM = 1  # one float32 a state: the code


def _slots(full_slots: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(full_slots), dtype=torch.int64)


def _check_code(code: object, argument: str) -> float:
    if not isinstance(code, int) or isinstance(code, bool) or abs(code) > CODE_LIMIT:
        raise InvalidArgument(argument, f"{code!r} is not an int float32 holds exactly "
                                        f"(|code| <= {CODE_LIMIT})")
    return float(code)


def _as_codes(values: torch.Tensor) -> dict[int, int]:
    """slot -> code of a 1-D tensor of one value a slot."""
    return dict(enumerate(values.to(torch.int64).tolist()))


def probe() -> str:
    """The version under test: hiradix is always importable beside its own adapter."""
    return hiradix.__version__


class OursMambaAdapter:
    """``MambaEngine`` over ``MambaCache``; lock receipts are the locked nodes."""

    name = "ours-mamba"
    version = hiradix.__version__

    def __init__(self, config: MambaConfig) -> None:
        if not isinstance(config, MambaConfig):
            raise InvalidArgument("config", f"must be a MambaConfig, got "
                                            f"{type(config).__name__}")
        self.config = config
        self.cache = MambaCache(page_size=config.page_size, full_slots=config.full_slots,
                                state_slots=config.state_slots, clock=CountingClock().now,
                                kv=TINY_KV, state_dim=STATE_DIM, state_dtype=torch.float32)

    @staticmethod
    def _tokens(key: Key, argument: str) -> tuple[int, ...]:
        if not isinstance(key, Key):
            raise InvalidArgument(argument, f"must be a Key, got {type(key).__name__}")
        if key.namespace is not None:
            raise InvalidArgument(argument, "this adapter keys pages without a namespace")
        tokens: tuple[int, ...] = key.tokens
        return tokens

    def _node(self, page: Key | None) -> MambaNode:
        """The node whose last page is ``page`` (split there if needed; the root: None)."""
        node = self.cache.node_at(() if page is None else self._tokens(page, "page"))
        if node is None:
            raise InvalidArgument("page", f"{page} is not cached")
        return node

    def _page(self, node: MambaNode) -> Key | None:
        return None if node is self.cache.root else Key(node.prefix(), None)

    @staticmethod
    def _receipt(receipt: object) -> MambaNode:
        if not isinstance(receipt, MambaNode):
            raise InvalidArgument("receipt", f"must be what lock() returned, got "
                                             f"{type(receipt).__name__}")
        return receipt

    # -- pools ------------------------------------------------------------------------------

    def alloc(self, num_tokens: int) -> tuple[int, ...] | None:
        slots = self.cache.alloc(num_tokens)
        return None if slots is None else tuple(slots.tolist())

    def write_kv(self, full_slots: Sequence[int], codes: Sequence[int]) -> None:
        if len(codes) != len(full_slots):
            raise InvalidArgument("codes", f"has {len(codes)} codes for {len(full_slots)} slots")
        values = torch.tensor([_check_code(c, f"codes[{i}]") for i, c in enumerate(codes)],
                              dtype=torch.float32).view(1, -1, 1, 1, 1)
        self.cache.write_kv(_slots(full_slots), values.expand(1, len(codes), 2, 1, 1))

    def free(self, full_slots: Sequence[int]) -> None:
        self.cache.free(_slots(full_slots))

    def alloc_state(self) -> int | None:
        return self.cache.alloc_state()

    def write_state(self, slot: int, code: int) -> None:
        value = _check_code(code, "code")
        self.cache.write_state(slot, torch.full((1, STATE_DIM), value, dtype=torch.float32))

    def free_state(self, slot: int) -> None:
        self.cache.free_state(slot)

    def fork(self, page: Key) -> int | None:
        return self.cache.fork(self._node(page))

    # -- the tree ---------------------------------------------------------------------------

    def match_prefix(self, key: Key) -> MambaHit:
        found = self.cache.match_prefix(self._tokens(key, "key"))
        return MambaHit(full=tuple(found.full_slots.tolist()), page=self._page(found.last_node),
                        full_hit=found.full_hit)

    def insert(self, key: Key, full_slots: Sequence[int], state: int) -> tuple[int, bool]:
        return self.cache.insert(self._tokens(key, "key"), _slots(full_slots), state)

    def lock(self, page: Key | None, with_state: bool) -> object:
        node = self._node(page)
        self.cache.inc_lock_ref(node, with_state)
        return node

    def release_state(self, receipt: object) -> None:
        self.cache.dec_state_lock(self._receipt(receipt))

    def unlock(self, receipt: object, state_released: bool) -> None:
        self.cache.dec_lock_ref(self._receipt(receipt), state_released)

    def evict_full(self, num_tokens: int) -> int:
        return self.cache.evict_full(num_tokens)

    def evict_states(self, num_states: int) -> int:
        return self.cache.evict_states(num_states)

    # -- reading it back (13m.8) ------------------------------------------------------------

    def observe(self) -> MambaView:
        ps = self.config.page_size
        pages: dict[Key, MambaPageView] = {}
        stack: list[tuple[MambaNode, tuple[int, ...]]] = [(self.cache.root, ())]
        while stack:
            parent, prefix = stack.pop()
            for node in parent.children.values():
                tokens = prefix + node.tokens
                full = node.full.tolist()
                for start in range(0, len(node.tokens), ps):  # a node of k pages: k views
                    last = start + ps == len(node.tokens)
                    pages[Key(tokens[:len(prefix) + start + ps], None)] = MambaPageView(
                        full=tuple(full[start:start + ps]),
                        state=node.state if last else None, lock=node.lock_ref,
                        state_lock=node.state_lock_ref if last else 0)
                stack.append((node, tokens))
        pools = self.cache.pools
        found = self.cache.violations()
        return MambaView(
            pages=pages,
            full_free=pools.full.free_slots(),
            state_free=pools.states.free_slots(),
            full_kv=_as_codes(pools.full.layer_view(0)[0, :, 0, 0]),
            state_kv=_as_codes(pools.states.states[:, 0, 0]),
            own_check="; ".join(f"{i}: {d}" for i, d in found) if found else None,
        )

    def close(self) -> None:
        """Nothing to release: the pools are CPU tensors the collector takes back."""


def build(config: MambaConfig) -> OursMambaAdapter:
    """A fresh adapter over an empty cache of ``config``."""
    return OursMambaAdapter(config)
