"""Kernel-throughput microbenchmarks of the installed vflow (``python -m vflow bench``).

vflow's fused kernels against what PyTorch offers for the same work, on flat float32
buffers and parameter lists the size of a real model's gradients, with the copy
bandwidth measured in the same run as the memory limit:

* accumulate: ``acc[i] += w * grad[i]`` for every parameter, fp32 and bf16 gradients
  into fp32 accumulators: vflow's fused ``multi_accumulate_`` into views of one flat
  buffer (what the Executor does after each VN's backward) against a per-tensor
  ``add_`` loop (the peer baseline) and ``torch._foreach_add_``;
* scale and check: ``scale_check_`` (the end of a step: scale the summed gradient and
  flag inf/NaN in one pass) against ``mul_`` then ``isfinite().all()``;
* exact accumulate: ``exact_accumulate_``, the integer accumulation of
  ``deterministic="exact"``, against the float fold it replaces.

Bytes moved per call count each tensor read or written once (1 GB = 1e9 B); GB/s is
bytes over the median time. Every method is timed in rounds, its place in the order
rotating each round, so that slow drift on a shared machine hits all of them alike.
``benchmarks/accumulate.py`` in a source checkout is the full study (ResNet-50 and GPT-2
lists, thread scaling, the exact pack/unpack kernels on every CPU vector path).
"""

from __future__ import annotations

import os
import platform
import statistics
import timeit
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.benchmark as tbench

from vflow import ops
from vflow._extension import _C
from vflow._version import __version__
from vflow.bench.records import copy_limit_note, headline, measurement, target
from vflow.bench.table import format_table

__all__ = [
    "Settings",
    "cpu_name",
    "environment",
    "gradient_sizes",
    "run",
    "time_blocks",
    "usable_cpus",
]

# The weight of one of 8 equal VNs: a power of two, so the fused kernel and add_ compute
# bit-identical products and the correctness check can ask for equality.
WEIGHT = 0.125
TARGET_FP32_COPY_FRACTION = 0.8
TARGET_BF16_SPEEDUP = 1.5
# Timed blocks of one method spread wider than this (IQR / median) only on a busy machine.
NOISY_IQR = 0.5

EXACT_NOTE = (
    "limit = the time the exact kernel's bytes (4 B read + 13 B read + 13 B written per "
    "element) take at the copy bandwidth measured in this run"
)


@dataclass(frozen=True)
class Settings:
    numel: int
    tensors: int
    rounds: int
    min_run_time: float


QUICK = Settings(numel=6_000_000, tensors=160, rounds=3, min_run_time=0.1)
FULL = Settings(numel=25_000_000, tensors=160, rounds=5, min_run_time=0.3)


def gradient_sizes(numel: int, tensors: int) -> list[int]:
    """Element counts of a parameter list shaped like a convolutional network's: a
    third of the tensors are weights whose size grows with the depth (channel widths
    doubling over four stages, as in a ResNet), the rest small bias and norm vectors of
    the matching width; about ``numel`` elements in all."""
    if tensors < 3 or numel < 64 * tensors:
        raise ValueError(
            f"gradient_sizes needs tensors >= 3 and numel >= 64 * tensors, got numel="
            f"{numel}, tensors={tensors}"
        )
    weights = tensors // 3
    widths = [64 * 2 ** (4 * i // weights) for i in range(weights)]
    vectors = [widths[i % weights] for i in range(tensors - weights)]
    scale = (numel - sum(vectors)) / sum(w * w for w in widths)
    return [max(1, round(w * w * scale)) for w in widths] + vectors


def environment(device: torch.device) -> dict[str, Any]:
    """What the results depend on, printed first and stored with every record."""
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_built_against": _C.torch_version,
        "vflow": __version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": cpu_name(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": usable_cpus(),
        "torch_threads": torch.get_num_threads(),
        "vflow_cpu_vector_path": _C.cpu_vector_path(),
        "vflow_built_with_cuda": _C.built_with_cuda(),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    return env


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()


def time_blocks(
    fn: Callable[[], object],
    device: torch.device,
    *,
    min_run_time: float,
    num_threads: int | None = None,
    label: str = "",
    description: str = "",
) -> list[float]:
    """Seconds per call of ``fn``, one value per block of torch's blocked_autorange.

    Callers pool the blocks of several calls (taken in rounds, interleaved with the
    other methods) and report the median, so slow drift on a shared machine hits every
    method alike.
    """
    timer = tbench.Timer(
        stmt="fn()",
        globals={"fn": fn},
        label=label,
        description=description,
        # Timer defaults to one thread; benchmark what users run.
        num_threads=torch.get_num_threads() if num_threads is None else num_threads,
        # Timer's default clock synchronises the accelerator; a CPU run need not pay it.
        **({} if device.type == "cuda" else {"timer": timeit.default_timer}),
    )
    return list(timer.blocked_autorange(min_run_time=min_run_time).times)


def _timed_blocks(
    methods: dict[str, Callable[[], object]], device: torch.device, settings: Settings
) -> dict[str, list[float]]:
    """Seconds per call of each method, one value per timed block, pooled over rounds."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(settings.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name] += time_blocks(methods[name], device, min_run_time=settings.min_run_time)
    return times


def _accumulate_case(
    sizes: list[int], grad_dtype: torch.dtype, device: torch.device
) -> dict[str, Callable[[], object]]:
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(n, generator=gen, device=device).to(grad_dtype) for n in sizes]
    accs = [torch.zeros(n, device=device) for n in sizes]  # separate, as param.grad is
    flat = torch.zeros(sum(sizes), device=device)
    views = list(flat.split(sizes))
    accumulate = ops.multi_accumulate_

    def loop() -> None:
        for acc, grad in zip(accs, grads):
            acc.add_(grad, alpha=WEIGHT)

    methods: dict[str, Callable[[], object]] = {
        "per-tensor add_": loop,
        "torch._foreach_add_": lambda: torch._foreach_add_(accs, grads, alpha=WEIGHT),
        "vflow multi_accumulate_": lambda: accumulate(views, grads, WEIGHT),
    }
    try:
        methods["torch._foreach_add_"]()
    except (RuntimeError, TypeError, NotImplementedError):
        del methods["torch._foreach_add_"]  # rejects these dtypes in this torch
    # A benchmark of a wrong computation is worthless: one call of each from zero agree.
    flat.zero_()
    for acc in accs:
        acc.zero_()
    accumulate(views, grads, WEIGHT)
    loop()
    if not all(torch.equal(v, a) for v, a in zip(views, accs)):
        raise AssertionError("multi_accumulate_ and add_ disagree: the benchmark would be void")
    return methods


def _flat_case(numel: int, device: torch.device) -> dict[str, Callable[[], object]]:
    gen = torch.Generator(device=device).manual_seed(1)
    grad = torch.randn(numel, generator=gen, device=device)
    buf, dst = torch.randn(numel, generator=gen, device=device), torch.empty(numel, device=device)
    fold = torch.zeros(numel, device=device)
    found = torch.zeros((), device=device)
    top = torch.zeros(numel, dtype=torch.int8, device=device)
    limbs = torch.zeros(3, numel, dtype=torch.int32, device=device)
    scale_check, accumulate = ops.scale_check_, ops.multi_accumulate_
    exact = ops.exact_accumulate_
    exact(top, *limbs, grad, WEIGHT, True)
    # Both scalings multiply buf by powers of two in turn (0.5, 2, 0.5, ...): its values
    # come back exactly every second call, however often the timer calls (a factor of 1
    # would skip the writes).
    factor = [2.0]

    def next_factor() -> float:
        factor[0] = 1 / factor[0]
        return factor[0]

    sign = [1.0]

    def exact_add() -> None:
        # +w and -w in turn: the integers come back every second call, so no limb grows
        # towards overflow.
        sign[0] = -sign[0]
        exact(top, *limbs, grad, sign[0] * WEIGHT, False)

    def mul_isfinite() -> None:
        buf.mul_(next_factor())
        found.copy_(~torch.isfinite(buf).all())

    return {
        "copy_": lambda: dst.copy_(buf),
        "scale_check_": lambda: scale_check(buf, next_factor(), found),
        "mul_ + isfinite": mul_isfinite,
        "float fold": lambda: accumulate([fold], [grad], WEIGHT),
        "exact_accumulate_ add": exact_add,
    }


def run(device: torch.device, settings: Settings) -> tuple[list[dict[str, Any]], str]:
    """Measures every case; returns the headline records and the detailed table."""
    sizes = gradient_sizes(settings.numel, settings.tensors)
    numel = sum(sizes)
    fp32 = 4
    times: dict[str, dict[str, list[float]]] = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        print(f"measuring accumulate, {name} gradients ...", flush=True)
        methods = _accumulate_case(sizes, dtype, device)
        # The copy runs among them: the limit is measured under the same conditions.
        copy_src, copy_dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
        methods["copy_"] = lambda src=copy_src, dst=copy_dst: dst.copy_(src)
        times[name] = _timed_blocks(methods, device, settings)
        del methods, copy_src, copy_dst
    print("measuring scale_check_ and exact_accumulate_ ...", flush=True)
    times["flat"] = _timed_blocks(_flat_case(numel, device), device, settings)

    copy_bytes = 2 * fp32 * numel
    nbytes = {("fp32", m): numel * (fp32 + 2 * fp32) for m in times["fp32"] if m != "copy_"} | {
        ("bf16", m): numel * (2 + 2 * fp32) for m in times["bf16"] if m != "copy_"
    }
    nbytes |= {(case, "copy_"): copy_bytes for case in times}
    exact_bytes = numel * (4 + 13 + 13)
    nbytes |= {
        ("flat", "scale_check_"): 2 * fp32 * numel,
        ("flat", "mul_ + isfinite"): 2 * fp32 * numel,
        ("flat", "float fold"): 3 * fp32 * numel,
        ("flat", "exact_accumulate_ add"): exact_bytes,
    }

    def m(case: str, method: str, **kwargs: Any) -> dict[str, Any]:
        return measurement(times[case][method], nbytes=nbytes[(case, method)], **kwargs)

    what = f"{len(sizes)} tensors, {numel / 1e6:.1f} M"
    copy_note = copy_limit_note(f"{numel / 1e6:.1f} M fp32 elements")
    records = [
        headline(
            "kernels",
            f"kernels/accumulate/{dt}",
            f"accumulate {dt} ({what}): fused / " + ("copy GB/s" if fp32 else "loop GB/s"),
            vflow=m(dt, "vflow multi_accumulate_"),
            baseline=m(dt, "per-tensor add_", label="per-tensor add_"),
            limit=m(dt, "copy_", label="copy bandwidth", note=copy_note),
            compare="vflow/limit" if fp32 else "vflow/baseline",
            target=target(">=", TARGET_FP32_COPY_FRACTION if fp32 else TARGET_BF16_SPEEDUP),
        )
        for dt, fp32 in (("fp32", True), ("bf16", False))
    ]
    records += [
        headline(
            "kernels",
            "kernels/scale_check",
            f"scale_check_ ({numel / 1e6:.1f} M): fused / mul_+isfinite GB/s",
            vflow=m("flat", "scale_check_"),
            baseline=m("flat", "mul_ + isfinite", label="mul_ + isfinite"),
            limit=m("flat", "copy_", label="copy bandwidth", note=copy_note),
        ),
        headline(
            "kernels",
            "kernels/exact_add",
            f"exact accumulate ({numel / 1e6:.1f} M): time / float fold",
            vflow=measurement(times["flat"]["exact_accumulate_ add"]),
            baseline=measurement(times["flat"]["float fold"], label="float fold"),
            limit=measurement(
                times["flat"]["copy_"],
                nbytes=copy_bytes,
                for_bytes=exact_bytes,
                label="copy bandwidth",
                note=EXACT_NOTE,
            ),
        ),
    ]
    return records, _detail_table(times, nbytes)


def _detail_table(
    times: dict[str, dict[str, list[float]]], nbytes: dict[tuple[str, str], int]
) -> str:
    rows = []
    noisy = 0
    for case, methods in times.items():
        copy_gbps = nbytes[(case, "copy_")] / statistics.median(methods["copy_"]) / 1e9
        for method, samples in methods.items():
            median = statistics.median(samples)
            q1, _, q3 = statistics.quantiles(samples, n=4) if len(samples) > 1 else (0, 0, 0)
            noisy += (q3 - q1) / median > NOISY_IQR
            gbps = nbytes[(case, method)] / median / 1e9
            rows.append(
                [
                    case,
                    method,
                    f"{median * 1e3:.3f}",
                    f"{100 * (q3 - q1) / median:.0f}%",
                    f"{gbps:.1f}",
                    f"{100 * gbps / copy_gbps:.0f}%",
                ]
            )
    text = format_table(["case", "method", "median ms", "IQR", "GB/s", "% copy"], rows)
    if noisy:
        text += (
            f"\nWARNING: {noisy} of {len(rows)} methods vary by more than "
            f"{NOISY_IQR:.0%} (IQR): other processes are competing for the cores, and "
            "descheduled threads dominate the times; rerun on a quiet machine, or with "
            "--threads 1"
        )
    return text
