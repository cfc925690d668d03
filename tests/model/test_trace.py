"""Traces round-trip, and replay points at the first step that breaks or disagrees."""

from __future__ import annotations

import io
import json
import os
import random
from pathlib import Path

import pytest

from hiradix_model import Config, Key, StorageSettings, choosers, initial, ops, trace


def recorded(seed: int = 0) -> list[str]:
    """A legal run of requests and evictions, recorded as trace lines."""
    config = Config(page_size=2, device_slots=8, host_slots=8, load_back_threshold=0)
    rng, state, steps = random.Random(seed), initial(config), []

    def apply(op, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal state
        arguments = trace.encode_call(op, *args, **kwargs)
        state, observation = op(state, *args, **kwargs)
        steps.append(trace.Step(op.__name__, arguments, trace.encode_observation(observation)))
        return observation

    for now in range(1, 30):
        key = Key(tuple(rng.choice((1, 2)) for _ in range(rng.randint(0, 8))),
                  rng.choice((None, "ns")))
        match = apply(ops.match_prefix, key, now)
        need = len(key.tokens) - len(match.device_slots)
        whole = -(-need // config.page_size) * config.page_size  # whole pages (R7)
        if whole > len(state.device_free):
            short = whole - len(state.device_free)
            apply(ops.evict, short, choosers.choose_evict(state, short, rng))
            match = apply(ops.match_prefix, key, now)  # the eviction may have taken some
            need = len(key.tokens) - len(match.device_slots)
            whole = -(-need // config.page_size) * config.page_size
        if whole > len(state.device_free):
            continue
        new = choosers.free_pages(state.device_free, need, rng, config.page_size)
        apply(ops.alloc, key, len(match.device_slots), new)
        slots = match.device_slots + new[:need]
        backup = choosers.choose_insert_backup(state, key, slots, now, rng)
        apply(ops.insert, key, slots, now, backup=backup)
        apply(ops.free, tuple(s for s in new if s in state.held))
        pending = sum(t.direction == "d2h" for t in state.pending)
        apply(ops.writing_check, rng.randint(0, pending))
    return [trace.header(config, "test")] + [s.to_json() for s in steps]


def test_a_legal_trace_replays_clean() -> None:
    lines = recorded()
    applied, finding = trace.replay(lines)
    assert finding is None and applied == len(lines) - 1


def test_a_wrong_observation_is_found_at_its_line() -> None:
    lines = recorded()
    number = next(i for i, line in enumerate(lines) if '"op": "insert"' in line and i > 3)
    record = json.loads(lines[number])
    record["observed"] = {"prefix_tokens": 999}
    lines[number] = json.dumps(record)
    _, finding = trace.replay(lines)
    assert finding is not None and finding.line == number + 1 and "999" in finding.problem


def test_an_illegal_choice_is_rejected_at_its_line() -> None:
    lines = recorded()
    records = [json.loads(line) for line in lines]
    number = next(i for i, r in enumerate(records) if r.get("op") == "evict"
                  and r["args"]["victims"]  # dropping the last one stops short (R1)
                  and 2 * (len(r["args"]["victims"]) - 1) < r["args"]["num_tokens"])
    record = records[number]
    record["args"]["victims"] = record["args"]["victims"][:-1]  # stop short
    lines[number] = json.dumps(record)
    _, finding = trace.replay(lines)
    assert finding is not None and finding.line == number + 1
    assert finding.problem.startswith("rejected")


def test_not_a_trace() -> None:
    with pytest.raises(ValueError, match="header"):
        trace.replay(['{"format": "something else"}'])


def storage_run() -> list[str]:
    """A run with a storage tier, as the storage machine records it: attached first."""
    config = Config(page_size=2, device_slots=8, host_slots=8, load_back_threshold=0)
    state, steps = initial(config), []

    def apply(op, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal state
        arguments = trace.encode_call(op, *args, **kwargs)
        state, observation = op(state, *args, **kwargs)
        steps.append(trace.Step(op.__name__, arguments, trace.encode_observation(observation)))

    apply(ops.attach_storage, "memory", identity=("m", "float16", "mha"),
          settings=StorageSettings(prefetch_threshold=0, timeout_max=3000))
    apply(ops.query_storage_hit_length, Key((1, 2, 3, 4), None), None, 0)
    apply(ops.drain_storage_queues)
    apply(ops.clear_storage)
    apply(ops.detach_storage)
    return [trace.header(config, "test")] + [s.to_json() for s in steps]


def test_storage_steps_replay_and_are_needed() -> None:
    lines = storage_run()
    assert trace.replay(lines) == (len(lines) - 1, None)
    assert json.loads(lines[1])["args"]["settings"]["timeout_max"] == 3000
    # Without its attachment (as --record wrote storage runs) the clear finds no tier
    # to clear: the engine's True disagrees with the model.
    _, finding = trace.replay([lines[0], *lines[3:]])
    assert finding is not None and (finding.line, finding.op) == (3, "clear_storage"), finding


def test_storage_settings_the_model_does_not_take_are_a_broken_file() -> None:
    lines = storage_run()
    record = json.loads(lines[1])
    record["args"]["settings"]["timeout_max"] = -1
    with pytest.raises(trace.TraceFormatError, match="timeout_max") as broken:
        trace.replay([lines[0], json.dumps(record)])
    assert broken.value.line == 2


def test_lines_are_read_no_further_than_their_bound() -> None:
    lines = trace.bounded_lines(io.StringIO("short\n" + "x" * 11 + "\nnever read\n"), 10)
    assert next(lines) == "short\n"
    with pytest.raises(trace.TraceFormatError, match="longer than 10") as broken:
        next(lines)
    assert broken.value.line == 2


def test_only_a_regular_file_is_opened(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opened without blocking: no writer needed for the refusal
    for path, kind in ((fifo, "a FIFO"), (tmp_path, "a directory")):
        with pytest.raises(trace.TraceFormatError, match=f"not a regular file \\({kind}\\)"):
            trace.open_trace(str(path))
    plain = tmp_path / "t.jsonl"
    plain.write_text("x\n")
    with trace.open_trace(str(plain)) as handle:
        assert handle.read() == "x\n"
