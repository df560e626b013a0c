"""The layers of model/ and kernels/ that the import contracts (pyproject.toml, on the built wheel) cannot see:
`routing.route_module` imports the route modules by name, so none may reach routing back; the hooks each route
module defines are route.RouteModule's and route.OptionalHooks'; an import inside a function, in model/, kernels/
or the pipeline (workflow/shapewise/), says why it waits."""

import ast
import inspect
from pathlib import Path

import pytest

from shapewise.model import routing
from shapewise.model.route import OptionalHooks, RouteModule

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "model"
ROUTE_MODULES = sorted({spec.module for spec in routing.ROUTE_SPECS.values()})


def _model_imports(name: str) -> set:
    """The modules of model/ that model/<name>.py imports, at its top or inside a function."""
    tree = ast.parse((MODEL / f"{name}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:  # from .x import ...
                found.add(node.module.split(".")[0])
            elif node.level == 1:  # from . import x
                found.update(alias.name for alias in node.names)
            elif node.level == 0 and (node.module or "").startswith("shapewise.model."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith("shapewise.model."))
    return {m for m in found if (MODEL / f"{m}.py").is_file()}


def _reached(name: str) -> set:
    seen, todo = set(), [name]
    while todo:
        for m in _model_imports(todo.pop()) - seen:
            seen.add(m)
            todo.append(m)
    return seen


def test_the_import_graph_is_read():
    """The reader sees what a route module imports (or the test below would pass on an empty graph)."""
    assert {"policy", "weights", "reference", "route_sdpa"} <= _reached("route_triton")
    assert "routing" in _reached("memory") and "routing" in _reached("streamed")


@pytest.mark.parametrize("module", ROUTE_MODULES)
def test_no_route_module_reaches_routing(module):
    """routing.route_module imports model/<module>.py by name (importlib): were routing among what it imports, at
    its top or in a function, the two would be a cycle no static contract sees."""
    assert "routing" not in _reached(module), f"model/{module}.py reaches routing: {sorted(_reached(module))}"


def _parameters(function) -> list:
    return [p for p in inspect.signature(function).parameters if p != "self"]


@pytest.mark.parametrize("name", routing.ROUTES)
def test_each_route_module_defines_the_hooks_of_the_interface(name):
    module = routing.route_module(name)
    assert isinstance(module, RouteModule), f"{module.__name__} lacks a hook of route.RouteModule"
    for protocol in (RouteModule, OptionalHooks):
        for hook, want in vars(protocol).items():
            if callable(want) and not hook.startswith("_") and hasattr(module, hook):
                assert _parameters(getattr(module, hook)) == _parameters(want), (module.__name__, hook)


def _deferred_imports(path: Path):
    """(line, has its reason) of each import inside a function of `path`: a `# deferred:` comment on its lines."""
    text = path.read_text()
    lines = text.splitlines()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    span = lines[inner.lineno - 1:inner.end_lineno]
                    yield inner.lineno, any("# deferred:" in line for line in span)


PIPELINE = ROOT / "workflow" / "shapewise"
SOURCES = [*sorted((ROOT / "model").glob("*.py")), *sorted((ROOT / "kernels").glob("*.py")),
           *sorted(PIPELINE.rglob("*.py"))]


def test_the_sources_are_found():
    """The pipeline's modules and its subpackages' are among the files checked below."""
    wanted = {PIPELINE / "cli.py", PIPELINE / "execution" / "jobserver.py", PIPELINE / "jobs" / "candidate" / "__init__.py"}
    assert wanted <= set(SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_an_import_inside_a_function_says_why_it_waits(path):
    """An import inside a function only defers a heavy one (triton, torch, matplotlib, pandas where the module
    imports none of them) or one that reads files when imported, and its comment says so: `# deferred: <reason>`.
    Every other import is at the module's top, where the import contracts (pyproject.toml) see it, so a cycle
    among modules cannot hide in a function."""
    bare = [line for line, why in _deferred_imports(path) if not why]
    assert not bare, f"{path.relative_to(ROOT)}: imports inside functions without a '# deferred:' reason at {bare}"
