"""BiLD-v0 on the tiny-random pair: env checkers, determinism, bounds, equivalence with the decoder."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import gymnasium
import numpy as np
import pytest

from bild_env import generate_bild
from bild_env.decoding.forward_costs import COARSE_FED
from bild_env.env import BildEnv

from conftest import COSTS  # noqa: E402




def rollout(env, actions, seed):
    obs, info = env.reset(seed=seed)
    trace = [(obs.tolist(), info)]
    for a in actions:
        obs, r, term, trunc, info = env.step(a)
        trace.append((obs.tolist(), r, term, trunc, info))
        if term or trunc:
            break
    return trace


def test_gymnasium_and_sb3_env_checkers_pass(make_env):
    from gymnasium.utils.env_checker import check_env as gym_check
    from stable_baselines3.common.env_checker import check_env as sb3_check

    env = make_env()
    gym_check(env.unwrapped, skip_render_check=True)
    sb3_check(env.unwrapped, warn=True)


def test_make_works_in_a_fresh_interpreter():
    code = ("import gymnasium; env = gymnasium.make('bild_env:BiLD-v0', pair='tiny-random', device='cpu', "
            "max_new_tokens=4); obs, _ = env.reset(seed=0); print(env.action_space, obs.shape)")
    env = os.environ | {"OMP_NUM_THREADS": "1"}  # one torch thread: the calibration is fast on a busy CPU
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert "Discrete(25) (7,)" in out.stdout


def test_same_seed_same_actions_same_everything(make_env):
    actions = np.random.default_rng(0).integers(0, 25, size=40).tolist()
    a = rollout(make_env(), actions, seed=5)
    b = rollout(make_env(), actions, seed=5)
    assert a == b
    assert a[-1][2] is True  # terminated


def test_observations_stay_in_bounds_over_random_rollouts(make_env):
    env = make_env(max_new_tokens=32)
    space = env.observation_space
    rng = np.random.default_rng(1)
    seen = []
    for episode in range(12):
        obs, _ = env.reset(seed=episode)
        assert space.contains(obs)
        done = False
        while not done:
            obs, reward, term, trunc, info = env.step(int(rng.integers(25)))
            assert space.contains(obs), obs
            assert math.isfinite(reward)
            done = term or trunc
            seen.append(obs)
    seen = np.array(seen)
    assert seen[:, 6].max() == 1.0 and seen[:, 3].min() < seen[:, 3].max()  # progress reaches 1; thresholds vary


def test_fixed_policy_matches_the_bild_decoder(make_env, tiny_pair):
    env = make_env(max_new_tokens=40)
    base = env.unwrapped
    assert base.thresholds(7) == (0.103, 4.697)
    for index in range(3):
        obs, info = env.reset(options={"prompt_index": index})
        done, rewards = False, []
        while not done:
            obs, r, term, trunc, info = env.step(7)
            rewards.append(r)
            done = term or trunc
        summary = info["episode_summary"]
        prompt = base.prompts[index]
        g = generate_bild(tiny_pair, prompt, 0.103, 4.697, 10, 40, cost_model=COSTS)
        assert base.session.new_ids == g.new_ids
        assert summary["latency_ms"] == pytest.approx(g.stats.model_ms)
        assert summary["acceptance_rate"] == pytest.approx(g.stats.acceptance_rate or 0.0)
        assert summary["mean_accepted_length"] == pytest.approx(g.stats.mean_accepted_length)
        assert summary["rollbacks"] == g.stats.rollbacks and summary["steps"] == g.stats.steps
        # the latency part of the return is the share of target-only time saved
        t_ref = base.cost_model.target_only_ms(len(prompt), g.stats.new_tokens) - base.cost_model.target_only_ms(len(prompt), 1)
        bleu_loss = 2.0 * (100.0 - summary["bleu"]) / 100.0
        steps_ms = g.stats.model_ms - base._latency(base.session.prefill)
        assert sum(rewards) == pytest.approx((t_ref - steps_ms) / base.norm_ms - bleu_loss, abs=1e-6)


def test_rollback_below_ln2_gives_bleu_100(make_env):
    env = make_env(actions={"rollback_values": (0.1, 0.3, 0.5, 0.6, 0.69)}, max_new_tokens=32)
    rng = np.random.default_rng(2)
    for episode in range(6):
        env.reset(seed=episode)
        done = False
        while not done:
            _, _, term, trunc, info = env.step(int(rng.integers(25)))
            done = term or trunc
        assert info["episode_summary"]["bleu"] == 100.0
        assert info["episode_summary"]["exact_match"] == 1.0


def test_bad_input_is_refused_clearly(make_env):
    env = make_env()
    base = env.unwrapped
    with pytest.raises(RuntimeError, match="call reset"):
        base.step(0)
    env.reset(seed=0)
    for bad in (25, -1, 3.0, np.array([1, 2]), np.array([3]), "7"):
        with pytest.raises(ValueError, match=r"action must be an integer in \[0, 25\)"):
            base.step(bad)
    done = False
    while not done:
        _, _, term, trunc, _ = base.step(np.int64(24))
        done = term or trunc
    with pytest.raises(RuntimeError, match="episode has ended"):
        base.step(0)
    with pytest.raises(ValueError, match="unknown model pair preset 'nope'"):
        make_env(pair="nope")
    with pytest.raises(ValueError, match="no usable prompt"):
        make_env(dataset=["hi", ""], split="test")
    with pytest.raises(ValueError, match="unknown split"):
        make_env(split="dev")
    with pytest.raises(ValueError, match="latency must be one of"):
        make_env(latency="fast")
    with pytest.raises(TypeError, match="unknown BiLD-v0 argument"):
        make_env(max_tokens=3)
    with pytest.raises(ValueError, match="fallback threshold"):
        make_env(actions={"fallback_values": (0.1, 1.5)})


def test_model_failure_truncates_the_episode(make_env, monkeypatch):
    env = make_env()
    env.reset(seed=0)
    base = env.unwrapped

    def boom(tokens):
        raise RuntimeError("CUDA out of memory (simulated)")

    monkeypatch.setattr(base.runner, "draft_next", boom)
    obs, reward, term, trunc, info = env.step(7)
    assert (term, trunc, reward) == (False, True, 0.0)
    assert "out of memory" in info["error"]
    monkeypatch.undo()
    env.reset(seed=1)  # the env is usable again
    env.step(7)


def test_wall_latency_mode_and_text_prompts(make_env):
    env = make_env(latency="wall", dataset=["One two three four five six.", "Seven eight nine ten eleven."],
                   split="validation", render_mode="ansi")
    obs, _ = env.reset(seed=0)
    _, _, _, _, info = env.step(7)
    assert info["latency_ms"] > 0
    assert "output:" in env.render()


def test_references_are_cached_on_disk(make_env, tiny_pair):
    env = make_env()
    env.reset(options={"prompt_index": 0})
    store = env.unwrapped.references
    assert store.path.exists()
    from bild_env.reference import ReferenceStore

    again = ReferenceStore(tiny_pair, 24)
    assert again.refs == store.refs and len(again.refs) >= 1


def test_direct_construction_and_calibrated_costs(tiny_pair):
    env = BildEnv(pair="tiny-random", pair_options={"device": "cpu"}, max_new_tokens=8, dataset="builtin")
    fixed, per_token = env.cost_model.batch_costs("target")
    assert fixed >= 0 and per_token >= 0 and fixed + per_token > 0
    for cost in (env.cost_model.draft, env.cost_model.target):  # measured: positive and finite (never ordered: noise)
        # timed sparsely: the coarse counts always, the others where the curve bends; every count is priced
        assert set(COARSE_FED) <= set(cost.fed) and all(0 < ms < float("inf") for ms in cost.ms)
        assert all(0 < cost(f, 40) < float("inf") for f in range(1, 13))
        assert all(cost(f, 40) == pytest.approx(ms + cost.per_context_ms * (40 - cost.ref_context))
                   for f, ms in zip(cost.fed, cost.ms))
    assert BildEnv(pair="tiny-random", pair_options={"device": "cpu"}, max_new_tokens=8).cost_model == env.cost_model  # stored


def test_an_episode_the_prefill_already_finished_ends_at_the_first_step(make_env):
    env = make_env(max_new_tokens=1)
    obs, _ = env.reset(seed=0)
    assert obs[6] == 1.0  # progress: the prefill's token is all there is
    obs, reward, terminated, truncated, info = env.step(7)
    assert (reward, terminated, truncated, info["committed"]) == (0.0, True, False, 0)
    assert info["episode_summary"]["new_tokens"] == 1 and info["episode_summary"]["bleu"] == 100.0
