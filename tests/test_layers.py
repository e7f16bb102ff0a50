"""The house's layering, checked over the import graph of the source (every import, those inside functions
included): no module imports another that imports it back, however far round; the packages point one way,
server -> engine -> scheduler; and inside the engine each room keeps to its floor:

    top        builder, llm, async_engine, engine (the step loop), platform (which parts run), bench, ...
    runner     the forward pass and sampling of a step          -> models, attention, sampling, structured, profiling
    models     the families, built from layers                  -> layers, attention, quantization, loading
    layers     linears, norms, rotary, the fused decode step    -> attention, kernels, quantization
    attention  backends, the paged KV cache and its spec        -> kernels
    spec_decode  the proposers of draft tokens                -> models, loading (a draft model's, to come)
    loading    checkpoints and GGUF files                       -> quantization, kernels
    profiling  step timings and bandwidth floors                -> quantization
    pooling    pooling requests' settings and the runner's pooling (a floor: engine.errors only)
    quantization, kernels (the floor: kernels import nothing of the engine but its cache folder)
    distributed  the step broadcast and all-reduce of ranks    (a floor of its own: imports nothing of the engine)

A new import that breaks one of these fails here, with the edge that broke it."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "server", "scheduler", "benchmarks", "scripts")
HTTP_LIBRARIES = ("fastapi", "starlette", "uvicorn", "httpx")
ENGINE_FORBIDDEN = {  # engine room -> rooms it must not import
    "kernels": {
        "attention",
        "layers",
        "models",
        "runner",
        "loading",
        "quantization",
        "sampling",
        "structured",
        "text",
        "profiling",
        "platform",
        "builder",
        "engine",
        "llm",
        "async_engine",
    },
    "quantization": {"loading", "attention", "layers", "models", "runner", "platform", "builder"},
    "loading": {"attention", "layers", "models", "runner", "platform", "builder"},
    "attention": {"layers", "models", "runner", "loading", "quantization", "sampling", "platform", "builder"},
    "layers": {"models", "runner", "loading", "platform", "builder", "llm", "async_engine", "engine"},
    "models": {"runner", "platform", "builder", "llm", "async_engine", "engine"},
    "profiling": {"runner", "models", "layers", "platform", "builder", "llm", "async_engine", "engine"},
    "runner": {"platform", "builder", "llm", "async_engine"},
    "spec_decode": {"runner", "platform", "builder", "llm", "async_engine", "engine"},
    "pooling": {  # a floor: loading's model config and the runner read it
        p.stem for p in (ROOT / "engine").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()
    }
    - {"pooling", "errors", "__init__"},
    "distributed": {  # a floor: workers receive the step message through it, whatever rooms they run
        p.stem for p in (ROOT / "engine").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()
    }
    - {"distributed", "__init__"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] == "scripts" and len(parts) > 1 and parts[1] == "gpucheck":
        parts = parts[1:]  # scripts/gpu_check.py puts scripts/ on sys.path: its parts import as gpucheck.*
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str) -> set[str]:
    """Every module `path` imports, as absolute names (relative imports resolved)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports."""
    files = {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    return {name: {i for i in imports_of(path, name) if i in files and i != name} for name, path in files.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_back(graph):
    assert cycles(graph) == []


def engine_room(module: str) -> str:
    """engine.attention.backend -> attention; engine.builder -> builder (a module at the engine's top)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_the_engine_rooms_form_no_circle(graph):
    rooms: dict[str, set[str]] = defaultdict(set)
    for module, imported in graph.items():
        if module.startswith("engine."):
            for other in imported:
                if other.startswith("engine.") and engine_room(other) != engine_room(module):
                    rooms[engine_room(module)].add(engine_room(other))
    assert cycles(rooms) == []


def test_each_engine_room_keeps_to_its_floor(graph):
    broken = sorted(
        f"{module} -> {other}"
        for module, imported in graph.items()
        if module.startswith("engine.")
        for other in imported
        if other.startswith("engine.") and engine_room(other) in ENGINE_FORBIDDEN.get(engine_room(module), ())
    )
    assert broken == []


def test_packages_point_one_way(graph):
    """server -> engine -> scheduler; benchmarks and scripts above them all, never imported by them."""
    above = {
        "scheduler": ("engine", "server", "benchmarks", "gpucheck", "scripts"),
        "engine": ("server", "benchmarks", "gpucheck", "scripts"),
        "server": ("benchmarks", "gpucheck", "scripts"),
    }
    broken = sorted(
        f"{module} -> {other}"
        for module, imported in graph.items()
        for other in imported
        if other.split(".")[0] in above.get(module.split(".")[0], ())
    )
    assert broken == []


@pytest.mark.parametrize(
    "package, libraries", [("scheduler", ("torch", "numpy", *HTTP_LIBRARIES)), ("engine", HTTP_LIBRARIES)]
)
def test_lower_packages_import_no_library_of_the_rooms_above(package, libraries):
    broken = sorted(
        f"{module_name(path)} imports {name}"
        for path in (ROOT / package).rglob("*.py")
        for name in imports_of(path, module_name(path))
        if name.split(".")[0] in libraries
    )
    assert broken == []


def test_the_checker_sees_a_cycle_and_a_relative_import(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    path = ROOT / "engine" / "attention" / "backend.py"
    assert "engine.attention.kv_cache" in imports_of(path, "engine.attention.backend")


GENERATION_ROUTES = ("server.openai.chat", "server.openai.completions", "server.openai.responses.route")


@pytest.mark.parametrize("route", GENERATION_ROUTES)
def test_generation_routes_only_translate_into_the_one_pipeline(graph, route):
    """A generation route translates its protocol into a GenerationRequest and writes the Generation back;
    checking, admitting, queueing in the engine and reading its streams are the pipeline's alone."""
    imported = graph[route]
    assert "server.serving.pipeline" in imported
    pipeline_parts = (
        "server.serving.admission",
        "server.serving.request_guard",
        "server.serving.streams",
        "server.serving.checks",
        "server.serving.sampling_params",
        "engine.async_engine",
        "engine.request_stream",
        "engine.sampling.params",
        "engine.sampling.parallel",
        "scheduler",
    )
    broken = sorted(name for name in imported if name.startswith(pipeline_parts))
    assert broken == []
