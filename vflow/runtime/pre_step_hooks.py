"""The user's pre-step hooks of an executor (``register_pre_step_hook``), one
implementation for ``vflow.Executor`` and ``vflow.PipelineExecutor``: where they run is
Note [Before the optimizer step], vflow/runtime/step_run.py."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle


class PreStepHooks:
    """Hooks ``fn(executor)``, called in registration order on a step that steps the
    optimizer, with ``param.grad`` as the optimizer will take it."""

    def __init__(self) -> None:
        self._hooks: OrderedDict[int, Callable[[Any], None]] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._hooks)

    def register(self, fn: Callable[[Any], None]) -> RemovableHandle:
        """Adds ``fn``; the handle's ``remove()`` takes it away. Not callable: TypeError."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = fn
        return handle

    def call(self, executor: Any, params: Sequence[torch.nn.Parameter]) -> None:
        """Runs every hook on ``executor``; raises when one replaced a ``param.grad``
        (clipping and the optimizer would not see a change made so)."""
        grads = [p.grad for p in params]
        for fn in list(self._hooks.values()):
            fn(executor)
        replaced = [index for index, (p, g) in enumerate(zip(params, grads)) if p.grad is not g]
        if replaced:
            raise RuntimeError(
                f"a pre-step hook replaced param.grad of {len(replaced)} trainable "
                f"parameter(s) (the first of shape {tuple(params[replaced[0]].shape)}); "
                "change param.grad in place (param.grad.mul_(c), param.grad.copy_(g)) so "
                "that clipping and the optimizer see the change"
            )
