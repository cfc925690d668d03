"""The command line's usage errors, before any work (issue #34): argparse's own as one
line, and the paths the commands write (``--record``, ``--trace``, ``--reproducer``,
``--report``, ``show --svg``, ``bench --plot``) checked writable up front rather than
failing with a traceback after the whole run. Nothing is created by the checks."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path
from typing import NoReturn


class BadCommandLine(ValueError):
    """A command line argparse refuses; the message is one line naming the argument."""


class OneLineParser(argparse.ArgumentParser):
    """argparse's errors (a missing value, a value that is not a number, an unknown
    choice) as ``BadCommandLine``, ``hiradix COMMAND: argument --x: ...``, instead of the
    usage block and a SystemExit. Subparsers are of the same class (argparse's default)."""

    def error(self, message: str) -> NoReturn:
        raise BadCommandLine(f"{self.prog}: {message}")


class UnwritableOutput(ValueError):
    """An output path that cannot be written; ``argument`` names the option."""

    def __init__(self, argument: str, path: str, reason: str) -> None:
        super().__init__(f"{argument} {path}: {reason}")
        self.argument = argument


def _writable_directory(argument: str, path: str, directory: Path) -> None:
    if not directory.is_dir():
        raise UnwritableOutput(argument, path, f"{directory} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UnwritableOutput(argument, path, f"directory {directory} is not writable")


def check_file(argument: str, path: str | None) -> None:
    """``path`` can be opened for writing as a file: an existing file that is writable
    (not a directory, and not a FIFO or socket, which would block or fail the write), or
    a new name in a writable directory."""
    if path is None:
        return
    if path == "":
        raise UnwritableOutput(argument, repr(path), "an empty path")
    target = Path(path)
    try:
        mode = target.stat().st_mode
    except FileNotFoundError:
        _writable_directory(argument, path, target.parent)
        return
    except OSError as unreadable:  # a component is a file, a loop, no permission
        raise UnwritableOutput(argument, path, unreadable.strerror or str(unreadable)) \
            from None
    if stat.S_ISDIR(mode):
        raise UnwritableOutput(argument, path, "is a directory")
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        raise UnwritableOutput(argument, path, "is a FIFO or socket, not a file")
    if not os.access(target, os.W_OK):
        raise UnwritableOutput(argument, path, "is not writable")


def check_directory(argument: str, path: str | None) -> None:
    """``path`` is a writable directory, or can be created as one (its nearest existing
    ancestor is a writable directory)."""
    if path is None:
        return
    if path == "":
        raise UnwritableOutput(argument, repr(path), "an empty path")
    target = Path(path).absolute()
    existing = target
    while not existing.exists():
        if existing.is_symlink():  # a dangling link: mkdir would fail on it
            raise UnwritableOutput(argument, path, f"{existing} is a dangling link")
        existing = existing.parent
    _writable_directory(argument, path, existing)


__all__ = ["BadCommandLine", "OneLineParser", "UnwritableOutput", "check_directory",
           "check_file"]
