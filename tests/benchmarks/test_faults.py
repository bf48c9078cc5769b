"""benchmarks/faults.py's pure parts: its options, the torchrun chain's fault events
(accepted by the chain check it shares with benchmarks/elastic.py), the medians of its
rows and its table. The faults themselves run in tests/elastic/test_faults.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.benchmark_scripts import load_script

faults = load_script("faults")
trb = sys.modules["_torchrun_baseline"]


def test_bad_options_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        faults.main(["--only", "a,z"])
    assert "--only: faults are a, b, c, d, e, f, g, got ['z']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        faults.main(["--runs", "0"])
    assert "--runs must be >= 1" in capsys.readouterr().err


def test_the_torchrun_chain_fires_network_faults_the_shared_check_accepts(
    tmp_path: Path,
) -> None:
    settings = trb.Settings(workers=3, steps=60)
    chain = faults.HostsChain([], settings, tmp_path, machines=None)  # type: ignore[arg-type]
    events = [trb.Event("store-restart", 10), trb.Event("grow", 20), trb.Event("link-down", 30)]
    trb.check_chain(events, settings, chain.size_after, chain.kinds)
    assert [chain.size_after(e.kind, 3) for e in events] == [3, 4, 2]
    with pytest.raises(ValueError, match="unknown event kind 'store-restart'"):
        trb.check_chain(events, settings, chain.size_after)  # torchrun's own chain


def test_rows_are_medians_of_the_runs_and_print_as_a_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    runs = [
        faults.Outcome(detection_s=4.1, back_s=4.6, recomputed=0, lost=0, bitwise=True),
        faults.Outcome(detection_s=4.0, back_s=None, recomputed=0, lost=0, bitwise=True),
        faults.Outcome(detection_s=4.3, back_s=4.8, recomputed=1, lost=0, bitwise=False),
    ]
    row = faults.summarise("vflow", "a", runs)
    assert (row["detection_s"], row["recomputed"]) == (4.1, 0)
    assert row["back_s"] == pytest.approx(4.7)
    assert row["bitwise"] is False  # one run that was not is a "NO"
    faults.print_table([row])
    table = capsys.readouterr().out
    cells = "4.10 (4.00-4.30) | 4.70 (4.60-4.80) | 0 | 0 | NO"
    assert f"a. a host goes silent (link down) | vflow | {cells}" in table
