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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from hiradix.conformance.hybrid.abstraction import Codes, abstract, mapping_problems
from hiradix.conformance.hybrid.engine import SwaEngine
from hiradix.conformance.victims import NoOrder, accepted_order, diff, victim_chains
from hiradix_model import Key
from hiradix_model import hybrid as model
from hiradix_model.hybrid import SwaConfig, SwaState
from hiradix_model.keys import content_at

Build = Callable[[SwaConfig], SwaEngine]
tokens = st.lists(st.integers(1, 3), min_size=1, max_size=16).map(tuple)


@dataclass(frozen=True)
class Running:
    """A request that holds a lock on its inserted key while it decodes."""

    page: Key | None
    receipt: object
    swa_released: bool = False


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


def taken_pages(before: SwaState, after: SwaState) -> list[set[Key]]:
    """The pages an eviction tombstoned, and those it deleted."""
    return [{k for k, p in before.pages.items()
             if p.live and k in after.pages and not after.pages[k].live},
            {k for k in before.pages if k not in after.pages}]


def same_pages(state: SwaState, other: SwaState) -> bool:
    """The same cached pages, each live or not alike."""
    return ({k: p.live for k, p in state.pages.items()}
            == {k: p.live for k, p in other.pages.items()})


def make_swa_machine(build: Build, config: SwaConfig,
                     reached: Counter[str] | None = None) -> type[RuleBasedStateMachine]:
    """A machine class driving a fresh ``build(config)`` per example; ``reached`` counts
    what the examples exercised (healing, tombstones, SWA evictions, ...)."""
    seen = reached if reached is not None else Counter()

    class SwaMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.engine = build(config)
            self.model = model.initial(config)
            self.codes = Codes()
            self.running: list[Running] = []
            self.node_locks = self.engine.lock_granularity == "node"
            seen["examples"] += 1
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
            problems += state_problems(abstract(view, config, self.codes), self.model,
                                       self.node_locks)
            assert not problems, f"after {step}:\n  " + "\n  ".join(problems)

        def match(self, key: Key) -> model.SwaMatch:
            slots, page = self.engine.match_prefix(key)
            want = model.match_prefix(self.model, key)
            problems = list(model.match_problems(self.model, key, page))
            if (tuple(slots), page) != (want.full_slots, want.last_page):
                problems.append(f"engine {page} {tuple(slots)}, model {want.last_page} "
                                f"{want.full_slots}")
            assert not problems, f"match_prefix({key.tokens}):\n  " + "\n  ".join(problems)
            return want

        # -- evictions ------------------------------------------------------------------
        def evict(self, pool: str, num_tokens: int) -> None:
            before = self.model
            freed = (self.engine.evict_full if pool == "full" else self.engine.evict_swa)(
                num_tokens)
            after = abstract(self.engine.observe(), config, self.codes)
            chains = victim_chains(taken_pages(before, after), config.page_size)

            def model_evict(victims: list[Key]) -> tuple[SwaState, int]:
                if pool == "full":
                    return model.evict_full(before, num_tokens, victims)
                return model.evict_swa(before, num_tokens, victims, enough=not self.node_locks)

            try:
                state, want, victims = accepted_order(
                    chains, model_evict, lambda state: same_pages(state, after))
            except NoOrder as refused:
                raise AssertionError(f"evict_{pool}({num_tokens}) = {freed} {refused}") from None
            self.model = state
            seen[f"evict_{pool}"] += 1
            seen["victims"] += len(victims)
            if pool == "swa":
                seen["tombstoned"] += sum(k in after.pages for k in victims)
            self.check(f"evict_{pool}({num_tokens}) = {freed}, "
                       f"victims {[v.tokens for v in victims]}")
            assert freed == want, f"evict_{pool}({num_tokens}) reported {freed}, freed {want}"

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
                self.evict("full", num_tokens)
                self.evict("swa", num_tokens)
                full = self.engine.alloc(num_tokens)
            return full

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

    SwaMachine.__name__ = f"SwaMachine_{config.page_size}_{config.window}"
    return SwaMachine
