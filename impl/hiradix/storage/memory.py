"""The in-memory storage backend: pages in a dict, for tests and single-process use.

It is the simplest backend that keeps the interface's promises: a write is one dict
assignment under a lock (all or nothing), and each page keeps the checksum recorded when
it was written, so damage to a stored copy is still seen (INV-STORAGE-INTEGRITY). Every
primitive validates its arguments (``StorageArgumentError`` naming the argument).

Capacity: it holds at most ``capacity_bytes`` bytes of page payload (default 1 GiB). A
write that does not fit is refused with a ``StorageError`` (operation ``set``) and stores
nothing; nothing stored is evicted to make room. So a full backend is a failing write to
the tier, which the backup's result reports (its leading count stops at that page) and
which spec/09 already models (a write fault: the write is acknowledged, the page stays
unstored, a later prefetch misses it). Eviction was not chosen: a backend that forgot
pages on its own would make a hit answered a moment ago a miss in the middle of a fetch.
"""

from __future__ import annotations

import threading

from hiradix._slots import is_int
from hiradix.storage.backend import MISS, PageRead, StorageBackend, check_entry
from hiradix.storage.errors import StorageArgumentError, StorageError
from hiradix.storage.hashing import check_page_hash

DEFAULT_CAPACITY_BYTES = 1 << 30


class MemoryBackend(StorageBackend):
    """Pages by hash in this process's memory, at most ``capacity_bytes`` bytes of
    payload (a write past it is refused, see the module docstring); gone when the process
    ends."""

    def __init__(self, name: str = "memory", *,
                 capacity_bytes: int = DEFAULT_CAPACITY_BYTES) -> None:
        if not is_int(capacity_bytes) or capacity_bytes < 1:
            raise StorageArgumentError("capacity_bytes", f"must be an int >= 1, got "
                                                         f"{capacity_bytes!r}")
        super().__init__(name)
        self.capacity_bytes = capacity_bytes
        self._pages: dict[str, tuple[bytes, bytes]] = {}  # hash -> (payload, checksum)
        self._used = 0  # payload bytes stored
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        """Payload bytes stored now."""
        with self._lock:
            return self._used

    def __len__(self) -> int:
        """Pages stored."""
        with self._lock:
            return len(self._pages)

    def has_page(self, page_hash: str) -> bool:
        check_page_hash(page_hash, "page_hash")
        with self._lock:
            return page_hash in self._pages

    def read_page(self, page_hash: str) -> PageRead:
        check_page_hash(page_hash, "page_hash")
        with self._lock:
            entry = self._pages.get(page_hash)
        if entry is None:
            return MISS
        return PageRead("hit", entry[0], entry[1])

    def write_page(self, page_hash: str, payload: bytes, page_checksum: bytes) -> None:
        check_entry(page_hash, payload, page_checksum)
        # bytes() so a caller's bytearray cannot change a stored page afterwards.
        entry = (bytes(payload), bytes(page_checksum))
        with self._lock:
            present = self._pages.get(page_hash)
            used = self._used - (0 if present is None else len(present[0])) + len(entry[0])
            if used > self.capacity_bytes:
                raise StorageError(self.name, "set", f"page {page_hash[:12]}: full "
                                                     f"({self._used} of "
                                                     f"{self.capacity_bytes} bytes used, "
                                                     f"{len(entry[0])} more needed)")
            self._pages[page_hash] = entry
            self._used = used

    def discard_page(self, page_hash: str) -> None:
        check_page_hash(page_hash, "page_hash")
        with self._lock:
            gone = self._pages.pop(page_hash, None)
            if gone is not None:
                self._used -= len(gone[0])

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()
            self._used = 0
