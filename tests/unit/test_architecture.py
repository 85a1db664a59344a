"""The package structure of docs/ARCHITECTURE.md, enforced: no import cycle between ucp modules
(imports inside functions included), no import against the documented direction, the format apart from the storage
backends, and folders that stay small enough to read at a glance."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Source folders and the package each is installed as (setup.cfg's package_dir).
SOURCES = {"ucp": "ucp", "converters": "ucp.converters", "patterns": "ucp.patterns", "cli": "ucp.cli"}

# docs/ARCHITECTURE.md, "Direction of imports": lowest first. A module may import modules of its own
# layer or of lower ones; a module belongs to the layer of its longest matching prefix.
LAYERS = (
    ("ucp.errors", "ucp.version", "ucp.sizes", "ucp.progress", "ucp.collectives"),
    ("ucp.patterns",),
    ("ucp.storage",),
    ("ucp.format",),
    ("ucp.plan",),
    ("ucp.converters",),
    ("ucp.convert", "ucp.checkpoint"),
    ("ucp.hmp",),
    ("ucp.elastic",),
    # ucp.deepspeed's rooms: what an engine holds, the one reading of the "ucp" section, the save, then the load and
    # the memory tier; the start, the life and the exit at the top of the package.
    ("ucp.deepspeed.engine",),
    ("ucp.deepspeed.config",),
    ("ucp.deepspeed.saving",),
    ("ucp.deepspeed.loading", "ucp.deepspeed.memory"),
    ("ucp.deepspeed",),
    ("ucp.export", "ucp.transformers", "ucp.accelerate", "ucp.lightning", "ucp.elastic.ray_train"),
    ("ucp.cli",),
    ("ucp",),
)


# The storage backends (docs/ARCHITECTURE.md, "Storage"): reached only through `ucp.storage.layer`'s dispatch.
BACKENDS = ("ucp.storage.local", "ucp.storage.remote", "ucp.storage.s3", "ucp.storage.fsspec")
# The most modules (`__init__` aside) a folder of the package holds, and the most modules of one folder whose names
# share a prefix (the words before the first "_": `save_plan`, `save_index` and `save_files` make a folder `save`).
MAX_MODULES = 15
MAX_SHARING_A_PREFIX = 2


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The ucp modules `name` imports anywhere in its body (functions included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base not in known:
                continue
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            out.update(subs or [base])
            if subs and len(subs) < len(node.names):
                out.add(base)
    out.discard(name)
    return out


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def layer_of(module: str) -> int:
    best = max((p for layer in LAYERS for p in layer if module == p or module.startswith(p + ".")), key=len)
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_imports_follow_the_documented_direction():
    # `from ucp import __version__` reads the root package's version string, not a module.
    wrong = sorted(f"{a} -> {b}" for a, targets in graph().items() for b in targets
                   if b != "ucp" and layer_of(b) > layer_of(a))
    assert wrong == []


def format_imports_of_backends(edges: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                  if (a == "ucp.format" or a.startswith("ucp.format.")) and b in BACKENDS)


def test_the_format_imports_no_storage_backend():
    # What the bytes mean never depends on where they live: the format reads and writes through ucp.storage.layer.
    assert format_imports_of_backends(graph()) == []


def folder_problems(names_by_folder: dict[str, list[str]]) -> list[str]:
    """Each folder with more than MAX_MODULES modules, and each prefix shared by more than MAX_SHARING_A_PREFIX
    modules of one folder (`names_by_folder`: a folder's module names, without `.py`)."""
    out = []
    for folder, names in sorted(names_by_folder.items()):
        names = [n for n in names if n != "__init__"]
        if len(names) > MAX_MODULES:
            out.append(f"{folder}: {len(names)} modules")
        prefixes: dict[str, list[str]] = {}
        for name in names:
            if "_" in name.strip("_"):
                prefixes.setdefault(name.strip("_").split("_")[0], []).append(name)
        out.extend(f"{folder}: {sorted(shared)} share {prefix}_" for prefix, shared in sorted(prefixes.items())
                   if len(shared) > MAX_SHARING_A_PREFIX)
    return out


def source_folders() -> dict[str, list[str]]:
    folders: dict[str, list[str]] = {}
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            folders.setdefault(str(path.parent.relative_to(ROOT)), []).append(path.stem)
    return folders


def test_folders_stay_small_and_a_shared_prefix_is_a_folder():
    assert folder_problems(source_folders()) == []


def test_the_checks_see_a_backend_import_a_big_folder_and_a_shared_prefix():
    # Negative controls for the two checks above.
    assert format_imports_of_backends({"ucp.format.index": {"ucp.storage.s3", "ucp.storage.layer"}}) == [
        "ucp.format.index -> ucp.storage.s3"]
    big = {"ucp/x": ["__init__", *(f"m{i}" for i in range(MAX_MODULES + 1))]}
    assert folder_problems(big) == [f"ucp/x: {MAX_MODULES + 1} modules"]
    assert folder_problems({"ucp/x": ["__init__", "save_plan", "save_index", "save_files", "plan_common"]}) == [
        "ucp/x: ['save_files', 'save_index', 'save_plan'] share save_"]
    assert folder_problems({"ucp/x": ["save_plan", "save_index", "_private", "index"]}) == []


def test_the_checks_see_a_cycle_and_a_wrong_direction():
    # Negative controls for the two checks above, on a made-up graph.
    edges = {"ucp.format.a": {"ucp.convert.driver"}, "ucp.convert.driver": {"ucp.format.a"}}
    assert cycles(edges) == [["ucp.convert.driver", "ucp.format.a"]]
    assert layer_of("ucp.format.a") < layer_of("ucp.convert.driver")
    assert layer_of("ucp.plan.plan") < layer_of("ucp.converters.deepspeed.zero") < layer_of("ucp.convert.driver")
    assert layer_of("ucp.deepspeed.engine.targets") < layer_of("ucp.deepspeed.config") < layer_of(
        "ucp.deepspeed.saving.saver") < layer_of("ucp.deepspeed.memory.tier") < layer_of("ucp.deepspeed.hook")


@pytest.mark.parametrize("module", sorted(modules()))
def test_every_module_has_a_layer(module):
    assert 0 <= layer_of(module) < len(LAYERS)
