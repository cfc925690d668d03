"""The layering rules of the brief, checked on the import graph."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "model" / "hiradix_model"
IMPL = ROOT / "impl" / "hiradix"
# The conformance layer sits above both and is the only part of impl/ that sees the model.
CONFORMANCE = {IMPL / "conformance", IMPL / "cli.py", IMPL / "__main__.py"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_model_imports_only_the_standard_library() -> None:
    allowed = set(sys.stdlib_module_names) | {"hiradix_model"}
    for path in MODEL.rglob("*.py"):
        assert imported_roots(path) <= allowed, f"{path.relative_to(ROOT)} imports beyond stdlib"


def test_model_imports_with_torch_unavailable() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "import hiradix_model, hiradix_model.walk, hiradix_model.choosers\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_impl_core_imports_neither_model_nor_tests() -> None:
    for path in IMPL.rglob("*.py"):
        if any(path == p or p in path.parents for p in CONFORMANCE):
            continue
        forbidden = imported_roots(path) & {"hiradix_model", "tests", "hypothesis", "pytest"}
        assert not forbidden, f"{path.relative_to(ROOT)} imports {sorted(forbidden)}"
