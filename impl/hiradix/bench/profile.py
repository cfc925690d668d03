"""``hiradix bench --profile``: where ours spends each operation's time (issue 13).

The bench's request stream served by ours alone (no SGLang needed), with cProfile on
around each timed call, one profile per operation. Each function's own time is summed
into the kinds of cost issue 13 asked about; alongside, the torch kernels and the C
bookkeeping calls per operation call. A kernel here is a torch function or tensor
method that does work: reads of a shape, a stride or a data pointer are not counted.

cProfile charges each Python call more than a builtin one, so the shares lean towards
Python code and the times per call are inflated; the counts per call are exact.
"""

from __future__ import annotations

import cProfile
import pstats
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from hiradix.bench.cache import (
    DEVICE_TOKENS,
    HOST_TOKENS,
    OPS,
    Ours,
    Timings,
    request_stream,
    table,
)

# The timed calls, one profile each: the match_prefix row's two parts, key and match, on
# their own (its samples are their sums, profiled as those parts).
PROFILED = ("key", "match", *(op for op in OPS if op not in ("key", "match_prefix")))

#  (file name, function name) of one pstats entry; builtins have the file "~".
Where = tuple[str, str]

ACCESSORS = ("'stride'", "'dim'", "'data_ptr'", "'numel'", "'element_size'", "'size'",
             "'is_contiguous'", "_has_torch_function", "_get_tracing_state")
BOOKKEEPING = frozenset({"_refresh", "_refresh_around", "_add_lock", "_count", "_set_device",
                         "_set_host", "_drop_device_copy", "_detach", "_now", "_emit"})
WALK = frozenset({"match_prefix", "_walk", "_descend"})


def _validation(file: str, name: str) -> bool:
    return (file.endswith("cache.py") and name.startswith(
        ("_require", "_check", "_own_prefix", "_caller_pages", "_explain"))) \
        or file.endswith("errors.py")


# In order: an entry counts for the first kind it matches.
KINDS: tuple[tuple[str, Callable[[str, str], bool]], ...] = (
    ("validation", _validation),
    ("walk+split", lambda f, n: (f.endswith("cache.py") and n in WALK)
     or f.endswith(("tree.py", "keys.py"))),
    ("bookkeeping", lambda f, n: f.endswith("cache.py") and n in BOOKKEEPING),
    ("evict heap", lambda f, n: f.endswith("policies.py") or "heapq" in n),
    ("allocators", lambda f, n: f.endswith(("_slots.py", "device_pool.py"))),
    ("host copies", lambda f, n: f.endswith(("host_pool.py", "transfer.py"))),
    ("C loops", lambda f, n: "_pagebits" in n or "_tokens" in n),
    ("torch", lambda f, n: "torch" in n or "Tensor" in n or "/torch/" in f),
)
OTHER = "body"
LEGEND = ("validation: the checks of caller input; walk+split: match and insert's walk, "
          "splits, keys; bookkeeping: leaf-set refresh, locks, counters, ownership; evict "
          "heap: the eviction order; allocators, host copies: their Python side; C loops: "
          "hiradix._pagebits and hiradix._tokens; torch: torch calls; body: the "
          "operation's own lines and Python builtins")


def kind(where: Where) -> str:
    file, name = where
    for label, matches in KINDS:
        if matches(file, name):
            return label
    return OTHER


class ProfiledTimings(Timings):
    """``Timings`` that also profiles each timed call, one profile per operation."""

    def __init__(self) -> None:
        super().__init__()
        self.profiles: dict[str, cProfile.Profile] = {}

    def timed(self, op: str, call: Callable[[], Any]) -> Any:
        profile = self.profiles.setdefault(op, cProfile.Profile())
        profile.enable()
        try:
            return super().timed(op, call)
        finally:
            profile.disable()


def breakdown(page_size: int, scale: float, seed: int) -> list[tuple[str, int, dict[str, float],
                                                                      float, float, float]]:
    """Per operation: (name, calls, share of own time per kind, µs per call under
    cProfile, torch kernels per call, C calls per call)."""
    stream = request_stream(seed, scale)
    ours = Ours(page_size, DEVICE_TOKENS, HOST_TOKENS)
    timings = ProfiledTimings()
    ours.t = timings
    for request in stream:
        ours.serve(request)
    result = []
    for op in PROFILED:
        profile = timings.profiles.get(op)
        calls = timings.calls(op)
        if profile is None or not calls:
            continue
        own: Counter[str] = Counter()
        kernels = native = 0
        stats: dict[tuple[str, int, str], tuple[Any, ...]] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        for (file, _, name), (_, count, seconds, *_) in stats.items():
            if file.endswith("bench.py") or name in ("<lambda>", "<method 'disable' of "
                                                     "'_lsprof.Profiler' objects>"):
                continue  # the bench's own timing, not the operation
            label = kind((file, name))
            own[label] += seconds
            if label == "torch" and file == "~" and not any(a in name for a in ACCESSORS):
                kernels += count
            elif label == "C loops":
                native += count
        total = sum(own.values())
        if total == 0:
            continue
        result.append((op, calls, {label: seconds / total for label, seconds in own.items()},
                       total / calls * 1e6, kernels / calls, native / calls))
    return result


def report(page_sizes: list[int], scale: float, seed: int) -> Iterator[str]:
    """The breakdown as one table per page size."""
    labels = [label for label, _ in KINDS] + [OTHER]
    for page_size in page_sizes:
        rows = []
        for op, calls, shares, micros, kernels, native in breakdown(page_size, scale, seed):
            rows.append([op, f"{calls}", f"{micros:,.1f}", f"{kernels:.1f}", f"{native:.1f}",
                         *(f"{100 * shares.get(label, 0.0):.0f}" for label in labels)])
        yield f"Profile of ours, page size {page_size} (% of each operation's own time):"
        yield from table(rows, ["operation", "calls", "µs/call", "torch kernels/call",
                                "C calls/call", *labels])
        yield ""
    yield (f"(seed {seed}, scale {scale}; µs/call under cProfile, which inflates Python "
           "calls more than builtin ones: shares lean towards Python code, the counts are "
           "exact; a kernel is a torch call that does work, not a read of a shape, stride "
           f"or pointer; {LEGEND})")
