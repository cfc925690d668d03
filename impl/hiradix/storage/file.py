"""The file storage backend: one file per page under a directory, durable across restarts.

A page lives at ``<root>/<first two hex chars of its hash>/<hash>.page`` (the fan-out
keeps directories small). A file is a fixed header and the page's bytes::

    magic (8) | version (u32) | payload length (u64) | page hash (32) | checksum (32) | payload

Every byte is checked on read: magic, version and the page hash must be this format's and
this file's, the length must equal what follows the header, and the payload must match
the checksum, which covers the page hash too (the batch loop checks that last one, for
every backend). So a truncated, damaged or misplaced file, or one written under the
wrong name, is a miss counted as corrupt, never data (INV-STORAGE-INTEGRITY). Version 1
files (whose checksum did not cover the hash) read as corrupt: a miss, then rewritten.

Every primitive validates its page hash (64 lowercase hex characters) before it builds
a path, so no argument can name a file outside ``root`` (``StorageArgumentError``). Nor
can the directory: a link under ``root`` in a page's place, its fan-out directory or its
file, is never followed (a ``StorageError`` of the operation; ``clear`` removes such a
link, not what it points to), so no page is read from or written to outside ``root``.
(``root`` itself may be a link: it is the directory the caller named.)

Writes are atomic: the file is written under a temporary name in the page's own
directory, fsynced, then renamed over the final name with ``os.replace`` (and the
directory fsynced, so the rename survives a crash too). A reader sees the old file, the
new one or none, never a part. A crash can leave a temporary file behind; it is never
read as a page, and ``clear`` removes it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import tempfile
from pathlib import Path

from hiradix.storage.backend import (
    CHECKSUM_BYTES,
    CORRUPT,
    MISS,
    PageRead,
    StorageBackend,
    check_entry,
)
from hiradix.storage.errors import StorageArgumentError, StorageError
from hiradix.storage.hashing import DIGEST_BYTES, check_page_hash

MAGIC = b"HRDXPAGE"
VERSION = 2  # 2: the checksum covers the page hash
HEADER = struct.Struct(f"<8sIQ{DIGEST_BYTES}s{CHECKSUM_BYTES}s")
SUFFIX = ".page"
TEMP_SUFFIX = ".tmp"


def _fan_out(name: str) -> bool:
    """Whether ``name`` is one of this backend's two-hex-character subdirectories."""
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)


class FileBackend(StorageBackend):
    """Pages as files under ``root`` (created if missing). Several backends, in this
    process or others, may share one directory: writes are atomic renames."""

    def __init__(self, root: str | os.PathLike[str], *, name: str = "file") -> None:
        if not isinstance(root, str | os.PathLike):
            raise StorageArgumentError("root", f"must be a path, got {type(root).__name__}")
        text = os.fsdecode(root)
        if text == "":
            raise StorageArgumentError("root", "must be a non-empty path")
        if "\0" in text:  # the OS would refuse it later, as a ValueError
            raise StorageArgumentError("root", "contains a NUL character")
        path = Path(text)
        if path.exists() and not path.is_dir():
            raise StorageArgumentError("root", f"{path} exists and is not a directory")
        super().__init__(name)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StorageArgumentError("root", f"cannot create {path}: {error}") from error
        self.root = path

    def path_of(self, page_hash: str) -> Path:
        """Where the page named ``page_hash`` is (or would be) stored; the hash is checked
        first, so the path is always a file two levels under ``root``."""
        check_page_hash(page_hash, "page_hash")
        return self.root / page_hash[:2] / f"{page_hash}{SUFFIX}"

    def _inside(self, page_hash: str, operation: str) -> Path:
        """``path_of(page_hash)``, refused (``StorageError``) if its fan-out directory is
        a link: what is under ``root`` may not lead out of it."""
        path = self.path_of(page_hash)
        if path.parent.is_symlink():
            raise StorageError(self.name, operation, f"page {page_hash[:12]}: "
                                                     f"{path.parent} is a link; refused "
                                                     "(pages stay under the storage root)")
        return path

    def _open(self, page_hash: str, operation: str) -> int:
        """A read-only descriptor of the page's file, not following a link (ELOOP, an
        ``OSError``, if the file is one)."""
        return os.open(self._inside(page_hash, operation), os.O_RDONLY | os.O_NOFOLLOW)

    def _error(self, operation: str, page_hash: str, error: OSError) -> StorageError:
        return StorageError(self.name, operation, f"page {page_hash[:12]}: {error}")

    # -- the page primitives -------------------------------------------------------------

    def _header_ok(self, page_hash: str, header: bytes, file_size: int) -> bool:
        """Whether ``header`` is this format's header of this page for a file of
        ``file_size`` bytes."""
        if len(header) != HEADER.size:
            return False
        magic, version, length, name, _ = HEADER.unpack(header)
        return bool(magic == MAGIC and version == VERSION
                    and name == bytes.fromhex(page_hash) and length == file_size - HEADER.size)

    def has_page(self, page_hash: str) -> bool:
        """Whether a file with a valid header for ``page_hash`` is there (the payload is
        checked by ``read_page``)."""
        try:
            with os.fdopen(self._open(page_hash, "exists"), "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                return self._header_ok(page_hash, handle.read(HEADER.size), size)
        except FileNotFoundError:
            return False
        except OSError as error:
            raise self._error("exists", page_hash, error) from error

    def read_page(self, page_hash: str) -> PageRead:
        try:
            with os.fdopen(self._open(page_hash, "get"), "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            return MISS
        except OSError as error:
            raise self._error("get", page_hash, error) from error
        if not self._header_ok(page_hash, data[:HEADER.size], len(data)):
            return CORRUPT
        page_checksum = HEADER.unpack(data[:HEADER.size])[4]
        return PageRead("hit", data[HEADER.size:], page_checksum)

    def write_page(self, page_hash: str, payload: bytes, page_checksum: bytes) -> None:
        check_entry(page_hash, payload, page_checksum)
        final = self._inside(page_hash, "set")
        header = HEADER.pack(MAGIC, VERSION, len(payload), bytes.fromhex(page_hash),
                             page_checksum)
        try:
            final.parent.mkdir(exist_ok=True)
            handle, temp = tempfile.mkstemp(dir=final.parent, prefix=f".{page_hash[:12]}.",
                                            suffix=TEMP_SUFFIX)
            try:
                with os.fdopen(handle, "wb") as stream:
                    stream.write(header)
                    stream.write(payload)
                    stream.flush()
                    os.fsync(stream.fileno())
                os.replace(temp, final)
            except BaseException:
                # Whatever stopped the write, no temporary file may outlive it.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)
                raise
            self._sync_directory(final.parent)
        except OSError as error:
            raise self._error("set", page_hash, error) from error

    @staticmethod
    def _sync_directory(directory: Path) -> None:
        """Make a rename in ``directory`` durable (POSIX; Windows has no directory fds)."""
        if os.name != "posix":
            return
        handle = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)

    def discard_page(self, page_hash: str) -> None:
        try:
            self._inside(page_hash, "discard").unlink(missing_ok=True)
        except OSError as error:
            raise self._error("discard", page_hash, error) from error

    def clear(self) -> None:
        """Remove every page and temporary file: the fan-out subdirectories only, so
        anything else a user keeps under ``root`` is left alone. A link in a fan-out
        directory's place is removed itself; what it points to is never touched."""
        try:
            for entry in self.root.iterdir():
                if not _fan_out(entry.name):
                    continue
                if entry.is_symlink():
                    entry.unlink()
                elif entry.is_dir():
                    shutil.rmtree(entry)
        except OSError as error:
            raise StorageError(self.name, "clear", str(error)) from error

    def page_files(self) -> list[Path]:
        """Every page file now under ``root`` (not temporary files)."""
        return sorted(self.root.glob(f"??/*{SUFFIX}"))

    def temp_files(self) -> list[Path]:
        """Temporary files left under ``root`` (none, unless a write was cut short)."""
        return sorted(self.root.glob(f"??/*{TEMP_SUFFIX}"))
