"""Page identity in storage: one chained hash per full page (spec/09, "Page identity").

A page's name in storage must identify everything its KV bytes depend on, or a lookup
could return another page's bytes as data (INV-STORAGE-INTEGRITY):

- its whole prefix: the hash covers the previous page's hash and this page's tokens, so
  equal tokens after different prefixes get different hashes;
- its namespace (SGLang's ``extra_key``): two namespaces never share KV;
- the cache's identity, ``PageIdentity``: the model, the KV dtype and the KV layout
  (geometry), so pages of another model, precision or shape never match.

Hashes are blake2b-256 hex digests (64 lowercase hex characters). The preimage is a
length-prefixed encoding, so no two distinct (identity, namespace, parent, tokens) tuples
encode alike. Only full pages are hashed: the partial tail page is never cached.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from hiradix._slots import is_int
from hiradix.host_pool import HostKVPool
from hiradix.storage.errors import StorageArgumentError

DIGEST_BYTES = 32
HASH_CHARS = 2 * DIGEST_BYTES
_DOMAIN = b"hiradix.storage.page.v1\x00"  # bumps if the encoding ever changes
_HEX = frozenset("0123456789abcdef")
_INT64 = (-(2 ** 63), 2 ** 63)


def _text(value: str) -> bytes:
    encoded = value.encode("utf-8")
    return struct.pack("<I", len(encoded)) + encoded


@dataclass(frozen=True, slots=True)
class PageIdentity:
    """What besides its tokens a page's KV bytes depend on: the model (a caller-chosen
    string, e.g. name and revision), the KV dtype and the KV layout (kind and geometry)."""

    model: str
    dtype: str
    layout: str

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise StorageArgumentError(name, f"must be a non-empty str, got {value!r}")

    @classmethod
    def for_pool(cls, host_pool: HostKVPool, model: str) -> PageIdentity:
        """The identity of pages held in ``host_pool``: its dtype, and its KV kind with
        the geometry (layers, per-token shape) that fixes how many bytes a page holds.
        The host layout (layer_first / page_first) is left out: pages are stored in one
        canonical order whatever the host layout is."""
        if not isinstance(host_pool, HostKVPool):
            raise StorageArgumentError("host_pool", f"must be a HostKVPool, got "
                                                    f"{type(host_pool).__name__}")
        dtype = str(host_pool.dtype).removeprefix("torch.")
        shape = "x".join(str(size) for size in host_pool.token_shape)
        layout = f"{host_pool.kv_layout}/layers={host_pool.layers}/token={shape}"
        return cls(model=model, dtype=dtype, layout=layout)

    def encode(self) -> bytes:
        """The identity's part of every page preimage."""
        return _text(self.model) + _text(self.dtype) + _text(self.layout)


def check_page_hash(value: object, argument: str = "hash") -> str:
    """Validate one page hash: a str of 64 lowercase hex characters."""
    if not isinstance(value, str):
        raise StorageArgumentError(argument, f"must be a str page hash, got "
                                             f"{type(value).__name__}")
    if len(value) != HASH_CHARS or not _HEX.issuperset(value):
        raise StorageArgumentError(argument, f"must be {HASH_CHARS} lowercase hex "
                                             f"characters, got {value!r}")
    return value


def check_hashes(hashes: object, argument: str = "hashes") -> tuple[str, ...]:
    """Validate a sequence of page hashes (not a bare str); return them as a tuple."""
    if isinstance(hashes, str | bytes) or not isinstance(hashes, Sequence):
        raise StorageArgumentError(argument, f"must be a sequence of page hashes, got "
                                             f"{type(hashes).__name__}")
    for index, value in enumerate(hashes):
        check_page_hash(value, f"{argument}[{index}]")
    return tuple(hashes)


def _check_tokens(tokens: object) -> Sequence[int]:
    if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence):
        raise StorageArgumentError("tokens", f"must be a sequence of ints, got "
                                             f"{type(tokens).__name__}")
    low, high = _INT64
    for index, token in enumerate(tokens):
        if not is_int(token):
            raise StorageArgumentError("tokens", f"tokens[{index}] must be an int, got "
                                                 f"{type(token).__name__}")
        if not low <= token < high:
            raise StorageArgumentError("tokens", f"tokens[{index}] = {token} is outside "
                                                 "the int64 range")
    return tokens


def page_hashes(tokens: Sequence[int], page_size: int, identity: PageIdentity,
                namespace: str | None, parent: str | None = None) -> list[str]:
    """The chained hashes of the full pages of ``tokens``, first page first.

    ``parent`` is the hash of the page just before ``tokens[0]`` (None: ``tokens`` starts
    at the root), so hashing a key in two pieces gives the hashes of hashing it whole.
    The hashes of a prefix of ``tokens`` are a prefix of these.
    """
    checked = _check_tokens(tokens)
    if not is_int(page_size) or page_size < 1:
        raise StorageArgumentError("page_size", f"must be an int >= 1, got {page_size!r}")
    if not isinstance(identity, PageIdentity):
        raise StorageArgumentError("identity", f"must be a PageIdentity, got "
                                               f"{type(identity).__name__}")
    if namespace is not None and not isinstance(namespace, str):
        raise StorageArgumentError("namespace", f"must be a str or None, got "
                                                f"{type(namespace).__name__}")
    if parent is not None:
        check_page_hash(parent, "parent")
    # None and "" are different namespaces in the tree, so they must differ here too.
    scope = b"\x00" if namespace is None else b"\x01" + _text(namespace)
    base = hashlib.blake2b(_DOMAIN + identity.encode() + scope, digest_size=DIGEST_BYTES)
    previous = parent
    hashes: list[str] = []
    for page in range(len(checked) // page_size):
        chunk = checked[page * page_size:(page + 1) * page_size]
        hasher = base.copy()
        hasher.update(b"\x00" if previous is None else b"\x01" + bytes.fromhex(previous))
        hasher.update(struct.pack(f"<I{page_size}q", page_size, *chunk))
        previous = hasher.hexdigest()
        hashes.append(previous)
    return hashes

