"""README.md and docs/ as a new user reads them: every command the README shows works as
written right after ``make demo`` / ``make test`` from a clean clone, which install
vflow into .venv and not into the system Python; the README's single-process snippets
run; every vflow name and every file the docs give exists; and every snippet that calls
``ex.infer`` puts the model in eval mode first. (The README's torchrun and elastic lines
run in tests/test_examples.py and tests/elastic/test_train_elastic.py.)"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import vflow
from tests.support import plan_follow
from vflow.world.launch import run_ranks

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
GUIDE = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
DOCS = ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]
DOCS += ["benchmarks/README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# Commands that only exist inside .venv after make: shown bare, they fail ("command not
# found", or the system Python without vflow).
VENV_ONLY = re.compile(r"^(python3?|torchrun|pytest|ruff)(\s|$)")
# A command line of a README shell block may start with these.
SHELL_STARTS = ("make ", ".venv/bin/", "source .venv/bin/activate", "benchmarks/", "#")


def _blocks(text: str, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang == language]


def _inline_code(text: str) -> list[str]:
    prose = FENCE.sub("", text)
    return [span.strip() for span in re.findall(r"`([^`\n]+)`", prose)]


def test_readme_shell_commands_run_from_the_venv() -> None:
    lines = [line.strip() for block in _blocks(README, "bash") for line in block.splitlines()]
    assert lines, "the README shows no shell block"
    for line in filter(None, lines):
        assert line.startswith(SHELL_STARTS), f"README shell line needs .venv/bin/: {line}"


def test_readme_inline_commands_run_from_the_venv() -> None:
    spans = _inline_code(README)
    bare = [span for span in spans if VENV_ONLY.match(span)]
    assert not bare, f"README commands that fail after make unless run from .venv: {bare}"
    assert any(span.startswith(".venv/bin/python -m vflow") for span in spans)


def test_readme_says_what_the_first_make_does() -> None:
    text = " ".join(README.split())
    for fact in (
        "python3-venv",
        "downloads the pinned CPU build of PyTorch",
        "printing a line per compiled file",
        "pip install --no-build-isolation .",
    ):
        assert fact in text
    assert "source .venv/bin/activate" in text


def test_the_venv_has_the_commands_the_readme_names() -> None:
    if Path(sys.prefix) != (ROOT / ".venv").resolve():
        pytest.skip("checks the .venv that make creates; this is another environment")
    for command in (".venv/bin/torchrun", ".venv/bin/python"):
        if command in README:
            assert shutil.which(Path(command).name, path=str(ROOT / ".venv" / "bin"))


@pytest.mark.parametrize(("name", "text"), [("README.md", README), ("docs/guide.md", GUIDE)])
def test_infer_snippets_put_the_model_in_eval_mode_first(name: str, text: str) -> None:
    snippets = [b for b in _blocks(text, "python") if "ex.infer(" in b]
    assert snippets, f"{name} has no snippet calling ex.infer"
    for block in snippets:
        before = block[: block.index("ex.infer(")]
        assert "model.eval()" in before, f"{name}: ex.infer without model.eval() before:\n{block}"


# design.md's note on the modules moved in 0.4 gives two old paths as examples.
_DOCUMENTED_OLD_PATHS = {"vflow.plan", "vflow.checkpoint"}


def _resolve(dotted: str) -> bool:
    """Whether ``dotted`` (vflow.x.y.Z) names an importable module or an attribute."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # the old paths named
                obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS)
def test_every_vflow_name_the_docs_give_resolves(doc: str) -> None:
    text = (ROOT / doc).read_text(encoding="utf-8")
    # Not after a dot or a slash: torch.ops.vflow.x names an operator, vflow/x a path.
    names = set(re.findall(r"(?<![\w./])vflow(?:\.[A-Za-z_]\w*)+", text))
    assert names, f"{doc} names nothing of vflow"
    moved = sorted(
        name
        for name in names - _DOCUMENTED_OLD_PATHS
        if any(name == old or name.startswith(old + ".") for old in vflow.MOVED_MODULES)
    )
    assert not moved, f"{doc} names modules by their paths from before 0.4: {moved}"
    missing = sorted(name for name in names if not _resolve(name))
    assert not missing, f"{doc} names what vflow does not have: {missing}"


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_the_docs_name_exists(doc: str) -> None:
    text = (ROOT / doc).read_text(encoding="utf-8")
    # A path into the checkout: a file with an extension, or a folder written with its /.
    paths = re.findall(
        r"(?<![\w./-])((?:vflow|tests|benchmarks|csrc|examples|docs|\.ci)/[\w./-]*"
        r"(?:\.\w+|/))(?![\w*])",
        text,
    )
    missing = sorted({p for p in paths if not (ROOT / p).exists()})
    assert not missing, f"{doc} names files that are not there: {missing}"


# The names the README's snippets assume: a model, its optimizer, a loss, a loader of
# global batches, test inputs, an epoch. Each snippet runs on its own, as a reader would
# paste it; those that need a process group (torchrun, a rendezvous store) run in the
# examples' tests instead.
_PRELUDE = """
import torch
import vflow
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = lambda model, batch: torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
loader = [(torch.randn(48, 8), torch.randint(0, 4, (48,))) for _ in range(3)]
dataset = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randint(0, 4, (96,)))
B = 48
x_test = torch.randn(10, 8)
epoch = 0
"""
_RUN_EACH = """
import sys
import warnings
for number, snippet in enumerate(sys.argv[1:]):
    exec(compile(PRELUDE + snippet, f"README python snippet {number}", "exec"), {})
print("ran", len(sys.argv) - 1)
"""


def test_the_readmes_single_process_snippets_run(tmp_path: Path) -> None:
    blocks = [b for b in _blocks(README, "python") if "dist." not in b and "ElasticJob" not in b]
    assert len(blocks) >= 3, "the README's single-process snippets"
    result = subprocess.run(
        [sys.executable, "-c", f"PRELUDE = {_PRELUDE!r}\n{_RUN_EACH}", *blocks],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(f"ran {len(blocks)}")
    assert (tmp_path / "ckpt.pt").exists()


# ---- the README's "Many workers" loop, as written, on two Gloo ranks ------------------


def _run_readme_loop(world_size: int, snippet: str) -> list[dict]:
    results = run_ranks(
        world_size, plan_follow.readme_rank, snippet, 2.0, timeout=90, collective_timeout=60
    )
    return [r.value for r in results]


@pytest.mark.alone  # its planner's decisions read step times
def test_the_readme_many_workers_loop_follows_automatic_plans() -> None:
    """Acceptance (issue 20): with plan="auto" the loop re-plans on its own and the
    sampler follows, so every sample of every global batch is used exactly once."""
    snippet = plan_follow.readme_snippet()
    assert 'plan="auto"' in snippet and "executor=ex" in snippet
    ranks = _run_readme_loop(2, snippet)
    steps = ranks[0]["steps"]
    assert steps == 2 * plan_follow.SAMPLES // plan_follow.B  # ran to the end of 2 epochs
    assert ranks[0]["history"], "the automatic planner never re-planned"
    assert ranks[1]["history"] == ranks[0]["history"]
    parts = [plan_follow.served_by_step(r, 2, ranks[r]) for r in range(2)]
    plan_follow.assert_each_sample_once(parts, steps)


@pytest.mark.alone  # its planner's decisions read step times
def test_the_readme_many_workers_loop_is_bitwise_one_process_in_deterministic_mode() -> None:
    snippet = plan_follow.readme_snippet()
    assert snippet.count('plan="auto"') == 1
    snippet = snippet.replace('plan="auto"', 'plan="auto", deterministic=True')
    ranks = _run_readme_loop(2, snippet)
    (alone,) = _run_readme_loop(1, snippet)
    assert ranks[0]["history"], "the automatic planner never re-planned"
    parts = [plan_follow.served_by_step(r, 2, ranks[r]) for r in range(2)]
    plan_follow.assert_each_sample_once(parts, ranks[0]["steps"])
    assert alone["steps"] == ranks[0]["steps"]
    for rank in ranks:
        for got, want in zip(rank["params"], alone["params"], strict=True):
            assert torch.equal(got, want)
