"""The serving evaluation (`evaluate.py --env serve`, `agents.serve.evaluation`) on the tiny pair: rules chosen on validation, judged on test beside the oracle."""

import json
from pathlib import Path

import numpy as np
import pytest

from tests.test_serving import make_serve, workload  # noqa: F401 (fixtures)


def test_serving_bench_runs_rules_and_oracle(tmp_path, monkeypatch, capsys):
    import bild_env.decoding.costs as costs
    from tests.test_serving import evaluate_serve as main
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())  # no timing in a test

    out = tmp_path / "serving.json"
    report = main(["--pair", "tiny-random", "--levels", "0.1", "1.0", "--moving", "burst:0.1,1.0",
                   "--domains", "prose", "--select-episodes", "2", "--episodes", "2", "--episode-steps", "8",
                   "--max-new-tokens", "8", "--max-batch", "4", "--fixed-actions", "0", "15", "--max-prompts", "6",
                   "--step-oracle", "--out", str(out)])
    assert json.loads(out.read_text())["levels"].keys() == {"0.1", "1.0"}
    for rows in list(report["levels"].values()) + list(report["moving"].values()):
        by = {r["policy"].split(" (")[0].split(",")[0]: r for r in rows}
        assert by["speculation off"]["speedup"] == pytest.approx(1.0)
        assert by["per-episode oracle of the fixed actions"]["minus_best_single"] >= 0.0
        assert "per-step hindsight oracle of the fixed actions" in by
        assert "per-batch-size table" in by
        assert by["per-load table"]["minus_table"] == 0.0 and "minus_table_ci" in rows[-1]
        batch = by["per-batch-size table"]
        assert batch["minus_batch_table"] == 0.0 and batch["minus_batch_table_ci"] == [0.0, 0.0]
        # paired: the per-load table minus the batch-size table is the negative of the batch-size table minus it
        assert by["per-load table"]["minus_batch_table"] == pytest.approx(-batch["minus_table"])
        assert rows[0]["minus_best_single"] == 0.0
    assert set(report["chosen"]["table"]) == {"0.1", "1.0"}
    assert report["domains"]["prose"]["levels"].keys() == {"0.1", "1.0"}
    # the per-domain table runs on test as a rule: prose's from its own validation runs, the other domains the
    # per-load table's action
    domain_table = report["chosen"]["domain_table"]
    assert set(domain_table) == {"0.1", "1.0"} and all(set(t) == {"prose", "code", "chat"} for t in domain_table.values())
    for u, t in domain_table.items():
        assert t["code"] == t["chat"] == report["chosen"]["table"][u]
        assert t["prose"] == report["domains"]["prose"]["levels"][u]["table"]
    for rows in list(report["levels"].values()) + list(report["moving"].values()):
        assert any(r["policy"].startswith("per-domain-and-load table, per request") for r in rows)
        assert any(r["policy"].startswith("per-batch-size-and-domain table, per request") for r in rows)
        by = {r["policy"].split(" (")[0].split(",")[0]: r for r in rows}
        domain_batch = by["per-batch-size-and-domain table"]
        assert domain_batch["minus_domain_batch_table"] == 0.0 and all("minus_domain_batch_table" in r for r in rows)
        assert by["per-batch-size table"]["minus_domain_batch_table"] == pytest.approx(-domain_batch["minus_batch_table"])
    assert report["chosen"]["domain_batch_table"] and all(
        set(v) == {"(0.103, 0.5)", "(0.45, 0.5)", "off"} for v in report["chosen"]["domain_batch_table_means"].values())
    assert report["machine"]
    printed = capsys.readouterr().out
    assert "minus per-batch-size table" in printed and "minus per-(batch size, domain) table" in printed


def test_per_domain_table_on_a_one_domain_mix_is_the_per_load_table(tmp_path, monkeypatch):
    """With one domain in the mix the per-domain table is chosen on the very episodes the per-load table is, so it
    picks the same actions and, run per request, returns exactly what the per-load table does."""
    import bild_env.decoding.costs as costs
    from tests.test_serving import evaluate_serve as main
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())
    report = main(["--pair", "tiny-random", "--mix", "prose:1", "--domains", "prose", "--levels", "0.1", "1.0",
                   "--moving", "burst:0.1,1.0", "--select-episodes", "2", "--episodes", "2", "--episode-steps", "8",
                   "--max-new-tokens", "8", "--max-batch", "4", "--fixed-actions", "0", "15", "--max-prompts", "6",
                   "--out", str(tmp_path / "one.json")])
    assert report["chosen"]["domain_table"] == {u: {"prose": a} for u, a in report["chosen"]["table"].items()}
    for rows in report["levels"].values():
        by = {r["policy"].split(" (")[0].split(",")[0]: r for r in rows}
        assert by["per-domain-and-load table"]["minus_table"] == 0.0
        assert by["per-domain-and-load table"]["minus_table_ci"] == [0.0, 0.0]
        # one domain: the per-domain batch-size table is the batch-size table's best reply, chosen on the states the
        # batch-size table visits, with the same exact counterfactuals: the same table, the same returns
        assert by["per-batch-size-and-domain table"]["minus_batch_table"] == 0.0


def test_serving_bench_refuses_actions_outside_the_grid():
    from agents.serve.selection import action_set
    with pytest.raises(ValueError, match="--actions"):
        action_set(type("E", (), {"n_chain_actions": 26, "tree_rules": ()})(), (30,))


def test_serving_bench_speed_reports_warm_steps_per_second(tmp_path, monkeypatch):
    import bild_env.decoding.costs as costs
    from tests.test_serving import evaluate_serve as main
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())
    report = main(["--pair", "tiny-random", "--speed", "--levels", "0.2", "1.0", "--episode-steps", "8",
                   "--max-new-tokens", "8", "--max-batch", "4", "--mix", "prose:1", "--out", str(tmp_path / "s.json")])
    assert report["speed"].keys() == {"0.2", "1.0"}
    assert all(r["steps_per_s"] > 0 and 1 <= r["mean_batch"] <= 4 for r in report["speed"].values())
    assert all(r["range"][0] <= r["steps_per_s"] <= r["range"][1] for r in report["speed"].values())


def test_evaluate_env_serve_reports_every_load_overall_and_plots_goodput(tmp_path, monkeypatch):
    import bild_env.decoding.costs as costs
    from agents.commands import evaluate_main as main
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())
    out = tmp_path / "serve.json"
    assert main(["--env", "serve", "--pair", "tiny-random", "--levels", "0.1", "1.0", "--moving", "burst:0.1,1.0",
                 "--select-episodes", "2", "--episodes", "3", "--episode-steps", "6", "--max-new-tokens", "6",
                 "--max-batch", "4", "--fixed-actions", "15", "--max-prompts", "6", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    names = [r["policy"].split(" (")[0].split(",")[0] for r in report["levels"]["0.1"]]
    overall = {r["policy"]: r for r in report["overall"]}
    assert list(overall) == names  # one overall row per policy, paired over both levels' episodes
    for name in names:
        per_level = [next(r for r in report["levels"][u] if r["policy"].startswith(name)) for u in ("0.1", "1.0")]
        assert overall[name]["return"] == pytest.approx(sum(r["return"] for r in per_level) / 2)  # equal episodes
    assert overall[names[0]]["minus_best_single"] == 0.0
    assert out.with_suffix(".png").stat().st_size > 0


def test_serving_bench_runs_a_trained_agent_beside_the_rules(tmp_path, monkeypatch):
    """A run folder given to --model: its best model is loaded against the env's spaces and gets rows."""
    import bild_env.decoding.costs as costs
    from tests.test_serving import train_serve as train
    from tests.test_serving import evaluate_serve as main
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())
    env = ["--pair", "tiny-random", "--max-new-tokens", "6", "--max-batch", "4", "--episode-steps", "6",
           "--max-prompts", "6"]
    assert train(env + ["--total-timesteps", "48", "--n-envs", "2", "--eval-freq", "24", "--eval-episodes", "1",
                        "--hyperparams", "learning_starts=8", "batch_size=8", "--no-progress-bar", "--actions", "rollback_values=0.5",
                        "--log-dir", str(tmp_path), "--run-name", "a"]) == 0  # its own grid: 5 lossless pairs + off
    report = main(env + ["--levels", "0.5", "--moving", "burst:0.1,1.0", "--select-episodes", "1", "--episodes", "2",
                         "--fixed-actions", "15", "--model", str(tmp_path / "a"), str(tmp_path / "a"),
                         "--out", str(tmp_path / "s.json")])
    for rows in (report["levels"]["0.5"], report["moving"]["burst:0.1,1.0"], report["overall"]):
        by = {r["policy"]: r for r in rows}
        assert "minus_best_single_ci" in by["agent a"]
        assert by[f"agent {tmp_path / 'a'}"]["return"] == by["agent a"]["return"]  # one name per row
        # two DQNs on one grid also act as one (their mean Q-values): the same model twice acts as itself
        assert by["agents' Q-ensemble of 2"]["return"] == by["agent a"]["return"]
        # ... and each on the per-batch-size table's floor: departing from it only where validation shows a gain
        table = by[next(n for n in by if n.startswith("per-batch-size table"))]["return"]
        for name, floor in report["chosen"]["floors"].items():
            row = by[next(n for n in by if n.startswith(f"{name} on the per-batch-size table's floor"))]
            if floor["margin"] == "inf":
                assert row["return"] == table
    floors = report["chosen"]["floors"]
    assert set(floors) == {"agent a", f"agent {tmp_path / 'a'}", "agents' Q-ensemble of 2"}
    assert all(set(f["validation_means"]) == {"0", "0.005", "0.01", "0.02", "0.05", "0.1", "inf"} for f in floors.values())


def test_the_rule_floor_keeps_a_margin_only_where_its_gain_clears_the_interval():
    from agents.serve.selection import keep_where_it_helps

    rule = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    noisy = rule + np.array([0.5, -0.4, 0.3, -0.2, 0.4, -0.3])  # the best mean of the margins, gain not sure (+0.05)
    sure = rule + np.array([0.02, 0.03, 0.02, 0.04, 0.03, 0.02])  # a small gain on every episode
    worse = rule - 0.1
    kept = keep_where_it_helps(rule, {0.0: noisy, 0.01: worse})
    assert kept["margin"] == np.inf  # nothing beat the rule beyond noise: the agent is the rule
    assert kept["validation_means"]["inf"] == 3.5 and kept["gain_ci"]["0.01"][0] == pytest.approx(-0.1)
    assert keep_where_it_helps(rule, {0.0: noisy, 0.01: worse, 0.05: sure})["margin"] == 0.05
    assert keep_where_it_helps(rule, {0.0: sure, 0.05: sure})["margin"] == 0.05  # equal gains: the larger margin


def test_table_guard_departs_from_the_rule_only_above_the_margin():
    from agents.serve.rules import BatchTable, TableGuard

    rule = BatchTable({0: 2}, off=3, max_batch=4)  # batch 1: action 2, else off (3)
    q = {1: [0.0, 0.30, 0.25, 0.0], 2: [0.9, 0.0, 0.0, 0.1]}  # the agent's Q-values by the observed batch size
    q_values = lambda obs: np.array([q[round(o[0] * 4)] for o in np.atleast_2d(obs)])  # noqa: E731
    batch1, batch2 = np.array([0.25, 0.0]), np.array([0.5, 0.0])
    acts = lambda m, obs: int(TableGuard(q_values, rule, {a: a for a in range(4)}, m).predict(obs)[0])  # noqa: E731
    assert [acts(0.0, batch1), acts(0.0, batch2)] == [1, 0]  # margin 0: the agent's greedy action
    assert [acts(0.1, batch1), acts(0.1, batch2)] == [2, 0]  # 0.30 - 0.25 is not above 0.1; 0.9 - 0.1 is
    assert [acts(np.inf, batch1), acts(np.inf, batch2)] == [2, 3]  # inf: the rule
    both = TableGuard(q_values, rule, {a: a for a in range(4)}, 0.1).predict(np.stack([batch1, batch2]))[0]
    assert both.tolist() == [2, 0]  # a batch of observations, one action each
    shifted = TableGuard(q_values, rule, {0: 0, 1: 1, 2: 1, 3: 3}, np.inf)  # the rule's 2 is the agent's 1
    assert int(shifted.predict(batch1)[0]) == 1


def test_batch_table_reads_the_batch_size_bucket():
    from agents.serve.rules import BatchTable, batch_bucket, bucket_label

    assert [batch_bucket(b) for b in (0, 1, 2, 3, 4, 5, 8, 9, 16, 17, 32)] == [0, 0, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert [bucket_label(k) for k in range(6)] == ["1", "2", "3-4", "5-8", "9-16", "17-32"]
    rule = BatchTable({0: 11, 1: 21, 2: 3}, off=25, max_batch=32)
    obs = lambda b: [b / 32] + [0.0] * 13  # noqa: E731
    assert [int(rule.predict(obs(b))[0]) for b in (1, 2, 3, 4, 5, 32)] == [11, 21, 3, 3, 25, 25]


def test_step_hindsight_takes_each_steps_best_reward_and_leaves_the_episode_as_it_was(make_serve):
    from agents.serve.rules import Fixed, StepHindsight, run_serving_episode

    actions = [0, 7, 15, 25]
    env = make_serve(load="constant:0.1")
    policy = StepHindsight(env, actions)
    obs, _ = env.reset(seed=3)
    chose_on = 0
    for _ in range(24):
        _, rewards, _ = env.unwrapped.peek(actions)
        a, _ = policy.predict(obs)
        assert a == actions[int(np.argmax(rewards))]
        chose_on += int(a) != 25
        obs, reward, terminated, truncated, _ = env.step(int(a))
        assert reward == pytest.approx(rewards.max(), abs=1e-12)  # peeking twice changed nothing
        if terminated or truncated:
            break
    assert chose_on > 0  # speculation won some steps
    # and an episode of it is one of the same episode's runs: the seed meets the same requests
    again = run_serving_episode(env, policy, 3)
    fixed = [run_serving_episode(env, Fixed(a), 3).rewards[0] for a in actions]
    assert again.rewards[0] == pytest.approx(max(fixed), abs=1e-12)
    with pytest.raises(ValueError, match="at least one action"):
        StepHindsight(env, [])


def test_batch_table_is_chosen_from_exact_counterfactuals(make_serve):
    from agents.serve.rules import Fixed, choose_batch_table

    env = make_serve(load="burst:0.2,1.5")
    table, means = choose_batch_table([env], [Fixed(25)], [0, 1], [0, 7, 15, 25])
    assert means and set(table) == set(means)
    for k, m in means.items():
        assert m[25] == pytest.approx(0.0, abs=1e-9)  # speculation off scores exactly 0 in every state
        assert table[k] == max(m, key=m.get)


def test_whole_episodes_choose_the_batch_table_among_its_step_rewards_best_and_the_off_above_batch_rules(make_serve):
    from agents.common.stats import mean_ci
    from agents.serve.rules import (BatchTable, Fixed, choose_batch_table, off_above_tables, refine_batch_table,
                                    returns_of, table_label)

    env = make_serve(load="burst:0.2,1.5")
    seeds, off = [0, 1, 2, 3], 25
    first, means = choose_batch_table([env], [Fixed(off)], seeds, [0, 7, 15, off])
    starts = off_above_tables(list(means), 7, off)
    assert starts[0] == {k: off for k in means} and starts[-1] == {k: 7 for k in means}
    assert [sum(a == 7 for a in t.values()) for t in starts] == list(range(len(means) + 1))

    def per_episode(table):
        return returns_of(env, BatchTable(table, off, env.unwrapped.config.max_batch), seeds)[0]

    # from the step rewards' table and the rules, and from always on alone (on this toy pair speculation loses:
    # whole episodes turn it off bucket by bucket)
    for begin, others in ((first, starts), (starts[-1], [])):
        ran: list[int] = []
        chosen, tried = refine_batch_table([env], seeds, begin, off, means, others, counted=ran.append)
        for table, mean in tried:  # each table's mean return over the same episodes, run once
            assert mean == pytest.approx(per_episode(table).mean(), abs=1e-12)
        assert len({table_label(t, off) for t, _ in tried}) == len(tried) and sum(ran) == len(tried) * len(seeds)
        # by hand: the best start by mean, then one bucket at a time (its 2 best by step reward, or off), a change
        # kept only where its paired gain's interval is above zero
        n_starts = len({table_label(t, off) for t in [begin, *others]})
        best = max([begin, *others], key=lambda t: per_episode(t).mean())
        for table, _ in tried[n_starts:]:
            (k,) = {k for k in set(best) | set(table) if best.get(k, off) != table.get(k, off)}
            assert table[k] == off or table[k] in sorted(means[k], key=lambda a: -means[k][a])[:2]
            if mean_ci(per_episode(table) - per_episode(best))[0] > 0:
                best = table
        assert table_label(chosen, off) == table_label(best, off)
        assert per_episode(chosen).mean() >= max(per_episode(t).mean() for t in [begin, *others])
    assert table_label(chosen, off) != table_label(starts[-1], off)  # a change was kept


def test_serving_validation_script_runs_rules_on_validation_seeds(monkeypatch, capsys):
    import bild_env.decoding.costs as costs
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())
    results = _script("serving_validation").main(
        ["--pair", "tiny-random", "--levels", "0.05", "1.0", "--episodes", "2", "--episode-steps", "4",
         "--max-prompts", "6", "--table", "0.05:15", "--batch-table", "0:15"])
    assert set(results) == {"off", "per-load table", "per-batch-size table"}
    assert all(len(parts) == 2 and all(len(p) == 2 for p in parts) for parts in results.values())
    assert np.allclose(np.concatenate(results["off"]), 0.0, atol=1e-9)  # speculation off scores exactly 0
    assert np.allclose(results["per-load table"][1], 0.0, atol=1e-9)  # level 1.0 is not in the table: off
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    # speculation off never speculates; the per-batch-size table (batch 1: (0.45, 0.5)) at every batch-1 step, never at 2
    import re
    off = re.findall(r"b1 (\d+)/(\d+) b2 (\d+)/(\d+)", lines["off"])
    table = re.findall(r"b1 (\d+)/(\d+) b2 (\d+)/(\d+)", lines["per-batch-size"])
    assert len(off) == len(table) == 2
    assert all(b1 == "0" and b2 == "0" for b1, _, b2, _ in off)
    assert all(b1 == n1 and b2 == "0" for b1, n1, b2, _ in table)
    assert sum(int(n1) + int(n2) for _, n1, _, n2 in table) > 0  # the counts saw some small batches


def test_serving_validation_overrides_the_table_only_above_the_margin(monkeypatch, capsys, tmp_path):
    """--override-margins: with a margin no Q-value gap reaches, the ensemble never overrides the table (the same
    returns, episode by episode); --by-bucket prints every action's mean step reward per bucket of its episodes."""
    import bild_env.decoding.costs as costs
    from tests.test_serving import train_serve as train_main
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())
    runs = []
    for seed in (0, 1):
        assert train_main(["--pair", "tiny-random", "--total-timesteps", "120", "--n-envs", "2", "--eval-freq", "0",
                           "--max-new-tokens", "8", "--max-batch", "4", "--episode-steps", "8", "--max-prompts", "6",
                           "--hyperparams", "learning_starts=40", "batch_size=16", "--no-progress-bar", "--seed", str(seed),
                           "--log-dir", str(tmp_path), "--run-name", f"s{seed}"]) == 0
        runs.append(str(tmp_path / f"s{seed}"))
    results = _script("serving_validation").main(
        ["--pair", "tiny-random", "--levels", "0.05", "--episodes", "2", "--episode-steps", "4", "--max-prompts", "6",
         "--table", "0.05:15", "--batch-table", "0:15", "--override-margins", "1e9", "--by-bucket", *runs])
    assert {"Q-ensemble", "table, ensemble > 1e+09"} <= set(results)
    assert np.array_equal(results["table, ensemble > 1e+09"][0], results["per-batch-size table"][0])
    out = capsys.readouterr().out
    assert "load 0.05 bucket 1:" in out and "best" in out and "Q-ensemble" in out


def _script(name: str):
    """One of the one-off analyses the results cite (``scripts/analysis/<name>.py``)."""
    import importlib

    return importlib.import_module(f"scripts.analysis.{name}")


def test_predictability_fits_features_by_hand():
    script = _script("serving_predictability")
    assert script.features(np.array([[2.0, 3.0]])).tolist() == [[1.0, 2.0, 3.0, 4.0, 6.0, 9.0]]
    x = np.random.default_rng(0).normal(size=(50, 2))
    y = np.stack([1.0 + 2.0 * x[:, 0] - x[:, 0] * x[:, 1], -3.0 * x[:, 1] ** 2], axis=1)
    w = script.fit_ridge(script.features(x), y, ridge=0.0)
    assert np.allclose(script.features(x) @ w, y) and np.allclose(script.r_squared(y, script.features(x) @ w), 1.0)
    assert script.r_squared(y, np.broadcast_to(y.mean(0), y.shape)) == pytest.approx([0.0, 0.0])
    choice = script.FittedChoice(np.array([[-1.0, 0.5], [0.0, 0.0], [0.0, 0.0]]), [3, 7, 25], off=25)  # rows: 1, x, x^2
    assert choice.predict(np.array([0.0]))[0] == 7  # the highest predicted advantage, above 0
    assert script.FittedChoice(-np.ones((3, 2)), [3, 7, 25], off=25).predict(np.array([0.0]))[0] == 25  # none above 0


def test_predictability_script_runs_on_the_tiny_pair(monkeypatch, capsys, tmp_path):
    import bild_env.decoding.costs as costs
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())
    report = _script("serving_predictability").main(
        ["--pair", "tiny-random", "--levels", "0.1", "1.0", "--episodes", "2", "--episode-steps", "6", "--max-prompts", "6",
         "--actions", "0", "15", "--batch-table", "0:15", "--out", str(tmp_path / "p.json")])
    assert report["steps"] == {"fit": 24, "test": 24}
    import json

    assert json.loads((tmp_path / "p.json").read_text())["steps"] == report["steps"]  # 2 levels x 2 episodes x 6 steps each
    assert set(report["r2"]) == {"(0.103, 0.5)", "(0.45, 0.5)"}
    assert set(report["levels"]) == {0.1, 1.0}
    for name in ("per-batch-size table", "fitted choice", "per-step hindsight oracle"):  # equal episodes per level
        assert report[name]["return"] == pytest.approx(np.mean([report["levels"][u][name] for u in (0.1, 1.0)]))
    assert "fitted choice = hindsight best" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        _script("serving_predictability").main(["--pair", "tiny-random", "--episodes", "1"])


def test_predictability_preview_reads_the_drafts_confidence_and_leaves_the_episode_as_it_was(make_serve):
    script = _script("serving_predictability")
    env = make_serve(load="constant:0.8")
    obs, _ = env.reset(seed=5)
    for _ in range(6):
        _, rewards, _ = env.unwrapped.peek([0, 25])
        mean, least = script.preview(env.unwrapped)
        assert 0.0 < least <= mean <= 1.0
        assert script.preview(env.unwrapped) == [mean, least]  # reading twice reads the same
        obs, reward, terminated, truncated, _ = env.step(0)
        assert reward == pytest.approx(rewards[0], abs=1e-12)  # the step after it is the step peeked
        if terminated or truncated:
            break


def test_the_batch_size_reads_back_on_either_scale():
    import math

    from bild_env.serving.observations import batch_feature, batch_from_feature

    assert batch_feature(1, 32, "log") == pytest.approx(1 / math.log2(33))  # log2(1 + 1) / log2(1 + 32)
    assert batch_feature(32, 32, "log") == pytest.approx(1.0) and batch_feature(0, 32, "log") == 0.0
    assert batch_feature(2, 32, "log") - batch_feature(1, 32, "log") > 3 * (batch_feature(2, 32, "linear") - 1 / 32)
    for scale in ("linear", "log"):
        as_observed = [float(np.float32(batch_feature(b, 32, scale))) for b in range(33)]  # the env observes float32
        assert [batch_from_feature(v, 32, scale) for v in as_observed] == list(range(33))


def test_rules_act_alike_whatever_scale_the_env_observes_the_batch_on(make_serve):
    """The batch-size rules read the batch on the env's scale: on the same seeds they take the same actions and
    return exactly the same with ``batch_scale="log"`` as with the linear default; only observation 0 differs."""
    from agents.serve.rules import BatchTable, OffAboveBatch, returns_of

    linear, log = make_serve(load="burst:0.2,1.5"), make_serve(load="burst:0.2,1.5", observe={"batch_scale": "log"})
    for make_rule in (lambda env: BatchTable({0: 15, 1: 7}, 25, 8, env.unwrapped.config.observe.batch_scale),
                      lambda env: OffAboveBatch(15, 25, 2, 8, env.unwrapped.config.observe.batch_scale)):
        r_lin, _, eps_lin = returns_of(linear, make_rule(linear), [0, 1])
        r_log, _, eps_log = returns_of(log, make_rule(log), [0, 1])
        assert np.array_equal(r_lin, r_log)
        assert [e.actions for e in eps_lin] == [e.actions for e in eps_log]
        assert [e.observed_batches for e in eps_lin] == [e.observed_batches for e in eps_log]
        assert any(a == 15 for e in eps_lin for a in e.actions) and any(a == 25 for e in eps_lin for a in e.actions)
    o_lin, _ = linear.reset(seed=3)
    o_log, _ = log.reset(seed=3)
    b = round(float(o_lin[0]) * 8)
    assert b >= 1 and o_log[0] == pytest.approx(np.log2(1 + b) / np.log2(9)) and np.array_equal(o_lin[1:], o_log[1:])


def test_a_run_saved_before_batch_scale_reads_the_batch_linearly(tmp_path):
    from agents.serve.evaluation_agents import agent_grid
    from agents.serve.options import saved_configs

    (tmp_path / "config.json").write_text(json.dumps({"env_id": "BiLD-Serve-v0", "format": 2, "train": {"seed": 0, "run_name": "old"},
                                                      "env": {"pair": "tiny-random"}}))
    assert saved_configs(tmp_path)[1].observe.batch_scale == "linear"
    assert agent_grid(tmp_path / "best_model.zip")["observe"]["batch_scale"] == "linear"
    (tmp_path / "config.json").write_text(json.dumps({"env_id": "BiLD-Serve-v0", "format": 2, "train": {"seed": 0, "run_name": "old"},
                                                      "env": {"pair": "tiny-random", "batch_scale": "log"}}))
    assert agent_grid(tmp_path / "best_model.zip")["observe"]["batch_scale"] == "log"  # its env is built on it


def test_an_agent_keeps_its_runs_grid_whatever_the_rules_are_given(tmp_path):
    """The rules' env takes the evaluation's ``--actions`` (here another fallback grid and draft cap); an agent's env is
    the evaluation's with its run's whole grid, observation and score over it, so those never reach the agent."""
    from agents.serve.bench_config import QUICK, env_options
    from agents.serve.evaluation import parse
    from agents.serve.evaluation_agents import agent_grid
    from bild_env.config import FALLBACK_VALUES

    (tmp_path / "config.json").write_text(json.dumps({"env_id": "BiLD-Serve-v0", "format": 2, "train": {
        "seed": 0, "run_name": "r"}, "env": {"pair": "tiny-random", "actions": {"rollback_values": [0.5]}}}))
    cfg = parse(["--pair", "tiny-random", "--actions", "fallback_values=0.2,0.4", "max_draft_len=3",
                 "--fixed-actions", "0", "1"], QUICK)
    rules = env_options(cfg, "test", "constant:0.5")["actions"]
    agent = env_options(cfg, "test", "constant:0.5", **agent_grid(tmp_path / "best_model.zip"))["actions"]
    assert (rules.fallback_values, rules.max_draft_len) == ((0.2, 0.4), 3)
    assert (agent.fallback_values, agent.rollback_values, agent.max_draft_len) == (FALLBACK_VALUES, (0.5,), 10)


@pytest.mark.parametrize("argv, says", [(["--test-mix", "prose:-1"], "--test-mix"),
                                        (["--mix", "fiction:1"], "mix 'fiction:1': unknown domain"),
                                        (["--test-mix", "prose,long", "--domains", "prose", "code"], "['long']"),
                                        (["--test-code-source", "github"], "--test-code-source"),
                                        (["--actions", "score=best"], "score must be one of")])
def test_serving_bench_refuses_a_bad_test_mix_before_any_model_loads(argv, says, monkeypatch, capsys):
    import agents.serve.evaluation as bench

    monkeypatch.setattr(bench, "run", lambda cfg, *_: (_ for _ in ()).throw(AssertionError("ran")))
    with pytest.raises(SystemExit) as exc:
        bench.ServingEvaluation.from_argv(["--pair", "tiny-random"] + argv)
    assert says in str(exc.value) and "error:" in str(exc.value)


def test_test_mix_meets_the_rules_with_a_workload_they_were_not_chosen_on(monkeypatch):
    import agents.serve.bench_config as bench

    made = []
    monkeypatch.setattr(bench, "ServingEnv", lambda **kw: made.append((kw["split"], kw["mix"], kw["code_source"])))
    env = bench.ServingConfig(pair="tiny-random", mix="prose:1")
    cfg = bench.ServingBenchConfig(env=env, test_mix="code:1", test_code_source="stdlib")
    for split in ("train", "validation", "test"):
        bench.make_env(cfg, split, "constant:0.5")
    bench.make_env(bench.ServingBenchConfig(env=env), "test", "constant:0.5")
    bench.make_env(cfg, "test", "constant:0.5", mix="chat:1")  # a mix given for one env (per-domain runs) wins
    assert made == [("train", "prose:1", "humaneval"), ("validation", "prose:1", "humaneval"),
                    ("test", "code:1", "stdlib"), ("test", "prose:1", "humaneval"), ("test", "chat:1", "stdlib")]


def test_the_rules_read_the_score_given_and_an_agent_its_runs(monkeypatch):
    """--actions score=S sets every rule's env; an agent's env takes its run's score (agent_grid always carries it)."""
    import agents.serve.bench_config as bench

    made = []
    monkeypatch.setattr(bench, "ServingEnv", lambda **kw: made.append(kw["actions"].score))
    cfg = bench.ServingBenchConfig(env=bench.ServingConfig(pair="tiny-random", actions={"score": "cumulative"}))
    bench.make_env(cfg, "validation", "constant:0.5")
    bench.make_env(cfg, "test", "constant:0.5", actions={"score": "token"})  # an agent's grid, from its run
    bench.make_env(bench.ServingBenchConfig(env=bench.ServingConfig(pair="tiny-random")), "test", "constant:0.5")
    assert made == ["cumulative", "token", "token"]


def test_evaluate_env_serve_counts_every_episode_and_writes_each_load_as_it_is_done(tmp_path, monkeypatch, capsys):
    """One progress line for the whole evaluation, its total counted before the first episode (by hand: 2 levels x 2
    validation episodes x (2 fixed actions + 7 rules + the per-batch-size table's step rewards + each table whole
    episodes tried) = 40 + 4 a table, then (2 levels + 1 moving load) x 2 test episodes x (2 fixed actions + 4 rules)
    = 36); a run stopped during the second load keeps the first load's table (printed) and JSON ("complete": false)."""
    import bild_env.decoding.costs as costs
    import agents.serve.evaluation as se
    from agents.commands import evaluate_main as main
    from agents.serve.bench_config import QUICK, ServingBenchConfig
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())
    monkeypatch.setattr(se, "EVERY_S", 0.0)  # a progress line per episode
    out = tmp_path / "serve.json"
    argv = ["--env", "serve", "--pair", "tiny-random", "--levels", "0.1", "1.0", "--moving", "burst:0.1,1.0",
            "--select-episodes", "2", "--episodes", "2", "--episode-steps", "6", "--max-new-tokens", "6",
            "--max-batch", "4", "--fixed-actions", "15", "--max-prompts", "6", "--out", str(out)]
    assert main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("evaluation: ")]
    # before the tables are tried, at most: 1 table + "off above batch" tables of the one action other than off
    # (4 thresholds: always off, above 1, 2, 4) + 3 buckets x 3 tries
    planned_at_most = 76 + 4 * (1 + 4 + 9)
    counts = [tuple(int(x) for x in line.split()[1].split("/")) for line in lines]
    report = json.loads(out.read_text())
    total = 76 + 4 * len(report["chosen"]["batch_table_scores"])
    assert counts[-1] == (total, total) and {t for _, t in counts} <= {total, planned_at_most}
    assert [done for done, _ in counts] == sorted({done for done, _ in counts})
    assert "estimating" in lines[0] and "left" in lines[-1]
    assert report["complete"] is True and report["config"]["bandits"] is False  # QUICK's, where the line is silent

    real = se.test_rows

    def stopped_at_the_second_load(cfg, chosen, agents, seeds, load, raw=None):
        if load != "constant:0.1":
            raise KeyboardInterrupt
        return real(cfg, chosen, agents, seeds, load, raw)

    monkeypatch.setattr(se, "test_rows", stopped_at_the_second_load)
    with pytest.raises(KeyboardInterrupt):
        main(argv + ["--force"])
    kept = json.loads(out.read_text())
    assert kept["complete"] is False and list(kept["levels"]) == ["0.1"] and kept["levels"]["0.1"] == report["levels"]["0.1"]
    printed = capsys.readouterr().out
    assert "**load 0.1**" in printed and "**load 1.0**" not in printed


def test_evaluate_env_serve_is_quick_unless_full(tmp_path, monkeypatch):
    """``python evaluate.py --env serve`` starts from QUICK; with --full from the bench's defaults."""
    from dataclasses import replace

    import agents.serve.evaluation as se
    from agents.commands import evaluate_main as main
    from agents.serve.bench_config import QUICK, ServingBenchConfig

    seen = []

    def record(cfg, done=None, say=None):
        seen.append(cfg)
        raise KeyboardInterrupt

    monkeypatch.setattr(se, "run", record)
    out = str(tmp_path / "s.json")
    for extra in ([], ["--full"]):
        with pytest.raises(KeyboardInterrupt):
            main(["--env", "serve", "--pair", "tiny-random", "--out", out, *extra])
    assert seen == [replace(base, out=out, env=replace(base.env, pair="tiny-random"))
                    for base in (QUICK, ServingBenchConfig())]
    assert seen[0].bandits is False and seen[0].fixed_actions == (0, 5, 10, 15, 20) and seen[1].bandits is True
    assert (seen[0].env.episode_steps, seen[0].env.max_prompts, seen[1].env.episode_steps) == (64, 40, 128)


def test_an_evaluation_of_a_run_is_written_beside_the_run(tmp_path):
    from dataclasses import replace

    from agents.serve.bench_config import DEFAULT_OUT, ServingBenchConfig, outputs

    run = tmp_path / "logs" / "run"
    (run / "checkpoints").mkdir(parents=True)
    cfg = ServingBenchConfig()
    assert outputs(replace(cfg, model=(str(run), "other"))) == (run / "evaluation.json", run / "evaluation.png")
    assert outputs(replace(cfg, model=(str(run / "checkpoints" / "m.zip"),)))[0] == run / "evaluation.json"
    assert outputs(replace(cfg, model=(str(run / "best_model.zip"),)))[0] == run / "evaluation.json"
    assert outputs(replace(cfg, model=("pretrained",)))[0] == Path(DEFAULT_OUT)  # the shipped agent's folder: not ours
    assert outputs(cfg)[0] == Path(DEFAULT_OUT)
    assert outputs(replace(cfg, model=(str(run),), out=str(tmp_path / "x.json")))[0] == tmp_path / "x.json"
