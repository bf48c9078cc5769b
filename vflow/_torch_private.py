"""Every private torch name vflow's Python code uses: where, for which feature, and why.

torch may rename or drop a private name in any release. tests/test_torch_private.py
looks each name up in the installed torch and fails naming it and the vflow feature
that needs it, and scans vflow's source for private torch names missing here, so that
this table stays the whole list. Nothing imports this module at run time.

An entry's ``name`` is a dotted path: an importable module, then attributes. ``instance``
marks an attribute that torch sets on each object (in ``__init__``), not on the class: it
is looked up on an object the test builds. ``needs`` names a torch.distributed backend
without which the name cannot exist (the CPU build of torch has no NCCL).

Out of this table: the C++ extension includes torch's internal headers
(torch/csrc/autograd, torch/csrc/distributed/c10d); it is compiled against the torch it
runs with, so a change there fails the build, not a run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrivateName:
    name: str
    used_in: tuple[str, ...]  # files under vflow/
    feature: str
    why: str
    instance: bool = False
    needs: str | None = None  # "nccl": only in torch builds with NCCL

    @property
    def attribute(self) -> str:
        """The last part of ``name``: what vflow's source spells."""
        return self.name.rsplit(".", 1)[-1]


_DYNAMIC = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_HANDLER = f"{_DYNAMIC}.DynamicRendezvousHandler"
_HOLDER = f"{_DYNAMIC}._BackendRendezvousStateHolder"
_RENDEZVOUS = ("elastic/rendezvous.py",)
_ELASTIC = "elastic jobs (vflow.elastic.Rendezvous, ElasticJob)"
_CLOCKS = "Note [Heartbeats across clocks]: heartbeats judged by change, not by wall clock"
_GROUP = "elastic jobs: a process group per round without init_process_group (round_group)"

PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName(
        _HOLDER,
        _RENDEZVOUS,
        _ELASTIC,
        f"subclassed by _ClockFreeStateHolder; {_CLOCKS}",
    ),
    PrivateName(
        f"{_HOLDER}._sanitize",
        _RENDEZVOUS,
        _ELASTIC,
        f"overridden: torch's expiry of participants, fed heartbeats restated in this "
        f"machine's clock; {_CLOCKS}",
    ),
    PrivateName(
        f"{_HOLDER}._state",
        _RENDEZVOUS,
        _ELASTIC,
        "the rendezvous state whose heartbeats the override restates",
        instance=True,
    ),
    PrivateName(
        f"{_HOLDER}._backend",
        _RENDEZVOUS,
        _ELASTIC,
        "rewired to the new store connection when a worker reconnects to the store",
        instance=True,
    ),
    PrivateName(
        f"{_DYNAMIC}._DistributedRendezvousOpExecutor",
        _RENDEZVOUS,
        _ELASTIC,
        "rebuilt around the clock-free state holder, as torch's handler builds its own",
    ),
    PrivateName(
        f"{_DYNAMIC}._RendezvousExitOp",
        _RENDEZVOUS,
        _ELASTIC,
        "Rendezvous.leave: leaves the round without closing the job for the others",
    ),
    PrivateName(
        f"{_DYNAMIC}._RendezvousState.round",
        _RENDEZVOUS,
        _ELASTIC,
        "the round number, which names the round's keys in the store",
        instance=True,
    ),
    PrivateName(
        f"{_DYNAMIC}._RendezvousState.participants",
        _RENDEZVOUS,
        _ELASTIC,
        "whether this worker is still in the round (an evicted worker must rejoin)",
        instance=True,
    ),
    PrivateName(
        f"{_DYNAMIC}._RendezvousState.last_heartbeats",
        _RENDEZVOUS,
        _ELASTIC,
        f"the heartbeats the clock-free holder restates; {_CLOCKS}",
        instance=True,
    ),
    PrivateName(
        f"{_HANDLER}._settings",
        _RENDEZVOUS,
        _ELASTIC,
        "the handler's settings, given to the replacement holder and op executor",
        instance=True,
    ),
    PrivateName(
        f"{_HANDLER}._state_holder",
        _RENDEZVOUS,
        _ELASTIC,
        "replaced by the clock-free holder; read for the round number and participants",
        instance=True,
    ),
    PrivateName(
        f"{_HANDLER}._op_executor",
        _RENDEZVOUS,
        _ELASTIC,
        "replaced to use the clock-free holder; runs the exit op of Rendezvous.leave",
        instance=True,
    ),
    PrivateName(
        f"{_HANDLER}._this_node",
        _RENDEZVOUS,
        _ELASTIC,
        "this worker's node, for the op executor and to tell whether it was evicted",
        instance=True,
    ),
    PrivateName(
        f"{_HANDLER}._store",
        _RENDEZVOUS,
        _ELASTIC,
        "rewired to the new store connection when a worker reconnects to the store",
        instance=True,
    ),
    PrivateName(
        f"{_HANDLER}._keep_alive",
        _RENDEZVOUS,
        _ELASTIC,
        "a heartbeat right after a round forms, before the handler's own timer's first",
    ),
    PrivateName(
        f"{_HANDLER}._stop_heartbeats",
        _RENDEZVOUS,
        _ELASTIC,
        "leaving, closing, or losing the store: no heartbeats for a round left behind",
    ),
    PrivateName(
        "torch.distributed.ProcessGroupGloo._Options",
        _RENDEZVOUS,
        _GROUP,
        "Gloo bound to a chosen network interface needs the options constructor",
    ),
    PrivateName(
        "torch.distributed.ProcessGroupGloo._Options._devices",
        _RENDEZVOUS,
        _GROUP,
        "the Gloo device on the interface that reaches the store",
        instance=True,
    ),
    PrivateName(
        "torch.distributed.ProcessGroupGloo._Options._timeout",
        _RENDEZVOUS,
        _GROUP,
        "the collectives' timeout, which the options constructor otherwise leaves unset",
        instance=True,
    ),
    PrivateName(
        "torch.distributed.ProcessGroupGloo._Options._threads",
        _RENDEZVOUS,
        _GROUP,
        "Gloo's threads per device, as the constructor without options sets them",
        instance=True,
    ),
    PrivateName(
        "torch.distributed.ProcessGroupNCCL.Options._timeout",
        _RENDEZVOUS,
        _GROUP,
        "the NCCL collectives' timeout",
        instance=True,
        needs="nccl",
    ),
    PrivateName(
        "torch.distributed.ProcessGroup._set_default_backend",
        _RENDEZVOUS,
        _GROUP,
        "a ProcessGroup assembled by hand, as init_process_group does inside",
    ),
    PrivateName(
        "torch.distributed.ProcessGroup._register_backend",
        _RENDEZVOUS,
        _GROUP,
        "a ProcessGroup assembled by hand, as init_process_group does inside",
    ),
    PrivateName(
        "torch.distributed.ProcessGroup._set_group_name",
        _RENDEZVOUS,
        _GROUP,
        "errors name the round and the group instead of 'default'",
    ),
    PrivateName(
        "torch.distributed.distributed_c10d._get_default_group",
        ("world/group.py",),
        "Executor(process_group=None) after init_process_group",
        "the default group as a ProcessGroup object (dist.group.WORLD is a placeholder)",
    ),
    PrivateName(
        "torch.autograd._profiler_enabled",
        ("runtime/step_run.py", "pipeline/executor.py", "pipeline/stage.py"),
        "vflow's ranges in torch.profiler traces (vflow::forward, vflow::backward, ...)",
        "ranges are recorded only while a profiler runs: no cost otherwise",
    ),
    PrivateName(
        "torch.autograd.Variable._execution_engine",
        ("planning/emulation.py",),
        "emulated device speeds (vflow.planning.emulation)",
        "queue_callback: the end of the backward pass, to stretch it like the forward",
    ),
    PrivateName(
        "torch.distributed.pipelining.PipelineStage._compute_outputs",
        ("pipeline/stage.py",),
        "pipeline parallelism (PipelineExecutor)",
        "overridden: shape inference's only call into the modules keeps their buffers",
    ),
    PrivateName(
        "torch.nn.Module._buffers",
        ("runtime/module_buffers.py",),
        "module buffers (BatchNorm statistics) kept alike across mappings",
        "the buffers by owning module and name, so each can be read and replaced in place",
        instance=True,
    ),
    PrivateName(
        "torch.nn.modules.batchnorm._BatchNorm",
        ("runtime/inference.py",),
        "Executor.infer's warning about BatchNorm in training mode",
        "the base class of every BatchNorm that tracks running statistics",
    ),
    PrivateName(
        "torch.nn.Module.state_dict._metadata",
        ("world/membership.py",),
        "state sent to newcomers and reloaded (map_tensors)",
        "modules read their state-dict version from it (BatchNorm's num_batches_tracked)",
        instance=True,
    ),
    PrivateName(
        "torch._dynamo.compiled_autograd.compiled_autograd_enabled",
        ("runtime/grad_store.py",),
        "Executor.step and PipelineExecutor.step refusing compiled autograd",
        "whether compiled autograd is on; Note [Compiled autograd]: vflow's C++ gradient "
        "hooks cannot be traced by it. Read with getattr(..., False): were it renamed, the "
        "refusal would never fire, so only this table's test would tell",
    ),
    PrivateName(
        "torch._foreach_add_",
        ("bench/kernels.py",),
        "python -m vflow bench (the kernel benchmarks)",
        "torch's multi-tensor add, one of the compared accumulation methods",
    ),
)
