"""Checkpoints written per stage with torch.distributed.checkpoint (Note [Checkpoints
per stage], vflow/pipeline/checkpoint.py), of the example's model
(vflow.demo.make_pipeline_model): between stages=1 on one process and 2 stages on 2
processes, both ways, training resumed from either ends bitwise where the uninterrupted
single-process run ends; on 4 Gloo processes, one written by 2
replicas x 2 stages resumes on 1 x 2 and on one process bitwise where the uninterrupted
single-process run ends, and its files show that no process wrote another stage's
tensors; a file of the earlier single-file format still loads; a checkpoint of another
model or V is refused by every process alike with nothing changed; a write that fails
anywhere raises everywhere and leaves the previous checkpoint in place. One spawn per
test: starting processes dominates the cost."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import vflow
from vflow.demo import make_pipeline_model
from vflow.pipeline import ProcessGrid
from vflow.world.launch import run_ranks

if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with Gloo", allow_module_level=True)

pytestmark = pytest.mark.slow

V = 4
B = 16
STEPS = 4
SAVED_AT = 2


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (torch.rand(B, 1, 8, 8, generator=g), torch.randint(0, 10, (B,), generator=g))
        for _ in range(STEPS)
    ]


def _executor(
    stages: int,
    grid: ProcessGrid | None,
    model_seed: int,
    *,
    blocks: int = 4,
    virtual_nodes: int = V,
) -> vflow.PipelineExecutor:
    return vflow.PipelineExecutor(
        make_pipeline_model(model_seed, width=32, blocks=blocks),
        lambda params: torch.optim.AdamW(params, lr=1e-2),
        lambda output, target: F.cross_entropy(output, target),
        virtual_nodes,
        seed=4,
        pipeline=vflow.Pipeline(stages),
        grid=grid,
        deterministic=True,
        timeout=60,
    )


def _train(ex: vflow.PipelineExecutor, steps: range) -> None:
    batches = _batches()
    for step in steps:
        ex.step(*batches[step])


def _finish(ex: vflow.PipelineExecutor) -> dict[str, Any]:
    state = ex.full_state_dict()
    ex.close()
    return state


def _alone(fn: Any, *args: Any) -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the ranks: bitwise results need the same count
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def _assert_equal(got: dict[str, Any], want: dict[str, Any], where: str) -> None:
    assert got["step_count"] == want["step_count"] == STEPS, where
    assert list(got["model"]) == list(want["model"]), where
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), f"{where}: model[{key}]"
    assert list(got["optimizer"]["state"]) == list(want["optimizer"]["state"]), where
    for name, entries in want["optimizer"]["state"].items():
        assert list(got["optimizer"]["state"][name]) == list(entries), f"{where}: {name}"
        for key, value in entries.items():
            assert torch.equal(got["optimizer"]["state"][name][key], value), f"{where}: {name}"
    # The groups are the stages' own; each parameter's hyperparameters are the same.
    assert _hyper_by_name(got) == _hyper_by_name(want), where


def _hyper_by_name(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: {k: v for k, v in group.items() if k != "params"}
        for group in state["optimizer"]["param_groups"]
        for name in group["params"]
    }


def _uninterrupted() -> dict[str, Any]:
    ex = _executor(1, None, model_seed=0)
    _train(ex, range(STEPS))
    return _finish(ex)


# ---- between one process and 2 stages, both ways -------------------------------------


def _two_stages(rank: int, world_size: int, resume_from: str, save_to: str) -> dict[str, Any]:
    grid = ProcessGrid.of(2)
    resumed = _executor(2, grid, model_seed=8)
    vflow.pipeline.load(resume_from, resumed)
    _train(resumed, range(SAVED_AT, STEPS))
    state = resumed.full_state_dict()
    resumed.close()
    fresh = _executor(2, ProcessGrid.of(2), model_seed=0)
    _train(fresh, range(SAVED_AT))
    vflow.pipeline.save(save_to, fresh)
    fresh.close()
    return state


def _one_stage_until_saved(path: str) -> dict[str, Any]:
    ex = _executor(1, None, model_seed=0)
    _train(ex, range(SAVED_AT))
    vflow.pipeline.save(path, ex)
    _train(ex, range(SAVED_AT, STEPS))
    state = ex.full_state_dict()
    ex.close()
    return state


def _one_stage_resumed(path: str) -> dict[str, Any]:
    ex = _executor(1, None, model_seed=9)
    vflow.pipeline.load(path, ex)
    _train(ex, range(SAVED_AT, STEPS))
    state = ex.full_state_dict()
    ex.close()
    return state


def test_checkpoints_move_between_one_and_two_stages(tmp_path: Path) -> None:
    one_stage, two_stages = str(tmp_path / "one.pt"), str(tmp_path / "two.pt")
    want = _alone(_one_stage_until_saved, one_stage)
    results = [r.value for r in run_ranks(2, _two_stages, one_stage, two_stages, timeout=180)]
    for rank, got in enumerate(results):
        _assert_equal(got, want, f"1 stage -> 2 stages, rank {rank}")
    _assert_equal(_alone(_one_stage_resumed, two_stages), want, "2 stages -> 1 stage")


# ---- a checkpoint of 2 x 2 on 1 x 2 and on one process --------------------------------


def _save_on_2x2_resume_on_1x2(
    rank: int, world_size: int, path: str, old_format: str
) -> dict[str, Any]:
    ex = _executor(2, ProcessGrid.of(2), model_seed=0)
    _train(ex, range(SAVED_AT))
    vflow.pipeline.save(path, ex)
    segments = ex.stage_segments
    ex.close()
    # Two grids of one replica of two stages, each a collective of every process, each
    # resuming from other weights: processes 2 and 3 from the checkpoint just written,
    # processes 0 and 1 from a file of the earlier single-file format.
    pairs = [ProcessGrid.of(2, [0, 1]), ProcessGrid.of(2, [2, 3])]
    pair = pairs[rank // 2]
    ex = _executor(2, pair, model_seed=8)
    vflow.pipeline.load(old_format if rank < 2 else path, ex)
    assert ex.step_count == SAVED_AT
    _train(ex, range(SAVED_AT, STEPS))
    return {"segments": segments, "resumed": _finish(ex)}


def _old_format_at_saved_step(path: str) -> None:
    """What vflow.pipeline.save wrote before it wrote per stage: the gathered state in
    one torch.save file."""
    ex = _executor(1, None, model_seed=0)
    _train(ex, range(SAVED_AT))
    torch.save(ex.full_state_dict(), path)
    ex.close()


def _one_process_resumed(path: str) -> dict[str, Any]:
    ex = _executor(1, None, model_seed=9)
    vflow.pipeline.load(path, ex)
    assert ex.step_count == SAVED_AT
    _train(ex, range(SAVED_AT, STEPS))
    return _finish(ex)


def _segment_of(key: str) -> str | None:
    """The segment a DCP key of vflow.pipeline.save belongs to; None for the keys of
    the whole job (the header, the registered objects)."""
    for prefix in ("model.", "optimizer.param.", "optimizer.state."):
        if key.startswith(prefix):
            return key[len(prefix) :].split(".", 1)[0]
    return None


def _assert_written_per_stage(path: str, segments_of_rank: list[list[str]]) -> None:
    """Every entry of every process's file is of that process's stage, and every
    process wrote some (the replicas of a stage share its keys)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    stage_of_segment = {s: rank % 2 for rank in (0, 1) for s in segments_of_rank[rank]}
    assert len(stage_of_segment) == 6  # embed, block0..block3, head
    written: dict[int, int] = defaultdict(int)
    ends: dict[str, int] = defaultdict(int)
    keys = set()
    for index, where in metadata.storage_data.items():
        keys.add(index.fqn)
        name = where.relative_path
        rank = int(name.split("_")[2])  # "__<rank>_0.distcp"
        segment = _segment_of(index.fqn)
        if segment is not None:
            assert stage_of_segment[segment] == rank % 2, f"process {rank} wrote {index.fqn}"
        if index.fqn == "registered":
            assert rank % 2 == 0, "the registered objects are stage 0's"
        written[rank] += where.length
        ends[name] = max(ends[name], where.offset + where.length)
    # Each key once (the replicas' duplicates were dropped), every process wrote.
    assert keys == set(metadata.state_dict_metadata)
    assert sorted(written) == [0, 1, 2, 3] and all(n > 0 for n in written.values())
    # Nothing in the files but what the metadata places there.
    real = os.path.realpath(path)
    for name, end in ends.items():
        assert os.path.getsize(os.path.join(real, name)) == end, name
    assert sorted(os.listdir(real)) == [".metadata", *sorted(ends)]


def test_a_checkpoint_of_2x2_resumes_on_1x2_and_on_one_process(tmp_path: Path) -> None:
    path = str(tmp_path / "step2.pt")  # a directory (a link to one) named like a file
    old_format = str(tmp_path / "old_format.pt")
    _alone(_old_format_at_saved_step, old_format)
    results = [
        r.value for r in run_ranks(4, _save_on_2x2_resume_on_1x2, path, old_format, timeout=240)
    ]
    want = _alone(_uninterrupted)
    for rank in (0, 1):
        _assert_equal(results[rank]["resumed"], want, f"a single file on 1x2, rank {rank}")
    for rank in (2, 3):
        _assert_equal(results[rank]["resumed"], want, f"2x2's checkpoint on 1x2, rank {rank}")
    _assert_equal(_alone(_one_process_resumed, path), want, "2x2's checkpoint on one process")
    _assert_written_per_stage(path, [r["segments"] for r in results])
    # The checkpoint, the link to it and the single file: nothing of the save is left.
    assert os.path.islink(path) and len(os.listdir(tmp_path)) == 3


# ---- refusals and failed writes, on every process alike -------------------------------


class _Unpicklable:
    """A registered object that stage 0 cannot write: a save fails inside DCP, on
    whichever of stage 0's processes DCP gives its entry."""

    def __init__(self, stage: int) -> None:
        self.stage = stage

    def state_dict(self) -> dict[str, Any]:
        return {"f": (lambda: 0) if self.stage == 0 else 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class _Picky:
    """A registered object that stage 1 cannot load: stage 1's processes fail after
    every check passed, and stage 0's, which loaded, must put their stage back."""

    def __init__(self, stage: int) -> None:
        self.stage = stage

    def state_dict(self) -> dict[str, Any]:
        return {"n": 1}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.stage == 1:
            raise RuntimeError("stage 1 cannot load this")


def _stage_copy(ex: vflow.PipelineExecutor) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in ex.stage_module.state_dict().items()},
        "optimizer": {
            (id(p), k): v.clone() for p, s in ex.optimizer.state.items() for k, v in s.items()
        },
        "step_count": ex.step_count,
        "seed": ex.seed,
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["step_count"] == b["step_count"]
        and a["seed"] == b["seed"]
        and a["model"].keys() == b["model"].keys()
        and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        and a["optimizer"].keys() == b["optimizer"].keys()
        and all(torch.equal(a["optimizer"][k], b["optimizer"][k]) for k in a["optimizer"])
    )


def _refused_and_failed(rank: int, world_size: int, paths: dict[str, str]) -> dict[str, Any]:
    ex = _executor(2, ProcessGrid.of(2), model_seed=0)
    _train(ex, range(1))
    before = _stage_copy(ex)
    out: dict[str, Any] = {}
    for name in ("other_model", "other_v"):
        with pytest.raises(ValueError) as caught:
            vflow.pipeline.load(paths[name], ex)
        out[name] = str(caught.value)
        out[f"{name} changed nothing"] = _same(before, _stage_copy(ex))
    for name in ("no_parent", "a_file"):
        with pytest.raises(OSError) as caught:
            vflow.pipeline.save(paths[name], ex)
        out[name] = f"{type(caught.value).__name__}: {caught.value}"
    ex.register_state("picky", _Picky(ex.grid.stage))
    vflow.pipeline.save(paths["good"], ex)
    out["good"] = os.readlink(paths["good"])
    _train(ex, range(1, 2))
    before = _stage_copy(ex)
    with pytest.raises(RuntimeError) as caught:
        vflow.pipeline.load(paths["good"], ex)
    out["failed_load"] = str(caught.value)
    out["failed_load changed nothing"] = _same(before, _stage_copy(ex))
    ex.register_state("unpicklable", _Unpicklable(ex.grid.stage))
    with pytest.raises(OSError) as caught:
        vflow.pipeline.save(paths["good"], ex)
    out["inside_dcp"] = str(caught.value)
    ex.close()
    return out


def _write_other(path: str, blocks: int, virtual_nodes: int) -> None:
    ex = _executor(1, None, model_seed=1, blocks=blocks, virtual_nodes=virtual_nodes)
    vflow.pipeline.save(path, ex)
    ex.close()


def test_other_models_are_refused_and_failed_writes_raise_on_every_process(
    tmp_path: Path,
) -> None:
    paths = {
        "other_model": str(tmp_path / "five_blocks"),  # a segment this model lacks
        "other_v": str(tmp_path / "v2"),
        "no_parent": str(tmp_path / "missing" / "ckpt"),
        "a_file": str(tmp_path / "a_file"),
        "good": str(tmp_path / "good"),
    }
    _write_other(paths["other_model"], blocks=5, virtual_nodes=V)
    _write_other(paths["other_v"], blocks=4, virtual_nodes=2)
    Path(paths["a_file"]).write_bytes(b"not a checkpoint directory")
    results = [r.value for r in run_ranks(4, _refused_and_failed, paths, timeout=240)]

    for name, needle in (
        ("other_model", "entries of no segment of this model, ['block4."),
        ("other_v", "written for V=2 virtual nodes, this executor has V=4"),
    ):
        # Checked against the whole model, so every process says the same.
        assert all(r[name] == results[0][name] for r in results), name
        assert needle in results[0][name], results[0][name]
        assert all(r[f"{name} changed nothing"] for r in results), name
    # The first process fails to write; the others say so.
    for name, error in (("no_parent", "FileNotFoundError"), ("a_file", "FileExistsError")):
        assert results[0][name].startswith(error), results[0][name]
        for r in results[1:]:
            assert r[name].startswith("OSError: vflow.pipeline.save: process(es) [0] "), r[name]
    assert Path(paths["a_file"]).read_bytes() == b"not a checkpoint directory"
    # A load that passes every check and still fails on stage 1's processes: stage 0's
    # put back what they had loaded, and every process raises.
    for rank, r in enumerate(results):
        assert r["failed_load changed nothing"], rank
        assert r["failed_load"] == (
            "stage 1 cannot load this"
            if rank % 2
            else f"vflow.pipeline.load: process(es) [1, 3] of the grid could not load "
            f"{paths['good']!r} (their own errors say why); no process loaded it, this one's "
            "stage is unchanged"
        ), r["failed_load"]
    assert not os.path.exists(paths["no_parent"])
    # A failure inside DCP's write, on one of stage 0's processes: every process raises,
    # and the previous checkpoint stays where it was, whole.
    for r in results:
        assert "vflow.pipeline.save: writing" in r["inside_dcp"], r["inside_dcp"]
        assert "PicklingError" in r["inside_dcp"] or "pickle" in r["inside_dcp"], r["inside_dcp"]
    assert os.readlink(paths["good"]) == results[0]["good"]
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".good.")]
    assert leftovers == [results[0]["good"]], leftovers
    ex = _executor(1, None, model_seed=9)
    ex.register_state("picky", _Picky(0))
    vflow.pipeline.load(paths["good"], ex)
    assert ex.step_count == 1
    ex.close()
