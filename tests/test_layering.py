"""The import directions docs/architecture.md states, checked on the source's AST so they cannot drift.

    contract   <- plugins <- builder
    contract   <- chat    <- runtime, builder, triton_repo, server
    contract   <- runtime <- builder, triton_repo, server
    testkit    (test support) may import any part; no product part imports it

Every import counts, at module level or inside a function (a lazy import is still a dependency). Two exceptions
are stated and held here: the runtime imports the plugins only in the TensorRT session (plugin registration), and
the builder imports the Triton repository only in its CLI (`v4build triton-repo`). torch is imported by no module
at import time in contract/, runtime/ or triton_repo/, and inside functions only where tensors live on a device:
runtime/pool_arrays.py, runtime/sessions/ and runtime/samplers.py (tokens decided where the logits are).

Backends: generic code never branches on a backend's name; what differs by backend lives on its record
(contract/backends.py) or in its own modules (runtime/sessions/<name>.py, builder/backends/<name>.py).
"""
from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("contract", "plugins", "chat", "runtime", "builder", "triton_repo", "server", "testkit")
MAY_IMPORT = {
    "contract": {"contract"},
    "plugins": {"contract", "plugins"},
    "chat": {"contract", "chat"},
    "runtime": {"contract", "chat", "runtime"},
    "builder": {"contract", "plugins", "chat", "runtime", "builder"},
    "triton_repo": {"contract", "chat", "runtime", "triton_repo"},
    "server": {"contract", "chat", "runtime", "server"},
    "testkit": set(PARTS),
}
EXCEPTIONS = {("runtime/sessions/tensorrt.py", "plugins"), ("builder/cli.py", "triton_repo")}
TORCH_FREE = ("contract", "chat", "runtime", "triton_repo", "server")   # no torch at import time
LAZY_TORCH = ("runtime/pool_arrays.py", "runtime/sessions/", "runtime/samplers.py")   # torch inside functions,
                                                                                     # tensors on a device


@dataclass(frozen=True)
class Import:
    file: str            # relative to the root, e.g. runtime/scheduler.py
    line: int
    module: str          # absolute, e.g. v4engine.contract.layout or torch
    top_level: bool      # executed at import time (not inside a function)


def imports(root: Path, part: str) -> list[Import]:
    """Every import statement of a part's modules, relative ones made absolute."""
    out = []
    for path in sorted((root / part).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        package = ["v4engine", *path.relative_to(root).parent.parts]
        tree = ast.parse(path.read_text(), filename=rel)
        nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                names = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            else:
                continue
            out += [Import(rel, node.lineno, name, id(node) not in nested) for name in names]
    return out


def violations(root: Path) -> list[str]:
    """Each import that breaks a stated direction, as `file:line imports module (why)`."""
    found = []
    for part in PARTS:
        for imp in imports(root, part):
            words = imp.module.split(".")
            if words[0] == "v4engine" and len(words) > 1:
                target = words[1]
                if target == "testkit" and part != "testkit":
                    found.append(f"{imp.file}:{imp.line} imports {imp.module} (no product part imports testkit)")
                elif target not in MAY_IMPORT[part] and (imp.file, target) not in EXCEPTIONS:
                    found.append(f"{imp.file}:{imp.line} imports {imp.module} ({part} may import "
                                 f"{', '.join(sorted(MAY_IMPORT[part]))})")
            elif words[0] == "torch" and part in TORCH_FREE:
                if imp.top_level:
                    found.append(f"{imp.file}:{imp.line} imports torch at import time")
                elif not imp.file.startswith(LAZY_TORCH):
                    found.append(f"{imp.file}:{imp.line} imports torch outside {', '.join(LAZY_TORCH)}")
    return found


def test_every_import_follows_the_stated_directions():
    assert violations(ROOT) == []


def test_the_exceptions_are_still_needed():
    """A stated exception no import uses any more is removed from the docs and from here."""
    used = {(imp.file, imp.module.split(".")[1]) for part in PARTS for imp in imports(ROOT, part)
            if imp.module.startswith("v4engine.")}
    assert EXCEPTIONS <= used


def test_a_planted_import_against_a_direction_is_named(tmp_path):
    for part in PARTS:
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    layout = tmp_path / "contract" / "layout.py"
    layout.write_text(layout.read_text() + "\n\ndef planted():\n    from ..runtime import scheduler\n")
    pools = tmp_path / "runtime" / "cache.py"
    pools.write_text("import torch\n" + pools.read_text())
    assert violations(tmp_path) == [
        f"contract/layout.py:{len(layout.read_text().splitlines())} imports v4engine.runtime "
        "(contract may import contract)",
        "runtime/cache.py:1 imports torch at import time"]


BACKEND_NAMES = {"onnxruntime", "tensorrt", "migraphx"}


def backend_branches(root: Path) -> list[str]:
    """Comparisons with a backend's name (`backend == "tensorrt"`, `in ("onnxruntime", ...)`) outside the
    backends' own modules."""
    found = []
    for part in ("contract", "runtime", "builder", "triton_repo"):
        for path in sorted((root / part).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if path.stem in BACKEND_NAMES and path.parent.name in ("sessions", "backends"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare):
                    names = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant)} & BACKEND_NAMES
                    if names:
                        found.append(f"{rel}:{node.lineno} compares with {', '.join(sorted(names))}")
    return found


def test_generic_code_never_branches_on_a_backends_name():
    assert backend_branches(ROOT) == []
