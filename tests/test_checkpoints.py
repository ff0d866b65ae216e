"""agents.common.checkpoints: one checkpoint format for both trainers, complete once its state is written (last),
pruned to the newest complete ones, and the resume point past a torn one."""

import json

import pytest

from agents.common.checkpoints import Layout, checkpoint_at, complete_checkpoints, resume_point, save_checkpoint
from agents.common.lock import RunInUse, RunLock, lock_holder
from agents.serve.runs import LAYOUT as SERVING


@pytest.fixture(scope="module")
def model():
    import gymnasium as gym
    from stable_baselines3 import DQN

    return DQN("MlpPolicy", gym.make("CartPole-v1"), buffer_size=64, learning_starts=0, device="cpu")


@pytest.mark.parametrize("layout", [Layout("dqn", "dqn", True), Layout("ppo", "ppo", False), SERVING],
                         ids=["bild-dqn", "bild-ppo", "serve"])
def test_a_checkpoint_is_complete_once_its_state_is_written_and_older_ones_are_pruned(tmp_path, model, layout):
    for steps in (40, 80, 120):
        model.num_timesteps = steps
        cp = save_checkpoint(model, tmp_path, layout, {"steps": steps}, keep=2)
        assert cp.files[-1] == cp.state and json.loads(cp.state.read_text()) == {"steps": steps}
    assert [c.steps for c in complete_checkpoints(tmp_path, layout)] == [120, 80]  # 40's state pruned
    assert checkpoint_at(tmp_path, 40, layout).model.is_file()  # model zips all stay
    checkpoint_at(tmp_path, 120, layout).state.unlink()  # killed between the model and the state
    assert [c.steps for c in complete_checkpoints(tmp_path, layout)] == [80]


def test_the_resume_point_skips_a_torn_checkpoint_and_says_why(tmp_path, model):
    from stable_baselines3 import DQN

    for steps in (40, 80):
        model.num_timesteps = steps
        save_checkpoint(model, tmp_path, SERVING, {"steps": steps}, keep=0)
    torn = checkpoint_at(tmp_path, 80, SERVING).model
    torn.write_bytes(torn.read_bytes()[:200])
    said = []
    point = resume_point(tmp_path, SERVING, lambda p: DQN.load(p, device="cpu"), lambda p, s: json.loads(p.read_text()),
                         said.append)
    assert point.steps == 40 and len(said) == 1 and "step 80" in said[0] and str(torn) in said[0]


def test_the_run_lock_is_filelocks_and_names_its_holder(tmp_path):
    with RunLock.acquire(tmp_path):
        assert lock_holder(tmp_path)["argv"]
        with pytest.raises(RunInUse):
            RunLock.acquire(tmp_path)
    assert lock_holder(tmp_path) is None and not (tmp_path / "train.lock").exists()
