"""``vflow.PipelineExecutor``: virtual nodes over pipeline replicas.

Note [VNs as microbatches]
A job of R replicas x S stages (Note [The grid]) runs a global batch of B samples as
V VNs. The plan (vflow.Plan over the *replicas*) gives replica r its ``counts[r]``
consecutive VNs, and the replica runs them as the microbatches of one schedule
(GPipe or 1F1B, torch.distributed.pipelining's), microbatch i being its i-th VN. Each
stage folds every VN's gradients into its own flat buffers (Note [Capturing a stage's
gradients]); the buffers of one stage are reduced across the R replicas holding it by
the same Reducer and reduction strategies as ``vflow.Executor`` (bucketed, started
during the last VN's backward), so in deterministic mode a stage's gradient is the
fixed tree sum over VN indices, the same bits for any R and any S. Then every stage
steps its own optimizer once.

The loss runs on the last stage. Each VN's loss is multiplied by its weight before
its backward (``n_i / B`` for a mean loss, 1 for ``(sum, num_items)``), so no other
stage needs to know the loss's kind; after the schedule one all-reduce over the whole
grid carries every VN's loss and item count to every process, each in its own slot
(so the sums are exact in any order), and the buffers are divided once by the global
item count for summed losses. With S = 1 the replica runs its VNs one after another
without torch.distributed.pipelining (what the single-process reference is) and with
the same arithmetic.

Halving the replicas doubles the microbatches per replica: the step takes about
(2M + S - 1) / (M + S - 1) times as long, for half the processes (the bubble is
(S - 1) / (M + S - 1) of a schedule); memory per process does not change with M
under 1F1B (at most S - stage microbatches in flight).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils.hooks import RemovableHandle

from vflow.data.prefetch import Prefetcher, VNTransform
from vflow.data.vn_batches import VNBatchSource
from vflow.mapping import rng
from vflow.mapping.batching import concat_outputs
from vflow.mapping.plan import Plan, VNSlice
from vflow.pipeline import state as pipeline_state
from vflow.pipeline.grid import ProcessGrid
from vflow.pipeline.spec import SCHEDULES, Pipeline, Segments, segments, stage_bounds
from vflow.pipeline.stage import VNStage
from vflow.pipeline.streams import SegmentStreams
from vflow.planning import auto_plan
from vflow.planning.auto_plan import AutoPlan, PlanChange
from vflow.planning.profile import StepProfile, VNProfile, WorkerProfile
from vflow.runtime import inference, losses, training_state
from vflow.runtime.amp import LossScaler
from vflow.runtime.clock import StepClock
from vflow.runtime.config import ExecutorConfig
from vflow.runtime.grad_store import GradStore, refuse_compiled_autograd, trainable_params
from vflow.runtime.module_buffers import BufferRule
from vflow.runtime.pre_step_hooks import PreStepHooks
from vflow.runtime.reduction import Reduction, for_kind
from vflow.runtime.registered_state import RegisteredState, registered_from
from vflow.runtime.results import PhaseTimings, SignalWord, StepResult
from vflow.runtime.step_cycle import StepParts, run_step
from vflow.runtime.step_run import profiled
from vflow.world import membership
from vflow.world.group import (
    CollectiveError,
    PendingSum,
    World,
    backend_name,
    check_plan,
    retire,
)

LossFn = Callable[[Any, Any], Any]
OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


class PipelineExecutor:
    """Trains ``model`` cut into ``pipeline.stages`` stages, over the replicas of
    ``grid``, with the global batch split into ``virtual_nodes`` VNs.

    Args:
        model: a ``torch.nn.Sequential`` whose children are the segments the stages
            are cut from (Note [Segments and stages]), the same on every process, on
            this process's device. The executor keeps this process's stage
            (``stage_module``, a Sequential of those children under their own names)
            and moves the other segments to the meta device, freeing their memory.
        optimizer: ``optimizer(params) -> torch.optim.Optimizer`` builds the optimizer
            of this stage's trainable parameters (each stage steps its own).
        loss_fn: ``loss_fn(output, target)`` on the last segment's output for one VN:
            its mean loss (a scalar tensor) or ``(loss_sum, num_items)``, as for
            ``vflow.Executor`` (docs/design.md, "Loss normalisation"). It runs on the
            last stage only; other stages may pass None.
        virtual_nodes: V, the number of VNs (= microbatches over all replicas).
        seed: seeds the segments' random streams (Note [Segment streams]).
        pipeline: a ``vflow.Pipeline`` (stages, schedule, split), or the stage count.
        grid: the processes and their roles (``vflow.pipeline.ProcessGrid.of``);
            default: every process of the default group, or this process alone when
            torch.distributed is not initialised (then ``pipeline.stages`` must be 1).
        plan: VNs per replica (``vflow.Plan`` over the replicas); default even.
            ``"auto"`` (or a ``vflow.AutoPlan``): start even, then move VNs between
            replicas of different speeds (Note [Automatic plans for replicas]).
        deterministic: as for ``vflow.Executor``: True/"ordered" or "exact" make the
            parameters and optimizer state bitwise the same for any replica count, any
            stage count and any plan (docs/reproducibility.md).
        amp: None, "bf16" or "fp16": every segment's forward and ``loss_fn`` run under
            autocast in that dtype, on every stage (Note [Mixed precision on a grid]).
        loss_scale: fp16 loss scaling, as for ``vflow.Executor``: on by default with
            amp="fp16"; the last stage scales each VN's loss, every stage unscales its
            gradients, and one inf/NaN verdict for the whole grid skips the step and
            moves the scale alike on every process.
        max_grad_norm: clip the gradient of the whole model (every stage's
            parameters) to this global 2-norm before the optimizer step; every
            process computes the same norm from every stage's parameter norms, added
            in the unsplit model's parameter order, so it is the same bits on any grid
            (Note [One norm for the grid]). ``StepResult.grad_norm`` reports it.
        accumulate_dtype, buffer_rule, skip_nonfinite, timeout, bucket_cap_mb,
        first_bucket_mb: as for ``vflow.Executor``.
        prefetch, vn_transform: as for ``vflow.Executor``, on the first stage's inputs
            (Note [Feeding the first stage]): ``vn_transform(vn_inputs, generator)``
            gets a VN's inputs (a tensor or a tuple of them; not the targets, which live
            on the last stage) and returns them with the same number of samples, and,
            with S > 1, the same shapes for every VN. ``infer`` does not apply it.
        registered_state: ``registered_state(stage_optimizer) -> {name: obj}`` builds
            this stage's objects that are part of the training state (an LR scheduler of
            the stage's optimizer; see ``register_state``), before a process joining the
            grid receives the replicas' state, so that it receives theirs too.

    Every process of a fresh grid constructs its executor together; the replicas of
    each stage start from replica 0's parameters. A process constructing its executor
    on a grid whose other replicas are training (they call ``reconfigure``) joins it
    and receives its stage's training state from them.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: OptimizerFactory,
        loss_fn: LossFn | None,
        virtual_nodes: int,
        seed: int = 0,
        *,
        pipeline: Pipeline | int = 1,
        grid: ProcessGrid | None = None,
        plan: Plan | AutoPlan | str | None = None,
        deterministic: bool | str = False,
        amp: str | None = None,
        loss_scale: bool | LossScaler | None = None,
        max_grad_norm: float | None = None,
        accumulate_dtype: torch.dtype = torch.float32,
        buffer_rule: str = "vn0",
        skip_nonfinite: bool | None = None,
        timeout: float | datetime.timedelta = 600.0,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        registered_state: Callable[[torch.optim.Optimizer], Mapping[str, object]] | None = None,
        prefetch: bool = True,
        vn_transform: VNTransform | None = None,
    ) -> None:
        named_segments = segments(model)
        if registered_state is not None and not callable(registered_state):
            raise TypeError(
                "registered_state must be a function optimizer -> {name: obj} (each stage "
                f"registers its own objects) or None, got {type(registered_state).__name__}"
            )
        if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
            raise TypeError(
                "optimizer must be a function params -> torch.optim.Optimizer (each stage "
                f"builds its own), got {type(optimizer).__name__}"
            )
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
        if vn_transform is not None and not callable(vn_transform):
            raise TypeError(
                f"vn_transform must be callable or None, got {type(vn_transform).__name__}"
            )
        if isinstance(pipeline, int) and not isinstance(pipeline, bool):
            pipeline = Pipeline(pipeline)
        if not isinstance(pipeline, Pipeline):
            raise TypeError(
                f"pipeline must be a vflow.Pipeline or a stage count, got {type(pipeline).__name__}"
            )
        config = ExecutorConfig.from_arguments(
            virtual_nodes=virtual_nodes,
            seed=seed,
            amp=amp,
            accumulate_dtype=accumulate_dtype,
            loss_scale=loss_scale,
            skip_nonfinite=skip_nonfinite,
            buffer_rule=buffer_rule,
            max_grad_norm=max_grad_norm,
            bucket_cap_mb=bucket_cap_mb,
            first_bucket_mb=first_bucket_mb,
            broadcast_parameters=True,
            deterministic=deterministic,
            prefetch=prefetch,
            timeout=timeout,
            has_fp16_params=any(p.dtype == torch.float16 for p in model.parameters()),
        )
        if grid is None:
            grid = ProcessGrid.of(pipeline.stages, timeout=config.timeout)
        self._check_grid(grid, pipeline)
        checked: _CheckedStage = _together(
            grid,
            config,
            lambda: self._stage_of(
                named_segments, optimizer, loss_fn, plan, grid, pipeline, config
            ),
        )
        auto, plan, bounds = checked.auto, checked.plan, checked.bounds
        stage_module, stage_optimizer, params = checked.module, checked.optimizer, checked.params
        reduction, prepared = checked.reduction, checked.prepared
        first, stop = bounds[grid.stage]

        self.config = config
        self.pipeline = pipeline
        self.loss_fn = loss_fn
        self.model = model
        self.stage_module = stage_module
        self.optimizer = stage_optimizer
        if isinstance(loss_scale, LossScaler):
            self.scaler: LossScaler | None = loss_scale
        else:
            self.scaler = None if config.loss_scaling is None else LossScaler()
        self.step_count = 0
        self.skipped_steps = 0
        self._registered = RegisteredState()
        self._pre_step_hooks = PreStepHooks()
        self._signal = SignalWord()
        self._vn_inputs = VNBatchSource(bool(config.deterministic), vn_transform)
        self._prefetcher = Prefetcher(params[0].device, config.prefetch)
        self._feed: _InputFeed | None = None  # the first stage's VN inputs, during a step
        self._bounds = bounds
        self._segment_names = [name for name, _ in named_segments]
        self._params = params
        # Note [One norm for the grid]: each parameter's slot, in the unsplit model's order.
        order = {name: k for k, (name, _) in enumerate(model.named_parameters())}
        names = {id(p): name for name, p in stage_module.named_parameters()}
        self._norm_slots = [order[names[id(p)]] for p in params]
        self._norm_width = len(order)
        self._device = params[0].device
        self._generators = rng.generators([self._device])
        self._grid = grid
        self._plan = plan
        self._auto = auto
        self._previous: _PreviousStep | None = None  # sent with the next step's losses
        self._gathered_profile: StepProfile | None = None
        self._grads = GradStore(
            stage_module,
            params,
            config.accumulate_dtype,
            reduction,
            first_bucket_bytes=config.first_bucket_bytes,
            bucket_cap_bytes=config.bucket_cap_bytes,
            process_group=grid.replica_group,
            timeout_s=config.timeout.total_seconds(),
            description=self._replicas_world(grid).description,
        )
        self._streams: SegmentStreams | None = None
        try:
            reduction.apply_world(prepared)
            if registered_state is not None:
                self._registered = registered_from(registered_state(stage_optimizer))
            self._join(grid, plan, newcomer=True)
        except BaseException:
            self._grads.close()
            raise
        self._streams = SegmentStreams(
            [(first + k, module) for k, (_, module) in enumerate(named_segments[first:stop])],
            self._generators,
        )
        self._buffers = BufferRule(
            stage_module, config.buffer_rule, config.virtual_nodes if config.deterministic else None
        )
        self._run: _StepRun | None = None
        self._infer_slices: list[VNSlice] | None = None  # while ``infer`` runs
        # For training (True) and inference (False): the stage, with the samples per
        # microbatch its shapes were inferred on, and its schedules by microbatch count.
        self._stages: dict[bool, tuple[int, VNStage]] = {}
        self._schedules: dict[tuple[bool, int], Any] = {}
        self._last_result: StepResult | None = None
        self._release_other_segments(named_segments, first, stop)

    # ---- settings and grid ---------------------------------------------------------

    @property
    def virtual_nodes(self) -> int:
        return self.config.virtual_nodes

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def deterministic(self) -> bool | str:
        return self.config.deterministic

    @property
    def grid(self) -> ProcessGrid:
        return self._grid

    @property
    def rank(self) -> int:
        """This process's rank in the grid (``grid.rank``): the index of its word in
        ``StepResult.signals``."""
        return self._grid.rank

    @property
    def world_size(self) -> int:
        """The grid's processes (``grid.size``)."""
        return self._grid.size

    @property
    def world(self) -> World:
        """The whole grid as a worker set: its group (None on one process or a detached
        stage), this process's rank in it and the bound on every wait."""
        return self._grid_world()

    def interrupt(self) -> None:
        """From any thread, as ``World.interrupt`` for each of the grid's groups (the
        grid's, the stage group's, the replica group's): every vflow wait on them,
        running or later, ends at once in CollectiveError (Note [Interrupting a wait],
        csrc/interrupt.cpp); the schedule's own sends and receives are torch's and end
        when the peer's connections close. vflow.elastic calls it when told that the
        worker set broke elsewhere."""
        grid = self._grid
        for group in (grid.group, grid.stage_group, grid.replica_group):
            World(group, self.config.timeout).interrupt()

    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def stage_segments(self) -> list[str]:
        """The names of the segments this process holds."""
        first, stop = self._bounds[self._grid.stage]
        return self._segment_names[first:stop]

    @property
    def segment_names(self) -> list[str]:
        """The names of the model's segments (its children), every stage's."""
        return list(self._segment_names)

    @property
    def reducer(self) -> Any:
        """This stage's C++ Reducer (``vflow._C.Reducer``)."""
        return self._grads.reducer

    @staticmethod
    def _stage_of(
        named_segments: list[tuple[str, torch.nn.Module]],
        optimizer: OptimizerFactory,
        loss_fn: LossFn | None,
        plan: Plan | AutoPlan | str | None,
        grid: ProcessGrid,
        pipeline: Pipeline,
        config: ExecutorConfig,
    ) -> _CheckedStage:
        """This process's checked arguments and its stage: what the constructor checks
        once the grid says which stage this process holds."""
        auto = auto_plan.resolve(plan)
        if auto is not None:
            if auto.kind != "counts":
                raise ValueError(
                    "plan=AutoPlan(kind='sizes') changes VN sizes, and a pipeline's microbatches "
                    "share one shape; use kind='counts'"
                )
            auto.check(bool(config.deterministic), grid.replicas)
            plan = None
        checked = PipelineExecutor._checked_plan(plan, config.virtual_nodes, grid, pipeline)
        bounds = stage_bounds([name for name, _ in named_segments], pipeline)
        first, stop = bounds[grid.stage]
        if grid.is_last and loss_fn is None:
            raise ValueError(
                f"loss_fn is None on the process holding the last stage (stage {grid.stage}, "
                f"replica {grid.replica}): the loss runs there"
            )
        stage_module = Segments(collections.OrderedDict(named_segments[first:stop]))
        stage_optimizer = optimizer([p for p in stage_module.parameters() if p.requires_grad])
        if not isinstance(stage_optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer(params) must return a torch.optim.Optimizer, got "
                f"{type(stage_optimizer).__name__}"
            )
        params = trainable_params(stage_module, stage_optimizer)
        reduction = for_kind(config.deterministic)
        reduction.check_support(params, config.accumulate_dtype, config.virtual_nodes)
        if config.amp_dtype is not None:
            _check_autocast(params[0].device, config.amp_dtype, config.amp)
        prepared = reduction.prepare_world(checked, grid.replica)
        return _CheckedStage(
            auto, checked, bounds, stage_module, stage_optimizer, params, reduction, prepared
        )

    @staticmethod
    def _check_grid(grid: object, pipeline: Pipeline) -> None:
        if not isinstance(grid, ProcessGrid):
            raise TypeError(
                f"grid must be a vflow.pipeline.ProcessGrid or None, got {type(grid).__name__}"
            )
        if not grid.member:
            raise ValueError("grid does not include this process (ProcessGrid.member is False)")
        if grid.stages != pipeline.stages:
            raise ValueError(
                f"grid has {grid.stages} stages per replica but pipeline.stages is "
                f"{pipeline.stages}"
            )

    @staticmethod
    def _checked_plan(
        plan: Plan | None, virtual_nodes: int, grid: ProcessGrid, pipeline: Pipeline
    ) -> Plan:
        if plan is None:
            if grid.replicas > virtual_nodes:
                raise ValueError(
                    f"the grid has {grid.replicas} replicas but virtual_nodes={virtual_nodes}: "
                    "every replica needs at least one VN"
                )
            plan = Plan.even(virtual_nodes, grid.replicas)
        plan = check_plan(plan, virtual_nodes, grid.replicas)
        if plan.sizes is not None:
            raise ValueError(
                "a pipelined executor takes a counts plan (Plan(counts=...)): every "
                "microbatch of a schedule must have the same shape"
            )
        pipeline.check_microbatches(plan.counts)
        return plan

    def _replicas_world(self, grid: ProcessGrid) -> World:
        return World(grid.replica_group, self.config.timeout)

    def _grid_world(self) -> World:
        return World(self._grid.group, self.config.timeout)

    def _columns(self, plan: Plan) -> list[membership.Column]:
        """What every process of a grid must share (Note [Agreement])."""
        layout = repr(
            (
                [
                    (n, tuple(p.shape), str(p.dtype))
                    for n, p in self.stage_module.named_parameters()
                ],
                [(n, tuple(b.shape), str(b.dtype)) for n, b in self.stage_module.named_buffers()],
            )
        )
        return [
            membership.Column("plan", repr(plan), repr(plan)),
            membership.Column("pipeline", repr(self.pipeline), repr(self.pipeline)),
            membership.Column("stage cut", repr(self._bounds), f"stage bounds {self._bounds}"),
            membership.Column("segments", repr(self._segment_names), "the model's children"),
            membership.Column("stage layout", layout, "this stage's parameter and buffer shapes"),
            membership.Column(
                "optimizer", type(self.optimizer).__qualname__, type(self.optimizer).__qualname__
            ),
            self._registered.column(),
            *(
                membership.Column(f"settings ({name})", value, f"{name}={value}")
                for name, value in self.config.agreed_fields()
            ),
        ]

    def _join(
        self, grid: ProcessGrid, plan: Plan, *, newcomer: bool, catch_up: bool = False
    ) -> None:
        """The stage's replicas agree and newcomers receive the stage's state (Note
        [Joining a worker set], vflow/world/membership.py); the whole grid agrees on
        what every stage shares first, and that every stage has a process at the
        members' highest step count (Note [Catching up on a grid])."""
        shared = [c for c in self._columns(plan) if c.name != "stage layout"]
        rows = membership.check_agreement(
            World(grid.group, self.config.timeout),
            shared,
            [int(not newcomer), self.step_count, grid.stage],
        )
        _check_every_stage_caught_up(rows, grid)
        progress = training_state.Progress(self.step_count, self.skipped_steps, self.seed)
        membership.join(
            self._replicas_world(grid),
            self._columns(plan),
            membership.Candidate(
                member=not newcomer,
                step_count=self.step_count,
                progress=repr(progress),
                catch_up=catch_up,
            ),
            state=self._local_state,
            load_state=self._load_received_state,
            fresh_start=lambda: self._replicas_world(grid).broadcast_from(
                0,
                [*self._params, *self.stage_module.buffers()],
                "broadcast of replica 0's stage parameters",
                None,
            ),
        )

    def _release_other_segments(
        self, named: list[tuple[str, torch.nn.Module]], first: int, stop: int
    ) -> None:
        for k, (_, module) in enumerate(named):
            if not first <= k < stop:
                module.to("meta")

    def set_plan(self, plan: Plan) -> None:
        """Runs the following steps with ``plan`` (VNs per replica). A collective of
        the grid: every process calls it between the same two steps with the same
        plan (checked; on a mismatch every process raises and keeps its plan)."""
        self._check_open()
        plan = self._checked_plan(plan, self.virtual_nodes, self._grid, self.pipeline)
        prepared = self._grads.reduction.prepare_world(plan, self._grid.replica)
        membership.check_agreement(
            self._grid_world(), [membership.Column("plan", repr(plan), repr(plan))]
        )
        self._grads.reduction.apply_world(prepared)
        self._plan = plan
        self._restart_auto()

    def register_pre_step_hook(self, fn: Callable[[PipelineExecutor], None]) -> RemovableHandle:
        """As ``vflow.Executor.register_pre_step_hook``: ``fn(executor)`` runs on every
        process in every step that steps the optimizer, after the grid's inf/NaN verdict
        and before ``max_grad_norm`` clipping, with this stage's ``param.grad`` the
        reduced gradient the optimizer will use. Register the same hooks on every
        process. Returns a handle whose ``remove()`` unregisters ``fn``."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self._check_open()
        return self._pre_step_hooks.register(fn)

    def _restart_auto(self) -> None:
        """Profiles of the new plan or grid from now on."""
        self._gathered_profile = None
        self._previous = None
        if self._auto is not None:
            self._auto.reset()

    @property
    def plan_history(self) -> list[PlanChange]:
        """The automatic plan's changes (``plan="auto"``), oldest first."""
        return [] if self._auto is None else list(self._auto.history)

    @property
    def last_profile(self) -> StepProfile | None:
        """Every replica's profile of the step before the last (Note [Automatic plans
        for replicas]); None until there is one."""
        return self._gathered_profile

    def reconfigure(
        self,
        grid: ProcessGrid,
        plan: Plan | None = None,
        *,
        catch_up: bool = False,
        newcomer: bool = False,
    ) -> None:
        """Moves to another grid between steps, at replica granularity: the same
        stages, more or fewer replicas (``plan``: default even). A collective of the
        new grid: every process of it calls this, except the processes new to the job,
        which construct their executor on ``grid`` and receive their stage's training
        state from a replica that has it, bit for bit. Processes that leave just stop
        (every process of the default group still builds the grid: ProcessGrid.of).
        Any error leaves the executor on its old grid.

        ``catch_up`` and ``newcomer``, as for ``vflow.Executor.reconfigure``: members
        of a stage behind the stage's others receive their state (every stage must
        have a process at the members' highest step count: Note [Catching up on a
        grid]); ``newcomer``: this executor was built ahead, on a detached stage
        (``ProcessGrid.detached``), and receives its stage's state here as a
        constructor on ``grid`` would. vflow.elastic uses both."""
        self._check_open()
        self._check_grid(grid, self.pipeline)
        for name, flag in (("catch_up", catch_up), ("newcomer", newcomer)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")

        def checked() -> tuple[Plan, object]:
            if grid.stage != self._grid.stage:
                raise ValueError(
                    f"this process holds stage {self._grid.stage} but would hold stage "
                    f"{grid.stage} of the new grid: reconfigure moves whole replicas, each "
                    "process keeps its stage (order the grid's ranks replica by replica)"
                )
            new_plan = self._checked_plan(plan, self.virtual_nodes, grid, self.pipeline)
            if self._auto is not None:
                self._auto.check(bool(self.deterministic), grid.replicas)
            return new_plan, self._grads.reduction.prepare_world(new_plan, grid.replica)

        # The same collectives as a newcomer's constructor, in the same order.
        plan, prepared = _together(grid, self.config, checked)
        self._join(grid, plan, newcomer=newcomer, catch_up=catch_up)
        self._take_grid(grid, plan, prepared)

    def _take_grid(self, grid: ProcessGrid, plan: Plan, prepared: object) -> None:
        """Runs the next steps on ``grid`` with ``plan`` (``prepared``: the reduction's
        ``prepare_world`` for it); the stages and schedules of the old grid go."""
        self._grads.set_world(
            grid.replica_group,
            self.config.timeout.total_seconds(),
            self._replicas_world(grid).description,
            prepared,
        )
        self._grid = grid
        self._plan = plan
        self._stages = {}
        self._schedules = {}
        self._last_result = None
        self._restart_auto()

    def abort_group(self) -> None:
        """As ``vflow.Executor.abort_group``, after a ``CollectiveError``: drops every
        group of the grid this executor holds (the grid's, its stage group's and its
        replica group's, and the pipeline stages built on them), NCCL's aborted, so that
        peers still blocked on this process fail now; a Gloo group that an interrupted
        wait left busy is held until its collective ends (vflow.world.group.retire),
        and the gradient buffers are replaced. The executor is left on its detached
        stage (``ProcessGrid.detached``; one process with S = 1) until the next
        ``reconfigure``; its training state is untouched. The registry of
        torch.distributed still holds the groups until the default group is destroyed
        (vflow.elastic does)."""
        self._check_open()
        grid = self._grid
        busy = False
        for group in (grid.group, grid.stage_group, grid.replica_group):
            if group is None:
                continue
            if backend_name(group) == "nccl":
                group.abort()
            elif retire(group):
                busy = True
        if busy:
            self._grads = self._grads.renewed()
        alone = (
            ProcessGrid.alone()
            if grid.stages == 1
            else ProcessGrid.detached(grid.stages, grid.stage)
        )
        plan = Plan.even(self.virtual_nodes, 1)
        self._take_grid(alone, plan, self._grads.reduction.prepare_world(plan, 0))

    # ---- training ------------------------------------------------------------------

    def step(
        self,
        inputs: torch.Tensor | tuple[torch.Tensor, ...] | None,
        targets: torch.Tensor | tuple[torch.Tensor, ...] | None,
        *,
        global_batch_size: int | None = None,
    ) -> StepResult:
        """Runs one global step of B samples (Note [Data per replica]).

        ``inputs``: what the first segment takes (a tensor, or a tuple of tensors, its
        positional arguments), on the first stage; ``targets``: what ``loss_fn`` takes
        beside the last segment's output (a tensor or a tuple of tensors), on the last
        stage. Each is either the whole global batch (B samples along dim 0) or, with
        ``global_batch_size=B``, only this replica's share: the samples of its VNs,
        ``plan.worker_range(grid.replica, B)``. A process that does not use them (a
        middle stage; inputs on the last stage) may pass None, with
        ``global_batch_size=B`` when it holds neither.

        On an error before the optimizer step the parameters, buffers, optimizer and
        step count stay as they were.
        """
        self._check_open()
        refuse_compiled_autograd("vflow.PipelineExecutor.step")
        grid = self._grid
        self._check_attached("step")
        batch_size, slices, mine_in, mine_target = self._replica_batch(
            inputs, targets, global_batch_size, training=True
        )
        assert self._streams is not None
        run = _StepRun(self, slices, batch_size, mine_target)
        clock = run.clock
        start = clock.mark()
        buffers = self._buffers if self._buffers.has_buffers else None
        marks: list[Any] = []  # after the VNs, after the reductions

        def compute() -> None:
            self._grads.begin_step(self.step_count)
            self._streams.begin_step(self.seed, self.step_count)  # type: ignore[union-attr]
            self._run = run
            self._feed = self._input_feed(mine_in, slices)
            try:
                if grid.stages == 1:
                    run.sequential(mine_in)
                else:
                    self._run_schedule(len(slices), slices[0].size, mine_in)
            finally:
                self._streams.end_step()  # type: ignore[union-attr]
                self._run = None
                feed, self._feed = self._feed, None
                if feed is not None:
                    feed.close()
            marks.append(clock.mark())
            run.reduce()
            if buffers is not None and grid.replicas > 1:
                buffers.reduce(self._replicas_world(grid), self.virtual_nodes, self.step_count)
            marks.append(clock.mark())

        parts = StepParts(
            self._grads,
            self.optimizer,
            self.scaler,
            buffers,
            self._generators,
            self.step_count,
            "vflow::pipeline_step",
        )
        # One verdict for the grid: every process moves its loss scale alike.
        scale = run_step(parts, run, compute)
        if run.skipped:
            self.skipped_steps += 1
        after_vns, after_reduce = marks
        end = clock.mark()
        clock.finish(end)
        result = run.result(start, after_vns, after_reduce, end, scale)
        self._last_result = result
        self._previous = _PreviousStep(
            self._plan, batch_size, self.step_count, result.profile, result.timings.reduce_wait
        )
        self._gathered_profile = run.gathered_profile
        self.step_count += 1
        self._signal.reset()
        if self._auto is not None and run.gathered_profile is not None:
            self._follow_auto_plan(run.gathered_profile, batch_size)
        return result

    def signal(self, word: int | Callable[[], int]) -> None:
        """As ``vflow.Executor.signal``: ``word`` (an int in [0, 2**31), or a function
        the step calls when it sends its losses) travels with this process's next step,
        and every process of the grid reads every process's word, by grid rank, in that
        step's ``StepResult.signals``. Reset to 0 once a step succeeds."""
        self._signal.set(word)

    def _check_attached(self, what: str) -> None:
        if self._grid.is_detached:
            raise RuntimeError(
                f"{what}: this process holds stage {self._grid.stage} of {self._grid.stages} "
                "but has no grid yet (ProcessGrid.detached): move it onto one with "
                "reconfigure(grid, newcomer=True)"
            )

    def _follow_auto_plan(self, profile: StepProfile, batch_size: int) -> None:
        """Note [Automatic plans for replicas]: every process decides the same from the
        same profile, so the new plan needs no agreement round."""
        assert self._auto is not None
        new = self._auto.observe(
            profile, self._plan, batch_size, self.step_count, self.pipeline.min_microbatches
        )
        if new is None:
            return
        self._grads.reduction.apply_world(
            self._grads.reduction.prepare_world(new, self._grid.replica)
        )
        self._plan = new

    def _replica_batch(
        self, inputs: Any, targets: Any, global_batch_size: int | None, *, training: bool
    ) -> tuple[int, list[VNSlice], Any, Any]:
        """B, this replica's VNs, and what this process takes of their samples: the
        inputs on the first stage, the targets on the last when ``training`` (Note [Data
        per replica]). Checked alike on every process, before anything changes."""
        grid = self._grid
        batch_size = self._batch_size(inputs, targets, global_batch_size)
        slices = self._plan.worker_slices(grid.replica, batch_size)
        # Every VN, not only this replica's: every process must refuse the same batch.
        if grid.stages > 1 and len(set(self._plan.vn_sizes(batch_size))) > 1:
            raise ValueError(
                f"a global batch of {batch_size} samples does not split into "
                f"virtual_nodes={self.virtual_nodes} VNs of one size; a pipeline's microbatches "
                "must all have the same shape (make B a multiple of V)"
            )
        if grid.is_first and inputs is None:
            raise ValueError(f"inputs is None on stage 0 (replica {grid.replica}): it runs them")
        if training and grid.is_last and targets is None:
            raise ValueError(
                f"targets is None on the last stage (stage {grid.stage}, replica "
                f"{grid.replica}): loss_fn takes them"
            )
        lo, hi = slices[0].start, slices[-1].start + slices[-1].size
        mine_in = _share(inputs, "inputs", batch_size, lo, hi) if grid.is_first else None
        last = training and grid.is_last
        mine_target = _share(targets, "targets", batch_size, lo, hi) if last else None
        return batch_size, slices, mine_in, mine_target

    def _batch_size(self, inputs: Any, targets: Any, global_batch_size: int | None) -> int:
        """B: ``global_batch_size``, else the samples of ``inputs`` and ``targets``
        (which must then agree: each is the whole batch)."""
        if global_batch_size is not None:
            if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int):
                raise TypeError(
                    f"global_batch_size must be an int, got {type(global_batch_size).__name__}"
                )
            batch_size = global_batch_size
        else:
            sizes = {
                name: _samples(value, name)
                for name, value in (("inputs", inputs), ("targets", targets))
                if value is not None
            }
            if not sizes:
                raise ValueError(
                    "step needs the batch size: pass inputs or targets (tensors, samples along "
                    "dim 0), or global_batch_size"
                )
            if len(set(sizes.values())) > 1:
                raise ValueError(
                    f"inputs and targets disagree on B: {sizes}; pass global_batch_size=B with "
                    "a replica's share"
                )
            batch_size = next(iter(sizes.values()))
        if batch_size < self.virtual_nodes:
            raise ValueError(
                f"the global batch has {batch_size} samples but virtual_nodes="
                f"{self.virtual_nodes}: every VN needs at least one"
            )
        return batch_size

    def _run_schedule(self, microbatches: int, microbatch_size: int, inputs: Any) -> None:
        """The replica's VNs as one schedule's microbatches (Note [A failure inside a
        schedule]). The schedule splits the inputs (each tensor of a tuple along dim 0);
        the last stage takes each VN's targets itself (``_vn_loss``), so that they may
        be a tuple too: the schedule gets a placeholder, one element per microbatch."""
        schedule = self._schedule(microbatches, microbatch_size)
        placeholder = torch.zeros(microbatches) if self._grid.is_last else None
        if self._feed is not None:
            inputs = self._feed.schedule_inputs(microbatches)
        self._schedule_step(
            schedule, inputs, f"vflow step {self.step_count}", target=placeholder, outputs=False
        )

    def _input_feed(self, inputs: Any, slices: list[VNSlice]) -> _InputFeed | None:
        """The first stage's VN inputs prepared by the prefetcher (Note [Feeding the
        first stage]); None where the schedule's own split is all there is to do."""
        if inputs is None or not (
            self._vn_inputs.transform is not None or self._prefetcher.needs_transfer(inputs)
        ):
            return None
        lo = slices[0].start
        local = [VNSlice(s.vn, s.start - lo, s.size) for s in slices]
        jobs = self._vn_inputs.jobs(inputs, local, self.seed, self.step_count)
        return _InputFeed(self._prefetcher.batches(jobs))

    def stage_inputs(self, microbatch: int, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """A StageListener's: the first stage's arguments for ``microbatch``."""
        if self._feed is None or self._infer_slices is not None:
            return args
        return self._feed.arguments(microbatch)

    def _schedule_step(
        self, schedule: Any, inputs: Any, where: str, *, target: Any, outputs: bool
    ) -> Any:
        """``schedule.step`` on ``inputs`` (a tensor or a tuple: the first segment's
        arguments), its failures from the network as CollectiveError (Note [A failure
        inside a schedule])."""
        args = () if inputs is None else inputs if isinstance(inputs, tuple) else (inputs,)
        try:
            return schedule.step(*args, target=target, return_outputs=outputs)
        except CollectiveError:
            raise
        except RuntimeError as e:
            if not _from_the_network(e):
                raise
            raise CollectiveError(
                f"{where}: the pipeline's sends and receives on "
                f"{World(self._grid.stage_group, self.config.timeout).description} failed "
                f"(another stage of replica {self._grid.replica} failed or is gone): {e}"
            ) from e

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """What the segments' forwards and ``loss_fn`` run under (Note [Mixed precision
        on a grid])."""
        if self.config.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self._device.type, dtype=self.config.amp_dtype)

    def _schedule(self, microbatches: int, microbatch_size: int, training: bool = True) -> Any:
        """The schedule of ``microbatches`` microbatches: the pipeline's, with the VN loss,
        for training; forward only (GPipe's order, no loss) for ``infer``. Training and
        inference have stages of their own: a stage's shape inference knows whether a
        backward follows."""
        held = self._stages.get(training)
        if held is None or held[0] != microbatch_size:
            # No stage yet, or its shapes were inferred on other microbatches.
            grid = self._grid
            assert grid.stage_group is not None
            stage = VNStage(
                self.stage_module, grid.stage, grid.stages, self._device, grid.stage_group, self
            )
            held = self._stages[training] = (microbatch_size, stage)
            self._schedules = {k: v for k, v in self._schedules.items() if k[0] != training}
        schedule = self._schedules.get((training, microbatches))
        if schedule is None:
            if training:
                schedule = SCHEDULES[self.pipeline.schedule](
                    held[1], microbatches, loss_fn=self._vn_loss, scale_grads=False
                )
            else:
                schedule = SCHEDULES["GPipe"](held[1], microbatches)
            self._schedules[(training, microbatches)] = schedule
        return schedule

    # The StageListener of VNStage (Note [Capturing a stage's gradients]).

    def forward_begins(self, microbatch: int) -> None:
        assert self._streams is not None
        if self._infer_slices is not None:
            self._streams.begin_vn(self._infer_slices[microbatch].vn)
            return
        assert self._run is not None
        self._streams.begin_vn(self._run.slices[microbatch].vn)
        self._run.mark(microbatch, 0)

    def forward_ends(self, microbatch: int) -> None:
        if self._infer_slices is not None:
            return
        assert self._run is not None
        self._run.mark(microbatch, 1)
        self._run.loss_position = microbatch
        if self._buffers.has_buffers:
            self._buffers.end_vn(self._run.slices[microbatch].vn)

    @contextlib.contextmanager
    def backward(self, microbatch: int) -> Iterator[None]:
        assert self._run is not None
        run = self._run
        run.mark(microbatch, 2)
        last = microbatch == len(run.slices) - 1
        with self._grads.capture(1.0, last, self._grads.reduction.placement(microbatch)):
            yield
        run.mark(microbatch, 3)

    def _vn_loss(self, output: Any, placeholder: Any) -> torch.Tensor:
        """The schedule's loss function on the last stage: the VN's weighted loss
        (Note [VNs as microbatches]), on the VN's targets (``_run_schedule``)."""
        assert self.loss_fn is not None and self._run is not None
        run = self._run
        if run.loss_position is None:
            # Shape inference, on the first VN's targets: its loss is thrown away (Note
            # [Capturing a stage's gradients]).
            with self.autocast():
                out = self.loss_fn(output, run.vn_targets(0))
            return out[0] if isinstance(out, tuple) else out
        position, run.loss_position = run.loss_position, None
        with self.autocast():
            out = self.loss_fn(output, run.vn_targets(position))
        return run.weighted_loss(position, out)

    # ---- inference ---------------------------------------------------------------------

    def infer(
        self,
        inputs: torch.Tensor | tuple[torch.Tensor, ...] | None,
        *,
        global_batch_size: int | None = None,
        gather: bool = True,
    ) -> Any:
        """The last segment's outputs for a batch of B samples, under no_grad, on the
        grid (Note [Inference on a grid]): each replica forwards its VNs as the
        microbatches of a forward-only schedule (one after another when S = 1).

        ``inputs`` and ``global_batch_size`` as for ``step`` (the whole batch, or the
        replica's share with ``global_batch_size``; None on the other stages). Returns,
        on each process holding a last stage, the outputs of the whole batch in batch
        order (``gather``, the default: gathered over the replicas' last stages) or of
        its replica's share (``gather=False``); None on the other stages. Outputs are
        tensors or tuples/dicts of them, concatenated along dim 0. Dropout and
        BatchNorm follow the modules' mode: call ``stage_module.eval()`` first (the
        executor does not change it). A collective of the grid."""
        self._check_open()
        self._check_attached("infer")
        if not isinstance(gather, bool):
            raise TypeError(f"gather must be a bool, got {type(gather).__name__}")
        grid = self._grid
        batch_size, slices, mine, _ = self._replica_batch(
            inputs, None, global_batch_size, training=False
        )
        lo = slices[0].start
        assert self._streams is not None
        local: Any = None
        with (
            torch.no_grad(),
            rng.preserved_rng(self._generators),
            profiled("vflow::pipeline_infer", torch.autograd._profiler_enabled()),
        ):
            self._streams.begin_step(self.seed, self.step_count)
            self._infer_slices = slices
            try:
                if grid.stages == 1:
                    outputs = []
                    for position, vn_slice in enumerate(slices):
                        start = vn_slice.start - lo
                        vn_inputs = _rows(mine, start, start + vn_slice.size)
                        self.forward_begins(position)
                        with self.autocast():
                            outputs.append(
                                self.stage_module(
                                    *vn_inputs if isinstance(vn_inputs, tuple) else (vn_inputs,)
                                )
                            )
                    local = concat_outputs(outputs)
                else:
                    local = self._infer_schedule(len(slices), slices[0].size, mine)
            finally:
                self._streams.end_step()
                self._infer_slices = None
        if not grid.is_last:
            return None
        if not gather or grid.replicas == 1:
            return local
        world = World(grid.replica_group, self.config.timeout)
        return inference.gather(world, self._plan, local, batch_size, self.step_count)

    def _infer_schedule(self, microbatches: int, microbatch_size: int, inputs: Any) -> Any:
        schedule = self._schedule(microbatches, microbatch_size, training=False)
        where = f"vflow (inference at step {self.step_count})"
        return self._schedule_step(schedule, inputs, where, target=None, outputs=True)

    # ---- training state --------------------------------------------------------------

    def _local_state(self) -> dict[str, Any]:
        """This stage's training state (what a newcomer replica of it receives)."""
        return training_state.build(
            self._state_target(),
            training_state.Progress(self.step_count, self.skipped_steps, self.seed),
            bool(self.deterministic),
            self._grid.replicas,
            list(self._plan.counts),
        )

    def _load_local_state(self, state: dict[str, Any], *, assign: bool = False) -> None:
        progress = training_state.load(self._state_target(), state, assign=assign)
        self.step_count = progress.step_count
        self.skipped_steps = progress.skipped_steps
        self.config = self.config.with_seed(progress.seed)

    def _load_received_state(self, state: object) -> Callable[[], None]:
        return training_state.load_received(state, self._local_state, self._load_local_state)

    def _state_target(self) -> training_state.Target:
        return training_state.Target(
            self.stage_module, self.optimizer, self.scaler, self.virtual_nodes, self._registered
        )

    def register_state(self, name: str, obj: Any) -> None:
        """As ``vflow.Executor.register_state``: ``obj`` (with ``state_dict()`` and
        ``load_state_dict()``) becomes part of this stage's training state under
        ``name``. Every process registers the same names; ``full_state_dict()`` keeps stage
        0's objects (Note [A state for every grid]) and gives them to every stage on
        loading, so register objects that are alike on every stage (a scheduler of
        each stage's optimizer with the same settings). A process joining a grid must
        have them before it joins: pass ``registered_state`` to its constructor."""
        self._check_open()
        self._registered.register(name, obj)

    def stage_state_dict(self) -> dict[str, Any]:
        """This process's stage alone, no collective: its segments' state dict and its
        optimizer state under the unsplit model's names, its registered objects' and
        loss scaler's states (vflow.pipeline.state's part of a stage; what
        ``vflow.pipeline.save`` writes from each process)."""
        self._check_open()
        return pipeline_state.stage_part(
            self.stage_module,
            self.optimizer,
            self._grid.stage,
            self._registered,
            None if self.scaler is None else self.scaler.state_dict(),
        )

    def state_dict(self) -> dict[str, Any]:
        """This stage's training state, no collective (Note [A state for every grid]'s
        layout with this stage's entries only): its segments' state dict under the
        unsplit model's names, its optimizer state by parameter name, step counts,
        seed, registered objects and loss scaler. It loads back into this stage on any
        grid with the same cut (``load_state_dict``); ``full_state_dict`` gathers every
        stage's, and ``vflow.pipeline.save`` writes them without gathering."""
        return self._assembled([self.stage_state_dict()])

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model's training state, gathered from every stage onto every
        process (a collective of the grid; every stage's memory on every process): it
        loads on any grid with the same V (``load_state_dict``), and into ``stages=1``
        on one process."""
        self._check_open()
        mine = self.stage_state_dict() if self._grid.replica == 0 else None
        return self._assembled(pipeline_state.gather(self._grid_world(), mine, self._grid.stages))

    def _assembled(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        return pipeline_state.assemble(
            parts,
            virtual_nodes=self.virtual_nodes,
            seed=self.seed,
            step_count=self.step_count,
            skipped_steps=self.skipped_steps,
            deterministic=bool(self.deterministic),
            optimizer_class=type(self.optimizer),
            written_by={
                "replicas": self._grid.replicas,
                "stages": self._grid.stages,
                "plan_counts": list(self._plan.counts),
            },
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores this stage's part of ``state`` (``full_state_dict`` from any grid,
        ``state_dict`` from this stage on any grid with the same cut, or what
        ``vflow.pipeline.load`` reads). Every process of the grid loads the same state;
        each raises before changing anything when it does not fit its stage."""
        self._check_open()
        local = pipeline_state.stage_state(
            state, self.stage_module, self.optimizer, self._local_state(), self._segment_names
        )
        self._load_local_state(local)

    # ---- lifecycle ---------------------------------------------------------------------

    @property
    def last_result(self) -> StepResult | None:
        return self._last_result

    @property
    def closed(self) -> bool:
        return getattr(self, "_grads", None) is None

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this PipelineExecutor is closed")

    def close(self) -> None:
        """Removes vflow's hooks from the stage's modules."""
        grads = getattr(self, "_grads", None)
        if grads is None:
            return
        grads.close()
        self._grads = None  # type: ignore[assignment]
        streams = getattr(self, "_streams", None)
        if streams is not None:
            streams.remove()
        prefetcher = getattr(self, "_prefetcher", None)
        if prefetcher is not None:
            prefetcher.close()

    def __enter__(self) -> PipelineExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class _StepRun:
    """One step's bookkeeping on one process: the VNs' losses (last stage, kept as
    tensors until the step's one read), the step's clock, the reductions that follow
    the schedule."""

    def __init__(
        self, executor: PipelineExecutor, slices: list[VNSlice], total: int, targets: Any
    ) -> None:
        self.executor = executor
        self.slices = slices
        self.total = total
        self.targets = targets  # this replica's share (last stage), else None
        self.clock = StepClock(executor._device)
        self.scale = 1.0 if executor.scaler is None else executor.scaler.scale
        self.loss_position: int | None = None
        self.kind: losses.LossKind | None = None
        # (vn, detached loss, weight, num_items) of each VN this process computed the loss of.
        self.vn_losses: list[tuple[int, torch.Tensor, float, Any]] = []
        self.times: list[list[Any]] = [[None, None, None, None] for _ in slices]
        self.loss = math.nan
        self.num_items: int | float = 0
        self.skipped = False
        self.published = False
        self.grad_norm: float | None = None
        self.wait_s = 0.0
        self.profiling = torch.autograd._profiler_enabled()
        self.gathered_profile: StepProfile | None = None
        self._row = torch.zeros(0)
        self._signals_at = 0
        self.signals: tuple[int, ...] = (0,)  # every process's word, by grid rank
        self._layout: _ProfileLayout | None = None
        self._pending: PendingSum | None = None  # the losses' sum the last stage did not wait for

    def mark(self, position: int, point: int) -> None:
        self.times[position][point] = self.clock.mark()

    def _bounds(self, position: int) -> tuple[int, int]:
        lo = self.slices[position].start - self.slices[0].start
        return lo, lo + self.slices[position].size

    def vn_targets(self, position: int) -> Any:
        return _rows(self.targets, *self._bounds(position))

    def weighted_loss(self, position: int, out: Any) -> torch.Tensor:
        """The loss the VN's backward starts from: weighted (mean losses) and scaled
        (fp16 loss scaling); its value stays on the device until the step's one read."""
        vn, size = self.slices[position].vn, self.slices[position].size
        parsed = losses.parse(out, vn)
        if self.kind is None:
            self.kind = parsed.kind
        elif parsed.kind != self.kind:
            losses.check_same_kind(parsed.kind, self.kind, vn, self.slices[0].vn)
        weight = size / self.total if parsed.kind == "mean" else 1.0
        self.vn_losses.append((vn, parsed.loss.detach(), weight, parsed.items))
        loss = parsed.loss if weight == 1.0 else parsed.loss * weight
        return loss if self.scale == 1.0 else loss.float() * self.scale

    def sequential(self, inputs: Any) -> None:
        """S = 1: the replica's VNs one after another (the single-process reference)."""
        ex = self.executor
        assert ex.loss_fn is not None
        feed = ex._feed
        for position in range(len(self.slices)):
            if feed is not None:
                vn_inputs: Any = feed.take(position)
            else:
                vn_inputs = _rows(inputs, *self._bounds(position))
            ex.forward_begins(position)
            with profiled("vflow::forward", self.profiling), ex.autocast():
                output = ex.stage_module(
                    *vn_inputs if isinstance(vn_inputs, tuple) else (vn_inputs,)
                )
            ex.forward_ends(position)
            self.loss_position = None
            with ex.autocast():
                out = ex.loss_fn(output, self.vn_targets(position))
            loss = self.weighted_loss(position, out)
            with ex.backward(position), profiled("vflow::backward", self.profiling):
                loss.backward()

    def _losses_row(self, width: int, device: torch.device, signals_at: int) -> torch.Tensor:
        """The VN losses and item counts in their slots of a float64 row on ``device``,
        built with tensor operations (no host synchronisation on an accelerator); the
        products are the float64 ones of ``n_i / B * loss_i``, the same bits on any grid.
        From ``signals_at``, a slot per process of the grid: its signal word (exact in
        float64), read now (``PipelineExecutor.signal``)."""
        virtual_nodes = self.executor.virtual_nodes
        host = [0.0] * width
        self._signals_at = signals_at
        host[signals_at + self.executor.grid.rank] = float(self.executor._signal.read())
        if self.kind is not None:
            host[2 * virtual_nodes + (0 if self.kind == "mean" else 1)] = len(self.vn_losses)
        previous = self.executor._previous
        if previous is not None:
            assert self._layout is not None
            self._layout.encode(host, 2 * virtual_nodes + 2, previous)
        row = torch.tensor(host, dtype=torch.float64, device=device)
        if self.vn_losses:
            vns, values, weights, items = zip(*self.vn_losses, strict=True)
            source = values[0].device
            weighted = torch.stack([v.double() for v in values]) * torch.tensor(
                weights, dtype=torch.float64, device=source
            )
            counts = torch.stack(
                [torch.as_tensor(n, dtype=torch.float64).to(source) for n in items]
            )
            index = torch.tensor(vns, device=device)
            row[index] = weighted.to(device)
            row[virtual_nodes + index] = counts.to(device)
        return row

    def reduce(self) -> None:
        """Every VN's loss to every process, the global normalisation, the inf/NaN
        verdict of all stages and the global gradient norm (Note [The last stage does
        not wait], Note [One norm for the grid])."""
        ex = self.executor
        virtual_nodes = ex.virtual_nodes
        world = ex._grid_world()
        self._layout = _ProfileLayout(virtual_nodes, ex.grid)
        signals_at = 2 * virtual_nodes + 2 + self._layout.size
        row = self._losses_row(signals_at + ex.grid.size, world.device, signals_at)
        self._row = row
        check = ex.config.skip_nonfinite or bool(ex.deterministic)
        clip = ex.config.max_grad_norm
        if (
            ex.grid.is_last
            and self.kind == "mean"
            and not check
            and clip is None
            and world.distributed
        ):
            self._pending = world.start_sum(row, "all-reduce of the VN losses", ex.step_count)
            ex._grads.finish(1.0, False)
            return
        waited = time.perf_counter()
        world.sum([row], "all-reduce of the VN losses", ex.step_count)
        self.wait_s = time.perf_counter() - waited
        factor = self._read_losses() / self.scale
        found = ex._grads.finish(factor, check)
        # With pre-step hooks the norm is taken after them (Note [Before the optimizer
        # step]): here only the verdict.
        norms = clip is not None and not ex._pre_step_hooks
        if norms or (check and world.distributed):
            found = self._verdict_and_norm(world, found, check, norms)
        if found and bool(ex.deterministic) and not ex.config.skip_nonfinite:
            raise FloatingPointError(
                f"vflow step {ex.step_count}: a gradient of the global batch is inf or NaN, "
                "or its sum does not fit float32; nothing was changed. Pass "
                "skip_nonfinite=True to skip such steps instead"
            )
        self.skipped = found

    def _verdict_and_norm(self, world: World, found: bool, check: bool, norms: bool) -> bool:
        """One all-reduce over the grid: whether any stage's gradient is inf/NaN and,
        with ``norms``, every parameter's norm in its slot (Note [One norm for the
        grid]), then ``param.grad`` clipped to ``max_grad_norm`` when the step goes on."""
        ex = self.executor
        clip = ex.config.max_grad_norm
        row = torch.zeros(1 + ex._norm_width, dtype=torch.float64, device=world.device)
        row[0] = float(found and check)
        if norms:
            ex._grads.publish()
            self.published = True
            if ex.grid.replica == 0:  # the replicas hold the same gradient: counted once
                grads = [p.grad for p in ex._params]
                each = torch.stack(
                    [
                        torch.linalg.vector_norm(
                            g, dtype=torch.promote_types(g.dtype, torch.float32)
                        ).double()
                        for g in grads
                    ]
                )
                index = torch.tensor(ex._norm_slots, device=world.device) + 1
                row[index] = each.to(world.device)
        world.sum([row], "all-reduce of the inf/NaN verdict and the gradient norms", ex.step_count)
        values = row.tolist()
        found = values[0] > 0
        if not norms or clip is None or found:
            return found
        squares = 0.0
        for value in values[1:]:  # the unsplit model's order: the same bits on any grid
            squares += value * value
        self.grad_norm = math.sqrt(squares)
        coefficient = clip / (self.grad_norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s
        if coefficient < 1.0:
            for p in ex._params:
                p.grad.mul_(coefficient)  # type: ignore[union-attr]
        return False

    def before_optimizer(self) -> None:
        """Note [Before the optimizer step] (vflow/runtime/step_run.py): the pre-step
        hooks, then clipping by the grid's norm, which without hooks ran in ``reduce``."""
        ex = self.executor
        if not ex._pre_step_hooks:
            return
        ex._pre_step_hooks.call(ex, ex._params)
        if ex.config.max_grad_norm is not None:
            self._verdict_and_norm(ex._grid_world(), False, False, norms=True)

    def after_optimizer(self) -> None:
        """After the optimizer step: the losses' all-reduce the last stage did not wait
        for (Note [The last stage does not wait])."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        waited = time.perf_counter()
        pending.wait()
        self.wait_s = time.perf_counter() - waited
        self._read_losses()

    def _read_losses(self) -> float:
        """The global loss and item count from the reduced row (the step's one read of
        the losses); returns the factor the gradients are normalised by."""
        ex, row, virtual_nodes = self.executor, self._row, self.executor.virtual_nodes
        values = row.tolist()
        at = self._signals_at
        self.signals = tuple(int(w) for w in values[at : at + ex.grid.size])
        if ex._previous is not None:
            assert self._layout is not None
            self.gathered_profile = self._layout.decode(values, 2 * virtual_nodes + 2, ex._previous)
        means, sums = int(values[2 * virtual_nodes]), int(values[2 * virtual_nodes + 1])
        if means and sums:
            raise ValueError(
                f"loss_fn returned mean losses for {means} VNs and (sum, num_items) for "
                f"{sums}; every VN must return the same kind"
            )
        loss_total = sum(values[:virtual_nodes])  # VN order: the same bits on any grid
        if sums:
            items_total = sum(values[virtual_nodes : 2 * virtual_nodes])
            losses.check_item_total(items_total)
            self.num_items = items_total
            self.loss = loss_total / items_total
            return 1.0 / items_total
        self.num_items = self.total
        self.loss = loss_total
        return 1.0

    def result(
        self, start: Any, after_vns: Any, after_reduce: Any, end: Any, loss_scale: float | None
    ) -> StepResult:
        """Once the step is committed and ``clock.finish(end)`` ran."""
        ex, seconds = self.executor, self.clock.seconds
        vns = tuple(
            VNProfile(s.vn, s.size, seconds(t[0], t[1]), seconds(t[2], t[3]))
            for s, t in zip(self.slices, self.times, strict=True)
        )
        wait = self.wait_s + ex._grads.last_wait_seconds
        profile = WorkerProfile(
            ex.grid.rank,
            ex.step_count,
            vns,
            sum(v.forward_s + v.backward_s for v in vns),
            wait,
            seconds(after_reduce, end),
            seconds(start, end),
        )
        timings = PhaseTimings(
            seconds(start, after_vns),
            seconds(after_vns, after_reduce),
            seconds(after_reduce, end),
            wait,
        )
        return StepResult(
            self.loss,
            self.num_items,
            ex.step_count,
            self.skipped,
            loss_scale,
            self.grad_norm,
            timings,
            lambda: profile,
            self.signals,
        )


# Note [Feeding the first stage]
# With ``vn_transform``, or inputs on the CPU for a stage on a GPU, the first stage's VN
# inputs are prepared as vflow.Executor prepares its VN batches (vflow.data: the slice,
# the deterministic-mode copy, the transform drawing from (seed, step, VN)'s generator,
# the copy to the GPU on a side stream), by the same Prefetcher, the next VN's while the
# current one computes. With S = 1 the loop takes them one by one. With S > 1 the
# schedule splits its inputs itself and infers the stage's shapes from the first
# microbatch: it is given VN 0's prepared inputs, repeated once per microbatch (so that
# the shapes it infers are the prepared ones), and the stage's forward of microbatch i
# takes VN i's prepared inputs instead of the schedule's slice (VNStage asks
# ``stage_inputs``). Forwards run in microbatch order in both schedules, which is the
# order the prefetcher prepares them in. Every VN's prepared inputs must then have VN
# 0's shapes and dtypes (checked): a pipeline's microbatches share one shape.


class _InputFeed:
    """The prepared VN inputs of one step, taken in microbatch order (Note [Feeding the
    first stage]); VN 0's are kept for the step, the others handed on."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self._batches = batches
        self._first: Any = None
        self._next = 0

    def take(self, position: int) -> Any:
        if position == 0:
            if self._first is None:
                self._first = next(self._batches)
            self._next = max(self._next, 1)
            return self._first
        if position != self._next:
            raise RuntimeError(
                f"vflow: microbatch {position}'s inputs asked for before microbatch "
                f"{self._next}'s; the schedule runs its forwards out of order"
            )
        self._next += 1
        return next(self._batches)

    def arguments(self, position: int) -> tuple[Any, ...]:
        batch = self.take(position)
        args = batch if isinstance(batch, tuple) else (batch,)
        first = self._first if isinstance(self._first, tuple) else (self._first,)
        if [(t.shape, t.dtype) for t in args] != [(t.shape, t.dtype) for t in first]:
            raise ValueError(
                f"vn_transform gave microbatch {position} tensors of "
                f"{[(tuple(t.shape), t.dtype) for t in args]} but microbatch 0 "
                f"{[(tuple(t.shape), t.dtype) for t in first]}: a pipeline's microbatches "
                "must share one shape"
            )
        return args

    def schedule_inputs(self, microbatches: int) -> Any:
        """What the schedule splits: VN 0's prepared inputs once per microbatch."""
        first = self.take(0)
        if isinstance(first, tuple):
            return tuple(torch.cat([t] * microbatches) for t in first)
        return torch.cat([first] * microbatches)

    def close(self) -> None:
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()


# Note [Mixed precision on a grid]
# With amp, every segment's forward and loss_fn run under autocast, on every stage,
# shape inference included (VNStage), and backwards outside it: the same operations in
# the same dtypes as in the single-process reference, so an activation crosses stages in
# the dtype autocast gave it and the bits do not depend on the cut. fp16 loss scaling is
# the step's, not a stage's: the last stage multiplies each VN's loss by the scale
# before its backward, every stage divides its reduced gradient by it with the global
# normalisation, and one inf/NaN verdict, summed over the whole grid with the gradient
# norms (Note [One norm for the grid]), decides whether the step is skipped; each
# process then moves its LossScaler alike, so the scale stays one number for the grid.

# Note [One norm for the grid]
# max_grad_norm clips the gradient of the whole model, whose parameters are spread over
# the stages. After the reduction each process takes the 2-norm of each of its
# parameters' gradients (in at least float32) and writes it, as float64, into the slot
# of that parameter in the unsplit model's parameter order, in a row that one
# all-reduce sums over the grid (only replica 0 writes: the replicas of a stage hold the
# same gradient). Every slot has one writer, so the sum is exact; every process then
# adds the squares in slot order, in float64 on the host, and takes the square root:
# the same norm, to the bit, on every process and on every grid, one process included.
# The coefficient is torch.nn.utils.clip_grad_norm_'s, applied to ``param.grad``.

# Note [The last stage does not wait]
# The last stage ends its schedule a backward or two before the first, and the first
# stages need the losses' all-reduce before their optimizer step (only there do they
# learn the loss's kind and, for summed losses, the global item count). The last stage
# computed the losses itself: with mean losses its gradients are complete without the
# all-reduce, so, unless the inf/NaN verdict is wanted (deterministic mode,
# skip_nonfinite), it steps its optimizer first and waits for the all-reduce after,
# overlapping its step with the first stages' last backwards, as a pipeline without
# vflow does. The price: should the all-reduce then fail, or reveal that another
# replica's VNs returned summed losses, the last stage has already stepped.

# Note [Automatic plans for replicas]
# With plan="auto" the planner of vflow.Executor (Note [Automatic plans],
# vflow/planning/auto_plan.py) balances VNs across *replicas*. A replica's speed is its
# slowest stage's: a VN's time in the replica's profile is the forward and backward of
# the stage that took longest on it, its step time the longest of its stages'. Each
# process writes its last step's VN times, step time and exposed communication into
# slots of its own in the next step's losses all-reduce (so no collective is added),
# every process reads the same replica profiles back and decides the same plan. A
# plan never leaves a replica fewer VNs than 1F1B needs (one per stage). The profiles
# do not model the pipeline's own bubble, (S - 1) slots per replica: it is part of
# what the planner sees as the step's fixed time. ``reconfigure`` (and ``set_plan``)
# start the planner over, unlike vflow.Executor's (Note [Plans across worker sets]): a
# grid's join runs stage by stage, and every process of the grid would have to carry
# the same replicas' models for their decisions to stay alike; nothing makes the
# stages' tables agree yet.


@dataclasses.dataclass(frozen=True)
class _PreviousStep:
    """What this process knows of its last step, sent with the next one's losses."""

    plan: Plan
    batch_size: int
    step: int
    profile: WorkerProfile
    exposed_s: float


class _ProfileLayout:
    """Note [Automatic plans for replicas]: where each process writes its last step's
    VN times, step time and exposed communication in the losses' all-reduce (a slot per
    process and VN, so the sum is exact), and the replicas' profiles read back."""

    def __init__(self, virtual_nodes: int, grid: ProcessGrid) -> None:
        self.virtual_nodes = virtual_nodes
        self.grid = grid
        self.per_vn = virtual_nodes * grid.stages
        self.size = 2 * self.per_vn + 2 * grid.size

    def encode(self, row: list[float], at: int, previous: _PreviousStep) -> None:
        """Writes ``previous`` into ``row`` from index ``at`` (host values: no tensor
        element writes, each a device operation on an accelerator)."""
        stage, stages = self.grid.stage, self.grid.stages
        for vn in previous.profile.vns:
            row[at + vn.vn * stages + stage] = vn.forward_s
            row[at + self.per_vn + vn.vn * stages + stage] = vn.backward_s
        row[at + 2 * self.per_vn + self.grid.rank] = previous.profile.step_s
        row[at + 2 * self.per_vn + self.grid.size + self.grid.rank] = previous.exposed_s

    def decode(self, summed: list[float], at: int, previous: _PreviousStep) -> StepProfile:
        values, stages = summed[at:], self.grid.stages
        sizes = previous.plan.vn_sizes(previous.batch_size)
        replicas = []
        for replica in range(self.grid.replicas):
            vns = []
            for vn in previous.plan.vns(replica):
                times = [
                    (values[vn * stages + s], values[self.per_vn + vn * stages + s])
                    for s in range(stages)
                ]
                forward_s, backward_s = max(times, key=sum)  # the slowest stage sets the pace
                vns.append(VNProfile(vn, sizes[vn], forward_s, backward_s))
            ranks = range(replica * stages, (replica + 1) * stages)
            step_s = max(values[2 * self.per_vn + r] for r in ranks)
            exposed_s = max(values[2 * self.per_vn + self.grid.size + r] for r in ranks)
            compute_s = sum(v.forward_s + v.backward_s for v in vns)
            replicas.append(
                WorkerProfile(replica, previous.step, tuple(vns), compute_s, exposed_s, 0.0, step_s)
            )
        return StepProfile(previous.step, tuple(replicas))


class _CheckedStage(NamedTuple):
    auto: AutoPlan | None
    plan: Plan
    bounds: list[tuple[int, int]]
    module: torch.nn.Sequential
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    reduction: Reduction
    prepared: object


def _together(grid: ProcessGrid, config: ExecutorConfig, check: Callable[[], Any]) -> Any:
    """Runs this process's ``check`` and tells the grid how it went: a process whose
    arguments are refused raises its own error, and the others raise at once too,
    instead of waiting for it in the next collective until the timeout."""
    error: Exception | None = None
    try:
        result = check()
    except (TypeError, ValueError) as e:
        error = e
    flags = World(grid.group, config.timeout).gather_ints(
        [int(error is not None)], "gather of the argument checks", None
    )
    if error is not None:
        raise error
    refused = [rank for rank, (flag,) in enumerate(flags) if flag]
    if refused:
        raise ValueError(
            f"process(es) {refused} of the grid refused their PipelineExecutor arguments "
            "(their own errors say why); nothing was changed"
        )
    return result


# Note [Inference on a grid]
# ``infer`` runs the forward only, VN by VN, on the processes that hold the stages:
# with S > 1 as the microbatches of a forward-only schedule (GPipe's order, no loss;
# a stage of its own, since shape inference differs when no backward follows), with
# S = 1 one after another. Each segment draws from its VN's stream of the current step
# (Note [Segment streams]), as in training, so the outputs are the same bits on every
# grid and in one process. Only a replica's last stage holds outputs: the last stages
# gather them over their replica group (whose ranks are the replicas, the plan's
# workers), so every one returns the whole batch's outputs in batch order; the other
# stages return None, since nothing they hold needs the outputs. Nothing of the
# training state changes: no gradient, no buffer rule, no step.

# Note [A failure inside a schedule]
# A stage whose forward, loss or backward raises leaves the schedule there; the other
# stages of its replica wait for what it would have sent until the stage group's
# timeout (ProcessGrid.of's ``timeout``, the executor's when it builds the grid), then
# Gloo raises a RuntimeError of its own. Such errors, the ones that come from the
# network rather than from the stage's own code, become CollectiveError naming the
# step and the group, like every other failed collective of vflow, so that a caller
# (an elastic job) can tell a lost peer from a bug; the process whose own code raised
# raises its own error. Either way nothing was committed: the step's failure path
# restores the stage. The stage group's messages of the failed step may still be in
# flight: the grid is not used again (a job moves to a new one).


# Note [Building a stage ahead]
# An elastic worker builds its executor before it joins a grid (Note [Joining ahead],
# vflow/elastic/job.py): building a model and an optimizer takes seconds, which the
# members should not wait for. For a pipeline it does so on a detached stage
# (``ProcessGrid.detached(S, s)``): it knows which stage it holds, so it builds only
# that stage's segments, its optimizer and its gradient buffers, alone, as one replica
# without any group; ``step`` and ``infer`` refuse to run there. Its first
# ``reconfigure(grid, newcomer=True)`` moves it onto a grid as a constructor on that
# grid would, receiving its stage's training state from the stage's members. A
# process whose grid broke is left on its detached stage too (``abort_group``).

# Note [Catching up on a grid]
# A grid that broke during a step's last collective (the all-reduce of the losses, or
# of the verdict and norms) may have processes that committed the step and others that
# did not: ``catch_up`` lets a stage's processes behind receive the state of one of
# that stage ahead (over the replica group, Note [Joining a worker set]). That needs,
# for every stage, a process at the members' highest step count; a stage whose every
# process is behind cannot catch up, since no process holds its segments' state of
# that step, and every process raises alike (the whole grid checks it first, from one
# all-gather).


def _check_every_stage_caught_up(rows: list[list[int]], grid: ProcessGrid) -> None:
    """Note [Catching up on a grid]: ``rows`` are every process's (member, step count,
    stage)."""
    steps = [step for member, step, _ in rows if member]
    if not steps:
        return
    top = max(steps)
    behind = sorted(
        {
            stage
            for stage in range(grid.stages)
            if not any(member and step == top and s == stage for member, step, s in rows)
        }
    )
    if behind:
        raise ValueError(
            f"stage(s) {behind} of the grid have no process at step {top}, the step other "
            "stages' processes reached: their state of that step is lost, and the grid "
            "cannot go on from it (Note [Catching up on a grid])"
        )


def _from_the_network(error: BaseException) -> bool:
    """Whether a RuntimeError raised by a schedule came from the process group (a peer
    gone, a wait timed out) rather than from this stage's own code, which the
    schedule re-raises as a RuntimeError with the original as its cause."""
    seen: BaseException | None = error
    while seen is not None:
        if not isinstance(seen, RuntimeError):
            return False  # the stage's own code: its error, wrapped
        if isinstance(seen, torch.distributed.DistError):
            return True
        seen = seen.__cause__ or seen.__context__
    text = str(error).lower()
    return any(
        word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer")
    )


def _check_autocast(device: torch.device, dtype: torch.dtype, amp: str | None) -> None:
    """Refuses ``amp`` on a device whose autocast does not run ``dtype`` (autocast would
    otherwise warn and run in float32)."""
    if not torch.amp.is_autocast_available(device.type):
        raise ValueError(f"amp={amp!r}: autocast is not available on {device.type}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast(device.type, dtype=dtype):
            supported = torch.is_autocast_enabled(device.type)
    if not supported or (
        device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported()
    ):
        raise ValueError(
            f"amp={amp!r}: {device} does not run autocast in {dtype}; use another amp or None"
        )


# Note [Data per replica]
# A replica runs the VNs the plan gives it, consecutive in the global batch: samples
# [start, stop) = plan.worker_range(replica, B). Only its first stage reads inputs and
# only its last stage reads targets, so a data loader need not give any process the
# whole global batch: with ``global_batch_size=B`` the first stage may be given its
# replica's share of the inputs, the last stage its share of the targets, the middle
# stages nothing. The whole batch is still taken (and sliced here), which keeps a
# single-process loop unchanged.


def _samples(value: Any, name: str) -> int:
    """The samples along dim 0 of a tensor or of a tuple of tensors (which must agree)."""
    parts = value if isinstance(value, (tuple, list)) else (value,)
    if not parts or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in parts):
        raise TypeError(
            f"{name} must be a tensor or a tuple of tensors with samples along dim 0, got "
            f"{type(value).__name__}"
        )
    counts = {t.shape[0] for t in parts}
    if len(counts) > 1:
        raise ValueError(f"the tensors of {name} disagree on the samples along dim 0: {counts}")
    return parts[0].shape[0]


def _share(value: Any, name: str, batch_size: int, start: int, stop: int) -> Any:
    """This replica's samples [start, stop) of ``value``, given the whole batch or the
    share itself (Note [Data per replica])."""
    count = _samples(value, name)
    if count == stop - start:
        return tuple(value) if isinstance(value, list) else value
    if count != batch_size:
        raise ValueError(
            f"{name} has {count} samples: neither the global batch ({batch_size}) nor this "
            f"replica's share of it, samples [{start}, {stop})"
        )
    return _rows(value, start, stop)


def _rows(value: Any, start: int, stop: int) -> Any:
    """Samples [start, stop) of a tensor or of each tensor of a tuple."""
    if isinstance(value, (tuple, list)):
        return tuple(t[start:stop] for t in value)
    return value[start:stop]
