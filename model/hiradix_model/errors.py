"""Typed errors of the model.

Two kinds of rejection, kept apart because they blame different parties:

* ``PreconditionError``: the *caller* asked for something the spec forbids (a bad
  argument, unlocking an unlocked page, inserting slots it does not hold).
* ``IllegalChoice``: a nondeterministic choice (eviction victim, host slots, how many
  copies finished) that the *implementation* reported is not one the spec allows.

Both leave the state untouched: every operation is a pure function.
"""


class ModelError(Exception):
    """Base class of every error the model raises."""


class ConfigError(ModelError, ValueError):
    """A configuration field is invalid; the message names the field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"config.{field}: {reason}")
        self.field = field


class PreconditionError(ModelError, ValueError):
    """An operation's precondition does not hold; the message names the argument."""

    def __init__(self, argument: str, reason: str) -> None:
        super().__init__(f"{argument}: {reason}")
        self.argument = argument


class IllegalChoice(ModelError):
    """A reported nondeterministic choice is not allowed by the spec."""
