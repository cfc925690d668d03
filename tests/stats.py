"""Counters that the stateful tests fill and conftest prints at the end of a run."""

import copy
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from hiradix_model import Key, MatchResult, choosers, ops

RUNS: Counter[str] = Counter()  # "examples", "steps", and one entry per rule
STORAGE_RUNS: Counter[str] = Counter()  # the same for test_storage_stateful.py
SUMMARY: list[str] = []  # further lines for the end of the run (impl storage machine)


class Stepping:
    """Mixed into a model state machine: ``apply`` an operation to ``self.state`` and
    count it in ``tally``; check that an operation ``rejects`` bad input unchanged; and
    ``serve`` a request the way a scheduler does. The machine provides ``tick(dt)``."""

    state: Any
    tally: Counter[str]

    def tick(self, dt: int) -> int:
        raise NotImplementedError

    def load(self, page: Key, quota: int | None, rng: random.Random) -> None:
        victims, slots = choosers.choose_load(self.state, page, quota, rng)
        loaded, _ = self.apply("init_load_back", ops.init_load_back, page, quota,  # type: ignore[misc]
                               device_victims=victims, device_slots=slots)
        self.tally["loads that copied"] += bool(loaded)

    def serve(self, key: Key, rng: random.Random, ticks: tuple[int, int, int], *,
              priority: int = 0, chunked: bool = False, counted_pages: int = 0) -> MatchResult:
        """Match (loading a host hit back and matching again), lock, evict the
        shortfall, allocate, insert and free the duplicates; ``ticks`` advance the clock
        before the first match, the second and the insert. Returns the match whose last
        device page is now locked: the caller releases or keeps the lock. The insert counts
        from ``counted_pages`` pages on, modulo the key's pages + 1 (spec/03 3.5)."""
        first, again, insert = ticks
        match = self.apply("match_prefix", ops.match_prefix, key, self.tick(first))
        assert isinstance(match, MatchResult)
        if match.host_hit_tokens and match.last_host_page is not None:
            self.load(match.last_host_page, None, rng)
            match = self.apply("match_prefix", ops.match_prefix, key, self.tick(again))
            assert isinstance(match, MatchResult)
        self.apply("inc_lock_ref", ops.inc_lock_ref, match.last_device_page)
        cached = len(match.device_slots)
        need = len(key.tokens) - cached
        ps = self.state.config.page_size
        whole = -(-need // ps) * ps  # an allocator hands out whole pages (spec/03, R7)
        if whole > len(self.state.device_free):
            short = whole - len(self.state.device_free)
            self.apply("evict", ops.evict, short, choosers.choose_evict(self.state, short, rng))
        if whole <= len(self.state.device_free):
            new = choosers.free_pages(self.state.device_free, need, rng, ps)
            self.apply("alloc", ops.alloc, key, cached, new)
            slots = match.device_slots + new[:need]
            now = self.tick(insert)
            aligned = len(key.tokens) // ps * ps
            counted_from = counted_pages % (aligned // ps + 1) * ps
            self.tally["inserts counting from inside the key"] += 0 < counted_from < aligned
            backup = choosers.choose_insert_backup(self.state, key, slots, now, rng,
                                                   priority=priority, chunked=chunked,
                                                   counted_from=counted_from)
            result = self.apply("insert", ops.insert, key, slots, now, priority=priority,
                                chunked=chunked, counted_from=counted_from, backup=backup)
            assert isinstance(result, ops.InsertResult)
            assert result.prefix_tokens == cached
            self.apply("free", ops.free, tuple(s for s in new if s in self.state.held))
        return match

    def apply(self, name: str, op: Callable[..., tuple[object, object]], *args: object,
              **kwargs: object) -> object:
        self.state, observation = op(self.state, *args, **kwargs)
        self.tally["steps"] += 1
        self.tally[name] += 1
        return observation

    def rejects(self, error: type[Exception], op: Callable[..., object], *args: object,
                **kwargs: object) -> None:
        """The op must raise ``error`` and leave its input state exactly as it was."""
        before = copy.deepcopy(self.state)
        with pytest.raises(error):
            op(self.state, *args, **kwargs)
        assert self.state == before
        self.tally["rejected"] += 1
