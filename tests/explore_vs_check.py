"""What the exhaustive refinement of a tiny scope finds that a sampled ``hiradix check``
misses, on bugs planted in our implementation (issue 32; tests/impl_mutants.py).

    .venv/bin/python tests/explore_vs_check.py [--check-seconds 60] [--only NAME]

For each mutant, with the bug planted in this process:

- explore: ``hiradix.conformance.explore.refine`` on the mutant's scope (every request
  from every state the implementation reaches; a crash of the implementation counts as
  a finding at its request); found or not, the length of the shortest failing request
  path, seconds.
- check: ``hiradix check`` through its ``main`` (so the patch applies), engine
  ``controlled``, ``--seconds S``, a fixed ``--seed``, ``--database none``,
  ``--storage none``, and ``--page-sizes`` / ``--policies`` / ``--strategies`` the
  scope's; found or not, the seconds to the first failing example and to the exit.

First, once, the unpatched implementation must pass both: every scope used, and one
check over the policies and strategies used. Then a table, and the count of mutants
found by explore and missed by the check.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from impl_mutants import FAMILY, MUTANTS, Mutant, Search, explore_refinement

from hiradix import cli
from hiradix_model.explore import Scope

SEED = 1

# What `hiradix check` draws (impl/hiradix/conformance/machine.py and scenario.py), none of
# which a command-line option narrows: only page size, policy, strategy, host layout, KV
# layout and storage tier are options.
CHECK_DRAWS = (
    "hiradix check cannot be narrowed to a scope's pools or keys: it builds 6 device pages "
    "and, per example, 8, 2, 3 or 5 host pages (machine.host_size), and draws keys of up "
    "to 14 tokens over {1, 2, 3} in namespaces None and 'b' (machine.keys_for, "
    "namespaces); it runs as users run it, restricted only to the scope's page size, "
    "write policy and strategy (both host layouts, MHA and MLA); of --seconds, 75% goes "
    "to this machine, 10% to the rank campaign (also our cache, so also mutated) and 15% "
    "to the hybrid caches (not mutated)")


@dataclass(frozen=True)
class CheckRun:
    """One ``hiradix check`` in process."""

    status: int  # its exit status (1: a failure; 0: none)
    first_failure: float | None  # seconds to the first failing example of the machine
    seconds: float  # to its exit (shrinking and printing included)
    failure: str  # the FAILED line and the one after it, or ""


class _Clock:
    """When the first example failed: ``hiradix check`` notes it on its ``Watch``."""

    started = 0.0
    first: float | None = None


class _TimedWatch(cli.Watch):
    """``cli.Watch``, timing the first failure (the check prints no time of its own)."""

    @property  # type: ignore[override]
    def failed(self) -> bool:
        return self.__dict__.get("_failed", False)  # type: ignore[no-any-return]

    @failed.setter
    def failed(self, value: bool) -> None:
        if value and _Clock.first is None:
            _Clock.first = time.monotonic() - _Clock.started
        self.__dict__["_failed"] = value


@contextlib.contextmanager
def _timed_watch() -> Iterator[None]:
    real = cli.Watch
    cli.Watch = _TimedWatch  # type: ignore[misc]
    try:
        yield
    finally:
        cli.Watch = real  # type: ignore[misc]


def check_argv(seconds: float, policies: Sequence[str], strategies: Sequence[str],
               page_size: int = 1) -> list[str]:
    return ["check", "--engine", "controlled", "--seconds", f"{seconds:g}",
            "--seed", str(SEED), "--database", "none", "--storage", "none",
            "--page-sizes", str(page_size), "--policies", ",".join(policies),
            "--strategies", ",".join(strategies)]


def run_check(argv: list[str], log: Path | None) -> CheckRun:
    """``hiradix check`` with ``argv``, its output kept (written to ``log`` if given)."""
    out = io.StringIO()
    _Clock.first = None
    _Clock.started = time.monotonic()
    with _timed_watch(), contextlib.redirect_stdout(out):
        status = cli.main(argv)
    seconds = time.monotonic() - _Clock.started
    text = out.getvalue()
    if log is not None:
        log.write_text(" ".join(["hiradix", *argv]) + "\n\n" + text)
    lines = [line for line in text.splitlines() if line.strip()]
    failure = ""
    for number, line in enumerate(lines):
        if line.startswith("FAILED"):
            failure = " / ".join(lines[number:number + 2])
            break
    return CheckRun(status, _Clock.first, seconds, failure)


def scope_label(scope: Scope) -> str:
    keys = "siblings" if scope.max_key_tokens == 1 else "path"
    policy = {"write_through": "wt", "write_through_selective": "wts",
              "write_back": "wb"}[scope.write_policy]
    return f"{scope.device_pages}d{scope.host_pages}h {keys} {policy}/{scope.eviction}"


@dataclass(frozen=True)
class Row:
    mutant: Mutant
    explore: Search
    check: CheckRun

    @property
    def explore_found(self) -> bool:
        return self.explore.mismatch is not None

    @property
    def check_found(self) -> bool:
        return self.check.status == 1


def baseline(scopes: list[Scope], check_seconds: float, logs: Path | None) -> bool:
    """The unpatched implementation passes every scope and one check over the policies
    and strategies the scopes use; prints each; False if anything failed."""
    ok = True
    print("unpatched implementation:")
    for scope in scopes:
        search = explore_refinement(scope)
        passed = search.mismatch is None and search.complete
        ok &= passed
        print(f"  explore {scope_label(scope):<24} states {search.states:>4}  "
              f"{'complete, no finding' if passed else 'FAILED'}  {search.seconds:.1f} s")
    policies = sorted({s.write_policy for s in scopes})
    strategies = sorted({s.eviction for s in scopes})
    argv = check_argv(check_seconds, policies, strategies)
    run = run_check(argv, None if logs is None else logs / "unpatched.txt")
    ok &= run.status == 0
    print(f"  check   {' '.join(argv[1:])}\n          exit {run.status}  {run.seconds:.1f} s"
          + (f"  {run.failure}" if run.failure else ""))
    return ok


def compare(mutant: Mutant, check_seconds: float, logs: Path | None) -> Row:
    with mutant.planted():
        search = explore_refinement(mutant.scope)
        scope = mutant.scope
        argv = check_argv(check_seconds, [scope.write_policy], [scope.eviction],
                          scope.page_size)
        run = run_check(argv, None if logs is None else logs / f"{mutant.name}.txt")
    return Row(mutant, search, run)


def table(rows: list[Row], check_seconds: float) -> str:
    head = (f"| mutant | kind | scope | explore found? | depth | explore s | "
            f"check ({check_seconds:g} s) found? | s to failure (to exit) |")
    lines = [head, "|" + "---|" * 8]
    for row in rows:
        found = row.explore.mismatch
        check = row.check
        when = ("-" if not row.check_found else
                f"{check.first_failure:.1f} ({check.seconds:.1f})"
                if check.first_failure is not None else f"- ({check.seconds:.1f})")
        lines.append(
            f"| {row.mutant.name} | {row.mutant.kind} | {scope_label(row.mutant.scope)} | "
            f"{'yes' if found else 'no'} | {len(found.path) if found else '-'} | "
            f"{row.explore.seconds:.1f} | {'yes' if row.check_found else 'no'} | {when} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check-seconds", type=float, default=60.0)
    parser.add_argument("--only", action="append", default=None, metavar="NAME",
                        help="this mutant only (repeatable)")
    parser.add_argument("--skip-baseline", action="store_true",
                        help="do not first run the unpatched implementation")
    parser.add_argument("--logs", type=Path, default=None, metavar="DIR",
                        help="write each check's full output here")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if args.only is None or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutant(s) {sorted(unknown)}; one of "
                     f"{[m.name for m in MUTANTS]}")
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
    print(f"scope family: {FAMILY}")
    print(f"check: {CHECK_DRAWS}")
    print(f"check options: {' '.join(check_argv(args.check_seconds, ['POLICY'], ['STRATEGY']))}")
    print()
    if not args.skip_baseline:
        scopes = sorted({m.scope for m in chosen}, key=scope_label)
        if not baseline(scopes, args.check_seconds, args.logs):
            print("the unpatched implementation failed: no comparison")
            return 1
        print()
    rows = []
    for mutant in chosen:
        row = compare(mutant, args.check_seconds, args.logs)
        rows.append(row)
        found = row.explore.mismatch
        print(f"{mutant.name} ({scope_label(mutant.scope)}): {mutant.summary}")
        print("  explore: " + (f"found at depth {len(found.path)} in "
                                f"{row.explore.seconds:.1f} s: "
                                f"{found.reason.splitlines()[0][:160]}" if found else
                                f"{'complete' if row.explore.complete else 'INCOMPLETE'}, "
                                f"{row.explore.states} states, no finding in "
                                f"{row.explore.seconds:.1f} s"))
        if mutant.blind and not found:
            print(f"           (expected: {mutant.blind})")
        print(f"  check:   exit {row.check.status} after {row.check.seconds:.1f} s"
              + (f"; first failing example at {row.check.first_failure:.1f} s"
                 if row.check.first_failure is not None else "")
              + (f": {row.check.failure[:200]}" if row.check.failure else ""), flush=True)
    print()
    print(table(rows, args.check_seconds))
    missed = [r.mutant.name for r in rows if r.explore_found and not r.check_found]
    unseen = [r.mutant.name for r in rows if r.check_found and not r.explore_found]
    print()
    print(f"found by explore, missed by a {args.check_seconds:g} s check: {len(missed)} of "
          f"{len(rows)}" + (f" ({', '.join(missed)})" if missed else ""))
    print(f"found by the check, missed by explore: {len(unseen)} of {len(rows)}"
          + (f" ({', '.join(unseen)})" if unseen else ""))
    print(f"found by both: {sum(r.explore_found and r.check_found for r in rows)}; "
          f"by neither: {sum(not r.explore_found and not r.check_found for r in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
