"""``vflow.Executor``: runs a global batch as V virtual nodes (VNs) over the workers
of a worker set, and moves to another worker set between steps.

The executor orchestrates; each concern lives in a module of its own, in this room
(vflow.runtime) unless another is named:

* the settings, validated and frozen (config), and the loss protocol (losses);
* the gradients: flat buffers and hooks for the executor's life (grad_store,
  csrc/grad_store.h), folded and reduced by the C++ Reducer with a reduction strategy
  (reduction, csrc/reducer.h);
* the worker set: a process group, this worker's rank and the non-gradient
  collectives (vflow.world.World); joining one (vflow.world.membership);
* the step: its VN loop (step_run), its statistics and their wire layout (step_stats),
  per-VN profiles (vflow.planning.profile), VN batches (vflow.data.vn_batches, driven by
  vflow.data.prefetch), module buffers (module_buffers) and the training state
  (training_state).

A step splits the global batch into V contiguous VN slices; the plan (vflow.Plan) says
which of them this worker runs. The worker runs forward and backward VN by VN while
the fused kernels fold each VN's gradients into flat float32 buffers, and during
its last VN the Reducer reduces the buffers bucket by bucket. The gradient is
normalised once for the whole global batch and every worker steps its optimizer once on
the same gradient. See docs/design.md for the semantics this guarantees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from vflow.data.prefetch import Prefetcher, VNTransform
from vflow.data.vn_batches import VNBatchSource
from vflow.mapping import rng
from vflow.mapping.batching import Batch
from vflow.mapping.plan import Plan, VNSlice
from vflow.planning import auto_plan
from vflow.planning.auto_plan import AutoPlan, PlanChange, PlanDecision
from vflow.planning.profile import StepProfile, WorkerProfile
from vflow.runtime import inference, training_state
from vflow.runtime.amp import LossScaler
from vflow.runtime.clock import StepClock
from vflow.runtime.config import Deterministic, ExecutorConfig
from vflow.runtime.grad_store import GradStore, refuse_compiled_autograd, trainable_params
from vflow.runtime.inference import ForwardFn
from vflow.runtime.module_buffers import BufferRule
from vflow.runtime.pre_step_hooks import PreStepHooks
from vflow.runtime.reduction import for_kind
from vflow.runtime.registered_state import registered_from
from vflow.runtime.results import SignalWord, StepResult
from vflow.runtime.step_cycle import StepParts, run_step
from vflow.runtime.step_run import StepInputs, StepRun
from vflow.runtime.step_stats import GlobalStats, StatsLayout
from vflow.world import membership
from vflow.world.group import (
    World,
    backend_name,
    check_plan,
    default_plan,
    resolve_group,
    retire,
    to_timedelta,
)

LossFn = Callable[[torch.nn.Module, Batch], Any]

# Note [Plan changes wait for the data]
# A sampler bound to the executor (vflow.data.VNBatchSampler, Note [Data follows the
# plan]) splits each global batch under ``plan_for_step`` of its step and reports the
# draw (``record_draw``). A DataLoader with num_workers > 0 draws ahead of the batches
# it returns, so a plan change may only take effect at a step whose indices no rank has
# drawn yet; until then it waits in ``_pending`` as (first step, plan).
# * Each rank's data lead (steps beyond the current one its sampler has drawn) rides in
#   the step's statistics, so every rank knows the largest one after the step: an
#   automatic decision after step s takes effect at s + 1 + that lead, the same step on
#   every rank. No new decision is taken while a change waits.
# * ``set_plan`` gathers every rank's last drawn step and takes effect after it.
# * ``reconfigure`` cannot wait (the old workers may be gone): batches drawn ahead under
#   the old plan no longer fit, and ``step`` refuses them before changing anything.


@dataclasses.dataclass(frozen=True)
class _PendingPlan:
    first_step: int  # the first step run under plan
    plan: Plan
    prepared: object  # reduction.prepare_world(plan, rank)
    reset_auto: bool  # set_plan's change: the automatic plan starts over under it


class Executor:
    """Runs training steps and inference over ``virtual_nodes`` VNs on this worker.

    Args:
        model: the module to train. Its trainable parameters must be leaf tensors.
        optimizer: a torch.optim.Optimizer over (a subset of) the model's parameters.
        loss_fn: ``loss_fn(model, vn_batch)`` returning the VN's mean loss (a scalar
            tensor) or ``(loss_sum, num_items)``; see docs/design.md, "Loss normalisation".
        virtual_nodes: V, the number of VNs the global batch is split into.
        seed: seeds the per-VN random generators, see Note [VN randomness].
        amp: None, "bf16" or "fp16": run loss_fn under autocast in that dtype.
        accumulate_dtype: accumulator dtype for gradients of non-float64 parameters
            (torch.float32 or torch.float64). float64 parameters always use float64.
        loss_scale: fp16 loss scaling. None (default) enables it when amp="fp16" or a
            trainable parameter is float16; True/False force it; a LossScaler
            instance configures it.
        skip_nonfinite: skip the optimizer step when a gradient is inf/NaN (reported
            in StepResult.skipped). Defaults to True when loss scaling is on.
        buffer_rule: how module buffers are updated, "vn0" or "mean"; see
            Note [Buffer rule].
        max_grad_norm: if set, clip the global gradient 2-norm to this value before
            the optimizer step (torch.nn.utils.clip_grad_norm_ semantics).
        plan: which VNs each worker of the process group runs (vflow.Plan); defaults
            to ``Plan.even(virtual_nodes, world_size)``. Replace it with ``set_plan``.
            ``"auto"`` (or a ``vflow.AutoPlan`` with settings): start even, then plan
            from the workers' measured speeds and re-plan when they change (Note
            [Automatic plans], vflow/planning/auto_plan.py; ``plan_history`` lists the changes).
        process_group: the torch.distributed group whose workers share the step;
            defaults to the default group when torch.distributed is initialised, else
            this process alone. Every rank must construct its Executor with the same
            arguments (checked: plan, model layout and settings). Constructing an
            executor on a group whose other members are already training (they call
            ``reconfigure``) makes this process a new member: it receives their
            training state (Note [Joining a worker set], vflow/world/membership.py).
        timeout: bound on every wait for a collective (seconds or a timedelta). When a
            worker dies or hangs, the others raise vflow.CollectiveError naming the
            step and the group within this time.
        bucket_cap_mb: gradients are folded and reduced in buckets of at most this
            many MB (see Note [Buckets] in csrc/reducer.h).
        first_bucket_mb: cap of the first bucket, kept small so that the first
            reduction starts early in backward.
        broadcast_parameters: with a process group of new members only, copy rank 0's
            parameters and buffers to every rank at construction (as DDP does), so
            replicas start equal.
        deterministic: make training bitwise identical for a given V and seed whatever
            the number of workers and the plan; the loss and module buffers are then
            reduced VN by VN in VN order, and a gradient sum that is inf/NaN skips the
            step with ``skip_nonfinite`` or else raises FloatingPointError. How the
            gradients are summed: ``True`` or ``"ordered"`` adds them in float in one
            fixed binary tree over the VN indices (Note [Ordered sum] in
            csrc/reduction/ordered.cpp; about the cost of the default path); ``"exact"``
            sums them exactly in integers (Note [Exact accumulation] in csrc/exact.h;
            more accurate, about twice the communication, float32 accumulation and
            non-float64 parameters only). See docs/reproducibility.md for the
            conditions and the cost. Stored normalised: False, "ordered" or "exact".
        prefetch: prepare the next VN's batch in a background thread while the current
            VN computes (Note [Prefetch] in vflow/data/prefetch.py): slicing, the
            deterministic-mode copy, ``vn_transform`` and, for a model on a GPU and a
            batch on the CPU, the copy to the GPU on a side stream; not for plain slicing
            or a deterministic-mode copy under 1 MiB a VN, cheaper than the hand-off.
            Results are the same with and without it.
        vn_transform: ``fn(vn_batch, generator) -> vn_batch`` applied to every VN's
            batch before ``loss_fn`` (decoding, augmentation, collation). It runs in the
            prefetch thread, so it must not use torch's global random generator: draw
            from ``generator``, a CPU generator seeded from (seed, step, VN) — the same
            draws for a VN under every plan. It must keep the number of samples and not
            modify its input in place (outside deterministic mode that input is a view
            of the caller's batch). ``infer`` does not apply it.
        registered_state: ``{name: obj}``, objects with ``state_dict()`` and
            ``load_state_dict()`` that are part of the training state, as
            ``register_state(name, obj)`` makes them; given here, they take part in a
            join that constructing this executor makes (a newcomer built on the members'
            group receives their states).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        virtual_nodes: int,
        seed: int = 0,
        *,
        amp: str | None = None,
        accumulate_dtype: torch.dtype = torch.float32,
        loss_scale: bool | LossScaler | None = None,
        skip_nonfinite: bool | None = None,
        buffer_rule: str = "vn0",
        max_grad_norm: float | None = None,
        plan: Plan | AutoPlan | str | None = None,
        process_group: torch.distributed.ProcessGroup | None = None,
        timeout: float | datetime.timedelta = 600.0,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        broadcast_parameters: bool = True,
        deterministic: bool | str = False,
        prefetch: bool = True,
        vn_transform: VNTransform | None = None,
        registered_state: Mapping[str, object] | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if vn_transform is not None and not callable(vn_transform):
            raise TypeError(
                f"vn_transform must be callable or None, got {type(vn_transform).__name__}"
            )
        registered = registered_from(registered_state)
        params = trainable_params(model, optimizer)
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
            broadcast_parameters=broadcast_parameters,
            deterministic=deterministic,
            prefetch=prefetch,
            timeout=timeout,
            has_fp16_params=any(p.dtype == torch.float16 for p in params),
        )
        reduction = for_kind(config.deterministic)
        reduction.check_support(params, config.accumulate_dtype, config.virtual_nodes)
        world = World(resolve_group(process_group), config.timeout)
        auto = auto_plan.resolve(plan)
        if auto is not None:
            auto.check(bool(config.deterministic), world.size)
            plan = None
        plan = self._checked_plan(plan, config.virtual_nodes, world.size)
        prepared = reduction.prepare_world(plan, world.rank)

        self.config = config
        self._auto = auto
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        if isinstance(loss_scale, LossScaler):
            self.scaler: LossScaler | None = loss_scale
        else:
            self.scaler = None if config.loss_scaling is None else LossScaler()
        self.step_count = 0
        self.skipped_steps = 0
        self._registered = registered
        self._signal = SignalWord()
        self._pre_step_hooks = PreStepHooks()
        # Note [Plan changes wait for the data]: changes not yet in force, by first
        # step, and the plan and rank each drawn step's batch was split under.
        self._pending: list[_PendingPlan] = []
        self._draws: dict[int, tuple[Plan, int]] = {}
        self._last_result: StepResult | None = None
        self._warned_training_mode = False
        # last_profile on several workers: the latest step's statistics, whose profile
        # is built when read (Note [Profiles]).
        self._gathered: GlobalStats | None = None
        self._device = params[0].device
        self._devices = sorted({p.device for p in params}, key=str)
        self._generators = rng.generators(self._devices)
        self._batches = VNBatchSource(bool(config.deterministic), vn_transform)
        self._grads = GradStore(
            model,
            params,
            config.accumulate_dtype,
            reduction,
            first_bucket_bytes=config.first_bucket_bytes,
            bucket_cap_bytes=config.bucket_cap_bytes,
            process_group=world.group,
            timeout_s=config.timeout.total_seconds(),
            description=world.description,
        )
        self._params = params
        self._world = world
        self._plan = plan
        # The rank of this executor's worker in the worker set its automatic planner
        # learned about (Note [Plans across worker sets]).
        self._auto_rank = world.rank
        try:
            reduction.apply_world(prepared)
            notes = membership.join(
                world,
                self._agreement_columns(plan, params),
                # A new executor has learned nothing (as many words as a member sends).
                membership.Candidate(
                    member=False, step_count=0, progress="", notes=auto_plan.to_words(None)
                ),
                state=self.state_dict,
                load_state=self._load_received_state,
                fresh_start=lambda: self._broadcast_initial(world, params),
            )
        except BaseException:
            self._grads.close()
            raise
        if auto is not None:
            # Members that move onto this group bring what they learned: a newcomer's
            # planner must start from the same table as theirs.
            auto.carry([auto_plan.from_words(words) for words in notes])
        self._stats = StatsLayout(config.virtual_nodes, world.size)
        self._own_profile: WorkerProfile | None = None
        self._buffers = BufferRule(
            model, config.buffer_rule, config.virtual_nodes if config.deterministic else None
        )
        self._prefetcher = Prefetcher(self._device, config.prefetch)

    # ---- settings and worker set ---------------------------------------------------

    @property
    def virtual_nodes(self) -> int:
        return self.config.virtual_nodes

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def deterministic(self) -> Deterministic:
        return self.config.deterministic

    @property
    def skip_nonfinite(self) -> bool:
        return self.config.skip_nonfinite

    @property
    def amp(self) -> str | None:
        return self.config.amp

    @property
    def max_grad_norm(self) -> float | None:
        return self.config.max_grad_norm

    @property
    def vn_transform(self) -> VNTransform | None:
        return self._batches.transform

    @property
    def plan(self) -> Plan:
        return self._plan

    @property
    def world(self) -> World:
        """The current worker set: process group, rank, size and collectives."""
        return self._world

    @property
    def process_group(self) -> torch.distributed.ProcessGroup | None:
        return self._world.group

    @property
    def rank(self) -> int:
        return self._world.rank

    @property
    def world_size(self) -> int:
        return self._world.size

    @property
    def reducer(self) -> Any:
        """The C++ Reducer (``vflow._C.Reducer``): buckets, bytes per step, overlap."""
        return self._grads.reducer

    @property
    def grad_buffers(self) -> list[Any]:
        """The flat gradient buffers (``vflow._C.GradBuffer``) ``param.grad`` view."""
        return list(self._grads.buffers)

    def set_plan(self, plan: Plan) -> None:
        """Runs the following steps with ``plan`` (same V, one entry per rank).

        With a process group this is a collective: every rank must call it between the
        same two steps with the same plan (checked; on a mismatch every rank raises and
        keeps its old plan).

        When a sampler bound to this executor (``VNBatchSampler(..., executor=ex)``) has
        drawn batches of later steps already (a DataLoader with ``num_workers > 0``
        draws ahead), those steps keep the plan they were drawn under: the new plan
        takes effect at the first step no rank has drawn (``plan_for_step`` tells which
        plan a step runs under). Otherwise — the common case — from the next step on.
        """
        self._check_open()
        plan = self._checked_plan(plan, self.virtual_nodes, self.world_size)
        prepared = self._grads.reduction.prepare_world(plan, self.rank)
        membership.check_agreement(self._world, [membership.Column("plan", repr(plan), repr(plan))])
        drawn = self._world.gather_ints(
            [self._last_drawn()], "gather of the drawn data positions", self.step_count
        )
        first_step = 1 + max(row[0] for row in drawn)
        if self._auto is not None:
            self._auto.reset()  # profiles of the new plan from now on
        # A later change replaces those that would start at or after it.
        self._pending = [p for p in self._pending if p.first_step < first_step]
        self._pending.append(_PendingPlan(first_step, plan, prepared, reset_auto=True))
        self._apply_due_plans()

    def plan_for_step(self, step: int) -> Plan:
        """The plan step ``step`` runs under (``step >= step_count``): ``plan`` for the
        next step, or a change waiting for batches drawn ahead (Note [Plan changes
        wait for the data])."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        if step < self.step_count:
            raise ValueError(
                f"step must be >= step_count={self.step_count} (the next step to run); step "
                f"{step} has run already"
            )
        plan = self._plan
        for pending in self._pending:
            if pending.first_step <= step:
                plan = pending.plan
        return plan

    def record_draw(self, step: int, plan: Plan, rank: int) -> None:
        """Called by a bound VNBatchSampler: it drew this worker's indices of step
        ``step`` under ``plan`` as ``rank``. Plan changes wait until the drawn steps
        have run (Note [Plan changes wait for the data])."""
        if step >= self.step_count:
            self._draws[step] = (plan, rank)

    def forget_draws(self) -> None:
        """Called by a bound VNBatchSampler when a new iteration starts at
        ``step_count``: the batches an abandoned iteration drew ahead will not run."""
        self._draws.clear()

    def _last_drawn(self) -> int:
        """The last step whose batch this worker's sampler has drawn (step_count - 1
        when none of the coming steps is drawn)."""
        return max(self._draws, default=self.step_count - 1)

    def _apply_due_plans(self) -> None:
        """Puts in force the changes whose first step is the next step."""
        while self._pending and self._pending[0].first_step <= self.step_count:
            pending = self._pending.pop(0)
            self._grads.reduction.apply_world(pending.prepared)
            self._plan = pending.plan
            if pending.reset_auto and self._auto is not None:
                self._auto.reset()  # profiles of the new plan from now on

    def reconfigure(
        self,
        process_group: torch.distributed.ProcessGroup | None,
        plan: Plan | None = None,
        *,
        timeout: float | datetime.timedelta | None = None,
        catch_up: bool = False,
        newcomer: bool = False,
    ) -> None:
        """Moves this executor to another worker set between steps: ``process_group``
        (None: this process alone) with ``plan`` (default ``Plan.even(V, size)``).

        A collective over the new group that every member calls; a process new to the
        job takes part by constructing its Executor on the same group (Note [Joining a
        worker set], vflow/world/membership.py). It checks that all ranks agree on the plan,
        the model and the settings, sends the training state to new members, then
        rebuilds what depends on the worker set (the reducer's group, the reduction's
        tree, the statistics' layout) and keeps everything else: the flat buffers and
        the ``param.grad`` views into them, the hooks, parameters, optimizer state, step
        count, loss scaler and random streams. ``timeout`` (default: unchanged) bounds
        the new group's collectives. Any error leaves the executor on its old worker set.

        ``catch_up`` (every member passes the same): members whose step count is behind
        the others' receive the training state of a member at the highest step count
        instead of raising; vflow.elastic uses it after a worker set broke during a step
        that some members committed and others did not.

        ``newcomer``: this executor has not trained with the others (it was built ahead of
        joining, on a group of its own): it takes part as a constructor on ``process_group`` would,
        receiving the members' training state, or rank 0's parameters when nobody is a
        member yet (``broadcast_parameters``). Newcomers that differ from agreeing
        members, or cannot load their state, make every rank raise ``RefusedNewcomers``
        naming them (Note [Refusing newcomers], vflow/world/membership.py).
        """
        self._check_open()
        for name, flag in (("catch_up", catch_up), ("newcomer", newcomer)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        config = self.config
        if timeout is not None:
            config = dataclasses.replace(config, timeout=to_timedelta(timeout))
        world = World(resolve_group(process_group), config.timeout)
        plan = self._checked_plan(plan, self.virtual_nodes, world.size)
        prepared = self._grads.reduction.prepare_world(plan, world.rank)
        if self._auto is not None:
            self._auto.check(bool(config.deterministic), world.size)
        progress = training_state.Progress(self.step_count, self.skipped_steps, self.seed)
        notes = membership.join(
            world,
            self._agreement_columns(plan, self._params),
            membership.Candidate(
                member=not newcomer,
                step_count=self.step_count,
                progress=repr(
                    (progress, None if self.scaler is None else self.scaler.state_dict())
                ),
                catch_up=catch_up,
                notes=self._learned_words(),
            ),
            state=self.state_dict,
            load_state=self._load_received_state,
            fresh_start=lambda: self._broadcast_initial(world, self._params) if newcomer else None,
        )
        self.config = config
        self._take_world(world, plan, prepared)
        if self._auto is not None:
            # Note [Plans across worker sets]: every rank from the same table.
            self._auto.carry([auto_plan.from_words(words) for words in notes])
        self._auto_rank = world.rank

    def abort_group(self) -> None:
        """Drops this executor's process group now, after a ``CollectiveError``: its
        connections close at once, so that peers still blocked on this worker in a
        collective fail now rather than at their timeout (a Gloo collective cannot be
        cancelled otherwise). The executor runs alone (plan ``[V]``) until the next
        ``reconfigure``; its training state is untouched. An NCCL group is aborted as
        well: its communicators, unlike Gloo's sockets, outlive the last reference. A
        group whose wait was interrupted (``World.interrupt``) is kept while the
        collectives it left running last, and the gradient buffers they hold are
        replaced.
        Under ``plan="auto"`` the planner keeps what it learned about this worker, which
        the next ``reconfigure`` brings to the survivors' set (Note [Plans across worker
        sets], vflow/planning/auto_plan.py)."""
        self._check_open()
        broken = self._world.group
        if broken is not None and backend_name(broken) == "nccl":
            self._world.abort()
        elif broken is not None and retire(broken):
            # An interrupted wait left collectives running on the buffers (Note
            # [Interrupting a wait], csrc/interrupt.cpp): the next steps use new ones.
            self._grads = self._grads.renewed()
        world = World(None, self.config.timeout)
        plan = Plan.even(self.virtual_nodes, 1)
        self._take_world(world, plan, self._grads.reduction.prepare_world(plan, world.rank))

    def _learned_words(self) -> tuple[int, ...]:
        """What this worker brings to a worker set it joins (Note [Plans across worker
        sets]): the words of what its automatic planner learned about it, as many with
        nothing learned or without ``plan="auto"`` (every rank of a join sends as many)."""
        learned = None if self._auto is None else self._auto.learned(self._auto_rank)
        return auto_plan.to_words(learned)

    def _take_world(self, world: World, plan: Plan, prepared: object) -> None:
        """Rebuilds what depends on the worker set (the rest of ``reconfigure``). The
        automatic planner is left to the caller: ``reconfigure`` carries what the workers
        brought, ``abort_group`` keeps what it learned for the next set."""
        self._grads.set_world(
            world.group, self.config.timeout.total_seconds(), world.description, prepared
        )
        self._world = world
        self._plan = plan
        # Cannot wait for drawn batches: the old worker set may be gone. ``step`` refuses
        # batches drawn under the old plan (Note [Plan changes wait for the data]).
        self._pending = []
        self._stats = StatsLayout(self.virtual_nodes, world.size)
        self._own_profile = None
        self._gathered = None
        self._last_result = None

    @staticmethod
    def _checked_plan(plan: Plan | None, virtual_nodes: int, world_size: int) -> Plan:
        if plan is None:
            plan = default_plan(virtual_nodes, world_size)
        return check_plan(plan, virtual_nodes, world_size)

    def _agreement_columns(
        self, plan: Plan, params: list[torch.nn.Parameter]
    ) -> list[membership.Column]:
        """Note [Agreement]: the plan, the model layout and every agreed setting."""
        layout = repr(
            (
                [(tuple(p.shape), str(p.dtype)) for p in params],
                [(name, tuple(b.shape), str(b.dtype)) for name, b in self.model.named_buffers()],
            )
        )
        return [
            membership.Column("plan", repr(plan), repr(plan)),
            membership.Column("automatic plan", repr(self._auto), f"plan={self._auto!r}"),
            membership.Column(
                "model layout", layout, "this rank's parameter and buffer shapes/dtypes"
            ),
            self._registered.column(),
            *(
                membership.Column(f"settings ({name})", value, f"{name}={value}")
                for name, value in self.config.agreed_fields()
            ),
        ]

    def _broadcast_initial(self, world: World, params: list[torch.nn.Parameter]) -> None:
        if self.config.broadcast_parameters:
            world.broadcast_from(
                0, [*params, *self.model.buffers()], "broadcast of rank 0's parameters", None
            )

    def _load_received_state(self, state: object) -> Callable[[], None]:
        return training_state.load_received(state, self.state_dict, self.load_state_dict)

    # ---- training -------------------------------------------------------------------

    def signal(self, word: int | Callable[[], int]) -> None:
        """Sends ``word`` (an int in [0, 2**31)) with this worker's next step: every rank
        reads every worker's word in that step's ``StepResult.signals``. It travels in
        the step's statistics, so all workers learn it at the same step without a
        collective of their own (vflow.elastic announces joiners and leavers this
        way). ``word`` may be a function returning the int: the step calls it when it
        sends its statistics (before its last VN's backward), so that what changes
        during the step's forward passes still travels with it. Reset to 0 once a step
        succeeds."""
        self._signal.set(word)

    def step(self, batch: Batch, *, global_batch_size: int | None = None) -> StepResult:
        """Runs one global step.

        ``batch`` is either the whole global batch (B samples; every rank passes the same
        one and runs its VNs' slices of it), or — with ``global_batch_size=B`` — only
        this worker's samples: its VNs' slices of the global batch concatenated in VN
        order, as vflow.data.VNBatchSampler yields them.

        On any error before the optimizer step (bad input, an exception in loss_fn or
        backward) the model's parameters and buffers, the optimizer, the loss scaler and
        the step count are left as they were, and ``param.grad`` is None. An exception
        raised by ``optimizer.step()`` itself propagates with the module buffers restored.
        """
        self._check_open()
        refuse_compiled_autograd("vflow.Executor.step")
        if global_batch_size is not None:
            self._check_drawn_plan()
        slices, total = self._plan.local_slices(self.rank, batch, global_batch_size)
        clock = StepClock(self._device)
        start = clock.mark()
        buffers = self._buffers if self._buffers.has_buffers else None
        inputs = StepInputs(
            self.model,
            self.loss_fn,
            self._grads,
            self._world,
            self._stats,
            self._generators,
            buffers,
            self.seed,
            self.step_count,
            self._signal.read,
            max(0, self._last_drawn() - self.step_count),
            self._own_profile,
            1.0 if self.scaler is None else self.scaler.scale,
            self.skip_nonfinite,
            self.deterministic,
            self.max_grad_norm,
            (lambda: self._pre_step_hooks.call(self, self._params))
            if self._pre_step_hooks
            else None,
            self._params,
        )
        run = StepRun(inputs, slices, total, clock)

        def compute() -> None:
            run.vns(self._vn_batches(batch, slices), self._autocast)
            run.reduce()
            if self._world.distributed and buffers is not None:
                buffers.reduce(self._world, self.virtual_nodes, self.step_count)

        parts = StepParts(
            self._grads,
            self.optimizer,
            self.scaler,
            buffers,
            self._generators,
            self.step_count,
            "vflow::step",
        )
        scale = run_step(parts, run, compute)
        if run.skipped:
            self.skipped_steps += 1
        end = clock.mark()
        clock.finish(end)
        result = run.result(start, end, scale)
        self._last_result = result
        self._signal.reset()
        if self._world.distributed:
            self._own_profile = result.profile  # sent with the next step's statistics
            self._gathered = run.gathered
        self.step_count += 1
        if self._draws:
            self._draws = {k: v for k, v in self._draws.items() if k >= self.step_count}
        if self._pending:
            self._apply_due_plans()
        if self._auto is not None and run.gathered is not None and not self._pending:
            # No profile on a worker set's first step: the planner may still decide
            # from what the workers brought (Note [Plans across worker sets]).
            self._follow_auto_plan(run.gathered.profile, total, max(run.leads))
        return result

    def register_pre_step_hook(self, fn: Callable[[Executor], None]) -> RemovableHandle:
        """Calls ``fn(executor)`` in every step that steps the optimizer, right before
        ``optimizer.step()``, with ``param.grad`` holding the reduced gradient the
        optimizer will use: the whole global batch's, normalised, unscaled under loss
        scaling, the same on every worker. ``fn`` may change ``param.grad`` in place
        (per-layer clipping, noise, logging norms); it must not replace it. Note
        [Before the optimizer step] (vflow/runtime/step_run.py) says where it runs: after
        the non-finite check (a skipped step calls no hook) and before ``max_grad_norm``
        clipping. Hooks run in registration order; returns a handle whose ``remove()``
        unregisters ``fn``. Register the same hooks on every worker: a hook that acts
        alike on equal gradients keeps the workers' parameters equal (bitwise, in
        deterministic mode, under every plan). An exception in ``fn`` fails the step as
        one in ``loss_fn`` would, before anything changed. Not callable: TypeError."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self._check_open()
        return self._pre_step_hooks.register(fn)

    def _check_drawn_plan(self) -> None:
        """Raises, changing nothing, when this step's local batch was drawn under
        another plan or rank than the step runs under (only after ``reconfigure``:
        other changes wait for the drawn batches)."""
        drawn = self._draws.get(self.step_count)
        if drawn is None or drawn == (self._plan, self.rank):
            return
        plan, rank = drawn
        raise ValueError(
            f"the batch of step {self.step_count} was drawn under {plan!r} as rank {rank}, "
            f"but step {self.step_count} runs under {self._plan!r} as rank {self.rank}: "
            "a DataLoader drew it ahead before the worker set changed (reconfigure). "
            "Start a new DataLoader iterator after a change of worker set (a bound "
            "VNBatchSampler then splits the batches under the new plan)"
        )

    def _follow_auto_plan(self, profile: StepProfile | None, batch_size: int, lead: int) -> None:
        """Note [Automatic plans]: every rank decides the same from the same profile,
        so the new plan needs no agreement round. It takes effect after the batches any
        rank has drawn (``lead`` steps beyond the one that ran; Note [Plan changes wait
        for the data])."""
        assert self._auto is not None
        first_step = self.step_count + lead
        new = self._auto.observe(profile, self._plan, batch_size, first_step)
        if new is None:
            return
        prepared = self._grads.reduction.prepare_world(new, self.rank)
        self._pending.append(_PendingPlan(first_step, new, prepared, reset_auto=False))
        self._apply_due_plans()

    @property
    def plan_history(self) -> list[PlanChange]:
        """The automatic plan changes (``plan="auto"``), oldest first; empty otherwise."""
        return [] if self._auto is None else list(self._auto.history)

    @property
    def plan_decisions(self) -> list[PlanDecision]:
        """Every time the automatic planner weighed a plan against the current one,
        taken or not, with its predicted gain and the noise band it had to beat (Note
        [Automatic plans]); oldest first, empty without ``plan="auto"``."""
        return [] if self._auto is None else list(self._auto.decisions)

    @property
    def last_profile(self) -> StepProfile | None:
        """Every worker's profile of the latest step that every rank holds (Note
        [Profiles], vflow/planning/profile.py): on several workers the step before the last,
        on one process the last; None before there is one (and after a new worker set)."""
        if self._world.distributed:
            # None only on a worker set's first step, when no worker had a previous
            # one: every later step of the set carries every worker's.
            return None if self._gathered is None else self._gathered.profile
        if self._last_result is None:
            return None
        return StepProfile(self._last_result.step, (self._last_result.profile,))

    def _vn_batches(self, batch: Batch, slices: list[VNSlice]) -> Iterator[Batch]:
        # Plain slicing is a few views, a small copy a few microseconds: not worth a
        # thread hand-off (Note [A copy inline or on the prefetch thread]).
        background = self._batches.needs_work(batch, slices) or self._prefetcher.needs_transfer(
            batch
        )
        return self._prefetcher.batches(
            self._batches.jobs(batch, slices, self.seed, self.step_count), background
        )

    @property
    def _autocast(self) -> Callable[[], contextlib.AbstractContextManager] | None:
        """What ``loss_fn`` runs under: None, or a factory of the autocast context."""
        if self.config.amp is None:
            return None
        return functools.partial(torch.autocast, self._device.type, dtype=self.config.amp_dtype)

    # ---- inference ------------------------------------------------------------------

    def infer(
        self,
        batch: Batch,
        forward_fn: ForwardFn | None = None,
        *,
        global_batch_size: int | None = None,
        gather: bool = True,
    ) -> Any:
        """Runs the forward VN by VN under no_grad; returns outputs in batch order.

        ``batch`` is the global batch, or this worker's samples of it with
        ``global_batch_size`` (as in ``step``). Each worker runs only its own VNs; with
        a process group and ``gather`` (default) the outputs of all workers are gathered
        so that every rank returns the outputs of the whole global batch, as a single
        process would. ``gather=False`` returns this worker's outputs only.

        ``forward_fn(model, vn_batch)`` defaults to ``model(x)`` for a tensor,
        ``model(*batch)`` for a tuple/list and ``model(**batch)`` for a dict. Outputs
        (tensors or tuples/lists/dicts of them) are concatenated along dim 0. The
        model's mode is left as the caller set it: call ``model.eval()`` first for
        inference-mode BatchNorm and dropout (in training mode BatchNorm updates its
        running statistics; a warning says so once).
        """
        self._check_open()
        if not isinstance(gather, bool):
            raise TypeError(f"gather must be a bool, got {type(gather).__name__}")
        slices, total = self._plan.local_slices(self.rank, batch, global_batch_size)
        if not self._warned_training_mode:
            self._warned_training_mode = inference.warn_if_training(self.model)
        local = inference.run(
            self.model,
            batch,
            slices,
            forward_fn,
            seed=self.seed,
            step=self.step_count,
            generators=self._generators,
            autocast=self._autocast,
        )
        if not self._world.distributed or not gather:
            return local
        return inference.gather(self._world, self._plan, local, total, self.step_count)

    # ---- training state -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume training bit for bit on any number of workers:
        model, optimizer, step counts, seed and loss scaler (vflow.runtime.training_state)."""
        self._check_open()
        return training_state.build(
            self._state_target(),
            training_state.Progress(self.step_count, self.skipped_steps, self.seed),
            bool(self.deterministic),
            self.world_size,
            list(self._plan.counts),
        )

    def load_state_dict(self, state: dict[str, Any], *, assign: bool = False) -> None:
        """Restores ``state`` from ``state_dict()``, written with any plan and any
        number of workers for the same V. Raises before changing anything when
        ``state`` does not fit this executor (vflow.runtime.training_state). ``assign``: the
        state's tensors belong to nobody else, so the optimizer may adopt them."""
        self._check_open()
        progress = training_state.load(self._state_target(), state, assign=assign)
        self.step_count = progress.step_count
        self.skipped_steps = progress.skipped_steps
        self.config = self.config.with_seed(progress.seed)
        # The data position moved with the step count: batches drawn before belong to
        # other steps, and a waiting change may be due (Note [Plan changes wait for the
        # data]).
        self._draws.clear()
        self._apply_due_plans()

    def _state_target(self) -> training_state.Target:
        return training_state.Target(
            self.model, self.optimizer, self.scaler, self.virtual_nodes, self._registered
        )

    def register_state(self, name: str, obj: Any) -> None:
        """Makes ``obj`` — an LR scheduler, or any object with ``state_dict()`` and
        ``load_state_dict()`` — part of the training state under ``name`` (Note
        [Registered state], vflow/runtime/registered_state.py): ``state_dict()``,
        ``vflow.save``/``vflow.load`` and the state a joining worker receives carry it,
        and a newcomer must have registered the same names as the members. Register
        before training, the same names on every worker (for a worker joining a job, in
        ``make_executor``; for one constructed on the members' group, with the
        constructor's ``registered_state``). Raises, registering nothing, on a name
        registered already, a name that is not a non-empty string, or an object
        without those methods."""
        self._check_open()
        self._registered.register(name, obj)

    # ---- lifecycle ------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return getattr(self, "_grads", None) is None

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this Executor is closed")

    def close(self) -> None:
        """Removes vflow's hooks from the model; gradients stay where they are."""
        grads = getattr(self, "_grads", None)
        if grads is None:
            return
        grads.close()
        self._grads = None
        prefetcher = getattr(self, "_prefetcher", None)
        if prefetcher is not None:
            prefetcher.close()

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
