"""The package layers: every import inside ds_pfc (module level, inside functions and
under ``TYPE_CHECKING``) points down the table below, no modules import each other in a
circle, nothing inside ds_pfc imports the root package, at most 8 modules sit directly in
``ds_pfc/``, ``import ds_pfc`` loads neither deepspeed nor triton, and every module
imports on its own.

Layers (a package may import its own modules, and the modules of the layers named):

  L0  _checks _rng _args devices launchers _versions _ds_internals  other L0 modules
  L1  kernels bank data models eval                              L0 (eval also data)
  L2  core                                                       L0, bank, kernels
  L3  checkpoint                                                 L0, core
  L4  deepspeed_plugin                                           L0-L3
  L5  bench                                                      L0-L2, data
  L6  app                                                        L0-L5
  L7  cli                                                        L0-L6
  L8  selfcheck (the entry file of ``python -m ds_pfc.selfcheck``) cli
  root __init__                                                  L0, core, bank
"""
from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "ds_pfc")

L0 = {"_checks", "_rng", "_args", "devices", "launchers", "_versions", "_ds_internals"}
LAYER = {**{name: 0 for name in L0},
         "kernels": 1, "bank": 1, "data": 1, "models": 1, "eval": 1,
         "core": 2, "checkpoint": 3, "deepspeed_plugin": 4, "bench": 5, "app": 6, "cli": 7,
         "selfcheck": 8, "__init__": 9}

# What each top-level unit may import besides itself (the table in the docstring).
ALLOWED = {
    **{name: L0 for name in L0},
    "kernels": L0, "bank": L0, "data": L0, "models": L0, "eval": L0 | {"data"},
    "core": L0 | {"bank", "kernels"},
    "checkpoint": L0 | {"core"},
    "deepspeed_plugin": L0 | {"kernels", "bank", "data", "models", "eval", "core", "checkpoint"},
    "bench": L0 | {"kernels", "bank", "core", "data"},
    "app": {name for name, layer in LAYER.items() if layer <= 5},
    "cli": {name for name, layer in LAYER.items() if layer <= 6},
    "selfcheck": {"cli"},
    "__init__": L0 | {"core", "bank"},
}


def _modules() -> dict[str, str]:
    """``{dotted name: path}`` of every module of the package."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(PACKAGE):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for filename in sorted(filenames):
            if filename.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, filename), ROOT)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                found[".".join(rel)] = os.path.join(dirpath, filename)
    return found


MODULES = _modules()


def _imports(name: str, path: str) -> list[tuple[int, str]]:
    """``(line, absolute dotted name)`` of every ds_pfc import in the module, at any depth
    (``from . import x`` gives ``package.x``)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "ds_pfc"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "ds_pfc":
                continue
            for alias in node.names:
                full = f"{module}.{alias.name}"
                # ``from pkg import sub`` names a module when ``pkg.sub`` is one
                out.append((node.lineno, full if full in MODULES else module))
    return out


def _unit(dotted: str) -> str:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _unit_of_file(name: str, path: str) -> str:
    if name == "ds_pfc":
        return "__init__"
    return _unit(name)


def test_every_module_has_a_layer():
    missing = sorted({_unit_of_file(n, p) for n, p in MODULES.items()} - set(LAYER))
    assert not missing, f"modules outside the layer table: {missing}"


def test_imports_point_down():
    bad = []
    for name, path in MODULES.items():
        unit = _unit_of_file(name, path)
        for line, target in _imports(name, path):
            if target not in MODULES:
                continue        # reported by test_no_old_or_root_imports
            other = _unit(target) if target != "ds_pfc" else "__init__"
            if other != unit and other not in ALLOWED[unit]:
                bad.append(f"{os.path.relpath(path, ROOT)}:{line} ({unit}, L{LAYER[unit]}) imports {target} "
                           f"({other}, L{LAYER.get(other)})")
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_no_old_or_root_imports():
    """Inside ds_pfc nothing imports the root package (it is the public face, and importing
    it from below makes circles) nor a path that is not a module."""
    bad = []
    for name, path in MODULES.items():
        if name == "ds_pfc":
            continue
        for line, target in _imports(name, path):
            if target == "ds_pfc":
                bad.append(f"{os.path.relpath(path, ROOT)}:{line} imports the root package")
            elif target not in MODULES and target.rpartition(".")[0] not in MODULES:
                bad.append(f"{os.path.relpath(path, ROOT)}:{line} imports {target}, not a module of the package")
            elif target not in MODULES and target.rpartition(".")[0] == "ds_pfc":
                bad.append(f"{os.path.relpath(path, ROOT)}:{line} imports {target} from the root package")
    assert not bad, "\n".join(bad)


def test_import_loads_neither_deepspeed_nor_triton():
    code = ("import sys, ds_pfc\n"
            "print(sorted(m for m in ('deepspeed', 'triton') if m in sys.modules))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"import ds_pfc loaded {out.stdout.strip()}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_imports(name):
    if name.endswith(".triton_softmax") or name.endswith(".triton_optim"):
        pytest.importorskip("triton")
    module = importlib.import_module(name)
    assert module.__name__ == name


def test_no_import_circles():
    """No module reaches itself through the imports of others (type-only imports count:
    they are the same coupling), e.g. engine -> checkpointing -> engine."""
    graph = {name: {t for _, t in _imports(name, path) if t in MODULES and t != name}
             for name, path in MODULES.items()}
    # a package's __init__ importing its own modules is how packages are built, not a circle
    graph = {name: {t for t in targets if not t.startswith(name + ".")} for name, targets in graph.items()}
    done, stack, circles = set(), [], []

    def visit(node):
        if node in stack:
            circles.append(" -> ".join(stack[stack.index(node):] + [node]))
            return
        if node in done:
            return
        stack.append(node)
        for target in sorted(graph[node]):
            visit(target)
        stack.pop()
        done.add(node)
    for name in sorted(graph):
        visit(name)
    assert not circles, "import circles:\n" + "\n".join(sorted(set(circles)))


def test_at_most_eight_modules_sit_directly_in_the_package():
    top = sorted(n for n in os.listdir(PACKAGE) if n.endswith(".py") and n != "__init__.py")
    assert len(top) <= 8, top
