"""The Mooncake storage backend: pages in a Mooncake distributed store (spec/09m).

SGLang's production storage tier is the Mooncake store: a ``mooncake_master`` keeps the
metadata (which key lives where), and every client lends part of its memory (its global
segment) to hold objects; a client reads and writes objects over a transfer engine
(``tcp`` on a CPU machine). This backend is one such client. It needs the
``mooncake-transfer-engine-non-cuda`` wheel (``INSTALL``); without it, making a
``MooncakeClient`` raises ``MooncakeUnavailable``, a typed usage error (a
``StorageConfigError`` on field ``backend``) that names the package and the command.

A page is one object under ``<prefix>/<page hash>``. A put under a present key reports
success and keeps the present object, so a present page is never replaced. Its bytes
are a header and the page's bytes::

    magic (8) | version (u32) | payload length (u64) | checksum (32) | payload

The checksum is the one the batch loop records (it covers the page hash), so an object
under another page's key, a truncated one or a damaged one is a miss counted as corrupt,
never data (INV-STORAGE-INTEGRITY). Mooncake makes an object visible only when its put
has ended, so a reader never sees half a page (``write_page`` is all or nothing).

Batches: ``exists`` asks for the whole batch in one ``batch_is_exist``; ``fetch`` reads
the whole batch in one ``batch_get_into`` into a buffer registered with the transfer
engine (the store writes into it directly, no intermediate copy); ``set`` asks which
pages exist in one call, then puts each missing page with ``put_from`` from a registered
buffer, in order, so a put that fails stops the leading count exactly there and the
metrics count exactly the pages written. The leading counts, the integrity check and the
metrics are the base class's batch loops (backend.py), run over these staged results.

Why not straight into the host slots: a page's slots are neither contiguous nor in the
canonical ``[layers, page_size, ...]`` order in either host layout, and bytes may reach
the slots only after the integrity check passed; so the store writes into a registered
staging buffer and the verified page is copied into its slots.

A master that is not there: before ``setup`` (whose own retries take about 90 s and
print over a hundred log lines when no master answers), the client opens a TCP
connection to the master's ``host:port`` and, for an ``http(s)://`` metadata server, to
its host and port, each bounded by ``connect_timeout_s`` (2 s by default); either refused
or timed out is one ``StorageError`` (operation ``connect``) naming the address, and
``setup`` is never called (spec/09m). Other metadata kinds (``P2PHANDSHAKE``, etcd) are
passed on unprobed.

Faults: any error code other than "object not found" is a ``StorageError`` of the page it
hit, with the leading count done before it. A master that is gone answers every call with
an error (never a hit); a restarted master knows no object, so every page is a miss until
it is written again: the master keeps its metadata in memory only (spec/09m, 9m.5).
"""

from __future__ import annotations

import importlib
import math
import re
import socket
import struct
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self
from urllib.parse import urlsplit

import numpy as np
import torch

from hiradix.host_pool import HostKVPool
from hiradix.storage.backend import (
    CHECKSUM_BYTES,
    CORRUPT,
    MISS,
    Fetched,
    PageOps,
    PageRead,
    StorageBackend,
    check_batch,
    check_entry,
)
from hiradix.storage.errors import StorageArgumentError, StorageConfigError, StorageError
from hiradix.storage.hashing import check_hashes, check_page_hash

PACKAGE = "mooncake-transfer-engine-non-cuda"
VERSION = "0.3.13.post1"
INSTALL = f"pip install {PACKAGE}=={VERSION} && apt-get install -y libibverbs1"
MAGIC = b"HRDXMOON"
FORMAT_VERSION = 1
HEADER = struct.Struct(f"<8sIQ{CHECKSUM_BYTES}s")
OBJECT_NOT_FOUND = -704  # Mooncake's ErrorCode::OBJECT_NOT_FOUND
_PREFIX = re.compile(r"[A-Za-z0-9_.-]+")


class MooncakeUnavailable(StorageConfigError):
    """The ``mooncake`` backend was asked for but its client cannot be imported here."""

    def __init__(self, detail: str) -> None:
        super().__init__("backend", f"'mooncake' needs {PACKAGE}=={VERSION} ({detail}); "
                                    f"install it: {INSTALL}")


def load_client() -> Any:
    """Mooncake's ``mooncake.store`` module; ``MooncakeUnavailable`` if it cannot load
    (the wheel absent, or ``libibverbs.so.1`` missing, which its libraries link)."""
    try:
        return importlib.import_module("mooncake.store")
    except ImportError as error:
        raise MooncakeUnavailable(f"import failed: {error}") from error


def master_binary() -> Path:
    """The ``mooncake_master`` executable the wheel ships."""
    package = load_client().__file__
    assert package is not None
    path = Path(package).parent / "mooncake_master"
    if not path.is_file():
        raise MooncakeUnavailable(f"{path} is missing from the installed wheel")
    return path


def _address(argument: str, text: str) -> tuple[str, int]:
    """``host:port`` (``master``) or the host and port of an HTTP URL (``metadata``)."""
    netloc = urlsplit(text).netloc if "://" in text else text
    host, _, port = netloc.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise StorageArgumentError(argument, f"must name a host and a port, got {text!r}")
    return host.strip("[]"), int(port)


def probe(argument: str, text: str, timeout_s: float) -> None:
    """Open and close a TCP connection to ``text``'s host and port within ``timeout_s``
    seconds; ``StorageError`` (operation ``connect``), one line, if none is accepted."""
    host, port = _address(argument, text)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as error:
        raise StorageError("mooncake", "connect", f"no {argument} at {text} "
                                                  f"({host}:{port}: {error}; waited at most "
                                                  f"{timeout_s} s)") from None


def _registered(store: Any, nbytes: int) -> np.ndarray:
    """A zeroed buffer of ``nbytes`` registered with ``store``'s transfer engine."""
    buffer = np.zeros(max(nbytes, 1), dtype=np.uint8)
    code = store.register_buffer(buffer.ctypes.data, buffer.nbytes)
    if code != 0:
        raise StorageError("mooncake", "register", f"register_buffer of {nbytes} bytes "
                                                   f"returned {code}")
    return buffer


def _parse(page_hash: str, data: memoryview) -> PageRead:
    """The page in an object's bytes ``data``, or ``CORRUPT`` if its header is not this
    format's or its length is not what follows the header."""
    if len(data) < HEADER.size:
        return CORRUPT
    magic, version, length, page_checksum = HEADER.unpack(data[:HEADER.size])
    if magic != MAGIC or version != FORMAT_VERSION or length != len(data) - HEADER.size:
        return CORRUPT
    return PageRead("hit", bytes(data[HEADER.size:]), page_checksum)


class _Closing:
    """``with`` closes it."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


class MooncakeClient(_Closing):
    """One connection to the Mooncake store whose master listens at ``master``
    (``host:port``) and whose metadata server is ``metadata``
    (``http://host:port/metadata``). It lends ``segment_bytes`` of this process's memory
    to the store: objects any client puts may be held there, so they go when it closes.
    Several backends may share one client. A master or metadata server that accepts no
    connection within ``connect_timeout_s`` seconds is a ``StorageError`` at once (see
    the module docstring)."""

    def __init__(self, master: str, metadata: str, *, local_hostname: str = "127.0.0.1",
                 protocol: str = "tcp", segment_bytes: int = 64 << 20,
                 buffer_bytes: int = 16 << 20, connect_timeout_s: float = 2.0) -> None:
        for argument, value in (("master", master), ("metadata", metadata),
                                ("local_hostname", local_hostname), ("protocol", protocol)):
            if not isinstance(value, str) or not value:
                raise StorageArgumentError(argument, f"must be a non-empty str, got {value!r}")
        for argument, size in (("segment_bytes", segment_bytes),
                               ("buffer_bytes", buffer_bytes)):
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
                raise StorageArgumentError(argument, f"must be an int > 0, got {size!r}")
        if (not isinstance(connect_timeout_s, int | float) or isinstance(connect_timeout_s, bool)
                or not math.isfinite(connect_timeout_s) or connect_timeout_s <= 0):
            raise StorageArgumentError("connect_timeout_s", f"must be a finite number > 0, "
                                                            f"got {connect_timeout_s!r}")
        module = load_client()
        probe("master", master, connect_timeout_s)
        if metadata.startswith(("http://", "https://")):
            probe("metadata", metadata, connect_timeout_s)
        self.store = module.MooncakeDistributedStore()
        code = self.store.setup(local_hostname, metadata, segment_bytes, buffer_bytes,
                                protocol, "", master)
        if code != 0:
            raise StorageError("mooncake", "setup", f"setup with master {master} and "
                                                    f"metadata {metadata} returned {code}")
        self.closed = False

    def close(self) -> None:
        """Leave the store (this takes the client's heartbeat, about 2 s). Idempotent."""
        if not self.closed:
            self.closed = True
            self.store.close()


class MooncakeBackend(StorageBackend, _Closing):
    """Pages in the Mooncake store ``client`` is connected to. ``prefix`` keeps these
    pages apart from other users of the same store; ``clear`` removes only them.
    Several backends, in one process or many, may share one store. ``connect`` makes a
    backend with a client of its own, which its ``close`` closes."""

    def __init__(self, client: MooncakeClient, *, prefix: str = "hiradix",
                 name: str = "mooncake") -> None:
        if not isinstance(client, MooncakeClient):
            raise StorageArgumentError("client", f"must be a MooncakeClient, got "
                                                 f"{type(client).__name__}")
        if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
            raise StorageArgumentError("prefix", f"must be letters, digits, '_', '.' or "
                                                 f"'-', got {prefix!r}")
        super().__init__(name)
        self.client = client
        self.prefix = prefix
        self._store = client.store
        self._owns_client = False

    @classmethod
    def connect(cls, master: str, metadata: str, *, prefix: str = "hiradix",
                name: str = "mooncake", **client_options: Any) -> MooncakeBackend:
        """A backend over a new ``MooncakeClient(master, metadata, **client_options)``."""
        backend = cls(MooncakeClient(master, metadata, **client_options), prefix=prefix,
                      name=name)
        backend._owns_client = True
        return backend

    def close(self) -> None:
        """Close the client if this backend made it (``connect``); the pages held in its
        segment go with it (other clients then miss them). Idempotent."""
        if self._owns_client:
            self.client.close()

    def key(self, page_hash: str) -> str:
        """The store key of the page named ``page_hash``."""
        check_page_hash(page_hash, "page_hash")
        return f"{self.prefix}/{page_hash}"

    def _check_open(self, operation: str) -> None:
        if self.client.closed:
            raise StorageError(self.name, operation, "the backend is closed")

    def _failed(self, operation: str, page_hash: str, code: int) -> StorageError:
        return StorageError(self.name, operation, f"page {page_hash[:12]}: mooncake "
                                                  f"error {code}")

    # -- the page primitives -------------------------------------------------------------

    def has_page(self, page_hash: str) -> bool:
        key = self.key(page_hash)
        self._check_open("exists")
        code = self._store.is_exist(key)
        if code < 0:
            raise self._failed("exists", page_hash, code)
        return bool(code == 1)

    def read_page(self, page_hash: str) -> PageRead:
        key = self.key(page_hash)
        self._check_open("get")
        size = self._store.get_size(key)
        if size == OBJECT_NOT_FOUND:
            return MISS
        if size < 0:
            raise self._failed("get", page_hash, size)
        buffer = _registered(self._store, size)
        try:
            code = self._store.get_into(key, buffer.ctypes.data, size)
        finally:
            self._store.unregister_buffer(buffer.ctypes.data)
        return self._staged_read(page_hash, code, buffer.data[:max(code, 0)])

    def _staged_read(self, page_hash: str, code: int, data: memoryview) -> PageRead:
        """What a get that returned ``code`` with ``data`` in its buffer found."""
        if code == OBJECT_NOT_FOUND:
            return MISS
        if code < 0:
            raise self._failed("get", page_hash, code)
        return _parse(page_hash, data)

    def write_page(self, page_hash: str, payload: bytes, page_checksum: bytes) -> None:
        check_entry(page_hash, payload, page_checksum)
        key = self.key(page_hash)
        self._check_open("set")
        size = HEADER.size + len(payload)
        buffer = _registered(self._store, size)
        try:
            HEADER.pack_into(buffer.data, 0, MAGIC, FORMAT_VERSION, len(payload), page_checksum)
            buffer[HEADER.size:size] = np.frombuffer(payload, dtype=np.uint8)
            code = self._store.put_from(key, buffer.ctypes.data, size)
        finally:
            self._store.unregister_buffer(buffer.ctypes.data)
        if code != 0:
            raise self._failed("set", page_hash, code)

    def discard_page(self, page_hash: str) -> None:
        key = self.key(page_hash)
        self._check_open("discard")
        # force: a page read a moment ago holds a lease that would refuse the removal.
        code = self._store.remove(key, True)
        if code not in (0, OBJECT_NOT_FOUND):
            raise self._failed("discard", page_hash, code)

    def clear(self) -> None:
        self._check_open("clear")
        code = self._store.remove_by_regex(f"^{re.escape(self.prefix)}/", True)
        if code < 0:
            raise StorageError(self.name, "clear", f"mooncake error {code}")

    # -- the batches, each staged in one call to the store --------------------------------

    def exists(self, hashes: Sequence[str]) -> int:
        checked = check_hashes(hashes)
        return self._exists(checked, _Staged(self, checked))

    def fetch(self, hashes: Sequence[str], host_pool: HostKVPool,
              host_slots: torch.Tensor) -> Fetched:
        batch = check_batch(hashes, host_pool, host_slots, unique=True)
        object_bytes = HEADER.size + batch.page_size * host_pool.bytes_per_token
        ops = _Staged(self, batch.hashes, object_bytes)
        try:
            return self._get(batch, ops)
        finally:
            ops.release()

    def set(self, hashes: Sequence[str], host_pool: HostKVPool,
            host_slots: torch.Tensor) -> int:
        batch = check_batch(hashes, host_pool, host_slots, unique=False)
        return self._set(batch, _Staged(self, batch.hashes))


class _Staged(PageOps):
    """The page primitives of one batch call: which pages exist, and (for a read, when
    ``object_bytes`` is given) their objects, asked of the store for the whole batch in
    one call at the first page. The call runs inside the batch loop, so its failure is
    that loop's failure at page 0."""

    def __init__(self, backend: MooncakeBackend, hashes: tuple[str, ...],
                 object_bytes: int | None = None) -> None:
        super().__init__(backend)
        self.mooncake = backend
        self.hashes = hashes
        self.object_bytes = object_bytes
        self.index = 0
        self.codes: list[int] | None = None
        self.buffer: np.ndarray | None = None

    def enter(self, index: int) -> bool:
        self.index = index
        return True

    def _stage(self) -> list[int]:
        if self.codes is None:
            backend, store = self.mooncake, self.mooncake._store
            backend._check_open("get" if self.object_bytes else "exists")
            keys = [backend.key(page_hash) for page_hash in self.hashes]
            if self.object_bytes is None:
                self.codes = list(store.batch_is_exist(keys))
            else:
                size = self.object_bytes
                self.buffer = _registered(store, size * len(keys))
                base = self.buffer.ctypes.data
                self.codes = list(store.batch_get_into(
                    keys, [base + i * size for i in range(len(keys))], [size] * len(keys)))
        return self.codes

    def has(self, page_hash: str) -> bool:
        code = self._stage()[self.index]
        if code < 0:
            raise self.mooncake._failed("exists", page_hash, code)
        return bool(code == 1)

    def read(self, page_hash: str) -> PageRead:
        code = self._stage()[self.index]
        if code < 0 and code != OBJECT_NOT_FOUND:
            # An object that does not fit the page's size (a damaged or foreign one) is
            # refused by the batch read; read it alone, at its own size, to judge it.
            return self.mooncake.read_page(page_hash)
        assert self.buffer is not None and self.object_bytes is not None
        start = self.index * self.object_bytes
        view = self.buffer.data[start:start + max(code, 0)]
        return self.mooncake._staged_read(page_hash, code, view)

    def release(self) -> None:
        """Unregister the staging buffer, if one was made."""
        if self.buffer is not None:
            self.mooncake._store.unregister_buffer(self.buffer.ctypes.data)
            self.buffer = None
