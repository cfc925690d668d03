"""The hybrid machine: a (FULL, SWA) cache beside the model of spec/13, checked after
every engine call.

Requests run as a scheduler runs them (13.4): match and lock the cached prefix, allocate
pairs for the rest (evicting full and SWA KV when the pools are short), write the KV,
drop the SWA halves of the tokens the request has decoded past (``swa_evicted``),
insert, free what the insert did not take, release the match lock, and -- for a request
that goes on decoding -- match and lock the inserted key again. Running requests later
release their SWA lock early or finish. Standalone evictions of either pool interleave.

After every call the engine's view is abstracted (``abstraction``) and compared with the
model's state; every model invariant, the engine's mapping and the engine's own check
are checked there too, and every match against INV-SWA-MATCH-LIVE. Victims of an
eviction are inferred from the pages that went (deleted or tombstoned), deepest first.

An engine that also takes requests the way its server's scheduler hands them over
(``ScheduledSwaEngine``: SGLang's ``checkpoint`` per prefill chunk, ``evict_sliding_windows``
per decode step, ``release_kv_cache`` with or without a last checkpoint) gets a second set
of rules beside those (``Scheduled``): requests admitted, prefilled chunk by chunk,
decoded, finished, aborted or retracted, interleaved with each other and with the
evictions. Each call is replayed on the model as the spec operations it stands for
(spec/13 13.4), read off what the call did: the SWA halves it freed (``free_swa``), its
insert (``insert`` with the ``swa_evicted`` the engine passed), the duplicates the engine
freed itself (``free``, DEV-24) and the lock it moved (``dec_lock_ref`` /
``inc_lock_ref``); the request's row past the insert must then be the tree's path to its
new lock.

An engine with a host tier that acts on host hits (``HostLoadingSwaEngine``) also gets
load backs: a key through a host-only page is matched and loaded back as its server's
scheduler does, and the engine's two-tier state after it is compared with 13.8a's
``load_back`` (``load_back.py``); the machine's device model then takes the loaded pages.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Iterator, Sequence
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from hiradix.conformance.host_judge import assert_host_match, load_starts
from hiradix.conformance.hybrid.abstraction import (
    Codes,
    abstract,
    host_problems,
    mapping_problems,
    with_host,
)
from hiradix.conformance.hybrid.engine import (
    AllocEvictingSwaEngine,
    HostLoadingSwaEngine,
    HostMatchingSwaEngine,
    SwaEngine,
)
from hiradix.conformance.hybrid.load_back import (
    HOST_TIER,
    LoadPlan,
    called_off,
    dev_h12_pages,
    evicted_for_load,
    expected_load,
    plan_for_key,
    window_held_past_match,
)
from hiradix.conformance.victims import (
    MAX_INTERLEAVINGS,
    NoOrder,
    accepted_order,
    diff,
    guided_orders,
    interleaved_orders,
    interleavings,
    victim_chains,
    victim_orders,
)
from hiradix_model import Key
from hiradix_model import hybrid as model
from hiradix_model.errors import IllegalChoice, PreconditionError
from hiradix_model.hybrid import SwaConfig, SwaState
from hiradix_model.keys import content_at, parent_page

Build = Callable[[SwaConfig], SwaEngine]
tokens = st.lists(st.integers(1, 3), min_size=1, max_size=16).map(tuple)


@dataclass(frozen=True)
class Running:
    """A request that holds a lock on its inserted key while it decodes."""

    page: Key | None
    receipt: object
    swa_released: bool = False


class RequestRows(Protocol):
    """What an engine taking requests as its scheduler hands them over offers for any
    components: requests bound to rows of slots, and where their locks are. Requests are
    the engine's own handles; slots are numbered as the engine's protocol numbers them."""

    def new_request(self, tokens: Sequence[int], prompt_len: int) -> Any:
        """A request with prompt ``tokens[:prompt_len]`` that will compute ``tokens``."""

    def write_row(self, req: Any, start: int, full_slots: Sequence[int]) -> None:
        """Put freshly allocated full slots into the request's row from ``start`` on."""

    def advance(self, req: Any, end: int) -> None:
        """The forward pass computed the request up to ``end``."""

    def row(self, req: Any, end: int) -> tuple[int, ...]:
        """The request's row up to ``end``."""

    def protected_len(self, req: Any) -> int:
        """The row prefix the tree owns (what the request's lock protects)."""

    def locked_page(self, req: Any) -> Key | None:
        """The page the request's lock is on (None: the root)."""

    def locked_path(self, req: Any) -> tuple[int, ...]:
        """The tree's full slots from the root to the request's lock."""

    def release(self, req: Any, owned: int, checkpoint: bool) -> Sequence[object]:
        """Finish (``checkpoint``: a last publish) or drop (abort, retraction) a request:
        its row past the protected prefix freed, its lock released; the inserts made."""


@runtime_checkable
class ScheduledSwaEngine(RequestRows, Protocol):
    """What an ``SwaEngine`` whose server publishes requests itself also takes."""

    def admit(self, req: Any, prompt: Key) -> tuple[int, ...]:
        """Match the prompt, lock where the match ended, bind a row; the matched full
        slots."""

    def checkpoint(self, req: Any, up_to: int) -> list[tuple[int, int]]:
        """Publish ``[protected, up_to)`` of an unfinished request; each insert made, as
        (key length, swa_evicted)."""

    def slide_window(self, req: Any, pre_len: int) -> None:
        """A decode step's free of the SWA halves that left the request's window."""

    def release(self, req: Any, owned: int, checkpoint: bool) -> list[tuple[int, int]]:
        """Finish (``checkpoint``: a last publish) or drop (abort, retraction) a request:
        its row past the protected prefix freed, its lock released; the inserts made."""


def lock_moved_problems(engine: RequestRows, req: Any, page: Key | None,
                        length: int) -> list[str]:
    """After an unfinished request's checkpoint inserted ``length`` tokens: its lock is
    on ``page``, its protected prefix is ``length`` and its row that far is the tree's
    path to the lock (``checkpoint_into_tree`` rewrites the row and moves the lock)."""
    problems = []
    if engine.locked_page(req) != page:
        problems.append(f"the engine's lock is on {engine.locked_page(req)}")
    if engine.protected_len(req) != length:
        problems.append(f"protected {engine.protected_len(req)}")
    if engine.row(req, length) != engine.locked_path(req):
        problems.append(f"row {engine.row(req, length)} is not the tree's path "
                        f"{engine.locked_path(req)}")
    return problems


def release_unpublished(engine: RequestRows, req: Any, allocated: int, end: int,
                        held: Container[int]) -> tuple[int, tuple[int, ...]]:
    """Release a request computed to ``end`` (its row holding ``allocated`` slots)
    without a checkpoint; its protected prefix and the row slots past it, which must all
    be the caller's (in ``held``, the model's): the tree owns none of them."""
    protected = engine.protected_len(req)
    mine = engine.row(req, allocated)[protected:]
    stray = [f for f in mine if f not in held]
    assert not stray, (f"row past protected {protected} holds {stray}, which the model has "
                       "the tree own")
    inserts = engine.release(req, end, False)
    assert not inserts, f"a release without checkpoint inserted {inserts}"
    return protected, mine


def pick(data: st.DataObject, requests: Sequence[Any], ready: Callable[[Any], bool]) -> int:
    """The index of one of ``requests`` that is ``ready``, drawn."""
    return data.draw(st.sampled_from([i for i, s in enumerate(requests) if ready(s)]))


@dataclass
class Scheduled:
    """A request the machine drives through a ``ScheduledSwaEngine``: ``end`` tokens
    computed, ``allocated`` row positions with pairs, its lock on ``page`` (the model's)."""

    req: Any
    tokens: tuple[int, ...]
    prompt_len: int
    page: Key | None
    allocated: int
    end: int


MAX_SCHEDULED = 4  # requests live at once (an engine's request rows bound it)
MAX_REQUEST = 18  # tokens a request computes at most (an engine's rows hold this many)
decode_tail = st.lists(st.integers(1, 3), max_size=MAX_REQUEST).map(tuple)


def state_problems(engine_state: SwaState, expected: SwaState, node_locks: bool) -> list[str]:
    """Where the abstracted engine state differs from the model's. ``node_locks``: the
    engine's SWA locks may cover more pages than the model's (DEV-H1), never fewer."""
    problems = []
    for name in ("full_free", "swa_free", "held", "full_kv", "swa_kv"):
        mine, theirs = getattr(expected, name), getattr(engine_state, name)
        if mine != theirs:
            problems.append(f"{name}: model {diff(mine, theirs)}")
    for key in sorted(set(expected.pages) | set(engine_state.pages), key=lambda k: k.tokens):
        want, got = expected.pages.get(key), engine_state.pages.get(key)
        if want is None or got is None:
            problems.append(f"page {key.tokens}: model {want}, engine {got}")
            continue
        if node_locks and got.swa_lock >= want.swa_lock:
            got = replace(got, swa_lock=want.swa_lock)
        if want != got:
            problems.append(f"page {key.tokens}: model {want}, engine {got}")
    return problems


def describe_pages(state: SwaState) -> str:
    """Each cached page: its tokens, live or a tombstone (+/-), its locks."""
    return " ".join(f"{k.tokens}{'+' if p.live else '-'}{p.lock}/{p.swa_lock}"
                    for k, p in sorted(state.pages.items(), key=lambda i: i[0].tokens))


def describe_host(state: SwaState | None) -> str:
    """Each page with a host copy: its tokens, with a full and an SWA host copy or not
    (F/f, S/s); empty without a host tier."""
    if state is None:
        return ""
    return "; host: " + " ".join(
        f"{k.tokens}{'F' if p.full else 'f'}{'S' if p.swa else 's'}"
        for k, p in sorted(state.host.items(), key=lambda i: i[0].tokens))


def taken_pages(before: SwaState, after: SwaState) -> list[set[Key]]:
    """The pages an eviction tombstoned, and those it deleted."""
    return [{k for k, p in before.pages.items()
             if p.live and k in after.pages and not after.pages[k].live},
            {k for k in before.pages if k not in after.pages}]


def same_pages(state: SwaState, other: SwaState) -> bool:
    """The same cached pages, each live or not alike."""
    return ({k: p.live for k, p in state.pages.items()}
            == {k: p.live for k, p in other.pages.items()})


def joint_orders(chains: list[list[Key]], before: SwaState, after: SwaState, full_need: int,
                 node_locks: bool) -> Iterator[list[Key]]:
    """Orders in which an allocation's eviction (13.3 ``evict_for_alloc``) from ``before``
    may have taken ``chains`` to leave ``after``: every interleaving where they are few
    (``interleaved_orders``), else those the walks' rules admit page by page: the full
    walk deletes a full leaf while it is short of ``full_need`` (or the rest of the node
    it last took: the parent page of its previous victim), the SWA walk takes a live page
    the way the engine did (tombstoned or deleted)."""
    yield from interleaved_orders(chains)
    if interleavings(chains) <= MAX_INTERLEAVINGS:
        return
    ps = before.config.page_size

    def step(at: tuple[SwaState, bool, Key | None], page: Key, *_: object,
             ) -> Iterator[tuple[SwaState, bool, Key | None]]:
        state, full_walk, previous = at
        short = len(state.full_free) - len(before.full_free) < full_need
        rest = previous is not None and parent_page(previous, ps) == page
        if full_walk and page not in after.pages and (short or rest):
            with suppress(IllegalChoice):
                yield model.evict_full(state, ps, [page])[0], True, page
        with suppress(IllegalChoice):
            took, _ = model.evict_swa(state, ps, [page], enough=not node_locks)
            if (page in took.pages) == (page in after.pages):
                yield took, False, page

    yield from guided_orders(chains, (before, True, None), step)


def judged_eviction(before: SwaState, after: SwaState, pool: str, num_tokens: int,
                    node_locks: bool) -> tuple[SwaState, int, list[Key]]:
    """A standalone eviction of ``num_tokens`` from ``pool`` (13.3 ``evict_full`` or
    ``evict_swa``) that took ``before`` to ``after``: the model's state, what it freed, the
    victims in an order it accepts; ``NoOrder`` where none is. An SWA walk goes node by
    node in recency order, so its victims may interleave: it tombstones an inner page,
    deletes the leaf below it, then reaches the inner page's parent (a chain of
    tombstones with a deletion inside it, met by a write-through campaign)."""
    chains = victim_chains(taken_pages(before, after), before.config.page_size)

    def model_evict(victims: list[Key]) -> tuple[SwaState, int]:
        if pool == "full":
            return model.evict_full(before, num_tokens, victims)
        return model.evict_swa(before, num_tokens, victims, enough=not node_locks)

    return accepted_order(chains, model_evict, lambda state: same_pages(state, after),
                          victim_orders if pool == "full" else interleaved_orders)


def evicting_load(device: SwaState, plan: LoadPlan, after: SwaState, made: bool,
                  node_locks: bool) -> tuple[SwaState, LoadPlan, list[Key]]:
    """The device tier a load back short of slots loaded into, what it loaded, and the
    victims: ``device`` after the evictions it made first (``load_back.evicted_for_load``),
    the victims read off the engine's state ``after`` the load (the pages it tombstoned or
    deleted, the loaded ones aside), split between its full and its SWA walk, with as
    many DEV-H12 pages as it loaded (any number where it ``made`` no load); the plan
    called off where the evictions freed too little. ``AssertionError`` where no order
    and split of the victims is one the model accepts, or where the model's evictions
    disagree with the engine on whether the load was made."""
    loads = {*plan.full, *plan.swa, *plan.beyond}
    extras = ([len(dev_h12_pages(device, plan, after))] if made
              else list(range(len(plan.beyond) + 1)))

    def same_but_the_load(outcome: tuple[SwaState, bool]) -> bool:
        state, goes_on = outcome
        return goes_on == made and (
            {k: p.live for k, p in state.pages.items() if k not in loads}
            == {k: p.live for k, p in after.pages.items() if k not in loads})

    def evicted(victims: list[Key]) -> tuple[tuple[SwaState, bool], int]:
        objections: list[str] = []
        outcome: tuple[SwaState, bool] | None = None
        for split in range(len(victims) + 1):
            for extra in extras:
                try:
                    outcome = evicted_for_load(device, plan, victims, split, extra,
                                               enough=not node_locks)
                except IllegalChoice as illegal:
                    objections.append(f"split {split}: {illegal}")
                    continue
                if same_but_the_load(outcome):
                    return outcome, 0
        if outcome is None:
            raise IllegalChoice("; ".join(objections))
        return outcome, 0

    chains = victim_chains(taken_pages(device, after), device.config.page_size)
    try:
        (state, goes_on), _, victims = accepted_order(chains, evicted, same_but_the_load,
                                                      interleaved_orders)
    except NoOrder as refused:
        raise AssertionError(
            f"load back to {plan.anchor}, short of {plan.full_short(device)} full slots "
            f"({len(device.swa_free)} SWA slots free for {len(plan.swa)} pages and up to "
            f"{len(plan.beyond)} more), the engine {'made' if made else 'called off'} "
            f"the load: its eviction {refused}; before it: "
            f"{describe_pages(device)}") from None
    return state, (plan if goes_on else called_off(plan)), victims


def make_swa_machine(build: Build, config: SwaConfig,
                     reached: Counter[str] | None = None) -> type[RuleBasedStateMachine]:
    """A machine class driving a fresh ``build(config)`` per example; ``reached`` counts
    what the examples exercised (healing, tombstones, SWA evictions, ...)."""
    seen = reached if reached is not None else Counter()
    # A scheduled request fits in half the full pool, so that two run side by side and
    # most run to their end (a pool of ten pages or fewer tokens in these campaigns).
    longest = min(MAX_REQUEST, config.full_slots // 2)

    class SwaMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.engine = build(config)
            self.model = model.initial(config)
            self.codes = Codes()
            self.running: list[Running] = []
            self.node_locks = self.engine.lock_granularity == "node"
            self.scheduler = (self.engine if isinstance(self.engine, ScheduledSwaEngine)
                              else None)
            self.scheduled: list[Scheduled] = []
            self.alloc_evicting = (self.engine if isinstance(self.engine, AllocEvictingSwaEngine)
                                   else None)
            # An engine that loads host hits back, where it has a host tier.
            self.loader = (self.engine if isinstance(self.engine, HostLoadingSwaEngine)
                           and self.engine.observe().host is not None else None)
            seen["examples"] += 1
            seen["scheduled_examples"] += self.scheduler is not None
            seen["alloc_evicting_examples"] += self.alloc_evicting is not None
            self.check("the initial state")

        def teardown(self) -> None:
            self.engine.close()

        # -- checking -------------------------------------------------------------------
        def check(self, step: str) -> None:
            seen["checks"] += 1
            view = self.engine.observe()
            problems = [f"engine's own check: {view.own_check}"] if view.own_check else []
            problems += mapping_problems(view)
            problems += model.violations(self.model)
            engine_state = abstract(view, config, self.codes)
            problems += state_problems(engine_state, self.model, self.node_locks)
            if view.host is not None:  # the host tier, to 13.8a's invariants
                seen["host_checks"] += 1
                seen["host_pages_seen"] += len(view.host.pages)
                seen["host_deviation_checks"] += bool(view.host.exempt)
                seen["host_deviations_met"] += sum(map(len, view.host.exempt.values()))
                problems += host_problems(with_host(engine_state, view.host, self.codes),
                                          view.host.exempt)
            assert not problems, f"after {step}:\n  " + "\n  ".join(problems)

        def match(self, key: Key) -> model.SwaMatch:
            before = self.host_state()
            slots, page = self.engine.match_prefix(key)
            if before is not None:
                self.judge_host_match(before, key)
            return self.judge_match(key, slots, page)

        def host_state(self) -> SwaState | None:
            """The engine's state on both tiers now, where it has a host tier and reports
            its host match; else None."""
            if not isinstance(self.engine, HostMatchingSwaEngine):
                return None
            view = self.engine.observe()
            if view.host is None:
                return None
            return with_host(abstract(view, config, self.codes), view.host, self.codes)

        def judge_host_match(self, before: SwaState, key: Key) -> None:
            """The engine's match with host hits (13.8a ``match_prefix_host``) from
            ``before``, the state it matched in: where it ends (INV-SWA-HOST-MATCH-LIVE).
            Its host-hit count is not compared: SGLang's counts the full tokens with a
            host copy behind the device match, resident ones included (DEV-H13)."""
            assert isinstance(self.engine, HostMatchingSwaEngine)
            page, _ = self.engine.last_host_match()
            assert_host_match(key, page, model.match_prefix_host(before, key).last_page,
                              model.match_prefix(before, key).last_page,
                              model.host_match_problems(before, key, page), seen)

        def judge_match(self, key: Key, slots: tuple[int, ...],
                        page: Key | None) -> model.SwaMatch:
            """The model's match of ``key``, asserted equal to the engine's."""
            want = model.match_prefix(self.model, key)
            problems = list(model.match_problems(self.model, key, page))
            if (tuple(slots), page) != (want.full_slots, want.last_page):
                problems.append(f"engine {page} {tuple(slots)}, model {want.last_page} "
                                f"{want.full_slots}")
            assert not problems, f"match_prefix({key.tokens}):\n  " + "\n  ".join(problems)
            return want

        # -- evictions ------------------------------------------------------------------
        def evict(self, pool: str, num_tokens: int) -> None:
            before, tiers = self.model, self.host_state()
            freed = (self.engine.evict_full if pool == "full" else self.engine.evict_swa)(
                num_tokens)
            after = abstract(self.engine.observe(), config, self.codes)
            try:
                state, want, victims = judged_eviction(before, after, pool, num_tokens,
                                                       self.node_locks)
            except NoOrder as refused:
                raise AssertionError(f"evict_{pool}({num_tokens}) = {freed} {refused}; "
                                     f"before it: {describe_pages(before)}"
                                     f"{describe_host(tiers)}") from None
            self.model = state
            seen[f"evict_{pool}"] += 1
            seen["victims"] += len(victims)
            if pool == "swa":
                seen["tombstoned"] += sum(k in after.pages for k in victims)
            self.check(f"evict_{pool}({num_tokens}) = {freed}, "
                       f"victims {[v.tokens for v in victims]}")
            assert freed == want, f"evict_{pool}({num_tokens}) reported {freed}, freed {want}"

        def evict_joint(self, full_need: int, swa_need: int) -> None:
            """The engine's own eviction for an allocation short of ``full_need`` full and
            ``swa_need`` SWA tokens (13.3 ``evict_for_alloc``): some order of what it took,
            and some split of it into the full phase and the SWA phase, must be legal."""
            assert self.alloc_evicting is not None
            before = self.model
            freed = self.alloc_evicting.evict_for_alloc(full_need, swa_need)
            after = abstract(self.engine.observe(), config, self.codes)
            chains = victim_chains(taken_pages(before, after), config.page_size)

            def same(state: SwaState) -> bool:
                return same_pages(state, after)

            def model_evict(victims: list[Key]) -> tuple[SwaState, int]:
                objections: list[str] = []
                accepted: tuple[SwaState, int] | None = None
                for split in range(len(victims) + 1):
                    try:
                        accepted = model.evict_for_alloc(before, full_need, swa_need, victims,
                                                         split, enough=not self.node_locks)
                    except IllegalChoice as illegal:
                        objections.append(f"split {split}: {illegal}")
                        continue
                    if same(accepted[0]):
                        return accepted
                if accepted is None:
                    raise IllegalChoice("; ".join(objections))
                return accepted

            def orders(chains: list[list[Key]]) -> Iterator[list[Key]]:
                yield from joint_orders(chains, before, after, full_need, self.node_locks)

            try:
                state, want, victims = accepted_order(chains, model_evict, same, orders)
            except NoOrder as refused:
                raise AssertionError(f"evict_for_alloc({full_need}, {swa_need}) = {freed} "
                                     f"{refused}; before it: {describe_pages(before)}, "
                                     f"{len(before.full_free)} full and "
                                     f"{len(before.swa_free)} SWA slots free") from None
            self.model = state
            seen["evict_for_alloc"] += 1
            seen["victims"] += len(victims)
            self.check(f"evict_for_alloc({full_need}, {swa_need}) = {freed}, "
                       f"victims {[v.tokens for v in victims]}")
            assert freed == want, (f"evict_for_alloc({full_need}, {swa_need}) reported "
                                   f"{freed} full tokens, freed {want}")

        @precondition(lambda self: self.alloc_evicting is not None)
        @rule(full_pages=st.integers(0, 3), swa_pages=st.integers(0, 3), now=st.integers(0, 2))
        def evict_for_alloc(self, full_pages: int, swa_pages: int, now: int) -> None:
            """An allocation's eviction outside any request of the machine's (the requests'
            own allocations make it too). One draw in three: the rules it would crowd out
            are rarer."""
            if not now:
                self.evict_joint(full_pages * config.page_size, swa_pages * config.page_size)

        @rule(pages=st.integers(1, 4))
        def evict_full(self, pages: int) -> None:
            self.evict("full", pages * config.page_size)

        @rule(pages=st.integers(1, 4))
        def evict_swa(self, pages: int) -> None:
            self.evict("swa", pages * config.page_size)

        # -- a request --------------------------------------------------------------------
        def allocate(self, num_tokens: int) -> tuple[int, ...] | None:
            full = self.engine.alloc(num_tokens)
            if full is None:
                seen["alloc_short"] += 1
                if self.alloc_evicting is not None:  # as the server's allocator does
                    self.evict_joint(max(0, num_tokens - len(self.model.full_free)),
                                     max(0, num_tokens - len(self.model.swa_free)))
                else:
                    self.evict("full", num_tokens)
                    self.evict("swa", num_tokens)
                full = self.engine.alloc(num_tokens)
            return full

        @precondition(lambda self: self.loader is not None)
        @rule(data=st.data(), tail=st.lists(st.integers(1, 3), max_size=3).map(tuple))
        def load_back(self, data: st.DataObject, tail: tuple[int, ...]) -> None:
            """A request whose prefix reaches KV on the host only (a host-only page's or an
            SWA host copy's tokens and ``tail``): matched, then loaded back as its server
            does; the engine's state
            after it must be 13.8a's ``load_back`` of what the match reached, into the
            device slots the engine chose. A load short of free slots in either pool
            evicts first, as the server's does (``evicting_load``), judged where the
            engine evicts as its allocator does; not made where the anchor's window
            holds live device pages the device match's does not
            (``window_held_past_match``), nor where a device page has no host copy
            (write-back backs victims up as it evicts them)."""
            assert self.loader is not None
            engine_before = self.host_state()
            assert engine_before is not None
            # Host-only pages (a full load), and device tombstones with an SWA host copy
            # (an SWA-only load, healing them: the host hits DEV-H13 counts).
            hosted = load_starts(engine_before, lambda k: engine_before.host[k].swa is not None
                                 and not engine_before.pages[k].live)
            if not hosted:
                seen["load_back_nothing_hosted"] += 1
                return
            self.load_back_of(Key(data.draw(st.sampled_from(hosted)).tokens + tail))

        def load_back_of(self, key: Key) -> None:
            """The ``load_back`` rule's request for ``key``: matched, loaded back, judged."""
            assert self.loader is not None
            self.match(key)  # judged on both tiers as any match
            engine_before = self.host_state()
            assert engine_before is not None
            before = HOST_TIER.two_tier(self.model, engine_before)
            plan = plan_for_key(before, key)
            evicting = not plan.fits(before)
            if evicting and self.alloc_evicting is None:
                seen["load_back_pools_short"] += 1
                return
            if evicting and window_held_past_match(before, plan):
                seen["load_back_short_window_held_past_match"] += 1
                return
            if evicting and not before.pages.keys() <= before.host.keys():
                # Write-back backs victims up as it evicts them, which 13.3's device-tier
                # eviction does not express.
                seen["load_back_short_unbacked"] += 1
                return
            loaded, page = self.loader.load_back()
            engine_after = self.host_state()
            assert engine_after is not None
            if evicting:
                device, plan = self.evicted_for_load(plan, engine_after,
                                                     page != plan.device_end)
                before = HOST_TIER.two_tier(device, engine_before)
            expected, problems = expected_load(before, plan, loaded, page, engine_after)
            problems += state_problems(engine_after, expected, self.node_locks)
            problems += HOST_TIER.problems(engine_after, expected)
            assert not problems, (f"load_back({key.tokens}) from "
                                  f"{describe_pages(before)}:\n  " + "\n  ".join(problems))
            self.model = HOST_TIER.device_part(expected, self.model)
            seen["load_backs"] += not plan.empty
            seen["load_backs_nothing_to_load"] += plan.empty
            seen["load_back_full_pages"] += len(plan.full)
            seen["load_back_swa_pages"] += len(plan.swa)
            seen["load_backs_swa_only"] += bool(plan.swa) and not plan.full
            seen["load_back_dev_h12_pages"] += len(dev_h12_pages(before, plan, engine_after))
            self.check("load_back")

        def evicted_for_load(self, plan: LoadPlan, after: SwaState, made: bool
                             ) -> tuple[SwaState, LoadPlan]:
            """``evicting_load`` from the machine's device model, counted."""
            state, plan_made, victims = evicting_load(self.model, plan, after, made,
                                                      self.node_locks)
            seen["load_backs_evicting"] += 1
            seen["load_back_victims"] += len(victims)
            seen["load_backs_called_off"] += plan_made != plan
            return state, plan_made

        @rule(ids=tokens, past=st.integers(0, 16), keep=st.booleans())
        def serve(self, ids: tuple[int, ...], past: int, keep: bool) -> None:
            self.run_request(ids, past, keep)

        @precondition(lambda self: any(r.page is not None for r in self.running))
        @rule(data=st.data(), past=st.integers(0, 16), keep=st.booleans())
        def serve_shared(self, data: st.DataObject, past: int, keep: bool) -> None:
            """A request sharing a prefix of a running one's key (a system prompt): it
            reaches the tombstones on a locked path, which its insert heals."""
            page = data.draw(st.sampled_from([r.page for r in self.running
                                              if r.page is not None]))
            cut = data.draw(st.integers(1, len(page.tokens)))
            self.run_request(page.tokens[:cut], past, keep)

        def run_request(self, ids: tuple[int, ...], past: int, keep: bool) -> None:
            ps = config.page_size
            key = Key(ids)
            matched = self.match(key)
            prefix = len(matched.full_slots)
            receipt = self.engine.lock(matched.last_page)
            self.model = model.inc_lock_ref(self.model, matched.last_page)
            self.check(f"lock({matched.last_page})")
            need = -(-(len(ids) - prefix) // ps) * ps
            full = self.allocate(need) if need else ()
            if full is None:
                seen["abandoned"] += 1
                self.engine.unlock(receipt, False)
                self.model = model.dec_lock_ref(self.model, matched.last_page, False)
                self.check("unlock of an abandoned request")
                return
            view = self.engine.observe()
            unpaired = [f for f in full if f not in view.pairs]
            assert not unpaired, f"alloc({need}) gave full slots {unpaired} no SWA half"
            self.model = model.alloc(self.model, key, prefix, full,
                                     tuple(view.pairs[f] for f in full))
            self.engine.write_kv(full, [self.codes.code(content_at(key, prefix + i))
                                        if prefix + i < len(ids) else 0
                                        for i in range(len(full))])
            self.check(f"alloc({need}) = {full} and the forward pass")
            aligned = len(ids) - len(ids) % ps
            swa_evicted = min(past * ps, aligned)
            dropped = full[:max(0, swa_evicted - prefix)]
            if dropped:
                self.engine.free_swa(dropped)
                self.model = model.free_swa(self.model, dropped)
                self.check(f"free_swa({dropped})")
            slots = matched.full_slots + full[:len(ids) - prefix]
            before = self.model
            got = self.engine.insert(key, slots, swa_evicted)
            view = self.engine.observe()
            healed = {k for k, p in before.pages.items() if not p.live
                      and k in view.pages and view.pages[k].swa is not None}
            kept = frozenset(k for k in healed if view.pages[k].full == before.pages[k].full)
            self.model, want = model.insert(self.model, key, slots, swa_evicted, kept)
            seen["healed"] += len(healed)
            seen["healed_keeping_full"] += len(kept)
            seen["inserted_tombstones"] += sum(not p.live for k, p in self.model.pages.items()
                                               if k not in before.pages)
            assert got == want, f"insert({ids}) returned prefix {got}, the model {want}"
            # What the insert did not take goes back at once: an engine may free the
            # duplicates itself (SGLang, DEV-24), so the check follows the free.
            leftover = tuple(f for f in full if f in self.model.held)
            if leftover:
                self.engine.free(leftover)
                self.model = model.free(self.model, leftover)
            self.check(f"insert({ids}, {slots}, swa_evicted={swa_evicted}) = {got}, "
                       f"then free({leftover})")
            self.engine.unlock(receipt, False)
            self.model = model.dec_lock_ref(self.model, matched.last_page, False)
            self.check(f"unlock({matched.last_page})")
            if keep:
                again = self.match(key)
                self.running.append(Running(again.last_page, self.engine.lock(again.last_page)))
                self.model = model.inc_lock_ref(self.model, again.last_page)
                seen["running"] += 1
                self.check(f"lock({again.last_page}) of a running request")

        def releasable(self) -> list[int]:
            """Running requests a scheduler would release the SWA lock of early: not yet
            released, locked more than W tokens deep (DEV-H3)."""
            return [i for i, r in enumerate(self.running) if not r.swa_released
                    and r.page is not None and len(r.page.tokens) > config.window]

        @precondition(lambda self: bool(self.releasable()))
        @rule(data=st.data())
        def release_swa(self, data: st.DataObject) -> None:
            options = self.releasable()
            index = data.draw(st.sampled_from(options))
            request = self.running[index]
            self.engine.release_swa(request.receipt)
            self.model = model.dec_swa_lock(self.model, request.page)
            self.running[index] = replace(request, swa_released=True)
            seen["release_swa"] += 1
            self.check(f"release_swa({request.page})")

        @precondition(lambda self: bool(self.running))
        @rule(data=st.data())
        def finish(self, data: st.DataObject) -> None:
            request = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
            self.engine.unlock(request.receipt, request.swa_released)
            self.model = model.dec_lock_ref(self.model, request.page, request.swa_released)
            seen["finish"] += 1
            self.check(f"unlock({request.page}, swa_released={request.swa_released})")

        # -- requests as the scheduler hands them over (ScheduledSwaEngine) -------------
        def can_admit(self) -> bool:
            return self.scheduler is not None and len(self.scheduled) < MAX_SCHEDULED

        @precondition(lambda self: self.can_admit())
        @rule(prompt=st.lists(st.integers(1, 3), min_size=1, max_size=longest).map(tuple),
              tail=decode_tail)
        def admit_request(self, prompt: tuple[int, ...], tail: tuple[int, ...]) -> None:
            self.admit(prompt, tail)

        @precondition(lambda self: self.can_admit() and bool(self.scheduled))
        @rule(data=st.data(), tail=decode_tail)
        def admit_sharing(self, data: st.DataObject, tail: tuple[int, ...]) -> None:
            """A request whose prompt is a prefix of a live request's tokens (a system
            prompt): its match ends on that request's checkpoints, or short of them."""
            other = self.scheduled[pick(data, self.scheduled, lambda s: True)]
            cut = data.draw(st.integers(1, len(other.tokens)))
            self.admit(other.tokens[:cut], tail)

        def admit(self, prompt: tuple[int, ...], tail: tuple[int, ...]) -> None:
            """The scheduler's admission (``PrefillAdder``: ``match_kv_cache``, then the
            request locks the node its device match ended at)."""
            assert self.scheduler is not None
            tail = tail[:max(0, longest - len(prompt))]
            req = self.scheduler.new_request(prompt + tail, len(prompt))
            slots = self.scheduler.admit(req, Key(prompt))
            want = self.judge_match(Key(prompt), slots, self.scheduler.locked_page(req))
            self.model = model.inc_lock_ref(self.model, want.last_page)
            self.scheduled.append(Scheduled(req, prompt + tail, len(prompt), want.last_page,
                                            len(slots), len(slots)))
            seen["admitted"] += 1
            self.check(f"admit({prompt}) matched {len(slots)}, locked {want.last_page}")

        def grow(self, s: Scheduled, end: int) -> bool:
            """Pairs for the request's row up to ``end`` (whole pages) and the forward
            pass that computes it; False if the pools have no room even after evicting."""
            assert self.scheduler is not None
            need = -(-(end - s.allocated) // config.page_size) * config.page_size
            if need > 0:
                full = self.allocate(need)
                if full is None:
                    return False
                pairs = self.engine.observe().pairs
                unpaired = [f for f in full if f not in pairs]
                assert not unpaired, f"alloc({need}) gave full slots {unpaired} no SWA half"
                key = Key(s.tokens)
                self.model = model.alloc(self.model, key, s.allocated, full,
                                         tuple(pairs[f] for f in full))
                self.engine.write_kv(full, [self.codes.code(content_at(key, s.allocated + i))
                                            if s.allocated + i < len(s.tokens) else 0
                                            for i in range(len(full))])
                self.scheduler.write_row(s.req, s.allocated, full)
                s.allocated += need
            self.scheduler.advance(s.req, end)
            s.end = end
            self.check(f"alloc to {end} of {s.tokens} and the forward pass")
            return True

        @precondition(lambda self: any(s.end < s.prompt_len for s in self.scheduled))
        @rule(data=st.data(), chunk=st.integers(1, 8))
        def prefill_chunk(self, data: st.DataObject, chunk: int) -> None:
            """One chunk of a chunked prefill, published by ``checkpoint``
            (``checkpoint_kv_cache``, common.py:278, after every extend)."""
            index = pick(data, self.scheduled, lambda s: s.end < s.prompt_len)
            s = self.scheduled[index]
            if not self.grow(s, min(s.prompt_len, s.end + chunk)):
                self.drop(index, "aborted_for_room")
                return
            self.publish(s, finish=False)

        @precondition(lambda self: any(s.prompt_len <= s.end < len(s.tokens)
                                       for s in self.scheduled))
        @rule(data=st.data(), steps=st.integers(1, 6))
        def decode(self, data: st.DataObject, steps: int) -> None:
            """Decode steps (``alloc_for_decode``: ``maybe_evict_swa`` slides the window
            at ``seqlen - 1``, allocation.py:633, then one pair); a step short of room
            retracts the request (``retract_decode`` -> ``release_req``,
            schedule_batch.py:2389), which the scheduler re-admits later."""
            index = pick(data, self.scheduled, lambda s: s.prompt_len <= s.end < len(s.tokens))
            s = self.scheduled[index]
            for step in range(steps):
                if s.end >= len(s.tokens):
                    return
                if step or s.end > s.prompt_len:  # not on the first decode step
                    self.slide(s, s.end)
                seen["decode_steps"] += 1
                if not self.grow(s, s.end + 1):
                    self.drop(index, "retracted")
                    self.admit(s.tokens[:s.end], s.tokens[s.end:])
                    return

        def slide(self, s: Scheduled, pre_len: int) -> None:
            assert self.scheduler is not None
            row = self.scheduler.row(s.req, s.allocated)
            self.scheduler.slide_window(s.req, pre_len)
            pairs = self.engine.observe().pairs
            dropped = tuple(f for f in row
                            if self.model.held.get(f) is not None and f not in pairs)
            if dropped:
                self.model = model.free_swa(self.model, dropped)
                seen["window_slides"] += 1
            self.check(f"slide_window({pre_len}) of {s.tokens}: dropped {dropped}")

        @precondition(lambda self: any(s.end >= s.prompt_len for s in self.scheduled))
        @rule(data=st.data())
        def finish_request(self, data: st.DataObject) -> None:
            """``release_kv_cache(req, checkpoint=True)``: the final publish."""
            index = pick(data, self.scheduled, lambda s: s.end >= s.prompt_len)
            self.publish(self.scheduled.pop(index), finish=True)

        @precondition(lambda self: bool(self.scheduled))
        @rule(data=st.data(), now=st.integers(0, 2))
        def abort_request(self, data: st.DataObject, now: int) -> None:
            """An abort (``scheduler.py:3819``): ``release_kv_cache(req,
            checkpoint=False)`` whatever the request computed, prefill chunks already
            published included. One draw in three: requests mostly run their course."""
            if now:
                return
            index = pick(data, self.scheduled, lambda s: True)
            mid_prefill = self.scheduled[index].end < self.scheduled[index].prompt_len
            self.drop(index, "aborted_in_prefill" if mid_prefill else "aborted")

        def drop(self, index: int, why: str) -> None:
            """Release a request without publishing: its row past the protected prefix
            is freed (every pair of it the caller's), its lock released."""
            assert self.scheduler is not None
            s = self.scheduled.pop(index)
            p0, mine = release_unpublished(self.scheduler, s.req, s.allocated, s.end,
                                           self.model.held)
            if mine:
                self.model = model.free(self.model, mine)
            self.model = model.dec_lock_ref(self.model, s.page, False)
            seen[why] += 1
            self.check(f"release({s.tokens}, checkpoint=False) [{why}] at {s.end}, "
                       f"protected {p0}")

        def publish(self, s: Scheduled, finish: bool) -> None:
            """A checkpoint (``finish``: the final one of ``release_kv_cache``), replayed
            on the model from what the call did (module docstring)."""
            assert self.scheduler is not None
            sched = self.scheduler
            p0 = sched.protected_len(s.req)
            row = sched.row(s.req, s.allocated)
            before = self.model
            inserts = (sched.release(s.req, s.end, True) if finish
                       else sched.checkpoint(s.req, s.end))
            assert len(inserts) <= 1, f"one checkpoint made inserts {inserts}"
            length, cursor = inserts[0] if inserts else (p0, p0)
            swa_evicted = min(cursor, length)
            view = self.engine.observe()
            # The call's out-of-window free ran before its insert: the SWA halves of
            # [p0, swa_evicted) are gone, which makes those pages tombstones.
            in_key = tuple(f for f in row[p0:swa_evicted] if self.model.held.get(f) is not None)
            if in_key:
                self.model = model.free_swa(self.model, in_key)
            healed = {k for k, p in before.pages.items()
                      if not p.live and k in view.pages and view.pages[k].swa is not None}
            kept = frozenset(k for k in healed if view.pages[k].full == before.pages[k].full)
            key = Key(s.tokens[:length])
            if length:
                self.model, _ = model.insert(self.model, key, row[:length], swa_evicted, kept)
            seen["healed"] += len(healed)
            if not finish:
                seen["chunks"] += 1
                seen["chunk_tombstones"] += swa_evicted > p0
            # Duplicates of the tree's own slots: the insert freed them (DEV-24).
            leftover = tuple(f for f in row[p0:length] if f in self.model.held)
            if leftover:
                self.model = model.free(self.model, leftover)
            # SWA halves past the key that the out-of-window free took.
            beyond = tuple(f for f in row[length:] if self.model.held.get(f) is not None
                           and f not in view.pairs and f not in view.full_free)
            if beyond:
                self.model = model.free_swa(self.model, beyond)
            self.model = model.dec_lock_ref(self.model, s.page, False)
            step = (f"{'release' if finish else 'checkpoint'}({s.tokens[:s.end]}) protected "
                    f"{p0}, insert {length} swa_evicted {swa_evicted}, healed {len(healed)}")
            if finish:
                rest = tuple(f for f in row[length:] if f in self.model.held)
                if rest:
                    self.model = model.free(self.model, rest)
                seen["finished_requests"] += 1
                self.check(step)
                return
            page = key if length else None
            try:
                self.model = model.inc_lock_ref(self.model, page)
            except PreconditionError as refused:
                raise AssertionError(f"after {step}: the engine locked {page}, which the "
                                     f"model refuses: {refused}") from None
            s.page = page
            problems = lock_moved_problems(sched, s.req, page, length)
            assert not problems, f"after {step}: " + "; ".join(problems)
            self.check(step)

    SwaMachine.__name__ = f"SwaMachine_{config.page_size}_{config.window}"
    return SwaMachine
