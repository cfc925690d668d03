"""What a campaign did, for the summary of ``hiradix check``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hiradix_model import Config, trace


@dataclass
class Tally:
    """What a campaign did: for the summary of ``hiradix check``."""

    examples: int = 0
    steps: int = 0  # operations issued to both the implementation and the model
    checks: int = 0  # rule executions, each followed by the full comparison
    ops: Counter[str] = field(default_factory=Counter)
    exercised: Counter[str] = field(default_factory=Counter)  # steps where an ID had work
    last_trace: list[trace.Step] = field(default_factory=list)  # the latest example's steps
    last_config: Config | None = None  # the latest example's model configuration
    faults: Counter[str] = field(default_factory=Counter)  # storage faults, by kind
    states: Counter[str] = field(default_factory=Counter)  # steps per coverage.COVERAGE
    swarm: Counter[str] = field(default_factory=Counter)  # examples per swarm draw
