"""The PEP 316 contracts are well-formed: every name they use resolves.

CrossHair evaluates contract expressions in the function's module; a name that is only
used by a contract looks unused to linters and is easily dropped, which turns the
contract into a NameError at analysis time.
"""

from __future__ import annotations

import ast
import builtins
import inspect

import pytest

from hiradix_model import ops

OPERATIONS = [getattr(ops, name) for name in ops.__all__ if inspect.isfunction(getattr(ops, name))]


def contract_lines(function: object) -> list[str]:
    doc = inspect.getdoc(function) or ""
    return [line.split(":", 1)[1].strip() for line in doc.splitlines()
            if line.strip().startswith(("pre:", "post:"))]


@pytest.mark.parametrize("function", OPERATIONS, ids=lambda f: f.__name__)
def test_every_operation_has_pre_and_post_conditions(function: object) -> None:
    doc = inspect.getdoc(function) or ""
    assert "post:" in doc, f"{function.__name__} has no postcondition"  # type: ignore[attr-defined]


@pytest.mark.parametrize("function", OPERATIONS, ids=lambda f: f.__name__)
def test_contract_names_resolve(function: object) -> None:
    module_globals = function.__globals__  # type: ignore[attr-defined]
    parameters = set(inspect.signature(function).parameters)  # type: ignore[arg-type]
    for expression in contract_lines(function):
        for node in ast.walk(ast.parse(expression, mode="eval")):
            if isinstance(node, ast.Name):
                assert (node.id in parameters or node.id == "__return__"
                        or node.id in module_globals or hasattr(builtins, node.id)), (
                    f"{function.__name__}: contract name {node.id!r} is undefined")  # type: ignore[attr-defined]
