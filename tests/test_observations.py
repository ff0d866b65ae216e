"""The env's versions and observations: both spaces pass Gymnasium's and SB3's checkers, and the rich
observation reports what the last step did."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

from bild_env import ENV_ID
from bild_env.env import PAPER_SETTING

from conftest import COSTS  # noqa: E402

KW = {"pair": "tiny-random", "pair_options": {"device": "cpu"}, "cost_model": COSTS, "max_new_tokens": 16}


@pytest.mark.parametrize("observation, size", [("paper", 7), ("rich", 14), ("context", 17)])
def test_every_observation_pass_the_checkers(observation, size):
    env = gymnasium.make(f"bild_env:{ENV_ID}", observation=observation, **KW)
    assert env.observation_space.shape == (size,)
    check_env(env.unwrapped, skip_render_check=True)
    sb3_check_env(env.unwrapped)
    env.close()


def test_rich_observation_reports_the_last_step():
    env = gymnasium.make(f"bild_env:{ENV_ID}", observation="rich", **KW)
    paper = gymnasium.make(f"bild_env:{ENV_ID}", observation="paper", **KW)  # the same episode, in lockstep
    obs, _ = env.reset(seed=3)
    paper_obs, _ = paper.reset(seed=3)
    assert obs[7:11].tolist() == [0, 0, 0, 0] and obs[11] == 1.0 and obs[12] == 0.5 and obs[13] == 0.0
    cfg = env.unwrapped.config
    rng, done, generated = np.random.default_rng(0), False, 1  # the prefill commits the first token
    while not done:
        action = int(rng.integers(25))
        obs, _, term, trunc, info = env.step(action)
        paper_obs, *_ = paper.step(action)
        generated += info["committed"]
        assert obs[:7].tolist() == paper_obs.tolist()  # the paper's 7 numbers come first, unchanged
        assert (obs[1], obs[3], obs[6]) == pytest.approx((info["bleu"] / 100, info["fallback"],
                                                          generated / cfg.max_new_tokens))
        assert obs[4] == pytest.approx(info["rollback"] / max(cfg.actions.rollback_values))
        assert obs[7] == pytest.approx(info["proposed"] / cfg.actions.max_draft_len)
        assert obs[8] == pytest.approx(info["accepted"] / info["proposed"] if info["proposed"] else 0.0)
        assert obs[9] == float(info["fell_back"]) and obs[10] == float(info["rolled_back"])
        assert 0.0 <= obs[11] <= 1.0 and env.observation_space.contains(obs)
        done = term or trunc
    assert obs[13] == pytest.approx(min(1.0, info["episode_summary"]["regret"] / 2), abs=1e-6)


def test_context_observation_is_rich_plus_the_drafts_calibration_so_far():
    env = gymnasium.make(f"bild_env:{ENV_ID}", observation="context", **KW)
    rich = gymnasium.make(f"bild_env:{ENV_ID}", observation="rich", **KW)
    obs, _ = env.reset(seed=5)
    rich_obs, _ = rich.reset(seed=5)
    assert obs[14:].tolist() == [0.5, 0.5, 0.5] and obs[:14].tolist() == rich_obs.tolist()
    rng, done, judged, right, seen = np.random.default_rng(1), False, 0, 0, 0
    while not done:
        action = int(rng.integers(25))
        obs, _, term, trunc, info = env.step(action)
        rich_obs, *_ = rich.step(action)
        assert obs[:14].tolist() == rich_obs.tolist()
        # judged: the proposals up to a rollback (all when none), plus one withheld by a fallback when nothing was rolled back
        expected = (info["accepted"] + 1 if info["rolled_back"] else info["proposed"] + info["fell_back"])
        assert info["guesses"] == expected and info["guesses_right"] <= info["guesses"]
        judged, right, seen = judged + info["guesses"], right + info["guesses_right"], seen + info["proposed"]
        assert obs[14] == pytest.approx((right + 1) / (judged + 2)) and 0 < obs[15] < 1 and 0 < obs[16] < 1
        done = term or trunc
    assert seen > 0 and info["episode_summary"]["draft_accuracy"] == pytest.approx(right / judged)


def test_v0_is_the_papers_setting_and_v1_the_defaults():
    v0 = gymnasium.make("bild_env:BiLD-v0", **KW).unwrapped
    v1 = gymnasium.make(f"bild_env:{ENV_ID}", **KW).unwrapped
    assert v0.config.actions.rollback_values == PAPER_SETTING["actions"]["rollback_values"] and v0.config.reward.quality == "bleu"
    assert v0.thresholds(7) == (0.103, 4.697) and v1.thresholds(4) == (0.103, 4.697)
    assert v1.config.reward.quality == "regret" and v0.observation_space.shape == v1.observation_space.shape == (7,)


def test_the_continuous_action_passes_the_checkers_and_maps_onto_the_grids_span():
    env = gymnasium.make(f"bild_env:{ENV_ID}", actions={"space": "continuous"}, **KW)
    assert env.action_space == gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)
    check_env(env.unwrapped, skip_render_check=True)
    sb3_check_env(env.unwrapped)
    base = env.unwrapped
    cfg = base.config
    assert base.thresholds(np.array([-1.0, -1.0])) == pytest.approx((min(cfg.actions.fallback_values), min(cfg.actions.rollback_values)))
    assert base.thresholds(np.array([1.0, 1.0])) == pytest.approx((max(cfg.actions.fallback_values), max(cfg.actions.rollback_values)))
    mid = base.thresholds(np.array([0.0, 0.0]))  # fallback: the middle; rollback: the geometric mean (log scale)
    assert mid == pytest.approx(((0.103 + 0.6) / 2, (0.5 * 4.697) ** 0.5))
    env.reset(seed=0)
    _, _, _, _, info = env.step(np.array([0.0, 0.0], dtype=np.float32))
    assert (info["fallback"], info["rollback"]) == pytest.approx(mid)
    for bad in (np.array([0.0, 0.0, 0.0]), np.array([np.nan, 0.0]), np.array([2.0, 0.0]), 3):
        with pytest.raises(ValueError, match="2 finite numbers in \\[-1, 1\\]"):
            env.step(bad)
    env.close()
    with pytest.raises(ValueError, match="actions: space must be one of"):
        gymnasium.make(f"bild_env:{ENV_ID}", actions={"space": "box"}, **KW)
    with pytest.raises(ValueError, match="log scale"):
        gymnasium.make(f"bild_env:{ENV_ID}", actions={"space": "continuous", "rollback_values": (0.0, 1.0)}, **KW)
