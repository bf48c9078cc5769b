"""README.md and docs/ as a new user reads them: every command the README shows works as
written right after ``make demo`` / ``make test`` from a clean clone, which install
vflow into .venv and not into the system Python, and some test runs it (the registry
below); the README's single-process snippets run as pasted; its links lead somewhere;
every vflow name and every file the docs give exists; and every snippet that calls
``ex.infer`` puts the model in eval mode first."""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

import vflow
from tests.support import plan_follow, several_hosts
from vflow.__main__ import COMMANDS
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


# ---- every README command, and the test that runs it -----------------------------------

# Each shell command README.md shows (comments and a trailing & dropped), and where it
# runs: a test, by path::name, or .ci/run. A command the README shows that is missing here
# fails test_every_readme_command_is_run_somewhere: write or name the test that runs it,
# then add its line. The tests of the elastic, several-machine and cluster lines read them
# from README.md itself; the others' flags are checked here as written
# (test_the_readmes_example_commands_parse_as_written).
_ELASTIC = "tests/elastic/test_train_elastic.py::"
_HOSTS = "tests/elastic/test_several_machines.py::"
_CLUSTER = "tests/cluster/test_cli.py::test_the_readmes_cluster_commands_run_as_written"
_PIPELINES = "tests/elastic/test_pipelines.py::"
_FLAGS = "--job j1 --steps 200 --virtual-nodes 8 --seed 0 --deterministic --out final.pt"
README_COMMANDS: dict[str, str] = {
    "make demo": ".ci/run",
    "make test": ".ci/run",
    ".venv/bin/torchrun --standalone --nproc_per_node=2 examples/train_digits.py": (
        "tests/test_examples.py::test_same_parameters_on_any_number_of_processes"
    ),
    ".venv/bin/python -m vflow rendezvous --port 29400": (
        _ELASTIC + "test_the_readme_lines_grow_crash_and_grow_again_bitwise_as_one_worker"
    ),
    f".venv/bin/python examples/train_elastic.py --rdzv 127.0.0.1:29400 {_FLAGS} --sleep 0.15": (
        _ELASTIC + "test_the_readme_lines_grow_crash_and_grow_again_bitwise_as_one_worker"
    ),
    ".venv/bin/python examples/train_pipeline.py --rdzv 127.0.0.1:29400 --job p1 --stages 2 "
    "--stage 0 --steps 200 --virtual-nodes 8 --seed 0 --deterministic --out final.pt "
    "--sleep 0.15": _PIPELINES
    + "test_replicas_join_crash_come_back_and_leave_bitwise_as_one_process",
    ".venv/bin/python -m vflow rendezvous --host 10.0.0.1 --port 29400": (
        _HOSTS + "test_the_readme_lines_run_as_written_on_two_hosts"
    ),
    f".venv/bin/python examples/train_elastic.py --rdzv 10.0.0.1:29400 {_FLAGS} --sleep 0.1": (
        _HOSTS + "test_the_readme_lines_run_as_written_on_two_hosts"
    ),
    ".venv/bin/python -m vflow cluster generate --seed 0 --out trace.json": _CLUSTER,
    ".venv/bin/python -m vflow cluster simulate --trace trace.json --policy priority "
    "--out priority.json": _CLUSTER,
    ".venv/bin/python -m vflow cluster simulate --trace trace.json --policy wfs "
    "--out wfs.json": _CLUSTER,
}


def _readme_commands() -> list[list[str]]:
    """Every command line of the README's shell blocks, as words, without comments and
    without a trailing ``&``."""
    commands = []
    for block in _blocks(README, "bash"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            commands.append(words[:-1] if words[-1:] == ["&"] else words)
    return [words for words in commands if words]


def test_every_readme_command_is_run_somewhere() -> None:
    shown = {" ".join(words) for words in _readme_commands()}
    assert shown, "the README shows no shell command"
    unregistered = sorted(shown - README_COMMANDS.keys())
    assert not unregistered, (
        f"README commands that no test is known to run (tests/test_readme.py, "
        f"README_COMMANDS): {unregistered}"
    )
    stale = sorted(README_COMMANDS.keys() - shown)
    assert not stale, f"README_COMMANDS lists commands the README no longer shows: {stale}"


@pytest.mark.parametrize("where", sorted(set(README_COMMANDS.values())))
def test_the_tests_that_run_readme_commands_exist(where: str) -> None:
    if where == ".ci/run":
        ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
        makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
        assert "make demo" in ci and re.search(r"^demo:", makefile, re.MULTILINE)
        # .ci/run runs the first "make test" line of README.md (its sed, in Python).
        assert re.search(r"^make test( .*)?$", README, re.MULTILINE), "README: no make test line"
        assert "README.md" in ci and re.search(r"^test:", makefile, re.MULTILINE)
        return
    path, name = where.split("::")
    source = (ROOT / path).read_text(encoding="utf-8")
    assert re.search(rf"^def {name}\(", source, re.MULTILINE), f"{where} is not a test"


def test_the_tests_that_read_readme_lines_are_registered_for_them() -> None:
    """What the README-reading tests take from README.md is what the registry says
    they run."""
    read = {
        _ELASTIC: several_hosts.readme_lines("### Elastic jobs"),
        _HOSTS: several_hosts.readme_lines(),
    }
    for prefix, lines in read.items():
        for words in lines:
            assert README_COMMANDS.get(" ".join(words), "").startswith(prefix), words
    # The pipelines' store line is the elastic jobs' own (registered there).
    _, pipeline = several_hosts.readme_lines("### Elastic pipelines", "examples/train_pipeline.py")
    assert README_COMMANDS.get(" ".join(pipeline), "").startswith(_PIPELINES), pipeline
    cluster = [line.strip() for line in README.splitlines()]
    cluster = [line for line in cluster if line.startswith(".venv/bin/python -m vflow cluster ")]
    assert cluster and all(README_COMMANDS.get(line) == _CLUSTER for line in cluster), cluster


def _example_module(script: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"readme_{Path(script).stem}", ROOT / script)
    assert spec is not None and spec.loader is not None, script
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readmes_example_commands_parse_as_written() -> None:
    """The launchers' flags and each example's flags, as the README writes them, are
    accepted (argparse exits on an unknown flag), and every ``-m vflow`` command exists."""
    from torch.distributed.run import get_args_parser

    examples = 0
    for words in _readme_commands():
        if words[0] == "make":
            continue
        assert words[0] in (".venv/bin/python", ".venv/bin/torchrun"), words
        if words[1:2] == ["-m"]:
            assert words[2] == "vflow" and words[3] in COMMANDS, words
            continue
        script = next(i for i, word in enumerate(words) if word.endswith(".py"))
        world_size = 1
        parse_args = _example_module(words[script]).parse_args
        argv = words[script + 1 :]
        try:  # argparse exits with status 2 on a flag it does not know
            if words[0].endswith("torchrun"):
                launcher = get_args_parser().parse_args([*words[1:script], words[script]])
                world_size = int(launcher.nproc_per_node)
            if "world_size" in parse_args.__code__.co_varnames:
                parse_args(argv, world_size)
            else:
                parse_args(argv)
        except SystemExit as exit_:
            pytest.fail(
                f"README command refused its flags (exit {exit_.code}): {shlex.join(words)}"
            )
        examples += 1
    assert examples >= 2, "the README's example commands"


def test_readme_python_blocks_each_run_somewhere() -> None:
    """The README's python blocks: single-process ones run below as pasted; the one that
    needs a process group is the "Many workers" loop, run on two Gloo ranks below."""
    distributed = [b for b in _blocks(README, "python") if "dist." in b]
    assert distributed == [plan_follow.readme_snippet()]


_SLUG_DROP = re.compile(r"[^\w\- ]")


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings of ``markdown`` (a repeated one gets -1, -2, ...)."""
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", markdown), re.MULTILINE):
        slug = _SLUG_DROP.sub("", heading.strip().lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


@pytest.mark.parametrize("doc", ["README.md", "docs/setup.md", "docs/demo.md"])
def test_the_links_lead_to_a_file_and_a_heading(doc: str) -> None:
    text = (ROOT / doc).read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", text))
    local = [link for link in links if not re.match(r"\w+://", link)]
    assert local, f"{doc} links to nothing"
    broken = []
    for link in local:
        target, _, anchor = link.partition("#")
        path = (ROOT / doc).parent / target if target else ROOT / doc
        if not path.exists():
            broken.append(link)
        elif anchor and anchor not in _anchors(path.read_text(encoding="utf-8")):
            broken.append(link)
    assert not broken, f"{doc}: links to no file or no heading: {broken}"


def test_readme_is_a_five_minute_read() -> None:
    """Issue 34: what vflow is, the set-up, a loop, the capabilities and the limits; the
    rest lives in docs/."""
    lines = README.count("\n")
    assert lines <= 200, f"README.md has {lines} lines: move detail to docs/"
    for heading in ("## Set-up", "## A training loop", "## What vflow does", "## Limits"):
        assert f"\n{heading}\n" in README, heading


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


_RUN_EACH = """
import sys
for number, snippet in enumerate(sys.argv[1:]):
    exec(compile(snippet, f"README python snippet {number}", "exec"), {})
print("ran", len(sys.argv) - 1)
"""


def test_the_readmes_single_process_snippets_run_as_pasted(tmp_path: Path) -> None:
    """Each block on its own, with nothing defined before it, as a reader pastes it."""
    blocks = [b for b in _blocks(README, "python") if "dist." not in b]
    assert blocks, "the README's single-process snippets"
    result = subprocess.run(
        [sys.executable, "-c", _RUN_EACH, *blocks],
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
