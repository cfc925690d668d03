"""The storage backend interface: batch page operations between host slots and storage.

Everything is in pages. A batch names ``n`` pages by their hashes (``hiradix.storage.
hashing``) and gives ``n * page_size`` host slots, page ``i`` being slots
``[i * page_size, (i + 1) * page_size)``. A page's bytes are its slots over all layers,
in the canonical ``[layers, page_size, *token_shape]`` order that ``HostKVPool.read``
returns, so what is stored does not depend on the host layout.

Every batch call returns a *leading* count, as SGLang's ``batch_exists`` does: a page
after a missing, corrupt or failed one is not counted even if it is there. A
``StorageError`` carries the leading count done before the failure.

A concrete backend implements five thread-safe page primitives (``has_page``,
``read_page``, ``write_page``, ``discard_page``, ``clear``); the batch loops here do the
checking, the (de)serialisation, the integrity check and the metrics, once for all
backends, so no backend can skip the integrity check (INV-STORAGE-INTEGRITY): a page
whose bytes do not match the checksum recorded when it was written is a miss, counted as
corrupt, and is discarded so a later backup can store it again. The checksum covers
the page's hash as well as its bytes, so an entry stored under another page's name (a
misdirected write: page 2's bytes and checksum under page 1's hash) fails the check too.

A batch call raises ``StorageError`` and nothing else for a backend failure: any
``Exception`` a primitive raises (an ``OSError``, a ``MemoryError``, a bug) is restated as
one, with the leading count done before it. A ``BaseException`` that is not an
``Exception`` (an interrupt) is counted as an error and goes through unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NoReturn

import torch

from hiradix.host_pool import HostKVPool
from hiradix.storage.errors import StorageArgumentError, StorageError
from hiradix.storage.hashing import check_hashes, check_page_hash

PageStatus = Literal["hit", "miss", "corrupt"]
CHECKSUM_BYTES = 32


def checksum(payload: bytes, page_hash: str) -> bytes:
    """The integrity checksum of a page's bytes stored under ``page_hash`` (blake2b-256
    keyed by the hash): bytes that are intact but stored under another page's name fail
    it (INV-STORAGE-INTEGRITY)."""
    check_page_hash(page_hash, "page_hash")
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise StorageArgumentError("payload", f"must be bytes, got {type(payload).__name__}")
    return hashlib.blake2b(payload, digest_size=CHECKSUM_BYTES, key=bytes.fromhex(page_hash),
                           person=b"hiradix-kv-page").digest()


def check_entry(page_hash: object, payload: object, page_checksum: object) -> None:
    """Validate a page primitive's write arguments: a page hash, the page's bytes and a
    checksum of ``CHECKSUM_BYTES`` bytes."""
    check_page_hash(page_hash, "page_hash")
    if not isinstance(payload, bytes | bytearray):
        raise StorageArgumentError("payload", f"must be bytes, got {type(payload).__name__}")
    if not isinstance(page_checksum, bytes | bytearray) \
            or len(page_checksum) != CHECKSUM_BYTES:
        raise StorageArgumentError("page_checksum", f"must be {CHECKSUM_BYTES} bytes, got "
                                                    f"{page_checksum!r:.60}")


@dataclass(frozen=True, slots=True)
class PageRead:
    """What a backend found under one hash: ``hit`` with the bytes and the checksum
    recorded when they were written, ``miss``, or ``corrupt`` (the backend itself saw the
    entry is damaged, e.g. a bad file header)."""

    status: PageStatus
    payload: bytes = b""
    checksum: bytes = b""


MISS = PageRead("miss")
CORRUPT = PageRead("corrupt")


@dataclass(frozen=True, slots=True)
class StorageMetrics:
    """Counters of one backend, since it was made. A snapshot: backends replace theirs.

    ``hits``: pages ``exists`` found (its leading runs). ``misses``: lookups (``exists``
    or ``get``) that stopped at an absent page. ``corrupt``: pages found damaged by
    ``get`` (each also stops its run). ``errors``: batch calls that raised. Pages backed
    up count pages newly written; a page already present is not rewritten.
    """

    pages_prefetched: int = 0
    tokens_prefetched: int = 0
    pages_backed_up: int = 0
    tokens_backed_up: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    errors: int = 0

    def plus(self, **deltas: int) -> StorageMetrics:
        """These counters with ``deltas`` added."""
        return dataclasses.replace(self, **{name: getattr(self, name) + delta
                                            for name, delta in deltas.items()})


@dataclass(frozen=True, slots=True)
class Fetched:
    """What one ``fetch`` did: ``pages_done`` leading pages are in their host slots, and
    ``corrupt`` says the page right after them failed verification and was discarded
    (DEV-S11), so it is no longer stored."""

    pages_done: int
    corrupt: bool = False


@dataclass(frozen=True, slots=True)
class PageBatch:
    """A checked batch: its hashes, its host pool and its host slots (CPU, int64)."""

    hashes: tuple[str, ...]
    host_pool: HostKVPool
    slots: torch.Tensor

    @property
    def page_size(self) -> int:
        return self.host_pool.page_size

    def page_slots(self, index: int) -> torch.Tensor:
        """The host slots of page ``index`` of the batch."""
        size = self.page_size
        return self.slots[index * size:(index + 1) * size]


def check_batch(hashes: object, host_pool: object, host_slots: object, *,
                unique: bool) -> PageBatch:
    """Validate a batch's arguments: page hashes, a ``HostKVPool``, and one int64 slot
    per token of those pages (``unique``: none twice, for a read into them)."""
    checked_hashes = check_hashes(hashes)
    if not isinstance(host_pool, HostKVPool):
        raise StorageArgumentError("host_pool", f"must be a HostKVPool, got "
                                                f"{type(host_pool).__name__}")
    slots = host_pool.check_slots(host_slots, "host_slots", unique=unique)
    expected = len(checked_hashes) * host_pool.page_size
    if slots.numel() != expected:
        raise StorageArgumentError("host_slots", f"holds {slots.numel()} slots but "
                                                 f"{len(checked_hashes)} pages of "
                                                 f"{host_pool.page_size} need {expected}")
    return PageBatch(checked_hashes, host_pool, slots)


def encode_page(values: torch.Tensor) -> bytes:
    """The bytes of one page's values (any dtype, bfloat16 included)."""
    return bytes(values.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def verified_values(read: PageRead, host_pool: HostKVPool,
                    page_hash: str) -> torch.Tensor | None:
    """The page's values for ``host_pool`` if ``read`` is an intact hit of the page named
    ``page_hash``: its bytes match the checksum recorded for that name and have the size
    of one page of this pool. None otherwise."""
    if read.status != "hit":
        return None
    if len(read.payload) != host_pool.page_size * host_pool.bytes_per_token:
        return None
    if checksum(read.payload, page_hash) != read.checksum:
        return None
    flat = torch.frombuffer(bytearray(read.payload), dtype=torch.uint8)
    return flat.view(host_pool.dtype).reshape(host_pool.value_shape(host_pool.page_size))


class PageOps:
    """The page primitives one batch call runs on. This one goes straight to its backend;
    the controlled backend hands out one that injects faults (``enter`` is called before
    each page and may stop the run there)."""

    def __init__(self, backend: StorageBackend) -> None:
        self.backend = backend

    def enter(self, index: int) -> bool:
        """Before page ``index`` of the batch: False stops the run there."""
        return True

    def has(self, page_hash: str) -> bool:
        return self.backend.has_page(page_hash)

    def read(self, page_hash: str) -> PageRead:
        return self.backend.read_page(page_hash)

    def write(self, page_hash: str, payload: bytes, page_checksum: bytes) -> None:
        self.backend.write_page(page_hash, payload, page_checksum)

    def discard(self, page_hash: str) -> None:
        self.backend.discard_page(page_hash)


class StorageBackend(ABC):
    """A store of pages by hash, shared by the prefetch and backup threads: every method
    must be safe to call from several threads at once."""

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise StorageArgumentError("name", f"must be a non-empty str, got {name!r}")
        self._name = name
        self._metrics = StorageMetrics()
        self._metrics_lock = threading.Lock()

    @property
    def name(self) -> str:
        return self._name

    @property
    def metrics(self) -> StorageMetrics:
        """A snapshot of this backend's counters."""
        with self._metrics_lock:
            return self._metrics

    def _count(self, **deltas: int) -> None:
        with self._metrics_lock:
            self._metrics = self._metrics.plus(**deltas)

    # -- what a backend supplies ---------------------------------------------------------

    @abstractmethod
    def has_page(self, page_hash: str) -> bool:
        """Whether a page is stored under ``page_hash`` (a cheap check; ``read_page`` is
        the one that verifies its bytes)."""

    @abstractmethod
    def read_page(self, page_hash: str) -> PageRead:
        """The page stored under ``page_hash``, with the checksum recorded at write."""

    @abstractmethod
    def write_page(self, page_hash: str, payload: bytes, page_checksum: bytes) -> None:
        """Store ``payload`` and its checksum under ``page_hash``, all or nothing: a
        reader never sees a half-written page."""

    @abstractmethod
    def discard_page(self, page_hash: str) -> None:
        """Forget the page under ``page_hash`` if there is one."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every page (metrics are kept)."""

    # -- the batch interface -------------------------------------------------------------

    def _ops(self, operation: Literal["exists", "get", "set"]) -> PageOps:
        """The page primitives the next ``operation`` batch runs on."""
        return PageOps(self)

    def exists(self, hashes: Sequence[str]) -> int:
        """How many leading pages of ``hashes`` are stored."""
        return self._exists(check_hashes(hashes), self._ops("exists"))

    def get(self, hashes: Sequence[str], host_pool: HostKVPool,
            host_slots: torch.Tensor) -> int:
        """Read the leading stored, intact pages of ``hashes`` into ``host_slots``; return
        how many. Slots of pages past the count hold unspecified bytes."""
        return self.fetch(hashes, host_pool, host_slots).pages_done

    def fetch(self, hashes: Sequence[str], host_pool: HostKVPool,
              host_slots: torch.Tensor) -> Fetched:
        """``get``, also saying whether the run stopped at a corrupt page."""
        batch = check_batch(hashes, host_pool, host_slots, unique=True)
        return self._get(batch, self._ops("get"))

    def set(self, hashes: Sequence[str], host_pool: HostKVPool,
            host_slots: torch.Tensor) -> int:
        """Store the pages held in ``host_slots`` under ``hashes``; return how many leading
        pages are now stored (written, or already there). Each page's host slots are read
        only when that page is written, so they must not change until the call returns
        (INV-STORAGE-WRITE-PROTECT)."""
        batch = check_batch(hashes, host_pool, host_slots, unique=False)
        return self._set(batch, self._ops("set"))

    def _failure(self, operation: str, error: BaseException, done: int) -> BaseException:
        """What a batch call that ``error`` stopped after ``done`` leading pages raises:
        a ``StorageError`` of this backend for any ``Exception``, ``error`` itself for an
        interrupt (a ``BaseException`` that is not an ``Exception``). Counted either way."""
        self._count(errors=1)
        if not isinstance(error, Exception):
            return error
        if isinstance(error, StorageError):
            reason = error.reason if error.backend == self._name else \
                f"{error.backend}: {error.reason}"
        else:
            reason = f"unexpected {type(error).__name__}: {error}"
        return StorageError(self._name, operation, reason, pages_done=done)

    def _raise(self, operation: str, error: BaseException, done: int) -> NoReturn:
        failure = self._failure(operation, error, done)
        if failure is error:
            raise error
        raise failure from error

    def _exists(self, hashes: tuple[str, ...], ops: PageOps) -> int:
        run = missed = 0
        try:
            for index, page_hash in enumerate(hashes):
                if not ops.enter(index):
                    break
                if not ops.has(page_hash):
                    missed = 1
                    break
                run += 1
        except BaseException as error:
            self._raise("exists", error, run)
        finally:
            self._count(hits=run, misses=missed)
        return run

    def _get(self, batch: PageBatch, ops: PageOps) -> Fetched:
        done = missed = corrupt = 0
        try:
            for index, page_hash in enumerate(batch.hashes):
                if not ops.enter(index):
                    break
                read = ops.read(page_hash)
                if read.status == "miss":
                    missed = 1
                    break
                values = verified_values(read, batch.host_pool, page_hash)
                if values is None:
                    corrupt = 1
                    ops.discard(page_hash)
                    break
                batch.host_pool.write(batch.page_slots(index), values)
                done += 1
        except BaseException as error:
            self._raise("get", error, done)
        finally:
            self._count(pages_prefetched=done, tokens_prefetched=done * batch.page_size,
                        misses=missed, corrupt=corrupt)
        return Fetched(done, corrupt=bool(corrupt))

    def _set(self, batch: PageBatch, ops: PageOps) -> int:
        done = written = 0
        try:
            for index, page_hash in enumerate(batch.hashes):
                if not ops.enter(index):
                    break
                if not ops.has(page_hash):
                    # Read now, not at submit: a caller that lets these slots change while
                    # the backup runs stores wrong bytes, which tests can then see.
                    values = batch.host_pool.read(batch.page_slots(index))
                    payload = encode_page(values)
                    ops.write(page_hash, payload, checksum(payload, page_hash))
                    written += 1
                done += 1
        except BaseException as error:
            self._raise("set", error, done)
        finally:
            self._count(pages_backed_up=written, tokens_backed_up=written * batch.page_size)
        return done
