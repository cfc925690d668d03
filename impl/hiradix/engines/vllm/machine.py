"""The differential machine for vLLM's device cache (spec/10): the model beside
``KVCacheManager``, one request at a time, as vLLM's scheduler drives it.

The generic suite (``differential``) speaks ``EngineAdapter``: a cache with separate
match, lock, alloc, insert and evict calls. vLLM has none of these as calls; a request
does ``get_computed_blocks`` and ``allocate_slots`` (touch, lazy eviction, allocation and
hash registration at once) and later ``free``. This machine issues exactly those and maps
each onto the model's steps (DEV-V4, DEV-V5), infers the victims of the lazy eviction
from the states before and after (``infer``), and after every rule compares the observed
state with the model's and checks every invariant on both (``violations``), plus vLLM's
free-block counter (INV-ACCOUNTING, ``counter_problems``).

``hiradix check --engine vllm`` builds it with ``make_machine(engine, scenario, tally)``.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hiradix.conformance import infer
from hiradix.conformance.differential import EngineSteps
from hiradix.conformance.infer import left_device
from hiradix.conformance.scenario import Scenario
from hiradix.conformance.tally import Tally
from hiradix.engines.vllm.cache import VllmDevice, ceil_pages, factory, page_aligned
from hiradix.engines.vllm.offload import VllmOffload
from hiradix_model import Key, State, initial, ops, trace
from hiradix_model.ops._draft import Draft
from hiradix_model.ops.backup import backup_run
from hiradix_model.ops.insert import insert_pages

tokens = st.lists(st.integers(1, 3), min_size=1, max_size=14).map(tuple)
namespaces = st.sampled_from([None, None, "b"])


def evicted(state: State, gone: set[Key]) -> State:
    """``state`` after its pages ``gone`` lost their device copies (write-through: a page
    with a host copy becomes host-only, one without is deleted)."""
    pages = {k: replace(p, device=None) if k in gone else p for k, p in state.pages.items()
             if k not in gone or p.host is not None}
    return replace(state, pages=pages)


ROOMY_HOST = 256  # host pages: more than a bounded campaign ever stores (DEV-V7, DEV-V8)


def make_machine(engine: str, scenario: Scenario, tally: Tally | None = None,
                 host_policy: str = "lru",
                 host_eviction: bool = False) -> type[RuleBasedStateMachine]:
    """A state machine class driving a fresh vLLM cache per example: ``vllm`` (device
    only) or ``vllm-offload`` (with the CPU tier under ``host_policy``, lru or arc).
    Unless ``host_eviction``, the host gets ``ROOMY_HOST`` pages, so that a campaign
    steers clear of vLLM's host eviction (DEV-V7, DEV-V8) and goes on to find others."""
    if engine == "vllm-offload" and not host_eviction:
        scenario = replace(scenario, host_pages=max(scenario.host_pages, ROOMY_HOST))
    if engine not in ("vllm", "vllm-offload"):
        raise ValueError(f"engine: the vLLM machine drives 'vllm' or 'vllm-offload', "
                         f"got {engine!r}")
    build = factory(engine, scenario) if engine == "vllm" else (
        lambda: VllmOffload(scenario, host_policy))
    counts = tally if tally is not None else Tally()

    class VllmDifferential(EngineSteps, RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            counts.begin_example()  # TimeUp once the budget is spent: before any engine
            self.engine: VllmDevice = build()
            self.model = initial(self.engine.config)
            self.adopted = frozenset(self.engine.adopted)
            self.why = "; ".join(f"{k}: {v}" for k, v in self.engine.adopted.items())
            self.now = 0
            self.seen: list[Key] = []
            self.trace: list[trace.Step] = []
            self.counts = counts
            self.engine_label = self.engine.name
            counts.last_trace = self.trace
            counts.last_config = self.engine.config

        def teardown(self) -> None:
            self.engine.close()

        # -- a request's life (spec/03 3.17 as vLLM's scheduler runs it) --------------

        def serve(self, key: Key, dt: int, keep: bool) -> None:
            ps = self.model.config.page_size
            now = self.tick(dt)
            request = self.engine.new_request(key)
            hit, hit_tokens = self.engine.lookup(request)
            host_pages = self.engine.host_hit(request, key, hit_tokens // ps)
            # DEV-V4: the scheduler caps a hit at all but the last token (it needs logits).
            want = self.step("match_prefix", ops.match_prefix,
                             Key(key.tokens[:-1], key.namespace), now)
            assert isinstance(want, ops.MatchResult)
            last_host = self.engine.last_on_host(key, hit_tokens // ps + host_pages)
            self.agree(ops.MatchResult(self.engine.hit_slots(hit), self.engine.last_page(hit),
                                       last_host, host_pages * ps), want)
            locked = want.last_device_page
            prefix = want.device_slots
            if host_pages:
                loaded = self.load(request, key, hit, hit_tokens, want)
                if loaded is None:
                    return
                hit, hit_tokens, prefix = None, 0, prefix + loaded
                locked = want.last_host_page
            before = self.observe()
            need = len(key.tokens) - len(prefix)
            # What an allocation can take once the hit is referenced: free and evictable.
            pinned = ops.inc_lock_ref(self.model, locked)[0] if not host_pages else self.model
            room = len(pinned.device_free) + pinned.evictable_tokens
            new = self.engine.schedule(request, key, hit, hit_tokens)
            if new is None:
                # vLLM found no room and changed nothing: neither does the model.
                assert ceil_pages(need, ps) > room, "vLLM refused an allocation that fits"
                if host_pages:  # the scheduler gives the loaded request's blocks back
                    self.engine.abandon(request)
                    self.step("dec_lock_ref", ops.dec_lock_ref, locked)
                return
            self.engine.store(request, key)  # the connector offers the request's blocks
            # DEV-V5: allocate_slots = touch, lazy eviction, allocation, registration.
            after = self.observe(adopt=False)
            if not host_pages:
                self.step("inc_lock_ref", ops.inc_lock_ref, locked)
            self.flush()
            shortfall = max(0, len(new) - len(self.model.device_free))
            gone = left_device(before, after)
            if shortfall or gone:
                victims = infer.device_victims(self.model, before, after, shortfall)
                self.step("evict", ops.evict, shortfall, victims)
            self.step("alloc", ops.alloc, key, len(prefix), new)
            slots = prefix + new[:need]
            draft = Draft(self.model)
            _, due = insert_pages(draft, key, slots, now, 0, False)
            # The store's host victims are judged after the device eviction of the same
            # call: a page that lost its device copy there is host-only by then.
            report = infer.backup(self.model, evicted(before, gone), after,
                                  backup_run(draft, due))
            self.step("insert", ops.insert, key, slots, now, priority=0, chunked=False,
                      backup=report)
            full = len(key.tokens) // ps * ps
            deepest = Key(key.tokens[:full], key.namespace) if full else None
            if deepest != locked:  # the request now references its whole block table
                self.step("inc_lock_ref", ops.inc_lock_ref, deepest)
                self.step("dec_lock_ref", ops.dec_lock_ref, locked)
            self.engine.running[request.request_id].lock_page = deepest
            if not keep:
                self.finish(request.request_id)

        def load(self, request: object, key: Key, hit: object, hit_tokens: int,
                 want: ops.MatchResult) -> tuple[int, ...] | None:
            """The connector's load of the host hit, completed at once: init_load_back,
            loading_check, and the request's lock on the loaded page."""
            assert isinstance(self.engine, VllmOffload)  # a host hit needs the host tier
            before = self.observe()
            pages = want.host_hit_tokens // self.model.config.page_size
            loaded = self.engine.load(request, key, hit, hit_tokens, pages)
            if loaded is None:
                return None
            after = self.observe(adopt=False)
            anchor = want.last_device_page
            self.flush()
            shortfall = max(0, want.host_hit_tokens - len(self.model.device_free))
            pinned = ops.inc_lock_ref(self.model, anchor)[0] if anchor else self.model
            victims = infer.device_victims(pinned, before, after, shortfall)
            self.step("init_load_back", ops.init_load_back, want.last_host_page, None,
                      device_victims=victims, device_slots=loaded)
            self.step("loading_check", ops.loading_check, 1)
            self.step("inc_lock_ref", ops.inc_lock_ref, want.last_host_page)
            return loaded

        def flush(self) -> None:
            """DEV-V9: the stores the connector flushed, because the request's block table
            after the allocation holds a block they read (taken back or hit), complete
            before that call's eviction or load."""
            flushed = self.engine.take_flushes()
            if flushed:
                self.step("writing_check", ops.writing_check, flushed)

        def finish(self, request_id: str) -> None:
            # Freed at once, stores in flight or not (DEV-V9: no delayed free).
            running = self.engine.finish(request_id)
            self.step("dec_lock_ref", ops.dec_lock_ref, running.lock_page)
            if running.tail:
                self.step("free", ops.free, running.tail)

        # -- rules ---------------------------------------------------------------------

        @rule(tokens=tokens, namespace=namespaces, dt=st.integers(0, 2), keep=st.booleans())
        def request(self, tokens: tuple[int, ...], namespace: str | None, dt: int,
                    keep: bool) -> None:
            if page_aligned(tokens, self.model.config.page_size):
                tokens = (*tokens, 1)  # DEV-V1 steered around: never whole pages
            key = Key(tokens, namespace)
            self.serve(key, dt, keep)
            self.seen.append(key)

        @precondition(lambda self: bool(self.seen))
        @rule(index=st.integers(0, 63), dt=st.integers(0, 2))
        def request_again(self, index: int, dt: int) -> None:
            self.serve(self.seen[index % len(self.seen)], dt, False)

        @precondition(lambda self: bool(self.engine.running))
        @rule(index=st.integers(0, 63))
        def finish_one(self, index: int) -> None:
            # No tick of its own: a release is stamped with the model's clock (DEV-V2).
            running = sorted(self.engine.running, key=int)
            self.finish(running[index % len(running)])

        @precondition(lambda self: "writing_check" in self.engine.operations
                      and bool(self.model.pending))
        @rule()
        def writing_check(self) -> None:
            assert isinstance(self.engine, VllmOffload)
            self.step("writing_check", ops.writing_check, self.engine.writing_check())

        @rule(go=st.integers(0, 15))
        def reset(self, go: int) -> None:
            if go:
                return
            done = self.engine.reset()
            # vLLM refuses while a request holds blocks; the model's reset has no such
            # precondition, so the step is taken only when vLLM did it.
            assert done == (not self.engine.running), f"reset_prefix_cache returned {done}"
            if done:
                self.step("reset", ops.reset)

        # -- after every step ------------------------------------------------------------

        @invariant()
        def engine_refines_the_model(self) -> None:
            seen = self.observe()
            self.compare(seen)
            counter = self.engine.counter_problems(seen)
            assert not counter, f"vllm breaks INV-ACCOUNTING: {counter}"
            self.tally_step()

    return VllmDifferential
