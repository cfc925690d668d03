"""Hypothesis profiles, chosen by HIRADIX_PROFILE: ci (bounded), dev (default), soak.

What bounds a campaign test's wall time (each stateful or property test that runs a
machine), shrinking included:
- generation: at most ``max_examples`` examples (a test may scale it down, never up) of
  at most ``stateful_step_count`` steps each; a count, not a clock, so that what a run
  covers never depends on the machine's load.
- after the first failure: no search for further bugs (``report_multiple_bugs=False``;
  Hypothesis would otherwise go on generating for up to 10 s), then shrinking, explain
  phase included, for at most ``SHRINK_SECONDS[profile]`` seconds (Hypothesis's own
  ``MAX_SHRINKING_SECONDS``, 300 s, set here per profile; it is checked between test
  cases, so the test case running at the limit finishes first), then one replay of the
  shrunk failure. A partly shrunk failure is still saved to the example database, and
  the next run resumes shrinking from it.

So a campaign that fails costs at most its passing run's time plus SHRINK_SECONDS plus
two test cases: under ``ci``, 30 s more than it takes to pass.
"""

import os

from hypothesis import HealthCheck, settings
from hypothesis.internal.conjecture import engine

# Seconds of shrinking (explain phase included) per failing test, by profile.
SHRINK_SECONDS = {"ci": 30, "dev": 60, "soak": 300}
COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True,
              report_multiple_bugs=False)

settings.register_profile("ci", max_examples=300, stateful_step_count=60, **COMMON)
settings.register_profile("dev", max_examples=500, stateful_step_count=60, **COMMON)
settings.register_profile("soak", max_examples=20000, stateful_step_count=200, **COMMON)
PROFILE = os.environ.get("HIRADIX_PROFILE", "dev")
settings.load_profile(PROFILE)
# A module attribute Hypothesis reads when shrinking begins (documented there as
# monkeypatchable). Setting a name it no longer has would bound nothing, silently.
if not hasattr(engine, "MAX_SHRINKING_SECONDS"):
    raise RuntimeError("hypothesis.internal.conjecture.engine.MAX_SHRINKING_SECONDS is "
                       "gone: tests/conftest.py can no longer bound shrinking")
engine.MAX_SHRINKING_SECONDS = SHRINK_SECONDS[PROFILE]


def pytest_terminal_summary(terminalreporter):  # type: ignore[no-untyped-def]
    from stats import RUNS, STORAGE_RUNS, SUMMARY

    for line in SUMMARY:
        terminalreporter.write_line(line)

    if STORAGE_RUNS:
        faults = ", ".join(f"{k[6:]}={v}" for k, v in sorted(STORAGE_RUNS.items())
                           if k.startswith("fault "))
        rules = ", ".join(f"{k}={v}" for k, v in sorted(STORAGE_RUNS.items())
                          if k not in ("examples", "steps") and not k.startswith("fault "))
        terminalreporter.write_line(
            f"storage stateful runs: {STORAGE_RUNS['examples']} examples, "
            f"{STORAGE_RUNS['steps']} steps; faults injected: {faults}; rules: {rules}"
        )
    if RUNS:
        rules = ", ".join(f"{k}={v}" for k, v in sorted(RUNS.items())
                          if k not in ("examples", "steps"))
        terminalreporter.write_line(
            f"stateful runs: {RUNS['examples']} examples, {RUNS['steps']} steps "
            f"(profile {os.environ.get('HIRADIX_PROFILE', 'dev')}); rules: {rules}"
        )
