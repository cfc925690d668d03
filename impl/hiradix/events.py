"""KV events (spec/11): the cache tells an injected sink what became resident where.

A ``HiRadixCache`` given a sink (``HiRadixCache.create(..., events=sink)``, the
constructor's ``events``, or ``cache.events = sink``) calls it with one ``KVEvent`` per
page whose residency changes, synchronously, at the end of the operation that changes it
(spec/11, 11.3, 11.7). Without a sink nothing is built. A KV-aware router turns the stream
into its index of what each engine caches on which medium; ``EventLog`` keeps it in a
list.

``EventChannel`` is how the cache and its storage tier emit: events are buffered while an
operation runs and offered to the sink once the operation's state is whole, so a sink
that raises cannot leave a half-done mutation behind (issue 34, spec/11 11.7).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Concatenate, Literal, ParamSpec, Protocol, TypeVar

from hiradix.errors import ConfigError, EventSinkError

Medium = Literal["device", "host", "storage"]  # SGLang: GPU, CPU_PINNED, DISK/EXTERNAL
EventKind = Literal["stored", "removed", "cleared"]


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One page's residency change on ``medium``, or (``cleared``) the whole medium's.
    A page is named by its namespace and its full token prefix (spec/01, "Pages")."""

    kind: EventKind
    medium: Medium
    namespace: str | None = None
    tokens: tuple[int, ...] = ()  # the page's whole prefix; () for ``cleared``


EventSink = Callable[[KVEvent], None]

Params = ParamSpec("Params")
Result = TypeVar("Result")


def check_sink(sink: object, argument: str = "events") -> EventSink | None:
    """``sink`` if it is None or callable, else ``ConfigError`` naming ``argument``."""
    if sink is not None and not callable(sink):
        raise ConfigError(argument, f"must be None or a callable taking a KVEvent, got "
                                    f"{type(sink).__name__}")
    return sink  # type: ignore[return-value]


class EventChannel:
    """The one path from a cache (and its storage tier) to the sink (spec/11, 11.7).

    ``emit`` buffers; ``run`` runs one operation and, when it is the outermost one (an
    operation may call others: ``writing_check`` runs the tier's, which runs the cache's
    acknowledgement), offers the buffered events to the sink in order once it has
    returned, so the state they describe is whole. A sink raising an ``Exception`` is
    offered the rest all the same, then ``EventSinkError`` carries the operation's result
    with the first exception as ``__cause__``; a ``BaseException`` (``KeyboardInterrupt``)
    propagates at once and the operation's events not yet offered are dropped. Not
    thread-safe: one scheduler thread calls a cache (as the cache itself)."""

    def __init__(self, sink: EventSink | None = None) -> None:
        self._sink = check_sink(sink)
        # Whether events are wanted (a sink is set): emit sites build nothing otherwise.
        # Kept by the sink's setter; an attribute, since every eviction victim reads it
        # (issue 29: a property is a Python call per read).
        self.enabled = self._sink is not None
        self._buffer: deque[KVEvent] = deque()
        self._depth = 0  # operations running (nested ones included)
        self._delivering = False

    @property
    def sink(self) -> EventSink | None:
        """The sink, or None: nothing is emitted nor built for events."""
        return self._sink

    @sink.setter
    def sink(self, sink: EventSink | None) -> None:
        self._sink = check_sink(sink)
        self.enabled = self._sink is not None

    def emit(self, event: KVEvent) -> None:
        """Queue ``event`` for the end of the running operation (or offer it now, when
        no operation runs: a caller outside ``run`` has nothing half-done)."""
        if self._sink is None:
            return
        self._buffer.append(event)
        if self._depth == 0 and not self._delivering:
            self._deliver(None, None)

    def emit_pages(self, kind: EventKind, medium: Medium, namespace: str | None,
                   prefix: tuple[int, ...], tokens: int, page_size: int) -> None:
        """``emit`` one event per page of the last ``tokens`` tokens of ``prefix`` (a
        node's pages), root-most first (spec/11, 11.1)."""
        for end in range(len(prefix) - tokens + page_size, len(prefix) + 1, page_size):
            self.emit(KVEvent(kind, medium, namespace, prefix[:end]))

    def run(self, operation: Callable[Params, Result], *args: Params.args,
            **kwargs: Params.kwargs) -> Result:
        """``operation(*args, **kwargs)``, its events offered when it has returned (or
        raised: the events of changes it made before raising are still true)."""
        self._depth += 1
        try:
            result = operation(*args, **kwargs)
        except BaseException as error:
            self._end(None, error)
            raise
        self._end(result, None)
        return result

    def _end(self, result: object, failed: BaseException | None) -> None:
        """An operation has returned ``result`` or raised ``failed``: the outermost one
        offers the buffer."""
        self._depth -= 1
        if self._depth == 0 and self._buffer and not self._delivering:
            self._deliver(result, failed)

    def _deliver(self, result: object, failed: BaseException | None) -> None:
        """Offer the buffer in order. An operation the sink itself runs meanwhile queues
        its events behind these (``_delivering``), so the stream keeps its order."""
        self._delivering = True
        first: Exception | None = None
        count = offered = 0
        try:
            while self._buffer and self._sink is not None:
                event = self._buffer.popleft()
                offered += 1
                try:
                    self._sink(event)
                except Exception as error:  # contained: typed below, after every event
                    count += 1
                    if first is None:
                        first = error
        finally:  # a BaseException drops the rest (spec/11, 11.7); so does an unset sink
            self._buffer.clear()
            self._delivering = False
        if first is None:
            return
        if failed is not None:  # the operation's own error is the caller's to see
            failed.add_note(f"the KV event sink also raised {count} time(s): {first!r}")
            return
        raise EventSinkError(result, count, offered) from first


class EventLog:
    """A sink that keeps the events in order; ``take`` hands over those not yet taken."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def __call__(self, event: KVEvent) -> None:
        self.events.append(event)

    def take(self) -> list[KVEvent]:
        taken, self.events = self.events, []
        return taken


class ChannelOwner(Protocol):
    """What ``delivering`` decorates the methods of: an object with an event channel."""

    event_channel: EventChannel


Owner = TypeVar("Owner", bound=ChannelOwner)


def delivering(method: Callable[Concatenate[Owner, Params], Result]
               ) -> Callable[Concatenate[Owner, Params], Result]:
    """``method`` as one operation of its object's ``event_channel``: its KV events reach
    the sink after it has returned, its state whole (spec/11, 11.7). ``run`` written out
    around the method, with the usual return inline: every cache operation passes here
    (issue 29: a call and an argument repacking less per operation)."""
    @functools.wraps(method)
    def operation(self: Owner, /, *args: Params.args, **kwargs: Params.kwargs) -> Result:
        channel = self.event_channel
        channel._depth += 1
        try:
            result = method(self, *args, **kwargs)
        except BaseException as error:
            channel._end(None, error)
            raise
        channel._depth -= 1
        if channel._depth == 0 and channel._buffer and not channel._delivering:
            channel._deliver(result, None)
        return result
    return operation
