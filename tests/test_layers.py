"""Folders are layers: every import of ours (function-level ones included) points downward, and
no two modules import each other, directly or through others.

The table is DESIGN.md section 2 / issue 13:

* ``hicache.core`` imports nothing of ours;
* ``hicache.kernels`` and ``hicache.host_pools`` import only ``core``;
* ``hicache.controllers`` (the daemon) imports ``core``, ``kernels`` and ``host_pools``;
* ``hicache.engine`` imports ``core`` and ``kernels`` — never the daemon;
* ``hicache.sim`` imports ``engine`` and ``core``;
* ``hicache.bench``, ``hicache.fuzz`` and ``hicache.cli`` are tools: anything above.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"hicache": "hicache", "controllers": "hicache.controllers",
           "kernels": "hicache.kernels", "host_pools": "hicache.host_pools"}
ALLOWED = {
    "core": {"core"},
    "kernels": {"core", "kernels"},
    "host_pools": {"core", "host_pools"},
    "controllers": {"core", "kernels", "host_pools", "controllers"},
    "engine": {"core", "kernels", "engine"},
    "sim": {"core", "engine", "sim"},
    "root": {"core"},
}
TOOLS = {"bench", "fuzz", "cli"}


def modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for folder, pkg in FOLDERS.items():
        for p in sorted((ROOT / folder).rglob("*.py")):
            rel = p.relative_to(ROOT / folder).with_suffix("")
            parts = [x for x in rel.parts if x != "__init__"]
            name = ".".join([pkg, *parts])
            if folder == "hicache" and parts and parts[0] in ("controllers", "kernels", "host_pools"):
                continue
            out[name] = p
    return out


def layer(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) == 1:
        return "root"
    return parts[1] if parts[1] not in ("__main__",) else "root"


def edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        base = name if is_pkg else name.rsplit(".", 1)[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = base.split(".")
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    mod = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod
                           for a in node.names]
            for t in targets:
                if t.startswith("hicache") and t != name:
                    while t not in mods and "." in t:
                        t = t.rsplit(".", 1)[0]
                    if t in mods and t != name:
                        found.add(t)
        out[name] = found
    return out


def test_every_import_points_downward() -> None:
    mods = modules()
    assert "hicache.core.layout" in mods and "hicache.controllers.server" in mods
    bad = []
    for src, targets in edges(mods).items():
        ls = layer(src)
        if ls in TOOLS:
            continue
        for t in targets:
            lt = layer(t)
            if lt == "root" and t == "hicache":
                continue  # the package root holds only the version re-export
            if lt not in ALLOWED.get(ls, set()):
                bad.append(f"{src} ({ls}) imports {t} ({lt})")
    assert not bad, "imports that break the layer table:\n" + "\n".join(sorted(bad))


def test_no_import_cycles() -> None:
    g = edges(modules())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    sccs: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not sccs, f"modules that import each other: {sccs}"


def test_the_walker_sees_function_level_imports(tmp_path: Path) -> None:
    """The check above can fail: a function-level upward import is an edge it reports."""
    src = "def f():\n    from hicache.controllers import server\n"
    tree = ast.parse(src)
    seen = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert seen and seen[0].module == "hicache.controllers"
    assert layer("hicache.controllers.server") not in ALLOWED["engine"]
