"""SGLang 0.5.23's server path for a (FULL, SWA) UnifiedRadixCache, checked against spec/13.

The scheduler never calls ``insert`` for a request: it publishes the request's row with
``checkpoint(req, up_to)`` after every prefill chunk, frees out-of-window SWA halves with
``evict_sliding_windows`` every decode step and checkpoints a last time in
``release_kv_cache``. These tests drive those calls through ``SglangSwaAdapter``'s
request-level methods, replay each call's effect on the model (``hiradix_model.hybrid``)
as spec operations, and run the hybrid machine's checks after every step.

Runs under ``.venv-sglang23``, skipped or failed as tests/engines/test_sglang_swa.py is.
"""

from __future__ import annotations

import importlib
import importlib.util
import random
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from hiradix.conformance.hybrid.abstraction import Codes, abstract, mapping_problems
from hiradix.conformance.hybrid.machine import state_problems
from hiradix.engines.sglang.swa import SglangRequest, SglangSwaAdapter
from hiradix_model import Key
from hiradix_model import hybrid as model
from hiradix_model.errors import IllegalChoice, PreconditionError
from hiradix_model.hybrid import SwaConfig
from hiradix_model.keys import content_at

from engine_env import require

ENGINE = "sglang-swa"
SEEDS = range(40)
ROWS, MAX_CONTEXT = 8, 512  # at most 4 requests live at once, each under 64 tokens


@pytest.fixture(autouse=True)
def sglang_installed() -> str:
    """Skip without SGLang 0.5.23; fail where it is installed but does not probe."""
    return require(ENGINE)


@dataclass
class FakeReq(SglangRequest):
    """The adapter's stand-in for SGLang's Req, with the harness's own bookkeeping,
    which SGLang never reads."""

    prompt_len: int = 0
    page: Key | None = None  # the model page its lock is on
    allocated: int = 0  # row positions with slots


class Divergence(AssertionError):
    """The engine and the model disagree, or a check failed."""


@dataclass
class Harness:
    """One cache and the model it is replayed on; ``reached`` counts what ran."""

    cfg: SwaConfig
    reached: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.a = SglangSwaAdapter(self.cfg, req_rows=ROWS, max_context_len=MAX_CONTEXT)
        self.model = model.initial(self.cfg)
        self.codes = Codes()
        self.n = 0
        self.log: list[str] = []

    def check(self, step: str) -> None:
        self.log.append(step)
        view = self.a.observe()
        problems = [f"own check: {view.own_check}"] if view.own_check else []
        problems += list(mapping_problems(view))
        problems += model.violations(self.model)
        problems += state_problems(abstract(view, self.cfg, self.codes), self.model, True)
        if problems:
            raise Divergence(f"after {step}:\n  " + "\n  ".join(problems))

    def _with_swa(self, slots: list[int] | tuple[int, ...]) -> list[int]:
        """Those of ``slots`` the model has held with their SWA half."""
        return [s for s in slots if self.model.held.get(s) is not None]

    def admit(self, tokens: tuple[int, ...], prompt_len: int) -> FakeReq:
        self.n += 1
        prompt = Key(tokens[:prompt_len])
        kv = importlib.import_module("sglang.srt.managers.schedule_batch").ReqKvInfo()
        req = FakeReq(rid=f"r{self.n}", origin_input_ids=array("q", prompt.tokens), kv=kv,
                      full_untruncated_fill_ids=array("q", prompt.tokens), tokens=tokens,
                      prompt_len=prompt_len)
        mine = self.a.admit(req, prompt)
        want = model.match_prefix(self.model, prompt)
        if mine != want.full_slots:
            raise Divergence(f"match {prompt_len}: engine {mine} model {want.full_slots}")
        req.page = want.last_page
        self.model = model.inc_lock_ref(self.model, want.last_page)
        req.allocated = req.extend_end = len(mine)
        self.reached["branching admissions"] += req.swa_branching_seqlen is not None
        self.check(f"{req.rid} admit prefix={len(mine)} branching={req.swa_branching_seqlen}")
        return req

    def grow(self, req: FakeReq, end: int) -> None:
        """Allocate whole pages up to position ``end``, KV written for the tokens."""
        ps = self.cfg.page_size
        need = -(-(end - req.allocated) // ps) * ps
        if need > 0:
            full = self.a.alloc(need)
            if full is None:
                raise Divergence("pool short: the scenarios are sized never to run out")
            key = Key(req.tokens)
            pairs = self.a.observe().pairs
            self.model = model.alloc(self.model, key, req.allocated, full,
                                     tuple(pairs[f] for f in full))
            # Padding past the tokens (a partial last page) gets code 0.
            self.a.write_kv(full, [self.codes.code(content_at(key, req.allocated + i))
                                   if req.allocated + i < len(req.tokens) else 0
                                   for i in range(len(full))])
            self.a.write_row(req, req.allocated, full)
            req.allocated += need
            req.kv.kv_allocated_len = req.allocated
        req.kv.kv_committed_len = req.extend_end = end
        req.full_untruncated_fill_ids = array("q", req.tokens[:end])
        self.check(f"{req.rid} alloc to {end}")

    def slide(self, req: FakeReq, pre_len: int) -> None:
        row = self.a.row(req, req.allocated)
        self.a.slide_window(req, pre_len)
        pairs = self.a.observe().pairs
        dropped = [s for s in self._with_swa(row) if s not in pairs]
        if dropped:
            self.model = model.free_swa(self.model, tuple(dropped))
            self.reached["decode frees"] += 1
        self.check(f"{req.rid} slide({pre_len}) dropped {dropped}")

    def checkpoint(self, req: FakeReq, up_to: int, finish: bool = False) -> None:
        p0 = req.kv.cache_protected_len
        row = list(self.a.row(req, req.allocated))
        before = self.model
        if finish:
            req.done = True
            inserts = self.a.release(req, up_to)
        else:
            inserts = self.a.checkpoint(req, up_to)
        if len(inserts) > 1:
            raise Divergence(f"{req.rid}: checkpoint({up_to}) made {len(inserts)} inserts")
        length, cursor = inserts[0] if inserts else (p0, p0)
        swa_evicted = min(cursor, length)
        if not finish and req.kv.cache_protected_len != length:
            raise Divergence(f"{req.rid}: protected {req.kv.cache_protected_len} after an "
                             f"insert of {length}")
        view = self.a.observe()
        # The call freed the SWA halves of [p0, swa_evicted) before its insert, which
        # makes those pages tombstones.
        in_key = self._with_swa(row[p0:swa_evicted])
        if in_key:
            self.model = model.free_swa(self.model, tuple(in_key))
        healed = {k for k, p in before.pages.items()
                  if not p.live and k in view.pages and view.pages[k].swa is not None}
        kept = frozenset(k for k in healed if view.pages[k].full == before.pages[k].full)
        key = Key(req.tokens[:length])
        if length:
            self.model, _ = model.insert(self.model, key, tuple(row[:length]), swa_evicted,
                                         kept)
            self.reached["tombstone-making inserts"] += swa_evicted > p0
            self.reached["healing inserts"] += bool(healed)
        # Duplicates of the tree's own slots that the insert freed.
        leftover = tuple(s for s in row[p0:length] if s in self.model.held)
        if leftover:
            self.model = model.free(self.model, leftover)
        # SWA halves past the key that the out-of-window free took.
        beyond = [s for s in self._with_swa(row[length:])
                  if s not in view.pairs and s not in view.full_free]
        if beyond:
            self.model = model.free_swa(self.model, tuple(beyond))
        self.model = model.dec_lock_ref(self.model, req.page, False)
        new_page = key if length else None
        if finish:
            rest = tuple(s for s in row[length:] if s in self.model.held)
            if rest:
                self.model = model.free(self.model, rest)
        else:
            try:
                self.model = model.inc_lock_ref(self.model, new_page)
            except PreconditionError as refused:
                raise Divergence(f"{req.rid} checkpoint({up_to}) locked page {length} "
                                 f"whose window is not live: {refused}") from refused
            req.page = new_page
            if self.a.locked_page(req) != new_page:
                raise Divergence(f"{req.rid}: engine lock on {self.a.locked_page(req)}, "
                                 f"expected {new_page}")
            if self.a.row(req, length) != self.a.locked_path(req):
                raise Divergence(f"{req.rid}: row {self.a.row(req, length)} is not the "
                                 f"tree path {self.a.locked_path(req)}")
        self.reached["releases" if finish else "checkpoints"] += 1
        self.check(f"{req.rid} {'release' if finish else 'checkpoint'}({up_to}) p0={p0} "
                   f"L={length} swa_evicted={swa_evicted} healed={len(healed)}")


def scenario(seed: int, reached: Counter[str]) -> None:
    """Up to four requests sharing a prefix, interleaved chunk by chunk and step by
    step: chunked prefill (a checkpoint per chunk), decode (a window slide per token),
    finish (release). Raises ``Divergence`` (with the last steps) on the first problem."""
    rng = random.Random(seed)
    ps = rng.choice([1, 2, 4])
    window = rng.randint(1, 9)
    # Pools of 96 pages: the scenarios never run out, so nothing is evicted for room.
    cfg = SwaConfig(page_size=ps, full_slots=ps * 96, swa_slots=ps * 96, window=window)
    h = Harness(cfg, reached)
    try:
        base = tuple(rng.randint(1, 2) for _ in range(rng.randint(4, 24)))
        live: list[tuple[FakeReq, int]] = []  # request, total length
        for _ in range(rng.randint(1, 4)):
            prompt = base[:rng.randint(1, len(base))] + tuple(
                rng.randint(1, 3) for _ in range(rng.randint(0, 8)))
            total = len(prompt) + rng.randint(0, 14)
            tokens = prompt + tuple(rng.randint(1, 3) for _ in range(total - len(prompt)))
            live.append((h.admit(tokens, len(prompt)), total))
            for _ in range(rng.randint(1, 6)):
                if not live:
                    break
                i = rng.randrange(len(live))
                req, total = live[i]
                if req.extend_end < req.prompt_len:
                    # batch_result_processor.py: every prefill extend checkpoints.
                    end = min(req.prompt_len, req.extend_end + rng.randint(1, 8))
                    h.grow(req, end)
                    h.checkpoint(req, end)
                elif req.extend_end < total:
                    for _ in range(rng.randint(1, 6)):
                        if req.extend_end >= total:
                            break
                        h.grow(req, req.extend_end + 1)
                        # maybe_evict_swa passes seqlen - 1.
                        h.slide(req, req.extend_end - 1)
                else:
                    h.checkpoint(req, req.extend_end, finish=True)
                    live.pop(i)
        for req, _ in live:
            if req.extend_end < req.prompt_len:
                h.grow(req, req.prompt_len)
                h.checkpoint(req, req.prompt_len)
            h.checkpoint(req, req.extend_end, finish=True)
    except (Divergence, PreconditionError, IllegalChoice) as problem:
        trail = "\n    ".join(h.log[-6:])
        raise Divergence(f"seed {seed} P={ps} W={window}: {type(problem).__name__}: "
                         f"{problem}\n  trail:\n    {trail}") from problem
    finally:
        h.a.close()


def test_checkpoint_decode_and_release_refine_the_model() -> None:
    reached: Counter[str] = Counter()
    for seed in SEEDS:
        scenario(seed, reached)
    # What these seeds reach (counted when this test was written); a floor well under
    # those counts keeps the test from passing on scenarios that stopped reaching them.
    assert reached["checkpoints"] >= 100, reached
    assert reached["releases"] >= 50, reached
    assert reached["tombstone-making inserts"] >= 20, reached
    assert reached["healing inserts"] >= 3, reached
    assert reached["branching admissions"] >= 3, reached
    assert reached["decode frees"] >= 20, reached


def cursor_left_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint's out-of-window free frees the SWA halves but leaves the request's
    SWA cursor where it was: the insert is told too short an evicted prefix."""
    swa = importlib.import_module("sglang.srt.mem_cache.unified_cache.components.swa")
    original = swa.SWAComponent.free_out_of_window_slots

    def free_out_of_window_slots(self: Any, req: Any, pre_len: int,
                                 insert_params: Any) -> None:
        cursor = dict(req.kv.component_evicted_seqlens)
        original(self, req, pre_len, insert_params)
        req.kv.component_evicted_seqlens = cursor
        insert_params.set_evicted_seqlen(self.component_type,
                                         req.kv.get_evicted_seqlen(self.component_type))

    monkeypatch.setattr(swa.SWAComponent, "free_out_of_window_slots",
                        free_out_of_window_slots)


def test_a_checkpoint_that_leaves_the_cursor_behind_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cursor_left_behind(monkeypatch)
    # The tree's new nodes name SWA slots the free already returned: SGLang's own pool
    # balance and the machine's INV-SWA-SWA-POOL both see it.
    with pytest.raises(Divergence,
                       match=r"(?s)swa pool balance.*INV-SWA-SWA-POOL.*maps to None"):
        for seed in SEEDS:
            scenario(seed, Counter())
