"""Module buffers (BatchNorm running statistics and the like) under virtual nodes.

Note [Buffer rule]
Each VN must behave as if it were its own device, so every VN's forward starts from
the buffers as they were at the start of the step: after each VN, every buffer is put
back (by value, and by identity if the module reassigned it). What the model keeps at
the end of the step is decided by one rule that does not look at workers:

* ``"vn0"``  — the values VN 0 produced, i.e. PyTorch DDP with broadcast_buffers=True,
  where every rank adopts rank 0's buffers;
* ``"mean"`` — the mean over all V VNs of the values each produced, accumulated in
  float64. Integer buffers such as ``num_batches_tracked`` take VN 0's value.

In deterministic mode the ``"mean"`` rule keeps one float64 row per VN instead of a
running sum: rows of VNs run elsewhere are zero, so summing the rows over the workers
is exact in any order, and the rows are then added in VN order, which gives the same
bits for every plan. It costs V copies of the floating-point buffers (small next to
the gradients for the models this targets).

Changes cannot be detected through version counters: native kernels such as
batch_norm update running statistics through raw pointers without bumping them. So
every buffer is saved and restored by value; buffers are small next to parameters and
activations for the models this targets (a ResNet-50 has 0.2 MB of them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vflow.world.group import World

BUFFER_RULES = ("vn0", "mean")


class BufferRule:
    def __init__(self, model: torch.nn.Module, rule: str, vn_rows: int | None = None) -> None:
        """``vn_rows``: V for the per-VN rows of deterministic mode, None otherwise."""
        if rule not in BUFFER_RULES:
            raise ValueError(f"buffer_rule must be one of {BUFFER_RULES}, got {rule!r}")
        self.rule = rule
        self._vn_rows = vn_rows
        self._slots = [
            (module, name)
            for module in model.modules()
            for name, value in module._buffers.items()
            if value is not None
        ]
        self._start: list[torch.Tensor] = []
        self._snapshot: list[torch.Tensor] = []
        self._result: list[torch.Tensor] = []
        self._vns = 0

    @property
    def has_buffers(self) -> bool:
        return bool(self._slots)

    def _current(self, k: int) -> torch.Tensor:
        module, name = self._slots[k]
        return module._buffers[name]

    def _averaged(self, value: torch.Tensor) -> bool:
        return self.rule == "mean" and value.is_floating_point()

    def begin_step(self) -> None:
        self._start = [self._current(k) for k in range(len(self._slots))]
        self._snapshot = [t.detach().clone() for t in self._start]
        self._result = []
        self._vns = 0

    @torch.no_grad()
    def end_vn(self, vn: int) -> None:
        """Records what VN ``vn``, which just ran, produced and restores the step's
        start values."""
        for k in range(len(self._slots)):
            value = self._current(k).detach()
            if self._vn_rows is not None and self._averaged(value):
                if self._vns == 0:
                    self._result.append(
                        torch.zeros(
                            (self._vn_rows, *value.shape), dtype=torch.float64, device=value.device
                        )
                    )
                self._result[k][vn] = value
            elif self._vns == 0:
                self._result.append(
                    value.to(torch.float64, copy=True) if self._averaged(value) else value.clone()
                )
            elif self._averaged(value):
                self._result[k] += value
            self._restore(k)
        self._vns += 1

    def _restore(self, k: int) -> None:
        module, name = self._slots[k]
        if module._buffers[name] is not self._start[k]:
            module._buffers[name] = self._start[k]
        # Through .data, which autograd does not version: in a pipeline a VN's backward
        # runs after the next VN's forward, and BatchNorm saved its running statistics
        # for it (training-mode backward reads the batch's statistics, not these).
        self._start[k].data.copy_(self._snapshot[k])

    @torch.no_grad()
    def reduce(self, world: World, virtual_nodes: int, step: int) -> None:
        """Turns this worker's per-VN record into the rule's value over all V VNs of
        all workers (VN 0 runs on the group's first rank); call before commit."""
        averaged = [value for value in self._result if self._averaged(value)]
        from_vn0 = [value for value in self._result if not self._averaged(value)]
        if averaged:
            world.sum(averaged, "all-reduce of the module buffers", step)
        if from_vn0:
            world.broadcast_from(0, from_vn0, "broadcast of VN 0's module buffers", step)
        self._vns = virtual_nodes

    @torch.no_grad()
    def commit(self) -> None:
        """Writes the rule's values into the model's buffers."""
        for k, value in enumerate(self._result):
            if self._vn_rows is not None and self._averaged(value):
                total = value[0].clone()
                for row in value[1:]:
                    total += row
                value = total
            if self._averaged(value):
                value = value / self._vns
            self._start[k].copy_(value)
        self._release()

    @torch.no_grad()
    def abort(self) -> None:
        """Puts every buffer back to its value at the start of the step."""
        for k in range(len(self._start)):
            self._restore(k)
        self._release()

    def _release(self) -> None:
        self._start, self._snapshot, self._result = [], [], []
