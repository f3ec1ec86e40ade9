"""The package's modules depend one way (docs/design.md, Layout): no import circle, even through imports inside
functions, and no module imports one on a floor above its own. The floors, bottom first, are FLOORS below; the
engine never reaches the store, the server or the CLI, and quant/ never imports dgemma_cli.

engine -> store (model names) -> quantize -> engine (device choice) was once a circle; model names now live in
checkpoint/names.py and the device helpers in device.py, below all three.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "dgemma_cli"

# Bottom first. A module may import modules on its own floor or below; a package's name stands for all its modules.
FLOORS = [
    ("bottom", {"errors", "config", "device"}),
    ("structured", {"structured"}),
    ("network and text", {"model", "sampler", "tokenizer", "tools", "image", "answer"}),
    ("checkpoint", {"checkpoint"}),
    ("tuner", {"tuner"}),
    ("engine", {"engine", "vision", "conversation", "step_trace", "bench", "placement", "doctor"}),
    ("store", {"store"}),
    ("server", {"server"}),
    ("cli", {"cli"}),
]
PLUMBING = {"__init__", "__main__"}  # dgemma_cli/__init__.py (the lazy Python API) and __main__.py


def module_name(path: Path) -> str:
    """dgemma_cli/server/app.py -> 'server.app'; a package's __init__.py -> the package's name."""
    parts = list(path.relative_to(PKG).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports(path: Path, known: set[str]) -> set[str]:
    """The dgemma_cli modules a file imports, at module level or inside functions, relative or absolute: each
    resolved to the longest known module name (`from .x import y` is the module x.y when that is one)."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()

    def add(dotted: str) -> None:
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            if ".".join(parts[:n]) in known:
                found.add(".".join(parts[:n]))
                return

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                mod = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "dgemma_cli":
                mod = node.module.partition(".")[2]
            else:
                continue
            for a in node.names:  # `from . import x` and `from .pkg import mod`: x may be a module
                add(f"{mod}.{a.name}" if mod else a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dgemma_cli."):
                    add(a.name.partition(".")[2])
    found.discard(module_name(path))
    return {m for m in found if m.split(".")[-1] not in PLUMBING}


def graph() -> dict[str, set[str]]:
    """Module -> the modules it imports, without the package's own plumbing (__init__, __main__)."""
    mods = all_modules()
    return {m: imports(p, set(mods)) for m, p in mods.items() if m not in PLUMBING}


def floor_of(module: str) -> int:
    top = module.split(".")[0]
    for i, (_, members) in enumerate(FLOORS):
        if top in members:
            return i
    raise AssertionError(f"dgemma_cli.{module} is on no floor: add it to tests/test_layers.py FLOORS "
                         "and docs/design.md's layout")


def upward(g: dict[str, set[str]]) -> list[str]:
    """Every import of a module on a higher floor, as 'a (floor) -> b (floor)'."""
    return sorted(f"{a} ({FLOORS[floor_of(a)][0]}) -> {b} ({FLOORS[floor_of(b)][0]})"
                  for a, deps in g.items() for b in deps if floor_of(b) > floor_of(a))


def reach(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in g.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_every_module_is_on_a_floor():
    for m in graph():
        floor_of(m)


def test_import_graph_has_no_circle():
    g = graph()
    circles = sorted(m for m in g if m in reach(g, m))
    assert not circles, f"modules that import themselves through others: {circles}"


def test_no_module_imports_a_floor_above_its_own():
    assert upward(graph()) == []


def test_the_floor_check_catches_an_upward_import():
    """The check itself: an engine module that imported the server, or the checkpoint one that imported the engine,
    is named; a module on no floor is refused."""
    g = graph()
    g["engine"] = g["engine"] | {"server.app"}
    g["checkpoint.weights"] = g["checkpoint.weights"] | {"engine"}
    assert upward(g) == ["checkpoint.weights (checkpoint) -> engine (engine)", "engine (engine) -> server.app (server)"]
    with pytest.raises(AssertionError, match="on no floor"):
        floor_of("newthing")


def test_imports_are_resolved_to_modules_in_packages():
    """What the graph is built from: relative imports one and two levels up, `from . import module`, absolute ones."""
    g = graph()
    assert {"errors", "engine", "server.batching", "server.guard", "server.requests"} <= g["server.app"]
    assert {"server.ollama_api", "server.responses_api"} <= g["server.app"] and "answer" in g["server.answering"]
    assert "checkpoint.names" in g["engine"] and "tuner.lora" in g["engine"]
    assert {"run", "chat", "serve", "models"} <= {m.split(".")[-1] for m in g["cli.commands"]}


def test_engine_reaches_neither_store_server_nor_cli():
    """The engine reaches neither the store nor the server or the CLI (model names come from checkpoint/names.py);
    the store never reaches the engine module (the device choice comes from device.py)."""
    g = graph()
    for start in ("engine", "conversation", "step_trace", "bench"):
        tops = {m.split(".")[0] for m in reach(g, start)}
        assert not {"store", "server", "cli"} & tops, start
    assert "engine" not in reach(g, "store.quantize") and "engine" not in reach(g, "store.models")
    assert {"checkpoint.names", "device"} <= g["engine"] and "device" in g["store.quantize"]


def test_bottom_modules_import_nothing_above_them():
    g = graph()
    assert g["errors"] == set()
    assert g["checkpoint.names"] <= {"errors"} and g["device"] <= {"errors"}


def test_each_package_says_what_it_owns_and_must_not_import():
    for init in sorted(PKG.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "Owns:" in doc and "never" in doc, f"{init.relative_to(ROOT)}: say what it owns and must not import"


def test_quant_never_imports_dgemma_cli():
    for path in sorted((ROOT / "quant").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            assert not any(n.split(".")[0] == "dgemma_cli" for n in names), path


def test_bottom_modules_import_alone_without_torch():
    """In a fresh interpreter: names and device load on their own, without torch or anything above them, and so do
    the light packages' front doors (the CLI's package, the server's guard)."""
    code = ("import sys; import dgemma_cli.checkpoint.names, dgemma_cli.device, dgemma_cli.cli, "
            "dgemma_cli.server.guard; "
            "print([m for m in ('torch', 'dgemma_cli.engine', 'dgemma_cli.store.models', 'dgemma_cli.store.quantize', "
            "'dgemma_cli.cli.commands', 'dgemma_cli.server.app') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
