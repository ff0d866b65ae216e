"""The bad-input probe (scripts/analysis/probe_inputs.py) on a sample of its cases: each ends in a clear error, nothing lost;
and its classification of outcomes, on outcomes made by hand."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("probe_inputs", ROOT / "scripts" / "analysis" / "probe_inputs.py")
probe = importlib.util.module_from_spec(spec)
sys.modules["probe_inputs"] = probe
spec.loader.exec_module(probe)

SAMPLE = ["fill: --actions 99", "train serve: --resume, finished run, no checkpoint", "distill: --top-k 0",
          "scripts.analysis.batched: --out unwritable", "fill: --out a folder"]


@pytest.mark.parametrize("name", SAMPLE)
def test_a_sample_of_the_probe_ends_in_clear_errors(name):
    (case,) = [c for c in probe.CASES if c.name == name]
    env = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}  # the suite's private BILD_ENV_CACHE
    row = probe.run_case(case, env, timeout=240)
    assert row["outcome"] == "clear error" and row["exit"] == 2, row
    assert "error" in row["message"]


@pytest.mark.parametrize("name", ["machine: fill, BILD_ENV_CACHE under a file",
                                  "machine: profile, --out on a full disk"])
def test_faults_of_the_machine_end_in_one_line_and_exit_1(name):
    (case,) = [c for c in probe.CASES if c.name == name]
    if case.disk and probe.private_mounts() is None:
        pytest.skip("no private mount namespace here (unshare --mount): a full disk cannot be made")
    env = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    row = probe.run_case(case, env, timeout=240)
    assert row["outcome"] == "clear error" and row["exit"] == 1, row
    assert "error: " in row["message"] and ("BILD_ENV_CACHE" in row["message"] or "free some space" in row["message"])


def test_a_command_stopped_by_ctrl_c_stops_cleanly_and_leaves_no_lock():
    (case,) = [c for c in probe.CASES if c.name == "stop: fill, SIGINT while filling"]
    env = os.environ | {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    row = probe.run_case(case, env, timeout=240)
    assert row["outcome"] == "clean stop" and row["exit"] == 130, row
    assert row["message"].endswith("stopped by SIGINT before it finished: run the same command again")


def test_outcomes_are_classified_as_the_module_says():
    bad, good = probe.Case("bad", []), probe.Case("good", [], ok=True)
    trace = "Traceback (most recent call last):\n  File ...\nValueError: x"
    assert probe.classify(bad, 2, "prog: error: x", kept=True) == "clear error"
    assert probe.classify(bad, 0, "", kept=True) == "silently wrong"
    assert probe.classify(good, 0, "", kept=True) == "fine"
    assert probe.classify(bad, 1, trace, kept=True) == "traceback"
    assert probe.classify(bad, -9, "", kept=True) == "traceback"
    assert probe.classify(bad, 2, "prog: error: x", kept=False) == "lost"
    assert probe.classify(bad, None, "timed out after 300 s", kept=True) == "stuck"
    stop = probe.Case("stop", [], signal="SIGINT", after="x")
    assert probe.classify(stop, 130, "prog: stopped by SIGINT: ...", kept=True) == "clean stop"
    assert probe.classify(stop, 130, "prog: stopped", kept=True, left=[".ev.json.lock"]) == "silently wrong"
    assert probe.classify(stop, -15, "", kept=True) == "traceback"  # killed by the signal
    assert probe.classify(stop, 0, "", kept=True) == "silently wrong"  # the signal changed nothing
    assert len({c.name for c in probe.CASES}) == len(probe.CASES)  # names pick cases
