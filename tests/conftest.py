"""Hypothesis profiles, chosen by HIRADIX_PROFILE: ci (bounded), dev (default), soak."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=300, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True,
)
settings.register_profile(
    "dev", max_examples=500, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True,
)
settings.register_profile(
    "soak", max_examples=20000, stateful_step_count=200, deadline=None,
    suppress_health_check=[HealthCheck.too_slow], print_blob=True,
)
settings.load_profile(os.environ.get("HIRADIX_PROFILE", "dev"))


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
