"""UCBSpec and EXP3Spec (agents.common.bandits): hand-computed choices, seeded draws, full episodes of both envs."""

from __future__ import annotations

import math
import re

import gymnasium
import numpy as np
import pytest

from agents.common.bandits import (BanditFeedback, BanditGrid, EXP3Spec, UCBSpec, candidates, choose, grid_arms, rescale)
from tests.conftest import COSTS
from tests.test_serving import make_serve, toy_batch_costs, workload  # noqa: F401 (fixtures)


def test_rewards_map_onto_zero_one_by_the_bound():
    assert rescale(0.0) == 0.5 and rescale(1.0) == 1.0 and rescale(-1.0) == 0.0
    assert rescale(0.2, bound=0.5) == pytest.approx(0.7)
    assert rescale(-18.0) == 0.0 and rescale(5.0) == 1.0  # a lossy step's regret charge: the worst, clipped


def test_ucb_tries_every_arm_once_then_takes_the_highest_bound():
    ucb = UCBSpec([3, 7, 9], c=0.5)
    tried = []
    for r in (0.2, -0.2, 0.6):  # rescaled: 0.6, 0.4, 0.8
        tried.append(ucb.act())
        ucb.update(r)
    assert tried == [3, 7, 9]  # each once, in the order given
    assert ucb.act() == 9  # equal bonuses: the best mean, 0.8
    ucb.update(-1.0)  # arm 9: rescaled 0, its mean now 0.4 over 2 pulls
    # t = 4: arm 3: 0.6 + 0.5 sqrt(ln 4 / 1) = 1.1887; arm 7: 0.4 + 0.5887 = 0.9887; arm 9: 0.4 + 0.5 sqrt(ln 4 / 2) = 0.8163
    assert ucb.index() == pytest.approx([0.6 + 0.5 * math.sqrt(math.log(4)), 0.4 + 0.5 * math.sqrt(math.log(4)),
                                         0.4 + 0.5 * math.sqrt(math.log(4) / 2)])
    assert ucb.act() == 3
    ucb.update(0.0)
    ucb.reset()  # a new episode: nothing remembered
    assert ucb.act() == 3 and ucb.counts.sum() == 0


def test_exp3_probabilities_follow_the_hand_computation():
    exp3 = EXP3Spec([0, 1, 2], gamma=0.3, seed=1)
    exp3.reset(episode=0)
    assert exp3.probabilities == pytest.approx([1 / 3] * 3)
    first = exp3.act()
    exp3.update(0.2)  # x = 0.6, estimate 0.6 / (1/3) = 1.8, w = exp(0.3 * 1.8 / 3) = exp(0.18)
    w = np.ones(3)
    w[first] = math.exp(0.18)
    p = 0.7 * w / w.sum() + 0.1
    assert p[first] == pytest.approx(0.362119, abs=1e-6) and exp3.probabilities == pytest.approx(p)
    for r in (-0.4, 1.0, 0.1):  # three more, by the formula
        arm = exp3.act()
        exp3.update(r)
        w[arm] *= math.exp(0.3 * (rescale(r) / p[arm]) / 3)
        p = 0.7 * w / w.sum() + 0.1
        assert exp3.probabilities == pytest.approx(p)
    assert exp3.probabilities.sum() == pytest.approx(1.0)


def draws(bandit, episode, n=12):
    bandit.reset(episode)
    out = []
    for _ in range(n):
        out.append(bandit.act())
        bandit.update(0.1 * (out[-1] % 3))
    return out


def test_exp3_draws_are_seeded_by_seed_and_episode():
    a, b = EXP3Spec(list(range(6)), gamma=0.5, seed=3), EXP3Spec(list(range(6)), gamma=0.5, seed=3)
    assert draws(a, 7) == draws(b, 7)
    assert draws(a, 8) == draws(EXP3Spec(list(range(6)), gamma=0.5, seed=3), 8)  # whatever ran before
    assert draws(a, 7) != draws(a, 8)  # another episode, other draws


@pytest.mark.parametrize("make, says", [
    (lambda: UCBSpec([0, 1], c=-0.1), "exploration constant c"),
    (lambda: UCBSpec([0, 1], c=float("nan")), "exploration constant c"),
    (lambda: EXP3Spec([0, 1], gamma=0.0), "gamma must be in (0, 1]"),
    (lambda: EXP3Spec([0, 1], gamma=1.5), "gamma must be in (0, 1]"),
    (lambda: UCBSpec([0, 1], bound=0.0), "bound must be a finite number > 0"),
    (lambda: EXP3Spec([], gamma=0.1), "at least one arm"),
    (lambda: UCBSpec([2, 2]), "distinct"),
])
def test_bad_hyperparameters_are_refused(make, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        make()


def test_act_twice_without_a_reward_is_refused():
    ucb = UCBSpec([0, 1])
    ucb.act()
    with pytest.raises(RuntimeError, match="before update"):
        ucb.act()


def test_choose_keeps_each_bandits_best_setting_and_every_score():
    ranked = [5, 2, 9, 0]
    grid = BanditGrid(ucb_c=(0.1, 1.0), exp3_gamma=(0.2,), top=(2, 0))
    assert len(candidates(ranked, grid)) == 6
    chosen = choose(lambda b: -len(b.arms) + getattr(b, "c", 0.0), ranked, grid)
    assert chosen["UCBSpec"]["value"] == 1.0 and chosen["UCBSpec"]["arms"] == [5, 2] and chosen["UCBSpec"]["top"] == 2
    assert chosen["EXP3Spec"]["arms"] == [5, 2] and len(chosen["UCBSpec"]["tried"]) == 4


@pytest.mark.parametrize("kind", ["UCBSpec", "EXP3Spec"])
def test_a_full_bild_v1_episode_takes_valid_actions_only(kind):
    from agents.bild.rollout import run_episode

    env = gymnasium.make("bild_env:BiLD-v1", pair="tiny-random", pair_options={"device": "cpu"}, cost_model=COSTS, max_new_tokens=16,
                         backend="replay", split="validation")
    try:
        arms = grid_arms(env)
        assert arms == list(range(25))
        bandit = UCBSpec(arms, c=0.1) if kind == "UCBSpec" else EXP3Spec(arms, gamma=0.3)
        ep = run_episode(BanditFeedback(env, bandit), bandit, prompt_index=1)
        assert ep.summary is not None and ep.length >= 1 and all(a in arms for a in ep.actions)
        if kind == "UCBSpec":  # every step's reward reached it, and it tried the arms in order
            assert bandit.counts.sum() == ep.length and ep.actions == arms[:ep.length]
    finally:
        env.close()


@pytest.mark.parametrize("kind", ["UCBSpec", "EXP3Spec"])
def test_a_full_serving_episode_takes_valid_actions_only(make_serve, kind):
    from agents.serve.rules import run_serving_episode

    env = make_serve(episode_steps=40)
    arms = grid_arms(env)
    assert arms == list(range(26))  # the grid and speculation off
    bandit = UCBSpec(arms, c=0.1) if kind == "UCBSpec" else EXP3Spec(arms, gamma=0.3)
    ep = run_serving_episode(BanditFeedback(env, bandit), bandit, seed=3)
    assert len(ep.actions) == 40 and all(a in arms for a in ep.actions) and ep.summary
    if kind == "UCBSpec":
        assert ep.actions[:26] == arms and bandit.counts.sum() == 40
    again = run_serving_episode(BanditFeedback(env, bandit), bandit, seed=3)
    assert again.actions == ep.actions  # reset with the episode: the same seed, the same choices


def test_only_a_discrete_action_and_its_own_arms_are_taken(make_serve):
    with pytest.raises(ValueError, match="Discrete"):
        grid_arms(make_serve(actions={"per_domain": True}))
    with pytest.raises(ValueError, match="not actions of this env"):
        BanditFeedback(make_serve(), UCBSpec([0, 26]))


def test_serving_bench_chooses_the_bandits_on_validation_and_runs_them_on_test(tmp_path, monkeypatch):
    import bild_env.decoding.costs as costs
    from tests.test_serving import evaluate_serve as main

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())
    report = main(["--pair", "tiny-random", "--levels", "0.1", "1.0", "--moving", "burst:0.1,1.0",
                   "--select-episodes", "2", "--episodes", "2", "--episode-steps", "8", "--max-new-tokens", "8",
                   "--max-batch", "4", "--fixed-actions", "0", "15", "20", "--max-prompts", "6",
                   "--out", str(tmp_path / "s.json")])
    chosen = report["chosen"]["bandits"]
    assert set(chosen) == {"UCBSpec", "EXP3Spec"}
    for kind, entry in chosen.items():
        assert entry["validation_return"] == max(entry["tried"].values())
        assert len(entry["arm_labels"]) == len(entry["arms"]) and set(entry["arms"]) <= {0, 15, 20, 25}
    for rows in list(report["levels"].values()) + list(report["moving"].values()) + [report["overall"]]:
        names = [r["policy"].split(" (")[0] for r in rows]
        assert "UCBSpec" in names and "EXP3Spec" in names
        assert all("minus_batch_table_ci" in r for r in rows if r["policy"].startswith(("UCBSpec", "EXP3Spec")))


def test_headroom_runs_the_bandits_chosen_on_the_select_split(tmp_path):
    from bench import headroom

    cfg = headroom.HeadroomConfig(split="test", prompts=3, select_split="validation", select_prompts=2,
                                  env={"pair": "tiny-random", "max_new_tokens": 8}, out=str(tmp_path / "h.json"))
    report = headroom.run(cfg)
    rows = {r["policy"].split(" (")[0]: r for r in report["rows"]}
    for kind in ("UCBSpec", "EXP3Spec"):
        entry = report["bandits"][kind]
        assert entry["validation_return"] == max(entry["tried"].values()) and len(entry["per_prompt_returns"]) == 3
        assert rows[kind]["return"] == pytest.approx(np.mean(entry["per_prompt_returns"]))
        assert "minus_best_single_ci95" in rows[kind]
