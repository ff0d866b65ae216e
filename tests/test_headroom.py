"""The headroom benchmark's ceilings on the toy pair: the orderings they must satisfy by construction."""

from __future__ import annotations

import numpy as np
import pytest

from bench import headroom


def test_oracles_bound_the_best_single_action_from_above(tmp_path):
    cfg = headroom.HeadroomConfig(split="validation", prompts=3, select_split="validation", select_prompts=3,
                                  lookahead=True, env={"pair": "tiny-random", "max_new_tokens": 12},
                                  out=str(tmp_path / "h.json"))
    report = headroom.run(cfg)
    best = report["best_single_action"]
    returns = {int(a): np.array(r) for a, r in report["per_prompt_returns"].items()}
    # chosen on the same prompts: no fixed action has a higher mean return
    assert all(returns[best].mean() >= r.mean() - 1e-12 for r in returns.values())
    rows = {r["policy"].split(" (")[0]: r for r in report["rows"]}
    oracle = rows["per-prompt oracle of fixed actions"]
    assert np.isclose(oracle["return"], np.stack(list(returns.values())).max(0).mean())
    assert oracle["minus_best_single"] >= -1e-12
    # one-step lookahead with rollouts of the best action never does worse than that action (policy improvement)
    assert rows["per-step oracle"]["minus_best_single"] >= -1e-12
    assert rows["per-step oracle"]["minus_best_single_ci95"][0] >= -1e-12
    assert "per-prompt oracle" in headroom.markdown(report)


def test_the_oracle_can_run_on_fewer_prompts_than_the_comparison(tmp_path):
    cfg = headroom.HeadroomConfig(split="test", prompts=3, select_split="validation", select_prompts=2,
                                  oracle_prompts=1, env={"pair": "tiny-random", "max_new_tokens": 8},
                                  out=str(tmp_path / "h.json"))
    report = headroom.run(cfg)
    best, counts = report["best_single_action"], {a: m["prompts"] for a, m in report["fixed"].items()}
    assert counts[best] == 3 and sorted(set(counts.values())) == [1, 3] and len(counts) == 25
    returns = {int(a): np.array(r) for a, r in report["per_prompt_returns"].items()}
    rows = {r["policy"].split(" (")[0]: r for r in report["rows"]}
    assert np.isclose(rows["best single action"]["return"], returns[best].mean())
    oracle = rows["per-prompt oracle of fixed actions"]
    assert np.isclose(oracle["return"], max(r[0] for r in returns.values()))  # prompt 0 only
    assert "(first 1 prompts)" in headroom.markdown(report)


def test_a_lookahead_over_some_actions_never_falls_below_its_base(make_env):
    from agents.bild.evaluation import Scripted, lookahead_returns, returns_on_prompts

    env = make_env(backend="replay", max_new_tokens=10).unwrapped
    prompts, base = [0, 1], 7
    fixed = returns_on_prompts(env, Scripted([], base), prompts).returns
    assert np.allclose(lookahead_returns(env, prompts, base, [base]), fixed)  # nothing else to pick: the base itself
    some = lookahead_returns(env, prompts, base, [base, 2, 12])
    assert np.all(some >= fixed - 1e-12)  # policy improvement, prompt by prompt


@pytest.mark.parametrize("argv, message", [
    (["--prompts", "0"], "--prompts must be an integer >= 1, got 0"),
    (["--oracle-prompts", "0"], "--oracle-prompts must be an integer >= 1"),
    (["--pair", "tiny-random", "--split", "nope", "--prompts", "1"], "unknown split 'nope'"),
    (["--pair", "tiny-random", "--model", "{missing}"], "no model file at"),
    (["--out", "{folder}"], "is a folder; give a file name"),
])
def test_bad_options_end_with_a_message_not_a_traceback(tmp_path, argv, message):
    argv = [a.format(missing=tmp_path / "missing", folder=tmp_path) for a in argv]
    out = argv if "--out" in argv else [*argv, "--out", str(tmp_path / "h.json")]
    with pytest.raises(SystemExit, match="^(bench.headroom|error): .*" + message.replace("(", r"\(")):
        headroom.main(out)


def test_agents_run_in_their_own_env_and_as_one_q_ensemble(tmp_path):
    """Two DQN runs on one env: each agent's row, and their Q-ensemble's; the same run given twice acts as itself.
    The agent observes the next proposal and reads the cumulative score (its run's), the fixed pairs the bench's."""
    from agents.commands import train_main

    tiny = ["--pair", "tiny-random", "--max-new-tokens", "8", "--n-envs", "2", "--torch-threads", "1",
            "--no-progress-bar", "--max-prompts", "4", "--eval-freq", "0", "--hyperparams", "learning_starts=20",
            "batch_size=16", "--observation", "foresee", "--actions", "score=cumulative"]
    assert train_main([*tiny, "--total-timesteps", "40", "--log-dir", str(tmp_path), "--run-name", "a"]) == 0
    cfg = headroom.HeadroomConfig(split="validation", prompts=2, select_split="validation", select_prompts=2,
                                  bandits=False, env={"pair": "tiny-random", "max_new_tokens": 8}, out=str(tmp_path / "h.json"),
                                  model=(str(tmp_path / "a"), str(tmp_path / "a" / "model.zip")))
    report = headroom.run(cfg)
    rows = {r["policy"]: r for r in report["rows"]}
    agent = rows[f"agent {tmp_path / 'a' / 'model.zip'}"]
    ensemble = rows["agents' Q-ensemble of 2"]
    assert ensemble["return"] == agent["return"]  # one model twice: its own greedy actions
    assert ensemble["minus_best_single_ci95"][0] <= ensemble["minus_best_single"] <= ensemble["minus_best_single_ci95"][1]
    # each on the best fixed action's floor, chosen on the select split: the best action itself unless a margin helped
    floors = report["floors"]
    assert len(floors) == 3 and all(set(f["validation_means"]) == {"0", "0.005", "0.01", "0.02", "0.05", "0.1", "inf"}
                                    for f in floors.values())
    for name, kept in floors.items():  # (in the agent's env: its score, so not the bench's best row's returns)
        floor = next(p for p in rows if p.startswith(f"{name} on the best fixed action's floor"))
        assert ("no margin helped" in floor) == (kept["margin"] == "inf")
        assert kept["validation_means"]["inf"] == pytest.approx(kept["validation_means"]["0"] - kept["gain_ci"]["0"][0])
    # bench.paper_table's agent rows: the same agents, each in its run's env, and their Q-ensemble (its own actions)
    from bench import paper_table
    from tests.test_profiles import linear_profile

    table = paper_table.main(["--pair", "tiny-random", "--prompts", "2", "--select-prompts", "2", "--max-new-tokens",
                              "8", "--cost-profile", str(linear_profile(tmp_path)), "--out", str(tmp_path / "t2.json"),
                              "--model", str(tmp_path / "a"), str(tmp_path / "a" / "model.zip")])
    methods = {r["method"]: r for r in table["rows"]}
    one = methods[f"BiLD + agent {tmp_path / 'a' / 'model.zip'}"]
    assert [r["method"] for r in table["rows"]][-3:] == [*[one["method"]] * 2, "BiLD + the agents' Q-ensemble of 2"]
    assert methods["BiLD + the agents' Q-ensemble of 2"]["per_prompt_latency_ms"] == one["per_prompt_latency_ms"]
    assert "minus_paper_fixed_ms_ci95" in one and "minus_best_pair_bleu" in one
    with pytest.raises(headroom.ConfigError, match="--actions score: score must be one of"):
        headroom.HeadroomConfig(env={"actions": {"score": "best"}})


def test_the_actions_option_sets_the_grid_every_policy_chooses_from(tmp_path):
    """``--actions`` as train.py's: the lossless grid and off give 6 fixed actions, the off one named so and worth
    the target alone (return 0); the paper's pair is not in that grid, so it has no row."""
    report = headroom.main(["--pair", "tiny-random", "--prompts", "2", "--select-prompts", "2", "--max-new-tokens", "8",
                            "--no-bandits", "--lookahead", "--actions", "rollback_values=0.5", "off_switch=1",
                            "--out", str(tmp_path / "h.json")])
    assert report["config"]["env"]["actions"]["rollback_values"] == (0.5,) and len(report["fixed"]) == 6
    assert report["names"][5] == "off" and report["thresholds"][5] is None
    assert report["fixed"][5]["return"] == pytest.approx(0.0, abs=1e-12) and report["fixed"][5]["regret"] == 0.0
    assert [r["policy"].split(" (")[0] for r in report["rows"]] == [
        f"best single action {report['names'][report['best_single_action']]}", "per-prompt oracle of fixed actions",
        "per-step oracle"]
    assert "\n   5 off: " in headroom.markdown(report)
    from bild_env.command import UsageError

    with pytest.raises(UsageError, match="--actions 'nope=1': give KEY=VALUE, KEY one of fallback_values, "):
        headroom.main(["--actions", "nope=1", "--out", str(tmp_path / "h.json")])


@pytest.mark.parametrize("bench", ["headroom", "paper_table"])
def test_the_benches_take_the_envs_own_arguments_and_refuse_the_old_spellings(bench, capsys, tmp_path):
    """``--pair-options dtype=...`` and ``--reward quality=...`` as train.py spells them; the flat ``--dtype`` and
    ``--quality`` the benches once restated exit 2 naming the option that holds them now."""
    import importlib

    module = importlib.import_module(f"bench.{bench}")
    config = module.HeadroomConfig if bench == "headroom" else module.PaperTableConfig
    cfg = headroom.parse_bench(config, module.ENV_OPTIONS, ["--pair", "tiny-random", "--pair-options", "dtype=bfloat16",
                                                             "--max-new-tokens", "8", "--out", str(tmp_path / "o.json")], "")
    assert (cfg.env.pair, cfg.env.pair_options.dtype, cfg.env.max_new_tokens, cfg.env.backend) == (
        "tiny-random", "bfloat16", 8, "replay")
    for old, new in (("--dtype", "--pair-options dtype=VALUE"), ("--quality", "--reward quality=VALUE")):
        with pytest.raises(SystemExit) as stop:
            module.main([old, "bleu" if old == "--quality" else "bfloat16"])
        assert stop.value.code == 2 and new in capsys.readouterr().err
