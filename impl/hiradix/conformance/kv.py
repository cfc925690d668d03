"""Test KV bytes that are a function of (namespace, prefix, layer).

A slot holding the KV of token ``i`` of a request holds ``pattern(content, layer)`` in
every layer, where ``content`` is the request's prefix up to token ``i`` (spec/01,
"content_at"). Reading a slot back therefore says exactly whose KV it holds, and a slot
freed or reused while a copy was in flight shows up as the wrong pattern.
"""

from __future__ import annotations

import hashlib
import math

import torch

from hiradix_model import Key

MODULUS = 2039  # a prime below 2048: every value is exact in float16 and bfloat16


def _seed(content: Key, layer: int) -> int:
    """``content``'s offset into the pattern in ``layer``, below ``MODULUS``."""
    digest = hashlib.blake2b(repr((content.namespace, content.tokens, layer)).encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") % MODULUS


def _values(seeds: torch.Tensor, elements: int) -> torch.Tensor:
    """``seeds[..., None]`` spread over ``elements`` distinct values each."""
    step = 7919 * torch.arange(elements, dtype=torch.int64)
    return (seeds.unsqueeze(-1) + step) % MODULUS - MODULUS // 2


def pattern(content: Key, layer: int, token_shape: tuple[int, ...],
            dtype: torch.dtype) -> torch.Tensor:
    """The KV one token of ``content`` has in ``layer``: distinct per element, so a
    transposed or shifted copy does not match either."""
    seed = torch.tensor(_seed(content, layer), dtype=torch.int64)
    return _values(seed, math.prod(token_shape)).to(dtype).reshape(token_shape)


def patterns(contents: list[Key], layers: int, token_shape: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:
    """``[layers, len(contents), *token_shape]``: what a pool's ``read`` should return,
    ``pattern`` of each content in each layer, in one tensor op (the checker reads and
    writes KV on most steps; one op per token was a fifth of its time, issue 13)."""
    seeds = torch.tensor([[_seed(c, layer) for c in contents] for layer in range(layers)],
                         dtype=torch.int64).reshape(layers, len(contents))
    values = _values(seeds, math.prod(token_shape))
    return values.to(dtype).reshape(layers, len(contents), *token_shape)
