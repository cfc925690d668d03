"""The engine adapter protocol (public: ``hiradix.engines``): how the differential suite
drives any engine's cache.

An adapter wraps one engine's prefix cache built for one model ``Config``. It issues the
spec's operations (spec/03) to the engine in the model's vocabulary -- keys, pages, slot
ids -- and reads the engine's state back as the model's abstract ``State`` (spec/06).
The differential suite (``hiradix.conformance.differential``) then runs the model beside
it: it infers the engine's nondeterministic choices (victims, slots) from the states
before and after each call, lets the model validate them, and compares the states.

What an adapter must say about itself:

- ``operations``: the spec operations the engine has. The suite skips a rule whose
  operation is absent (a precondition), it never emulates one.
- ``adopted``: per-page fields whose meaning the spec deliberately changed from this
  engine's (a ``DEV-…`` entry of spec/07 for each). Before every comparison the model
  takes these from the engine, so that later steps are judged on the engine's own
  ranks. Everything else must be equal.
- ``mapped``: the other explicit translations ``observe`` makes, with their DEV ids --
  for example, slot ids shifted past a reserved padding slot, or locks a per-node backup
  holds folded into the one lock per run that the spec counts. Two keys change what the
  suite does: ``evict_for_whole_load`` (a load's eviction is taken as lock anchor, evict,
  unlock, then the load) and ``evict_host_for_whole_node`` (a backup's host eviction is
  taken as an ``evict_host`` step before the insert) -- both DEV-8.
- ``avoid``: known engine bugs, each recorded in spec/07 with a reproducer, that the suite
  steers around (by precondition) so that a campaign goes on to find other divergences.
  The names are the suite's: ``reset_with_copies_in_flight``.
- ``guards``: situations the engine's own server never creates (its scheduler refuses or
  never issues the call), each with where it does so (file:line) and the DEV id of what
  would go wrong. Campaigns respect them by default (server mode), so that every failure
  they report is reachable through the server; ``hiradix check --beyond-server`` drives
  them too, and says so beside any failure. The names are the suite's, as for ``avoid``.
- ``inexpressible``: arguments of the spec's operations that the engine's API has no
  exact counterpart for, each with its DEV id. The suite never generates them (a
  precondition); an adapter never approximates them. The names are the suite's:
  ``counted_from_inside`` (an ``insert`` whose ``counted_from`` lies strictly between 0
  and the key's page-aligned length) and ``insert_cache_slot_after_caller_slot`` (an
  ``insert`` passing one of the cache's own slots after a slot the caller holds, which
  ``hiradix explore`` offers and no scheduler does: DEV-24).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, Protocol

from hiradix_model import Config, Key, State, ops

OPERATIONS = frozenset({
    "match_prefix", "insert", "inc_lock_ref", "dec_lock_ref", "alloc", "free", "evict",
    "evict_host", "write_backup", "writing_check", "load_back", "loading_check", "reset",
})



class EngineAdapter(Protocol):
    """One engine cache under test, spoken to in the model's vocabulary."""

    name: str
    version: str  # the engine package's installed version, as traces record it
    config: Config  # the model configuration this engine instance realises
    operations: frozenset[str]  # a subset of OPERATIONS
    adopted: Mapping[str, str]  # Page field -> why (a spec/07 DEV id); keys in trace.ADOPTABLE
    mapped: Mapping[str, str]  # what observe() translates -> why
    avoid: Mapping[str, str]  # situations the suite steers clear of -> the known bug (DEV id)
    guards: Mapping[str, str]  # situations the engine's server never creates -> where (DEV id)
    inexpressible: Mapping[str, str]  # spec arguments the engine cannot take -> why (DEV id)

    def set_time(self, now: int) -> None:
        """The logical tick the engine's clock reads from now on (spec/04 4.3)."""

    def match_prefix(self, key: Key) -> ops.MatchResult:
        """The engine's match, as device slots and the last device / host page."""

    def inc_lock_ref(self, page: Key | None) -> int:
        """Lock the root path of ``page`` (None: the root); the evictable-size delta."""

    def dec_lock_ref(self, page: Key | None) -> int:
        """Release one lock on the root path of ``page``; the evictable-size delta."""

    def num_free_slots(self) -> int:
        """Free device slots, as an allocation would see them."""

    def alloc(self, num_tokens: int) -> tuple[int, ...] | None:
        """Device slots for a caller (a multiple of the page size), or None."""

    def free(self, slots: Sequence[int]) -> None:
        """Return caller-held device slots (whole pages)."""

    def write_kv(self, slots: Sequence[int], contents: Sequence[Key]) -> None:
        """Store, in each device slot, the test KV bytes of the matching content."""

    def insert(self, key: Key, slots: Sequence[int], *, priority: int, chunked: bool,
               counted_from: int = 0) -> int:
        """Cache ``key`` with its KV in ``slots``; the length of the prefix already cached.
        ``counted_from``: what this request inserted before (spec/03 3.5)."""

    def evict(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens`` device tokens if it can; the tokens evicted."""

    def evict_host(self, num_tokens: int) -> int:
        """Evict host-only tokens; the tokens evicted."""

    def writing_check(self) -> int:
        """Acknowledge finished backups; how many copies (spec runs) were acknowledged."""

    def loading_check(self) -> int:
        """Acknowledge finished loads; how many copies were acknowledged."""

    def init_load_back(self, page: Key | None,
                       quota: int | None) -> tuple[tuple[int, ...], Key | None]:
        """Load the host-only chain ending at ``page``: the device slots of the chain
        now on device, and the deepest page on device afterwards."""

    def reset(self) -> None:
        """Drop everything: the cache and every caller's slots."""

    def observe(self, model: State) -> State:
        """The engine's state as the model's ``State``. ``model`` supplies what an engine
        cannot show (the KV codebook, the clock) and nothing else."""

    def close(self) -> None:
        """Release what the engine holds (threads, process groups)."""


class EngineUnavailable(Exception):
    """The engine cannot be driven here: its package is missing, its version is one no
    adapter knows, or its API is not the one the adapter was written against. A usage
    error -- ``hiradix check`` prints the one-line message and exits 2 -- never a
    conformance failure. The message names the package, the version found or wanted,
    and the command that sets the engine up. ``kind`` says which: ``missing`` (the
    package is not installed), ``version`` (installed, but not a version this adapter
    drives) or ``api`` (the right version, but it does not import or construct as the
    adapter expects: a broken environment)."""

    def __init__(self, message: str, kind: Literal["missing", "version", "api"] = "api") -> None:
        super().__init__(message)
        self.kind = kind


def probe_engine(engine: str, package: str, versions: Sequence[str], what: str, setup: str,
                 load: Callable[[], object]) -> str:
    """The installed version of ``package`` if it is one of ``versions`` and ``load()``
    (importing and preparing what the adapter drives) succeeds; ``EngineUnavailable``
    of the right kind otherwise. ``what`` names what those versions have (in messages),
    ``setup`` the command that sets the engine up."""
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        raise EngineUnavailable(f"{engine}: {package} is not installed here ({setup})",
                                "missing") from None
    if version not in versions:
        raise EngineUnavailable(f"{engine}: needs {package} {' or '.join(versions)} ({what}), "
                                f"found {version} ({setup})", "version")
    try:
        load()
    except (ImportError, AttributeError) as missing:
        raise EngineUnavailable(f"{engine}: {package} {version} does not import as this "
                                f"adapter expects: {missing} ({setup})") from missing
    return version


def unsupported(adapter: EngineAdapter, operation: str) -> NotImplementedError:
    """The error an adapter raises if a rule reaches an operation it lacks."""
    return NotImplementedError(f"{adapter.name} has no {operation} (spec/03)")
