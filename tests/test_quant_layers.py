"""The quant package's modules import each other in one direction only: no import circle, counted statically
(imports inside functions included), and nothing of dgemma_cli."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imports() -> dict[str, set[str]]:
    """module -> the quant modules it imports (a name imported from a package counts as that submodule)."""
    graph: dict[str, set[str]] = {}
    for f in (ROOT / "quant").rglob("*.py"):
        parts = list(f.relative_to(ROOT).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mod = ".".join(parts[:-1] if is_pkg else parts)
        pkg = mod if is_pkg else mod.rsplit(".", 1)[0]
        out = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                for n in node.names:
                    full = f"{base}.{n.name}"
                    is_mod = (ROOT / (full.replace(".", "/") + ".py")).exists() or (ROOT / full.replace(".", "/")).is_dir()
                    out.add(full if is_mod else base)
            elif isinstance(node, ast.Import):
                out.update(n.name for n in node.names)
    return graph


def test_no_import_circle_in_quant():
    graph = imports()
    internal = {m: {t for t in ts if t.startswith("quant") and t != m} for m, ts in graph.items()}
    # a package's __init__ may import its own submodules; a submodule importing its package is the same edge back
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(internal.get(m, ())):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(internal):
        if m not in state:
            visit(m)


def test_quant_never_imports_dgemma_cli():
    graph = imports()
    assert not {m for m, ts in graph.items() if any(t.startswith("dgemma_cli") for t in ts)}
