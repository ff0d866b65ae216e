"""A killed and resumed run is the uninterrupted run: the same evaluation, checkpoint and TensorBoard steps
(SIGKILL and SIGTERM, at several points), nothing of the discarded branch kept; compact replay buffers.

One uninterrupted run (in this process) and one run killed three times and resumed three times (subprocesses,
as a user's), both of the same seed on tiny-random: a few hundred steps, 4 envs.
"""

from __future__ import annotations

import json
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from agents.bild.runs import latest_checkpoint
from agents.commands import train_main
from agents.bild.runs import Evaluations, checkpoints, discard_after
from agents.common.checkpoints import checkpoint_files
from agents.common.folders import best_model_info, best_snapshot
from agents.common.replay_buffer import read_replay_buffer, save_replay_buffer

ROOT = Path(__file__).resolve().parents[1]
TOTAL = 400
ARGS = ["--pair", "tiny-random", "--max-new-tokens", "16", "--n-envs", "4", "--checkpoint-freq", "80", "--eval-freq", "80",
        "--eval-episodes", "2", "--hyperparams", "learning_starts=40", "batch_size=16", "target_update_interval=40",
        "--seed", "5", "--torch-threads", "1", "--no-progress-bar",
        "--cost-profile", "h200-opt-eager",  # both runs charged alike: timings a busy machine slowed are re-timed
        "--total-timesteps", str(TOTAL)]
# (signal, the checkpoint the run must have completed before it is sent: its state file, written last)
KILLS = [(signal.SIGKILL, 80), (signal.SIGTERM, 160), (signal.SIGKILL, 240)]


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def model_steps(run_dir: Path) -> set[int]:
    """The steps of the run's model checkpoints (all kept; the replay buffers of the newest only)."""
    return {name.steps for _, name in checkpoint_files(run_dir / "checkpoints") if name.prefix == "dqn"
            and name.kind == "model"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_pair):
    log_dir = tmp_path_factory.mktemp("logs")
    assert train_main([*ARGS, "--log-dir", str(log_dir), "--run-name", "whole"]) == 0
    run_dir, outputs, stopped_at = log_dir / "killed", [], []
    command = [sys.executable, "train.py", *ARGS, "--log-dir", str(log_dir), "--run-name", "killed"]
    for sig, after in KILLS:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while not (run_dir / "checkpoints" / f"dqn_state_{after}_steps.json").exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, f"no checkpoint at step {after} after 120 s"
            time.sleep(0.02)
        proc.send_signal(sig)
        outputs.append((sig, proc.communicate(timeout=120)[0], proc.returncode))
        stopped_at.append(latest_checkpoint(run_dir).steps)
        command = [sys.executable, "train.py", "--resume", str(run_dir), "--no-progress-bar", "--torch-threads", "1"]
    last = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    outputs.append((None, last.stdout + last.stderr, last.returncode))
    return {"whole": log_dir / "whole", "killed": run_dir, "outputs": outputs, "stopped_at": stopped_at}


def test_each_kill_stops_the_run_and_each_resume_goes_on_from_its_checkpoint(runs):
    for (sig, out, rc), at in zip(runs["outputs"], [None, *runs["stopped_at"]]):
        if at is not None:
            assert f"resuming at step {at}" in out, out
        if sig == signal.SIGKILL:
            assert rc == -signal.SIGKILL, out
        elif sig == signal.SIGTERM:  # stopped at the next checkpoint boundary, with a checkpoint
            assert rc == 130 and "SIGTERM: stopping at the next checkpoint boundary" in out, out
            assert "interrupted at step" in out and "Traceback" not in out, out
        else:
            assert rc == 0 and f"done at step {TOTAL}" in out, out


def test_the_resumed_run_evaluates_and_checkpoints_at_the_steps_of_the_uninterrupted_one(runs):
    whole, killed = runs["whole"], runs["killed"]
    evaluations = {name: np.load(run / "evaluations.npz") for name, run in (("whole", whole), ("killed", killed))}
    assert evaluations["killed"]["timesteps"].tolist() == evaluations["whole"]["timesteps"].tolist() == list(
        range(80, TOTAL + 1, 80))
    np.testing.assert_allclose(evaluations["killed"]["results"], evaluations["whole"]["results"], rtol=1e-5)
    regular = set(range(80, TOTAL + 1, 80))
    # the SIGTERM's own checkpoint, at the boundary after the signal: one more, unless the signal landed while the
    # checkpoint it waited for (160) was still being written, so that the run stopped at that same regular step
    sigterm_stop = {runs["stopped_at"][1]} - regular
    assert model_steps(killed) - sigterm_stop == model_steps(whole) == regular
    assert best_model_info(killed)["step"] == best_model_info(whole)["step"]


def test_the_resumed_run_has_the_tensorboard_steps_of_the_uninterrupted_one(runs):
    whole, killed = scalars(runs["whole"]), scalars(runs["killed"])
    assert set(killed) == set(whole)
    for tag in whole:
        assert [s for s, _ in killed[tag]] == [s for s, _ in whole[tag]], tag
    for tag in ("eval/mean_reward", "bild/episode_reward", "rollout/exploration_rate", "train/loss"):
        np.testing.assert_allclose([v for _, v in killed[tag]], [v for _, v in whole[tag]], rtol=1e-4, err_msg=tag)


def test_a_resume_discards_the_later_evaluations_and_best_model_of_the_branch_it_throws_away(tmp_path):
    import gymnasium as gym
    from stable_baselines3 import DQN

    model = DQN("MlpPolicy", gym.make("CartPole-v1"), buffer_size=64, learning_starts=0, device="cpu")
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    killed_branch = Evaluations([80, 160, 240], [[1.0, 1.0], [0.5, 0.5], [3.0, 3.0]], [[4, 4]] * 3)
    killed_branch.save(run / "evaluations.npz")
    for steps in (80, 240):  # the best models of steps 80 and 240: the second on the branch a kill threw away
        model.num_timesteps = steps
        model.save(best_snapshot(run, steps))
    (run / "best_model.zip").write_bytes(best_snapshot(run, 240).read_bytes())
    (run / "best_model.json").write_text(json.dumps({"step": 240, "mean_reward": 3.0}))
    (run / "checkpoints" / "dqn_240_steps.zip").write_bytes(b"cut short")
    said = []
    discard_after(run, 160, killed_branch.upto(160), said.append)
    assert Evaluations.read(run / "evaluations.npz").timesteps == [80, 160]
    assert (run / "best_model.zip").read_bytes() == best_snapshot(run, 80).read_bytes()
    assert best_model_info(run)["step"] == 80 and DQN.load(run / "best_model.zip").num_timesteps == 80
    assert not best_snapshot(run, 240).exists() and not (run / "checkpoints" / "dqn_240_steps.zip").exists()
    assert any("written after step 160" in s for s in said) and any("model of step 80 again" in s for s in said)


def test_a_resume_before_the_first_evaluation_keeps_none(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    Evaluations([80], [[1.0]], [[4]]).save(run / "evaluations.npz")  # made after the checkpoint of step 48
    (run / "best_model.zip").write_bytes(b"of step 80")
    discard_after(run, 48, Evaluations(), lambda _: None)
    assert not (run / "evaluations.npz").exists() and not (run / "best_model.zip").exists()
    Evaluations().save(run / "empty.npz")
    assert Evaluations.read(run / "empty.npz") == Evaluations()


# ------------------------------------------------------------------------------------------------
# replay buffers: the filled rows, compressed; SB3's own files still read
@pytest.mark.parametrize("steps", [3, 10])  # part filled; full and wrapped around (capacity 8 rows)
def test_a_replay_buffer_file_holds_the_filled_rows_and_reads_back_whole(tmp_path, steps):
    from gymnasium import spaces
    from stable_baselines3.common.buffers import ReplayBuffer
    from stable_baselines3.common.save_util import save_to_pkl

    rng = np.random.default_rng(0)
    buffer = ReplayBuffer(16, spaces.Box(-1, 1, (7,), np.float32), spaces.Discrete(25), n_envs=2)
    for _ in range(steps):
        buffer.add(rng.random((2, 7), dtype=np.float32), rng.random((2, 7), dtype=np.float32),
                   rng.integers(25, size=(2, 1)), rng.random(2, dtype=np.float32), np.zeros(2), [{}, {}])
    path = tmp_path / "buffer.pkl"
    save_replay_buffer(buffer, path)
    raw = pickle.loads(path.read_bytes())  # a plain pickle of SB3's buffer, with the filled rows only
    filled = buffer.buffer_size if buffer.full else buffer.pos
    assert raw.observations.shape == (filled, 2, 7) and raw.pos == buffer.pos
    back = read_replay_buffer(path)
    for name in ("observations", "next_observations", "actions", "rewards", "dones", "timeouts"):
        assert np.array_equal(getattr(back, name), getattr(buffer, name)), name
    assert (back.pos, back.full) == (buffer.pos, buffer.full)
    save_to_pkl(tmp_path / "sb3.pkl", buffer)  # a checkpoint of an older version: SB3's whole buffer
    assert np.array_equal(read_replay_buffer(tmp_path / "sb3.pkl").observations, buffer.observations)


def test_a_checkpoint_of_an_older_version_still_resumes(tmp_path, tiny_pair):
    from stable_baselines3.common.save_util import save_to_pkl

    args = [*ARGS[:-1], "120", "--log-dir", str(tmp_path), "--run-name", "old"]
    assert train_main(args) == 0
    run = tmp_path / "old"
    newest = checkpoints(run)[0]
    for state in (run / "checkpoints").glob("dqn_state_*_steps.json"):
        state.unlink()  # older versions kept no resume state, said nothing of it in config.json's meta,
    config = json.loads((run / "config.json").read_text())
    del config["meta"]["checkpoints"]
    (run / "config.json").write_text(json.dumps(config))
    save_to_pkl(newest.replay_buffer, read_replay_buffer(newest.replay_buffer))  # and pickled SB3's whole buffer
    assert checkpoints(run)[0].steps == newest.steps and checkpoints(run)[0].state is None
    assert train_main(["--resume", str(tmp_path / "old"), "--total-timesteps", "200", "--no-progress-bar"]) == 0
    assert latest_checkpoint(tmp_path / "old").steps == 200
