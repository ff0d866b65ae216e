"""scripts.analysis.front: the grid-search front (hand-computed cases) and a tiny end-to-end run that trains an agent first."""

from __future__ import annotations

import json

import pytest

from scripts.analysis import front


def test_the_front_keeps_the_points_no_other_beats_on_both_axes():
    points = [(100.0, 0.5), (120.0, 0.1), (110.0, 0.6), (130.0, 0.1), (150.0, 0.0), (90.0, 0.9)]
    assert front.pareto(points) == [5, 0, 1, 4]  # (110, 0.6) and (130, 0.1) are beaten
    line = [points[i] for i in front.pareto(points)]
    assert front.front_latency(line, 0.3) == pytest.approx(110.0)  # halfway between (100, 0.5) and (120, 0.1)
    assert front.front_latency(line, 0.0) == 150.0 and front.front_latency(line, 0.9) == 90.0
    assert front.front_latency(line, 1.5) is None  # lossier than any fixed pair


def test_a_tiny_front_with_an_agent_trained_first(tmp_path, tiny_pair):
    out = tmp_path / "front.json"
    report = front.main(["--pair", "tiny-random", "--prompts", "2", "--max-new-tokens", "8", "--train-weights", "1",
                         "--total-timesteps", "64", "--log-dir", str(tmp_path / "logs"), "--out", str(out)])
    assert len(report["fixed"]) == 25 and report["front"]
    fixed = {p["action"]: p for p in report["fixed"]}
    on_front = [fixed[a] for a in report["front"]]
    for p in on_front:  # no fixed pair beats a front point on both axes
        assert not any(q["latency_ms"] < p["latency_ms"] and q["regret"] < p["regret"] for q in report["fixed"])
    for p in report["fixed"]:  # and every pair off the front is beaten by one on it (or ties it)
        assert p in on_front or any(q["latency_ms"] <= p["latency_ms"] and q["regret"] <= p["regret"] for q in on_front)
    (agent,) = report["agents"]
    assert agent["regret_weight"] == 1.0 and agent["algo"] == "dqn" and agent["latency_ms"] > 0
    assert json.loads(out.read_text())["agents"][0]["model"] == agent["model"]
    assert out.with_suffix(".png").stat().st_size > 0


def test_a_run_whose_config_cannot_be_read_is_named_not_a_traceback(tmp_path):
    import subprocess
    import sys

    damaged = tmp_path / "damaged-run"
    damaged.mkdir()
    (damaged / "model.zip").write_bytes(b"")
    (damaged / "config.json").write_text('{"train": {"algo": ')  # cut short
    out = subprocess.run([sys.executable, "-m", "scripts.analysis.front", "--pair", "tiny-random", "--prompts", "2",
                          "--model", str(damaged), "--out", str(tmp_path / "front.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "scripts.analysis.front:" in out.stderr and str(damaged / "config.json") in out.stderr
