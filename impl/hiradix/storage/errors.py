"""Typed errors of the storage tier (spec/09).

Three kinds, so a caller can tell whom to blame:

- ``StorageError``: the backend failed (an I/O error, an injected fault). It carries how
  many leading pages of the batch were done before it failed, because those pages are
  valid and the caller may keep them.
- ``StorageArgumentError``: the caller misused a storage API; nothing changed.
- ``StorageConfigError``: a storage configuration field is invalid; it names the field,
  and for a bad value also what was expected and what was given.
"""

from __future__ import annotations

from hiradix.errors import ConfigError, HiradixError, InvalidArgument


class StorageError(HiradixError):
    """A backend operation failed. ``pages_done`` leading pages of the batch were done
    (read into host slots, or written) before it did; the rest were not."""

    def __init__(self, backend: str, operation: str, reason: str, *,
                 pages_done: int = 0) -> None:
        super().__init__(f"storage backend {backend!r}, {operation}: {reason} "
                         f"(after {pages_done} pages)")
        self.backend = backend
        self.operation = operation
        self.reason = reason
        self.pages_done = pages_done


class StorageArgumentError(InvalidArgument):
    """Caller misuse of a storage backend, hash function or I/O layer; ``argument`` names
    the argument. The object raising it is unchanged."""


class StorageConfigError(ConfigError):
    """A storage configuration field is invalid; ``argument`` (also ``field``) names it.
    For a bad value, ``expected`` says what the field takes and ``value`` is what it got."""

    def __init__(self, field: str, reason: str, *, expected: str | None = None,
                 value: object = None) -> None:
        super().__init__(field, reason)
        self.field = field
        self.expected = expected
        self.value = value

    @classmethod
    def bad_value(cls, field: str, expected: str, value: object) -> StorageConfigError:
        """The error for a field whose value is not what it takes."""
        return cls(field, f"expected {expected}, got {value!r} ({type(value).__name__})",
                   expected=expected, value=value)
