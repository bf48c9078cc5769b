"""The demo's progress bar (vflow/demo/progress.py): in a log and on a terminal."""

from __future__ import annotations

import io

from vflow.demo.progress import ProgressBar


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_bar_in_a_log_prints_one_line_per_update() -> None:
    stream = _Stream(tty=False)
    bar = ProgressBar(10, stream)
    bar.start_run("run a")
    bar.update(3)
    bar.update(6)
    bar.end_run()
    bar.start_run("run b")
    bar.update(4)
    bar.end_run()
    bar.finish()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("[0/10 steps, ") and lines[0].endswith("] run a ...")
    assert lines[1].startswith("[6/10 steps, ") and "run a: 6 steps in " in lines[1]
    assert lines[3].startswith("[10/10 steps, ") and "run b: 4 steps in " in lines[3]


def test_progress_bar_on_a_terminal_redraws_one_line() -> None:
    stream = _Stream(tty=True)
    bar = ProgressBar(10, stream)
    bar.start_run("run a")
    bar.update(5)
    bar.end_run()
    bar.finish()
    text = stream.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    last = text.rstrip("\n").split("\r")[-1]
    assert last.startswith("[###############...............]  50% 5/10 steps")
    assert "run a" in last and "s left" in last
