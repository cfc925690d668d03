"""``hiradix bench --large``: what a key costs from each form a caller may hold its tokens
in, alone and with the match it is built for (issue 29).

One long prompt (``LONG_PROMPT`` tokens, a 32 k context plus a page-sized margin) is
cached by ours; then, for each form, ``REPEATS`` rounds of: the form made fresh outside
the clock, its key timed, and a second fresh copy's key and match timed together. A
list or tuple is packed (one C pass that checks every token); a contiguous int64
``array('q')``, numpy array or CPU tensor is borrowed, read in place (keys.py).
"""

from __future__ import annotations

import statistics
import time
from array import array
from collections.abc import Callable

import numpy
import torch

from hiradix.bench.cache import Ours
from hiradix.keys import RadixKey

LONG_PROMPT = 33_792
REPEATS = 25

FORMS: dict[str, Callable[[array[int]], object]] = {
    "list": lambda tokens: tokens.tolist(),
    "tuple": lambda tokens: tuple(tokens),
    "array('q')": lambda tokens: array("q", tokens),
    "numpy int64": lambda tokens: numpy.array(tokens, dtype=numpy.int64),
    "torch int64": lambda tokens: torch.tensor(tokens, dtype=torch.int64),
}


def key_forms(page_size: int = 16, tokens: int = LONG_PROMPT,
              repeats: int = REPEATS) -> list[list[str]]:
    """Rows: form, key median µs, key+match median µs, tokens the match found."""
    prompt = array("q", range(1_000, 1_000 + tokens))
    ours = Ours(page_size, 2 * tokens, 2 * tokens)
    ours.serve(prompt)
    rows = []
    for name, make in FORMS.items():
        key_times, match_times, found = [], [], 0
        for _ in range(repeats):
            form = make(prompt)
            start = time.perf_counter()
            RadixKey(form)  # type: ignore[arg-type]
            key_times.append(time.perf_counter() - start)
            form = make(prompt)
            start = time.perf_counter()
            found = len(ours.cache.match_prefix(RadixKey(form)).device_slots)  # type: ignore[arg-type]
            match_times.append(time.perf_counter() - start)
        rows.append([name, f"{statistics.median(key_times) * 1e6:.1f}",
                     f"{statistics.median(match_times) * 1e6:.1f}", f"{found:,}"])
    return rows
