"""``hiradix explore``: every reachable state of small scopes, on the model and on the
implementation (spec/14-exploration.md).

For each write policy x eviction strategy asked for: a breadth-first search of the
model (every invariant on every state), then, unless ``--model-only``, the exhaustive
refinement of the implementation (every request from every state it reaches). Prints
the figures of each; on a finding prints the shortest path as a runnable reproducer and
exits 1. A command line that cannot run is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from hiradix.conformance.explore.refine import refine
from hiradix.conformance.plots import PlotsUnavailable, pyplot
from hiradix_model.config import STRATEGIES, WRITE_POLICIES
from hiradix_model.explore import Figures, Scope, ScopeError, explore


class BadCommandLine(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise BadCommandLine(f"hiradix explore: {message}")


def _ints(value: str) -> tuple[int, ...]:
    return tuple(int(v) for v in value.split(","))


def _names(value: str) -> tuple[str | None, ...]:
    return tuple(None if v == "none" else v for v in value.split(","))


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hiradix explore", description=__doc__.splitlines()[0])
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--device-pages", type=int, default=2)
    p.add_argument("--host-pages", type=int, default=1)
    p.add_argument("--alphabet", type=_ints, default=(1, 2), help="token ids, e.g. 1,2")
    p.add_argument("--max-key-tokens", type=int, default=1)
    p.add_argument("--namespaces", type=_names, default=(None,),
                   help="comma-separated; 'none' is the default namespace")
    p.add_argument("--policies", type=lambda v: v.split(","), default=["write_through"],
                   help=f"write policies, comma-separated, or 'all' ({', '.join(WRITE_POLICIES)})")
    p.add_argument("--strategies", type=lambda v: v.split(","), default=["lru"],
                   help=f"eviction strategies, comma-separated, or 'all' ({', '.join(STRATEGIES)})")
    p.add_argument("--max-in-flight", type=int, default=2, help="copies in flight (a bound)")
    p.add_argument("--max-locks", type=int, default=1, help="caller locks per page (a bound)")
    p.add_argument("--max-hits", type=int, default=3, help="LFU only: hits per page (a bound)")
    p.add_argument("--max-held-pages", type=int, default=None,
                   help="device pages callers hold uninserted (a bound; default: any)")
    p.add_argument("--no-partial-inserts", action="store_true",
                   help="offer insert's counted_from 0 and chunked only")
    p.add_argument("--priorities", type=_ints, default=(0,), help="insert priorities offered")
    p.add_argument("--threshold-pages", type=int, default=1, help="load_back_threshold, pages")
    p.add_argument("--seconds", type=float, default=None, help="budget per scope and stage")
    p.add_argument("--max-states", type=int, default=None, help="budget per scope and stage")
    p.add_argument("--model-only", action="store_true", help="skip the implementation")
    p.add_argument("--engine", default="ours",
                   help="the implementation under refinement; only 'ours' so far")
    p.add_argument("--reproducer", type=Path, default=None, metavar="FILE",
                   help="write the reproducer of a finding here")
    p.add_argument("--report", type=Path, default=None, metavar="DIR",
                   help="write explore-depths.png here: states per depth of each scope "
                        "(needs matplotlib: pip install 'hiradix[plots]')")
    return p


def write_report(directory: Path, rows: list[tuple[str, Figures]]) -> Path:
    """One line per scope: new states at each depth of its model search (log scale)."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(8, 4.5))
    for label, figures in rows:
        axis.plot(range(len(figures.per_depth)), figures.per_depth, marker="o", label=label)
    axis.set_yscale("log")
    axis.set_xlabel("depth (operations from the empty cache)")
    axis.set_ylabel("new states")
    axis.set_title("hiradix explore: states per depth")
    axis.legend(fontsize=7)
    path = directory / "explore-depths.png"
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def scopes(args: argparse.Namespace) -> list[Scope]:
    """One scope per write policy x strategy asked for; ``ScopeError`` on a bad field."""
    policies = list(WRITE_POLICIES) if args.policies == ["all"] else args.policies
    strategies = list(STRATEGIES) if args.strategies == ["all"] else args.strategies
    return [Scope(page_size=args.page_size, device_pages=args.device_pages,
                  host_pages=args.host_pages, alphabet=args.alphabet,
                  max_key_tokens=args.max_key_tokens, namespaces=args.namespaces,
                  write_policy=policy, eviction=strategy, max_in_flight=args.max_in_flight,
                  max_locks=args.max_locks, max_hits=args.max_hits,
                  max_held_pages=args.max_held_pages,
                  partial_inserts=not args.no_partial_inserts, priorities=args.priorities,
                  load_back_threshold_pages=args.threshold_pages)
            for policy in policies for strategy in strategies]


def _depths(figures: Figures) -> str:
    return "states per depth: " + " ".join(map(str, figures.per_depth))


def explore_main(argv: Sequence[str]) -> int:
    try:
        args = parser().parse_args(list(argv))
        if args.engine != "ours":
            raise BadCommandLine(f"hiradix explore: --engine {args.engine}: only 'ours' is "
                                 "explored so far (engine adapters: open, issue 32)")
        if args.reproducer is not None and not args.reproducer.parent.is_dir():
            raise BadCommandLine(f"hiradix explore: --reproducer {args.reproducer}: "
                                 "its folder does not exist")
        if args.report is not None:
            if not args.report.is_dir():
                raise BadCommandLine(f"hiradix explore: --report {args.report}: not a folder")
            pyplot()
        chosen = scopes(args)
    except (BadCommandLine, ScopeError, ValueError, PlotsUnavailable) as usage:
        print(usage, file=sys.stderr)
        return 2
    total = 0
    drawn: list[tuple[str, Figures]] = []
    for scope in chosen:
        print(f"scope: {scope.describe()}")
        model = explore(scope, max_states=args.max_states, seconds=args.seconds)
        print(f"  model:          {model.figures.summary(model.finding is not None)}")
        print(f"  {_depths(model.figures)}")
        total += model.figures.states
        drawn.append((f"{scope.write_policy}/{scope.eviction}", model.figures))
        if model.finding is not None:
            print("  FINDING (model): " + "; ".join(
                f"{k}: {v[0]}" for k, v in model.finding.problems.items()))
            return _found(model.finding.reproducer(scope), args.reproducer)
        if args.model_only:
            continue
        impl = refine(scope, max_states=args.max_states, seconds=args.seconds)
        print(f"  implementation: {impl.figures.summary(impl.mismatch is not None)}  "
              f"requests replayed: {impl.requests}")
        if impl.mismatch is not None:
            print(f"  FINDING (implementation): {impl.mismatch.reason}")
            return _found(impl.mismatch.reproducer(scope), args.reproducer)
    print(f"scopes: {len(chosen)}  model states in total: {total}")
    if args.report is not None:
        print(f"report: {write_report(args.report, drawn)}")
    return 0


def _found(script: str, path: Path | None) -> int:
    print("reproducer (shortest path, breadth first):")
    print(script)
    if path is not None:
        path.write_text(script + "\n")
    return 1
