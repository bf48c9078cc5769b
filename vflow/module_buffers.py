"""Module buffers (BatchNorm running statistics and the like) under virtual nodes.

Note [Buffer rule]
Each VN must behave as if it were its own device, so every VN's forward starts from
the buffers as they were at the start of the step: after a VN, any buffer it changed
(in place or by reassignment) is put back before the next VN runs. What the model
keeps at the end of the step is decided by one rule that does not look at workers:

* ``"vn0"``  — the values VN 0 produced, i.e. PyTorch DDP with broadcast_buffers=True,
  where every rank adopts rank 0's buffers;
* ``"mean"`` — the mean over all V VNs of the values each produced (a VN that left a
  buffer untouched contributes its starting value). Integer buffers such as
  ``num_batches_tracked`` take VN 0's value under both rules.

Change detection uses tensor version counters and identity, so untouched buffers
(including large constant ones) cost nothing beyond the per-step snapshot.
"""

from __future__ import annotations

import torch

BUFFER_RULES = ("vn0", "mean")


class BufferRule:
    def __init__(self, model: torch.nn.Module, rule: str) -> None:
        if rule not in BUFFER_RULES:
            raise ValueError(f"buffer_rule must be one of {BUFFER_RULES}, got {rule!r}")
        self.rule = rule
        self._slots = [
            (module, name)
            for module in model.modules()
            for name, value in module._buffers.items()
            if value is not None
        ]
        self._start: list[torch.Tensor] = []
        self._start_versions: list[int] = []
        self._result: dict[int, torch.Tensor] = {}
        self._count: dict[int, int] = {}
        self._vns = 0

    def _current(self, k: int) -> torch.Tensor:
        module, name = self._slots[k]
        return module._buffers[name]

    def _changed(self, k: int) -> bool:
        current = self._current(k)
        return current is not self._start[k] or current._version != self._start_versions[k]

    def begin_step(self) -> None:
        self._start = [self._current(k) for k in range(len(self._slots))]
        self._snapshot = [t.detach().clone() for t in self._start]
        self._start_versions = [t._version for t in self._start]
        self._result = {}
        self._count = {}
        self._vns = 0

    def end_vn(self) -> None:
        """Records what the VN that just ran did and restores the step's start values."""
        first = self._vns == 0
        for k in range(len(self._slots)):
            if not self._changed(k):
                continue
            value = self._current(k).detach()
            if first or (self.rule == "mean" and value.is_floating_point()):
                if k in self._result and value.is_floating_point():
                    self._result[k] += value.to(self._result[k].dtype)
                elif k not in self._result:
                    self._result[k] = (
                        value.to(torch.float64).clone()
                        if self.rule == "mean" and value.is_floating_point()
                        else value.clone()
                    )
                self._count[k] = self._count.get(k, 0) + 1
            self._restore(k)
        self._vns += 1

    def _restore(self, k: int) -> None:
        module, name = self._slots[k]
        start = self._start[k]
        if module._buffers[name] is not start:
            module._buffers[name] = start
        with torch.no_grad():
            start.copy_(self._snapshot[k])
        self._start_versions[k] = start._version

    def commit(self) -> None:
        """Writes the rule's values into the model's buffers."""
        with torch.no_grad():
            for k, value in self._result.items():
                target = self._start[k]
                if self.rule == "mean" and value.is_floating_point():
                    untouched = self._vns - self._count[k]
                    if untouched:
                        value = value + untouched * self._snapshot[k].to(value.dtype)
                    value = value / self._vns
                target.copy_(value.to(target.dtype))
        self._release()

    def abort(self) -> None:
        """Puts every buffer back to its value at the start of the step."""
        if not self._start:
            return
        for k in range(len(self._slots)):
            if self._changed(k):
                self._restore(k)
        self._release()

    def _release(self) -> None:
        self._snapshot = []
        self._start = []
        self._result = {}
        self._count = {}
