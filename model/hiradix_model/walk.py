"""The model's own check: random serving traffic through the model, invariants every step.

``python -m hiradix_model`` (or ``hiradix-model-check``) runs request flows -- match,
lock, load back, evict, allocate, insert, free, unlock -- interleaved with standalone
evictions, backups and copy acknowledgements, over a matrix of configurations, with the
reference choosers resolving every nondeterministic choice. Every step is checked
against every invariant; the run fails on the first violation.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from hiradix_model import choosers, ops
from hiradix_model.config import STRATEGIES, WRITE_POLICIES, Config
from hiradix_model.events import record
from hiradix_model.invariants import INVARIANTS, violations
from hiradix_model.keys import Key
from hiradix_model.state import State, initial


@dataclass
class Tally:
    examples: int = 0
    steps: int = 0
    ops: Counter[str] = field(default_factory=Counter)
    configs: set[tuple[int, str, str]] = field(default_factory=set)


class InvariantViolation(AssertionError):
    pass


class Walk:
    """One random walk over one configuration."""

    def __init__(self, config: Config, rng: random.Random, tally: Tally) -> None:
        # The state keeps its KV event stream (spec/11), so INV-EVENTS-REPLAY is checked.
        self.state = replace(initial(config), events=())
        self.rng = rng
        self.tally = tally
        self.now = 0
        self.history: list[str] = []

    def apply(self, name: str, op: Callable[..., tuple[State, object]], *args: object,
              **kwargs: object) -> object:
        after, observation = op(self.state, *args, **kwargs)
        self.state = record(self.state, after)
        self.tally.ops[name] += 1
        self.tally.steps += 1
        self.history.append(name)
        found = violations(self.state)
        if found:
            raise InvariantViolation(f"after {self.history[-5:]}: {found}")
        return observation

    def tick(self) -> int:
        self.now += self.rng.randint(0, 2)
        return self.now

    def key(self) -> Key:
        length = self.rng.randint(0, 12)
        namespace = self.rng.choice([None, None, "ns"])
        return Key(tuple(self.rng.choice((1, 2, 3)) for _ in range(length)), namespace)

    def request(self) -> None:
        """One request's life in an engine, as SGLang's scheduler drives the cache."""
        key = self.key()
        match = self.apply("match_prefix", ops.match_prefix, key, self.tick())
        assert isinstance(match, ops.MatchResult)
        if match.last_host_page is not None and match.host_hit_tokens:
            quota = self.rng.choice([None, self.state.config.device_slots // 2])
            victims, slots = choosers.choose_load(self.state, match.last_host_page, quota,
                                                  self.rng)
            self.apply("init_load_back", ops.init_load_back, match.last_host_page, quota,
                       device_victims=victims, device_slots=slots)
            match = self.apply("match_prefix", ops.match_prefix, key, self.tick())
            assert isinstance(match, ops.MatchResult)
        locked = match.last_device_page
        self.apply("inc_lock_ref", ops.inc_lock_ref, locked)
        cached = len(match.device_slots)
        need = len(key.tokens) - cached
        ps = self.state.config.page_size
        whole = -(-need // ps) * ps  # the allocator hands out whole pages (R7)
        if whole > len(self.state.device_free):
            shortfall = whole - len(self.state.device_free)
            victims = choosers.choose_evict(self.state, shortfall, self.rng)
            self.apply("evict", ops.evict, shortfall, victims)
        if whole <= len(self.state.device_free):
            new = choosers.free_pages(self.state.device_free, need, self.rng, ps)
            self.apply("alloc", ops.alloc, key, cached, new)
            slots = match.device_slots + new[:need]
            now = self.tick()
            chunked = self.rng.random() < 0.2
            priority = self.rng.randint(0, 2)
            # Now and then the next chunk of a prefill: counted from an earlier length.
            pages = len(key.tokens) // ps
            counted_from = self.rng.randint(0, pages) * ps if self.rng.random() < 0.2 else 0
            backup = choosers.choose_insert_backup(self.state, key, slots, now, self.rng,
                                                   priority=priority, chunked=chunked,
                                                   counted_from=counted_from)
            self.apply("insert", ops.insert, key, slots, now, priority=priority,
                       chunked=chunked, counted_from=counted_from, backup=backup)
            leftover = tuple(s for s in new if s in self.state.held)
            self.apply("free", ops.free, leftover)
        self.apply("dec_lock_ref", ops.dec_lock_ref, locked)

    def background(self) -> None:
        """Something the scheduler does between requests."""
        s, rng = self.state, self.rng
        choice = rng.randrange(6)
        if choice == 0:
            count = rng.randint(0, sum(t.direction == "d2h" for t in s.pending))
            self.apply("writing_check", ops.writing_check, count)
        elif choice == 1:
            count = rng.randint(0, sum(t.direction == "h2d" for t in s.pending))
            self.apply("loading_check", ops.loading_check, count)
        elif choice == 2:
            n = rng.randint(0, 8)
            self.apply("evict", ops.evict, n, choosers.choose_evict(s, n, rng))
        elif choice == 3:
            n = rng.randint(0, 8)
            self.apply("evict_host", ops.evict_host, n, choosers.choose_evict_host(s, n, rng))
        elif choice == 4:
            candidates = sorted((k for k, p in s.pages.items()
                                 if p.device is not None and p.host is None), key=repr)
            if candidates:
                page = rng.choice(candidates)
                self.apply("write_backup", ops.write_backup, page,
                           choosers.choose_write_backup(s, page, rng))
        elif rng.random() < 0.05:
            self.apply("reset", ops.reset)

    def run(self, steps: int) -> None:
        while self.tally.steps < steps:
            if self.rng.random() < 0.6:
                self.request()
            else:
                self.background()


def configs() -> list[Config]:
    matrix = itertools.product((1, 2, 4), WRITE_POLICIES, STRATEGIES)
    return [
        Config(page_size=ps, device_slots=8 * ps, host_slots=12 * ps, write_policy=policy,
               eviction=strategy, load_back_threshold=2 * ps)
        for ps, policy, strategy in matrix
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hiradix-model-check", description=__doc__)
    parser.add_argument("--seconds", type=float, default=20.0, help="time budget")
    parser.add_argument("--steps", type=int, default=200, help="steps per example")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    tally = Tally()
    matrix = configs()
    deadline = time.monotonic() + args.seconds
    rng = random.Random(args.seed)
    while time.monotonic() < deadline:
        config = matrix[tally.examples % len(matrix)]
        seed = rng.randrange(2**32)
        walk = Walk(config, random.Random(seed), Tally())
        try:
            walk.run(args.steps)
        except InvariantViolation as failure:
            print(f"FAILED on {config} with walk seed {seed}:\n{failure}", file=sys.stderr)
            return 1
        tally.examples += 1
        tally.steps += walk.tally.steps
        tally.ops.update(walk.tally.ops)
        tally.configs.add((config.page_size, config.write_policy, config.eviction))
        if sys.stderr.isatty():
            done = min(1.0, 1 - (deadline - time.monotonic()) / args.seconds)
            print(f"\r[{'#' * int(30 * done):<30}] {tally.examples} examples, "
                  f"{tally.steps} steps", end="", file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(f"examples: {tally.examples}  steps: {tally.steps}  "
          f"configurations: {len(tally.configs)} of {len(matrix)}")
    print("operations: " + ", ".join(f"{k}={v}" for k, v in sorted(tally.ops.items())))
    print(f"invariants checked after every step: {len(INVARIANTS)} "
          f"({tally.steps * len(INVARIANTS)} checks, 0 violations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
