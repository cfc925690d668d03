"""Run CrossHair over every model operation's contract, within a fixed budget.

Prints one line per condition (as CrossHair reports it), then a summary: conditions
analysed, counterexamples, wall time. Exits non-zero on any counterexample or crash.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

MODULES = [
    "hiradix_model.ops.match",
    "hiradix_model.ops.pool",
    "hiradix_model.ops.locks",
    "hiradix_model.ops.insert",
    "hiradix_model.ops.backup",
    "hiradix_model.ops.evict",
    "hiradix_model.ops.load",
    # The storage tier (spec/09): the operations with a plan, a report and a release.
    "hiradix_model.ops.storage.prefetch",
    "hiradix_model.ops.storage.io",
    "hiradix_model.ops.storage.progress",
    "hiradix_model.ops.storage.backup",
    # The (FULL, SWA) hybrid cache (spec/13).
    "hiradix_model.hybrid.pool",
    "hiradix_model.hybrid.insert",
    "hiradix_model.hybrid.match",
    "hiradix_model.hybrid.locks",
    "hiradix_model.hybrid.evict",
    "hiradix_model.hybrid.host",
    # The (FULL, MAMBA) cache (spec/13m).
    "hiradix_model.mamba.pool",
    "hiradix_model.mamba.insert",
    "hiradix_model.mamba.match",
    "hiradix_model.mamba.locks",
    "hiradix_model.mamba.evict",
    "hiradix_model.mamba.host",
    # LMCache's flat CPU and disk tiers (spec/15 15.5).
    "hiradix_model.flat.store",
    "hiradix_model.flat.lookup",
    "hiradix_model.flat.retrieve",
    "hiradix_model.flat.unpin",
    "hiradix_model.flat.clear",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--per-condition-timeout", type=float, default=4.0)
    parser.add_argument("--per-path-timeout", type=float, default=2.0)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="CrossHair processes, each over its share of the modules")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs: must be at least 1, got {args.jobs}")
    root = Path(__file__).resolve().parents[2]
    crosshair = Path(sys.executable).parent / "crosshair"
    shares = [MODULES[job::args.jobs] for job in range(min(args.jobs, len(MODULES)))]
    started = time.monotonic()
    # One process per share, all at once: CrossHair itself runs on one core, and each
    # condition's budget is its own, so splitting the modules changes no verdict.
    running = [subprocess.Popen(
        [str(crosshair), "check", "--extra_plugin", "tests/crosshair/plugin.py",
         f"--per_condition_timeout={args.per_condition_timeout}",
         f"--per_path_timeout={args.per_path_timeout}", "--report_all", *share],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for share in shares]
    finished = [(process, *process.communicate()) for process in running]
    elapsed = time.monotonic() - started
    reports = [line for _, stdout, _ in finished for line in stdout.splitlines()
               if ": info: " in line or ": error: " in line]
    errors = [line for line in reports if ": error: " in line]
    for line in reports:
        print(line.replace(str(root) + "/", ""))
    for process, stdout, stderr in finished:
        crashed = process.returncode not in (0, 1) or (
            process.returncode == 1 and ": error: " not in stdout)
        if crashed:
            print(stderr[-4000:], file=sys.stderr)
            print(f"crosshair: crashed (exit {process.returncode})")
            return 2
    print(f"crosshair: {len(reports)} conditions over {len(MODULES)} modules, "
          f"{len(errors)} counterexamples, {elapsed:.0f} s on {len(shares)} processes "
          f"(per condition {args.per_condition_timeout:g} s, per path {args.per_path_timeout:g} s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
