"""The Mamba machine: a (FULL, MAMBA) cache beside the model of spec/13m, checked after
every engine call.

Requests run as a scheduler runs them (13m.4): match, copy the matched state into a slot
of the request's own (or start from a fresh one), lock the hit with its state, allocate
full slots for the rest (evicting full KV or states when a pool is short), run the
forward pass (KV written, the request's state moved to the end of its page-aligned
key), insert the key with that state, free what the insert did not take, release the
match lock, and -- for a request that goes on decoding -- match and lock the inserted
key again. Running requests later release their state lock early or finish. Standalone
evictions of either pool interleave.

After every call the engine's view is abstracted and compared with the model's state;
every model invariant holds on both, the engine's own check passes, and every match
satisfies INV-MAMBA-MATCH-STATE. Victims of an eviction are inferred from the pages that
went (deleted, or left without their state), deepest first.

An engine that also takes requests the way its server's scheduler hands them over
(``ScheduledMambaEngine``) gets a second set of rules beside those (``Scheduled``):
requests admitted (their state a copy of the hit's, or fresh), prefilled chunk by chunk,
each chunk published by ``checkpoint`` -- which offers the tree a fresh copy of the
request's state -- decoded, finished (the last checkpoint offers the request's own
state) or aborted and retracted (the request's state freed). Each call is replayed on
the model as the operations of 13m.3 it stands for, read off what it did: the copy
(``alloc_state`` holding the state after what the request computed), the insert and
whether the state was taken (``insert``), the state or copy freed when not
(``free_state``), the duplicates the engine freed itself (``free``) and the lock moved.

An engine with a host tier that acts on host hits (``HostLoadingMambaEngine``) also gets
load backs, each compared with 13m.8b's ``load_back`` (``load_back.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from hiradix.conformance.host_judge import assert_host_match, load_starts
from hiradix.conformance.hybrid.abstraction import Codes
from hiradix.conformance.hybrid.machine import (
    MAX_REQUEST,
    MAX_SCHEDULED,
    RequestRows,
    decode_tail,
    lock_moved_problems,
    pick,
    release_unpublished,
)
from hiradix.conformance.mamba.abstraction import abstract, host_problems, with_host
from hiradix.conformance.mamba.engine import (
    AllocEvictingMambaEngine,
    HostLoadingMambaEngine,
    HostMatchingMambaEngine,
    MambaEngine,
)
from hiradix.conformance.mamba.load_back import (
    HOST_TIER,
    MambaLoadPlan,
    called_off,
    evicted_for_load,
    expected_load,
    plan_for_key,
)
from hiradix.conformance.victims import NoOrder, accepted_order, diff, victim_chains
from hiradix_model import Key
from hiradix_model import mamba as model
from hiradix_model.keys import content_at
from hiradix_model.mamba import MambaConfig, MambaState

Build = Callable[[MambaConfig], MambaEngine]
tokens = st.lists(st.integers(1, 3), min_size=1, max_size=12).map(tuple)


@dataclass(frozen=True)
class Running:
    """A request that holds a lock on its inserted key while it decodes."""

    page: Key | None
    receipt: object
    state_released: bool = False


@runtime_checkable
class ScheduledMambaEngine(RequestRows, Protocol):
    """What a ``MambaEngine`` whose server publishes requests itself also takes."""

    def admit(self, req: Any, prompt: Key) -> tuple[tuple[int, ...], int, bool]:
        """Match the prompt (copying the hit's state into a slot of the request's own,
        or giving it a fresh one), bind a row, lock where the match ended: the matched
        full slots, the request's state slot, whether it is a copy."""

    def checkpoint(self, req: Any, up_to: int) -> list[tuple[int, int | None, bool]]:
        """Publish ``[protected, up_to)`` of an unfinished request; each insert made, as
        (key length, the state slot offered, whether the tree took it)."""

    def release(self, req: Any, owned: int,
                checkpoint: bool) -> list[tuple[int, int | None, bool]]:
        """Finish (``checkpoint``: a last publish) or drop (abort, retraction) a request;
        the inserts made."""

    def request_state(self, req: Any) -> int | None:
        """The request's own state slot, or None once it has none."""


@dataclass
class Scheduled:
    """A request the machine drives through a ``ScheduledMambaEngine``: ``end`` tokens
    computed, ``allocated`` row positions with slots, its own ``state`` slot, its lock on
    ``page`` (the model's)."""

    req: Any
    tokens: tuple[int, ...]
    prompt_len: int
    page: Key | None
    state: int
    allocated: int
    end: int


def state_problems(engine_state: MambaState, expected: MambaState) -> list[str]:
    """Where the abstracted engine state differs from the model's."""
    problems = []
    for name in ("full_free", "state_free", "held_full", "held_states", "full_kv",
                 "state_kv"):
        mine, theirs = getattr(expected, name), getattr(engine_state, name)
        if mine != theirs:
            problems.append(f"{name}: model {diff(mine, theirs)}")
    for key in sorted(set(expected.pages) | set(engine_state.pages), key=lambda k: k.tokens):
        want, got = expected.pages.get(key), engine_state.pages.get(key)
        if want != got:
            problems.append(f"page {key.tokens}: model {want}, engine {got}")
    return problems


def taken_pages(before: MambaState, after: MambaState) -> list[set[Key]]:
    """The pages an eviction left without their state, and those it deleted."""
    return [{k for k, p in before.pages.items() if p.state is not None
             and k in after.pages and after.pages[k].state is None},
            {k for k in before.pages if k not in after.pages}]


def same_pages(state: MambaState, other: MambaState) -> bool:
    """The same cached pages, each with or without a state alike."""
    return ({k: p.state is None for k, p in state.pages.items()}
            == {k: p.state is None for k, p in other.pages.items()})


def evicting_load(before: MambaState, plan: MambaLoadPlan, after: MambaState
                  ) -> tuple[MambaState, MambaLoadPlan, list[Key]]:
    """The state a load back short of full slots loaded into, what it loaded, and the
    victims: ``before`` after the eviction it made first (``load_back.evicted_for_load``),
    the victims read off the engine's state ``after`` the load (the pages it left without
    their state or deleted, the loaded ones aside); the plan called off where that
    eviction freed too little. ``AssertionError`` where no order of the victims is one
    the model accepts."""
    loads = {*plan.full, *((plan.anchor,) if plan.state else ())}

    def evicted(victims: list[Key]) -> tuple[MambaState, int]:
        return evicted_for_load(before, plan, victims)

    def same_but_the_load(state: MambaState) -> bool:
        return ({k: p.state is None for k, p in state.pages.items() if k not in loads}
                == {k: p.state is None for k, p in after.pages.items() if k not in loads})

    chains = victim_chains(taken_pages(before, after), before.config.page_size)
    try:
        state, enough, victims = accepted_order(chains, evicted, same_but_the_load)
    except NoOrder as refused:
        raise AssertionError(f"load back to {plan.anchor}, short of "
                             f"{plan.full_short(before)} full slots: its eviction "
                             f"{refused}") from None
    return state, (plan if enough else called_off(plan)), victims


def make_mamba_machine(build: Build, config: MambaConfig,
                       reached: Counter[str] | None = None) -> type[RuleBasedStateMachine]:
    """A machine class driving a fresh ``build(config)`` per example; ``reached`` counts
    what the examples exercised (forks, state tombstones, refills, evictions, ...)."""
    seen = reached if reached is not None else Counter()
    ps = config.page_size
    # A scheduled request fits in half the full pool, so that two run side by side.
    longest = min(MAX_REQUEST, config.full_slots // 2)

    class MambaMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.engine = build(config)
            self.model = model.initial(config)
            self.kv_codes = Codes()
            self.state_codes = Codes()
            self.running: list[Running] = []
            self.scheduler = (self.engine if isinstance(self.engine, ScheduledMambaEngine)
                              else None)
            self.alloc_evicting = (self.engine if isinstance(self.engine,
                                                             AllocEvictingMambaEngine)
                                   else None)
            self.scheduled: list[Scheduled] = []
            # An engine that loads host hits back, where it has a host tier.
            self.loader = (self.engine if isinstance(self.engine, HostLoadingMambaEngine)
                           and self.engine.observe().host is not None else None)
            seen["examples"] += 1
            seen["scheduled_examples"] += self.scheduler is not None
            seen["alloc_evicting_examples"] += self.alloc_evicting is not None
            self.check("the initial state")

        def teardown(self) -> None:
            self.engine.close()

        # -- checking -------------------------------------------------------------------
        def observed(self) -> MambaState:
            return abstract(self.engine.observe(), config, self.kv_codes, self.state_codes)

        def check(self, step: str) -> None:
            seen["checks"] += 1
            view = self.engine.observe()
            problems = [f"engine's own check: {view.own_check}"] if view.own_check else []
            engine_state = abstract(view, config, self.kv_codes, self.state_codes)
            problems += [f"engine {v}" for v in model.violations(engine_state)]
            problems += model.violations(self.model)
            problems += state_problems(engine_state, self.model)
            if view.host is not None:  # the host tier, to 13m.8b's invariants
                seen["host_checks"] += 1
                seen["host_pages_seen"] += len(view.host.pages)
                seen["host_deviation_checks"] += bool(view.host.exempt)
                seen["host_deviations_met"] += sum(map(len, view.host.exempt.values()))
                problems += host_problems(
                    with_host(engine_state, view.host, self.kv_codes, self.state_codes),
                    view.host.exempt)
            assert not problems, f"after {step}:\n  " + "\n  ".join(problems)

        def match(self, key: Key) -> model.MambaMatch:
            before = self.host_state()
            hit = self.engine.match_prefix(key)
            if before is not None:
                self.judge_host_match(before, key)
            want = model.match_prefix(self.model, key)
            problems = list(model.match_problems(self.model, key, hit.page, hit.full_hit))
            if (tuple(hit.full), hit.page) != (want.full_slots, want.last_page):
                problems.append(f"engine {hit.page} {tuple(hit.full)}, model "
                                f"{want.last_page} {want.full_slots}")
            assert not problems, f"match_prefix({key.tokens}):\n  " + "\n  ".join(problems)
            seen["hits_on_a_state"] += want.last_page is not None
            seen["hits_past_the_state"] += want.full_hit > len(want.full_slots)
            return want

        def host_state(self) -> MambaState | None:
            """The engine's state on both tiers now, where it has a host tier and reports
            its host match; else None."""
            if not isinstance(self.engine, HostMatchingMambaEngine):
                return None
            view = self.engine.observe()
            if view.host is None:
                return None
            return with_host(abstract(view, config, self.kv_codes, self.state_codes),
                             view.host, self.kv_codes, self.state_codes)

        def judge_host_match(self, before: MambaState, key: Key) -> None:
            """The engine's match with host hits (13m.8b ``match_prefix_host``) from
            ``before``, the state it matched in: where it ends
            (INV-MAMBA-HOST-MATCH-STATE)."""
            assert isinstance(self.engine, HostMatchingMambaEngine)
            page = self.engine.last_host_match()
            assert_host_match(key, page, model.match_prefix_host(before, key).last_page,
                              model.match_prefix(before, key).last_page,
                              model.host_match_problems(before, key, page), seen)

        # -- evictions ------------------------------------------------------------------
        def evict(self, pool: str, target: int, *, for_alloc: bool = False) -> None:
            """``evict_full`` or ``evict_states`` of ``target``, or with ``for_alloc`` the
            allocator's ``evict_for_alloc`` of that shortfall (13m.3)."""
            before = self.model
            if for_alloc:
                assert self.alloc_evicting is not None
                full, states = self.alloc_evicting.evict_for_alloc(
                    target if pool == "full" else 0, target if pool == "states" else 0)
                freed = full if pool == "full" else states
                call = f"evict_for_alloc({pool} short {target})"
            else:
                freed = (self.engine.evict_full if pool == "full"
                         else self.engine.evict_states)(target)
                call = f"evict_{pool}({target})"
            after = self.observed()
            chains = victim_chains(taken_pages(before, after), ps)
            evict = model.evict_full if pool == "full" else model.evict_states
            needs = (target, 0) if pool == "full" else (0, target)

            def judge(victims: list[Key]) -> tuple[MambaState, int]:
                if for_alloc:
                    return model.evict_for_alloc(before, *needs, victims)
                return evict(before, target, victims)

            try:
                state, want, victims = accepted_order(
                    chains, judge, lambda state: same_pages(state, after))
            except NoOrder as refused:
                raise AssertionError(f"{call} = {freed} {refused}") from None
            self.model = state
            seen[f"evict_for_alloc_{pool}" if for_alloc else f"evict_{pool}"] += 1
            seen["victims"] += len(victims)
            if pool == "states":
                seen["state_tombstones"] += sum(k in after.pages for k in victims)
            self.check(f"{call} = {freed}, victims {[v.tokens for v in victims]}")
            assert freed == want, f"{call} reported {freed}, freed {want}"

        def evict_for_room(self, pool: str, need: int) -> None:
            """Room for ``need`` full tokens or states after an allocation came back
            short: the server's allocators evict the shortfall themselves
            (``evict_for_alloc``, 13m.3) where the engine has that call; elsewhere the
            machine evicts ``need``."""
            if self.alloc_evicting is None:
                self.evict(pool, need)
                return
            free = len(self.model.full_free if pool == "full" else self.model.state_free)
            assert need > free, (f"the engine refused {need} {pool} with {free} free in the "
                                 "model")
            self.evict(pool, need - free, for_alloc=True)

        @rule(pages=st.integers(1, 4))
        def evict_full(self, pages: int) -> None:
            self.evict("full", pages * ps)

        @rule(states=st.integers(1, 3))
        def evict_states(self, states: int) -> None:
            self.evict("states", states)

        # -- a request --------------------------------------------------------------------
        def state_slot(self, hit: model.MambaMatch, key: Key) -> int | None:
            """The request's own state: a copy of the hit's (locked by now, so an
            eviction for room cannot take it), or a fresh one; None if no room."""
            page = hit.last_page

            def take() -> int | None:
                return self.engine.alloc_state() if page is None else self.engine.fork(page)

            slot = take()
            if slot is None:
                seen["state_short"] += 1
                self.evict_for_room("states", 1)
                slot = take()
            if slot is None:
                return None
            if page is not None:
                self.model = model.fork(self.model, page, slot)
                seen["forks"] += 1
                self.check(f"fork({page.tokens}) = {slot}")
            else:
                empty = Key((), key.namespace)
                self.model = model.alloc_state(self.model, slot, empty)
                self.engine.write_state(slot, self.state_codes.code(empty))
                self.check(f"alloc_state() = {slot}")
            return slot

        @precondition(lambda self: self.loader is not None)
        @rule(data=st.data(), tail=st.lists(st.integers(1, 3), max_size=3).map(tuple))
        def load_back(self, data: st.DataObject, tail: tuple[int, ...]) -> None:
            """A request whose prefix reaches KV or a state on the host only (a host-only
            page's or a host state's tokens and ``tail``): matched, then loaded back as its
            server does; the engine's state
            after it must be 13m.8b's ``load_back`` of what the match reached (and, where
            it restored a state, the request's copy of it, DEV-M14), into the slots the
            engine chose. The request then ends, returning its copy. A load short of
            full slots evicts first, as the server's does (``evicted_for_load``). Not
            made: one short of state slots (SGLang's load evicts states in three places,
            which the machine does not yet tell apart), and one short of full slots
            while a device page has no host copy (write-back backs victims up as it
            evicts them, which 13m.3's device-tier eviction does not express)."""
            assert self.loader is not None
            engine_before = self.host_state()
            assert engine_before is not None
            # Host-only pages (a full load), and device pages whose state is on the host
            # only (a load of the state alone).
            hosted = load_starts(engine_before, lambda k: engine_before.host[k].state
                                 is not None and engine_before.pages[k].state is None)
            if not hosted:
                seen["load_back_nothing_hosted"] += 1
                return
            key = Key(data.draw(st.sampled_from(hosted)).tokens + tail)
            self.match(key)  # judged on both tiers as any match
            engine_before = self.host_state()
            assert engine_before is not None
            before = HOST_TIER.two_tier(self.model, engine_before)
            plan = plan_for_key(before, key)
            if not plan.states_fit(before):
                seen["load_back_states_short"] += 1
                return
            if plan.full_short(before) and not before.pages.keys() <= before.host.keys():
                seen["load_back_short_unbacked"] += 1
                return
            loaded, page, slot = self.loader.load_back()
            engine_after = self.host_state()
            assert engine_after is not None
            if plan.full_short(before):
                before, plan = self.evicted_for_load(before, plan, engine_after)
            expected, problems = expected_load(before, plan, loaded, page, slot, engine_after)
            problems += state_problems(engine_after, expected)
            problems += HOST_TIER.problems(engine_after, expected)
            assert not problems, (f"load_back({key.tokens}):\n  " + "\n  ".join(problems))
            self.model = HOST_TIER.device_part(expected, self.model)
            seen["load_backs"] += not plan.empty
            seen["load_backs_nothing_to_load"] += plan.empty
            seen["load_back_full_pages"] += len(plan.full)
            seen["load_back_states"] += plan.state
            seen["load_backs_state_only"] += plan.state and not plan.full
            self.check(f"load_back({key.tokens})")
            if slot is not None:  # the request ends: its copy goes back to the pool
                self.engine.free_state(slot)
                self.model = model.free_state(self.model, slot)
                self.check(f"free_state({slot})")

        def evicted_for_load(self, before: MambaState, plan: MambaLoadPlan,
                             after: MambaState) -> tuple[MambaState, MambaLoadPlan]:
            """``evicting_load``, counted."""
            state, plan_made, victims = evicting_load(before, plan, after)
            seen["load_backs_evicting"] += 1
            seen["load_back_victims"] += len(victims)
            seen["load_backs_called_off"] += plan_made != plan
            return state, plan_made

        @rule(ids=tokens, keep=st.booleans(), early=st.booleans())
        def serve(self, ids: tuple[int, ...], keep: bool, early: bool) -> None:
            self.run_request(ids, keep, early)

        @precondition(lambda self: any(r.page is not None for r in self.running))
        @rule(data=st.data(), keep=st.booleans(), early=st.booleans())
        def serve_shared(self, data: st.DataObject, keep: bool, early: bool) -> None:
            """A request sharing a prefix of a running one's key (a system prompt)."""
            page = data.draw(st.sampled_from([r.page for r in self.running
                                              if r.page is not None]))
            cut = data.draw(st.integers(1, len(page.tokens)))
            self.run_request(page.tokens[:cut], keep, early)

        def run_request(self, ids: tuple[int, ...], keep: bool, early: bool) -> None:
            aligned = len(ids) - len(ids) % ps
            if not aligned:
                return
            key = Key(ids[:aligned])
            hit = self.match(key)
            receipt = self.engine.lock(hit.last_page, True)
            self.model = model.inc_lock_ref(self.model, hit.last_page, True)
            self.check(f"lock({hit.last_page}, with_state=True)")
            slot = self.state_slot(hit, key)
            if slot is None:
                seen["abandoned"] += 1
                self.engine.unlock(receipt, False)
                self.model = model.dec_lock_ref(self.model, hit.last_page, False)
                self.check("unlock of a request with no state slot")
                return
            prefix = len(hit.full_slots)
            need = aligned - prefix
            full = self.engine.alloc(need) if need else ()
            if full is None:
                seen["alloc_short"] += 1
                self.evict_for_room("full", need)
                full = self.engine.alloc(need)
            if full is None:
                seen["abandoned"] += 1
                self.engine.unlock(receipt, False)
                self.model = model.dec_lock_ref(self.model, hit.last_page, False)
                self.engine.free_state(slot)
                self.model = model.free_state(self.model, slot)
                self.check("unlock and free_state of an abandoned request")
                return
            self.model = model.alloc(self.model, key, prefix, full)
            self.engine.write_kv(full, [self.kv_codes.code(content_at(key, prefix + i))
                                        for i in range(len(full))])
            self.engine.write_state(slot, self.state_codes.code(key))
            self.model = model.write_state(self.model, slot, key)
            self.check(f"alloc({need}) = {full} and the forward pass")
            released = early and hit.last_page is not None
            if released:
                self.engine.release_state(receipt)
                self.model = model.dec_state_lock(self.model, hit.last_page)
                seen["release_state"] += 1
                self.check(f"release_state({hit.last_page})")
            slots = hit.full_slots + full
            got = self.engine.insert(key, slots, slot)
            self.model, prefix_len, taken = model.insert(self.model, key, slots, slot)
            assert got == (prefix_len, taken), (
                f"insert({ids}) returned {got}, the model ({prefix_len}, {taken})")
            seen["inserted_states"] += taken
            seen["refilled_state_tombstones"] += taken and prefix_len == aligned
            leftover = tuple(f for f in full if f in self.model.held_full)
            if leftover:
                self.engine.free(leftover)
                self.model = model.free(self.model, leftover)
            if not taken:
                self.engine.free_state(slot)
                self.model = model.free_state(self.model, slot)
            self.check(f"insert({key.tokens}, {slots}, state {slot}) = {got}, then "
                       f"free({leftover}){'' if taken else f' and free_state({slot})'}")
            self.engine.unlock(receipt, released)
            self.model = model.dec_lock_ref(self.model, hit.last_page, released)
            self.check(f"unlock({hit.last_page}, state_released={released})")
            if keep:
                again = self.match(key)
                self.running.append(Running(again.last_page,
                                            self.engine.lock(again.last_page, True)))
                self.model = model.inc_lock_ref(self.model, again.last_page, True)
                seen["running"] += 1
                self.check(f"lock({again.last_page}) of a running request")

        def releasable(self) -> list[int]:
            return [i for i, r in enumerate(self.running)
                    if not r.state_released and r.page is not None]

        @precondition(lambda self: bool(self.releasable()))
        @rule(data=st.data())
        def release_state(self, data: st.DataObject) -> None:
            index = data.draw(st.sampled_from(self.releasable()))
            request = self.running[index]
            self.engine.release_state(request.receipt)
            self.model = model.dec_state_lock(self.model, request.page)
            self.running[index] = replace(request, state_released=True)
            seen["release_state"] += 1
            self.check(f"release_state({request.page})")

        @precondition(lambda self: bool(self.running))
        @rule(data=st.data())
        def finish(self, data: st.DataObject) -> None:
            request = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
            self.engine.unlock(request.receipt, request.state_released)
            self.model = model.dec_lock_ref(self.model, request.page, request.state_released)
            seen["finish"] += 1
            self.check(f"unlock({request.page}, state_released={request.state_released})")

        # -- requests as the scheduler hands them over (ScheduledMambaEngine) -----------
        def can_admit(self) -> bool:
            return self.scheduler is not None and len(self.scheduled) < MAX_SCHEDULED

        def state_room(self) -> bool:
            """A free state slot for a call that allocates one, evicting a cached state
            if there is none (SGLang would evict inside the call: DEV-M1)."""
            if not self.model.state_free:
                seen["state_short"] += 1
                self.evict_for_room("states", 1)
            return bool(self.model.state_free)

        @precondition(lambda self: self.can_admit())
        @rule(prompt=st.lists(st.integers(1, 3), min_size=1, max_size=longest).map(tuple),
              tail=decode_tail)
        def admit_request(self, prompt: tuple[int, ...], tail: tuple[int, ...]) -> None:
            self.admit(prompt, tail)

        @precondition(lambda self: self.can_admit() and bool(self.scheduled))
        @rule(data=st.data(), tail=decode_tail)
        def admit_sharing(self, data: st.DataObject, tail: tuple[int, ...]) -> None:
            """A request whose prompt is a prefix of a live request's tokens: its match
            ends on that request's checkpoints (a branch, its state copied)."""
            other = self.scheduled[pick(data, self.scheduled, lambda s: True)]
            cut = data.draw(st.integers(1, len(other.tokens)))
            self.admit(other.tokens[:cut], tail)

        def admit(self, prompt: tuple[int, ...], tail: tuple[int, ...]) -> None:
            assert self.scheduler is not None
            if not self.state_room():
                seen["abandoned"] += 1
                return
            tail = tail[:max(0, longest - len(prompt))]
            req = self.scheduler.new_request(prompt + tail, len(prompt))
            key = Key(prompt)
            slots, state, copied = self.scheduler.admit(req, key)
            want = model.match_prefix(self.model, key)
            page = self.scheduler.locked_page(req)
            problems = list(model.match_problems(self.model, key, page, want.full_hit))
            if (slots, page) != (want.full_slots, want.last_page):
                problems.append(f"engine {page} {slots}, model {want.last_page} "
                                f"{want.full_slots}")
            if copied != (want.last_page is not None):
                problems.append(f"the request's state {'is' if copied else 'is not'} a "
                                f"copy, the match ended at {want.last_page}")
            assert not problems, f"admit({prompt}):\n  " + "\n  ".join(problems)
            if want.last_page is not None:
                self.model = model.fork(self.model, want.last_page, state)
                seen["admitted_on_a_copy"] += 1
            else:
                empty = Key((), key.namespace)
                self.model = model.alloc_state(self.model, state, empty)
                self.engine.write_state(state, self.state_codes.code(empty))
            self.model = model.inc_lock_ref(self.model, want.last_page, True)
            self.scheduled.append(Scheduled(req, prompt + tail, len(prompt), want.last_page,
                                            state, len(slots), len(slots)))
            seen["admitted"] += 1
            self.check(f"admit({prompt}) matched {len(slots)} at {want.last_page}, state "
                       f"{state}{' (a copy)' if copied else ''}")

        def grow(self, s: Scheduled, end: int) -> bool:
            """Full slots for the request's row up to ``end`` and the forward pass that
            computes it (KV written, the request's state moved to ``end``); False if the
            full pool has no room even after evicting."""
            assert self.scheduler is not None
            need = -(-(end - s.allocated) // ps) * ps
            if need > 0:
                full = self.engine.alloc(need)
                if full is None:
                    seen["alloc_short"] += 1
                    self.evict_for_room("full", need)
                    full = self.engine.alloc(need)
                if full is None:
                    return False
                key = Key(s.tokens)
                self.model = model.alloc(self.model, key, s.allocated, full)
                self.engine.write_kv(full, [self.kv_codes.code(content_at(key, s.allocated + i))
                                            for i in range(len(full))])
                self.scheduler.write_row(s.req, s.allocated, full)
                s.allocated += need
            self.scheduler.advance(s.req, end)
            s.end = end
            computed = Key(s.tokens[:end])
            self.engine.write_state(s.state, self.state_codes.code(computed))
            self.model = model.write_state(self.model, s.state, computed)
            self.check(f"alloc to {end} of {s.tokens} and the forward pass")
            return True

        @precondition(lambda self: any(s.end < s.prompt_len for s in self.scheduled))
        @rule(data=st.data(), chunk=st.integers(1, 8))
        def prefill_chunk(self, data: st.DataObject, chunk: int) -> None:
            """One chunk of a chunked prefill, published by ``checkpoint``
            (``checkpoint_kv_cache``, common.py:278, after every extend)."""
            index = pick(data, self.scheduled, lambda s: s.end < s.prompt_len)
            s = self.scheduled[index]
            if not self.grow(s, min(s.prompt_len, s.end + chunk)) or not self.state_room():
                self.drop(index, "aborted_for_room")
                return
            self.publish(s, finish=False)

        @precondition(lambda self: any(s.prompt_len <= s.end < len(s.tokens)
                                       for s in self.scheduled))
        @rule(data=st.data(), steps=st.integers(1, 6))
        def decode(self, data: st.DataObject, steps: int) -> None:
            """Decode steps, one token each; a step short of room retracts the request
            (``retract_decode`` -> ``release_req``, schedule_batch.py:2389), which the
            scheduler re-admits later."""
            index = pick(data, self.scheduled, lambda s: s.prompt_len <= s.end < len(s.tokens))
            self.decode_steps(index, steps)

        def decode_steps(self, index: int, steps: int) -> None:
            """Up to ``steps`` decode steps of scheduled request ``index``; short of room,
            it is retracted and admitted again (what it computed is its prompt now)."""
            s = self.scheduled[index]
            for _ in range(steps):
                if s.end >= len(s.tokens):
                    return
                seen["decode_steps"] += 1
                if not self.grow(s, s.end + 1):
                    self.drop(index, "retracted")
                    self.admit(s.tokens[:s.end], s.tokens[s.end:])
                    return

        @precondition(lambda self: any(s.end >= s.prompt_len for s in self.scheduled))
        @rule(data=st.data())
        def finish_request(self, data: st.DataObject) -> None:
            """``release_kv_cache(req, checkpoint=True)``: the final publish, which
            offers the tree the request's own state."""
            index = pick(data, self.scheduled, lambda s: s.end >= s.prompt_len)
            self.publish(self.scheduled.pop(index), finish=True)

        @precondition(lambda self: bool(self.scheduled))
        @rule(data=st.data(), now=st.integers(0, 2))
        def abort_request(self, data: st.DataObject, now: int) -> None:
            """An abort (``scheduler.py:3819``): ``release_kv_cache(req,
            checkpoint=False)``, prefill chunks already published included. One draw in
            three: requests mostly run their course."""
            if now:
                return
            index = pick(data, self.scheduled, lambda s: True)
            mid_prefill = self.scheduled[index].end < self.scheduled[index].prompt_len
            self.drop(index, "aborted_in_prefill" if mid_prefill else "aborted")

        def drop(self, index: int, why: str) -> None:
            """Release a request without publishing: its row past the protected prefix
            and its state freed, its lock released."""
            assert self.scheduler is not None
            s = self.scheduled.pop(index)
            p0, mine = release_unpublished(self.scheduler, s.req, s.allocated, s.end,
                                           self.model.held_full)
            assert self.scheduler.request_state(s.req) is None, (
                f"{s.tokens}: released without checkpoint, still holds state "
                f"{self.scheduler.request_state(s.req)}")
            if mine:
                self.model = model.free(self.model, mine)
            self.model = model.free_state(self.model, s.state)
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
            inserts = (sched.release(s.req, s.end, True) if finish
                       else sched.checkpoint(s.req, s.end))
            assert len(inserts) <= 1, f"one checkpoint made inserts {inserts}"
            length, offered, taken = inserts[0] if inserts else (p0, None, False)
            key = Key(s.tokens[:length])
            step = (f"{'release' if finish else 'checkpoint'}({s.tokens[:s.end]}) protected "
                    f"{p0}, insert {length} offering state {offered}, taken {taken}")
            if inserts:
                problems = []
                if finish and offered != s.state:
                    problems.append(f"the final insert offered {offered}, not the "
                                    f"request's state {s.state}")
                if not finish and (offered is None or offered == s.state):
                    problems.append(f"a chunk's insert offered {offered}, not a copy")
                assert not problems, f"{step}: " + "; ".join(problems)
                assert offered is not None
                if not finish:
                    # The copy holds the state after what the request computed.
                    self.model = model.alloc_state(self.model, offered,
                                                   Key(s.tokens[:s.end]))
                self.model, _, took = model.insert(self.model, key, row[:length], offered)
                assert took == taken, f"{step}: the model's insert took the state: {took}"
                if not taken:
                    self.model = model.free_state(self.model, offered)
                seen["states_published" if taken else "states_already_cached"] += 1
            elif finish:
                self.model = model.free_state(self.model, s.state)
            seen["finished_requests" if finish else "chunks"] += 1
            # Duplicates of the tree's own slots: the insert freed them (DEV-24).
            leftover = tuple(f for f in row[p0:length] if f in self.model.held_full)
            if leftover:
                self.model = model.free(self.model, leftover)
            self.model = model.dec_lock_ref(self.model, s.page, False)
            if finish:
                rest = tuple(f for f in row[length:] if f in self.model.held_full)
                if rest:
                    self.model = model.free(self.model, rest)
                self.check(step)
                return
            page = key if length else None
            self.model = model.inc_lock_ref(self.model, page, True)
            s.page = page
            problems = lock_moved_problems(sched, s.req, page, length)
            if sched.request_state(s.req) != s.state:
                problems.append(f"the request's state is {sched.request_state(s.req)}")
            assert not problems, f"after {step}: " + "; ".join(problems)
            self.check(step)

    MambaMachine.__name__ = f"MambaMachine_{config.page_size}_{config.state_slots}"
    return MambaMachine
