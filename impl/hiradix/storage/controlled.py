"""A storage backend for tests: another backend, with faults the test injects.

The test queues faults per operation (``exists``, ``get``, ``set``); each batch call of
that operation takes the next one (none queued: the call passes straight through). A
``Fault`` hits page ``at_page`` of its batch; the pages before it are done normally:

- ``ok``: nothing happens (a placeholder, to fault a later call);
- ``raise``: the call raises ``StorageError`` before doing any page (``at_page`` 0);
- ``die``: ``at_page`` (>= 1) pages are done, then the call raises ``StorageError``
  whose ``pages_done`` says so;
- ``short``: the call returns ``at_page``, fewer pages than asked, without an error;
- ``corrupt``: ``get`` receives the page's bytes damaged (the checksum recorded at write
  time no longer matches), so the batch loop counts it corrupt and stops there; ``set``
  stores the page damaged, so a later ``get`` of it is corrupt. Not for ``exists``;
- ``slow``: the page waits until the test calls ``release`` (``wait_held`` tells when a
  page is waiting), then goes on. ``hold_timeout_s`` is a safety net: a page still held
  after it fails with ``StorageError`` instead of hanging the test;
- ``runtime_error``, ``os_error``, ``memory_error``: ``at_page`` (>= 0) pages are done,
  then the call raises ``RuntimeError``, ``OSError`` or ``MemoryError``, as a
  broken backend would. The batch call restates it as a ``StorageError`` with
  ``pages_done`` = ``at_page`` (backend.py), so it behaves as ``raise`` (at page 0) or
  ``die`` (later);
- ``interrupt``: ``at_page`` pages are done, then ``InjectedInterrupt``, a
  ``BaseException`` that is not an ``Exception``, escapes the batch call unchanged: on
  the I/O's thread it ends that thread (io.py), on the caller's thread it reaches the
  caller.

The gate (``close_gate``) makes threaded I/O deterministic for a test that steps a model
beside it: every batch call from a thread other than the one that closed the gate waits
there until the test lets it through (``let_through``), so the I/O threads run but the
test decides when each call happens, and so when results become visible. The closing
thread's own calls (a hit query on the scheduler thread) pass. ``refuse`` makes waiting
and arriving calls fail with ``StorageError`` before touching a page (a shutdown must not
wait for a test that will not release them), and ``gate_timeout_s`` is the safety net: a
call never let through fails naming the wait instead of hanging the test.

A fault whose ``at_page`` is past its batch does nothing. After every ``get`` (``fetch``), the host
slots of the pages past the returned count are overwritten with NaN: they hold
unspecified bytes by contract, and this makes a caller that reads them fail its tests.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from hiradix._slots import is_int
from hiradix.host_pool import HostKVPool
from hiradix.storage.backend import (
    Fetched,
    PageBatch,
    PageOps,
    PageRead,
    StorageBackend,
    check_batch,
)
from hiradix.storage.errors import StorageArgumentError, StorageError

FaultKind = Literal["ok", "raise", "short", "corrupt", "slow", "die", "runtime_error",
                    "os_error", "memory_error", "interrupt"]
FAULT_KINDS: tuple[FaultKind, ...] = get_args(FaultKind)


class InjectedInterrupt(BaseException):
    """The ``interrupt`` fault: a ``BaseException`` that no ``except Exception`` catches."""


# The foreign exceptions the faults of these kinds raise (not StorageError).
FOREIGN: dict[FaultKind, type[BaseException]] = {
    "runtime_error": RuntimeError,
    "os_error": OSError,
    "memory_error": MemoryError,
    "interrupt": InjectedInterrupt,
}
Operation = Literal["exists", "get", "set"]
OPERATIONS: tuple[Operation, ...] = get_args(Operation)


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault: ``kind`` at page ``at_page`` of the batch call it is taken by."""

    kind: FaultKind
    at_page: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise StorageArgumentError("kind", f"must be one of {FAULT_KINDS}, "
                                               f"got {self.kind!r}")
        if not is_int(self.at_page) or self.at_page < 0:
            raise StorageArgumentError("at_page", f"must be an int >= 0, got "
                                                  f"{self.at_page!r}")
        if self.kind == "raise" and self.at_page != 0:
            raise StorageArgumentError("at_page", "a 'raise' fault fails before any page; "
                                                  "use 'die' to fail after some")
        if self.kind == "die" and self.at_page == 0:
            raise StorageArgumentError("at_page", "a 'die' fault needs at_page >= 1 (pages "
                                                  "done before it); use 'raise' for none")


def _damaged(payload: bytes) -> bytes:
    """``payload`` with its first byte inverted: the same size, a different checksum."""
    return bytes([payload[0] ^ 0xFF]) + payload[1:]


class _FaultyOps(PageOps):
    """The page primitives of one batch call, with that call's fault (if any)."""

    def __init__(self, backend: ControlledBackend, operation: Operation,
                 fault: Fault | None) -> None:
        super().__init__(backend)
        self.controlled = backend
        self.operation = operation
        self.fault = fault
        self.index = -1

    def _hits(self, kind: FaultKind) -> bool:
        return (self.fault is not None and self.fault.kind == kind
                and self.fault.at_page == self.index)

    def enter(self, index: int) -> bool:
        self.index = index
        if self._hits("raise") or self._hits("die"):
            raise StorageError(self.controlled.name, self.operation,
                               f"injected fault at page {index}")
        if self.fault is not None and self.fault.kind in FOREIGN and self._hits(self.fault.kind):
            raise FOREIGN[self.fault.kind](f"injected {self.fault.kind} in "
                                           f"{self.operation} at page {index}")
        if self._hits("slow"):
            self.controlled.hold(self.operation, index)
        return not self._hits("short")

    def read(self, page_hash: str) -> PageRead:
        read = super().read(page_hash)
        if self._hits("corrupt") and read.status == "hit":
            return PageRead("hit", _damaged(read.payload), read.checksum)
        return read

    def write(self, page_hash: str, payload: bytes, page_checksum: bytes) -> None:
        if self._hits("corrupt"):
            payload = _damaged(payload)  # stored with the checksum of the intact bytes
        super().write(page_hash, payload, page_checksum)


class ControlledBackend(StorageBackend):
    """``inner`` with test-injected faults (see the module docstring). The pages are the
    inner backend's; the metrics are this wrapper's own."""

    def __init__(self, inner: StorageBackend, *, name: str = "controlled",
                 hold_timeout_s: float = 30.0) -> None:
        if not isinstance(inner, StorageBackend):
            raise StorageArgumentError("inner", f"must be a StorageBackend, got "
                                                f"{type(inner).__name__}")
        if (not isinstance(hold_timeout_s, int | float) or isinstance(hold_timeout_s, bool)
                or not math.isfinite(hold_timeout_s) or hold_timeout_s <= 0):
            raise StorageArgumentError("hold_timeout_s", f"must be a finite number > 0, got "
                                                         f"{hold_timeout_s!r}")
        super().__init__(name)
        self.inner = inner
        self._hold_timeout_s = float(hold_timeout_s)
        self._faults: dict[Operation, deque[Fault]] = {op: deque() for op in OPERATIONS}
        self._condition = threading.Condition()
        self._held = 0
        self._generation = 0  # bumped by each release; a held page waits for a bump
        self._gate_owner: int | None = None  # the thread whose calls pass; None: open
        self._gate_timeout_s = 30.0
        self._waiting: dict[Operation, int] = {op: 0 for op in OPERATIONS}
        self._passes: dict[Operation, int] = {op: 0 for op in OPERATIONS}
        self._refusing = False

    # -- what the test drives ------------------------------------------------------------

    def inject(self, operation: Operation, *faults: Fault | FaultKind) -> None:
        """Queue ``faults`` (a bare kind means ``Fault(kind)``) for the next ``operation``
        calls, one fault per call, in order."""
        if operation not in OPERATIONS:
            raise StorageArgumentError("operation", f"must be one of {OPERATIONS}, "
                                                    f"got {operation!r}")
        checked = [fault if isinstance(fault, Fault) else Fault(fault) for fault in faults]
        if operation == "exists" and any(fault.kind == "corrupt" for fault in checked):
            raise StorageArgumentError("faults", "'corrupt' does not apply to exists")
        with self._condition:
            self._faults[operation].extend(checked)

    def queued_faults(self, operation: Operation) -> int:
        """Faults still queued for ``operation``."""
        if operation not in OPERATIONS:
            raise StorageArgumentError("operation", f"must be one of {OPERATIONS}, "
                                                    f"got {operation!r}")
        with self._condition:
            return len(self._faults[operation])

    @property
    def held(self) -> int:
        """Pages now waiting in a ``slow`` fault."""
        with self._condition:
            return self._held

    def wait_held(self, count: int = 1, timeout_s: float = 10.0) -> bool:
        """Wait until ``count`` pages are held by ``slow`` faults; False if ``timeout_s``
        (a safety net, not a timing assertion) passed first."""
        with self._condition:
            return self._condition.wait_for(lambda: self._held >= count, timeout=timeout_s)

    def release(self) -> None:
        """Let every page held now go on."""
        with self._condition:
            self._generation += 1
            self._condition.notify_all()

    def hold(self, operation: Operation, index: int) -> None:
        """Hold the calling thread until ``release`` (called by a ``slow`` fault)."""
        with self._condition:
            generation = self._generation
            self._held += 1
            self._condition.notify_all()
            released = self._condition.wait_for(lambda: self._generation != generation,
                                                timeout=self._hold_timeout_s)
            self._held -= 1
        if not released:
            raise StorageError(self.name, operation, f"slow page {index} was not released "
                                                     f"within {self._hold_timeout_s} s")

    # -- the gate --------------------------------------------------------------------------

    def close_gate(self, timeout_s: float = 30.0) -> None:
        """From now on every batch call from another thread than this one waits at the
        gate until ``let_through``; one still waiting after ``timeout_s`` fails."""
        if (not isinstance(timeout_s, int | float) or isinstance(timeout_s, bool)
                or not math.isfinite(timeout_s) or timeout_s <= 0):
            raise StorageArgumentError("timeout_s", f"must be a finite number > 0, got "
                                                    f"{timeout_s!r}")
        with self._condition:
            self._gate_owner = threading.get_ident()
            self._gate_timeout_s = float(timeout_s)

    def open_gate(self) -> None:
        """Let every call through from now on, those waiting too."""
        with self._condition:
            self._gate_owner = None
            self._condition.notify_all()

    def waiting(self, operation: Operation) -> int:
        """Calls of ``operation`` waiting at the gate and not yet let through."""
        with self._condition:
            return self._unserved(operation)

    def _unserved(self, operation: Operation) -> int:
        return self._waiting[operation] - self._passes[operation]

    def wait_at_gate(self, operations: Sequence[Operation], timeout_s: float) -> bool:
        """Wait until a call of one of ``operations`` waits at the gate; False if
        ``timeout_s`` passed first."""
        with self._condition:
            return self._condition.wait_for(
                lambda: any(self._unserved(op) for op in operations), timeout=timeout_s)

    def let_through(self, operation: Operation) -> None:
        """Let one call of ``operation`` waiting at the gate go on."""
        with self._condition:
            if self._unserved(operation) <= 0:
                raise StorageArgumentError("operation", f"no {operation} call waits at "
                                                        "the gate")
            self._passes[operation] += 1
            self._condition.notify_all()

    def refuse(self, refusing: bool) -> None:
        """While ``refusing``, calls waiting at the gate or reaching it fail at once
        with ``StorageError``, before any page (an I/O shutdown joins its threads)."""
        with self._condition:
            self._refusing = refusing
            self._condition.notify_all()

    def _at_gate(self, operation: Operation) -> None:
        """Wait at the gate if it is closed to this thread (see the module docstring)."""
        with self._condition:
            if self._gate_owner is None or self._gate_owner == threading.get_ident():
                return
            self._waiting[operation] += 1
            self._condition.notify_all()
            try:
                passed = self._condition.wait_for(
                    lambda: (self._passes[operation] > 0 or self._refusing
                             or self._gate_owner is None), timeout=self._gate_timeout_s)
                refused = self._refusing and not self._passes[operation]
                if passed and not refused and self._passes[operation]:
                    self._passes[operation] -= 1
            finally:
                self._waiting[operation] -= 1
                self._condition.notify_all()
        if not passed:
            raise StorageError(self.name, operation, f"a gated {operation} call was not let "
                                                     f"through within {self._gate_timeout_s} s")
        if refused:
            raise StorageError(self.name, operation, f"a gated {operation} call was refused "
                                                     "(the I/O is shutting down)")

    # -- the backend ---------------------------------------------------------------------

    def _ops(self, operation: Operation) -> PageOps:
        self._at_gate(operation)  # before the fault is taken: the call's turn decides it
        with self._condition:
            queue = self._faults[operation]
            fault = queue.popleft() if queue else None
        return _FaultyOps(self, operation, fault)

    def has_page(self, page_hash: str) -> bool:
        return self.inner.has_page(page_hash)

    def read_page(self, page_hash: str) -> PageRead:
        return self.inner.read_page(page_hash)

    def write_page(self, page_hash: str, payload: bytes, page_checksum: bytes) -> None:
        self.inner.write_page(page_hash, payload, page_checksum)

    def discard_page(self, page_hash: str) -> None:
        self.inner.discard_page(page_hash)

    def clear(self) -> None:
        self.inner.clear()

    def fetch(self, hashes: Sequence[str], host_pool: HostKVPool,
              host_slots: torch.Tensor) -> Fetched:
        batch = check_batch(hashes, host_pool, host_slots, unique=True)
        try:
            fetched = self._get(batch, self._ops("get"))
        except StorageError as error:
            self._scribble(batch, error.pages_done)
            raise
        except BaseException:
            self._scribble(batch, 0)  # an interrupt says nothing of the pages done
            raise
        self._scribble(batch, fetched.pages_done)
        return fetched

    @staticmethod
    def _scribble(batch: PageBatch, done: int) -> None:
        """NaN into the host slots of the batch's pages from ``done`` on."""
        rest = batch.slots[done * batch.page_size:]
        if rest.numel():
            pool = batch.host_pool
            pool.write(rest, torch.full(pool.value_shape(rest.numel()), math.nan,
                                        dtype=pool.dtype))
