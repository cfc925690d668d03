"""Pictures of a campaign and of the benchmark (``hiradix check --report DIR``, ``hiradix
bench --plot FILE``), drawn with matplotlib, an optional extra (``pip install
'hiradix[plots]'``): without it the flags are a usage error, never a silent skip.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hiradix.conformance.tally import Tally

INSTALL = "pip install 'hiradix[plots]' (matplotlib)"
WINDOW = 50  # requests per point of the hit-rate curves


class PlotsUnavailable(RuntimeError):
    """matplotlib is not installed; the message says what to install."""


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only Agg backend (no screen here or in CI)."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError as missing:
        raise PlotsUnavailable(f"plots need matplotlib: {INSTALL}") from missing
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


def hit_rates(hits: Sequence[tuple[int, int, int]], window: int = WINDOW
              ) -> tuple[list[int], list[float], list[float]]:
    """Per window of ``window`` requests (in order): the index of its last request, and the
    share of asked tokens hit on device and (host-only) on host."""
    ends: list[int] = []
    device: list[float] = []
    host: list[float] = []
    for start in range(0, len(hits), window):
        chunk = hits[start:start + window]
        asked = sum(h[0] for h in chunk) or 1
        ends.append(start + len(chunk))
        device.append(sum(h[1] for h in chunk) / asked)
        host.append(sum(h[2] for h in chunk) / asked)
    return ends, device, host


def _bars(axis: Any, counts: dict[str, int], title: str) -> None:
    names = list(counts)
    axis.barh(names, [counts[n] for n in names], color="#4c72b0")
    axis.set_title(title)
    axis.set_xscale("symlog")
    axis.tick_params(axis="y", labelsize=7)
    axis.invert_yaxis()


def write_check_report(tally: Tally, directory: str, invariants: Iterable[str],
                       states: Iterable[str]) -> list[Path]:
    """``hits.png`` (hit rate per tier over the campaign's requests) and ``coverage.png``
    (steps per invariant with work, per coverage state, executions per rule)."""
    plt = pyplot()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    figure, axis = plt.subplots(figsize=(9, 4))
    ends, device, host = hit_rates(tally.hits)
    axis.plot(ends, device, label="device", color="#55a868")
    axis.plot(ends, host, label="host only (loaded back)", color="#dd8452")
    axis.set_xlabel(f"requests served (points: windows of {WINDOW})")
    axis.set_ylabel("share of asked tokens hit")
    axis.set_ylim(0, 1)
    axis.set_title(f"hit rate per tier, {len(tally.hits)} requests")
    axis.legend()
    figure.tight_layout()
    written.append(out / "hits.png")
    figure.savefig(written[-1], dpi=110)
    plt.close(figure)
    figure, axes = plt.subplots(1, 3, figsize=(16, 7))
    _bars(axes[0], {i: tally.exercised[i] for i in invariants}, "steps with work, per invariant")
    _bars(axes[1], {s: tally.states[s] for s in states}, "steps per coverage state")
    _bars(axes[2], dict(sorted(tally.rules.items())), "executions per rule")
    figure.tight_layout()
    written.append(out / "coverage.png")
    figure.savefig(written[-1], dpi=110)
    plt.close(figure)
    return written


def write_bench_plot(rows: Sequence[tuple[int, str, str, float, float]], path: str) -> Path:
    """One panel per page size: median µs per call of each operation, ours beside each
    engine (``rows``: page size, operation, engine, ours µs, theirs µs)."""
    plt = pyplot()
    pages = sorted({r[0] for r in rows})
    figure, axes = plt.subplots(1, len(pages), figsize=(7 * len(pages), 4.5), squeeze=False)
    for axis, page in zip(axes[0], pages, strict=True):
        mine = [r for r in rows if r[0] == page]
        operations = list(dict.fromkeys(r[1] for r in mine))
        engines = list(dict.fromkeys(r[2] for r in mine))
        width = 0.8 / (len(engines) + 1)
        ours = {r[1]: r[3] for r in mine}
        axis.bar([i for i in range(len(operations))], [ours[o] for o in operations], width,
                 label="ours")
        for j, engine in enumerate(engines, start=1):
            theirs = {r[1]: r[4] for r in mine if r[2] == engine}
            axis.bar([i + j * width for i in range(len(operations))],
                     [theirs.get(o, 0.0) for o in operations], width, label=engine)
        axis.set_xticks([i + width * len(engines) / 2 for i in range(len(operations))],
                        operations)
        axis.set_ylabel("median µs per call (lower is faster)")
        axis.set_title(f"page size {page}")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return Path(path)
