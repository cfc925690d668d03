"""``hiradix explore``: every reachable state of small scopes, on the model and on the
implementation (spec/14-exploration.md).

For each write policy x eviction strategy asked for: a breadth-first search of the
model (every invariant on every state), then, unless ``--model-only``, the exhaustive
refinement of the implementation (every request from every state it reaches; 14.4) or,
with ``--engine NAME``, of that engine through its adapter (14.8). Prints the figures of
each; on a finding prints the shortest path as a runnable reproducer and exits 1. A
command line that cannot run (an engine absent, a scope it does not take) is one line on
stderr and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from hiradix.conformance.explore.engine_refine import (
    RESTORES,
    Engine,
    EngineRefinement,
    Restore,
    open_engine,
    refine_engine,
)
from hiradix.conformance.explore.refine import refine
from hiradix.conformance.plots import PlotsUnavailable, pyplot
from hiradix.engines.protocol import EngineUnavailable
from hiradix_model.config import STRATEGIES, WRITE_POLICIES
from hiradix_model.explore import Figures, Scope, ScopeError, explore

OURS = "controlled"  # our implementation, its decisions recorded (lockstep.Pair)


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
    p.add_argument("--engine", default=OURS,
                   help=f"what is refined: '{OURS}' (our implementation, the default) or "
                        "any engine `hiradix check --engine` drives through its adapter "
                        "(spec/14 14.8; 'ours' is our cache through its adapter)")
    p.add_argument("--beyond-server", action="store_true",
                   help="--engine NAME: issue the requests its server never makes too")
    p.add_argument("--restore", choices=RESTORES, default=None,
                   help="--engine NAME: rebuild each state by replaying its path after "
                        "reset() (the default, where the adapter has reset) or on a fresh "
                        "adapter")
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


def _engines(args: argparse.Namespace, chosen: list[Scope]) -> list[Engine]:
    """The engine opened for each scope (usage errors raised before any search)."""
    if args.engine == OURS:
        if args.beyond_server or args.restore is not None:
            raise BadCommandLine(f"hiradix explore: --beyond-server and --restore need "
                                 f"--engine NAME (not {OURS})")
        return []
    opened: list[Engine] = []
    try:
        for scope in chosen:
            opened.append(open_engine(args.engine, scope, args.beyond_server))
            if args.restore != "fresh" and "reset" not in opened[-1].kept.operations:
                raise BadCommandLine(f"hiradix explore: --engine {args.engine} has no "
                                     "reset: use --restore fresh")
    except BaseException:
        for engine in opened:
            engine.close()
        raise
    return opened


def explore_main(argv: Sequence[str]) -> int:
    try:
        args = parser().parse_args(list(argv))
        if args.reproducer is not None and not args.reproducer.parent.is_dir():
            raise BadCommandLine(f"hiradix explore: --reproducer {args.reproducer}: "
                                 "its folder does not exist")
        if args.report is not None:
            if not args.report.is_dir():
                raise BadCommandLine(f"hiradix explore: --report {args.report}: not a folder")
            pyplot()
        chosen = scopes(args)
        engines = [] if args.model_only else _engines(args, chosen)
    except EngineUnavailable as unavailable:
        print(f"hiradix explore: --engine {args.engine}: {unavailable}", file=sys.stderr)
        return 2
    except (BadCommandLine, ScopeError, ValueError, PlotsUnavailable) as usage:
        message = str(usage)
        print(message if message.startswith("hiradix") else f"hiradix explore: {message}",
              file=sys.stderr)
        return 2
    try:
        return _run(args, chosen, engines)
    finally:
        for engine in engines:
            engine.close()


def _run(args: argparse.Namespace, chosen: list[Scope], engines: list[Engine]) -> int:
    total = 0
    drawn: list[tuple[str, Figures]] = []
    for number, asked in enumerate(chosen):
        engine = engines[number] if engines else None
        scope = asked if engine is None else engine.scope
        print(f"scope: {scope.describe()}")
        if scope != asked:
            print(f"  (the pools {args.engine} builds for device={asked.device_pages}p "
                  f"host={asked.host_pages}p; the model is explored on them too)")
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
        if engine is not None:
            found = _refine_engine(args, engine)
            if found is not None:
                return found
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


def _refine_engine(args: argparse.Namespace, engine: Engine) -> int | None:
    """The engine's refinement of one scope, printed; the exit status at a finding."""
    restore: Restore = "fresh" if args.restore == "fresh" else "reset"
    result: EngineRefinement = refine_engine(engine, restore=restore,
                                             max_states=args.max_states, seconds=args.seconds)
    steered = ", ".join(f"{kind} {name}" for name, kind in sorted(engine.steer.items()))
    print(f"  engine {engine.name} {engine.version}: "
          f"{result.figures.summary(result.mismatch is not None)}  "
          f"requests replayed: {result.requests}  restore: {restore}"
          + ("  (beyond the server's guards)" if engine.beyond_server else ""))
    print(f"  {result.not_expressible()}" + (f"; steered around: {steered}" if steered else ""))
    if result.mismatch is None:
        return None
    print(f"  FINDING (engine {engine.name}): {result.mismatch.reason}")
    return _found(result.mismatch.reproducer(engine), args.reproducer)


def _found(script: str, path: Path | None) -> int:
    print("reproducer (shortest path, breadth first):")
    print(script)
    if path is not None:
        path.write_text(script + "\n")
    return 1
