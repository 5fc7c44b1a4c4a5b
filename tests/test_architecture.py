"""Structure checks: no import cycle inside jaxrl/, `jaxrl.data` is a leaf, constants are defined
once, the entry point stays a short script, modules stay small."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "jaxrl"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """jaxrl modules `path` imports, at module level or inside functions (not under
    `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _is_ancestor_package(a: str, b: str) -> bool:
    return b.startswith(a + ".")


def test_no_import_cycle_inside_jaxrl():
    graph = _graph()
    # a package importing its own submodules (re-exports in __init__) is not a cycle
    edges = {a: {b for b in bs if not _is_ancestor_package(a, b) and not _is_ancestor_package(b, a)}
             for a, bs in graph.items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []
    counter = [0]

    def strongconnect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in edges:
        if v not in index:
            strongconnect(v)
    assert not cycles, f"import cycles inside jaxrl/: {cycles}"


def test_the_cycle_detector_sees_a_cycle(tmp_path):
    """The check above can fail: the old config.py <-> data/config.py pair was such a cycle."""
    modules = {"jaxrl.a": tmp_path / "a.py", "jaxrl.b": tmp_path / "b.py"}
    modules["jaxrl.a"].write_text("from jaxrl.b import x\n")
    modules["jaxrl.b"].write_text("def f():\n    from jaxrl.a import y\n")
    assert _imports(modules["jaxrl.a"], "jaxrl.a", modules) == {"jaxrl.b"}
    assert _imports(modules["jaxrl.b"], "jaxrl.b", modules) == {"jaxrl.a"}


def test_data_is_a_leaf():
    """`jaxrl.data` builds on the config and on the reward functions its tasks name (neither
    imports anything above it); never on models, training, generation or the controller."""
    graph = _graph()
    below = ("jaxrl.data", "jaxrl.config", "jaxrl.rewards", "jaxrl.presets")
    for name, deps in graph.items():
        if name == "jaxrl.data" or name.startswith("jaxrl.data."):
            outside = sorted(d for d in deps if not d.startswith(below) and d != "jaxrl")
            assert not outside, f"{name} imports {outside}: jaxrl.data must stay a leaf"


def _tuple_constants() -> dict[tuple, list[str]]:
    seen: dict[tuple, list[str]] = {}
    for name, path in _modules().items():
        for node in ast.parse(path.read_text()).body:
            target = value = None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                target, value = node.target, node.value
            if not isinstance(target, ast.Name) or not isinstance(value, ast.Tuple):
                continue
            try:
                literal = ast.literal_eval(value)
            except ValueError:
                continue
            if len(literal) >= 2 and all(isinstance(x, str) for x in literal):
                seen.setdefault(tuple(sorted(literal)), []).append(f"{name}.{target.id}")
    return seen


def test_name_tuples_are_defined_once():
    """Choice lists (statuses, splits, pipeline modes, ...) live in one module each."""
    dupes = {k: v for k, v in _tuple_constants().items() if len(v) > 1}
    assert not dupes, f"the same choices defined in several places: {dupes}"


def test_run_is_a_short_script_and_modules_stay_small():
    assert len((PKG / "run.py").read_text().splitlines()) <= 210
    big = {str(p.relative_to(ROOT)): n for p in list(PKG.rglob("*.py")) + list(
        (ROOT / "kernels").rglob("*.py")) if (n := len(p.read_text().splitlines())) > 650}
    assert not big, f"modules over ~600 lines (split them by concept): {big}"


def test_entry_points_use_no_private_names_of_jaxrl():
    """launch/ scripts use jaxrl's public API (launch/run.py used to read
    `distributed._initialized`)."""
    offenders = []
    for path in sorted((ROOT / "launch").glob("*.py")):
        tree = ast.parse(path.read_text())
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxrl"):
                modules.update(a.asname or a.name for a in node.names)
            elif isinstance(node, ast.Import):
                modules.update((a.asname or a.name).split(".")[0] for a in node.names
                               if a.name.startswith("jaxrl"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                    and node.value.id in modules):
                offenders.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    assert not offenders, offenders
