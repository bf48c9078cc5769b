"""Fused gradient accumulation (vflow) against PyTorch baselines on real parameter lists.

One accumulation step is ``acc[i] += w * grad[i]`` for every parameter i, as vflow does
after each virtual node's backward. Methods:

* ``per-tensor add_``: ``acc.add_(g, alpha=w)`` per tensor, what a hand-written loop does;
* ``torch._foreach_add_``: PyTorch's multi-tensor op (n/a where it rejects the dtypes);
* ``vflow accumulate_``: ``GradBuffer.accumulate_`` into views of one flat buffer, the
  call vflow's executor makes;
* ``torch flat add_ (ref)``: one ``add_`` over a single tensor as large as the whole
  list (fp32 only): the accumulate pattern with no per-tensor cost, done by PyTorch;
* ``vflow accumulate_, 1 thread`` (CPU, not with --quick): shows thread scaling.

Bandwidth: bytes moved = read grad + read acc + write acc. The memory-bandwidth limit
is measured in the same run as ``dst.copy_(src)`` over 256 MB of fp32, counting read +
write bytes, interleaved with the methods above.

A second table (``--exact-only`` runs only it, ``--no-exact`` skips it) times the exact
kernels of deterministic mode (Note [Exact accumulation] in csrc/exact.h) on one flat
fp32 gradient per size: ``exact_accumulate_`` fresh (4 B read + 13 B written per
element) and adding (4 + 13 B read, 13 B written), ``exact_pack_`` (14 B + 8 B) and
``exact_unpack_`` (9 B + 4 B), beside vflow's float fold (``multi_accumulate_``),
``acc.add_(grad, alpha=w)`` and ``dst.copy_(src)`` of the same size, interleaved in the
same rounds; on CPU on every vector path (avx2, portable) the CPU offers.

Run ``python benchmarks/accumulate.py --help`` for options.
"""

from __future__ import annotations

import argparse
import gc
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from _common import (
    FULL_MLP,
    add_common_args,
    fmt_ms,
    format_table,
    iqr,
    median,
    open_session,
    synchronize,
    time_blocks,
)

from vflow import _C, ops
from vflow.bench.records import copy_limit_note, headline, measurement, target

# The weight of one of 8 equal virtual nodes; a power of two, so every method computes
# bit-identical products and the correctness check below can be tight.
WEIGHT = 0.125
COPY_BYTES = 256 * 2**20
LOOP = "per-tensor add_"
FOREACH = "torch._foreach_add_"
FUSED = "vflow accumulate_"
FUSED_1T = "vflow accumulate_, 1 thread"
FLAT = "torch flat add_ (ref)"

# On CPU, a copy with ordinary stores reads each destination line before writing it:
# 3 streams of traffic for the 2 counted. Used only for the extra bound column.
WRITE_ALLOCATE = 1.5

# Targets printed beside the results (not asserted).
TARGET_FP32_COPY_FRACTION = 0.80
TARGET_BF16_SPEEDUP = 1.5

Shape = tuple[int, ...]


def resnet50_shapes() -> list[Shape]:
    """Trainable parameter shapes of torchvision's resnet50, in named_parameters order."""
    shapes: list[Shape] = [(64, 3, 7, 7), (64,), (64,)]  # conv1, bn1
    inplanes = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        out = width * 4  # bottleneck expansion
        for block in range(blocks):
            # fmt: off
            shapes += [
                (width, inplanes, 1, 1), (width,), (width,),
                (width, width, 3, 3), (width,), (width,),
                (out, width, 1, 1), (out,), (out,),
            ]
            # fmt: on
            if block == 0:  # downsample: 1x1 conv + BN on the shortcut
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]
            inplanes = out
    shapes += [(1000, 2048), (1000,)]  # fc
    return shapes


def gpt2_shapes(layers: int = 12) -> list[Shape]:
    """Trainable parameter shapes of GPT-2 small (HF layout: Conv1D weights are
    (in, out); lm_head is tied to wte, so it adds no tensor)."""
    d, vocab, ctx = 768, 50257, 1024
    shapes: list[Shape] = [(vocab, d), (ctx, d)]  # wte, wpe
    for _ in range(layers):
        # fmt: off
        shapes += [
            (d,), (d,),  # ln_1
            (d, 3 * d), (3 * d,),  # attn.c_attn
            (d, d), (d,),  # attn.c_proj
            (d,), (d,),  # ln_2
            (d, 4 * d), (4 * d,),  # mlp.c_fc
            (4 * d, d), (d,),  # mlp.c_proj
        ]
        # fmt: on
    shapes += [(d,), (d,)]  # ln_f
    return shapes


def numel(shapes: list[Shape]) -> int:
    return sum(math.prod(s) for s in shapes)


@dataclass
class Case:
    """One parameter list with one gradient dtype, and the tensors every method uses."""

    name: str
    shapes: list[Shape]
    grad_dtype: torch.dtype
    methods: dict[str, Callable[[], object]]
    unsupported: dict[str, str]
    numel: int

    @property
    def bytes_moved(self) -> int:
        grad_size = torch.empty((), dtype=self.grad_dtype).element_size()
        return self.numel * (grad_size + 2 * 4)


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def build_case(
    name: str,
    shapes: list[Shape],
    grad_dtype: torch.dtype,
    device: torch.device,
    *,
    with_one_thread: bool,
) -> Case:
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(s, generator=gen, device=device).to(grad_dtype) for s in shapes]
    # Only shapes and device are read from the "params"; the grads have both.
    buffer = _C.GradBuffer(grads, torch.float32)
    indices = list(range(len(grads)))
    # Baselines accumulate into separately allocated tensors, as param.grad would be.
    accs = [torch.zeros(s, device=device) for s in shapes]

    def loop() -> None:
        for acc, grad in zip(accs, grads, strict=True):
            acc.add_(grad, alpha=WEIGHT)

    def foreach() -> None:
        torch._foreach_add_(accs, grads, alpha=WEIGHT)

    def fused() -> None:
        buffer.accumulate_(indices, grads, WEIGHT)

    methods: dict[str, Callable[[], object]] = {LOOP: loop, FOREACH: foreach, FUSED: fused}
    if with_one_thread:
        methods[FUSED_1T] = fused
    if grad_dtype == torch.float32:
        total = numel(shapes)
        flat_acc = torch.zeros(total, device=device)
        flat_grad = torch.randn(total, generator=gen, device=device)
        methods[FLAT] = lambda: flat_acc.add_(flat_grad, alpha=WEIGHT)

    unsupported: dict[str, str] = {}
    for method, fn in list(methods.items()):
        try:
            fn()
            synchronize(device)
        except (RuntimeError, TypeError, NotImplementedError) as e:
            first_line = (str(e).splitlines() or [""])[0]
            unsupported[method] = f"{type(e).__name__}: {first_line}"
            del methods[method]

    # Guard against benchmarking a wrong computation: one fused call and one loop call
    # from zero must agree.
    buffer.zero_()
    for acc in accs:
        acc.zero_()
    fused()
    loop()
    for view, acc in zip(buffer.views(), accs, strict=True):
        if not torch.equal(view, acc):
            raise AssertionError(f"{name}/{_short(grad_dtype)}: fused result differs from add_")
    return Case(name, shapes, grad_dtype, methods, unsupported, numel(shapes))


def make_copy(device: torch.device) -> Callable[[], object]:
    src = torch.randn(COPY_BYTES // 4, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def run_case(
    case: Case,
    device: torch.device,
    copy_fn: Callable[[], object],
    *,
    rounds: int,
    min_run_time: float,
    copy_times: list[float],
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {m: [] for m in case.methods}
    order = [*case.methods, "copy"]
    for r in range(rounds):
        # Rotating the order each round keeps "who ran right after whom" from biasing
        # one method (caches, frequency, a neighbour's load on a shared machine).
        shift = r % len(order)
        for method in order[shift:] + order[:shift]:
            if method == "copy":
                copy_times += time_blocks(copy_fn, device, min_run_time=min_run_time, label="copy")
                continue
            times[method] += time_blocks(
                case.methods[method],
                device,
                min_run_time=min_run_time,
                num_threads=1 if method == FUSED_1T else None,
                label=f"{case.name} {_short(case.grad_dtype)}",
                description=method,
            )
    return times


def float_section(
    device: torch.device, *, rounds: int, min_run_time: float, gpt2_layers: int, quick: bool
) -> list[dict[str, Any]]:
    """The fused float accumulation on real parameter lists against PyTorch: measures,
    prints its tables and returns its JSON records."""
    lists = [("resnet50", resnet50_shapes()), (f"gpt2-{gpt2_layers}L", gpt2_shapes(gpt2_layers))]
    # Catch typos in the hand-built lists against the published model sizes.
    assert (len(lists[0][1]), numel(lists[0][1])) == (161, 25_557_032)
    if gpt2_layers == 12:
        assert (len(lists[1][1]), numel(lists[1][1])) == (148, 124_439_808)
    for name, shapes in lists:
        print(f"{name}: {len(shapes)} tensors, {numel(shapes) / 1e6:.2f} M params")
    print(
        f"weight {WEIGHT}, {rounds} round(s) x blocked_autorange(min_run_time="
        f"{min_run_time}) per method; times are medians over all blocks\n",
        flush=True,
    )

    copy_fn = make_copy(device)
    copy_times: list[float] = []
    with_one_thread = device.type == "cpu" and torch.get_num_threads() > 1 and not quick
    measured: list[tuple[Case, dict[str, list[float]]]] = []
    for name, shapes in lists:
        for grad_dtype in (torch.float32, torch.bfloat16):
            case = build_case(name, shapes, grad_dtype, device, with_one_thread=with_one_thread)
            print(f"measuring {name} {_short(grad_dtype)} ...", flush=True)
            times = run_case(
                case,
                device,
                copy_fn,
                rounds=rounds,
                min_run_time=min_run_time,
                copy_times=copy_times,
            )
            case.methods = {}  # frees the tensors; the times and metadata are kept
            measured.append((case, times))
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    del copy_fn  # frees its buffers before the report

    copy_s = median(copy_times)
    copy_gbps = 2 * COPY_BYTES / copy_s / 1e9
    records: list[dict[str, Any]] = [
        {
            "benchmark": "copy",
            "bytes": 2 * COPY_BYTES,
            "median_s": copy_s,
            "iqr_s": iqr(copy_times),
            "gbps": copy_gbps,
            "times_s": copy_times,
        }
    ]
    rows: list[list[str]] = []
    limit_rows: list[list[str]] = []
    targets: list[str] = []
    for case, times in measured:
        dt = _short(case.grad_dtype)
        loop_s = median(times[LOOP]) if times.get(LOOP) else None
        bound_s = case.bytes_moved / (copy_gbps * 1e9)
        flat_s = median(times[FLAT]) if times.get(FLAT) else None
        limit_rows.append(
            [
                case.name,
                dt,
                f"{case.bytes_moved / 1e6:.0f}",
                fmt_ms(bound_s),
                *([fmt_ms(bound_s / WRITE_ALLOCATE)] if device.type == "cpu" else []),
                fmt_ms(flat_s) if flat_s else "-",
            ]
        )
        for method in (LOOP, FOREACH, FUSED, FUSED_1T, FLAT):
            record: dict[str, Any] = {
                "benchmark": "accumulate",
                "list": case.name,
                "tensors": len(case.shapes),
                "numel": case.numel,
                "grad_dtype": dt,
                "acc_dtype": "fp32",
                "method": method,
                "bytes": case.bytes_moved,
                "copy_gbps": copy_gbps,
                # The targets travel with the results, so a summary never restates them.
                "target_fp32_copy_fraction": TARGET_FP32_COPY_FRACTION,
                "target_bf16_speedup_vs_loop": TARGET_BF16_SPEEDUP,
            }
            if method in case.unsupported:
                record |= {"status": "n/a", "error": case.unsupported[method]}
                records.append(record)
                rows.append([case.name, dt, method, "n/a", "", "", "", "", "unsupported"])
                continue
            if method not in times:
                continue
            t = median(times[method])
            gbps = case.bytes_moved / t / 1e9
            speedup = loop_s / t if loop_s else None
            note = ""
            if method == FUSED and dt == "fp32":
                ok = gbps >= TARGET_FP32_COPY_FRACTION * copy_gbps
                note = f"target >={TARGET_FP32_COPY_FRACTION:.0%} copy: {'met' if ok else 'MISSED'}"
                short = TARGET_FP32_COPY_FRACTION * copy_gbps - gbps
                targets.append(
                    f"{case.name} fp32 fused: {gbps / copy_gbps:.0%} of copy GB/s "
                    f"(target >= {TARGET_FP32_COPY_FRACTION:.0%}) -> "
                    + ("met" if ok else f"MISSED by {short:.1f} GB/s")
                )
            if method == FUSED and dt == "bf16" and speedup is not None:
                ok = speedup >= TARGET_BF16_SPEEDUP
                note = f"target >={TARGET_BF16_SPEEDUP}x loop: {'met' if ok else 'MISSED'}"
                targets.append(
                    f"{case.name} bf16->fp32 fused: {speedup:.2f}x the per-tensor loop "
                    f"(target >= {TARGET_BF16_SPEEDUP}x) -> {'met' if ok else 'MISSED'}"
                )
            record |= {
                "status": "ok",
                "median_s": t,
                "iqr_s": iqr(times[method]),
                "gbps": gbps,
                "pct_copy": 100 * gbps / copy_gbps,
                "speedup_vs_loop": speedup,
                "threads": 1 if method == FUSED_1T else torch.get_num_threads(),
                "times_s": times[method],
            }
            records.append(record)
            rows.append(
                [
                    case.name,
                    dt,
                    method,
                    fmt_ms(t),
                    f"{100 * iqr(times[method]) / t:.0f}%",
                    f"{gbps:.1f}",
                    f"{100 * gbps / copy_gbps:.0f}%",
                    f"{speedup:.2f}x" if speedup else "n/a",
                    note,
                ]
            )

    print()
    print(
        f"copy bandwidth (dst.copy_(src), {COPY_BYTES // 2**20} MB fp32, read+write): "
        f"{copy_gbps:.1f} GB/s (median of {len(copy_times)} blocks, "
        f"{fmt_ms(copy_s)} ms per copy)"
    )
    print(
        "\naccumulate limits implied by the copy bandwidth "
        "(bytes = read grad + read acc + write acc):"
    )
    print(
        format_table(
            [
                "list",
                "grad",
                "MB moved",
                "bound ms",
                *(["bound ms, copy x1.5"] if device.type == "cpu" else []),
                "flat add_ ms",
            ],
            limit_rows,
        )
    )
    if device.type == "cpu":
        print(
            "(bound ms = bytes / copy GB/s. On CPU, copy_'s ordinary stores first read\n"
            " each destination line (write-allocate), so it moves 1.5x the bytes counted;\n"
            " accumulate reads acc anyway and has no such extra traffic, so it can beat\n"
            " the copy-derived bound: 'copy x1.5' is the bound with that traffic counted.)"
        )
    print("\nresults (median over all blocks; IQR relative to the median):")
    print(
        format_table(
            ["list", "grad", "method", "median ms", "IQR", "GB/s", "% copy", "vs loop", "target"],
            rows,
        )
    )
    for method, reason in {(m, r) for case, _ in measured for m, r in case.unsupported.items()}:
        print(f"n/a: {method}: {reason}")
    print("\ntargets:")
    for line in targets:
        print(f"  {line}")
    return records


# ---- Exact (deterministic-mode) kernels: Note [Exact accumulation] in csrc/exact.h ----

EXACT_COPY = "copy (dst.copy_(src))"
EXACT_TORCH_ADD = "torch add_"
EXACT_FOLD = "vflow float fold"
EXACT_FRESH = "exact accumulate_ fresh"
EXACT_ADD = "exact accumulate_ add"
EXACT_PACK = "exact pack_"
EXACT_UNPACK = "exact unpack_"
# Bytes each kernel must move per element (fp32 gradient; 1 B top bin + 3 x 4 B limbs
# = 13 B of exact accumulator): reads + writes, nothing counted twice.
EXACT_BYTES = {
    EXACT_COPY: 4 + 4,  # read src, write dst
    EXACT_TORCH_ADD: 4 + 4 + 4,  # read grad, read + write acc
    EXACT_FOLD: 4 + 4 + 4,
    EXACT_FRESH: 4 + 13,  # read grad, write the accumulator without reading it
    EXACT_ADD: 4 + 13 + 13,  # read grad, read + write the accumulator
    EXACT_PACK: 1 + 1 + 12 + 8,  # read local + global top and limbs, write int64
    EXACT_UNPACK: 1 + 8 + 4,  # read global top and int64, write fp32
}
# Kernels whose CPU code depends on set_cpu_vector_path (the others run the same code
# on every path and are measured once per size).
EXACT_PATH_KERNELS = (EXACT_FOLD, EXACT_FRESH, EXACT_ADD)
EXACT_ORDER = (
    EXACT_COPY,
    EXACT_TORCH_ADD,
    EXACT_FOLD,
    EXACT_FRESH,
    EXACT_ADD,
    EXACT_PACK,
    EXACT_UNPACK,
)


def exact_sizes(numels: list[int] | None, *, quick: bool) -> list[tuple[str, int]]:
    if numels:
        return [(f"{n:,}", n) for n in numels]
    sizes = [(FULL_MLP.name, FULL_MLP.params)]
    if not quick:
        sizes.append(("resnet50", numel(resnet50_shapes())))
    return sizes


def exact_paths(device: torch.device) -> list[str]:
    """The CPU vector paths to measure (all the CPU and build offer), or ["cuda"]."""
    if device.type == "cuda":
        return ["cuda"]
    return ops.cpu_vector_paths()


@dataclass
class ExactCase:
    """The tensors of one size and one list of (kernel, vector path or None, call)."""

    label: str
    numel: int
    methods: list[tuple[str, str | None, Callable[[], object]]]


def build_exact_case(label: str, n: int, device: torch.device, paths: list[str]) -> ExactCase:
    gen = torch.Generator(device=device).manual_seed(0)
    grad = torch.randn(n, generator=gen, device=device)
    top = torch.empty(n, dtype=torch.int8, device=device)
    limbs = torch.empty(3, n, dtype=torch.int32, device=device)  # as the Reducer holds them
    l0, l1, l2 = limbs
    acc = torch.zeros(n, device=device)
    src = torch.randn(n, generator=gen, device=device)
    dst = torch.empty_like(src)
    wire = torch.empty(n, dtype=torch.int64, device=device)
    out = torch.empty(n, device=device)

    # Correctness guard, per path: one contribution with a power-of-two weight is kept
    # exactly, so fresh accumulate -> pack -> unpack must return WEIGHT * grad bit for
    # bit; an add of the same contribution must double it. Before the first check the
    # accumulators hold garbage, which fresh must not read.
    expected = grad * WEIGHT
    for path in paths:
        if path != "cuda":
            ops.set_cpu_vector_path(path)
        top.fill_(5)
        limbs.fill_(12345)
        ops.exact_accumulate_(top, l0, l1, l2, grad, WEIGHT, True)
        ops.exact_pack_(top, top, l0, l1, l2, wire)
        ops.exact_unpack_(top, wire, out)
        if not torch.equal(out, expected):
            raise AssertionError(f"exact {label} ({path}): fresh round trip differs")
        ops.exact_accumulate_(top, l0, l1, l2, grad, WEIGHT, False)
        ops.exact_pack_(top, top, l0, l1, l2, wire)
        ops.exact_unpack_(top, wire, out)
        if not torch.equal(out, 2 * expected):
            raise AssertionError(f"exact {label} ({path}): add differs from 2 x fresh")

    # The timed state: this "worker" holds one contribution; the global top bins are the
    # MAX over it and a second worker's, as in a 2-rank reduce (mostly equal, so pack
    # takes the common branch, as in training).
    ops.exact_accumulate_(top, l0, l1, l2, grad, WEIGHT, True)
    other_top = torch.empty_like(top)
    other_limbs = torch.empty_like(limbs)
    other = torch.randn(n, generator=gen, device=device)
    ops.exact_accumulate_(other_top, *other_limbs, other, WEIGHT, True)
    global_top = torch.maximum(top, other_top)
    del other_top, other_limbs, other
    ops.exact_pack_(top, global_top, l0, l1, l2, wire)

    # The add alternates the sign of the weight, which takes the limbs back to the same
    # integers every second call: however often the timer calls it, no limb can grow
    # towards int32 overflow (a real step adds at most EXACT_MAX_TERMS contributions).
    sign = [1.0]

    def exact_add() -> None:
        sign[0] = -sign[0]
        ops.exact_accumulate_(top, l0, l1, l2, grad, sign[0] * WEIGHT, False)

    methods: list[tuple[str, str | None, Callable[[], object]]] = [
        (EXACT_COPY, None, lambda: dst.copy_(src)),
        (EXACT_TORCH_ADD, None, lambda: acc.add_(grad, alpha=WEIGHT)),
    ]
    # A path-dependent kernel also runs on CUDA, under the one "path" cuda.
    for path in paths:
        methods += [
            (EXACT_FOLD, path, lambda: ops.multi_accumulate_([acc], [grad], WEIGHT)),
            (
                EXACT_FRESH,
                path,
                lambda: ops.exact_accumulate_(top, l0, l1, l2, grad, WEIGHT, True),
            ),
            (EXACT_ADD, path, exact_add),
        ]
    methods += [
        (EXACT_PACK, None, lambda: ops.exact_pack_(top, global_top, l0, l1, l2, wire)),
        (EXACT_UNPACK, None, lambda: ops.exact_unpack_(global_top, wire, out)),
    ]
    synchronize(device)
    return ExactCase(label, n, methods)


def run_exact_case(
    case: ExactCase, device: torch.device, *, rounds: int, min_run_time: float
) -> list[list[float]]:
    """Blocks of seconds per call for each of case.methods, interleaved as run_case does."""
    times: list[list[float]] = [[] for _ in case.methods]
    order = list(range(len(case.methods)))
    for r in range(rounds):
        shift = r % len(order)
        for i in order[shift:] + order[:shift]:
            kernel, path, fn = case.methods[i]
            if path is not None and path != "cuda":
                ops.set_cpu_vector_path(path)
            times[i] += time_blocks(
                fn,
                device,
                min_run_time=min_run_time,
                label=f"exact {case.label}",
                description=f"{kernel} ({path})" if path else kernel,
            )
    return times


def _exact_row_order(key: tuple[str, str | None], paths: list[str]) -> tuple[int, int, int]:
    """Table order: the baselines (copy, add_), each path's kernels, then pack, unpack."""
    kernel, path = key
    group = 1 if path else (2 if kernel in (EXACT_PACK, EXACT_UNPACK) else 0)
    return group, paths.index(path) if path else 0, EXACT_ORDER.index(kernel)


def exact_section(
    device: torch.device, sizes: list[tuple[str, int]], *, rounds: int, min_run_time: float
) -> list[dict[str, Any]]:
    """The exact kernels of deterministic mode against the float fold, torch's add_ and a
    copy of the same size: measures, prints the table and returns the JSON records."""
    paths = exact_paths(device)
    threads = torch.get_num_threads()
    print(
        "\n== exact kernels (deterministic mode) ==\n"
        f"sizes: {', '.join(f'{label} ({n:,} elements)' for label, n in sizes)}; "
        f"fp32 gradients, weight {WEIGHT}\n"
        f"{'vector paths' if device.type == 'cpu' else 'device'}: {', '.join(paths)}; "
        f"torch threads {threads}\n"
        f"{rounds} round(s) x blocked_autorange(min_run_time="
        f"{min_run_time}) per kernel, interleaved with a copy of the same size\n",
        flush=True,
    )
    measured: list[tuple[ExactCase, list[tuple[str, str | None]], list[list[float]]]] = []
    saved_path = ops.cpu_vector_path()
    try:
        for label, n in sizes:
            case = build_exact_case(label, n, device, paths)
            print(f"measuring exact kernels, {label} ...", flush=True)
            times = run_exact_case(case, device, rounds=rounds, min_run_time=min_run_time)
            keys = [(kernel, path) for kernel, path, _ in case.methods]
            case.methods = []  # frees the tensors
            measured.append((case, keys, times))
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        ops.set_cpu_vector_path(saved_path)  # the correctness guard and timing switch it

    records: list[dict[str, Any]] = []
    rows: list[list[str]] = []
    summary: list[str] = []
    for case, keys, times in measured:
        medians = {key: median(t) for key, t in zip(keys, times, strict=True)}
        copy_s = medians[(EXACT_COPY, None)]
        copy_gbps = EXACT_BYTES[EXACT_COPY] * case.numel / copy_s / 1e9
        ordered = sorted(range(len(keys)), key=lambda i: _exact_row_order(keys[i], paths))
        for i in ordered:
            kernel, path = keys[i]
            t = medians[(kernel, path)]
            per_elem = EXACT_BYTES[kernel]
            gbps = per_elem * case.numel / t / 1e9
            fold_s = medians.get((EXACT_FOLD, path)) if path else None
            vs_fold = t / fold_s if fold_s and kernel in (EXACT_FRESH, EXACT_ADD) else None
            records.append(
                {
                    "benchmark": "exact",
                    "size": case.label,
                    "numel": case.numel,
                    "kernel": kernel,
                    "path": path,
                    "grad_dtype": "fp32",
                    "bytes_per_elem": per_elem,
                    "bytes": per_elem * case.numel,
                    "median_s": t,
                    "iqr_s": iqr(times[i]),
                    "ns_per_elem": t / case.numel * 1e9,
                    "gbps": gbps,
                    "copy_gbps": copy_gbps,
                    "frac_copy": gbps / copy_gbps,
                    "time_vs_float_fold": vs_fold,
                    "threads": threads,
                    "times_s": times[i],
                }
            )
            rows.append(
                [
                    case.label,
                    path or "-",
                    kernel,
                    str(per_elem),
                    fmt_ms(t),
                    f"{100 * iqr(times[i]) / t:.0f}%",
                    f"{t / case.numel * 1e9:.2f}",
                    f"{gbps:.1f}",
                    f"{100 * gbps / copy_gbps:.0f}%",
                    f"{vs_fold:.2f}x" if vs_fold else "",
                ]
            )
        for path in paths:
            add_s = medians[(EXACT_ADD, path)]
            fold_s = medians[(EXACT_FOLD, path)]
            summary.append(
                f"{case.label}, {path}: exact add / float fold = {add_s / fold_s:.2f}x the "
                f"time ({EXACT_BYTES[EXACT_ADD] / EXACT_BYTES[EXACT_FOLD]:.1f}x the bytes); "
                f"copy {copy_gbps:.1f} GB/s"
            )

    print(
        "\nexact kernels (median over all blocks; IQR relative to the median;\n"
        "GB/s = B/elem x elements / median; % copy = GB/s / the copy's GB/s (same size);\n"
        "vs fold = time / vflow float fold's time on the same path):"
    )
    print(
        format_table(
            [
                "size",
                "path",
                "kernel",
                "B/elem",
                "median ms",
                "IQR",
                "ns/elem",
                "GB/s",
                "% copy",
                "vs fold",
            ],
            rows,
        )
    )
    for line in summary:
        print(f"  {line}")
    if device.type == "cpu":
        print(
            "(path '-': the same code on every path. On CPU, kernels that write without\n"
            " reading (copy, fresh, pack, unpack) also pay write-allocate reads of their\n"
            " output, which B/elem does not count; add, fold and add_ read it anyway.)"
        )
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved rounds per case (default 5, 1 with --quick)",
    )
    parser.add_argument(
        "--min-run-time",
        type=float,
        default=None,
        help="seconds per blocked_autorange call (default 0.4, 0.05 with --quick)",
    )
    parser.add_argument(
        "--gpt2-layers",
        type=int,
        default=None,
        help="transformer layers of the GPT-2 list (default 12, 2 with --quick)",
    )
    parser.add_argument(
        "--exact-numel",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="element counts of the exact-kernel table (default: the distributed.py "
        "model's 12.6 M and resnet50's 25.6 M; 12.6 M only with --quick)",
    )
    sections = parser.add_mutually_exclusive_group()
    sections.add_argument(
        "--exact-only", action="store_true", help="run only the exact-kernel table"
    )
    sections.add_argument("--no-exact", action="store_true", help="skip the exact-kernel table")
    args = parser.parse_args(argv)
    if args.exact_numel and min(args.exact_numel) < 1:
        parser.error("--exact-numel: every N must be >= 1")
    rounds = args.rounds or (1 if args.quick else 5)
    min_run_time = args.min_run_time or (0.05 if args.quick else 0.4)
    gpt2_layers = args.gpt2_layers or (2 if args.quick else 12)
    session = open_session(args, "vflow benchmark: fused gradient accumulation")
    device = session.device

    records: list[dict[str, Any]] = []
    if not args.exact_only:
        records += float_section(
            device,
            rounds=rounds,
            min_run_time=min_run_time,
            gpt2_layers=gpt2_layers,
            quick=args.quick,
        )
    if not args.no_exact:
        sizes = exact_sizes(args.exact_numel, quick=args.quick)
        records += exact_section(device, sizes, rounds=rounds, min_run_time=min_run_time)
    return session.finish(records + headline_records(records))


# ---- Headline records for the suite's summary (vflow/bench/records.py) ----


def headline_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per list and dtype, the fused accumulate against the per-tensor loop with the copy
    bandwidth as the limit; per size and path of the exact table, the exact add against
    the float fold. Raw times and bytes only: the summary computes the ratios."""

    def m(r: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        return measurement(r["times_s"], nbytes=r["bytes"], **kwargs)

    out = []
    copy = next((r for r in records if r["benchmark"] == "copy"), None)
    ok = {
        (r["list"], r["grad_dtype"], r["method"]): r
        for r in records
        if r["benchmark"] == "accumulate" and r["status"] == "ok"
    }
    for (name, dt, method), fused in ok.items():
        loop = ok.get((name, dt, LOOP))
        if method != FUSED or loop is None or copy is None:
            continue
        note = copy_limit_note(f"{COPY_BYTES // 2**20} MB fp32")
        fp32 = dt == "fp32"
        out.append(
            headline(
                "accumulate",
                f"accumulate/{name}/{dt}",
                f"{name} {dt}: fused / " + ("copy GB/s" if fp32 else "per-tensor loop GB/s"),
                vflow=m(fused),
                baseline=m(loop, label=LOOP),
                limit=m(copy, label="copy bandwidth", note=note),
                compare="vflow/limit" if fp32 else "vflow/baseline",
                target=target(">=", TARGET_FP32_COPY_FRACTION if fp32 else TARGET_BF16_SPEEDUP),
                stated_ratio=fused["pct_copy"] / 100 if fp32 else fused["speedup_vs_loop"],
            )
        )
    exact = {(r["size"], r["kernel"], r["path"]): r for r in records if r["benchmark"] == "exact"}
    for (size, kernel, path), add in exact.items():
        fold = exact.get((size, EXACT_FOLD, path))
        if kernel != EXACT_ADD or fold is None:
            continue
        copy_r = exact[(size, EXACT_COPY, None)]
        out.append(
            headline(
                "accumulate",
                f"exact/{size}/{path}",
                f"exact add {size} ({path}): time / float fold",
                vflow=measurement(add["times_s"]),
                baseline=measurement(fold["times_s"], label=EXACT_FOLD),
                limit=m(
                    copy_r,
                    for_bytes=add["bytes"],
                    label="copy bandwidth",
                    note="limit = the time the exact add's bytes take at the copy bandwidth "
                    "of the same size",
                ),
                stated_ratio=add["time_vs_float_fold"],
            )
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
