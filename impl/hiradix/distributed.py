"""Agreement across tensor- and pipeline-parallel ranks (spec/12-ranks.md).

Each rank runs its own cache over its own shard of the KV. Every decision a rank could
take differently from another (an allocation's success, how many copies finished, how
far a prefetch got, how many pages storage holds) is settled by a collective: every rank
proposes its value and every rank proceeds with the minimum (12.3). Every rank must
issue the same collectives in the same order, whatever its local queues hold, or the
ranks wait on each other for ever (INV-RANKS-COLLECTIVES).

- ``RankSync``: what the cache calls, ``min`` of one int or ``min_all`` of a tuple; the
  ``what`` argument names the decision (it appears in the ledger and in timeouts).
- ``LocalSync``: one rank, nothing to agree with.
- ``Ledger``: wraps any sync and records every collective (the count, the order, the
  values; the conformance layer hands them to the model as ``Collective``s) for
  INV-RANKS-COLLECTIVES and INV-RANKS-CONSENSUS.
- ``LocalRanks``: several ranks of one process (threads in lockstep), for fast tests.
- ``TorchDistributedSync``: all_reduce(MIN) over a tensor-parallel group (gloo on CPU
  tensors), then the pipeline relay (12.4) across the stages.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from hiradix._slots import is_int
from hiradix.errors import ConfigError, RankSyncError


@runtime_checkable
class RankSync(Protocol):
    def min(self, value: int, what: str = "") -> int:
        """The minimum of ``value`` over all ranks (every rank must call it)."""
        ...

    def min_all(self, values: Sequence[int], what: str = "") -> tuple[int, ...]:
        """The element-wise minimum over all ranks (equal lengths on every rank)."""
        ...


def check_sync(sync: object) -> None:
    """None or a ``RankSync`` (callable ``min`` and ``min_all``), else ``ConfigError``
    naming ``sync``: checked where the cache is built, so that a bad one fails there and
    not at its first collective, after a side effect (spec/12, 12.6)."""
    if sync is not None and not (isinstance(sync, RankSync) and callable(sync.min)
                                 and callable(sync.min_all)):
        raise ConfigError("sync", f"must be None or a RankSync (min and min_all methods), "
                                  f"got {type(sync).__name__}")


class LocalSync:
    """A single rank: nothing to agree with."""

    def min(self, value: int, what: str = "") -> int:
        return value

    def min_all(self, values: Sequence[int], what: str = "") -> tuple[int, ...]:
        return tuple(values)


@dataclass(frozen=True)
class Collective:
    """One collective as this rank issued it: the decision, its proposal, the result."""

    name: str
    proposed: int
    result: int


class Ledger:
    """``inner`` with every collective recorded, in order (spec/12, 12.5). A vector
    collective is one entry per element, named ``what[i]``, so the ledger compares
    element by element."""

    def __init__(self, inner: RankSync) -> None:
        self.inner = inner
        self.log: list[Collective] = []
        self.calls = 0  # collectives issued (a vector one counts once)

    def min(self, value: int, what: str = "") -> int:
        result = self.inner.min(value, what)
        self.calls += 1
        self.log.append(Collective(what, value, result))
        return result

    def min_all(self, values: Sequence[int], what: str = "") -> tuple[int, ...]:
        results = self.inner.min_all(values, what)
        self.calls += 1
        self.log.extend(Collective(f"{what}[{i}]", v, r)
                        for i, (v, r) in enumerate(zip(values, results, strict=True)))
        return results


class CollectiveMismatch(RankSyncError, RuntimeError):
    """Ranks of one ``LocalRanks`` group reached different collectives (the deadlock a
    real group would hang in), or one of them waited past the timeout."""


class LocalRanks:
    """``world`` ranks in one process, one thread each, meeting at every collective.

    ``sync(rank)`` is rank ``rank``'s ``RankSync``; ``gather`` hands every rank every
    rank's object (a checker's exchange, a meeting like the others). A meeting waits for
    every rank; ranks that reach meetings of different names, or a rank that never comes
    within ``timeout_s``, raise ``CollectiveMismatch`` naming the meeting, in every
    rank."""

    def __init__(self, world: int, timeout_s: float = 10.0) -> None:
        if not is_int(world) or world < 1:
            raise ConfigError("world", f"must be an int >= 1, got {world!r}")
        self.world = world
        self.timeout_s = timeout_s
        self._barrier = threading.Barrier(world)
        self._slots: list[tuple[str, object] | None] = [None] * world

    def sync(self, rank: int) -> _RankOf:
        return _RankOf(self, rank)

    def abort(self) -> None:
        """Release every rank waiting at a collective (a rank has failed)."""
        self._barrier.abort()

    def gather(self, rank: int, item: object, what: str = "gather") -> list[object]:
        """Every rank's ``item``, in rank order."""
        return self._meet(rank, what, item)

    def _meet(self, rank: int, what: str, item: object) -> list[object]:
        self._slots[rank] = (what, item)
        self._wait(what)
        arrived = list(self._slots)
        self._wait(what)  # every rank has read the slots before any overwrites its own
        names = [entry[0] if entry is not None else None for entry in arrived]
        if len(set(names)) != 1:
            raise CollectiveMismatch(what, f"rank {rank} issued it; the ranks issued "
                                           f"{names}")
        return [entry[1] for entry in arrived if entry is not None]

    def _min_all(self, rank: int, what: str, values: tuple[int, ...]) -> tuple[int, ...]:
        proposals = [p for p in self._meet(rank, what, values) if isinstance(p, tuple)]
        if len({len(p) for p in proposals}) != 1:
            raise CollectiveMismatch(what, "ranks proposed different numbers of values")
        return tuple(min(column) for column in zip(*proposals, strict=True))

    def _wait(self, what: str) -> None:
        try:
            self._barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            raise CollectiveMismatch(what, f"not every rank arrived within "
                                           f"{self.timeout_s} s (a rank skipped it)") from None


class _RankOf:
    def __init__(self, group: LocalRanks, rank: int) -> None:
        self.group = group
        self.rank = rank

    def min(self, value: int, what: str = "") -> int:
        return self.group._min_all(self.rank, what, (value,))[0]

    def min_all(self, values: Sequence[int], what: str = "") -> tuple[int, ...]:
        return self.group._min_all(self.rank, what, tuple(values))


class TorchDistributedSync:
    """all_reduce(MIN) over ``group`` (gloo on CPU tensors, as SGLang's TP group), then,
    with ``pp_size`` > 1, the pipeline relay of spec/12 12.4 over ``pp_group``.

    The relay is a chain, as SGLang's ``_pp_sync``: no global synchronisation point. It
    runs twice: down the stages each stage folds its own value into what it received
    (so a later stage's fuller pool counts), and back up the last stage's result is
    relayed unchanged. SGLang relays stage 0's value alone, which suits acknowledgement
    counts (a later stage blocks on its own copies) but not an allocation a later stage
    cannot make (12.4)."""

    def __init__(self, group: dist.ProcessGroup | None = None, *,
                 pp_group: dist.ProcessGroup | None = None, pp_rank: int = 0,
                 pp_size: int = 1, checked: bool = True) -> None:
        for name, value in (("group", group), ("pp_group", pp_group)):
            if value is not None and not isinstance(value, dist.ProcessGroup):
                raise ConfigError(name, f"must be None or a torch.distributed.ProcessGroup, "
                                        f"got {type(value).__name__}")
        if not is_int(pp_size) or pp_size < 1:
            raise ConfigError("pp_size", f"must be an int >= 1, got {pp_size!r}")
        if not is_int(pp_rank) or not 0 <= pp_rank < pp_size:
            raise ConfigError("pp_rank", f"must be a stage in [0, {pp_size}), got {pp_rank!r}")
        if pp_size > 1 and pp_group is None:
            raise ConfigError("pp_group", "pp_size > 1 needs a pp_group")
        if not isinstance(checked, bool):
            raise ConfigError("checked", f"must be a bool, got {checked!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("group", "torch.distributed is not initialised: there is no "
                                       "process group to agree over")
        for name, value in (("group", group), ("pp_group", pp_group)):
            # A group this process is not a member of answers every collective with an
            # error: refused here, not at the first collective after a side effect.
            if value is not None and dist.get_rank(value) < 0:
                raise ConfigError(name, "this process is not a member of the group")
        self.group = group
        self.pp_group = pp_group
        self.pp_rank = pp_rank
        self.pp_size = pp_size
        self.checked = checked

    def min(self, value: int, what: str = "") -> int:
        return self.min_all((value,), what)[0]

    def min_all(self, values: Sequence[int], what: str = "") -> tuple[int, ...]:
        """``checked``: a fixed-size header goes first (see ``check``), so ranks that
        reach different collectives at the same point (one skipped one) all raise
        ``CollectiveMismatch`` naming theirs, where unchecked they would pair the wrong
        values silently, or hang on payloads of different sizes."""
        if not values:
            return ()
        if not all(is_int(v) for v in values):
            raise ConfigError("values", f"must be ints, got {list(values)!r}")
        if self.checked:
            self.check(what, len(values))
        tensor = torch.tensor(list(values), dtype=torch.int64)
        self._collective(tensor, what)
        return tuple(int(v) for v in tensor.tolist())

    def _collective(self, tensor: torch.Tensor, what: str) -> None:
        """all_reduce(MIN) then the relay; a failing one (a peer gone, a broken group:
        torch raises RuntimeError, its DistBackendError, or ValueError) as
        ``RankSyncError`` with the cause chained (spec/12, 12.6)."""
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
            self._relay(tensor)
        except (RuntimeError, ValueError) as error:
            raise RankSyncError(what, f"the collective failed: {error}") from error

    def check(self, what: str, size: int = 0) -> None:
        """Every rank is at a collective named ``what`` of ``size`` values, or every
        rank raises ``CollectiveMismatch``: the MIN of (size, -size, CRC, -CRC) shows
        the smallest and largest of each over the ranks. A caller's own exchange (an
        ``all_gather_object``) calls it first, so it cannot pair with a collective."""
        stamp = zlib.crc32(what.encode())
        header = torch.tensor([size, -size, stamp, -stamp], dtype=torch.int64)
        self._collective(header, what)
        low_size, high_size, low_stamp, high_stamp = (int(v) for v in header.tolist())
        if low_size != -high_size or low_stamp != -high_stamp:
            raise CollectiveMismatch(what, "the ranks issued different collectives here "
                                           "(one skipped or added one)")

    def _relay(self, tensor: torch.Tensor) -> None:
        if self.pp_size <= 1:
            return
        group, stage, last = self.pp_group, self.pp_rank, self.pp_size - 1
        received = torch.empty_like(tensor)
        if stage > 0:  # down: fold this stage's value into the running minimum
            dist.recv(received, group=group, group_src=stage - 1)
            torch.minimum(tensor, received, out=tensor)
        if stage < last:
            dist.send(tensor, group=group, group_dst=stage + 1)
            dist.recv(tensor, group=group, group_src=stage + 1)  # up: the last stage's
        if stage > 0:
            dist.send(tensor, group=group, group_dst=stage - 1)
