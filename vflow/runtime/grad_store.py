"""An Executor's gradients: the flat buffers and hooks it owns for its whole life, the
C++ Reducer that folds and reduces them, and the reduction strategy it uses.

Ownership (Note [Gradient store and reducer], csrc/grad_store.h): the C++ GradStore
owns the GradBuffers that ``param.grad`` point into and the autograd hooks that
capture gradients (Note [Capturing gradients]); the Reducer cuts the buffers into
buckets (cut here, by ``assign_buckets``) and holds the replaceable process group;
the Reduction strategy (vflow.runtime.reduction) holds what the kind of sum needs. A new worker
set (``set_world``) touches only the last two.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator, Sequence

import torch

from vflow._extension import _C
from vflow.runtime.reduction import Reduction, VNPlacement
from vflow.world.group import CollectiveError

# model -> the live store capturing its gradients. Two stores on one model would both
# capture them. Kept outside the model so that the model stays deep-copyable/picklable.
_OWNERS: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[GradStore]] = (
    weakref.WeakKeyDictionary()
)


# Note [Compiled autograd]
# Compiled autograd (torch._dynamo.compiled_autograd) replaces the engine's run of a
# backward by a graph it traces, and every hook must describe itself to the tracer.
# vflow's CaptureHook (csrc/grad_store.cpp, a C++ post hook on AccumulateGrad nodes)
# does not: the backward would fail inside autograd with "compiled_args nyi". So a step
# refuses first, before anything changes. A torch.compile'd model needs no compiled
# autograd: the ordinary engine runs its compiled backward graph, and the AccumulateGrad
# nodes carrying vflow's hooks stay outside it. torch._dynamo.config.compiled_autograd
# = True alone changes nothing here: it applies to backward calls made inside a
# compiled function, and vflow calls backward itself, outside any
# (tests/runtime/test_compile.py).


def refuse_compiled_autograd(where: str) -> None:
    """Raises when torch's compiled autograd is on (Note [Compiled autograd])."""
    # torch switches compiled autograd on and off through this module, which keeps
    # compiled_autograd_enabled in step with the engine: a process that never imported
    # it has it off, and the check costs a dict lookup.
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    if module is not None and getattr(module, "compiled_autograd_enabled", False):
        raise RuntimeError(
            f"{where}: torch's compiled autograd is enabled, and vflow does not support "
            "it: vflow captures each VN's gradients with autograd hooks written in C++, "
            "which compiled autograd cannot trace. Run the step with compiled autograd "
            "off (outside torch._dynamo.compiled_autograd._enable(...)); a model compiled "
            'with torch.compile still runs its compiled backward (docs/guide.md, "torch.compile")'
        )


def accumulation_dtype(param_dtype: torch.dtype, requested: torch.dtype) -> torch.dtype:
    return torch.float64 if param_dtype == torch.float64 else requested


def clip_grads_(grads: Sequence[torch.Tensor], max_norm: float) -> float:
    """Scales ``grads`` in place so that their joint 2-norm is at most ``max_norm``
    (torch.nn.utils.clip_grad_norm_'s coefficient); returns the norm before clipping.
    Each tensor's norm is taken in at least float32, so bfloat16 gradients lose no range."""
    device = grads[0].device
    norms = [
        torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32))
        .to(device)
        .double()
        for g in grads
    ]
    norm, coef = _clip_coefficient(norms, max_norm)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


def _clip_coefficient(norms: list[torch.Tensor], max_norm: float) -> tuple[float, float]:
    """The joint 2-norm of tensors whose own norms are ``norms``, and the factor that
    brings it to at most ``max_norm`` (torch.nn.utils.clip_grad_norm_'s: above 1 means
    no clipping)."""
    norm = float(torch.linalg.vector_norm(torch.stack(norms)))
    return norm, max_norm / (norm + 1e-6)


def assign_buckets(
    buffers: Sequence[_C.GradBuffer], first_bucket_bytes: int, bucket_cap_bytes: int
) -> list[tuple[int, int, int]]:
    """Note [Buckets] (csrc/reducer.h): each buffer's slots cut into runs of consecutive
    slots, (buffer, first slot, last slot); the first run of a buffer holds at most
    ``first_bucket_bytes``, the others at most ``bucket_cap_bytes``, and a slot larger
    than the cap makes a bucket of its own."""
    for name, value in (
        ("first_bucket_bytes", first_bucket_bytes),
        ("bucket_cap_bytes", bucket_cap_bytes),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    buckets = []
    for b, buffer in enumerate(buffers):
        element_size = buffer.data.element_size()
        first, size, cap = 0, 0, first_bucket_bytes
        for slot, numel in enumerate(buffer.numels):
            slot_bytes = numel * element_size
            if slot > first and size + slot_bytes > cap:
                buckets.append((b, first, slot - 1))
                first, size, cap = slot, 0, bucket_cap_bytes
            size += slot_bytes
        buckets.append((b, first, buffer.num_slots - 1))
    return buckets


def trainable_params(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[torch.nn.Parameter]:
    """The parameters vflow manages: every trainable parameter of ``model``, checked;
    the optimizer may hold only parameters of ``model``."""
    owned = {id(p) for p in model.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for k, p in enumerate(group["params"]):
            if id(p) not in owned:
                raise ValueError(
                    f"optimizer param_groups[{g}]['params'][{k}] (shape {tuple(p.shape)}) is "
                    "not a parameter of model; the optimizer may only hold model parameters"
                )
    params = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if not p.is_leaf:
            raise ValueError(
                f"model parameter {name!r} is not a leaf tensor (it was computed from "
                "other tensors); vflow accumulates gradients of leaf parameters only"
            )
        if not p.is_floating_point():
            raise ValueError(f"model parameter {name!r} is {p.dtype}; expected floating point")
        params.append(p)
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            raise ValueError(
                f"module {name!r} produces sparse gradients (sparse=True); vflow's "
                "accumulation buffers are dense"
            )
    if not params:
        raise ValueError("model has no trainable parameters (requires_grad=True)")
    return params


class GradStore:
    """Owns ``params``' flat buffers and hooks, fills them from autograd VN by VN and
    reduces them over the current worker set with ``reduction``.

    Args:
        model: the module the parameters belong to (one live store per model).
        params: trainable leaf parameters, in registration order.
        reduction: the strategy (vflow.runtime.reduction), used by this store only.
        process_group, timeout_s, description: the first worker set (None: this
            process alone).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        params: Sequence[torch.nn.Parameter],
        accumulate_dtype: torch.dtype,
        reduction: Reduction,
        *,
        first_bucket_bytes: int,
        bucket_cap_bytes: int,
        process_group: torch.distributed.ProcessGroup | None,
        timeout_s: float,
        description: str,
    ) -> None:
        owner = _OWNERS.get(model)
        if owner is not None and owner() is not None:
            raise ValueError(
                "model is already driven by another live vflow.Executor; call its close() first"
            )
        by_key: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = {}
        for p in params:
            by_key.setdefault((p.device, p.dtype), []).append(p)
        # Reverse registration order: roughly the order backward produces gradients.
        groups = [list(reversed(members)) for members in by_key.values()]
        dtypes = [accumulation_dtype(dtype, accumulate_dtype) for _, dtype in by_key]
        self.native = _C.GradStore(groups, dtypes)
        self.buffers: list[_C.GradBuffer] = list(self.native.buffers)
        self.reduction = reduction
        self.reducer = _C.Reducer(
            self.buffers,
            assign_buckets(self.buffers, first_bucket_bytes, bucket_cap_bytes),
            reduction.native,
            process_group,
            timeout_s,
            description,
        )
        self.native.set_sink(self.reducer)
        self._flags = {
            buffer.data.device: torch.zeros((), dtype=torch.float32, device=buffer.data.device)
            for buffer in self.buffers
        }
        self._model = model
        self._params = list(params)
        self._accumulate_dtype = accumulate_dtype
        self._bucket_bytes = (first_bucket_bytes, bucket_cap_bytes)
        self._timeout_s = timeout_s
        _OWNERS[model] = weakref.ref(self)

    def set_world(
        self,
        process_group: torch.distributed.ProcessGroup | None,
        timeout_s: float,
        description: str,
        prepared: object,
    ) -> None:
        """Reduces over a new worker set from the next step on; ``prepared`` is the
        strategy's ``prepare_world`` result for it. Not during a step."""
        self.reducer.set_group(process_group, timeout_s, description)
        self.reduction.apply_world(prepared)

    def begin_step(self, step: int) -> None:
        """Detaches ``param.grad`` so backward writes fresh gradients; see Note [First
        fold overwrites] (csrc/reducer.h) for why the buffers need no zeroing here.
        ``step`` is named in collective errors."""
        self.reducer.begin_step(step)
        self.native.detach_grads()

    def backward(
        self, loss: torch.Tensor, weight: float, last: bool, placement: VNPlacement
    ) -> None:
        """Runs ``loss.backward()`` and adds ``weight`` x its gradients to the buffers.
        With ``last`` (this worker's last VN of the step) the buckets' reductions start
        while backward runs."""
        # capture's body, inlined: this runs once per VN.
        reducer = self.reducer
        reducer.begin_vn(weight, last, placement.level, placement.merges)
        try:
            loss.backward()
        except BaseException as e:
            self._abort_vn(e)
            raise
        reducer.end_vn()

    @contextlib.contextmanager
    def capture(self, weight: float, last: bool, placement: VNPlacement) -> Iterator[None]:
        """Adds ``weight`` x the gradients of the backward passes run inside to the
        buffers, as one VN's (``backward``'s core, for a backward someone else runs: a
        pipeline stage's)."""
        # The reducer takes gradients from begin_vn to end_vn (Note [Capturing gradients]).
        self.reducer.begin_vn(weight, last, placement.level, placement.merges)
        try:
            yield
        except BaseException as e:
            self._abort_vn(e)
            raise
        self.reducer.end_vn()

    def _abort_vn(self, error: BaseException) -> None:
        """After ``error`` inside a VN's capture: the VN's gradients are dropped; a failed
        collective is raised as CollectiveError."""
        self.reducer.abort_vn()
        failure = self.reducer.comm_failure
        if failure and not isinstance(error, CollectiveError):
            # A collective started in a hook failed; autograd re-raised it as a
            # RuntimeError. Callers that recover from a lost worker need its type.
            raise CollectiveError(failure) from error

    def finish(self, factor: float, check_nonfinite: bool) -> bool:
        """Waits for the reductions and scales every buffer by ``factor`` in one pass;
        with ``check_nonfinite`` returns whether any scaled gradient is inf/NaN (reading
        the flags is the step's only synchronisation), else False."""
        if not check_nonfinite:
            self.reducer.finalize(factor, [])
            return False
        for flag in self._flags.values():
            flag.zero_()
        self.reducer.finalize(factor, [self._flags[b.data.device] for b in self.buffers])
        return any(bool(flag) for flag in self._flags.values())

    @property
    def last_wait_seconds(self) -> float:
        return self.reducer.last_wait_seconds

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scales the reduced gradient so that its global 2-norm is at most
        ``max_norm`` (torch.nn.utils.clip_grad_norm_'s coefficient); returns the norm
        before clipping."""
        device = self.buffers[0].data.device
        norms = [torch.linalg.vector_norm(b.data).to(device) for b in self.buffers]
        norm, coef = _clip_coefficient(norms, max_norm)
        if coef < 1.0:
            for buffer in self.buffers:
                buffer.scale_(coef)
        return norm

    def publish(self) -> None:
        """Points every ``param.grad`` at its accumulated gradient."""
        self.native.publish()

    def clear(self) -> None:
        """After a failed or skipped step: no gradient is exposed and no collective of
        the step is still writing to the buffers, unless a wait on the group was
        interrupted: then its collectives run on, holding the buffers, and the owner
        moves to ``renewed()``."""
        self.reducer.discard()
        self.native.detach_grads()

    def renewed(self) -> GradStore:
        """This store closed, and a new one for the same parameters, strategy kind and
        buckets on new memory, alone until ``set_world``: after an interrupted wait the
        collectives left running still hold this one's buffers, and a peer could yet
        write into them (Note [Interrupting a wait], csrc/interrupt.cpp). The old
        buffers are freed when those collectives end."""
        self.close()
        first, cap = self._bucket_bytes
        return GradStore(
            self._model,
            self._params,
            self._accumulate_dtype,
            type(self.reduction)(),
            first_bucket_bytes=first,
            bucket_cap_bytes=cap,
            process_group=None,
            timeout_s=self._timeout_s,
            description="this process",
        )

    def close(self) -> None:
        self.native.remove_hooks()
        owner = _OWNERS.get(self._model)
        if owner is not None and owner() is self:
            del _OWNERS[self._model]
