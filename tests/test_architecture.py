"""The dependency rule, checked on the source: layers import only the layers below them.

The rule is written once, in docs/architecture.md ("Layers and the dependency rule"); in short:

    schedules  ->  runtime  ->  hooks  ->  integrations (one module per framework), cli, train_examples
    (pure)       (torch.distributed)
    cost_model (pure), telemetry and viz are leaves that never import hooks.
    cost_model + telemetry records  ->  advisor (pure)  ->  hooks (state.advise), cli, integrations
    lab (emulated hosts; imports nothing of the package)  ->  cli (`lab`, `bench --link`)
    (the advisor reads the timeline's records, ``telemetry/timeline_records.py``, torch-free)
    links (the naming rule of slow links, pure; imports nothing of the package)  ->  runtime, telemetry, cli

Read with ``ast`` from the files themselves (nothing imported), so a new import that breaks
the rule fails here with the file and the line, before it becomes a cycle or a layer that
needs a process group to be tested.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # no test here starts a process

PACKAGE = Path(__file__).resolve().parents[1] / "ddp_ring_hooks"

#: Layer -> the layers of ours it may import (besides itself). Modules at the top of the package
#: (``bench``, ``interrupts``, ``launch``, ``machine``, ``progress``, ``units``) are layers of their own.
ALLOWED: dict[str, set[str]] = {
    "schedules": set(),
    "cost_model": {"schedules"},
    "progress": set(),
    "units": set(),
    "machine": set(),
    "interrupts": set(),
    "links": set(),
    "runtime": {"schedules", "cost_model", "links"},
    "telemetry": {"runtime", "schedules", "cost_model", "links"},
    "viz": {"schedules", "cost_model", "progress"},
    "advisor": {"schedules", "cost_model", "telemetry"},
    "hooks": {"schedules", "cost_model", "runtime", "telemetry", "advisor"},
    "launch": set(),
    "lab": set(),
    "bench": {"schedules", "cost_model", "runtime", "telemetry", "progress", "launch", "units"},
    # lightning.py, fabric.py, transformers.py: each the only module that imports its framework.
    "integrations": {"schedules", "cost_model", "runtime", "telemetry", "hooks", "advisor"},
    "cli": {"schedules", "cost_model", "runtime", "telemetry", "viz", "bench", "launch", "progress", "units", "hooks", "advisor",
            "lab", "links", "interrupts"},
}


def layer_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0].removesuffix(".py") if len(relative.parts) > 1 or relative.stem not in ("__init__", "__main__") else "package"


def imported_layers(path: Path, root: Path = PACKAGE.parent) -> list[tuple[str, int]]:
    """``(layer, line)`` for every import of another part of the package in ``path`` (a file
    under ``root``, the folder that holds the package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package_parts = path.relative_to(root).with_suffix("").parts[:-1]  # e.g. ("ddp_ring_hooks", "hooks")
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                target = (*base, *(node.module.split(".") if node.module else ()))
                names = [target] if node.module else [(*target, alias.name) for alias in node.names]
            else:
                names = [tuple((node.module or "").split("."))]
        elif isinstance(node, ast.Import):
            names = [tuple(alias.name.split(".")) for alias in node.names]
        else:
            continue
        for name in names:
            if len(name) >= 2 and name[0] == "ddp_ring_hooks":
                found.append((name[1], node.lineno))
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if layer_of(p) != "package")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_imports_only_the_layers_below_it(path):
    layer = layer_of(path)
    assert layer in ALLOWED, f"{path}: layer {layer!r} has no rule in ALLOWED; add one"
    wrong = [(other, line) for other, line in imported_layers(path) if other != layer and other not in ALLOWED[layer]]
    assert not wrong, f"{path.relative_to(PACKAGE)} ({layer}) imports " + ", ".join(
        f"{other} (line {line})" for other, line in wrong
    ) + f"; {layer} may import only {sorted(ALLOWED[layer]) or 'nothing of ours'}"


def test_the_rule_catches_an_import_that_breaks_it(tmp_path):
    # The checker itself: a schedules module importing the runtime is reported.
    bad = tmp_path / "ddp_ring_hooks" / "schedules" / "probe.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from ..runtime import run_schedule\nimport ddp_ring_hooks.hooks\nfrom . import ir\n")
    assert imported_layers(bad, root=tmp_path) == [("runtime", 1), ("hooks", 2), ("schedules", 3)]


def module_imports(path: Path, root: Path = PACKAGE.parent) -> set[str]:
    """Dotted names of the package's modules (not packages) that ``path`` imports, type-only
    imports included: a cycle through ``TYPE_CHECKING`` is still two modules owning one idea."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package_parts = path.relative_to(root).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package_parts[: len(package_parts) - node.level + 1] if node.level else ()
            target = (*base, *(node.module.split(".") if node.module else ()))
            candidates = [target, *((*target, alias.name) for alias in node.names)]
        elif isinstance(node, ast.Import):
            candidates = [tuple(alias.name.split(".")) for alias in node.names]
        else:
            continue
        for parts in candidates:
            if parts and parts[0] == "ddp_ring_hooks" and (root / Path(*parts)).with_suffix(".py").is_file():
                found.add(".".join(parts))
    return found


def test_no_two_modules_import_each_other():
    graph = {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): module_imports(p)
        for p in PACKAGE.rglob("*.py") if p.stem != "__init__"
    }
    cycles = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets if a in graph.get(b, ())})
    assert not cycles, f"modules that import each other (let one own the idea): {cycles}"


#: Each training framework is imported by its integration module only, so the rest of the
#: package works (and its tests run) without any of them installed.
FRAMEWORK_OWNERS = {
    "lightning.fabric": "integrations/fabric.py",
    "lightning.pytorch": "integrations/lightning.py",
    "pytorch_lightning": "integrations/lightning.py",
    "lightning": None,  # the umbrella package: import the part you mean
    "transformers": "integrations/transformers.py",
    "accelerate": None,  # register() takes what accelerator.prepare returns: no module needs it
}


def framework_of(module: str) -> str | None:
    """The framework a dotted import name belongs to (the longest matching prefix), if any."""
    matches = [name for name in FRAMEWORK_OWNERS if module == name or module.startswith(name + ".")]
    return max(matches, key=len, default=None)


def absolute_imports(path: Path) -> list[tuple[str, int]]:
    """``(dotted module, line)`` of every absolute import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_its_integration_imports_a_framework(path):
    here = path.relative_to(PACKAGE).as_posix()
    wrong = [
        (module, line) for module, line in absolute_imports(path)
        if (framework := framework_of(module)) is not None and FRAMEWORK_OWNERS[framework] != here
    ]
    assert not wrong, f"{here} imports " + ", ".join(f"{m} (line {n})" for m, n in wrong) + (
        "; only the framework's own module under integrations/ may (see FRAMEWORK_OWNERS)"
    )


def test_the_framework_rule_tells_the_frameworks_apart():
    assert framework_of("lightning.fabric.strategies") == "lightning.fabric"
    assert framework_of("lightning.pytorch") == "lightning.pytorch"
    assert framework_of("lightning_utilities") is None and framework_of("transformers_extra") is None
    imported = {framework_of(m) for p in (PACKAGE / "integrations").glob("*.py") for m, _ in absolute_imports(p)}
    assert {"lightning.fabric", "lightning.pytorch", "transformers"} <= imported
