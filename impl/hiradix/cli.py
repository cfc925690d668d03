"""``hiradix check``: the conformance state machine against the implementation;
``hiradix replay TRACE``: a recorded trace against the model.

Runs the machine over a matrix of configurations for a budget (seconds or examples),
with a progress bar on a terminal, then prints what was run: examples, steps,
operations by kind, the configurations covered and, per invariant, how many checked
steps gave it something to check. On a failure it prints the shrunk reproducer as a
runnable script (and writes it with ``--reproducer``) and exits 1.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from unittest import SkipTest

import torch
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    InMemoryExampleDatabase,
)
from hypothesis.reporting import with_reporter
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test

from hiradix.bench.cache import add_arguments as bench_arguments
from hiradix.bench.cache import main as bench_main
from hiradix.conformance.batches import ComponentCampaign
from hiradix.conformance.coverage import COVERAGE, STORAGE_ONLY
from hiradix.conformance.differential import make_differential
from hiradix.conformance.explore.cli import explore_main
from hiradix.conformance.machine import EXERCISED, SWARM_RULES, Tally, make_machine
from hiradix.conformance.outputs import (
    BadCommandLine,
    OneLineParser,
    UnwritableOutput,
    check_directory,
    check_file,
)
from hiradix.conformance.plots import PlotsUnavailable, pyplot, write_check_report
from hiradix.conformance.rank_campaign import (
    RankCampaign,
    describe,
    failure_report,
    run_rank_campaign,
)
from hiradix.conformance.ranks import RANK_INVARIANTS
from hiradix.conformance.results import CampaignResult, CheckResults, counts, write_results
from hiradix.conformance.scenario import Scenario
from hiradix.conformance.show import show_main
from hiradix.conformance.storage_machine import STORAGE_SWARM_RULES, make_storage_machine
from hiradix.conformance.tally import TimeUp
from hiradix.engines import (
    BUILT_IN,
    ComponentEngine,
    EngineError,
    EngineUnavailable,
    cache_engine,
    lookup,
    scenario_space,
    server_space,
)
from hiradix.policies import STRATEGIES, WRITE_POLICIES
from hiradix_model import initial, trace

DEFAULT_PAGE_SIZES = (1, 2, 4, 16)
# The largest page the checker's pools (6 to 12 pages of KV) are built for: far larger
# ones would allocate gigabytes before the first step.
MAX_PAGE_SIZE = 4096
# A failure found in a batch the budget cut short is replayed without shrinking, for at
# most as long as the batch had run, or this (seconds), whichever is longer.
REPLAY_MIN_SECONDS = 5.0


COPY_ENGINES = ("controlled", "cuda")  # ours, through the full conformance machine
# The share of a controlled campaign's budget its rank campaign takes (spec/12 12.7), and
# its runs per example under --examples. A lockstep run of 60 steps takes about 0.1 s.
RANK_SHARE = 0.1
EXAMPLES_PER_RANK_RUN = 50
# The share of a controlled campaign's budget the hybrid campaigns of ours take, half
# (FULL, SWA) (spec/13), half (FULL, MAMBA) (spec/13m), their examples per machine example
# under --examples, and the largest page they draw (requests are up to 16 tokens).
HYBRID_SHARE = 0.15
EXAMPLES_PER_HYBRID_EXAMPLE = 4
HYBRID_MAX_PAGE = 4


STORAGE = (None, "memory", "file")  # ours: no tier, or a tier over this backend
STORAGE_NAMES = ("none", "memory", "file")  # --storage's spelling of STORAGE


def matrix(page_sizes: Sequence[int], policies: Sequence[str], strategies: Sequence[str],
           engine: str, device: str,
           storage: Sequence[str] = STORAGE_NAMES, beyond_server: bool = False
           ) -> list[Scenario]:
    """Every combination the engine takes -- and, unless ``beyond_server``, its own server
    can run -- in an order that varies every axis early; ``storage`` names the tiers
    asked for (ours only)."""
    space = {} if engine in COPY_ENGINES else scenario_space(engine)
    if not beyond_server:
        space = {**space, **server_values(engine, space)}
    layouts = space.get("host_layout", ("layer_first", "page_first"))
    kinds = space.get("kv_layout", ("mha", "mla"))
    # The storage tier is ours only: an engine's tier would need an adapter of its own.
    tiers = tuple(tier for tier, name in zip(STORAGE, STORAGE_NAMES, strict=True)
                  if name in storage) if engine in COPY_ENGINES else (None,)
    axes = ("page_size", "write_policy", "eviction", "host_layout", "kv_layout", "storage")
    combos = [c for c in itertools.product(page_sizes, policies, strategies, layouts, kinds,
                                           tiers)
              if all(value in space.get(axis, (value,))
                     for axis, value in zip(axes, c, strict=True))]
    random.Random(0).shuffle(combos)
    copies = engine if engine in COPY_ENGINES else "controlled"
    return [Scenario(page_size=ps, write_policy=policy, eviction=strategy,  # type: ignore[arg-type]
                     host_layout=host, kv_layout=kv, engine=copies, device=device,  # type: ignore[arg-type]
                     storage=tier)  # type: ignore[arg-type]
            for ps, policy, strategy, host, kv, tier in combos]


def server_values(engine: str, space: Mapping[str, tuple[object, ...]]
                         ) -> dict[str, tuple[object, ...]]:
    """``space`` narrowed, axis by axis, to what the engine's server can run."""
    server = {} if engine in COPY_ENGINES else server_space(engine)
    return {axis: tuple(v for v in space.get(axis, values) if v in values)
            for axis, values in server.items()}


def outside_server(args: argparse.Namespace) -> list[str]:
    """The strategies asked for that the engine's server does not take (not run unless
    ``--beyond-server``): one line's worth for the summary."""
    if args.beyond_server or args.engine in COPY_ENGINES:
        return []
    server = server_space(args.engine).get("eviction")
    return [] if server is None else [s for s in args.strategies if s not in server]


def machine_for(engine: str, scenario: Scenario, tally: Tally,
                beyond_server: bool = False) -> type[RuleBasedStateMachine]:
    if engine in COPY_ENGINES:
        if scenario.storage is not None:
            return make_storage_machine(scenario, tally, tally.faults)
        return make_machine(scenario, tally)
    entry = cache_engine(engine)
    if entry.machine is not None:  # the engine's API needs a machine of its own
        return entry.machine(scenario, tally)
    return make_differential(entry.factory(scenario), tally, beyond_server)


def reproducer(scenario: Scenario, report: list[str], engine: str = "controlled") -> str:
    steps = [line.strip() for line in report
             if line.strip().startswith("state.") and "teardown" not in line]
    if engine in COPY_ENGINES and scenario.storage is not None:
        header = ["from hiradix.conformance.scenario import Scenario",
                  "from hiradix.conformance.storage_machine import make_storage_machine",
                  "from hiradix.storage.tier import TierSettings", "",
                  f"Machine = make_storage_machine({scenario!r})", "state = Machine()",
                  "state.refines_the_model()"]
    elif engine in COPY_ENGINES:
        header = ["from hiradix.conformance.machine import make_machine",
                  "from hiradix.conformance.scenario import Scenario", "",
                  f"Machine = make_machine({scenario!r})", "state = Machine()",
                  "state.refines_the_model()"]
    elif cache_engine(engine).machine is not None:
        header = ["from hiradix.conformance.scenario import Scenario",
                  "from hiradix.engines import cache_engine",
                  "from hiradix_model import StorageSettings", "",
                  f"Machine = cache_engine({engine!r}).machine({scenario!r}, None)",
                  "state = Machine()", "state.engine_refines_the_model()"]
    else:
        header = ["from hiradix.engines import factory",
                  "from hiradix.conformance.differential import make_differential",
                  "from hiradix.conformance.scenario import Scenario", "",
                  f"Machine = make_differential(factory({engine!r}, {scenario!r}))",
                  "state = Machine()", "state.engine_refines_the_model()"]
    lines = [
        "# Reproducer written by `hiradix check`: run it with python.",
        *header,
        *steps,
        "state.teardown()",
        'print("no failure reproduced")',
    ]
    return "\n".join(lines) + "\n"


class ScopedDatabase(ExampleDatabase):
    """``inner`` with every key prefixed by ``scope``. Hypothesis keys a state machine's
    examples by the source of its class, which is the same for every configuration
    (``make_machine`` builds them all from one class body): without a scope, an example
    saved for one configuration (a failure, or the pareto front of ``target()``) is
    replayed in another, where the same choices draw differently."""

    def __init__(self, inner: ExampleDatabase, scope: str) -> None:
        super().__init__()
        self.inner = inner
        self.scope = scope.encode() + b"/"

    def save(self, key: bytes, value: bytes) -> None:
        self.inner.save(self.scope + key, value)

    def fetch(self, key: bytes) -> Iterable[bytes]:
        return self.inner.fetch(self.scope + key)

    def delete(self, key: bytes, value: bytes) -> None:
        self.inner.delete(self.scope + key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self.inner.move(self.scope + src, self.scope + dest, value)


def _progress(done: float, tally: Tally) -> None:
    if sys.stderr.isatty():
        bar = "#" * int(30 * min(done, 1.0))
        print(f"\r[{bar:<30}] {tally.examples} examples, {tally.steps} steps", end="",
              file=sys.stderr, flush=True)


class Watch:
    """Whether an example of the batch failed: a batch the budget cuts short (TimeUp)
    is replayed only if it had found a failure."""

    failed = False


def watched(machine: type[RuleBasedStateMachine], tally: Tally,
            watch: Watch) -> type[RuleBasedStateMachine]:
    """``machine`` with the budget checked before each step's checks (each rule step of
    a large page size can take a second: ``Tally.begin_example`` alone let one example
    outlast --seconds many times over), and its failures noted in ``watch``."""

    class Watched(machine):  # type: ignore[valid-type, misc]
        def check_invariants(self, *args: object, **kwargs: object) -> None:
            tally.check_time()
            super().check_invariants(*args, **kwargs)

        def teardown(self) -> None:
            # Hypothesis tears a machine down in a ``finally``: the exception that ends
            # the example, if any, is the one being raised.
            ending = sys.exc_info()[1]
            if isinstance(ending, Exception):
                watch.failed = True
            elif ending is None:
                tally.example_passed()
            super().teardown()

    Watched.__name__ = Watched.__qualname__ = machine.__name__
    return Watched


def component(name: str) -> ComponentEngine:
    engine = BUILT_IN[name]
    assert isinstance(engine, ComponentEngine)
    return engine


def hybrid_page_sizes(page_sizes: Sequence[int]) -> list[int]:
    return [p for p in page_sizes if p <= HYBRID_MAX_PAGE] or [1]


def component_result(campaign: ComponentCampaign, version: str,
                     seconds: float) -> CampaignResult:
    return CampaignResult(
        name=f"{campaign.kind} {campaign.components}", engine=campaign.engine, version=version,
        seconds=seconds, examples=campaign.reached["examples"],
        steps=campaign.reached["checks"], configurations=campaign.configs,
        reached=counts(campaign.reached, campaign.reach), unreached=campaign.missed(),
        failure=campaign.failure)


def hybrid_failed(campaign: ComponentCampaign) -> int:
    """Print a hybrid campaign's failure (the shrunk steps and what broke); exit 1."""
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(f"FAILED: {campaign.kind} {campaign.components} campaign, engine {campaign.engine}\n"
          f"{campaign.failure}", flush=True)
    return 1


def run_hybrid(args: argparse.Namespace, results: CheckResults) -> int:
    """``--engine ours-swa / sglang-swa / ours-mamba / sglang-mamba …``: the hybrid
    machine of spec/13 or the Mamba machine of spec/13m for the whole budget."""
    started = time.monotonic()
    options = {"until": started + args.seconds, "examples": args.examples,
               "steps": args.steps, "batch": args.batch, "seeded": args.seed}
    engine = lookup(args.engine)
    assert isinstance(engine, ComponentEngine)  # validated() sent only these here
    campaign = engine.campaign(args.page_sizes, **options)
    results.add(component_result(campaign, args.version, time.monotonic() - started))
    if campaign.failure is not None:
        return hybrid_failed(campaign)
    if not campaign.reached["checks"]:
        print(f"hiradix check: --seconds {args.seconds:g}: the budget ran out before one "
              "step was checked; nothing was checked (give it more time)", file=sys.stderr)
        return 2
    print(f"hiradix check: {campaign.describe()} ({time.monotonic() - started:.0f} s)",
          flush=True)
    missed = campaign.missed()
    if args.require_coverage and missed:
        print(f"--require-coverage: never reached: {', '.join(missed)}", flush=True)
        return 1
    return 0


def machine_result(args: argparse.Namespace, tally: Tally, covered: set[Scenario],
                   seconds: float, failure: str | None = None,
                   script: str | None = None) -> CampaignResult:
    """The two-tier (or an engine's differential) campaign as a ``CampaignResult``."""
    return CampaignResult(
        name="two-tier" if args.engine in COPY_ENGINES else "differential",
        engine=args.engine, version=args.version, seconds=seconds,
        examples=tally.examples, steps=tally.checks, configurations=len(covered),
        reached={**dict(sorted(tally.ops.items())),
                 **{spec_id: tally.exercised[spec_id] for spec_id in EXERCISED}},
        unreached=unreached(tally, covered, args.engine), failure=failure,
        reproducer=script, beyond_server=args.beyond_server)


def rank_result(campaign: RankCampaign, seconds: float) -> CampaignResult:
    return CampaignResult(
        name="ranks", engine="controlled", version="hiradix", seconds=seconds,
        examples=sum(campaign.runs.values()), steps=campaign.steps,
        configurations=len(campaign.runs),
        reached={"collectives": campaign.collectives, "overruled": campaign.overruled},
        failure=failure_report(campaign) if campaign.failed is not None else None)


def run(args: argparse.Namespace, results: CheckResults) -> int:
    if args.component:
        return run_hybrid(args, results)
    scenarios = matrix(args.page_sizes, args.policies, args.strategies, args.engine,
                       args.device, args.storage, args.beyond_server)
    tally = Tally()
    covered: set[Scenario] = set()
    started = time.monotonic()
    # --seconds bounds the whole run, shrinking included: no example and no step begins
    # after the deadline (Tally.check_time raises TimeUp), and a failure whose shrinking
    # was cut short is replayed, without shrinking and for a bounded time, as far as it
    # got (from the database; a seeded batch generates the same examples again).
    ranks = args.engine == "controlled"
    machine_seconds = (args.seconds * (1 - RANK_SHARE - HYBRID_SHARE) if ranks
                       else args.seconds)
    if args.examples is None:
        tally.deadline = started + machine_seconds
    # The example database pytest uses too (.hypothesis/examples under the working
    # directory, by default): a failure found once by either replays first in both.
    # 'none': one in memory, for this run's replay of a failure cut short.
    database: ExampleDatabase = (InMemoryExampleDatabase() if args.database == "none"
                                 else DirectoryBasedExampleDatabase(args.database))
    # derandomize=False: Hypothesis derandomizes under a CI environment variable, which
    # would give every batch of a configuration the same examples (CI=true once ran
    # campaigns of evictions only). Runs replay through --seed instead.
    batch = settings(max_examples=args.batch, stateful_step_count=args.steps, deadline=None,
                     database=database, suppress_health_check=list(HealthCheck),
                     print_blob=False, derandomize=False)
    for index in itertools.count():
        elapsed = time.monotonic() - started
        if args.examples is not None and tally.examples >= args.examples:
            break
        if args.examples is None and elapsed >= machine_seconds:
            break
        scenario = scenarios[index % len(scenarios)]
        watch = Watch()
        machine = watched(machine_for(args.engine, scenario, tally, args.beyond_server),
                          tally, watch)
        scoped = settings(batch, database=ScopedDatabase(
            database, f"{args.engine}/{scenario.slug()}/{scenario.device}"))
        report: list[str] = []
        cut_short = False
        batch_started = time.monotonic()
        try:
            try:
                with with_reporter(report.append):
                    batch_test(machine, scoped, args.seed, index)()
            except TimeUp:
                # The budget ran out in this batch: while generating, or while shrinking
                # a failure. If an example had failed, once more without shrinking, for
                # a bounded time: a failure saved in the database (unseeded: as far as
                # shrinking got) replays first; a seeded batch, which saves nothing,
                # generates the same examples again, no slower than the first time.
                cut_short = True
                if watch.failed:
                    tally.deadline = time.monotonic() + max(
                        REPLAY_MIN_SECONDS, time.monotonic() - batch_started)
                    report = []
                    with with_reporter(report.append):
                        batch_test(machine, settings(scoped, phases=[
                            Phase.explicit, Phase.reuse, Phase.generate]), args.seed,
                            index)()
        except SkipTest:  # nothing left to run: the time was simply up
            break
        except TimeUp:  # the replay of the failure ran out of time too
            results.add(machine_result(args, tally, covered, time.monotonic() - started,
                                       failure=f"an example failed on {scenario}; the time "
                                               "ran out before it was shrunk or replayed"))
            return lost_failure(args, scenario)
        except Exception as failure:  # the reporting boundary: every
            # failure of the machine (a disagreement, an invariant, an illegal choice, a
            # crash) is a finding to print with its reproducer, then exit 1.
            return report_failure(args, scenario, tally, failure, report, cut_short,
                                  results, time.monotonic() - started, covered)
        covered.add(scenario)
        if cut_short:
            break
        done = (tally.examples / args.examples if args.examples is not None
                else (time.monotonic() - started) / args.seconds)
        _progress(done, tally)
    if not tally.checks:
        # Not even one rule step was checked: exit 0 would claim a campaign that checked
        # nothing. The budget was too small for this configuration (no rank run either).
        print(f"hiradix check: --seconds {args.seconds:g}: the budget ran out before one "
              "step was checked; nothing was checked (give it more time)", file=sys.stderr,
              flush=True)
        return 2
    campaign = None
    hybrid: ComponentCampaign | None = None
    mamba: ComponentCampaign | None = None
    if ranks:
        # Drawn from --seed where given, so that a seeded campaign replays.
        rng = random.Random(args.seed if args.seed is not None else random.getrandbits(64))
        rank_until = started + args.seconds * (1 - HYBRID_SHARE)
        results.add(machine_result(args, tally, covered, time.monotonic() - started))
        part_started = time.monotonic()
        campaign = (run_rank_campaign(rng, until=rank_until)
                    if args.examples is None else
                    run_rank_campaign(rng, runs=max(1, args.examples // EXAMPLES_PER_RANK_RUN)))
        results.add(rank_result(campaign, time.monotonic() - part_started))
        if campaign.failed is not None:
            if sys.stderr.isatty():
                print(file=sys.stderr)
            print(failure_report(campaign), flush=True)
            return 1
        # The hybrid share: half to (FULL, SWA), half to (FULL, MAMBA).
        swa_until = started + args.seconds * (1 - HYBRID_SHARE / 2)
        examples = (None if args.examples is None
                    else max(1, args.examples // EXAMPLES_PER_HYBRID_EXAMPLE))
        part_started = time.monotonic()
        hybrid = component("ours-swa").campaign(
            hybrid_page_sizes(args.page_sizes),
            until=swa_until if args.examples is None else math.inf,
            examples=examples, steps=args.steps, seeded=args.seed)
        results.add(component_result(hybrid, "hiradix", time.monotonic() - part_started))
        if hybrid.failure is not None:
            return hybrid_failed(hybrid)
        part_started = time.monotonic()
        mamba = component("ours-mamba").campaign(
            hybrid_page_sizes(args.page_sizes),
            until=started + args.seconds if args.examples is None else math.inf,
            examples=examples, steps=args.steps, seeded=args.seed)
        results.add(component_result(mamba, "hiradix", time.monotonic() - part_started))
        if mamba.failure is not None:
            return hybrid_failed(mamba)
    if not ranks:
        results.add(machine_result(args, tally, covered, time.monotonic() - started))
    if sys.stderr.isatty():
        print(file=sys.stderr)
    summary(tally, covered, len(scenarios), time.monotonic() - started, args.engine)
    print(describe(campaign) if campaign is not None else
          f"ranks: not run for engine {args.engine} ({', '.join(RANK_INVARIANTS)} "
          "not exercised)", flush=True)
    print(hybrid.describe() if hybrid is not None else
          f"hybrid (FULL, SWA): not run for engine {args.engine} (spec/13 not exercised; "
          "--engine ours-swa or sglang-swa runs it)", flush=True)
    print(mamba.describe() if mamba is not None else
          f"hybrid (FULL, MAMBA): not run for engine {args.engine} (spec/13m not exercised; "
          "--engine ours-mamba or sglang-mamba runs it)", flush=True)
    not_run = outside_server(args)
    if not_run:
        print(f"eviction strategies not run: {', '.join(not_run)} (the engine's server does "
              "not take them, spec/04 4.4; --beyond-server runs them)", flush=True)
    missed = unreached(tally, covered, args.engine)
    if hybrid is not None:
        missed += [f"hybrid {name}" for name in hybrid.missed()]
    if mamba is not None:
        missed += [f"mamba {name}" for name in mamba.missed()]
    if tally.examples and not any(tally.exercised.values()):
        # A campaign in which no invariant had anything to check has checked nothing.
        print("hiradix check: no invariant had anything to check in any step: "
              "this campaign checked nothing", flush=True)
        return 1
    if args.require_coverage and missed:
        print(f"--require-coverage: never reached: {', '.join(missed)}", flush=True)
        return 1
    if args.report:
        written = write_check_report(tally, args.report, EXERCISED, COVERAGE)
        print(f"(report: {', '.join(map(str, written))})", flush=True)
    if args.record:
        # The last example that ran to its end (else the last one begun, cut short).
        steps = tally.clean_trace if tally.clean_trace is not None else tally.last_trace
        config = (tally.clean_config if tally.clean_trace is not None else tally.last_config) \
            or scenarios[0].model_config()
        trace.write(args.record, config, engine_label(args.engine, args.version), steps)
        print(f"(trace of the last complete example written to {args.record}: "
              f"`hiradix replay {args.record}`)", flush=True)
    return 0


def batch_test(machine: type[RuleBasedStateMachine], batch: settings, seeded: int | None,
               index: int) -> Callable[[], None]:
    """The Hypothesis test of one batch: under ``--seed`` each batch its own seed, so that
    a seeded campaign replays exactly (as far as its time budget reaches)."""
    test = get_state_machine_test(machine, settings=batch)
    if seeded is not None:
        test = seed(seeded * 1_000_003 + index)(test)
    return test  # type: ignore[no-any-return]


def lost_failure(args: argparse.Namespace, scenario: Scenario) -> int:
    """An example failed, but the budget ran out before the failure was shrunk and
    before its replay failed again: no reproducer to print, still a failure (exit 1)."""
    if sys.stderr.isatty():
        print(file=sys.stderr)
    print(f"FAILED on {scenario}\n(an example failed, but --seconds {args.seconds:g} ran out "
          "before the failure could be shrunk or replayed: run again with a longer "
          "--seconds, or with --examples)", flush=True)
    return 1


def report_failure(args: argparse.Namespace, scenario: Scenario, tally: Tally,
                   failure: Exception, report: list[str], cut_short: bool,
                   results: CheckResults, seconds: float, covered: set[Scenario]) -> int:
    """Print a failure with its reproducer (shrunk, or as far as the time allowed);
    write the reproducer and the trace where asked. Returns the exit status, 1."""
    if sys.stderr.isatty():
        print(file=sys.stderr)
    # Hypothesis attaches the shrunk steps to the exception as notes; with several
    # distinct failures it raises a group: report the first.
    if isinstance(failure, ExceptionGroup):
        failure = failure.exceptions[0]
    script = reproducer(scenario, report + list(getattr(failure, "__notes__", [])),
                        args.engine)
    print(f"FAILED on {scenario}\n{type(failure).__name__}: {failure}\n", flush=True)
    if args.beyond_server:
        print(f"(run with --beyond-server: the calls {args.engine}'s server refuses were "
              "driven too, so this failure may not be reachable through its server; run "
              "without it to see whether it is)", flush=True)
    results.add(machine_result(args, tally, covered, seconds,
                               failure=f"FAILED on {scenario}\n{type(failure).__name__}: "
                                       f"{failure}", script=script))
    if cut_short:
        print(f"(--seconds {args.seconds:g} ran out in this batch: the reproducer is shrunk "
              "only as far as the time allowed)", flush=True)
    print(("Shrunk reproducer:\n" if not cut_short else "Reproducer:\n") + script,
          flush=True)
    if args.reproducer:
        with open(args.reproducer, "w") as handle:
            handle.write(script)
        print(f"(written to {args.reproducer})", flush=True)
    if args.trace:
        config = tally.last_config or scenario.model_config()
        trace.write(args.trace, config, engine_label(args.engine, args.version),
                    tally.failure_trace())
        print(f"(trace of the shrunk example written to {args.trace}: "
              f"`hiradix replay {args.trace}`)", flush=True)
    return 1


def machine_rules(engine: str, covered: set[Scenario]) -> tuple[str, ...]:
    """The rules the summary lists (with their zeros) for ``engine``'s machines: ours
    count every rule; the differential machines count none yet."""
    if engine not in COPY_ENGINES:
        return ()
    storage = STORAGE_SWARM_RULES if any(s.storage for s in covered) else ()
    return ("request", *SWARM_RULES, *storage)


def summary(tally: Tally, covered: set[Scenario], total: int, seconds: float,
            engine: str = "controlled") -> None:
    # Throughput as a figure of its own (issue 13): rule steps, each with every
    # invariant and the refinement checked after it, per second of the whole campaign.
    print(f"hiradix check: {tally.examples} examples, {tally.checks} rule steps, "
          f"{tally.steps} operations in {seconds:.1f} s, 0 failures; "
          f"{tally.checks / seconds:.0f} rule steps/s")
    axes = {
        "page sizes": sorted({s.page_size for s in covered}),
        "write policies": sorted({s.write_policy for s in covered}),
        "eviction": sorted({s.eviction for s in covered}),
        "host layouts": sorted({s.host_layout for s in covered}),
        "kv layouts": sorted({s.kv_layout for s in covered}),
        "storage": sorted({s.storage or "none" for s in covered}),
    }
    print(f"configurations: {len(covered)} of {total}")
    for axis, values in axes.items():
        print(f"  {axis}: {', '.join(map(str, values))}")
    print("operations: " + ", ".join(f"{k}={v}" for k, v in sorted(tally.ops.items())))
    injected = {k: v for k, v in sorted(tally.faults.items())
                if ":" in k and not k.endswith(":untaken") and v}
    if injected:
        untaken = sum(v for k, v in tally.faults.items() if k.endswith(":untaken"))
        print("storage faults injected: " + ", ".join(f"{k}={v}" for k, v in injected.items())
              + f"; left untaken when their example ended: {untaken}")
    if tally.swarm:
        print("swarm (examples per draw): " + ", ".join(
            f"{k}={v}" for k, v in sorted(tally.swarm.items())))
    rules = machine_rules(engine, covered)
    if rules:
        print("rules (executions of each):")
        for name in sorted(rules):
            print(f"  {name:<34} {tally.rules[name] or 'never run'}")
    idle = [spec_id for spec_id in EXERCISED if not tally.exercised[spec_id]]
    print(f"invariants: {len(EXERCISED) - len(idle)} of {len(EXERCISED)} exercised; every one "
          f"is checked after each of the {tally.checks} rule steps on the implementation and "
          "the model; steps in which each had something to check:")
    for spec_id in EXERCISED:
        count = tally.exercised[spec_id]
        print(f"  {spec_id:<30} {count if count else 'not exercised'}")
    print("states reached (steps in each; coverage.py names them):")
    for name in COVERAGE:
        count = tally.states[name]
        print(f"  {name:<34} {count if count else 'not reached'}")
    sys.stdout.flush()


def unreached(tally: Tally, covered: set[Scenario], engine: str = "controlled") -> list[str]:
    """What the campaign never reached: invariants with nothing to check, coverage
    states (those of the storage tier only when a tier was in the matrix) and rules
    never run."""
    storage = any(s.storage for s in covered)
    # The event stream is ours (spec/11); an engine's campaign does not read one.
    events = engine in COPY_ENGINES
    idle = [spec_id for spec_id in EXERCISED if not tally.exercised[spec_id]
            and (storage or not spec_id.startswith(("INV-PREFETCH", "INV-STORAGE",
                                                    "INV-RELEASE")))
            and (events or spec_id != "INV-EVENTS-REPLAY")]
    return idle + [name for name in COVERAGE if not tally.states[name]
                   and (storage or name not in STORAGE_ONLY)] + [
        f"rule {name}" for name in machine_rules(engine, covered) if not tally.rules[name]]


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = OneLineParser(prog="hiradix", description="hiradix tools")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help=__doc__.splitlines()[0])
    check.add_argument("--seconds", type=float, default=30.0,
                       help="time budget (default 30): bounds the whole run, shrinking and "
                            "the rank campaign included")
    check.add_argument("--examples", type=int, default=None, help="budget in examples instead")
    check.add_argument("--steps", type=int, default=40, help="steps per example")
    check.add_argument("--batch", type=int, default=4,
                       help="examples per configuration before moving to the next")
    check.add_argument("--page-sizes", type=lambda v: [int(x) for x in v.split(",")],
                       default=list(DEFAULT_PAGE_SIZES))
    check.add_argument("--policies", type=lambda v: v.split(","), default=list(WRITE_POLICIES))
    check.add_argument("--strategies", type=lambda v: v.split(","), default=list(STRATEGIES))
    check.add_argument("--storage", type=lambda v: v.split(","), default=list(STORAGE_NAMES),
                       help="the storage tiers of the matrix (ours only): none, memory, "
                            "file (default: all three)")
    check.add_argument("--engine", default="controlled",
                       help="controlled / cuda: ours through the full conformance machine "
                            "(copies finished in any order); the others: an engine through "
                            "its adapter and the differential suite (sglang: 0.5.20 "
                            "HiRadixCache; sglang-unified[-rust]: UnifiedRadixCache on the "
                            "Python [Rust] tree core; sglang-storage, "
                            "sglang-unified-storage: their storage tier (HiCacheFile); "
                            "sglang-unified-rust-hicache: the Rust core's host tier; "
                            "vllm[-offload]: vLLM's prefix cache "
                            "[and CPU offload]; ours-swa, sglang-swa: a (FULL, SWA) hybrid "
                            "cache, ours or SGLang 0.5.23's UnifiedRadixCache, through the "
                            "hybrid machine of spec/13; vllm-hybrid: vLLM's hybrid "
                            "coordinator (full + sliding-window groups) request by request; "
                            "ours-mamba, sglang-mamba: a (FULL, MAMBA) cache through the "
                            "Mamba machine of spec/13m; vllm-mamba: vLLM's coordinator "
                            "with a Mamba group (align mode) request by request)")
    check.add_argument("--beyond-server", action="store_true",
                       help="also drive the calls the engine's server never makes (the "
                            "guards its adapter declares); a failure found so may not be "
                            "reachable through the server, and is labelled so")
    check.add_argument("--device", default="cpu")
    check.add_argument("--report", default=None, metavar="DIR",
                       help="write plots here: hit rate per tier over the requests served, "
                            "coverage per invariant, state and rule (needs matplotlib: "
                            "pip install 'hiradix[plots]')")
    check.add_argument("--require-coverage", action="store_true",
                       help="fail (exit 1) if an invariant had nothing to check or a "
                            "listed state was never reached")
    check.add_argument("--seed", type=int, default=None,
                       help="replay a campaign exactly: the same seed, the same examples")
    check.add_argument("--database", default=".hypothesis/examples",
                       help="Hypothesis's example database, shared with pytest (default "
                            ".hypothesis/examples under the working directory; 'none': "
                            "no database)")
    check.add_argument("--reproducer", default=None, help="write the reproducer script here")
    check.add_argument("--trace", default=None,
                       help="on a failure, write the shrunk example as a JSONL trace here")
    bench = sub.add_parser("bench", help="ours against SGLang's caches on serving workloads")
    bench_arguments(bench)
    check.add_argument("--json", default=None, metavar="FILE",
                       help="write what each campaign ran, reached and found (failures with "
                            "their reproducers) as JSON, for a CI")
    check.add_argument("--junit", default=None, metavar="FILE",
                       help="write the campaigns as JUnit XML test suites (a failed campaign "
                            "is a failed test case), for a CI's test report")
    check.add_argument("--record", default=None,
                       help="after a clean run, write the last example as a JSONL trace here")
    replay_cmd = sub.add_parser("replay", help="check a JSONL trace against the model")
    replay_cmd.add_argument("path", help="the trace (spec/08-traces.md)")
    sub.add_parser("show", add_help=False,
                   help="draw a cache's tree by tier (text, or --svg FILE); "
                        "`hiradix show --help` for its options")
    sub.add_parser("explore", add_help=False,
                   help="every reachable state of a small scope, model and implementation "
                        "(spec/14); `hiradix explore --help` for its options")
    return parser.parse_args(argv)


def replay(path: str) -> int:
    """Apply a trace to the model; point at the first step that breaks or disagrees
    (exit 1). A file that cannot be read as a trace is ``FILE:LINE: reason``, exit 2:
    one that is not a regular file (a FIFO, a device) at once, a line longer than
    ``trace.MAX_LINE_CHARS`` when reached (spec/08)."""
    try:
        with trace.open_trace(path) as handle:
            applied, finding = trace.replay(trace.bounded_lines(handle))
    except trace.TraceFormatError as broken:
        print(f"{path}:{broken.line}: {broken.reason}", file=sys.stderr)
        return 2
    except UnicodeDecodeError:
        print(f"{path}:0: not a text file (not UTF-8)", file=sys.stderr)
        return 2
    except OSError as unreadable:
        print(f"{path}:0: {unreadable.strerror or unreadable}", file=sys.stderr)
        return 2
    if finding is None:
        print(f"{path}: {applied} steps, all accepted by the model, every invariant held")
        return 0
    print(f"{path}: line {finding.line} ({finding.op}), after {applied} accepted steps: "
          f"{finding.problem}")
    return 1


class UsageError(Exception):
    """A command line that cannot be run as given: one line on stderr, exit 2."""


def engine_label(engine: str, version: str) -> str:
    """The engine as traces name it: ours, or the engine with its installed version."""
    return "hiradix" if engine in (*COPY_ENGINES, "ours") else f"{engine} {version}"


def _positive(name: str, values: Sequence[float]) -> None:
    # not (v > 0): NaN compares false either way, and must be refused too.
    bad = [v for v in values if not v > 0]
    if bad:
        raise UsageError(f"{name}: must be positive, got {bad[0]}")


def _budget(name: str, value: float) -> None:
    """A time budget: positive and finite (``inf`` or ``nan`` would never end the run)."""
    _positive(name, [value])
    if not math.isfinite(value):
        raise UsageError(f"{name}: must be a finite number of seconds, got {value}")


def _outputs(*checks: tuple[Callable[[str, str | None], None], str, str | None]) -> None:
    """Every output path writable, before any work: a usage error otherwise."""
    for check, argument, path in checks:
        try:
            check(argument, path)
        except UnwritableOutput as unwritable:
            raise UsageError(str(unwritable)) from None


def _device(device: str) -> None:
    """``--device``: cpu, or a CUDA device this machine has."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as bad:
        reason = str(bad).splitlines()[0] if str(bad) else type(bad).__name__
        raise UsageError(f"--device {device}: not a torch device ({reason})") from None
    if parsed.type == "cpu":
        return
    if parsed.type != "cuda":
        raise UsageError(f"--device {device}: must be cpu or cuda[:N]")
    if not torch.cuda.is_available():
        raise UsageError(f"--device {device}: this machine has no CUDA device "
                         "(torch.cuda.is_available() is False)")
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: this machine has "
                         f"{torch.cuda.device_count()} CUDA devices")


def _known(name: str, given: Sequence[str], known: Sequence[str]) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise UsageError(f"{name}: unknown {', '.join(unknown)} (known: {', '.join(known)})")


def validated(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` for ``check``, with the engine's version and defaults filled in; a
    ``UsageError`` for anything that cannot run, before any example starts."""
    _positive("--page-sizes", args.page_sizes)
    too_large = [p for p in args.page_sizes if p > MAX_PAGE_SIZE]
    if too_large:
        raise UsageError(f"--page-sizes: at most {MAX_PAGE_SIZE} tokens per page, got "
                         f"{too_large[0]}")
    _budget("--seconds", args.seconds)
    _outputs((check_directory, "--report", args.report), (check_file, "--record", args.record),
             (check_file, "--json", args.json), (check_file, "--junit", args.junit),
             (check_file, "--reproducer", args.reproducer), (check_file, "--trace", args.trace),
             # Hypothesis drops a save it cannot write without a word: a failure cut
             # short could then not be replayed from it.
             (check_directory, "--database", None if args.database == "none" else args.database))
    if args.report is not None:
        try:
            pyplot()
        except PlotsUnavailable as missing:
            raise UsageError(f"--report: {missing}") from None
    _positive("--steps", [args.steps])
    _positive("--batch", [args.batch])
    if args.examples is not None:
        _positive("--examples", [args.examples])
    _known("--policies", args.policies, WRITE_POLICIES)
    _known("--strategies", args.strategies, STRATEGIES)
    _known("--storage", args.storage, STORAGE_NAMES)
    if args.engine not in COPY_ENGINES and "none" not in args.storage:
        raise UsageError(f"--storage: the storage tier is checked on ours only (--engine "
                         f"{', '.join(COPY_ENGINES)}); --engine {args.engine} runs without")
    _device(args.device)
    if args.beyond_server and args.engine in COPY_ENGINES:
        raise UsageError(f"--beyond-server: --engine {args.engine} is ours, which has no "
                         "server guards")
    if args.engine == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--engine cuda: this machine has no CUDA device "
                             "(torch.cuda.is_available() is False)")
        if args.device == "cpu":
            args = replace_namespace(args, device="cuda")
    version = "hiradix"
    if args.engine not in COPY_ENGINES:
        try:
            engine = lookup(args.engine)
            version = engine.probe()
        except EngineError as unknown:
            raise UsageError(f"{unknown}; controlled, cuda: ours through the full "
                             "conformance machine") from None
        except EngineUnavailable as missing:
            raise UsageError(str(missing)) from None
        if args.beyond_server and (isinstance(engine, ComponentEngine)
                                   or engine.machine is not None):
            raise UsageError(f"--beyond-server: {args.engine}'s campaign has no guards to "
                             "lift (only engines the differential machine drives through "
                             "an EngineAdapter declare them)")
        if isinstance(engine, ComponentEngine):
            return replace_namespace(args, version=version, component=True,
                                     page_sizes=hybrid_page_sizes(args.page_sizes))
        if args.page_sizes == list(DEFAULT_PAGE_SIZES):
            # Requests are up to 14 tokens: page size 16 would cache nothing.
            args = replace_namespace(args, page_sizes=[1, 2, 4])
    args = replace_namespace(args, version=version, component=False)
    scenarios = matrix(args.page_sizes, args.policies, args.strategies, args.engine,
                       args.device, args.storage, args.beyond_server)
    if not scenarios:
        raise UsageError(f"--engine {args.engine}: takes none of the configurations asked "
                         f"for ({scenario_space(args.engine)})")
    if args.engine not in COPY_ENGINES:
        smoke(args.engine, version, scenarios[0])
    return args


def smoke(engine: str, version: str, scenario: Scenario) -> None:
    """Build one engine cache and read its empty state: an engine whose API is not the
    one its adapter was written against fails here, as a usage error, rather than as a
    conformance failure with a meaningless reproducer."""
    try:
        adapter = cache_engine(engine).factory(scenario)()
        try:
            adapter.observe(initial(adapter.config))
        finally:
            adapter.close()
    except (ImportError, AttributeError, TypeError) as mismatch:
        raise UsageError(f"--engine {engine}: {engine} {version} does not match its adapter's "
                         f"API: {type(mismatch).__name__}: {mismatch}") from None


def main(argv: Sequence[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:1] == ["show"]:  # its own parser: a trace path and --svg
        return show_main(given[1:])
    if given[:1] == ["explore"]:  # its own parser: the scope (spec/14)
        return explore_main(given[1:])
    try:
        args = parse(given)
    except BadCommandLine as usage:
        print(usage, file=sys.stderr)
        return 2
    if args.command == "replay":
        return replay(args.path)
    if args.command == "bench":
        try:
            _budget("--scale", args.scale)
            _outputs((check_file, "--plot", args.plot))
        except UsageError as usage:
            print(f"hiradix bench: {usage}", file=sys.stderr)
            return 2
        return bench_main(args)
    try:
        args = validated(args)
    except UsageError as usage:
        print(f"hiradix check: {usage}", file=sys.stderr)
        return 2
    results = CheckResults(given)
    results.exit_status = run(args, results)
    written = write_results(results, args.json, args.junit)
    if written:
        print(f"(results: {', '.join(written)})", flush=True)
    return results.exit_status


def replace_namespace(args: argparse.Namespace, **changes: object) -> argparse.Namespace:
    values = vars(args) | changes
    return argparse.Namespace(**values)


__all__ = ["main", "matrix", "reproducer"]
