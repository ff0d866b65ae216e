"""The chaos test of serving training, CI-sized: 50 kills at random moments (checkpoint writes included), each run
resumed, every finished run checked against an uninterrupted one (scripts/analysis/chaos_serving.py)."""

import json
import subprocess
import sys


def test_fifteen_kills_lose_no_run_and_no_progress_row(tmp_path):
    # 15 kills, each drawn from scripts/analysis/chaos_serving.py's KILLS (SIGKILL, SIGTERM, SIGTERM then SIGKILL), every kind
    # checked to have landed; the long probe (200 kills) is results/chaos_serving.json
    out = tmp_path / "chaos.json"
    done = subprocess.run([sys.executable, "-m", "scripts.analysis.chaos_serving", "--kills", "15", "--seed", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["kills"] >= 15 and figures["runs_finished"] >= 1
    assert set(figures["by_signal"]) == {"SIGKILL", "SIGTERM", "SIGTERM+SIGKILL"}
    assert figures["runs_lost"] == 0 and figures["rows_lost"] == 0 and figures["mismatches"] == []
    assert figures["rows_checked"] > 0  # kills landed after checkpoints, so rows were at stake


def test_signals_inside_writes_end_in_the_clean_stop_or_a_kill(tmp_path):
    """Every signal sent the moment a file is being written (a checkpoint, progress.csv, an evaluation): a SIGTERM or
    SIGINT ends in exit 130 with the hint to go on, a SIGKILL after it loses nothing."""
    out = tmp_path / "chaos.json"
    done = subprocess.run([sys.executable, "-m", "scripts.analysis.chaos_serving", "--in-writes", "--damage", "0", "--kills", "12",
                           "--seed", "4", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["kills"] >= 12 and sum(figures["in_writes"].values()) == figures["kills"]
    assert figures["unclean_stops"] == [] and figures["runs_lost"] == 0 and figures["rows_lost"] == 0
    assert figures["mismatches"] == []
