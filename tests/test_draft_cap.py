"""``actions={"max_draft_len": "auto"}`` (bild_env.draft_cap): BiLD-v1 takes the cap whose best fixed action returns
most on the validation split under the costs it charges, BiLD-Serve-v0 the cap whose per-load best fixed actions do,
each computed here again cap by cap; where it cannot be chosen it is refused in words; both trainers save the cap
chosen; the serving evaluator's rules take a cap and agents keep their run's."""

from __future__ import annotations

import json

import gymnasium
import numpy as np
import pytest

from agents.commands import train_main
from agents.serve.bench_config import QUICK, env_options
from agents.serve.evaluation_agents import GRID
from bild_env.cli import key_values
from bild_env.config import ActionOptions
import bild_env.draft_cap as draft_cap
import bild_env.serving.env
from bild_env.draft_cap import CANDIDATES, candidates

# the real pair's shipped float32 recording, charged the Xeon's bfloat16 costs: no model loads
REAL = dict(pair="qwen2.5-coder", backend="replay", pair_options={"dtype": "float32"},
            cost_profile="xeon-amx-qwen2.5-coder-bf16")
LOSSLESS = {"rollback_values": (0.5,), "off_switch": True}


def _best_fixed_return(cap: int) -> float:
    """The best mean return over the validation prompts of any action held fixed, at ``cap``, from an env of its own."""
    env = gymnasium.make("bild_env:BiLD-v1", split="validation", actions=LOSSLESS | {"max_draft_len": cap}, **REAL)
    means = []
    for action in range(env.action_space.n):
        returns = []
        for prompt in range(len(env.unwrapped.prompts)):
            env.reset(options={"prompt_index": prompt})
            total, done = 0.0, False
            while not done:
                _, reward, terminated, truncated, _ = env.step(action)
                total, done = total + reward, terminated or truncated
            returns.append(total)
        means.append(np.mean(returns))
    return max(means)


def test_auto_takes_the_cap_whose_best_fixed_action_returns_most_on_validation(monkeypatch):
    monkeypatch.setattr(draft_cap, "_CHOSEN", {})
    env = gymnasium.make("bild_env:BiLD-v1", split="test", actions=LOSSLESS | {"max_draft_len": "auto"}, **REAL)
    chosen = env.unwrapped.config.actions.max_draft_len
    assert candidates(10) == CANDIDATES  # the dataset recorded drafts of up to 10
    (_, said), = draft_cap._CHOSEN.values()
    tried = list(said)
    assert tried == list(CANDIDATES[:len(tried)])  # from the shortest up
    best = {cap: _best_fixed_return(cap) for cap in tried}
    assert said == pytest.approx(best)
    assert chosen == max(tried, key=lambda k: (best[k], -k))
    if len(tried) < len(CANDIDATES):  # stopped early: the last two tried returned less than the best
        assert max(best[k] for k in tried[-2:]) < best[chosen] and chosen not in tried[-2:]
    # the agent's episodes then draft at most that many tokens a step
    env.reset(seed=0)
    for _ in range(5):
        _, _, terminated, truncated, info = env.step(0)
        assert info["proposed"] <= chosen
        if terminated or truncated:
            break


def test_auto_is_chosen_once_per_configuration_in_a_process(monkeypatch):
    monkeypatch.setattr(draft_cap, "_CHOSEN", {})
    a = gymnasium.make("bild_env:BiLD-v1", actions=LOSSLESS | {"max_draft_len": "auto"}, **REAL)
    b = gymnasium.make("bild_env:BiLD-v1", split="validation", actions=LOSSLESS | {"max_draft_len": "auto"}, **REAL)
    assert len(draft_cap._CHOSEN) == 1  # the training and the evaluation env agree
    assert a.unwrapped.config.actions.max_draft_len == b.unwrapped.config.actions.max_draft_len


@pytest.mark.parametrize("env_id, kwargs, message", [
    ("bild_env:BiLD-v1", {"backend": "live"}, r'needs backend="replay".*give an integer'),
    ("bild_env:BiLD-v1", {"backend": "replay", "actions": {"space": "continuous", "max_draft_len": "auto"}}, r'needs space="discrete"'),
    ("bild_env:BiLD-v1", {"actions": {"max_draft_len": "four"}}, r'max_draft_len must be an integer >= 1 or "auto" '
                                                                  r"\(chosen on the validation split\), got 'four'"),
    ("bild_env:BiLD-Serve-v0", {"actions": {"max_draft_len": "auto", "per_domain": True}}, r"no per_domain actions"),
    ("bild_env:BiLD-Serve-v0", {"charging": {"train_profiles": ("h200-opt-eager",)}}, r"with train_profiles"),
])
def test_auto_where_it_cannot_be_chosen_is_refused_in_words(env_id, kwargs, message):
    kwargs = {"actions": {"max_draft_len": "auto"}} | kwargs
    with pytest.raises(ValueError, match=message):
        gymnasium.make(env_id, pair="tiny-random", **kwargs)


def test_the_command_line_reads_auto_and_integers():
    assert key_values(ActionOptions, ["max_draft_len=auto"], "--actions") == {"max_draft_len": "auto"}
    assert key_values(ActionOptions, ["max_draft_len=3"], "--actions") == {"max_draft_len": 3}


def test_train_saves_the_cap_its_envs_chose(tmp_path, monkeypatch):
    monkeypatch.setattr(draft_cap, "_CHOSEN", {})
    argv = ["--pair", "qwen2.5-coder", "--pair-options", "dtype=float32", "--backend", "replay",
            "--cost-profile", "xeon-amx-qwen2.5-coder-bf16", "--actions", "rollback_values=0.5", "off_switch=1",
            "max_draft_len=auto", "--max-prompts", "1", "--eval-episodes", "1", "--total-timesteps", "40",
            "--hyperparams", "learning_starts=20", "--log-dir", str(tmp_path), "--run-name", "r",
            "--torch-threads", "1", "--no-progress-bar"]
    assert train_main(argv) == 0
    (chosen, _), = draft_cap._CHOSEN.values()
    saved = json.loads((tmp_path / "r" / "config.json").read_text())["env"]["actions"]["max_draft_len"]
    assert saved == chosen and isinstance(saved, int)


def test_serving_auto_takes_the_cap_whose_per_load_best_fixed_actions_return_most(monkeypatch):
    monkeypatch.setattr(draft_cap, "_CHOSEN", {})
    monkeypatch.setattr(bild_env.serving.env, "SERVE_EPISODES", (1000,))  # one validation episode a load
    monkeypatch.setattr(draft_cap, "CANDIDATES", (1, 2, 10))
    kwargs = dict(pair="qwen2.5-coder", pair_options={"dtype": "float32"}, cost_profile="xeon-amx-qwen2.5-coder-bf16",
                  load="levels:0.05,1.0", episode_steps=16, max_prompts=2)
    env = gymnasium.make("bild_env:BiLD-Serve-v0", actions={"max_draft_len": "auto"}, **kwargs)
    chosen = env.unwrapped.config.actions.max_draft_len

    def per_load_best(cap: int) -> float:
        means = []
        for load in ("constant:0.05", "constant:1"):
            twin = gymnasium.make("bild_env:BiLD-Serve-v0", actions={"max_draft_len": cap},
                                  **kwargs | {"split": "validation", "load": load})
            means.append(max(_episode_return(twin, a) for a in range(twin.action_space.n)))
        return float(np.mean(means))

    best = {cap: per_load_best(cap) for cap in (1, 2, 10)}
    assert chosen == max(best, key=lambda k: (best[k], -k))
    (_, said), = draft_cap._CHOSEN.values()
    assert said == pytest.approx(best)
    assert env.unwrapped.server.config.actions.max_draft_len == chosen  # what each request's session drafts under


def _episode_return(env, action: int) -> float:
    env.reset(seed=1000)
    total, done = 0.0, False
    while not done:
        _, reward, terminated, truncated, _ = env.step(action)
        total, done = total + reward, terminated or truncated
    return total


def test_the_serving_evaluator_runs_its_rules_at_its_cap_and_agents_at_theirs():
    from agents.serve.evaluation import parse

    cfg = parse(["--actions", "max_draft_len=2"], QUICK)
    assert cfg.env.actions.max_draft_len == 2
    assert parse(["--actions", "max_draft_len=auto"], None).env.actions.max_draft_len == "auto"
    assert env_options(cfg, "test", "constant:0.1")["actions"].max_draft_len == 2
    assert "max_draft_len" in GRID["actions"]  # an agent's own cap overrides the rules' in its env
    assert env_options(cfg, "test", "constant:0.1", actions={"max_draft_len": 1})["actions"].max_draft_len == 1


def test_the_serving_trainer_saves_the_cap_its_envs_chose(tmp_path, monkeypatch, capsys):
    from tests.test_serving import train_serve as main

    monkeypatch.setattr(draft_cap, "_CHOSEN", {})
    monkeypatch.setattr(bild_env.serving.env, "SERVE_EPISODES", (1000,))  # one validation episode a load
    monkeypatch.setattr(draft_cap, "CANDIDATES", (1, 2))
    args = ["--pair", "qwen2.5-coder", "--pair-options", "dtype=float32", "--cost-profile",
            "xeon-amx-qwen2.5-coder-bf16", "--max-batch", "8", "--max-prompts", "2", "--episode-steps", "12",
            "--total-timesteps", "120", "--n-envs", "1", "--eval-freq", "0", "--eval-episodes", "1",
            "--hyperparams", "learning_starts=40", "batch_size=16", "--actions", "max_draft_len=auto",
            "--no-progress-bar", "--log-dir", str(tmp_path), "--run-name", "r"]
    assert main(args) == 0
    chosen = {c for c, _ in draft_cap._CHOSEN.values()}
    saved = json.loads((tmp_path / "r" / "config.json").read_text())["env"]["actions"]["max_draft_len"]
    assert chosen == {saved} and isinstance(saved, int)
    nxt = json.loads((tmp_path / "r" / "summary.json").read_text())["result"]["next"][0]
    assert f"  {nxt}" in capsys.readouterr().out.split("\nnext:\n", 1)[1]  # printed as saved
    # and that command, as printed (a small evaluation), ends with its table: the pair, the profile's batch, the cap
    from agents.commands import evaluate_main
    from tests.test_documented_commands import evaluate_in

    assert evaluate_main(evaluate_in(nxt, tmp_path / "eval.json")) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["complete"] is True and "qwen2.5-coder" in json.dumps(report)
    env = report["config"]["env"]
    assert (env["pair"], env["max_batch"], env["actions"]["max_draft_len"]) == (
        "qwen2.5-coder", 8, saved)  # the rules ran at the agent's cap, read from the run
