"""The scope of an exhaustive exploration (spec/14-exploration.md, 14.1).

A scope is a model ``Config`` plus the bounds that make the reachable state space finite:
the keys the callers may use, the arguments offered to each operation, and three state
constraints (copies in flight, caller locks per page, LFU hits). A transition whose
target leaves a constraint is counted as *cut* and not followed; nothing else is pruned.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hiradix_model.config import STRATEGIES, WRITE_POLICIES, Config, Strategy, WritePolicy
from hiradix_model.errors import ModelError
from hiradix_model.keys import Key


class ScopeError(ModelError, ValueError):
    """A scope field is invalid; the message names the field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"scope.{field}: {reason}")
        self.field = field


def _require(condition: bool, field: str, reason: str) -> None:
    if not condition:
        raise ScopeError(field, reason)


@dataclass(frozen=True)
class Scope:
    """What one exploration covers. Capacities are in pages, keys in tokens."""

    page_size: int = 1
    # The defaults finish in seconds on the model and in about a minute on the
    # implementation (spec/14, 14.7); larger scopes grow fast.
    device_pages: int = 2
    host_pages: int = 1
    alphabet: tuple[int, ...] = (1, 2)
    max_key_tokens: int = 1
    namespaces: tuple[str | None, ...] = (None,)
    write_policy: WritePolicy = "write_through"
    eviction: Strategy = "lru"
    max_in_flight: int = 2  # copies in flight, both directions together
    max_locks: int = 1  # caller locks per page (locks copies hold are not counted)
    max_hits: int = 3  # LFU only: hits a page may reach (other strategies saturate exactly)
    max_held_pages: int | None = None  # device pages callers hold uninserted (None: any)
    partial_inserts: bool = True  # offer every counted_from (False: 0 and chunked only)
    priorities: tuple[int, ...] = (0,)
    mem_quotas: tuple[int | None, ...] = (None,)  # load_back's quota argument
    load_back_threshold_pages: int = 1

    def __post_init__(self) -> None:
        for name, low in (("page_size", 1), ("device_pages", 1), ("host_pages", 0),
                          ("max_key_tokens", 1), ("max_in_flight", 0), ("max_locks", 0),
                          ("max_hits", 1), ("load_back_threshold_pages", 0)):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= low,
                     name, f"must be an int >= {low}, got {value!r}")
        _require(self.max_held_pages is None or (
            isinstance(self.max_held_pages, int) and self.max_held_pages >= 0),
            "max_held_pages", f"must be None or an int >= 0, got {self.max_held_pages!r}")
        _require(isinstance(self.partial_inserts, bool), "partial_inserts", "must be a bool")
        _require(isinstance(self.alphabet, tuple) and len(self.alphabet) >= 1
                 and all(isinstance(t, int) for t in self.alphabet)
                 and len(set(self.alphabet)) == len(self.alphabet),
                 "alphabet", f"must be a non-empty tuple of distinct ints, got {self.alphabet!r}")
        _require(isinstance(self.namespaces, tuple) and len(self.namespaces) >= 1
                 and all(n is None or isinstance(n, str) for n in self.namespaces)
                 and len(set(self.namespaces)) == len(self.namespaces),
                 "namespaces", "must be a non-empty tuple of distinct str or None")
        _require(self.write_policy in WRITE_POLICIES, "write_policy",
                 f"must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        _require(self.eviction in STRATEGIES, "eviction",
                 f"must be one of {STRATEGIES}, got {self.eviction!r}")
        _require(isinstance(self.priorities, tuple) and len(self.priorities) >= 1
                 and all(isinstance(p, int) for p in self.priorities), "priorities",
                 "must be a non-empty tuple of ints")
        _require(isinstance(self.mem_quotas, tuple) and len(self.mem_quotas) >= 1
                 and all(q is None or (isinstance(q, int) and q >= 0) for q in self.mem_quotas),
                 "mem_quotas", "must be a non-empty tuple of None or ints >= 0")

    @property
    def config(self) -> Config:
        """The model configuration this scope explores."""
        return Config(page_size=self.page_size, device_slots=self.device_pages * self.page_size,
                      host_slots=self.host_pages * self.page_size,
                      write_policy=self.write_policy, eviction=self.eviction,
                      load_back_threshold=self.load_back_threshold_pages * self.page_size)

    def caller_keys(self) -> tuple[Key, ...]:
        """Every key a caller may use: each namespace, each non-empty token string up to
        ``max_key_tokens`` over the alphabet, shortest first."""
        return tuple(Key(tokens, namespace) for namespace in self.namespaces
                     for length in range(1, self.max_key_tokens + 1)
                     for tokens in itertools.product(self.alphabet, repeat=length))

    def describe(self) -> str:
        """One line naming the scope, as reports print it."""
        return (f"P={self.page_size} device={self.device_pages}p host={self.host_pages}p "
                f"keys<={self.max_key_tokens} over {list(self.alphabet)} "
                f"ns={list(self.namespaces)} {self.write_policy}/{self.eviction} "
                f"in_flight<={self.max_in_flight} locks<={self.max_locks} "
                f"prio={list(self.priorities)}"
                + (f" hits<={self.max_hits}" if self.eviction == "lfu" else "")
                + (f" held<={self.max_held_pages}p" if self.max_held_pages is not None else "")
                + ("" if self.partial_inserts else " counted_from=0|chunked"))
