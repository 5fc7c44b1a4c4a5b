"""Structure checks: the layers of jaxrl/ (LAYERS) at every import level, no import cycle, few
imports inside functions, `jaxrl.data` is a leaf, constants are defined once, the entry point stays
a short script, modules stay small."""

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


# Layers, lowest first. A module imports from its own layer or below, at every level (module top,
# function bodies, `if TYPE_CHECKING:`, module names given as strings). `jaxrl/__init__.py` (the
# package itself) is neutral. launch/*.py are the top: they import anything.
LAYERS = (
    ("jaxrl.config", "jaxrl.rounding", "jaxrl.dtypes", "jaxrl.cpu", "jaxrl.presets",
     "jaxrl.trace", "jaxrl.progress"),
    ("jaxrl.models", "jaxrl.sharding", "jaxrl.tokenizers", "jaxrl.distributed"),
    ("jaxrl.train", "jaxrl.generate", "jaxrl.data", "jaxrl.rewards", "jaxrl.sandbox",
     "jaxrl.envs", "jaxrl.planner"),
    ("jaxrl.rl", "jaxrl.controller"),  # the step package (jaxrl.controller until it is renamed)
    ("jaxrl.run", "jaxrl.api", "jaxrl.service", "jaxrl.serving", "jaxrl.benchmarks",
     "jaxrl.testing"),
    ("launch",),
)
MAX_IN_FUNCTION = 0.15  # of all import statements in jaxrl/ (the JAX-free command-line path)
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_STRING_IMPORTS = {"importlib.import_module", "import_module", "importlib.util.find_spec",
                   "find_spec", "sys.modules.get"}


def _walk(tree: ast.AST):
    """(node, inside a function) for every node of `tree`."""
    stack = [(tree, False)]
    while stack:
        node, inside = stack.pop()
        yield node, inside
        inside = inside or isinstance(node, _FUNCTIONS)
        stack.extend((c, inside) for c in ast.iter_child_nodes(node))


def _resolve(target: str, modules: dict[str, Path]) -> str:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """jaxrl modules `path` imports at any level: module top, inside functions, under
    `if TYPE_CHECKING:`, and module names as strings (`importlib.import_module(...)`,
    `importlib.util.find_spec(...)`, `sys.modules.get(...)` / `[...]`, or any string constant that
    is a jaxrl module's name; docstrings excluded)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    docstrings = {id(n.body[0].value) for n, _ in _walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, *_FUNCTIONS[:2])) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = set()
    for node, _ in _walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) in _STRING_IMPORTS
              and node.args) or (isinstance(node, ast.Subscript)
                                 and ast.unparse(node.value) == "sys.modules"):
            arg = node.args[0] if isinstance(node, ast.Call) else node.slice
            if isinstance(arg, ast.JoinedStr) and arg.values:  # f"jaxrl.planner.{name}"
                arg = arg.values[0]
            text = arg.value if isinstance(arg, ast.Constant) else None
            targets = [text.rstrip(".")] if isinstance(text, str) else []
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and node.value in modules and id(node) not in docstrings):
            targets = [node.value]
        else:
            continue
        found.update(t for t in (_resolve(t, modules) for t in targets) if t and t != name)
    return found


def _graph(modules: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Who imports whom in jaxrl/ and launch/ (launch/ to see that nothing imports it)."""
    if modules is None:
        modules = _modules() | {f"launch.{p.stem}": p for p in (ROOT / "launch").glob("*.py")}
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _is_ancestor_package(a: str, b: str) -> bool:
    return b.startswith(a + ".")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
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
        for w in edges.get(v, ()):
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
    return cycles


def _layer(name: str) -> int | None:
    for i, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    return None


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """`a -> b (layer i -> j)` for each import of a higher layer; modules in no layer too."""
    found = [f"{a} is in no layer of LAYERS" for a in graph if a != "jaxrl" and _layer(a) is None]
    for a, deps in sorted(graph.items()):
        for b in sorted(deps):
            i, j = _layer(a), _layer(b)
            if None not in (i, j) and j > i:
                found.append(f"{a} -> {b} (layer {i} -> {j})")
    return found


def _in_function_counts(modules: dict[str, Path]) -> tuple[int, dict[str, int]]:
    """All import statements, and those inside functions per module."""
    total, inside = 0, {}
    for name, path in modules.items():
        for node, in_function in _walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                total += 1
                inside[name] = inside.get(name, 0) + in_function
    return total, inside


def _ratio_problem(modules: dict[str, Path]) -> str | None:
    total, inside = _in_function_counts(modules)
    ratio = sum(inside.values()) / max(total, 1)
    if ratio <= MAX_IN_FUNCTION:
        return None
    top = sorted(inside.items(), key=lambda kv: -kv[1])[:15]
    return (f"{sum(inside.values())} of {total} imports in jaxrl/ sit inside functions "
            f"({ratio:.1%} > {MAX_IN_FUNCTION:.0%}); hoist them to the module top unless they keep "
            f"the JAX-free command-line path JAX-free. Most: {top}")


def test_no_import_cycle_inside_jaxrl():
    cycles = _cycles(_graph())
    assert not cycles, f"import cycles inside jaxrl/ (any level): {cycles}"


def test_the_cycle_detector_sees_a_cycle(tmp_path):
    """The check above can fail: the old config.py <-> data/config.py pair was such a cycle."""
    modules = {"jaxrl.a": tmp_path / "a.py", "jaxrl.b": tmp_path / "b.py"}
    modules["jaxrl.a"].write_text("from jaxrl.b import x\n")
    modules["jaxrl.b"].write_text("def f():\n    from jaxrl.a import y\n")
    assert _imports(modules["jaxrl.a"], "jaxrl.a", modules) == {"jaxrl.b"}
    assert _imports(modules["jaxrl.b"], "jaxrl.b", modules) == {"jaxrl.a"}
    assert _cycles(_graph(modules)) == [["jaxrl.a", "jaxrl.b"]]


def test_no_layer_imports_a_higher_one():
    up = _upward(_graph())
    assert not up, "imports of a higher layer (see LAYERS):\n" + "\n".join(up)


def test_the_layer_check_sees_every_kind_of_import(tmp_path):
    """Upward imports under TYPE_CHECKING, inside functions and as strings all count;
    docstrings and same-layer or downward imports do not."""
    names = ("jaxrl.config.a", "jaxrl.models.b", "jaxrl.train.c", "jaxrl.controller.d",
             "jaxrl.run", "jaxrl.nowhere")
    modules = {n: tmp_path / f"{n}.py" for n in names}
    for n in names:
        modules[n].write_text("")
    modules["jaxrl.config.a"].write_text(
        '"""jaxrl.run"""\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n'
        "    from jaxrl.models import b\n"
        'def f():\n    """jaxrl.run"""\n    return sys.modules.get("jaxrl.train.c")\n')
    modules["jaxrl.models.b"].write_text(
        'import importlib\nimportlib.import_module("jaxrl.controller.d")\n'
        'NAME = "jaxrl.run"\nfrom jaxrl.config import a\n')
    modules["jaxrl.train.c"].write_text(
        'import importlib.util\nimportlib.util.find_spec(f"jaxrl.run.{x}")\n'
        'def g():\n    from jaxrl.models import b\n')
    assert _upward(_graph(modules)) == [
        "jaxrl.nowhere is in no layer of LAYERS",
        "jaxrl.config.a -> jaxrl.models.b (layer 0 -> 1)",
        "jaxrl.config.a -> jaxrl.train.c (layer 0 -> 2)",
        "jaxrl.models.b -> jaxrl.controller.d (layer 1 -> 3)",
        "jaxrl.models.b -> jaxrl.run (layer 1 -> 4)",
        "jaxrl.train.c -> jaxrl.run (layer 2 -> 4)",
    ]
    assert _layer("jaxrl.rl.loop") == _layer("jaxrl.controller") == 3
    assert _layer("launch") == len(LAYERS) - 1


def test_few_imports_sit_inside_functions():
    problem = _ratio_problem(_modules())
    assert problem is None, problem


def test_the_in_function_ratio_check_can_fail(tmp_path):
    modules = {"jaxrl.a": tmp_path / "a.py"}
    modules["jaxrl.a"].write_text(
        "import os\nimport sys\nimport json\nimport re\nimport math\n"
        "def f():\n    import time\n    g = lambda: __import__('x')\n\n"
        "class C:\n    def m(self):\n        import jax\n")
    assert _in_function_counts(modules) == (7, {"jaxrl.a": 2})
    problem = _ratio_problem(modules)
    assert problem is not None and "2 of 7" in problem and "('jaxrl.a', 2)" in problem


def test_data_is_a_leaf():
    """`jaxrl.data` builds on the config, the reward functions its tasks name and the sandbox they
    run in (none imports anything above it); never on models, training, generation or the
    controller."""
    graph = _graph()
    below = ("jaxrl.data", "jaxrl.config", "jaxrl.rewards", "jaxrl.sandbox", "jaxrl.presets")
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
    lines = len((PKG / "run.py").read_text().splitlines())
    assert lines <= 150, f"jaxrl/run.py has {lines} lines (at most 150: the parts build elsewhere)"
    big = {str(p.relative_to(ROOT)): n for p in list(PKG.rglob("*.py")) + list(
        (ROOT / "kernels").rglob("*.py")) if (n := len(p.read_text().splitlines())) > 600}
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
