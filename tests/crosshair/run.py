"""Run CrossHair over every model operation's contract, within a fixed budget.

Prints one line per condition (as CrossHair reports it), then a summary: conditions
analysed, counterexamples, wall time. Exits non-zero on any counterexample or crash.
"""

from __future__ import annotations

import argparse
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
    # The (FULL, MAMBA) cache (spec/13m).
    "hiradix_model.mamba.pool",
    "hiradix_model.mamba.insert",
    "hiradix_model.mamba.match",
    "hiradix_model.mamba.locks",
    "hiradix_model.mamba.evict",
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
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[2]
    crosshair = Path(sys.executable).parent / "crosshair"
    command = [
        str(crosshair), "check",
        "--extra_plugin", "tests/crosshair/plugin.py",
        f"--per_condition_timeout={args.per_condition_timeout}",
        f"--per_path_timeout={args.per_path_timeout}",
        "--report_all",
        *MODULES,
    ]
    started = time.monotonic()
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, check=False)
    elapsed = time.monotonic() - started
    reports = [line for line in done.stdout.splitlines() if ": info: " in line
               or ": error: " in line]
    errors = [line for line in reports if ": error: " in line]
    for line in reports:
        print(line.replace(str(root) + "/", ""))
    if done.returncode not in (0, 1) or (done.returncode == 1 and not errors):
        print(done.stderr[-4000:], file=sys.stderr)
        print(f"crosshair: crashed (exit {done.returncode})")
        return 2
    print(f"crosshair: {len(reports)} conditions over {len(MODULES)} modules, "
          f"{len(errors)} counterexamples, {elapsed:.0f} s "
          f"(per condition {args.per_condition_timeout:g} s, per path {args.per_path_timeout:g} s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
