"""The in-memory storage backend: pages in a dict, for tests and single-process use.

It is the simplest backend that keeps the interface's promises: a write is one dict
assignment under a lock (all or nothing), and each page keeps the checksum recorded when
it was written, so damage to a stored copy is still seen (INV-STORAGE-INTEGRITY). Every
primitive validates its arguments (``StorageArgumentError`` naming the argument).
"""

from __future__ import annotations

import threading

from hiradix.storage.backend import MISS, PageRead, StorageBackend, check_entry
from hiradix.storage.hashing import check_page_hash


class MemoryBackend(StorageBackend):
    """Pages by hash in this process's memory; gone when the process ends."""

    def __init__(self, name: str = "memory") -> None:
        super().__init__(name)
        self._pages: dict[str, tuple[bytes, bytes]] = {}  # hash -> (payload, checksum)
        self._lock = threading.Lock()

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
            self._pages[page_hash] = entry

    def discard_page(self, page_hash: str) -> None:
        check_page_hash(page_hash, "page_hash")
        with self._lock:
            self._pages.pop(page_hash, None)

    def clear(self) -> None:
        with self._lock:
            self._pages.clear()
