"""Background storage I/O: a prefetch thread and a backup thread between host and storage.

The scheduler thread never waits for storage. It submits operations, each a run of
pages (hashes and the host slots they go to or come from), onto one control queue per
direction; a thread per direction does them in submission order and puts one result per
operation on a result queue, which the scheduler drains without blocking. This is the
shape of SGLang's cache controller (its prefetch and backup thread functions).

- A prefetch first asks the backend how many leading pages it has (the hit query); with
  fewer than ``min_pages`` it fetches nothing (*revoked*), else it reads those pages into
  the host slots, ``batch_pages`` at a time.
- A backup writes its pages from the host slots, ``batch_pages`` at a time.
- ``terminate(op_id)`` asks a prefetch to stop; it stops before its next batch (with
  ``batch_pages`` 1, the next page boundary). A page being read when terminate comes is
  finished and counted.

A result's ``pages_done`` counts leading pages only: those pages are in place (in host
slots, or in storage); nothing can be assumed of the rest. Until its result has been
drained, an operation owns its host slots: the caller must neither free nor rewrite them
(INV-STORAGE-WRITE-PROTECT), or a prefetch writes into reused slots and a backup stores
the wrong bytes.

With ``threaded=False`` no thread is started: submitted work waits in the queues until
``run_pending`` does it on the calling thread, so tests are deterministic.

Every submitted operation gets exactly one result, whatever happens (spec/09 DEV-S13):
a backend failure of any ``Exception`` type is a result with ``error`` set, after the
leading pages done before it. A ``BaseException`` that is not an ``Exception`` (an
interrupt) also posts that failed result first, then goes on: ``run_pending`` re-raises
it to its caller (the operations still queued stay queued), and on a thread it ends the
thread, which first fails every operation queued for it; later submissions in that
direction then fail at once (``thread died``) until a new ``StorageIO`` is made.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import torch

from hiradix._slots import is_int
from hiradix.host_pool import HostKVPool
from hiradix.storage.backend import Fetched, StorageBackend, check_batch
from hiradix.storage.errors import StorageArgumentError, StorageError

OpId = int | str
Kind = Literal["prefetch", "backup"]
KINDS: tuple[Kind, ...] = ("prefetch", "backup")
Mover = Callable[[Sequence[str], HostKVPool, torch.Tensor], Fetched]
Result = TypeVar("Result")


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """How a prefetch ended. ``pages_hit``: leading pages the hit query found (0 if it
    was not asked); ``pages_done``: leading pages now in their host slots; ``terminated``:
    ``terminate`` or ``shutdown`` cut it short; ``revoked``: fewer than ``min_pages`` hits,
    nothing fetched; ``error``: the backend failed (after ``pages_done`` pages);
    ``corrupt``: the page after ``pages_done`` failed verification, and the backend
    discarded it (DEV-S11)."""

    op_id: OpId
    pages_hit: int
    pages_done: int
    terminated: bool = False
    revoked: bool = False
    error: StorageError | None = None
    corrupt: bool = False


@dataclass(frozen=True, slots=True)
class BackupResult:
    """How a backup ended: ``pages_done`` leading pages are stored (written, or found
    there); ``terminated``: ``shutdown`` cut it short; ``error``: the backend failed."""

    op_id: OpId
    pages_done: int
    terminated: bool = False
    error: StorageError | None = None


@dataclass(frozen=True, slots=True)
class _Run:
    """How a run of batches ended: leading pages done, whether a stop cut it short, the
    error that ended it, and whether a corrupt page did."""

    done: int
    cut: bool = False
    error: StorageError | None = None
    corrupt: bool = False


@dataclass
class _Op:
    """One submitted operation, owned by the I/O until its result is queued."""

    kind: Kind
    op_id: OpId
    hashes: tuple[str, ...]
    slots: torch.Tensor  # a private copy: the caller may reuse its tensor
    min_pages: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    hit: int = 0  # a prefetch's hit query answer, once it came
    done: int = 0  # leading pages done so far, for prefetch_progress


def _check_op_id(op_id: object) -> OpId:
    if isinstance(op_id, str) or is_int(op_id):
        assert isinstance(op_id, int | str)
        return op_id
    raise StorageArgumentError("op_id", f"must be an int or a str, got {type(op_id).__name__}")


def _drain(results: queue.Queue[Result]) -> list[Result]:
    drained: list[Result] = []
    while True:
        try:
            drained.append(results.get_nowait())
        except queue.Empty:
            return drained


class StorageIO:
    """Prefetch and backup between ``host_pool`` and ``backend``, on two threads
    (``threaded``) or on the caller's thread in ``run_pending``."""

    def __init__(self, backend: StorageBackend, host_pool: HostKVPool, *,
                 threaded: bool = True, batch_pages: int = 1) -> None:
        if not isinstance(backend, StorageBackend):
            raise StorageArgumentError("backend", f"must be a StorageBackend, got "
                                                  f"{type(backend).__name__}")
        if not isinstance(host_pool, HostKVPool):
            raise StorageArgumentError("host_pool", f"must be a HostKVPool, got "
                                                    f"{type(host_pool).__name__}")
        if not isinstance(threaded, bool):
            raise StorageArgumentError("threaded", f"must be a bool, got {threaded!r}")
        if not is_int(batch_pages) or batch_pages < 1:
            raise StorageArgumentError("batch_pages", f"must be an int >= 1, got "
                                                      f"{batch_pages!r}")
        self.backend = backend
        self.host_pool = host_pool
        self.threaded = threaded
        self.batch_pages = batch_pages
        self._lock = threading.Lock()
        self._closed = False
        self._active: dict[Kind, dict[OpId, _Op]] = {kind: {} for kind in KINDS}
        self._work: dict[Kind, queue.Queue[_Op | None]] = {kind: queue.Queue()
                                                            for kind in KINDS}
        self._prefetch_results: queue.Queue[PrefetchResult] = queue.Queue()
        self._backup_results: queue.Queue[BackupResult] = queue.Queue()
        self._threads: tuple[threading.Thread, ...] = ()
        self._dead: dict[Kind, StorageError] = {}  # the directions whose thread died
        if threaded:
            self._threads = tuple(
                threading.Thread(target=self._serve, args=(kind,), daemon=True,
                                 name=f"hiradix-storage-{kind}") for kind in KINDS)
            for thread in self._threads:
                thread.start()

    # -- submitting ----------------------------------------------------------------------

    def _submit(self, kind: Kind, op_id: object, hashes: Sequence[str],
                host_slots: torch.Tensor, min_pages: int) -> None:
        checked_id = _check_op_id(op_id)
        batch = check_batch(hashes, self.host_pool, host_slots, unique=kind == "prefetch")
        op = _Op(kind, checked_id, batch.hashes, batch.slots.clone(), min_pages)
        with self._lock:
            if self._closed:
                raise StorageArgumentError("op_id", f"cannot submit {kind} {checked_id!r}: "
                                                    "the StorageIO is shut down")
            if checked_id in self._active[kind]:
                raise StorageArgumentError("op_id", f"{kind} {checked_id!r} is still running")
            dead = self._dead.get(kind)
            if dead is not None:  # no thread will do it: it fails now, with a result
                self._post(self._failed(op, dead))
                return
            self._active[kind][checked_id] = op
            self._work[kind].put(op)  # under the lock, so it is ahead of shutdown's stop

    def submit_prefetch(self, op_id: OpId, hashes: Sequence[str], host_slots: torch.Tensor,
                        *, min_pages: int = 0) -> None:
        """Queue a prefetch of the pages ``hashes`` into ``host_slots`` (one per token, none
        twice). With fewer than ``min_pages`` leading hits nothing is fetched."""
        if not is_int(min_pages) or min_pages < 0:
            raise StorageArgumentError("min_pages", f"must be an int >= 0, got {min_pages!r}")
        self._submit("prefetch", op_id, hashes, host_slots, min_pages)

    def submit_backup(self, op_id: OpId, hashes: Sequence[str],
                      host_slots: torch.Tensor) -> None:
        """Queue a backup of the pages held in ``host_slots`` under ``hashes``."""
        self._submit("backup", op_id, hashes, host_slots, 0)

    def terminate(self, op_id: OpId) -> bool:
        """Ask prefetch ``op_id`` to stop before its next batch; its result says how many
        leading pages it completed. False (and nothing done) if it is not running any
        more, e.g. its result is already queued."""
        checked = _check_op_id(op_id)
        with self._lock:
            op = self._active["prefetch"].get(checked)
        if op is None:
            return False
        op.stop.set()
        return True

    def prefetch_progress(self, op_id: OpId) -> int | None:
        """Leading pages prefetch ``op_id`` has put in place so far; None if it is not
        running any more (its result has the final count)."""
        checked = _check_op_id(op_id)
        with self._lock:
            op = self._active["prefetch"].get(checked)
            return None if op is None else op.done

    # -- results -------------------------------------------------------------------------

    def drain_prefetch(self) -> list[PrefetchResult]:
        """The prefetch results queued so far, oldest first; never blocks."""
        return _drain(self._prefetch_results)

    def drain_backup(self) -> list[BackupResult]:
        """The backup results queued so far, oldest first; never blocks."""
        return _drain(self._backup_results)

    def wait_prefetch(self, timeout_s: float) -> PrefetchResult | None:
        """The next prefetch result, waiting up to ``timeout_s`` (None if none came); for
        tests and shutdown paths, not for the scheduler loop."""
        try:
            return self._prefetch_results.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def wait_backup(self, timeout_s: float) -> BackupResult | None:
        """The next backup result, waiting up to ``timeout_s`` (None if none came)."""
        try:
            return self._backup_results.get(timeout=timeout_s)
        except queue.Empty:
            return None

    # -- doing the work ------------------------------------------------------------------

    def _transfer(self, op: _Op, limit: int, move: Mover) -> _Run:
        """Move the first ``limit`` pages of ``op`` a batch at a time."""
        size = self.host_pool.page_size
        done = 0
        while done < limit:
            if op.stop.is_set():
                return _Run(done, cut=True)
            end = min(limit, done + self.batch_pages)
            try:
                moved = move(op.hashes[done:end], self.host_pool,
                             op.slots[done * size:end * size])
            except StorageError as error:
                self._progress(op, done + error.pages_done)
                return _Run(done + error.pages_done, error=error)
            done += moved.pages_done
            self._progress(op, done)
            if done < end:  # a miss, a corrupt page or a short batch ends the run
                return _Run(done, corrupt=moved.corrupt)
        return _Run(done)

    def _store(self, hashes: Sequence[str], host_pool: HostKVPool,
               host_slots: torch.Tensor) -> Fetched:
        """A backup's batch, in a fetch's terms (a write is never corrupt)."""
        return Fetched(self.backend.set(hashes, host_pool, host_slots))

    def _progress(self, op: _Op, done: int) -> None:
        with self._lock:
            op.done = done

    def _prefetch(self, op: _Op) -> PrefetchResult:
        if op.stop.is_set():
            return PrefetchResult(op.op_id, 0, 0, terminated=True)
        try:
            hit = self.backend.exists(op.hashes)
        except StorageError as error:
            return PrefetchResult(op.op_id, 0, 0, error=error)
        op.hit = hit
        if hit < op.min_pages:
            return PrefetchResult(op.op_id, hit, 0, revoked=True)
        run = self._transfer(op, hit, self.backend.fetch)
        return PrefetchResult(op.op_id, hit, run.done, terminated=run.cut, error=run.error,
                              corrupt=run.corrupt)

    def _backup(self, op: _Op) -> BackupResult:
        run = self._transfer(op, len(op.hashes), self._store)
        return BackupResult(op.op_id, run.done, terminated=run.cut, error=run.error)

    def _failure(self, op: _Op, error: BaseException) -> StorageError:
        """``error``, which stopped ``op`` unexpectedly, as the StorageError of its result
        (a backend restates its own failures; this is for anything that got past)."""
        failure = StorageError(self.backend.name, op.kind,
                               f"unexpected {type(error).__name__}: {error}",
                               pages_done=op.done)
        failure.__cause__ = error
        return failure

    @staticmethod
    def _failed(op: _Op, failure: StorageError) -> PrefetchResult | BackupResult:
        """The result of ``op`` stopped by ``failure`` after ``op.done`` leading pages."""
        if op.kind == "prefetch":
            return PrefetchResult(op.op_id, op.hit, op.done, error=failure)
        return BackupResult(op.op_id, op.done, error=failure)

    def _post(self, result: PrefetchResult | BackupResult) -> None:
        if isinstance(result, PrefetchResult):
            self._prefetch_results.put(result)
        else:
            self._backup_results.put(result)

    def _finish(self, op: _Op, result: PrefetchResult | BackupResult) -> None:
        with self._lock:
            del self._active[op.kind][op.op_id]  # first, so a drained id may be reused
        self._post(result)

    def _execute(self, op: _Op) -> None:
        """Do ``op`` and queue its result. Every submitted operation gets exactly one
        result, or the scheduler would hold its host slots forever: an unexpected error
        (a bug, not a storage failure) is reported in the result as a StorageError, and
        an interrupt is too, before it is re-raised (see the module docstring)."""
        try:
            result = self._prefetch(op) if op.kind == "prefetch" else self._backup(op)
        except BaseException as error:  # reported in the result, never swallowed
            self._finish(op, self._failed(op, self._failure(op, error)))
            if isinstance(error, Exception):
                return
            raise
        self._finish(op, result)

    def _serve(self, kind: Kind) -> None:
        """A thread's loop: do ``kind`` operations in order until the stop sentinel. An
        interrupt ends it; every operation queued for it then fails with a result."""
        work = self._work[kind]
        try:
            while (op := work.get()) is not None:
                self._execute(op)
        except BaseException as error:
            death = StorageError(self.backend.name, kind, f"the {kind} I/O thread died: "
                                                          f"{type(error).__name__}: {error}")
            death.__cause__ = error
            with self._lock:
                self._dead[kind] = death
                for queued in _drain(work):
                    if queued is not None:
                        del self._active[kind][queued.op_id]
                        self._post(self._failed(queued, death))
            raise

    def dead(self, kind: Kind) -> StorageError | None:
        """Why the ``kind`` thread died (every later ``kind`` operation fails at once),
        or None while it lives (and always in synchronous mode)."""
        if kind not in KINDS:
            raise StorageArgumentError("kind", f"must be one of {KINDS}, got {kind!r}")
        with self._lock:
            return self._dead.get(kind)

    def run_pending(self) -> int:
        """Synchronous mode: do every queued operation now, on this thread (prefetches
        first, then backups, each in submission order); return how many were done."""
        if self.threaded:
            raise StorageArgumentError("threaded", "run_pending is for a StorageIO made "
                                                   "with threaded=False")
        count = 0
        for kind in KINDS:
            work = self._work[kind]
            while True:
                # One at a time: an interrupt re-raised by _execute leaves the rest queued.
                try:
                    op = work.get_nowait()
                except queue.Empty:
                    break
                if op is not None:
                    self._execute(op)
                    count += 1
        return count

    # -- stopping ------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The I/O threads (none in synchronous mode)."""
        return self._threads

    def shutdown(self) -> None:
        """Stop: refuse new work, stop every operation before its next batch (queued ones
        end at once, as terminated), and join the threads; the results stay drainable.
        Idempotent. A backend page that never returns blocks this (release a controlled
        backend's held pages first)."""
        with self._lock:
            first = not self._closed
            self._closed = True
            if first:
                for ops in self._active.values():
                    for op in ops.values():
                        op.stop.set()
                for work in self._work.values():
                    work.put(None)
        if self.threaded:
            for thread in self._threads:
                thread.join()
        elif first:
            self.run_pending()

    def __enter__(self) -> StorageIO:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
