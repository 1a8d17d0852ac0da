"""The layout shows the architecture: rules on the source tree itself, checked with `ast`.

- no import cycle between modules of node/, dht/, protocol/ (every import counts: top-level, inside
  functions, under TYPE_CHECKING; `from X import Y` counts as an import of X.Y when Y is a module;
  the parent packages Python initialises on the way are not counted as imports);
- layering: protocol/ imports nothing from dht/ or node/, dht/ nothing from node/; node/'s
  subpackages import only earlier ones in NODE_ORDER (node/stage/, the worker's floor, below
  pipeline, averaging, recovery, simulate and server);
- node/ holds at most 6 loose modules beside its subpackages;
- no module over 500 lines, no class over 300 lines (node/, dht/, protocol/), but for the few
  reviewed exceptions in SIZE_EXCEPTIONS, each held to its own allowance and dropped once it is
  back under the cap;
- a stage worker's training position (inner_step, last_grad_norm, lr_scale) is written by the
  worker alone (StageWorker.adopt for a state from elsewhere), never assigned from outside;
- nothing outside node/stage/ reads or writes a stage worker's module (`worker.module`): the floor's
  functions and StageWorker's methods are the way in;
- nothing points at the old algorithms notes outside docs/ (see OLD_NOTES).
"""

from __future__ import annotations

import ast
import itertools
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("node", "dht", "protocol")
SIZE_CHECKED = PACKAGES  # the product packages; test case tables may be long
LAYERS = {"protocol": {"dht", "node"}, "dht": {"node"}}  # package -> packages it must not import
MAX_LOOSE_NODE_MODULES = 6
MAX_MODULE_LINES = 500
MAX_CLASS_LINES = 300
# The caps' reviewed exceptions: "path" (a module) or "path::Class" -> (lines allowed, why this one
# may be longer). A module squeezed under a cap reads worse than one listed here; the list stays
# short because an entry back under the cap, or naming what no longer exists, fails the test.
SIZE_EXCEPTIONS: dict[str, tuple[int, str]] = {
    "node/stage/stage_worker.py::StageWorker": (
        310,
        "the floor's one way in to a stage: every compute and state method of a worker, on the worker",
    ),
}
OLD_NOTES = "shared/" + "ALGORITHMS"  # split, so that this file does not mention it itself
TRAINING_POSITION = {"inner_step", "last_grad_norm", "lr_scale"}  # StageWorker's, written by itself only

Graph = dict[str, dict[str, list[str]]]  # module -> imported module -> ["path:line", ...]


# ------------------------------------------------------------------------------------------------
# The import graph


def python_files(root: Path, packages: tuple[str, ...]) -> list[Path]:
    return sorted(p for package in packages for p in (root / package).rglob("*.py") if "__pycache__" not in p.parts)


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str, modules: set[str]) -> str | None:
    """The project module `name` refers to: itself, or its longest prefix that is a module."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [target for alias in node.names if (target := _resolve(alias.name, modules))]
    base = node.module or ""
    if node.level:  # relative: from the current package, one level up per extra dot
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    targets = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        target = submodule if submodule in modules else _resolve(base, modules)
        if target:
            targets.append(target)
    return targets


def import_graph(root: Path, packages: tuple[str, ...]) -> Graph:
    """Every import between the project's modules, wherever it sits in the file."""
    files = {module_name(root, path): path for path in python_files(root, packages)}
    modules = set(files)
    graph: Graph = {module: {} for module in modules}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(node, module, path.name == "__init__.py", modules):
                    if target != module:
                        graph[module].setdefault(target, []).append(f"{path.relative_to(root)}:{node.lineno}")
    return graph


def find_cycles(graph: Graph) -> list[list[str]]:
    """One cycle (as a closed path [a, b, ..., a]) per strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for group in groups:  # shortest way back to the group's first module, inside the group
        start, members = group[0], set(group)
        previous: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in previous:
            following = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in members and w not in previous:
                        previous[w] = v
                        following.append(w)
            frontier = following
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(previous[path[-1]])
        cycles.append(path[::-1])
    return cycles


def describe(cycle: list[str], graph: Graph) -> str:
    hops = [cycle[0]] + [f"-> {b} ({', '.join(graph[a][b])})" for a, b in itertools.pairwise(cycle)]
    return "  " + " ".join(hops)


@pytest.fixture(scope="module")
def graph() -> Graph:
    return import_graph(ROOT, PACKAGES)


def test_no_module_imports_a_module_that_imports_it_back(graph):
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (module -> imported module (where)):\n" + "\n".join(
        describe(c, graph) for c in cycles
    )


def layer_violations(graph: Graph) -> list[str]:
    return [
        f"  {module} imports {target} ({', '.join(where)})"
        for module, targets in sorted(graph.items())
        for target, where in sorted(targets.items())
        if target.split(".")[0] in LAYERS.get(module.split(".")[0], set())
    ]


def test_lower_layers_import_nothing_from_higher_ones(graph):
    offenders = layer_violations(graph)
    assert not offenders, "protocol/ must not import dht/ or node/, dht/ must not import node/:\n" + "\n".join(
        offenders
    )


# node/'s subpackages in dependency order (docs/architecture.md): each may import the ones before it
# (and node.config, dht, protocol), never one after it. node's loose modules (cli, demo, ...) sit
# on top and may import anything.
NODE_ORDER = ("runtime", "p2p", "model", "stage", "pipeline", "averaging", "recovery", "simulate", "server", "monitor")


def node_order_violations(graph: Graph) -> list[str]:
    def rank(module: str) -> int | None:
        parts = module.split(".")
        if parts[0] != "node" or len(parts) < 2:
            return None
        return NODE_ORDER.index(parts[1]) if parts[1] in NODE_ORDER else None

    offenders = []
    for module, targets in sorted(graph.items()):
        mine = rank(module)
        if mine is None:
            continue
        for target, where in sorted(targets.items()):
            theirs = rank(target)
            if theirs is None and target.startswith("node.") and target.split(".")[1] not in ("config", "__init__"):
                theirs = len(NODE_ORDER)  # a loose top-level module (cli, demo, local_swarm): above everything
            if theirs is not None and theirs > mine:
                offenders.append(f"  {module} imports {target} ({', '.join(where)})")
    return offenders


def test_node_subpackages_depend_one_way(graph):
    offenders = node_order_violations(graph)
    assert not offenders, f"node/ subpackages must only import earlier ones in {NODE_ORDER}:\n" + "\n".join(offenders)


def test_the_stage_floor_sits_below_every_package_that_uses_a_worker():
    above = ("pipeline", "averaging", "recovery", "simulate", "server")
    assert all(NODE_ORDER.index("stage") < NODE_ORDER.index(package) for package in above)
    graph: Graph = {
        "node.stage.stage_worker": {f"node.{package}.x": ["node/stage/stage_worker.py:1"] for package in above},
        "node.pipeline.traffic": {"node.stage.stage_worker": ["node/pipeline/traffic.py:1"]},
    }
    graph["node.stage.stage_worker"]["node.model.llama"] = ["node/stage/stage_worker.py:2"]
    assert node_order_violations(graph) == [
        f"  node.stage.stage_worker imports node.{package}.x (node/stage/stage_worker.py:1)"
        for package in sorted(above)
    ]


# ------------------------------------------------------------------------------------------------
# Sizes


def test_node_has_few_loose_modules_beside_its_subpackages():
    loose = sorted(p.name for p in (ROOT / "node").glob("*.py"))
    assert len(loose) <= MAX_LOOSE_NODE_MODULES, (
        f"node/ holds {len(loose)} loose modules (at most {MAX_LOOSE_NODE_MODULES}, __init__.py counted): {loose}"
    )


def sizes(root: Path, packages: tuple[str, ...]) -> dict[str, int]:
    """Lines of every module ("path") and class ("path::Class", its decorators counted) under `packages`."""
    found = {}
    for path in python_files(root, packages):
        text, name = path.read_text(encoding="utf-8"), path.relative_to(root).as_posix()
        found[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if isinstance(node, ast.ClassDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = (node.end_lineno or node.lineno) - start + 1
                key = f"{name}::{node.name}"
                found[key] = max(found.get(key, 0), lines)
    return found


def size_findings(sizes: dict[str, int], exceptions: dict[str, tuple[int, str]]) -> list[str]:
    """What breaks the caps: a module or class over its cap (or over its listed allowance), and a
    listed exception that is back under the cap or no longer exists."""

    def cap(name: str) -> int:
        return MAX_CLASS_LINES if "::" in name else MAX_MODULE_LINES

    findings = []
    for name, lines in sorted(sizes.items()):
        allowed = exceptions[name][0] if name in exceptions else cap(name)
        if lines > allowed:
            limit = "its listed allowance" if name in exceptions else "the cap"
            findings.append(f"  {name}: {lines} lines, over {limit} of {allowed}")
    for name in sorted(exceptions):
        if name not in sizes:
            findings.append(f"  {name}: listed, but no such module or class: drop it from SIZE_EXCEPTIONS")
        elif sizes[name] <= cap(name):
            findings.append(
                f"  {name}: {sizes[name]} lines, within the cap of {cap(name)}: drop it from SIZE_EXCEPTIONS"
            )
    return findings


def test_modules_and_classes_keep_to_their_caps_and_the_exceptions_stay_few():
    findings = size_findings(sizes(ROOT, SIZE_CHECKED), SIZE_EXCEPTIONS)
    assert not findings, (
        f"modules over {MAX_MODULE_LINES} lines, classes over {MAX_CLASS_LINES} (or a reviewed exception's "
        "allowance), stale exceptions:\n" + "\n".join(findings)
    )


def test_every_size_exception_says_why_and_allows_more_than_the_cap():
    for name, (allowed, why) in SIZE_EXCEPTIONS.items():
        assert why.strip(), f"{name}: no reason given"
        assert allowed > (MAX_CLASS_LINES if "::" in name else MAX_MODULE_LINES), f"{name}: allows no more than the cap"


def test_the_size_check_fails_unlisted_overlong_ones_overrun_allowances_and_stale_entries(tmp_path):
    (tmp_path / "node").mkdir()
    (tmp_path / "node" / "big.py").write_text("@dataclass\nclass Big:\n" + "    x = 1\n" * (MAX_CLASS_LINES - 1))
    found = sizes(tmp_path, ("node",))
    assert found == {"node/big.py": MAX_CLASS_LINES + 1, "node/big.py::Big": MAX_CLASS_LINES + 1}
    assert size_findings(found, {}) == [
        f"  node/big.py::Big: {MAX_CLASS_LINES + 1} lines, over the cap of {MAX_CLASS_LINES}"
    ]
    assert size_findings(found, {"node/big.py::Big": (MAX_CLASS_LINES + 1, "why")}) == []
    assert size_findings(
        {"a.py::A": 320, "b.py": 499}, {"a.py::A": (310, "why"), "b.py": (600, "why"), "c.py": (600, "why")}
    ) == [
        "  a.py::A: 320 lines, over its listed allowance of 310",
        "  b.py: 499 lines, within the cap of 500: drop it from SIZE_EXCEPTIONS",
        "  c.py: listed, but no such module or class: drop it from SIZE_EXCEPTIONS",
    ]


# ------------------------------------------------------------------------------------------------
# One writer of a worker's training position


def outside_writes(tree: ast.AST, attributes: set[str]) -> list[tuple[int, str]]:
    """(line, target) of every assignment to one of `attributes` of an object other than `self`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            continue
        for target in targets:
            for element in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(element, ast.Attribute) and element.attr in attributes:
                    if not (isinstance(element.value, ast.Name) and element.value.id == "self"):
                        found.append((node.lineno, ast.unparse(element)))
    return found


def findings_in_node(find: Callable[[ast.AST], list[tuple[int, str]]], spared: str | None = None) -> list[str]:
    """`  path:line: what` for each (line, what) `find` reports in a module of node/, those under the
    folder `spared` (relative to the root) left out."""
    return [
        f"  {path.relative_to(ROOT)}:{line}: {what}"
        for path in python_files(ROOT, ("node",))
        if spared is None or not path.is_relative_to(ROOT / spared)
        for line, what in find(ast.parse(path.read_text(encoding="utf-8")))
    ]


def test_only_the_stage_worker_writes_its_training_position():
    offenders = findings_in_node(
        lambda tree: [(line, f"{target} = ...") for line, target in outside_writes(tree, TRAINING_POSITION)]
    )
    assert not offenders, "a worker's training position assigned from outside (use StageWorker.adopt):\n" + "\n".join(
        offenders
    )


def test_the_writer_check_sees_assignments_to_other_objects_and_spares_self():
    tree = ast.parse(
        "worker.inner_step = 3\nself.inner_step = 4\na.b.lr_scale += 1\nw.last_grad_norm, x = None, 1\nw.other = 2"
    )
    assert outside_writes(tree, TRAINING_POSITION) == [
        (1, "worker.inner_step"),
        (3, "a.b.lr_scale"),
        (4, "w.last_grad_norm"),
    ]


# ------------------------------------------------------------------------------------------------
# A worker's module is the floor's own


def _holder_name(node: ast.expr) -> str | None:
    """The name an object goes by: `w`, `self.worker` -> worker, `self.workers[s][r]` -> workers."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def worker_module_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, expression) of every `.module` read or written on something named like a stage
    worker: `w`, `worker`, `*worker` or `*workers` (indexed), as the code names them."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "module":
            holder = _holder_name(node.value)
            if holder is not None and (holder == "w" or holder.endswith(("worker", "workers"))):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_nothing_outside_the_stage_floor_touches_a_workers_module():
    offenders = findings_in_node(worker_module_uses, spared="node/stage")
    assert not offenders, "a stage worker's module used outside node/stage/ (use its functions there):\n" + "\n".join(
        offenders
    )


def test_the_module_check_sees_workers_by_their_names_and_spares_other_modules():
    tree = ast.parse(
        "w.module(x)\nself.worker.module.embed(t)\nself.workers[0][r].module = m\nedge_worker.module\n"
        "replica.module\nnode.module\nw.modules"
    )
    assert worker_module_uses(tree) == [
        (1, "w.module"),
        (2, "self.worker.module"),
        (3, "self.workers[0][r].module"),
        (4, "edge_worker.module"),
    ]


# ------------------------------------------------------------------------------------------------
# Nothing points at the old notes


def _scan_for(needle: str) -> list[str]:
    """`git grep` over tracked and untracked (not ignored) files; a plain scan without git."""
    try:
        result = subprocess.run(
            ["git", "grep", "-n", "-F", "--untracked", "-e", needle],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if result.returncode in (0, 1):
            return result.stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        pass
    skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "runs", "build"}
    hits = []
    for path in sorted(ROOT.rglob("*")):
        relative = path.relative_to(ROOT)
        if not path.is_file() or skip & set(relative.parts) or relative.parts[0].endswith(".egg-info"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        hits += [f"{relative}:{n}:{line}" for n, line in enumerate(text.splitlines(), 1) if needle in line]
    return hits


def test_no_file_points_at_the_old_algorithms_notes():
    hits = _scan_for(OLD_NOTES)
    assert not hits, f"files still mention {OLD_NOTES} (docs/algorithms.md replaces it):\n" + "\n".join(hits)


# ------------------------------------------------------------------------------------------------
# The checker checks what it claims to


def test_the_import_walker_sees_every_kind_of_import_and_finds_cycles(tmp_path):
    files = {
        "protocol/__init__.py": "",
        "protocol/wire.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dht.records import R\n",
        "dht/__init__.py": "",
        "dht/records.py": "import protocol.wire as wire\n",
        "node/__init__.py": "",
        "node/sub/__init__.py": "from . import a\n",
        "node/sub/a.py": "def f():\n    from node.sub import b\n    return b\n",
        "node/sub/b.py": "from ..sub.a import f\nimport numpy\n",
        "node/c.py": "from node import sub\nfrom dht import records\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, PACKAGES)
    assert graph["protocol.wire"] == {"dht.records": ["protocol/wire.py:3"]}  # under TYPE_CHECKING
    assert graph["dht.records"] == {"protocol.wire": ["dht/records.py:1"]}
    assert set(graph["node.sub"]) == {"node.sub.a"}  # relative, a submodule
    assert set(graph["node.sub.a"]) == {"node.sub.b"}  # inside a function, a submodule
    assert set(graph["node.sub.b"]) == {"node.sub.a"}  # relative with two dots; numpy is not ours
    assert set(graph["node.c"]) == {"node.sub", "dht.records"}
    cycles = find_cycles(graph)
    assert cycles == [["dht.records", "protocol.wire", "dht.records"], ["node.sub.a", "node.sub.b", "node.sub.a"]]
    assert (
        describe(cycles[0], graph)
        == "  dht.records -> protocol.wire (dht/records.py:1) -> dht.records (protocol/wire.py:3)"
    )
    assert layer_violations(graph) == ["  protocol.wire imports dht.records (protocol/wire.py:3)"]


def test_the_cycle_finder_returns_nothing_for_a_tree_and_a_path_for_a_long_loop():
    assert find_cycles({"a": {"b": []}, "b": {"c": []}, "c": {}}) == []
    loop = {"a": {"b": ["x"]}, "b": {"c": ["y"]}, "c": {"a": ["z"], "d": ["w"]}, "d": {}}
    assert find_cycles(loop) == [["a", "b", "c", "a"]]
