"""Copies between the device and host KV pools, behind one interface the cache codes against.

By contract a copy is in flight from ``submit`` until the cache acknowledges it: its
destination bytes are only guaranteed once ``acknowledge`` has returned its ticket, and its
source slots must stay untouched until then (the cache pins them). Copies of one direction
complete in submission order (FIFO); the two directions are independent.

Three engines share the queue bookkeeping of ``TransferEngine``:

- ``SyncCopyEngine`` copies at submit time (CPU, or a CUDA device synchronously);
- ``CudaCopyEngine`` copies on two dedicated CUDA streams, tracked by events, either
  through Triton gather/scatter kernels that read and write the pinned host pool in place
  (``hiradix.kernels``, issue 33) or, where those are not available, through pinned staging;
- ``ControlledCopyEngine`` copies only when a test says so, reading the source then.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import torch

from hiradix._slots import SlotError, check_int, is_int
from hiradix.device_pool import DeviceKVPool, check_layer
from hiradix.host_pool import HostKVPool, StagedCopy
from hiradix.kernels import Copier, load_copier
from hiradix.pool_pair import check_pool_pair

Direction = Literal["d2h", "h2d"]
DIRECTIONS: tuple[Direction, ...] = ("d2h", "h2d")
EngineKind = Literal["auto", "sync", "cuda", "controlled"]
CopyPath = Literal["auto", "triton", "staging"]


def check_direction(direction: object) -> Direction:
    """Validate a ``direction`` argument."""
    if direction == "d2h":
        return "d2h"
    if direction == "h2d":
        return "h2d"
    raise SlotError("direction", f"must be 'd2h' or 'h2d', got {direction!r}")


@dataclass
class Copy:
    """One submitted copy. The slot tensors (checked, CPU) and every tensor the hardware
    copy uses are held here until the copy is acknowledged or dropped by ``reset``."""

    ticket: int
    direction: Direction
    device_slots: torch.Tensor
    host_slots: torch.Tensor
    completed: bool = False  # Sync and Controlled engines; CUDA asks its events
    staged: StagedCopy | None = None  # CUDA d2h: lands into the host pool at acknowledge
    events: list[torch.cuda.Event] = field(default_factory=list)  # CUDA: d2h 1, h2d per layer
    buffers: tuple[torch.Tensor, ...] = ()  # CUDA: index and staging tensors in use


class TransferEngine(ABC):
    """FIFO-per-direction copy queues between ``device_pool`` and ``host_pool``.

    Tickets increase across both directions and are never reused (not even after
    ``reset``), so a stale ticket cannot alias a new copy.
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool) -> None:
        self.device_pool, self.host_pool = check_pool_pair(device_pool, host_pool)
        self._queues: dict[Direction, deque[Copy]] = {d: deque() for d in DIRECTIONS}
        self._next_ticket = 0

    # -- what an engine supplies ---------------------------------------------------------

    @abstractmethod
    def _start(self, copy: Copy) -> None:
        """Start (or, for the controlled engine, only queue) a checked copy."""

    def _is_complete(self, copy: Copy) -> bool:
        """Whether ``copy``'s bytes have arrived (up to its landing, for CUDA d2h)."""
        return copy.completed

    @abstractmethod
    def _retire(self, copy: Copy) -> None:
        """Finish a finished copy being acknowledged (CUDA: sync, land staged bytes)."""

    @abstractmethod
    def _drain(self) -> None:
        """Before ``reset`` drops the queues: make sure no hardware copy still runs."""

    @abstractmethod
    def wait_layer(self, ticket: int, layer: int) -> None:
        """For an h2d copy: return once a forward pass may read layer ``layer`` of its
        device slots (for CUDA, once the *current stream* is made to wait for it)."""

    def _copy_now(self, copy: Copy) -> None:
        """Move ``copy``'s bytes synchronously, reading the source as it is now."""
        # Checked at submit: not again here (issue 13).
        if copy.direction == "d2h":
            self.host_pool.copy_from_device_unchecked(self.device_pool, copy.device_slots,
                                                      copy.host_slots)
        else:
            self.host_pool.copy_to_device_unchecked(self.device_pool, copy.host_slots,
                                                    copy.device_slots)
        copy.completed = True

    # -- the interface -------------------------------------------------------------------

    def submit(self, direction: Direction, device_slots: torch.Tensor,
               host_slots: torch.Tensor) -> int:
        """Queue a copy of ``len(device_slots)`` slots (d2h: device to host; h2d: host to
        device); return its ticket. The destination may hold no slot twice."""
        checked = check_direction(direction)
        device = self.device_pool.check_slots(device_slots, "device_slots",
                                              unique=checked == "h2d")
        host = self.host_pool.check_slots(host_slots, "host_slots", unique=checked == "d2h")
        if device.numel() != host.numel():
            raise SlotError("host_slots", f"holds {host.numel()} slots but device_slots holds "
                                          f"{device.numel()}")
        return self.submit_unchecked(checked, device.clone(), host.clone())

    def submit_unchecked(self, direction: Direction, device_slots: torch.Tensor,
                         host_slots: torch.Tensor) -> int:
        """``submit`` for a caller whose arguments are valid by construction (the cache:
        slots its allocators handed out, no destination slot twice, CPU int64 tensors of
        equal length): no checks and no defensive copies, so the caller must leave both
        tensors unchanged until the copy is acknowledged. Validated once at the public
        boundary, not on internal calls (issue 13)."""
        copy = Copy(self._next_ticket, direction, device_slots, host_slots)
        self._start(copy)
        self._queues[direction].append(copy)
        self._next_ticket += 1
        return copy.ticket

    def finished(self, direction: Direction) -> int:
        """How many of the oldest unacknowledged copies in ``direction`` are complete: a
        FIFO prefix, so a copy behind an unfinished one is not counted."""
        count = 0
        for copy in self._queues[check_direction(direction)]:
            if not self._is_complete(copy):
                break
            count += 1
        return count

    def acknowledge(self, direction: Direction, count: int) -> list[int]:
        """Pop the ``count`` oldest copies in ``direction``, which must all be finished;
        return their tickets. Their destination bytes are in place on return."""
        checked = check_direction(direction)
        check_int(count, "count", minimum=0)
        done = self.finished(checked)
        if count > done:
            raise SlotError("count", f"{count} exceeds the {done} finished {checked} copies")
        queue = self._queues[checked]
        tickets = []
        for _ in range(count):
            copy = queue[0]
            self._retire(copy)
            queue.popleft()
            tickets.append(copy.ticket)
        return tickets

    def pending(self, direction: Direction) -> int:
        """Copies in ``direction`` submitted and not yet acknowledged."""
        return len(self._queues[check_direction(direction)])

    def reset(self) -> None:
        """Drop every queued copy (after making sure none still runs). Tickets go on
        increasing."""
        self._drain()
        for queue in self._queues.values():
            queue.clear()

    def _pending_h2d(self, ticket: object, layer: object) -> Copy | None:
        """Validate ``wait_layer`` arguments; the pending h2d copy ``ticket``, or None if it
        is no longer pending (acknowledged or reset: nothing to wait for)."""
        if not is_int(ticket):
            raise SlotError("ticket", f"must be an int, got {type(ticket).__name__}")
        check_layer(layer, self.device_pool.layers)
        for copy in self._queues["d2h"]:
            if copy.ticket == ticket:
                raise SlotError("ticket", f"ticket {ticket} is a d2h copy; wait_layer is for "
                                          "h2d copies")
        for copy in self._queues["h2d"]:
            if copy.ticket == ticket:
                return copy
        assert isinstance(ticket, int)
        if not 0 <= ticket < self._next_ticket:
            raise SlotError("ticket", f"ticket {ticket} was never issued")
        return None


class SyncCopyEngine(TransferEngine):
    """Copies at submit time, synchronously (a CUDA device pool works too: the copy is
    ordered on the current stream and the host waits for it where it must). Every
    submitted copy is finished at once; the rest of the contract is unchanged."""

    def _start(self, copy: Copy) -> None:
        self._copy_now(copy)

    def _retire(self, copy: Copy) -> None:
        """Nothing left to do: the bytes moved at submit."""

    def _drain(self) -> None:
        """Nothing runs: every copy was done at submit."""

    def wait_layer(self, ticket: int, layer: int) -> None:
        """Nothing to wait for: the copy was done (on the current stream) at submit."""
        self._pending_h2d(ticket, layer)


class ControlledCopyEngine(TransferEngine):
    """For tests: nothing moves until ``complete``. A copy reads its source slots when it
    is completed, so a source freed or reused while in flight shows up as wrong bytes at
    the destination."""

    def _start(self, copy: Copy) -> None:
        """Only queue it."""

    def _retire(self, copy: Copy) -> None:
        """Nothing left to do: the bytes moved in ``complete``."""

    def _drain(self) -> None:
        """Nothing runs between calls; queued copies are simply forgotten."""

    def queued(self, direction: Direction) -> int:
        """Copies in ``direction`` submitted and not yet completed."""
        queue = self._queues[check_direction(direction)]
        return sum(not copy.completed for copy in queue)

    def complete(self, direction: Direction, count: int = 1) -> None:
        """Perform the ``count`` oldest not-yet-completed copies in ``direction``, reading
        their sources now."""
        checked = check_direction(direction)
        check_int(count, "count", minimum=0)
        waiting = [copy for copy in self._queues[checked] if not copy.completed]
        if count > len(waiting):
            raise SlotError("count", f"{count} exceeds the {len(waiting)} queued {checked} "
                                     "copies")
        for copy in waiting[:count]:
            self._copy_now(copy)

    def wait_layer(self, ticket: int, layer: int) -> None:
        """Fine once the copy is completed; before that the bytes cannot be there, so
        waiting is an error (it would never return)."""
        copy = self._pending_h2d(ticket, layer)
        if copy is not None and not copy.completed:
            raise SlotError("ticket", f"h2d copy {ticket} is not completed; call "
                                      "complete('h2d') first")


def _mark(copy: Copy, stream: torch.cuda.Stream) -> None:
    """Append to ``copy.events`` an event recorded on ``stream`` now: it fires when the
    work enqueued so far there (the copy's last part) is done."""
    event = torch.cuda.Event()
    event.record(stream)
    copy.events.append(event)


class CudaCopyEngine(TransferEngine):
    """Copies on two dedicated CUDA streams, one per direction, so they overlap compute.

    - d2h: the copy stream first waits for the work enqueued so far on the current
      (compute) stream, which produced the KV; then the device gather and the DMA into
      pinned staging run there, followed by an event. At acknowledge the host waits for
      the event and scatters the staged bytes into the host pool.
    - h2d: the copy stream waits for the current stream too (earlier readers of the
      destination slots must be done before they are overwritten); the host bytes are
      staged at submit; then layer by layer a DMA and a device scatter, each layer
      followed by its event, which ``wait_layer`` makes the current stream wait on.

    Copies are ``non_blocking`` only when the host pool is pinned; otherwise they are
    correct but block the host. Every index and staging tensor stays referenced by its
    ``Copy`` until acknowledged.

    With a ``copier`` (``hiradix.kernels.load_copier``: Triton kernels, pinned host pool)
    the same two streams and events carry no staging at all: d2h is one kernel that gathers
    the device rows and writes them into the host pool in place, so acknowledge only waits
    for its event; h2d is one kernel per layer that reads the host rows in place and
    scatters them on the device, each followed by that layer's event. The host bytes of an
    h2d copy are then read when the stream runs, not at submit: the cache protects its
    sources until acknowledgement (INV-TRANSFER-PINNED), so that is the same bytes.
    """

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool, *,
                 copier: Copier | None = None) -> None:
        super().__init__(device_pool, host_pool)
        if device_pool.device.type != "cuda":
            raise SlotError("device_pool", f"must be on a CUDA device, got {device_pool.device}")
        if copier is not None and not host_pool.pinned:
            raise SlotError("copier", "needs a pinned host pool: it reads and writes the host "
                                      "pool in place")
        self._copier = copier
        self.path: Literal["triton", "staging"] = "staging" if copier is None else "triton"
        self._device = device_pool.device
        self._non_blocking = host_pool.pinned
        self._streams: dict[Direction, torch.cuda.Stream] = {
            d: torch.cuda.Stream(device=self._device) for d in DIRECTIONS}

    def _start(self, copy: Copy) -> None:
        stream = self._streams[copy.direction]
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self._device))
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            stream.wait_event(produced)
            if self._copier is not None:
                self._start_in_place(self._copier, copy, stream)
            elif copy.direction == "d2h":
                copy.staged = self.host_pool.begin_from_device(
                    self.device_pool, copy.device_slots, copy.host_slots,
                    non_blocking=self._non_blocking)
                _mark(copy, stream)
            else:
                def layer_done(layer: int) -> None:
                    assert len(copy.events) == layer, "layers are reported in order"
                    _mark(copy, stream)

                copy.buffers = self.host_pool.copy_to_device(
                    self.device_pool, copy.host_slots, copy.device_slots,
                    non_blocking=self._non_blocking, on_layer=layer_done)
        # ``produced`` may go: a stream's wait binds to the event's state when it is issued.

    def _start_in_place(self, copier: Copier, copy: Copy, stream: torch.cuda.Stream) -> None:
        """``_start`` through the copier's kernels, on ``stream`` (the current one here)."""
        prepared = copier.prepare(copy.device_slots, copy.host_slots)
        copy.buffers = (prepared.device_index, prepared.host_index)
        if copy.direction == "d2h":
            copier.d2h(prepared)
            _mark(copy, stream)
            return
        for layer in range(self.device_pool.layers):
            copier.h2d_layer(prepared, layer)
            _mark(copy, stream)  # what wait_layer(ticket, layer) makes the current stream await

    def _is_complete(self, copy: Copy) -> bool:
        return bool(copy.events[-1].query())

    def _retire(self, copy: Copy) -> None:
        copy.events[-1].synchronize()
        if copy.staged is not None:
            self.host_pool.land(copy.staged)

    def _drain(self) -> None:
        for queue in self._queues.values():
            for copy in queue:
                copy.events[-1].synchronize()

    def wait_layer(self, ticket: int, layer: int) -> None:
        """Make the current stream wait for layer ``layer`` of h2d copy ``ticket``; the host
        does not block."""
        copy = self._pending_h2d(ticket, layer)
        if copy is not None:
            torch.cuda.current_stream(self._device).wait_event(copy.events[layer])


def make_engine(kind: EngineKind, device_pool: DeviceKVPool, host_pool: HostKVPool, *,
                copy_path: CopyPath = "auto") -> TransferEngine:
    """An engine over the two pools; ``auto`` is ``cuda`` for a CUDA device pool, else
    ``sync``. ``copy_path`` picks how the ``cuda`` engine moves bytes: ``triton`` (the
    in-place kernels; an error where they cannot run), ``staging``, or ``auto`` (Triton
    where ``hiradix.kernels.load_copier`` gives a copier, else staging). Other engines have
    one path, so they take only ``auto``."""
    if kind not in ("auto", "sync", "cuda", "controlled"):
        raise SlotError("kind", f"must be 'auto', 'sync', 'cuda' or 'controlled', got {kind!r}")
    if copy_path not in ("auto", "triton", "staging"):
        raise SlotError("copy_path", f"must be 'auto', 'triton' or 'staging', got "
                                     f"{copy_path!r}")
    if kind == "auto":
        on_cuda = isinstance(device_pool, DeviceKVPool) and device_pool.device.type == "cuda"
        kind = "cuda" if on_cuda else "sync"
    if kind != "cuda" and copy_path != "auto":
        raise SlotError("copy_path", f"only the cuda engine has copy paths; the {kind} "
                                     f"engine takes 'auto', got {copy_path!r}")
    if kind == "cuda":
        copier = None
        if copy_path != "staging" and isinstance(device_pool, DeviceKVPool) \
                and isinstance(host_pool, HostKVPool):
            loaded = load_copier(device_pool, host_pool)
            if isinstance(loaded, str) and copy_path == "triton":
                raise SlotError("copy_path", f"'triton' cannot run here: {loaded}")
            copier = None if isinstance(loaded, str) else loaded
        return CudaCopyEngine(device_pool, host_pool, copier=copier)
    if kind == "controlled":
        return ControlledCopyEngine(device_pool, host_pool)
    return SyncCopyEngine(device_pool, host_pool)
