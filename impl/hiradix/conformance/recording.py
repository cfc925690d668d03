"""Steps on the model that leave a trace: shared by the conformance and differential
machines. Each step applies one model operation (the storage tier's too), records it
(spec/08) and counts it; an observation the engine disagrees on is recorded as the
engine's, so that a replay of the trace stops at that line."""

from __future__ import annotations

from collections.abc import Callable

from hiradix.conformance.tally import Tally
from hiradix_model import ModelError, State, trace


class Recording:
    """Mixed into a state machine that sets ``model``, ``trace``, ``counts`` and
    ``engine_label`` (the engine's name in failure messages)."""

    model: State
    trace: list[trace.Step]
    counts: Tally
    engine_label: str

    def step(self, name: str, op: Callable[..., tuple[State, object]], *args: object,
             **kwargs: object) -> object:
        self.counts.check_time()  # before the model moves: the trace stays a legal run
        arguments = trace.encode_call(op, *args, **kwargs)
        try:
            self.model, observation = op(self.model, *args, **kwargs)
        except ModelError:
            # Not in the trace yet: a machine that expects the refusal (a misuse the
            # engine refuses too) catches it and goes on, and a trace holds only steps
            # the model takes. The trace of a failure ends with it (``failure_trace``).
            self.counts.last_rejected = trace.Step(name, arguments)
            raise
        self.counts.last_rejected = None
        self.trace.append(trace.Step(name, arguments, trace.encode_observation(observation)))
        self.counts.ops[name] += 1
        self.counts.steps += 1
        return observation

    def agree(self, engine: object, model: object) -> None:
        """The engine observed ``engine`` where the model observed ``model``: the trace
        keeps the engine's."""
        last = self.trace[-1]
        assert last.op != "adopt", "an observation follows its operation directly"
        self.trace[-1] = trace.Step(last.op, last.args, trace.encode_observation(engine))
        assert engine == model, f"{last.op}: {self.engine_label} {engine!r}, model {model!r}"
