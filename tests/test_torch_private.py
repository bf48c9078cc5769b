"""The private torch names vflow uses (vflow/_torch_private.py): each one is in the
installed torch, and the table lists every one vflow's source uses."""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import vflow
from vflow._torch_private import PRIVATE_NAMES, PrivateName

# The source of the vflow that runs: the checkout's with an editable install, the
# installed copy's otherwise (CI's run against another torch builds out of the tree).
VFLOW = Path(vflow.__file__).resolve().parent
_DYNAMIC = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"


def _resolve(dotted: str) -> Any:
    """The object at ``dotted``: the longest importable module prefix, then attributes.
    Raises AttributeError or ImportError naming the first part that is missing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for k, part in enumerate(parts[cut:], start=cut):
            if not hasattr(obj, part):
                raise AttributeError(f"{'.'.join(parts[:k])} has no attribute {part}")
            obj = getattr(obj, part)
        return obj
    raise ImportError(f"no module of {dotted} can be imported")


def _handler() -> Any:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    store = dist.HashStore()
    return DynamicRendezvousHandler.from_backend(
        run_id="probe",
        store=store,
        backend=C10dRendezvousBackend(store, "probe"),
        min_nodes=1,
        max_nodes=1,
    )


def _state_holder() -> Any:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )

    holder = _resolve(f"{_DYNAMIC}._BackendRendezvousStateHolder")
    return holder(C10dRendezvousBackend(dist.HashStore(), "probe"), _handler().settings)


# For entries with instance=True: an object of the owner (the name less its last part)
# as vflow meets it, built the public way wherever torch offers one.
INSTANCES: dict[str, Callable[[], Any]] = {
    f"{_DYNAMIC}.DynamicRendezvousHandler": _handler,
    f"{_DYNAMIC}._BackendRendezvousStateHolder": _state_holder,
    f"{_DYNAMIC}._RendezvousState": lambda: _resolve(f"{_DYNAMIC}._RendezvousState")(),
    "torch.distributed.ProcessGroupGloo._Options": lambda: dist.ProcessGroupGloo._Options(),
    "torch.distributed.ProcessGroupNCCL.Options": lambda: dist.ProcessGroupNCCL.Options(),
    "torch.nn.Module": lambda: torch.nn.Linear(1, 1),
    "torch.nn.Module.state_dict": lambda: torch.nn.Linear(1, 1).state_dict(),
}

_NEEDS = {"nccl": lambda: dist.is_available() and dist.is_nccl_available()}


def _where(entry: PrivateName) -> str:
    return ", ".join(f"vflow/{path}" for path in entry.used_in)


@pytest.mark.parametrize("entry", PRIVATE_NAMES, ids=[e.name for e in PRIVATE_NAMES])
def test_the_installed_torch_has_each_private_name_vflow_uses(entry: PrivateName) -> None:
    if entry.needs is not None and not _NEEDS[entry.needs]():
        pytest.skip(f"this torch has no {entry.needs}")
    owner, _ = entry.name.rsplit(".", 1)
    try:
        if entry.instance:
            obj = INSTANCES[owner]()
            if not hasattr(obj, entry.attribute):
                raise AttributeError(f"a {owner} object has no attribute {entry.attribute}")
        else:
            _resolve(entry.name)
    except (AttributeError, ImportError, TypeError) as exc:
        pytest.fail(
            f"torch {torch.__version__} lacks {entry.name} ({exc}). vflow needs it for "
            f"{entry.feature}, in {_where(entry)}: {entry.why}. Adapt those files and "
            "vflow/_torch_private.py to this torch.",
            pytrace=False,
        )


def test_a_missing_name_fails_naming_it_and_the_feature() -> None:
    """What a torch that dropped a name shows, for a class attribute and an object's."""
    check = test_the_installed_torch_has_each_private_name_vflow_uses
    gone = PrivateName(
        f"{_DYNAMIC}.DynamicRendezvousHandler._no_such_name",
        ("elastic/rendezvous.py",),
        "elastic jobs",
        "the reason",
    )
    with pytest.raises(
        pytest.fail.Exception,
        match=rf"^torch {re.escape(torch.__version__)} lacks {re.escape(gone.name)} \(.*"
        r"DynamicRendezvousHandler has no attribute _no_such_name\)\. vflow needs it for "
        r"elastic jobs, in vflow/elastic/rendezvous\.py: the reason\. Adapt those files",
    ):
        check(gone)
    per_object = PrivateName(
        "torch.nn.Module._no_such_name", ("runtime/module_buffers.py",), "f", "w", instance=True
    )
    with pytest.raises(
        pytest.fail.Exception,
        match=r"\(a torch\.nn\.Module object has no attribute _no_such_name\)",
    ):
        check(per_object)


def test_every_instance_entry_can_be_probed() -> None:
    owners = {e.name.rsplit(".", 1)[0] for e in PRIVATE_NAMES if e.instance}
    assert owners <= INSTANCES.keys(), f"add objects to INSTANCES for {owners - INSTANCES.keys()}"
    assert set(_NEEDS) >= {e.needs for e in PRIVATE_NAMES if e.needs}


# ---- the table is the whole list -----------------------------------------------------
# The scan below finds, in vflow's source, the private names vflow takes from others:
#  * private names imported from torch, and private torch modules imported or named in a
#    string that is a dotted torch name (sys.modules.get("torch._dynamo.compiled_autograd"));
#  * ``x._name`` and getattr/hasattr(x, "_name") on anything but self and cls, super()
#    included;
#  * in a class with a torch base: ``self._name`` read but neither assigned nor defined in
#    the class (torch's __init__ set it), and private methods that a torch base defines
#    (overrides).
# Each must be an attribute in the table, or one of vflow's own private names reached on
# another vflow object (below), or a Python standard one.
VFLOW_OWN = {
    "_C": "the extension module, vflow._C",
    "_checked_plan": "Executor's static plan check, called from PipelineExecutor",
    "_counts": "vflow.planning.auto_plan's formatting helper",
    "_device": "PipelineExecutor's device, read by its step runner (the step's clock)",
    "_feed": "PipelineExecutor's first-stage VN inputs, read by its step runner",
    "_grads": "PipelineExecutor's gradient store, read by its step runner",
    "_grid_world": "PipelineExecutor's grid, read by its step runner",
    "_norm_slots": "PipelineExecutor's parameter slots, read by its step runner (clipping)",
    "_norm_width": "PipelineExecutor's parameter count, read by its step runner (clipping)",
    "_params": "PipelineExecutor's trainable parameters, read by its step runner (clipping)",
    "_pre_step_hooks": "PipelineExecutor's pre-step hooks, called by its step runner",
    "_previous": "PipelineExecutor's previous step, read by its step runner",
    "_run": "World's collective runner, used by the sum World.start_sum started",
    "_signal": "PipelineExecutor's signal word, read by its step runner into the losses' row",
    "_sizes": "Plan's VN counts, compared with another Plan's",
}
NOT_TORCH = {"_fields": "namedtuple's field names"}


_TORCH_MODULE = re.compile(r"torch(\.[A-Za-z_]\w*)+")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _torch_names(tree: ast.Module) -> set[str]:
    """Names bound in the module to torch or to something imported from it."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    names.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root(expr: ast.expr) -> str | None:
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
        expr = expr.value
    return expr.id if isinstance(expr, ast.Name) else None


def _torch_base_class_uses(cls: ast.ClassDef, module: str) -> Iterator[tuple[str, int]]:
    assigned = {
        node.attr
        for node in ast.walk(cls)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assigned.add(node.name)
        elif isinstance(node, ast.Assign):
            assigned.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            assigned.add(node.target.id)
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Load)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and _private(node.attr)
            and node.attr not in assigned
        ):
            yield node.attr, node.lineno
    torch_bases = [
        base
        for base in getattr(importlib.import_module(module), cls.name).__mro__[1:]
        if base.__module__.split(".")[0] == "torch"
    ]
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
            if any(node.name in vars(base) for base in torch_bases):
                yield node.name, node.lineno


def _private_uses(path: Path, root: Path = VFLOW.parent) -> Iterator[tuple[str, int, bool]]:
    """(name, line, reached from torch) of each private name of another library that
    ``path``, a module importable from ``root``, uses. Reached from torch: in an import
    from torch, or on an expression rooted at a name torch bound (``torch._C._x``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    torch_names = _torch_names(tree)
    module = ".".join(path.relative_to(root).with_suffix("").parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    parts = alias.name.split(".")
                    yield from ((p, node.lineno, True) for p in parts if _private(p))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            yield from ((p, node.lineno, True) for p in node.module.split(".") if _private(p))
            yield from ((a.name, node.lineno, True) for a in node.names if _private(a.name))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                yield node.attr, node.lineno, _root(node.value) in torch_names
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
            and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))
        ):
            yield node.args[1].value, node.lineno, _root(node.args[0]) in torch_names
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _TORCH_MODULE.fullmatch(node.value)
        ):
            # A module named in a string: sys.modules.get("torch._dynamo..."), import_module.
            yield from ((p, node.lineno, True) for p in node.value.split(".") if _private(p))
        elif isinstance(node, ast.ClassDef) and any(
            _root(base) in torch_names for base in node.bases
        ):
            yield from ((n, line, True) for n, line in _torch_base_class_uses(node, module))


def _sources() -> list[Path]:
    return sorted(p for p in VFLOW.rglob("*.py") if p.name != "_torch_private.py")


def test_every_private_torch_name_in_vflow_is_in_the_table() -> None:
    listed = {entry.attribute for entry in PRIVATE_NAMES}
    listed |= {part for entry in PRIVATE_NAMES for part in entry.name.split(".") if _private(part)}
    unlisted = [
        f"vflow/{path.relative_to(VFLOW)}:{line}: {name}"
        for path in _sources()
        for name, line, from_torch in _private_uses(path)
        if name not in listed and (from_torch or (name not in VFLOW_OWN and name not in NOT_TORCH))
    ]
    assert not unlisted, (
        "private names of torch (or of another library) not listed in "
        "vflow/_torch_private.py's PRIVATE_NAMES (a vflow object's private name reached "
        "from another class goes in VFLOW_OWN here):\n  " + "\n  ".join(unlisted)
    )


def test_every_entry_is_used_where_the_table_says() -> None:
    for entry in PRIVATE_NAMES:
        for used_in in entry.used_in:
            text = (VFLOW / used_in).read_text(encoding="utf-8")
            pattern = rf"\b{re.escape(entry.attribute)}\b"
            assert re.search(pattern, text), f"vflow/{used_in} does not use {entry.name}"


def test_the_scan_finds_each_kind_of_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan, on a module made for it: each kind of private use is found."""
    package = tmp_path / "probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    source = package / "uses.py"
    source.write_text(
        "import sys\n"
        "import torch\n"
        "import torch._dynamo\n"
        "import vflow\n"
        "from torch._inductor import config\n"
        "from torch.nn.modules.batchnorm import _BatchNorm\n"
        "from torch.nn import Module\n"
        "x = torch.autograd._profiler_enabled()\n"
        "y = getattr(x, '_metadata', None)\n"
        "ext = vflow._C\n"
        "m = sys.modules.get('torch._functorch.config')\n"
        "said = 'see torch._dynamo.config.x = True in the docs'\n"
        "check = torch._C.has_openmp\n"
        "class M(Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self._own = 1\n"
        "    def _apply(self, fn, recurse=True):\n"
        "        return super()._apply(fn, recurse)\n"
        "    def _helper(self):\n"
        "        return self._own, self._parameters\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    found = {(name, from_torch) for name, _, from_torch in _private_uses(source, tmp_path)}
    assert found == {
        ("_dynamo", True),
        ("_inductor", True),
        ("_functorch", True),
        ("_C", True),
        ("_C", False),
        ("_BatchNorm", True),
        ("_profiler_enabled", True),
        ("_metadata", False),
        ("_apply", False),  # super()._apply: its root is no name
        ("_apply", True),  # a method of torch's Module, overridden
        ("_parameters", True),
    }
