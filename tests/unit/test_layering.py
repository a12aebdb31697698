"""The import graph (issue 22): no cycles, no upward imports, the router reaches into the worker
only through its public protocol package and its media encoding (on purpose: spoken chat
answers), and the third-party packages the router pulls in are a stated list (issue 47). Read from
the source with `ast`: every import, at module level or inside a function, counts (TYPE_CHECKING
imports too)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.util import ROOT

# Each package's layers, lowest first: a module may import its own layer or a lower one.
LAYERS: dict[str, list[tuple[str, ...]]] = {
    "worker": [
        ("worker.protocol",),
        ("worker.media_encoding",),
        ("worker.text",),
        ("worker.torch_model",),
        ("worker.backends",),
        ("worker.engine",),
        ("worker.speech",),
        ("worker.server",),
        ("worker.testing",),
    ],
    "router": [
        ("router.presets", "router.worker_flags", "router.events", "router.endless", "router.log_ring",
         "router.upstream",
         "router.prompt_cache_dir", "router.keys.keyfile", "router.keys.context", "router.hub",
         "router.discovery", "router.variants"),
        ("router.lifecycle",),
        ("router.placement",),
        ("router.observability",),
        ("router.keys",),  # but its keyfile and context, which Pool.get and the request traces read
        ("router.responses", "router.anthropic", "router.ollama", "router.speech"),
        ("router.http",),
        ("router.cli", "router.banner"),
    ],
}


# What of the worker the router may import: the contract, and the media encoding it uses on purpose.
ROUTER_MAY_USE = ("worker.protocol", "worker.media_encoding")
# Every third-party package the router imports, itself or through the worker modules it may use,
# and the modules that may import it (prefixes). A new one is a decision: add it here, with why.
_ROUTER = ("router", *ROUTER_MAY_USE)
ROUTER_THIRD_PARTY: dict[str, tuple[str, ...]] = {
    "starlette": _ROUTER,  # the ASGI app, requests and responses
    "uvicorn": ("router.cli",),  # serving it
    "typer": ("router.cli", "router.hub.pull_cli", "router.keys.cli"),  # the command lines
    "pydantic": _ROUTER,  # wire types at the edge
    "httpx": _ROUTER,  # workers' admin routes, https remote upstreams
    "httptools": ("router.upstream",),  # the proxy's hot-path HTTP/1.1 parser
    "prometheus_client": _ROUTER,  # GET /metrics
    "psutil": ("router.lifecycle", "router.placement"),  # a worker's process tree and its memory
    "ray": ("router.placement",),  # `--ray`: workers on other nodes (optional)
    "llguidance": ("worker.protocol.sampling",),  # a grammar's type, for type checking only
    # spoken chat answers (router/speech/): samples joined and encoded
    "numpy": ("router.speech", "worker.media_encoding"),
    "soundfile": ("worker.media_encoding",),  # flac, mp3, opus (libsndfile)
    "av": ("worker.media_encoding",),  # aac (FFmpeg)
    "huggingface_hub": ("router.hub",),  # pulling a model from a hub (issue 48)
    "filelock": ("router.hub",),  # one download per file across processes (huggingface_hub's own lock)
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _raw_imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for top in ("router", "worker"):
        for path in sorted((ROOT / top).rglob("*.py")):
            name = _module_name(path)
            found: set[str] = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    found.add(node.module)
                    found.update(f"{node.module}.{a.name}" for a in node.names)
            graph[name] = found
    return graph


def _imports() -> dict[str, set[str]]:
    graph = _raw_imports()
    modules = set(graph)
    return {m: {i for i in deps if i in modules and i != m} for m, deps in graph.items()}


def _layer(module: str) -> tuple[str, int] | None:
    top = module.split(".")[0]
    for rank, prefixes in enumerate(LAYERS.get(top, [])):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return top, rank
    return None


def test_every_module_has_a_layer() -> None:
    missing = [m for m in _imports() if "." in m and _layer(m) is None]
    assert not missing, f"add these to LAYERS: {missing}"


def test_no_upward_imports() -> None:
    upward = []
    for module, deps in _imports().items():
        here = _layer(module)
        for dep in deps:
            there = _layer(dep)
            if here and there and here[0] == there[0] and there[1] > here[1]:
                upward.append(f"{module} -> {dep}")
    assert not upward, upward


# Known breaches, each to be removed by the work that owns it (not new exceptions to the rule).
# (None now: issue 49's catalog reads the FIM token texts from worker.protocol.fim_tokens and asks
# the loaded worker whether its template renders tools.)
KNOWN_BREACHES: set[str] = set()


def test_the_router_imports_only_the_workers_protocol_and_media_encoding() -> None:
    bad = {f"{m} -> {d}" for m, deps in _imports().items() if m.startswith("router")
           for d in deps if d.startswith("worker") and not d.startswith(ROUTER_MAY_USE)}
    assert bad <= KNOWN_BREACHES, sorted(bad - KNOWN_BREACHES)


def test_the_router_imports_only_the_third_party_packages_it_states() -> None:
    """The router's modules and the worker modules it may use import only ROUTER_THIRD_PARTY's
    packages, each only where stated (numpy, soundfile and PyAV only for spoken answers)."""
    raw = _raw_imports()
    bad = []
    for module, deps in raw.items():
        if not module.startswith(_ROUTER):
            continue
        for dep in deps:
            top = dep.split(".")[0]
            if top in ("router", "worker", "__future__") or top in sys.stdlib_module_names:
                continue
            allowed = ROUTER_THIRD_PARTY.get(top)
            if allowed is None or not module.startswith(allowed):
                bad.append(f"{module} -> {top}")
    assert not bad, f"state these in ROUTER_THIRD_PARTY (or do without them): {sorted(set(bad))}"


def test_no_import_cycles() -> None:
    graph = _imports()
    # A package's __init__ importing its own modules is not a cycle in the sense that matters.
    edges = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges[m]):
            if state.get(d) == 1:
                cycles.append([*stack[stack.index(d):], d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, cycles


def test_every_package_maps_its_modules() -> None:
    # Each package's __init__ docstring names every module (and subpackage) in it, one line each.
    missing = []
    for init in sorted([*(ROOT / "router").rglob("__init__.py"), *(ROOT / "worker").rglob("__init__.py")]):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        names = {p.stem for p in init.parent.glob("*.py") if p.stem != "__init__"}
        names |= {p.name for p in init.parent.iterdir() if (p / "__init__.py").is_file()}
        missing += [f"{init.parent.relative_to(ROOT)}: {n}" for n in sorted(names) if n not in doc]
    assert not missing, missing


def test_a_module_over_500_lines_says_why() -> None:
    """House style: modules stay small; one that grows past 500 lines states in its docstring
    why it is one file ("Why one file of over 500 lines: ...")."""
    long = []
    for path in sorted([*(ROOT / "router").rglob("*.py"), *(ROOT / "worker").rglob("*.py")]):
        text = path.read_text()
        if text.count("\n") > 500:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Why one file of over 500 lines:" not in doc:
                long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert not long, long
