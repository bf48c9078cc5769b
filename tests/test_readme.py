"""README.md and docs/guide.md as a new user reads them: every command the README shows
works as written right after ``make demo`` / ``make test`` from a clean clone, which
install vflow into .venv and not into the system Python; and every snippet that calls
``ex.infer`` puts the model in eval mode first."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
GUIDE = (ROOT / "docs" / "guide.md").read_text(encoding="utf-8")
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
    for fact in ("python3-venv", "downloads the pinned CPU build of PyTorch", "1–3 minutes"):
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
