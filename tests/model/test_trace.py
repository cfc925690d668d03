"""Traces round-trip, and replay points at the first step that breaks or disagrees."""

from __future__ import annotations

import json
import random

import pytest

from hiradix_model import Config, Key, choosers, initial, ops, trace


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
