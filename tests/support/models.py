"""Small models and losses shared by the executor tests."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from vflow.mapping.batching import split_sizes


def mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
    ).to(dtype)


def bn_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(2, 6, 3, padding=1, bias=False),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Flatten(),
        nn.Dropout(0.3),
        nn.Linear(6 * 5 * 5, 4),
    )


class TokenModel(nn.Module):
    """Embedding + per-token classifier for (sum, num_items) losses over padded sequences."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(20, 16)
        self.proj = nn.Linear(16, 20)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.embed(tokens)))


def mean_ce(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def token_sum_loss(model: nn.Module, batch):
    tokens, targets, mask = batch
    logits = model(tokens)
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    mask = mask.flatten()
    return (per_token * mask).sum(), mask.sum()


def classification_data(b: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 6, generator=g), torch.randint(0, 4, (b,), generator=g)


def padded_tokens(b: int, length: int = 12, seed: int = 2):
    """Sequences whose real lengths vary widely, so VNs hold very different token counts."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 20, (b, length), generator=g)
    targets = torch.randint(0, 20, (b, length), generator=g)
    lengths = torch.randint(1, length + 1, (b,), generator=g)
    lengths[: b // 3] = 1  # the first VNs are mostly padding
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    return tokens, targets, mask


def float64_grads(model: nn.Module, loss_fn, batch) -> list[torch.Tensor]:
    """Gradient of the global-batch loss, computed in one float64 backward."""
    ref = copy.deepcopy(model).double()
    batch = tuple(t.double() if t.is_floating_point() else t for t in batch)
    out = loss_fn(ref, batch)
    loss = out[0] / out[1] if isinstance(out, tuple) else out
    loss.backward()
    return [p.grad for p in ref.parameters()]


def per_vn_reference(model: nn.Module, loss_fn, batch, v: int, seeds: list[int]):
    """Gradient as V real devices would produce it: VN i runs alone with its seed."""
    ref = copy.deepcopy(model)
    b = batch[0].shape[0]
    grads = [torch.zeros_like(p, dtype=torch.float64) for p in ref.parameters()]
    start = 0
    states = []
    for i, n in enumerate(split_sizes(b, v)):
        dev = copy.deepcopy(model)
        torch.manual_seed(seeds[i])
        loss = loss_fn(dev, tuple(t[start : start + n] for t in batch))
        (loss * n / b).backward()
        for acc, p in zip(grads, dev.parameters()):
            if p.grad is not None:  # a parameter this VN did not use contributes zero
                acc += p.grad.double()
        states.append({k: v.clone() for k, v in dev.state_dict().items()})
        start += n
    return grads, states


def max_relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """max over tensors of ||got - want||_inf / ||want||_inf.

    A tensor whose exact gradient is (numerically) zero, such as a conv bias followed by
    BatchNorm, is measured against 1e-3 of the largest gradient instead of its own tiny
    magnitude, where only rounding noise lives.
    """
    overall = max(w.double().abs().max().item() for w in want)
    return max(
        (g.double() - w.double()).abs().max().item()
        / max(w.double().abs().max().item(), 1e-3 * overall)
        for g, w in zip(got, want)
    )
