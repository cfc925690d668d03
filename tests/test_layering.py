"""The layering rules of the brief, checked on the import graph."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "model" / "hiradix_model"
IMPL = ROOT / "impl" / "hiradix"
# The checking layer sits above both and is the only part of impl/ that sees the model:
# the generic machinery (conformance/), the engines held to it (engines/, one sub-package
# per family), the benchmarks, the command line and its pytest plugin.
CONFORMANCE = {IMPL / "conformance", IMPL / "engines", IMPL / "bench", IMPL / "cli.py",
               IMPL / "__main__.py", IMPL / "pytest_plugin.py"}
# What only an engine family's own sub-package may import.
ENGINE_PACKAGES = {"sglang", "sgl_kernel", "vllm", "lmcache"}
FAMILIES = ("ours", "sglang", "vllm", "lmcache")


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


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_generic_checking_machinery_holds_no_engine_code() -> None:
    """conformance/ is generic (issue 30): it imports no engine's package and no engine
    family's adapters; those live in hiradix.engines.<family>."""
    for path in (IMPL / "conformance").rglob("*.py"):
        imported = imported_modules(path)
        engines = {name for name in imported if name.split(".")[0] in ENGINE_PACKAGES}
        families = {name for name in imported
                    if name.startswith(tuple(f"hiradix.engines.{f}" for f in FAMILIES))}
        assert not engines | families, \
            f"{path.relative_to(ROOT)} imports {sorted(engines | families)}"


def test_an_engine_family_imports_no_other_family() -> None:
    """Each family's sub-package stands alone: a shared patch lives once, in the family
    that needs it, or in the generic machinery."""
    for family in FAMILIES:
        others = tuple(f"hiradix.engines.{f}" for f in FAMILIES if f != family)
        for path in (IMPL / "engines" / family).rglob("*.py"):
            crossing = {name for name in imported_modules(path) if name.startswith(others)}
            assert not crossing, f"{path.relative_to(ROOT)} imports {sorted(crossing)}"
