"""One step of policy iteration from a fixed pair, fitted on rollouts (agents.bild.improvement, scripts/analysis/bild_predictability.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from agents.bild.evaluation import Scripted, returns_on_prompts
from agents.bild.improvement import RolloutImprovement, features, fit_ridge, record_rollouts
from agents.bild.rollout import run_episode
from tests.test_serving_bench import _script

ENV_DEFAULTS = {"backend": "replay", "observation": "foresee", "max_new_tokens": 12}


def test_features_by_hand_without_the_dropped_columns():
    x = np.array([[2.0, 5.0, 3.0]])
    assert features(x, drop=(1,)).tolist() == [[1.0, 2.0, 3.0, 4.0, 6.0, 9.0]]
    assert features(x).shape == (1, 1 + 3 + 6)


def test_the_policy_acts_on_the_fitted_advantage_above_its_margin():
    weights = np.zeros((3, 4))  # features of one column: 1, x, x^2; four actions, base 1
    weights[1, 2] = 1.0  # action 2's advantage is x
    weights[0, 3] = 0.2  # action 3's is 0.2 everywhere
    policy = RolloutImprovement(weights, base=1)
    assert policy.predict(np.array([0.5]))[0] == 2
    assert policy.predict(np.array([0.1]))[0] == 3
    assert policy.predict(np.array([-1.0]))[0] == 3
    assert policy.with_margin(0.3).predict(np.array([0.1]))[0] == 1  # none above the margin: the base
    assert policy.with_margin(0.3).predict(np.array([0.5]))[0] == 2


def test_fit_recovers_an_advantage_the_features_can_express():
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(200, 3))
    returns = np.stack([1.0 + x[:, 0] * x[:, 2], np.ones(200), 1.0 - x[:, 1] ** 2], axis=1)  # base 1 returns 1
    policy = RolloutImprovement.fit(x, returns, base=1, ridge=0.0, drop=(1,))  # column 1 dropped
    assert np.allclose(policy.advantages(x)[:, 0], x[:, 0] * x[:, 2])
    assert np.allclose(policy.advantages(x)[:, 1], 0.0)
    assert not np.allclose(policy.advantages(x)[:, 2], -x[:, 1] ** 2)  # it cannot see the column it dropped
    assert np.allclose(fit_ridge(features(x), returns - returns[:, [1]], 0.0)[:, 1], 0.0)


def test_rollouts_are_each_action_once_at_each_step_of_the_base_episode(make_env):
    env = make_env()
    base, prompts = 6, [0, 1]
    x, q, which = record_rollouts(env, base, prompts)
    for i in prompts:
        rows = np.flatnonzero(which == i)
        episode = run_episode(env, Scripted([], base), prompt_index=i)
        assert len(rows) == len(episode.actions)  # one row per step of the base's episode
        assert np.allclose(q[rows, base], episode.episode_return)  # the base column is the base's return
        first, _ = env.reset(options={"prompt_index": i})
        assert np.allclose(x[rows[0]], first)  # row t holds the observation the policy saw at step t
        t, a = len(rows) - 1, 0  # the last step played with action 0: by hand
        alone = run_episode(env, Scripted([base] * t + [a], base), prompt_index=i).episode_return
        assert q[rows[t], a] == pytest.approx(alone)
    assert q.shape == (len(which), env.action_space.n) and x.shape == (len(which), 18)
    assert np.any(np.abs(q - q[:, [base]]) > 1e-9)  # some deviation changes the return
    fitted = RolloutImprovement.fit(x, q, base, ridge=1e-3, margin=np.inf)  # a margin nothing passes: the base
    assert returns_on_prompts(env, fitted, prompts).returns == pytest.approx(q[[np.flatnonzero(which == i)[0]
                                                                                for i in prompts], base])


def test_the_script_runs_on_the_tiny_pair(tmp_path, capsys):
    out = tmp_path / "p.json"
    report = _script("bild_predictability").main(
        ["--pair", "tiny-random", "--score", "cumulative", "--max-new-tokens", "8", "--train-prompts", "4", "--select-prompts", "2",
         "--validation-prompts", "2", "--test-prompts", "3", "--oracle-prompts", "2", "--parts", "2",
         "--ridges", "0.01", "--margins", "0", "1000", "--out", str(out)])
    assert json.loads(out.read_text())["steps"] == report["steps"]
    rows = {r["policy"].split(" (")[0]: r for r in report["rows"]}
    assert rows["base"]["minus_base"] == 0.0
    assert rows["per-step oracle"]["minus_base"] >= -1e-12  # policy improvement: never below its base
    assert rows["one-step room, to first order"]["minus_base"] >= 0.0  # each step's best includes the base
    assert {"fitted on all train prompts", "fitted on train part 1 of 2", "fitted on train part 2 of 2"} <= set(rows)
    assert report["chosen"]["margin"] in (0.0, 1000.0) and report["chosen"]["ridge"] == 0.01
    if report["chosen"]["margin"] == 1000.0:  # a margin nothing passes is the base itself
        assert rows["fitted on all train prompts"]["minus_base"] == 0.0
    assert "R^2 of each action's advantage" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        _script("bild_predictability").main(["--pair", "tiny-random", "--parts", "0"])
    with pytest.raises(SystemExit, match="distill lookup"):  # the default score needs the pair's lookup predictor
        _script("bild_predictability").main(["--pair", "tiny-random", "--train-prompts", "1", "--parts", "1"])
