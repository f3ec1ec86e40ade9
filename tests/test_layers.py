"""The package's modules depend one way (docs/design.md, The layering rule): no import circle, even through imports
inside functions, and the helpers at the bottom (errors, names, device) import nothing above them.

engine -> store (model names) -> quantize -> engine (device choice) was once a circle; the model-name
helpers now live in names.py and the device helpers in device.py, below all three.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "dgemma_cli"


def imports(path: Path) -> set[str]:
    """The dgemma_cli modules a file imports: at module level or inside functions, relative or absolute."""
    mods = {p.stem for p in PKG.glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 or (node.module or "").split(".")[0] == "dgemma_cli":
                parts = (node.module or "").split(".")[0 if node.level == 1 else 1:]
                if parts and parts[0]:
                    found.add(parts[0])
                else:  # `from . import x` / `from dgemma_cli import x`: x may be a module
                    found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("dgemma_cli."))
    return {m for m in found if m in mods and m != path.stem}


def graph() -> dict[str, set[str]]:
    """Module -> the modules it imports, without the package's own plumbing (__init__, __main__)."""
    plumbing = ("__init__", "__main__")
    return {p.stem: imports(p) - set(plumbing) for p in sorted(PKG.glob("*.py")) if p.stem not in plumbing}


def reach(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in g[todo.pop()]:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_import_graph_has_no_circle():
    g = graph()
    circles = sorted(m for m in g if m in reach(g, m))
    assert not circles, f"modules that import themselves through others: {circles}"


def test_engine_store_quantize_point_one_way():
    """The engine reaches neither the store nor quantize (model names come from names.py); quantize and the store
    never reach the engine (the device choice comes from device.py)."""
    g = graph()
    assert not {"store", "quantize"} & reach(g, "engine")
    assert "engine" not in reach(g, "quantize") and "engine" not in reach(g, "store")
    assert {"names", "device"} <= g["engine"] and "device" in g["quantize"] and "names" in g["store"]


def test_bottom_modules_import_nothing_above_them():
    g = graph()
    assert g["errors"] == set()
    assert g["names"] <= {"errors"} and g["device"] <= {"errors"}


def test_quant_never_imports_dgemma_cli():
    for path in sorted((ROOT / "quant").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            assert not any(n.split(".")[0] == "dgemma_cli" for n in names), path


def test_bottom_modules_import_alone_without_torch():
    """In a fresh interpreter: names and device load on their own, without torch or anything above them."""
    code = ("import sys; import dgemma_cli.names, dgemma_cli.device; "
            "print([m for m in ('torch', 'dgemma_cli.engine', 'dgemma_cli.store', 'dgemma_cli.quantize') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
