"""The shape of kups' imports: no module of `src/kups` imports itself back through
a circle, the effects use only the public names of `kups.effects` (as a user
would), and the `__init__` of every package only re-exports.

The modules are read with `ast`, so every import counts wherever it is written:
at the top, inside a function (a deferred import), `from . import x` and
`from .x import y`. Imports under `if TYPE_CHECKING:` are left out: they never
run, and a type hint naming a class of a module that imports this one is not an
import circle.
"""

from __future__ import annotations

import ast
import importlib
import itertools
import types
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
KUPS = SRC / "kups"
EFFECTS = "kups.effects"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(KUPS.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _nodes(tree: ast.AST):
    """Every node of `tree` except those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def _resolve(module: str, node: ast.ImportFrom) -> str:
    """The absolute module that `from <node.module> import ...` in `module` reads."""
    if not node.level:
        return node.module or ""
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    parts = package.split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str) -> list[tuple[str, str | None, int]]:
    """`(imported module, imported name or None, line)` for every import of `module`.

    `from a import b` reads the module `a.b` when there is one (name `None`),
    otherwise the name `b` of the module `a`.
    """
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    found: list[tuple[str, str | None, int]] = []
    for node in _nodes(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in MODULES:
                    found.append((submodule, None, node.lineno))
                else:
                    found.append((source, alias.name, node.lineno))
    return found


def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {kups module it imports: line of the first such import}."""
    graph: dict[str, dict[str, int]] = {}
    for module in MODULES:
        edges: dict[str, int] = {}
        for target, _, line in imports(module):
            if target in MODULES and target != module:
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """A circle of imports in `graph`, as the list of its modules, or `None`."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state:
                cycle = visit(target)
                if cycle is not None:
                    return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            if cycle is not None:
                return cycle
    return None


def test_the_checker_finds_a_circle_and_resolves_relative_imports():
    assert find_cycle({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {}}) == [
        "a",
        "b",
        "c",
        "a",
    ]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1, "b": 2}}) is None
    handler = next(m for m in MODULES if m.startswith(f"{EFFECTS}.handlers._"))
    node = ast.parse("from .. import x").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _resolve(handler, node) == EFFECTS
    node = ast.parse("from . import x").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert _resolve(f"{EFFECTS}.handlers", node) == f"{EFFECTS}.handlers"


def test_no_import_circle_in_kups():
    graph = import_graph()
    cycle = find_cycle(graph)
    if cycle is not None:
        steps = "\n".join(
            f"  {a} imports {b} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)
        )
        pytest.fail(f"An import circle of {len(cycle) - 1} modules:\n{steps}")


def _private_below(module: str, unit: str) -> bool:
    """Whether `module` is a private module below the top-level unit `unit`."""
    if not module.startswith(unit + "."):
        return False
    return any(part.startswith("_") for part in module[len(unit) + 1 :].split("."))


def _unit(module: str) -> str:
    """The top-level unit of kups a module belongs to (`kups.effects`, `kups.harvest`)."""
    return ".".join(module.split(".")[:2])


def test_effects_import_only_public_names_of_the_framework():
    wrong = []
    for module in MODULES:
        if module == EFFECTS or module.startswith(EFFECTS + "."):
            continue
        for target, name, line in imports(module):
            if _private_below(target, EFFECTS):
                wrong.append(f"{MODULES[module].name}:{line} imports {target}")
            elif (target == EFFECTS or target.startswith(EFFECTS + ".")) and (
                name is not None and name.startswith("_")
            ):
                wrong.append(f"{MODULES[module].name}:{line} imports {name} from {target}")
    assert not wrong, "Private names of kups.effects imported outside it:\n" + "\n".join(wrong)


def test_no_module_imports_the_private_modules_of_another_part_of_kups():
    wrong = []
    for module in MODULES:
        for target, _, line in imports(module):
            unit = _unit(target)
            if (
                target.startswith("kups.")
                and unit != _unit(module)
                and _private_below(target, unit)
            ):
                wrong.append(f"{module} (line {line}) imports {target}")
    assert not wrong, "\n".join(wrong)


def _framework_private_attributes() -> set[str]:
    """The private attributes that framework objects (`Interpreter`, `Dispatcher`,
    ...) set on themselves: `self._x = ...` in a class of `kups.effects`."""
    names = set()
    for module, path in MODULES.items():
        if not module.startswith(EFFECTS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.ctx, ast.Store)
                and isinstance(node.value, ast.Name)
                and node.value.id == "self"
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                names.add(node.attr)
    return names


def test_framework_private_attributes_are_collected():
    attributes = _framework_private_attributes()
    assert {"_handlers", "_body_cache"} <= attributes


def test_effects_touch_no_private_attribute_of_framework_objects():
    private = _framework_private_attributes() | {"_policy_caller", "_acts_on"}
    wrong = []
    for module, path in MODULES.items():
        if module.startswith(EFFECTS):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private:
                wrong.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert not wrong, "Private attributes of framework objects used outside kups.effects:\n" + (
        "\n".join(wrong)
    )


EFFECT_PACKAGES = [f"kups.{name}" for name in ("harvest", "checks", "debug", "instrument")]
PACKAGES = ["kups", "kups.effects", "kups.effects.handlers", *EFFECT_PACKAGES]


@pytest.mark.parametrize("name", PACKAGES)
def test_package_init_only_reexports(name):
    """`dir(package)` is `__all__`, dunders and the package's own submodules (which
    Python sets on a package when they are imported); for an effect, `__all__`
    alone."""
    module = importlib.import_module(name)
    if not hasattr(module, "__path__"):
        return
    submodules = {
        attr
        for attr, value in vars(module).items()
        if isinstance(value, types.ModuleType) and value.__name__ == f"{name}.{attr}"
    }
    shown = {attr for attr in dir(module) if not (attr.startswith("__") and attr.endswith("__"))}
    extra = sorted(shown - submodules - set(module.__all__))
    missing = sorted(set(module.__all__) - set(dir(module)))
    assert not extra, f"{name} defines names outside __all__: {extra}"
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"
    if name in EFFECT_PACKAGES:
        # What a user of an effect sees: its public names and nothing else.
        assert dir(module) == sorted(module.__all__)
        assert all(hasattr(module, attr) for attr in submodules)  # still importable
