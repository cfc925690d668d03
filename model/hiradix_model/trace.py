"""Traces: one engine run as JSON Lines, and their replay against the model (spec/08).

Line 1 is the configuration; every further line is one operation with its arguments,
the choices the engine made, and what the engine observed. ``replay`` applies each line
to the model, which rejects an illegal choice, and compares the model's observation with
the engine's. The first step that breaks an invariant, is rejected, or disagrees is the
finding.
"""

from __future__ import annotations

import inspect
import json
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any, TextIO, cast

from hiradix_model import ops
from hiradix_model.config import Config
from hiradix_model.errors import ConfigError, ModelError
from hiradix_model.invariants import violations
from hiradix_model.keys import Key
from hiradix_model.ops import storage as storage_ops
from hiradix_model.state import State, initial
from hiradix_model.storage import StorageSettings

FORMAT = "hiradix-trace/1"
# The longest line a reader takes (spec/08 8.1), in characters: a step of a 32 k-token
# key with its slots is under 1 MiB; the bound keeps a file without newlines (or a
# device such as /dev/zero) from being read into memory whole.
MAX_LINE_CHARS = 1 << 24
Json = Any


def encode_key(key: Key | None) -> Json:
    return None if key is None else {"tokens": list(key.tokens), "namespace": key.namespace}


def decode_key(value: Json) -> Key | None:
    return None if value is None else Key(tuple(value["tokens"]), value["namespace"])


def _key(value: Json) -> Key:
    key = decode_key(value)
    if key is None:
        raise ValueError("a page key may not be null here")
    return key


def _slots(value: Json) -> tuple[int, ...] | None:
    return None if value is None else tuple(value)


def _settings(value: Json) -> StorageSettings:
    """The storage constants of an ``attach_storage`` line (spec/08: its fields by name);
    a ValueError, not a model finding, for fields the model does not take."""
    if not isinstance(value, dict):
        raise ValueError(f"settings must be an object, got {value!r}")
    try:
        return StorageSettings(**value)
    except (TypeError, ConfigError) as bad:
        raise ValueError(f"settings: {bad}") from None


def encode_victim(victim: ops.Victim) -> Json:
    return {"page": encode_key(victim.page), "host_victims": [encode_key(k) for k in
                                                               victim.host_victims],
            "host_slots": None if victim.host_slots is None else list(victim.host_slots)}


def decode_victim(value: Json) -> ops.Victim:
    return ops.Victim(_key(value["page"]), tuple(_key(k) for k in value["host_victims"]),
                      _slots(value["host_slots"]))


def encode_backup(backup: ops.Backup | None) -> Json:
    if backup is None:
        return None
    return {"host_victims": [encode_key(k) for k in backup.host_victims],
            "host_slots": None if backup.host_slots is None else list(backup.host_slots)}


def decode_backup(value: Json) -> ops.Backup | None:
    if value is None:
        return None
    return ops.Backup(tuple(_key(k) for k in value["host_victims"]), _slots(value["host_slots"]))


def encode_observation(observation: object) -> Json:
    """The JSON form of an operation's observation (what both sides compare)."""
    if isinstance(observation, ops.MatchResult):
        return {"device_slots": list(observation.device_slots),
                "last_device_page": encode_key(observation.last_device_page),
                "last_host_page": encode_key(observation.last_host_page),
                "host_hit_tokens": observation.host_hit_tokens}
    if isinstance(observation, ops.InsertResult):
        return {"prefix_tokens": observation.prefix_tokens}
    if isinstance(observation, tuple) and len(observation) == 2 and isinstance(
            observation[0], tuple):  # init_load_back: (slots, page)
        return {"slots": list(observation[0]), "page": encode_key(observation[1])}
    if isinstance(observation, tuple):  # load_back: slots
        return list(observation)
    return observation


@dataclass(frozen=True)
class Step:
    """One trace line: ``op`` applied with ``args``; ``observed`` is the engine's result."""

    op: str
    args: dict[str, Json]
    observed: Json = None

    def to_json(self) -> str:
        return json.dumps({"op": self.op, "args": self.args, "observed": self.observed})


# Per-page fields whose meaning the spec chose differently from an engine's (spec/07):
# a differential run lets the model take the engine's values, and says so in the trace.
ADOPTABLE = ("last_tick", "insert_tick", "hits", "host_protect")


def adopt(state: State, changes: dict[Key, dict[str, int]]) -> State:
    """``state`` with the engine's values of adoptable fields on existing pages (spec/08,
    the ``adopt`` directive). Raises ValueError for an unknown page, field or value."""
    pages = dict(state.pages)
    for page, fields in changes.items():
        if page not in pages:
            raise ValueError(f"adopt: {page} is not cached")
        bad = set(fields) - set(ADOPTABLE)
        if bad:
            raise ValueError(f"adopt: {sorted(bad)} are not adoptable fields {ADOPTABLE}")
        if any(not isinstance(v, int) or v < 0 for v in fields.values()):
            raise ValueError(f"adopt: values must be ints >= 0, got {fields}")
        pages[page] = replace(pages[page], **cast(dict[str, Any], fields))  # ints, checked
    return replace(state, pages=pages)


def adopt_step(changes: dict[Key, dict[str, int]], why: str) -> Step:
    return Step("adopt", {"pages": [{"page": encode_key(k), **v} for k, v in changes.items()],
                          "why": why})


def _adopt(state: State, args: dict[str, Json]) -> tuple[State, object]:
    changes = {_key(entry["page"]): {f: entry[f] for f in entry if f != "page"}
               for entry in args["pages"]}
    return adopt(state, changes), None


# How each operation's JSON arguments become the model call. One entry per operation.
CALLS: dict[str, Callable[[State, dict[str, Json]], tuple[State, object]]] = {
    "match_prefix": lambda s, a: ops.match_prefix(s, _key(a["key"]), a["now"]),
    "alloc": lambda s, a: ops.alloc(s, _key(a["key"]), a["start"], tuple(a["slots"])),
    "free": lambda s, a: ops.free(s, tuple(a["slots"])),
    "insert": lambda s, a: ops.insert(
        s, _key(a["key"]), tuple(a["slots"]), a["now"], priority=a.get("priority", 0),
        chunked=a.get("chunked", False), counted_from=a.get("counted_from", 0),
        backup=decode_backup(a.get("backup"))),
    "inc_lock_ref": lambda s, a: ops.inc_lock_ref(s, decode_key(a["page"])),
    "dec_lock_ref": lambda s, a: ops.dec_lock_ref(s, decode_key(a["page"])),
    "evict": lambda s, a: ops.evict(s, a["num_tokens"],
                                    tuple(decode_victim(v) for v in a["victims"])),
    "evict_host": lambda s, a: ops.evict_host(s, a["num_tokens"],
                                              tuple(_key(k) for k in a["victims"])),
    "write_backup": lambda s, a: ops.write_backup(s, _key(a["page"]),
                                                  decode_backup(a["report"])),  # type: ignore[arg-type]
    "writing_check": lambda s, a: ops.writing_check(s, a["count"]),
    "loading_check": lambda s, a: ops.loading_check(s, a["count"]),
    "load_back": lambda s, a: ops.load_back(
        s, _key(a["page"]), a["mem_quota"],
        device_victims=tuple(decode_victim(v) for v in a.get("device_victims", [])),
        device_slots=_slots(a.get("device_slots"))),
    "init_load_back": lambda s, a: ops.init_load_back(
        s, decode_key(a["page"]), a["mem_quota"],
        device_victims=tuple(decode_victim(v) for v in a.get("device_victims", [])),
        device_slots=_slots(a.get("device_slots"))),
    "reset": lambda s, a: ops.reset(s),
    "adopt": _adopt,
    # The storage tier (spec/09): a run with storage records these too, so that its
    # trace replays from the empty state (the tier is attached by the first of them).
    "attach_storage": lambda s, a: ops.attach_storage(
        s, a["backend"], identity=tuple(a.get("identity", ())),
        settings=_settings(a["settings"]), retained=a.get("retained", True)),
    "detach_storage": lambda s, a: ops.detach_storage(s),
    "clear_storage": lambda s, a: ops.clear_storage(s),
    "query_storage_hit_length": lambda s, a: ops.query_storage_hit_length(
        s, _key(a["key"]), decode_key(a["anchor"]), a["hit_pages"]),
    "prefetch_from_storage": lambda s, a: ops.prefetch_from_storage(
        s, a["request"], _key(a["key"]), decode_key(a["anchor"]), a["now"],
        host_victims=tuple(_key(k) for k in a.get("host_victims", [])),
        host_slots=_slots(a.get("host_slots"))),
    "io_prefetch_query": lambda s, a: ops.io_prefetch_query(s, a["request"], a["hit_pages"]),
    "io_prefetch_fetch": lambda s, a: ops.io_prefetch_fetch(s, a["request"], a["landed"],
                                                            fault=a.get("fault")),
    "io_storage_write": lambda s, a: ops.io_storage_write(s, a["pages"], fault=a.get("fault")),
    "check_prefetch_progress": lambda s, a: ops.check_prefetch_progress(s, a["request"],
                                                                        a["now"]),
    "terminate_prefetch": lambda s, a: ops.terminate_prefetch(s, a["request"]),
    "release_aborted_request": lambda s, a: ops.release_aborted_request(s, a["request"]),
    "pop_prefetch_loaded_tokens": lambda s, a: ops.pop_prefetch_loaded_tokens(s, a["request"]),
    "backup_pages": lambda s, a: storage_ops.backup_pages(s, _key(a["key"]), a["start"],
                                                          a["end"]),
    "drain_storage_queues": lambda s, a: ops.drain_storage_queues(
        s, revokes=a.get("revokes"), acks=a.get("acks"), releases=a.get("releases")),
}


def header(config: Config, engine: str) -> str:
    """The first line of a trace."""
    return json.dumps({"format": FORMAT, "engine": engine, "config": asdict(config)})


def write(path: str, config: Config, engine: str, steps: Iterable[Step]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(header(config, engine) + "\n")
        for step in steps:
            handle.write(step.to_json() + "\n")


@dataclass(frozen=True)
class Finding:
    line: int  # 1-based line of the trace
    op: str
    problem: str


class TraceFormatError(ValueError):
    """The trace file itself is broken (spec/08): not JSON Lines of this format, or a
    step the model cannot even read. ``line`` is 1-based; 0 for the file as a whole."""

    def __init__(self, line: int, reason: str) -> None:
        super().__init__(reason)
        self.line = line
        self.reason = reason


def _record(number: int, line: str) -> dict[str, Json]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as broken:
        raise TraceFormatError(number, f"not JSON ({broken.msg}, column {broken.colno})") \
            from None
    if not isinstance(record, dict):
        raise TraceFormatError(number, f"a line must be a JSON object, got "
                                       f"{type(record).__name__}")
    return record


def open_trace(path: str) -> TextIO:
    """``path`` opened for reading as a trace: a regular file only (spec/08 8.2). A FIFO
    would block the reader until a writer came, a device (/dev/zero) never ends: both
    are a ``TraceFormatError`` at line 0. Opened without blocking, then checked on the
    descriptor, so that nothing swapped in between a check and the open is read."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                    else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                    else "a socket" if stat.S_ISSOCK(mode) else "not a plain file")
            raise TraceFormatError(0, f"not a regular file ({kind})")
        os.set_blocking(descriptor, True)
        return open(descriptor, encoding="utf-8", closefd=True)
    except BaseException:
        os.close(descriptor)
        raise


def bounded_lines(handle: TextIO, limit: int = MAX_LINE_CHARS) -> Iterator[str]:
    """The lines of ``handle``, each at most ``limit`` characters (spec/08 8.1); a
    ``TraceFormatError`` at the first longer one, read no further than the bound."""
    number = 0
    while True:
        line = handle.readline(limit + 1)
        if not line:
            return
        number += 1
        if len(line.rstrip("\n")) > limit:
            raise TraceFormatError(number, f"line longer than {limit} characters")
        yield line


def read(lines: Iterable[str]) -> tuple[Config, str, Iterator[tuple[int, Step]]]:
    """The configuration, the engine name, and the steps (with their line numbers).
    ``TraceFormatError`` for a broken header at once, for a broken step when reached."""
    numbered = ((n, line) for n, line in enumerate(lines, 1) if line.strip())
    first = next(numbered, None)
    if first is None:
        raise TraceFormatError(0, "empty trace: no header line")
    head = _record(first[0], first[1])
    if head.get("format") != FORMAT:
        raise TraceFormatError(first[0], f"not a {FORMAT} trace header")
    fields = head.get("config")
    if not isinstance(fields, dict):
        raise TraceFormatError(first[0], "the header has no config object")
    try:
        config = Config(**fields)
    except (TypeError, ValueError) as bad:
        raise TraceFormatError(first[0], f"invalid config: {bad}") from None
    engine = head.get("engine", "unknown")

    def steps() -> Iterator[tuple[int, Step]]:
        for number, line in numbered:
            record = _record(number, line)
            op, args = record.get("op"), record.get("args", {})
            if not isinstance(op, str):
                raise TraceFormatError(number, "a step needs an \"op\" string")
            if not isinstance(args, dict):
                raise TraceFormatError(number, f"{op}: \"args\" must be an object")
            yield number, Step(op, args, record.get("observed"))

    return config, str(engine), steps()


def replay(lines: Iterable[str]) -> tuple[int, Finding | None]:
    """Apply a trace to the model; return the steps applied and the first finding (a
    step the model rejects, or that breaks an invariant, or whose observation differs).
    A step the model cannot read is a ``TraceFormatError``, not a finding."""
    config, _, steps = read(lines)
    state = initial(config)
    applied = 0
    for number, step in steps:
        call = CALLS.get(step.op)
        if call is None:
            raise TraceFormatError(number, f"unknown operation {step.op!r}")
        try:
            state, observation = call(state, step.args)
        except ModelError as rejected:
            return applied, Finding(number, step.op, f"rejected: {rejected}")
        except (KeyError, TypeError, ValueError) as malformed:
            raise TraceFormatError(number, f"{step.op}: malformed arguments: "
                                           f"{malformed!r}") from None
        applied += 1
        broken = violations(state)
        if broken:
            return applied, Finding(number, step.op, f"breaks {sorted(broken)}: {broken}")
        expected = encode_observation(observation)
        if step.observed is not None and step.observed != expected:
            return applied, Finding(number, step.op, f"engine observed {step.observed!r}, "
                                                     f"the model {expected!r}")
    return applied, None


def encode_value(value: object) -> Json:
    """Arguments as JSON: keys, victims, backups and storage settings as objects, tuples
    as lists."""
    if isinstance(value, StorageSettings):
        return asdict(value)
    if isinstance(value, Key):
        return encode_key(value)
    if isinstance(value, ops.Victim):
        return encode_victim(value)
    if isinstance(value, ops.Backup):
        return encode_backup(value)
    if isinstance(value, tuple | list):
        return [encode_value(v) for v in value]
    return value


def encode_call(op: Callable[..., object], *args: object, **kwargs: object) -> dict[str, Json]:
    """The named JSON arguments of ``op(state, *args, **kwargs)`` (state excluded)."""
    bound = inspect.signature(op).bind(None, *args, **kwargs)
    bound.arguments.pop("state")
    return {name: encode_value(value) for name, value in bound.arguments.items()}
