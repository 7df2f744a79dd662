"""The layout's rules, read from the source: imports point down (kernels below model below engine below
train, server and demo), nothing outside the engine reaches into its parts or swaps its methods, the C++
ops have one door, and no Python file (the package, its tests, its benchmarks) outgrows 400 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "pagedrl"
MAX_LINES = 400
# What each room may not import: every room above it.
ABOVE = {
    "kernels": ("model", "engine", "train", "server", "demo"),
    "model": ("engine", "train", "server", "demo"),
    "engine": ("train", "server", "demo"),
    "train": ("server", "demo"),
    "server": ("train", "demo"),
}
IMPORT = re.compile(r"^\s*(?:from\s+pagedrl\.(\w+)|import\s+pagedrl\.(\w+))", re.M)
# The engine's parts: a caller uses LLM's, LLMEngine's and AsyncEngine's own methods instead.
REACH_IN = re.compile(r"\.(?:engine\.runner|engine\.engine|scheduler|kv_cache|kv_manager)\b")


def sources(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py"))


def room(path: Path) -> str:
    return path.relative_to(SRC).parts[0] if len(path.relative_to(SRC).parts) > 1 else ""


@pytest.mark.parametrize("path", sources(SRC), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path: Path) -> None:
    above = ABOVE.get(room(path), ())
    wrong = [m.group(1) or m.group(2) for m in IMPORT.finditer(path.read_text(encoding="utf-8"))
             if (m.group(1) or m.group(2)) in above]
    assert not wrong, f"{path.relative_to(SRC)} imports pagedrl.{wrong[0]}, a room above it"


def test_nothing_outside_the_engine_reaches_into_it() -> None:
    found = []
    for path in sources(SRC):
        if room(path) == "engine":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if REACH_IN.search(code) and not re.match(r"\s*(from|import)\s", code):
                found.append(f"{path.relative_to(SRC)}:{n}: {line.strip()}")
    assert not found, "reach-ins into the engine's parts:\n" + "\n".join(found)


def engine_attributes_set(tree: ast.AST) -> list[tuple[int, str]]:
    """Attributes assigned, deleted or `setattr`-ed on an engine (a name with `engine` in it, or any
    `<x>.engine`): where a caller would swap `step` or `add_request` for its own."""
    def is_engine(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and "engine" in node.id.lower()) or \
            (isinstance(node, ast.Attribute) and node.attr == "engine")

    def targets(node: ast.AST) -> list[ast.AST]:
        if isinstance(node, ast.Assign | ast.Delete):
            return node.targets
        if isinstance(node, ast.AugAssign | ast.AnnAssign):
            return [node.target]
        return []

    found = []
    for node in ast.walk(tree):
        stack = targets(node)
        while stack:
            target = stack.pop()
            if isinstance(target, ast.Tuple | ast.List):
                stack += target.elts
            elif isinstance(target, ast.Attribute) and is_engine(target.value):
                found.append((target.lineno, target.attr))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and is_engine(node.args[0]):
            found.append((node.lineno, node.func.id))
    return found


def test_nothing_outside_the_engine_swaps_its_methods() -> None:
    """A caller that needs to see every step adds a step observer (`LLMEngine.add_step_observer`)."""
    found = [f"{path.relative_to(SRC)}:{n}: .{attr}" for path in sources(SRC) if room(path) != "engine"
             for n, attr in engine_attributes_set(ast.parse(path.read_text(encoding="utf-8")))]
    assert not found, "attributes of the engine set from outside it:\n" + "\n".join(found)


def test_the_swap_rule_catches_what_it_should() -> None:
    tree = ast.parse("engine.step, engine.add_request = a, b\ndel llm.engine.step\nsetattr(engine, 'x', 1)\n"
                     "self.engine = e\nengine.step()\nx = engine.stats\n")
    assert engine_attributes_set(tree) == [(1, "add_request"), (1, "step"), (2, "step"), (3, "setattr")]


def test_the_cpp_ops_have_one_door() -> None:
    door = SRC / "kernels" / "ops.py"
    found = [str(p.relative_to(ROOT)) for p in sources(SRC, ROOT / "bench")
             if p != door and "torch.ops.pagedrl_cpu" in p.read_text(encoding="utf-8")]
    assert not found, f"call the C++ ops through pagedrl.kernels.ops, not torch.ops.pagedrl_cpu: {found}"


def test_no_python_file_over_the_limit() -> None:
    """The package, its tests and its benchmarks alike."""
    long = {str(p.relative_to(ROOT)): n for p in sources(SRC, ROOT / "tests", ROOT / "bench")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"split along the seams they have (over {MAX_LINES} lines): {long}"
