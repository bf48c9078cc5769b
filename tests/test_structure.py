"""The package's architecture, checked: vflow/ is a house of rooms by concern whose
imports run one way (docs/design.md, "Structure: who owns what").

Each room's ``__init__`` docstring says what it may import ("May import: ..."); this
test reads those lines and fails on an import against them, on any import circle
between modules, and on a module outside the rooms. Every import counts: inside
functions and under ``if TYPE_CHECKING:`` too, since both tie the modules together."""

from __future__ import annotations

import ast
import importlib
import pickle
import re
import sys
import warnings

import pytest

import vflow
from tests.support import REPO_ROOT

PACKAGE = REPO_ROOT / "vflow"
# The top level: the package's face, the CLI, the version, the extension loader and the
# ops. Every room may import the last three; the face only the demo (and the CLI).
# vflow._torch_private is a table that only tests read (no module imports it).
TOP_LEVEL = {
    "vflow",
    "vflow.__main__",
    "vflow._version",
    "vflow._extension",
    "vflow._torch_private",
    "vflow.ops",
}
BASE = {"vflow._version", "vflow._extension", "vflow.ops"}
ROOMS = [
    "mapping",
    "planning",
    "data",
    "world",
    "runtime",
    "elastic",
    "pipeline",
    "cluster",
    "bench",
    "demo",
]


def _module_name(path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, ast.Module]:
    return {
        _module_name(path): ast.parse(path.read_text(), str(path))
        for path in sorted(PACKAGE.rglob("*.py"))
    }


MODULES = _modules()


def _imports(name: str, tree: ast.Module) -> set[str]:
    """The vflow modules ``name`` imports: for ``from X import y``, X.y where that is a
    module, else X."""
    package = (
        name
        if (PACKAGE / name.replace("vflow.", "", 1).replace(".", "/")).is_dir()
        else (name.rpartition(".")[0])
    )
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                child = f"{source}.{alias.name}"
                found.add(child if child in MODULES else source)
    return {target for target in found if target in MODULES and target != name}


GRAPH = {name: _imports(name, tree) for name, tree in MODULES.items()}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else None


def _allowed(room: str) -> set[str]:
    """The rooms named on the "May import:" line(s) of the room's docstring."""
    doc = ast.get_docstring(MODULES[f"vflow.{room}"]) or ""
    match = re.search(r"May import:(.*?)(?:\n\n|$)", doc, re.DOTALL)
    assert match, f"vflow/{room}/__init__.py: its docstring has no 'May import:' line"
    return set(re.findall(r"vflow\.(\w+)", match.group(1))) & set(ROOMS)


def test_the_top_level_holds_only_the_face_the_cli_the_version_the_loader_and_the_ops() -> None:
    outside = {name for name in MODULES if _room(name) is None}
    assert outside == TOP_LEVEL


def test_every_room_says_what_it_is_for_and_what_it_may_import() -> None:
    for room in ROOMS:
        doc = ast.get_docstring(MODULES[f"vflow.{room}"])
        assert doc and len(doc.split()) > 20, f"vflow/{room}/__init__.py needs a docstring"
        assert room not in _allowed(room)


def test_imports_between_rooms_follow_the_declared_direction() -> None:
    wrong = []
    for module, targets in GRAPH.items():
        room = _room(module)
        if room is None:
            continue
        allowed = _allowed(room) | {room}
        for target in targets:
            target_room = _room(target)
            if target_room is None:
                if target in BASE or (room == "demo" and target == "vflow"):
                    continue
                wrong.append(f"{module} -> {target} (the top level: only {sorted(BASE)})")
            elif target_room not in allowed:
                wrong.append(f"{module} -> {target} (vflow.{room} may import {sorted(allowed)})")
    assert not wrong, "imports against the declared direction:\n" + "\n".join(sorted(wrong))


def test_the_rooms_declare_no_circle() -> None:
    """The declared directions themselves form no circle between rooms."""
    order: list[str] = []

    def visit(room: str, path: tuple[str, ...]) -> None:
        assert room not in path, "circle of rooms: " + " -> ".join((*path, room))
        for below in sorted(_allowed(room)):
            visit(below, (*path, room))
        if room not in order:
            order.append(room)

    for room in ROOMS:
        visit(room, ())


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return circles


def test_no_module_imports_itself_through_a_circle() -> None:
    assert _circles(GRAPH) == []


def test_the_circle_check_finds_a_circle() -> None:
    graph = {name: set(targets) for name, targets in GRAPH.items()}
    graph["vflow.mapping.plan"].add("vflow.runtime.executor")  # plan -> executor -> plan
    assert any("vflow.mapping.plan" in c and "vflow.runtime.executor" in c for c in _circles(graph))


def test_the_direction_check_reads_the_docstrings() -> None:
    assert _allowed("mapping") == set()
    assert _allowed("runtime") == {"mapping", "planning", "data", "world"}
    assert "elastic" not in _allowed("runtime")  # the step never drives an elastic job


@pytest.mark.parametrize("old", sorted(vflow.MOVED_MODULES))
def test_old_module_paths_still_import_with_a_warning_naming_the_new_one(old: str) -> None:
    new = vflow.MOVED_MODULES[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{re.escape(old)} moved to {re.escape(new)}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__name__ == new and module.__spec__.name == new
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module(old) is module  # once imported, no second warning


def test_objects_keep_their_identity_and_pickle_under_the_new_path() -> None:
    sys.modules.pop("vflow.plan", None)
    with pytest.warns(DeprecationWarning):
        from vflow.plan import Plan  # type: ignore[import-not-found]
    assert Plan is vflow.Plan
    data = pickle.dumps(vflow.Plan.even(8, 2))
    assert b"vflow.mapping.plan" in data and pickle.loads(data) == vflow.Plan.even(8, 2)


def test_rooms_that_replaced_modules_export_what_the_modules_did() -> None:
    from vflow.data import VNBatchSampler
    from vflow.demo import accuracy, cross_entropy, load_digits_split, make_model
    from vflow.elastic import LEAVE, WAITING, ElasticJob, Event

    assert VNBatchSampler is vflow.VNBatchSampler and ElasticJob is vflow.elastic.ElasticJob
    assert callable(Event) and (LEAVE, WAITING) == (2, 1)
    assert all(callable(f) for f in (accuracy, cross_entropy, load_digits_split, make_model))


def test_tests_mirror_the_rooms() -> None:
    for room in ROOMS:
        folder = REPO_ROOT / "tests" / room
        assert sorted(folder.glob("test_*.py")), f"tests/{room}/ has no tests"


# torch.distributed's collectives (and group creation, itself a collective of the
# default group), as module functions, and ProcessGroup's own spellings of them.
_DIST_COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "irecv",
        "isend",
        "new_group",
        "new_subgroups",
        "recv",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
    }
)
_GROUP_METHODS = frozenset(
    {"allreduce", "allgather", "allgather_into_tensor_coalesced", "alltoall", "alltoall_base"}
)


def _collectives_outside_world(trees: dict[str, ast.Module]) -> list[str]:
    """``module:line name`` of every torch.distributed collective named outside
    vflow.world: ``dist.X`` / ``torch.distributed.X``, ``from torch.distributed import
    X`` and ProcessGroup methods (``group.allreduce``)."""
    found = []
    for module, tree in trees.items():
        if module == "vflow.world" or module.startswith("vflow.world."):
            continue
        aliases = {"torch.distributed"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {a.asname for a in node.names if a.name == "torch.distributed"}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
                found += [
                    f"{module}:{node.lineno} {a.name}"
                    for a in node.names
                    if a.name in _DIST_COLLECTIVES
                ]
            if not isinstance(node, ast.Attribute):
                continue
            owner = ast.unparse(node.value)
            if (owner in aliases and node.attr in _DIST_COLLECTIVES) or node.attr in _GROUP_METHODS:
                found.append(f"{module}:{node.lineno} {owner}.{node.attr}")
    return found


def test_every_collective_goes_through_the_world_room() -> None:
    """Issue 37: one place decides on which device a collective's tensors live and
    bounds its wait (vflow.world.World); a collective called elsewhere escapes both
    (a CPU tensor handed to NCCL, a wait without vflow's timeout)."""
    assert _collectives_outside_world(MODULES) == []


def test_the_collective_check_finds_one() -> None:
    planted = ast.parse(
        "import torch.distributed as dist\n"
        "from torch.distributed import barrier\n"
        "def f(row, group):\n"
        "    dist.all_reduce(row)\n"
        "    torch.distributed.broadcast(row, 0)\n"
        "    group.allreduce([row])\n"
    )
    assert _collectives_outside_world({"vflow.pipeline.x": planted}) == [
        "vflow.pipeline.x:2 barrier",
        "vflow.pipeline.x:4 dist.all_reduce",
        "vflow.pipeline.x:5 torch.distributed.broadcast",
        "vflow.pipeline.x:6 group.allreduce",
    ]
    assert _collectives_outside_world({"vflow.world.group": planted}) == []
