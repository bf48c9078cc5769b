"""vflow.save / vflow.load and Executor.state_dict / load_state_dict: exact round
trips, clear errors that change nothing, atomic writes, and checkpoints that move
between numbers of workers."""

from __future__ import annotations

import copy
import errno
import io
import os
import re
import subprocess
import sys
import textwrap
from pathlib import PurePosixPath
from typing import Any

import pytest
import torch
import torch.distributed as dist

import vflow
from tests.support import REPO_ROOT, models
from tests.support.states import assert_same
from vflow.world.launch import run_ranks

V = 8


def _images(steps: int, b: int = 32, seed: int = 40) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for s in range(steps):
        g = torch.Generator().manual_seed(seed + s)
        out.append((torch.randn(b, 2, 5, 5, generator=g), torch.randint(0, 4, (b,), generator=g)))
    return out


OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}


def _executor(
    model_seed: int = 0, seed: int = 3, optimizer: str = "sgd_momentum", **kwargs: Any
) -> vflow.Executor:
    model = models.bn_net(model_seed)
    return vflow.Executor(
        model, OPTIMIZERS[optimizer](model.parameters()), models.mean_ce, V, seed=seed, **kwargs
    )


def _state(ex: vflow.Executor) -> dict[str, Any]:
    """Everything a checkpoint must restore, copied."""
    return {
        "model": {k: v.clone() for k, v in ex.model.state_dict().items()},
        "optimizer": copy.deepcopy(ex.optimizer.state_dict()),
        "step_count": ex.step_count,
        "skipped_steps": ex.skipped_steps,
        "seed": ex.seed,
        "scaler": None if ex.scaler is None else ex.scaler.state_dict(),
    }


def _roundtrip_in_memory(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---- round trips ---------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_resumed_training_equals_uninterrupted_training(tmp_path, optimizer):
    batches = _images(6)
    a = _executor(0, seed=3, optimizer=optimizer)
    for batch in batches[:3]:
        a.step(batch)
    path = tmp_path / "ckpt.pt"
    rng = torch.get_rng_state()
    vflow.save(path, a, extra={"epoch": 2, "rng": rng, "note": ("text", 1.5, None)})

    # A different initialisation and seed: everything must come from the file.
    b = _executor(5, seed=11, optimizer=optimizer)
    extra = vflow.load(path, b)
    assert extra["epoch"] == 2 and extra["note"] == ("text", 1.5, None)
    assert torch.equal(extra["rng"], rng)
    assert (b.step_count, b.skipped_steps, b.seed) == (3, 0, 3)
    assert_same(_state(b), _state(a))

    for batch in batches[3:]:
        want = a.step(batch)
        got = b.step(batch)
        assert got.loss == want.loss and got.step == want.step
    assert_same(_state(b), _state(a))
    assert b.step_count == 6

    raw = torch.load(path, weights_only=True)
    assert set(raw) == {"executor", "extra"}
    state = raw["executor"]
    assert state["format"] == "vflow.executor" and state["version"] == 1
    assert state["virtual_nodes"] == V and state["step_count"] == 3 and state["seed"] == 3
    assert state["deterministic"] is False and state["loss_scaler"] is None
    assert state["written_by"]["world_size"] == 1
    assert state["written_by"]["plan_counts"] == [V]
    a.close()
    b.close()


def test_loss_scaler_and_seed_are_restored(tmp_path):
    model = models.mlp()
    scaler = vflow.LossScaler(init_scale=2.0**10, growth_interval=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    a = vflow.Executor(model, opt, models.mean_ce, 4, seed=21, loss_scale=scaler)
    for s in range(3):
        a.step(models.classification_data(16, seed=s))
    assert scaler.state_dict() == {"scale": 2.0**11, "good_steps": 1}
    vflow.save(tmp_path / "ckpt.pt", a)

    # The scaler's settings belong to the executor; its scale and count to the checkpoint.
    other = models.mlp(seed=1)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    scaled = vflow.LossScaler(growth_interval=2)
    b = vflow.Executor(other, opt, models.mean_ce, 4, seed=0, loss_scale=scaled)
    assert b.scaler.state_dict() != scaler.state_dict()
    assert vflow.load(tmp_path / "ckpt.pt", b) is None
    assert b.scaler.state_dict() == {"scale": 2.0**11, "good_steps": 1}
    assert b.seed == 21 and b.step_count == 3
    got, want = b.step(models.classification_data(16)), a.step(models.classification_data(16))
    assert got.loss_scale == want.loss_scale == 2.0**11
    assert b.scaler.state_dict() == {"scale": 2.0**12, "good_steps": 0}  # grew after 2 steps
    assert_same(_state(b), _state(a))
    a.close()
    b.close()


def test_load_state_dict_in_memory_does_not_share_tensors():
    batches = _images(3)
    a = _executor(0)
    a.step(batches[0])
    b = _executor(5)
    b.load_state_dict(a.state_dict())
    loaded = _state(b)
    a.step(batches[1])  # updates a's momentum buffers in place
    assert_same(_state(b), loaded)
    b.step(batches[1])
    assert_same(_state(b), _state(a))
    a.close()
    b.close()


# ---- bad input: a clear error, nothing changed --------------------------------------------


@pytest.fixture(scope="module")
def good_state() -> dict[str, Any]:
    """A checkpoint state after 3 steps, as a file would give it back."""
    batches = _images(3)
    with _executor(0) as ex:
        for batch in batches:
            ex.step(batch)
        return _roundtrip_in_memory(ex.state_dict())


@pytest.fixture
def target():
    """An executor in another state (1 step from another initialisation)."""
    ex = _executor(5, seed=7)
    ex.step(_images(1, seed=90)[0])
    yield ex
    ex.close()


def _split_groups(state):
    groups = state["optimizer"]["param_groups"]
    first = dict(groups[0], params=groups[0]["params"][:2])
    second = dict(groups[0], params=groups[0]["params"][2:])
    state["optimizer"]["param_groups"] = [first, second]


def _drop_param(state):
    state["optimizer"]["param_groups"][0]["params"].pop()


def _adamw_state(state):
    with _executor(0, optimizer="adamw") as ex:
        state.update(ex.state_dict())


BAD_STATES = {
    "wrong_v": (
        lambda s: s.update(virtual_nodes=4),
        ValueError,
        "written for V=4 virtual nodes, this executor has V=8; V must match "
        "(the number of workers need not)",
    ),
    "no_marker": (lambda s: s.pop("format"), ValueError, "not a vflow executor state"),
    "wrong_marker": (lambda s: s.update(format="torch"), ValueError, "'torch'"),
    "newer_version": (lambda s: s.update(version=2), ValueError, "written by a newer vflow"),
    "version_type": (lambda s: s.update(version="1"), TypeError, "state['version'] must be an int"),
    "missing_key": (lambda s: s.pop("step_count"), ValueError, "lacks the key(s) ['step_count']"),
    "missing_model_key": (
        lambda s: s["model"].pop("1.running_mean"),
        ValueError,
        "missing key(s) '1.running_mean'",
    ),
    "unexpected_model_key": (
        lambda s: s["model"].update({"head.weight": torch.zeros(2)}),
        ValueError,
        "unexpected key(s) 'head.weight'",
    ),
    "wrong_shape": (
        lambda s: s["model"].update({"5.weight": torch.zeros(3, 150)}),
        ValueError,
        "state['model']['5.weight'] has shape (3, 150)",
    ),
    "wrong_dtype": (
        lambda s: s["model"].update({"5.bias": s["model"]["5.bias"].double()}),
        ValueError,
        "dtype torch.float64, the model's has shape (4,) and dtype torch.float32",
    ),
    "not_a_tensor": (
        lambda s: s["model"].update({"5.bias": [0.0] * 4}),
        TypeError,
        "state['model']['5.bias'] must be a tensor",
    ),
    "more_groups": (_split_groups, ValueError, "has 2 parameter group(s), this executor's"),
    "fewer_params": (_drop_param, ValueError, "param_groups'][0] has 4 parameter(s)"),
    "other_optimizer": (_adamw_state, ValueError, "torch.optim.adamw.AdamW"),
    "scaler_not_expected": (
        lambda s: s.update(loss_scaler={"scale": 1.0, "good_steps": 0}),
        ValueError,
        "this executor has no loss scaling",
    ),
    "negative_steps": (lambda s: s.update(step_count=-1), ValueError, "step_count'] must be >= 0"),
    "skipped_over_steps": (lambda s: s.update(skipped_steps=9), ValueError, "skipped_steps"),
    "seed_type": (lambda s: s.update(seed="3"), TypeError, "state['seed'] must be an int"),
}


@pytest.mark.parametrize("case", list(BAD_STATES))
def test_bad_state_raises_and_changes_nothing(target, good_state, case):
    corrupt, error, message = BAD_STATES[case]
    state = copy.deepcopy(good_state)
    corrupt(state)
    before = _state(target)
    with pytest.raises(error) as info:
        target.load_state_dict(state)
    assert message in str(info.value)
    assert_same(_state(target), before)
    # The executor still works, and the unbroken state still loads.
    target.load_state_dict(good_state)
    assert target.step_count == 3


def test_non_dict_state_raises(target):
    before = _state(target)
    with pytest.raises(TypeError, match="executor state must be a dict"):
        target.load_state_dict([1, 2])
    assert_same(_state(target), before)


def test_missing_loss_scaler_state_raises(good_state):
    model = models.bn_net(5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with vflow.Executor(model, opt, models.mean_ce, V, loss_scale=True) as ex:
        before = _state(ex)
        with pytest.raises(ValueError, match=r"'loss_scaler'\] is None \(written without loss"):
            ex.load_state_dict(good_state)
        assert_same(_state(ex), before)


def test_failure_while_applying_rolls_back(target, good_state, monkeypatch):
    real = target.optimizer.load_state_dict
    calls = []

    def fail_once(state):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory, say")
        real(state)

    monkeypatch.setattr(target.optimizer, "load_state_dict", fail_once)
    before = _state(target)
    with pytest.raises(RuntimeError, match="out of memory, say"):
        target.load_state_dict(good_state)
    assert len(calls) == 2  # failed, then the rollback
    assert_same(_state(target), before)  # the model, loaded first, is back as well


def test_bad_files_and_arguments(tmp_path, target):
    before = _state(target)
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        vflow.save(tmp_path / "missing" / "ckpt.pt", target)
    assert not (tmp_path / "missing").exists()
    with pytest.raises(TypeError, match=r"ex must be a vflow.Executor, got Sequential"):
        vflow.save(tmp_path / "ckpt.pt", target.model)
    with pytest.raises(TypeError, match="path must be a str or os.PathLike, got int"):
        vflow.save(3, target)
    with pytest.raises(TypeError, match=r"extra\['gen'\] is a torch._C.Generator"):
        vflow.save(tmp_path / "ckpt.pt", target, extra={"gen": torch.Generator()})
    with pytest.raises(IsADirectoryError, match="is a directory"):
        vflow.save(tmp_path, target)
    assert os.listdir(tmp_path) == []

    missing = tmp_path / "nothing.pt"
    with pytest.raises(FileNotFoundError, match=re.escape(f"no checkpoint at '{missing}'")):
        vflow.load(missing, target)
    with pytest.raises(TypeError, match="ex must be a vflow.Executor, got dict"):
        vflow.load(missing, {})
    torch.save({"model": target.model.state_dict()}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"is not a vflow.save checkpoint.*\['model'\]"):
        vflow.load(tmp_path / "other.pt", target)
    torch.save({"executor": {}, "extra": PurePosixPath("x")}, tmp_path / "unsafe.pt")
    with pytest.raises(ValueError, match="could not read .*unsafe.pt"):
        vflow.load(tmp_path / "unsafe.pt", target)
    (tmp_path / "short.pt").write_bytes(b"PK\x03\x04truncated")
    with pytest.raises(ValueError, match="could not read .*short.pt"):
        vflow.load(tmp_path / "short.pt", target)

    model = models.bn_net(0)
    four = vflow.Executor(model, torch.optim.SGD(model.parameters(), lr=0.1), models.mean_ce, 4)
    vflow.save(tmp_path / "v4.pt", four)
    four.close()
    with pytest.raises(ValueError, match="written for V=4 virtual nodes, this executor has V=8"):
        vflow.load(tmp_path / "v4.pt", target)
    assert_same(_state(target), before)

    target.close()
    with pytest.raises(RuntimeError, match="closed"):
        vflow.save(tmp_path / "closed.pt", target)


# ---- atomicity -----------------------------------------------------------------------


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    batches = _images(2)
    ex = _executor(0)
    ex.step(batches[0])
    vflow.save(path, ex, extra={"n": 1})
    first = _state(ex)
    ex.step(batches[1])

    calls = []

    def fail_midway(obj, f, *args, **kwargs):
        calls.append(f)
        f.write(b"PK\x03\x04" + b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", fail_midway)
    with pytest.raises(OSError, match="No space left"):
        vflow.save(path, ex, extra={"n": 2})
    monkeypatch.undo()
    assert len(calls) == 1 and calls[0].name != str(path)
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # the temporary file is gone
    ex.close()
    with _executor(5) as fresh:
        assert vflow.load(path, fresh) == {"n": 1}
        assert_same(_state(fresh), first)


_CRASH_SCRIPT = textwrap.dedent(
    """
    import os, shutil, sys
    import torch
    import vflow
    from tests.support import models

    torch.set_num_threads(1)
    path = sys.argv[1]
    model = models.bn_net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ex = vflow.Executor(model, opt, models.mean_ce, 8)
    x = torch.randn(16, 2, 5, 5)
    y = torch.randint(0, 4, (16,))
    ex.step((x, y))
    vflow.save(path, ex, extra="first")
    shutil.copyfile(path, path + ".first")
    ex.step((x, y))

    def die_midway(obj, f, *args, **kwargs):
        f.write(b"PK\\x03\\x04" + b"\\0" * 4096)
        f.flush()
        os._exit(1)

    torch.save = die_midway
    vflow.save(path, ex, extra="second")
    """
)


def test_a_crash_mid_write_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH_SCRIPT, str(path)],
        cwd=REPO_ROOT,  # so that `tests` and `vflow` import
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    # The second save died inside its write: its temporary file holds what it wrote.
    strays = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.pt.tmp-")]
    assert len(strays) == 1 and strays[0].stat().st_size == 4100
    assert path.read_bytes() == (tmp_path / "ckpt.pt.first").read_bytes()
    with _executor(5) as fresh:
        assert vflow.load(path, fresh) == "first"
        assert fresh.step_count == 1


# ---- several workers ---------------------------------------------------------------------


def _ranks_save_and_load(
    rank: int, world_size: int, path: str, old_path: str, bad_path: str
) -> dict[str, Any]:
    torch.set_num_threads(1)
    writes = []
    real_save = torch.save

    def counting_save(obj, f, *args, **kwargs):
        writes.append(1)
        return real_save(obj, f, *args, **kwargs)

    torch.save = counting_save
    batches = _images(6)
    ex = _executor(0 if rank == 0 else 5, timeout=30)  # rank 0's parameters are broadcast
    ex.step(batches[0])
    vflow.save(old_path, ex)
    for batch in batches[1:3]:
        ex.step(batch)
    saved = _state(ex)
    vflow.save(path, ex, extra={"epoch": 3, "rank": rank})
    exists = os.path.exists(path)  # every rank returns only once the file is there

    out: dict[str, Any] = {"exists": exists, "saved": saved}
    try:
        vflow.save(bad_path, ex)
    except Exception as e:
        out["save_error"] = f"{type(e).__name__}: {e}"
    out["writes"] = len(writes)

    ex.step(batches[3])
    out["extra"] = vflow.load(path, ex)
    out["reloaded"] = _state(ex)

    ex.step(batches[4])
    before = _state(ex)
    for case, mine in (
        ("missing", path if rank == 0 else path + ".missing"),
        ("stale", path if rank == 0 else old_path),
    ):
        try:
            vflow.load(mine, ex)
        except Exception as e:
            out[f"{case}_error"] = f"{type(e).__name__}: {e}"
        out[f"{case}_unchanged"] = _state(ex)
    out["before"] = before
    ex.step(batches[5])  # the group still works
    dist.barrier()
    ex.close()
    return out


def test_ranks_save_once_and_load_all_or_nothing(tmp_path):
    (tmp_path / "old").mkdir()
    path = str(tmp_path / "ckpt.pt")
    bad_path = str(tmp_path / "missing" / "ckpt.pt")
    results = run_ranks(
        2,
        _ranks_save_and_load,
        path,
        str(tmp_path / "old" / "ckpt.pt"),
        bad_path,
        timeout=180,
        collective_timeout=60,
    )
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt", "old"]
    assert os.listdir(tmp_path / "old") == ["ckpt.pt"]
    r0, r1 = (r.value for r in results)
    assert r0["writes"] == 2 and r1["writes"] == 0  # only rank 0 writes
    assert r0["exists"] and r1["exists"]
    assert_same(r1["saved"], r0["saved"])

    assert r0["save_error"].startswith("FileNotFoundError: vflow.save: the directory")
    assert r1["save_error"] == (
        f"RuntimeError: vflow.save: rank 0 failed to write the checkpoint {bad_path!r} (its "
        "error says why); the file at that path, if any, is unchanged"
    )

    for r in (r0, r1):
        assert r["extra"] == {"epoch": 3, "rank": 0}  # rank 0's extra
        assert_same(r["reloaded"], r["saved"])
        assert_same(r["missing_unchanged"], r["before"])
        assert_same(r["stale_unchanged"], r["before"])
        assert "read a different checkpoint" in r["stale_error"]
    assert r0["missing_error"].startswith("RuntimeError: vflow.load: rank(s) [1] could not load")
    assert r1["missing_error"].startswith("FileNotFoundError: vflow.load: no checkpoint at")
    assert "ValueError: vflow.load: rank(s) [1] read a different" in r0["stale_error"]

    # Written by 2 workers, resumed on 1.
    with _executor(5, seed=0) as single:
        assert vflow.load(path, single) == {"epoch": 3, "rank": 0}
        assert_same(_state(single), r0["saved"])
        state = torch.load(path, weights_only=True)["executor"]
        assert state["written_by"]["world_size"] == 2
        assert state["written_by"]["plan_counts"] == [4, 4]


# ---- acceptance: 4 workers, then 1, equals 1 throughout, bit for bit -------------------------


def _deterministic_executor(model_seed: int, seed: int) -> vflow.Executor:
    model = models.bn_net(model_seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return vflow.Executor(model, opt, models.mean_ce, V, seed=seed, deterministic=True, timeout=60)


def _first_half(rank: int, world_size: int, path: str, batches: list) -> None:
    torch.set_num_threads(1)
    with _deterministic_executor(0, seed=3) as ex:
        for batch in batches:
            ex.step(batch)
        vflow.save(path, ex)


def test_four_workers_then_one_equals_one_throughout(tmp_path):
    batches = _images(10)
    path = str(tmp_path / "ckpt.pt")
    run_ranks(4, _first_half, path, batches[:5], timeout=180, collective_timeout=60)
    written = torch.load(path, weights_only=True)["executor"]
    assert written["deterministic"] is True and written["written_by"]["world_size"] == 4

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _deterministic_executor(5, seed=0) as resumed:
            vflow.load(path, resumed)
            assert resumed.step_count == 5 and resumed.seed == 3
            for batch in batches[5:]:
                resumed.step(batch)
            got = _state(resumed)
        with _deterministic_executor(0, seed=3) as straight:
            for batch in batches:
                straight.step(batch)
            want = _state(straight)
    finally:
        torch.set_num_threads(threads)
    assert_same(got, want)
