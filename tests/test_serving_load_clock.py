"""evaluate.py --env serve --clock --load: the methods online on the wall clock, the same requests, exact in float32."""

from __future__ import annotations

import json

import pytest

from tests.test_serving import toy_batch_costs

TINY = ["--pair", "tiny-random", "--pair-options", "dtype=float32", "--threads", "1", "--max-batch", "4", "--max-new-tokens", "6",
        "--max-prompts", "6", "--requests", "6"]


@pytest.fixture
def toy_costs(monkeypatch):
    import bild_env.decoding.costs as costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())  # no timing in a test


def requests_met(run: dict) -> list:
    return [(r["rid"], r["prompt_key"], r["arrived_ms"]) for r in run["requests"]]  # key: a digest of the prompt's ids


def test_every_method_meets_the_same_requests_exactly_at_every_level(tmp_path, toy_costs):
    from agents.commands import evaluate_main as main

    out = tmp_path / "clock.json"
    assert main(["--env", "serve", "--clock", "--load", "0.3", "1.0", "--table", "0.3:15,1:25", "--batch-table", "0:15,1:25",
                 "--out", str(out)] + TINY) == 0
    report = json.loads(out.read_text())
    assert list(report["levels"]) == ["0.3", "1"]
    for level in report["levels"].values():
        methods = level["methods"]
        assert list(methods) == ["target only", "naive SD (k=4)", "BiLD fixed (0.103, 4.697)", "per-load table",
                                 "per-batch-size table"]
        runs = [r for m in methods.values() for r in m["runs"]]
        assert len(runs) == 10 and {r["repeat"] for r in runs} == {1, 2}
        met = requests_met(runs[0])
        assert len(met) == level["warm"] + level["arrivals"] and level["arrivals"] == 6
        assert met == [(a["rid"], a["prompt_key"], a["arrived_ms"]) for a in level["trace"]]
        assert all(requests_met(r) == met for r in runs)  # the same requests, arriving at the same times
        n = len(met)
        for name, m in methods.items():
            assert m["ratio_to_target_only"] > 0 and m["ratio_range"][0] <= m["ratio_range"][1]
            for r in m["runs"]:
                assert r["goodput_tok_s"] > 0 and r["mean_latency_ms"] > 0
                assert all(q["finished_ms"] >= q["admitted_ms"] >= q["arrived_ms"] for q in r["requests"])
                # float32: every request's tokens are the env's, and the lossless methods' the target's greedy ones
                assert r["equal_env"] == (None if name.startswith("naive") else f"{n}/{n}")
                if not name.startswith("BiLD fixed"):  # (0.45, 0.5) and off: lossless
                    assert r["equal_greedy"] == f"{n}/{n}" and all(q["equal_greedy"] for q in r["requests"])
        assert methods["target only"]["ratio_to_target_only"] == 1.0
    assert report["table"] == {"0.3": "(0.45, 0.5)", "1": "off"}
    assert report["batch_table"] == {"1": "(0.45, 0.5)", "2": "off"} and report["batch_table_source"].startswith("given")
    for level in report["levels"].values():  # batch 1 speculates with (0.45, 0.5), larger batches are off
        acts = {k for r in level["methods"]["per-batch-size table"]["runs"] for k in r["actions"]}
        assert acts <= {"(0.45, 0.5)", "off"}
    assert out.with_suffix(".md").read_text().startswith("# BiLD-Serve-v0")
    assert out.with_suffix(".png").stat().st_size > 0


def test_an_agent_and_the_table_chosen_on_validation(tmp_path, toy_costs):
    from tests.test_serving import evaluate_clock as main
    from tests.test_serving import train_serve as train

    env = ["--pair", "tiny-random", "--max-new-tokens", "6", "--max-batch", "4", "--max-prompts", "6"]
    assert train(env + ["--episode-steps", "6", "--total-timesteps", "24", "--n-envs", "2", "--eval-freq", "24",
                        "--eval-episodes", "1", "--hyperparams", "learning_starts=8", "batch_size=8", "--no-progress-bar",
                        "--log-dir", str(tmp_path), "--run-name", "a", "--observe", "next=1", "--actions", "score=cumulative"]) == 0
    # the lossless grid (rollback 0.5); it observes the next proposals (on the clock the decoder reads them ahead,
    # BatchedDecoder.peek_draft), and its thresholds, as the rules' here, read the run's cumulative score
    report = main(["--load", "0.5", "--select-episodes", "1", "--episode-steps", "4", "--fixed-actions", "15", "--actions", "score=cumulative",
                   "--repeats", "1", "--model", str(tmp_path / "a"), str(tmp_path / "a"),
                   "--out", str(tmp_path / "c.json")] + TINY)
    assert report["table_source"].startswith("chosen on validation")
    assert report["batch_table_source"].startswith("chosen on validation")
    assert report["table"]["0.5"] in ("(0.45, 0.5)", "off")
    assert set(report["batch_table"].values()) <= {"(0.45, 0.5)", "off"} and report["batch_table"]
    # two DQNs on one grid (here one run twice, told apart by name) also serve as their Q-ensemble, exactly
    ensemble = report["levels"]["0.5"]["methods"]["agents' Q-ensemble of 2"]["runs"][0]
    m = len(ensemble["requests"])
    assert ensemble["equal_env"] == ensemble["equal_greedy"] == f"{m}/{m}"
    assert f"agent {tmp_path / 'a'}" in report["levels"]["0.5"]["methods"]
    level = report["levels"]["0.5"]
    agent = level["methods"]["agent a"]["runs"][0]
    n = len(agent["requests"])
    assert agent["equal_env"] == agent["equal_greedy"] == f"{n}/{n}"  # its grid is lossless
    assert requests_met(agent) == requests_met(level["methods"]["target only"]["runs"][0])


def test_bad_options_are_refused_before_any_model_loads(tmp_path, monkeypatch):
    import gymnasium as gym
    import numpy as np
    from stable_baselines3 import DQN

    import bild_env.models.pairs as pairs
    from agents.serve.load_clock import LoadClockConfig, check_config
    from tests.test_serving import evaluate_clock as main

    monkeypatch.setattr(pairs, "load_pair", lambda *a, **k: pytest.fail("a model loaded"))
    for argv, message in ((["--load", "0"], "--load: level 0.0 is outside"), (["--load", "5"], "--load: level 5.0"),
                          (["--load", "0.3", "--table", "0.3:40"], "--table: action 40"),
                          (["--load", "0.3", "--table", "0.3"], "--table: '0.3' is not LEVEL:ACTION"),
                          (["--load", "0.3", "--batch-table", "0:40"], "--batch-table: action 40"),
                          (["--load", "0.3", "--batch-table", "0.5:10"], "--batch-table: '0.5:10' is not BUCKET:ACTION"),
                          (["--load", "0.3", "--batch-table=-1:10"], "--batch-table: bucket -1 is below 0"),
                          (["--load", "0.3", "--actions", "score=oracle"], "--actions score: the oracle reads .* give token or cumulative"),
                          (["--load", "0.3", "--actions", "max_draft_len=auto"], "--actions max_draft_len=auto: the clock's"),
                          (["--load", "0.3", "--actions", "3"], "the fixed actions the rules run are --fixed-actions 3"),
                          (["--load", "0.3", "--select-steps", "4"], "--select-steps is the env's --episode-steps"),
                          (["--load", "0.3", "--fixed-actions", "26"], "--fixed-actions: \\[26\\] not in \\[0, 26\\)"),
                          (["--load", "0.3", "--actions", "score=best"], "score must be one of"),
                          (["--load", "0.3", "--requests", "0"], "--requests must be >= 1")):
        with pytest.raises(SystemExit, match=message):
            main(argv)
    with pytest.raises(ValueError, match="--load: give at least one load level"):
        check_config(LoadClockConfig(load=()))
    from agents.commands import evaluate_main, serve_mode

    assert serve_mode(["--pair", "x"]) == ("quick", ["--pair", "x"])
    assert serve_mode(["--full", "--levels", "0.3"]) == ("full", ["--levels", "0.3"])
    assert serve_mode(["--clock", "--load", "0.3"]) == ("clock", ["--load", "0.3"])
    for argv in (["--load", "0.3"], ["--full", "--load=0.3"]):  # the clock's levels asked of the cost model's evaluation
        with pytest.raises(SystemExit, match="--load gives the wall clock's load levels: add --clock"):
            evaluate_main(["--env", "serve", *argv])
    with pytest.raises(SystemExit) as err:  # one mode at a time
        serve_mode(["--full", "--clock"])
    assert err.value.code == 2

    class BildV1Like(gym.Env):  # BiLD-v1's spaces: 7 observations, 25 actions
        observation_space = gym.spaces.Box(0, 1, (7,), dtype=np.float32)
        action_space = gym.spaces.Discrete(25)

    DQN("MlpPolicy", BildV1Like(), learning_starts=0, device="cpu").save(tmp_path / "v1.zip")
    with pytest.raises(ValueError, match="--model .*v1.zip: .*action space Discrete\\(25\\), but the env it would act in has .* 26 actions"):
        check_config(LoadClockConfig(load=(0.3,), model=(str(tmp_path / "v1.zip"),)))
    run = tmp_path / "v1run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"train": {}, "env": {}}))
    (run / "model.zip").write_bytes((tmp_path / "v1.zip").read_bytes())
    with pytest.raises(ValueError, match=".*v1run.* is a model of a BiLD-v1 run .*, not of a BiLD-Serve-v0 one"):
        check_config(LoadClockConfig(load=(0.3,), model=(str(run),)))
    (run / "config.json").write_text(json.dumps({"env_id": "BiLD-Serve-v0", "train": {"run_name": "x"},
                                                      "env": {"max_batch": 8}}))
    with pytest.raises(ValueError, match="--model .*trained with max_batch 8 .*this evaluation runs max_batch 32.*give --max-batch 8"):
        check_config(LoadClockConfig(load=(0.3,), model=(str(run),)))


def test_load_clock_refuses_an_out_holding_results_unless_forced_and_an_unwritable_out(tmp_path):
    from agents.serve.load_clock import LoadClockConfig, check_config

    out = tmp_path / "clock.json"
    out.with_suffix(".md").write_text("earlier")
    with pytest.raises(ValueError, match="--force"):
        check_config(LoadClockConfig(load=(0.05,), out=str(out)))
    check_config(LoadClockConfig(load=(0.05,), out=str(out), force=True))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot write"):
        check_config(LoadClockConfig(load=(0.05,), out=str(tmp_path / "file" / "clock.json")))


def test_a_run_with_tree_rules_is_refused_on_the_clock_naming_the_evaluation_that_runs_it(tmp_path):
    """The clock's batched decoder steps chains: a tree action of the agent's would be read as speculation off, so a
    run trained with tree rules is refused before anything loads, naming the cost model's evaluation instead."""
    from agents.serve.load_clock import LoadClockConfig, check_model
    from agents.serve.options import ServeTrainConfig
    from bild_env.serving.env import ServingConfig

    run = tmp_path / "run"
    run.mkdir()
    env = ServingConfig(max_batch=LoadClockConfig().env.max_batch, actions={"tree_rules": ("3,2,1",)})
    (run / "config.json").write_text(ServeTrainConfig().spec(env).text())
    (run / "best_model.zip").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"tree rules \['3,2,1'\].*python evaluate.py --env serve --model"):
        check_model(LoadClockConfig(), str(run))
    for given in ({"actions": {"per_domain": True}}, {"observe": {"costs": True}}):  # nor what its loop does not observe
        env = ServingConfig(max_batch=LoadClockConfig().env.max_batch, **given)
        (run / "config.json").write_text(ServeTrainConfig().spec(env).text())
        with pytest.raises(ValueError, match=r"(per_domain|costs)\); the clock's online loop observes neither"):
            check_model(LoadClockConfig(), str(run))


def test_the_clock_runs_a_model_in_the_world_its_run_was_trained_in(tmp_path):
    """``evaluate.py --env serve --clock --model RUN`` takes the run's pair, dtype, batch, answer length and draft cap
    where the command line is silent (as the cost model's evaluation does), so the agent's observation keeps its
    meaning without restating them; an option given still wins, and the clock's own defaults stay."""
    from agents.serve.bench_config import parse_options
    from agents.serve.evaluation_agents import trained_world
    from agents.serve.bench_config import MAIN_JOB_EPISODES as CLOCK_ENV
    from agents.serve.load_clock import LoadClockConfig, check_model
    from agents.serve.options import ServeTrainConfig
    from bild_env.serving.env import ServingConfig

    run = tmp_path / "run"
    run.mkdir()
    env = ServingConfig(pair="tiny-random", pair_options={"dtype": "float32"}, max_batch=4, max_new_tokens=6,
                        actions={"max_draft_len": 2})
    (run / "config.json").write_text(ServeTrainConfig().spec(env).text())
    (run / "best_model.zip").write_bytes(b"not read")  # refused before its zip is read

    def parsed(argv):
        return parse_options(argv, trained_world(argv, LoadClockConfig()), "", "evaluate.py --env serve --clock")

    cfg = parsed(["--load", "0.3", "--model", str(run)])
    e = cfg.env
    assert (e.pair, e.pair_options.dtype, e.max_batch, e.max_new_tokens, e.actions.max_draft_len) == (
        "tiny-random", "float32", 4, 6, 2)
    assert (e.episode_steps, e.max_prompts, cfg.load) == (CLOCK_ENV.episode_steps, CLOCK_ENV.max_prompts, (0.3,))
    assert parsed(["--model", str(run), "--max-batch", "2"]).env.max_batch == 2  # given: wins
    with pytest.raises(ValueError, match="trained with max_batch 4 .*this evaluation runs max_batch 32.*give --max-batch 4"):
        check_model(LoadClockConfig(), str(run))  # without the run's world its observation would mean another batch
