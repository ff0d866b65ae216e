"""The trainer itself (``agents.training``), on a room of one's own: CartPole with SB3's DQN, no model of ours. What
``train`` promises any env: a run stops at a checkpoint boundary on a signal (no ``model.zip``), goes on from that
checkpoint to its total, writes its end again when resumed at its total, and keeps its folder to one process."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from stable_baselines3 import DQN
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env

from agents.common import checkpoints as cps
from agents.common.lock import RunInUse, RunLock
from agents.common.replay_buffer import load_replay_buffer
from agents.spec import RunSpec
from agents.training import Room, run, train

LAYOUT = cps.Layout(prefix="dqn", state="toy", buffer=True)


class SignalAt(BaseCallback):
    """Sends SIGINT to this process once, at the first step at or past ``steps``."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps

    def _on_step(self) -> bool:
        if self.steps is not None and self.num_timesteps >= self.steps:
            self.steps = None
            os.kill(os.getpid(), signal.SIGINT)
        return True


class CartPoleRoom(Room):
    env_id = "CartPole-v1"

    def __init__(self, run_dir: Path, total: int, resume: bool = False, signal_at: int | None = None) -> None:
        self.run_dir, self.total, self.resume, self.signal_at = run_dir, total, resume, signal_at
        self.n_envs, self.checkpoint_freq = 2, 40
        self.env = None
        self.ended: list[int] = []

    def checkpoints(self):
        return cps.complete_checkpoints(self.run_dir, LAYOUT)

    def start_point(self):
        return cps.resume_point(self.run_dir, LAYOUT, lambda p: DQN.load(p, device="cpu"),
                                lambda p, steps: json.loads(p.read_text()), self.warn)

    def setup(self, start):
        self.env = make_vec_env("CartPole-v1", n_envs=self.n_envs, seed=0)
        if start is None:
            (self.run_dir / "config.json").write_text(RunSpec(self.env_id, {}, "dqn", {}, {}).text())
        return self.env

    def make_model(self, env, start):
        if start is None:
            return DQN("MlpPolicy", env, learning_starts=20, buffer_size=1_000, train_freq=4, seed=0, device="cpu")
        model = DQN.load(start.model, env=env, device="cpu")
        load_replay_buffer(model, start.replay_buffer)
        return model

    def callbacks(self, model, stop):
        return [SignalAt(self.signal_at)] if self.signal_at is not None else []

    def save_checkpoint(self, model):
        return cps.save_checkpoint(model, self.run_dir, LAYOUT, {"steps": int(model.num_timesteps)}, keep=2)

    def finish(self, model, interrupted):
        self.ended.append(int(model.num_timesteps))
        return [{"steps": int(model.num_timesteps)}]

    def close(self):
        if self.env is not None:
            self.env.close()


@pytest.fixture
def signals_default():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as a terminal's Ctrl-C, never ignored
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_room_of_ones_own_stops_on_a_signal_goes_on_to_its_total_and_ends_again_at_it(tmp_path, capsys,
                                                                                       signals_default):
    run_dir = tmp_path / "cartpole"
    stopped = train(CartPoleRoom(run_dir, total=200, signal_at=90))
    assert stopped.interrupted == "SIGINT" and 90 <= stopped.steps < 200  # at the next rollout start: 4 steps at most
    assert stopped.checkpoint.steps == stopped.steps and stopped.checkpoint.state.is_file()
    assert not (run_dir / "model.zip").exists()  # the model of a run that reached its end only
    assert (run_dir / "progress.csv").is_file() and not (run_dir / "train.lock").exists()

    room = CartPoleRoom(run_dir, total=200, resume=True)
    done = train(room)
    out = capsys.readouterr().out
    assert f"resuming at step {stopped.steps}: {run_dir} (200 steps in all)" in out
    assert done.interrupted is None and 200 <= done.steps < 200 + 2 * 4 and done.table == [{"steps": done.steps}]
    assert DQN.load(run_dir / "model.zip").num_timesteps == done.steps == done.checkpoint.steps
    assert [c.steps for c in room.checkpoints()][0] == done.steps

    (run_dir / "model.zip").unlink()  # killed while writing its end: a resume trains nothing, writes it again
    again = CartPoleRoom(run_dir, total=200, resume=True)
    assert run(again) == 0
    assert again.ended == [done.steps] and DQN.load(run_dir / "model.zip").num_timesteps == done.steps
    assert "only its end is written again" in capsys.readouterr().out


def test_the_trainer_refuses_a_new_run_over_one_with_a_checkpoint_and_a_run_in_use(tmp_path, capsys):
    run_dir = tmp_path / "cartpole"
    assert run(CartPoleRoom(run_dir, total=80)) == 0
    assert run(CartPoleRoom(run_dir, total=80)) == 2  # a new run where one has a checkpoint
    assert f"is a run with a checkpoint at step 80 already: continue it with `python train.py --resume {run_dir}`" in (
        capsys.readouterr().err)
    with RunLock.acquire(run_dir):
        with pytest.raises(RunInUse, match="is in use by process"):
            train(CartPoleRoom(run_dir, total=160, resume=True))
    assert run(CartPoleRoom(run_dir, total=160, resume=True)) == 0  # the lock released with its holder
