"""train.py --env serve: checkpoints written as one unit, resumes past torn ones, logs that continue, no stuck
folders, signals that stop with a checkpoint (issue: serving runs that survive kills and bad input)."""

import csv
import json
import os
import signal
import subprocess
import sys

import pytest

ARGS = ["--pair", "tiny-random", "--n-envs", "2", "--eval-freq", "120", "--eval-episodes", "2", "--max-new-tokens", "8",
        "--max-batch", "4", "--episode-steps", "12", "--hyperparams", "learning_starts=40", "batch_size=16", "--mix", "prose:1",
        "--no-progress-bar", "--checkpoint-freq", "100"]


@pytest.fixture
def toy_costs(monkeypatch):
    import bild_env.decoding.costs as costs
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())  # no timing in a test


def run(tmp_path, *extra, total=240, name="r"):
    from tests.test_serving import train_serve as main

    return main(ARGS + ["--total-timesteps", str(total), "--log-dir", str(tmp_path), "--run-name", name, *extra])


def resume(tmp_path, *extra, name="r"):
    from tests.test_serving import train_serve as main

    return main(["--resume", str(tmp_path / name), "--no-progress-bar", *extra])


def progress(run_dir):
    with open(run_dir / "progress.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return [(int(float(r["time/total_timesteps"])), bool(r["eval/mean_reward"])) for r in rows]


def signal_at(monkeypatch, steps, signum=signal.SIGINT):
    """Send ``signum`` to this process once, from inside training, at the first step at or past ``steps``."""
    from agents.serve import training as serving_training

    real, pending = serving_training.EpisodeMetrics._on_step, [steps]

    def on_step(self):
        if pending and self.num_timesteps >= pending[0]:
            pending.clear()
            os.kill(os.getpid(), signum)
        return real(self)

    monkeypatch.setattr(serving_training.EpisodeMetrics, "_on_step", on_step)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_at_a_rollout_boundary_with_a_checkpoint_and_resume_goes_on_as_uninterrupted(
        signum, tmp_path, monkeypatch, toy_costs, capsys, signals_not_ignored):
    from agents.serve import runs as serving_runs

    assert run(tmp_path, name="whole") == 0
    whole = tmp_path / "whole"
    signal_at(monkeypatch, 130, signum)
    assert run(tmp_path) == 130  # stopped: non-zero, after a checkpoint
    err = capsys.readouterr().err
    hint = f"python train.py --resume {tmp_path / 'r'}"
    assert hint in err  # a hint that works as printed
    assert [c.steps for c in serving_runs.complete_checkpoints(tmp_path / "r")] == [132, 100]  # 132: the next rollout start
    before = progress(tmp_path / "r")
    monkeypatch.undo()
    import bild_env.decoding.costs as costs
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())
    assert resume(tmp_path) == 0
    after = progress(tmp_path / "r")
    assert after[: len(before)] == before  # every row before the stop kept
    assert [s for s, _ in after] == sorted(s for s, _ in after)  # in order, no step logged twice by the resume
    # the evaluations and checkpoints fall at the uninterrupted run's steps
    steps = [h["step"] for h in json.loads((tmp_path / "r" / "evaluations.json").read_text())]
    assert steps == [h["step"] for h in json.loads((whole / "evaluations.json").read_text())] == [120, 240]
    assert [s for s, e in after if e] == [s for s, e in progress(whole) if e] == [120, 240]
    assert serving_runs.complete_checkpoints(tmp_path / "r")[0].steps == 240
    names = sorted(p.name for p in (tmp_path / "r" / "checkpoints").glob("dqn_*_steps.zip"))
    assert names == sorted([p.name for p in (whole / "checkpoints").glob("dqn_*_steps.zip")] + ["dqn_132_steps.zip"])


def test_a_finished_run_without_its_newest_state_resumes_from_the_previous_checkpoint(tmp_path, toy_costs, capsys):
    from agents.serve import runs as serving_runs

    assert run(tmp_path) == 0
    r = tmp_path / "r"
    assert [c.steps for c in serving_runs.complete_checkpoints(r)] == [240, 200]  # the last two kept whole
    assert not (r / "checkpoints" / "dqn_replay_buffer_100_steps.pkl").exists()  # older ones pruned after
    before = progress(r)
    (r / "checkpoints" / "serving_state_240_steps.json").unlink()
    capsys.readouterr()
    assert resume(tmp_path, "--total-timesteps", "280") == 0
    out = capsys.readouterr().out
    assert "resuming at step 200: " in out
    after = progress(r)
    assert after[: len([x for x in before if x[0] <= 200])] == [x for x in before if x[0] <= 200]
    assert [s for s, e in after if e] == [120, 240, 280]
    assert sorted({s for s, e in after if not e}) == sorted(s for s, e in after if not e)  # no duplicate step rows
    state = (r / "checkpoints" / "serving_state_280_steps.json").read_text()
    json.loads(state, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_resume_falls_back_past_a_torn_checkpoint_and_says_why(tmp_path, toy_costs, capsys):
    assert run(tmp_path) == 0
    model = tmp_path / "r" / "checkpoints" / "dqn_240_steps.zip"
    model.write_bytes(model.read_bytes()[:200])  # cut short, as a disk full or a copy interrupted leaves it
    capsys.readouterr()
    assert resume(tmp_path, "--total-timesteps", "260") == 0
    out = capsys.readouterr().out
    assert "skipping the checkpoint at step 240" in out and "dqn_240_steps.zip" in out
    assert "resuming at step 200: " in out
    best = json.loads((tmp_path / "r" / "best_model.json").read_text())
    assert best["step"] in (120, 240, 260)


def test_a_run_killed_before_its_first_checkpoint_starts_again_in_place(tmp_path, toy_costs, capsys):
    r = tmp_path / "r"
    r.mkdir()
    (r / "config.json").write_text(json.dumps({"env_id": "BiLD-Serve-v0", "format": 2, "train": {}, "env": {}}))
    (r / "progress.csv").write_text("a,b\n1,2\n")
    (r / "model.zip.tmp-99999").write_bytes(b"x")  # a stale temporary file of a killed process
    assert run(tmp_path, total=120) == 0
    assert "starting it again in place" in capsys.readouterr().out
    assert not (r / "model.zip.tmp-99999").exists()
    assert (r / "set_aside" / "1" / "progress.csv").read_text() == "a,b\n1,2\n"  # the earlier attempt's log, kept
    assert [s for s, e in progress(r) if e] == [120]
    assert run(tmp_path, total=120) == 2  # now it has a checkpoint: a new start is refused, --resume named
    assert "--resume" in capsys.readouterr().err
    # --resume of a run without a complete checkpoint starts it again with its saved options; what it wrote is kept
    for p in (r / "checkpoints").glob("serving_state_*"):
        p.unlink()
    (r / "model.zip").unlink()  # not finished: a finished run is refused (test_run_folders_kept)
    kept = {name: (r / name).read_bytes() for name in ("best_model.zip", "progress.csv", "evaluations.json")}
    assert resume(tmp_path) == 0
    out = capsys.readouterr().out
    assert "starting it again from step 0" in out and "set_aside/2" in out
    assert {name: (r / "set_aside" / "2" / name).read_bytes() for name in kept} == kept
    assert (r / "set_aside" / "2" / "checkpoints" / "dqn_120_steps.zip").is_file()


@pytest.mark.parametrize("bad, says", [(["--run-name", "../escape"], "--run-name"),
                                        (["--run-name", "a/b"], "--run-name"),
                                        (["--actions", "space=continuous"], "Discrete"),
                                        (["--eval-episodes", "0"], "--eval-episodes")])
def test_serving_training_refuses_before_loading(bad, says, tmp_path):
    log = tmp_path / "logs"
    out = subprocess.run([sys.executable, "train.py", "--env", "serve", "--pair", "tiny-random", "--log-dir", str(log),
                          *bad], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "escape").exists()  # nothing written outside --log-dir
    assert not log.exists() or not any(log.iterdir())  # nor inside it


def test_resuming_a_bild_v1_run_as_a_serving_run_is_refused_by_name(tmp_path):
    run_dir = tmp_path / "v1"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"train": {}, "dqn": {}, "env": {"dataset": "wiki"}}))
    out = subprocess.run([sys.executable, "train.py", "--env", "serve", "--resume", "--run-name", "v1", "--log-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "BiLD-v1 run" in out.stderr and "Traceback" not in out.stderr


def test_progress_csv_keeps_rows_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    from agents.common.logs import ResumableCSV, progress_rows

    path = tmp_path / "progress.csv"
    path.write_text("time/total_timesteps,x\n10,a\n20,b\n30,c\n40,d")  # the last line torn by a kill
    header, rows = progress_rows(path, upto=20)
    assert header == ["time/total_timesteps", "x"] and rows == [["10", "a"], ["20", "b"]]
    assert progress_rows(path)[1] == [["10", "a"], ["20", "b"], ["30", "c"]]
    out = ResumableCSV(path, header, rows)
    out.write({"time/total_timesteps": 30, "y": 1.5}, {})  # a new column: the file rewritten whole, earlier rows padded
    out.close()
    assert path.read_text() == "time/total_timesteps,x,y\n10,a,\n20,b,\n30,,1.5\n"
