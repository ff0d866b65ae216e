"""The main job's phases (train.py --env serve): a progress line per phase, the time left, peak memory at the end."""

from __future__ import annotations

import json

import pytest

from agents.phases import Phases, peak_memory_mb


def test_a_phase_says_when_it_starts_how_far_it_is_and_when_it_ends():
    lines = []
    phases = Phases(("load", "work"), say=lines.append, every_s=0.0)
    phases.skip("load", "cached")
    with phases.phase("work", unit="step", total=4) as bar:
        bar.update(1)
        bar.total += 4  # more work found on the way
        bar.update(1)
    assert lines[0] == "[1/2] load: skipped (cached)" and lines[1].startswith("[2/2] work: started")
    assert "1/4 steps" in lines[2] and "left" in lines[2] and "2/8 steps" in lines[3]
    assert lines[-1].startswith("[2/2] work: done in") and "peak memory" in lines[-1]
    summary = phases.summary()
    assert summary["phases"]["work"]["units"] == 2 and summary["phases"]["load"]["skipped"] == "cached"
    assert summary["peak_memory_mb"]["max"] >= summary["peak_memory_mb"]["self"] > 0
    with pytest.raises(ValueError, match="unknown phase"):
        with phases.phase("rest"):
            pass


def test_the_main_job_prints_its_phases_and_writes_their_times_and_peak_memory(tmp_path, monkeypatch, capsys):
    import bild_env.decoding.costs as costs
    from agents.serving_training import PHASES, main
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())  # no timing in a test
    args = ["--pair", "tiny-random", "--total-timesteps", "80", "--n-envs", "2", "--eval-freq", "80",
            "--eval-episodes", "1", "--max-new-tokens", "8", "--max-batch", "4", "--episode-steps", "8",
            "--learning-starts", "20", "--batch-size", "16", "--mix", "prose:1", "--no-progress-bar",
            "--log-dir", str(tmp_path), "--run-name", "r"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for i, name in enumerate(PHASES, 1):
        assert f"train.py: [{i}/{len(PHASES)}] {name}: started" in out
        assert f"train.py: [{i}/{len(PHASES)}] {name}: done in" in out
    assert "peak memory" in out.splitlines()[-1]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert list(summary["phases"]) == list(PHASES) and summary["steps"] == 80
    assert all(p["wall_s"] >= 0 and p["cpu_s"] >= 0 for p in summary["phases"].values())
    assert summary["total_wall_s"] >= sum(p["wall_s"] for p in summary["phases"].values()) - 1
    assert summary["peak_memory_mb"]["max"] > 0 and summary["peak_memory_mb"]["max"] <= peak_memory_mb()["max"]
    assert summary["last_evaluation"]["step"] == 80 and "load_table" in summary["references"]


@pytest.mark.parametrize("dtype, steps", [("float32", 8_000), ("bfloat16", 20_000)])
def test_the_default_run_length_follows_the_dtype(dtype, steps):
    from dataclasses import replace

    from agents.serving_training import TRAIN_ENV, default_timesteps

    assert default_timesteps(replace(TRAIN_ENV, dtype=dtype, device="cpu")) == steps
