"""Offline RL on the recorded decoding (``python -m agents.offline``): BiLD-Serve-v0 episodes written as Minari
datasets from the shipped decoding dataset with no model, read back as the env's own steps, learnt from with no env
stepping, and ranked by ``evaluate.py --env serve`` beside the rules."""

import json

import gymnasium
import numpy as np
import pytest

import bild_env.models.pairs

minari = pytest.importorskip("minari", reason="the offline extra: pip install -e '.[offline]'")

PROFILE = "xeon-amx-smollm2-bf16"
ENV = ["--pair-options", "dtype=bfloat16", "--cost-profile", PROFILE, "--episode-steps", "12", "--max-prompts", "4"]


@pytest.fixture
def no_model(monkeypatch, tmp_path):
    """No model may load (the shipped decoding dataset answers every step); Minari's datasets under ``tmp_path``."""
    monkeypatch.setattr(bild_env.models.pairs, "_CACHE", {})
    monkeypatch.setattr(bild_env.models.pairs, "load_pair", lambda *a, **k: (_ for _ in ()).throw(OSError("offline")))
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))


def test_recorded_episodes_are_the_envs_steps_and_agents_learnt_from_them_are_ranked(no_model, tmp_path, capsys):
    from agents.offline import main
    from tests.test_serving import evaluate_serve as evaluate

    assert main(["record", *ENV, "--episodes", "2", "--eval-episodes", "1"]) == 0
    ids = {f"bild-gym/serve-smollm2-bfloat16/{p}-v0" for p in ("rule", "oracle", "epsilon")}
    assert ids <= set(minari.list_local_datasets())
    table = minari.load_dataset("bild-gym/serve-smollm2-bfloat16/rule-v0")
    oracle = minari.load_dataset("bild-gym/serve-smollm2-bfloat16/oracle-v0")
    assert table.total_episodes == 2 and table.total_steps == 2 * 12
    meta = table.storage.metadata
    assert meta["ref_min_score"] < meta["ref_max_score"] == oracle.storage.metadata["ref_max_score"]
    # the oracle's returns are the max score; speculation off's is the min (about 0: off is the reference)
    assert np.mean([ep.rewards.sum() for ep in oracle.iterate_episodes()]) == pytest.approx(meta["ref_max_score"])
    # the recovered env is the one played (its cost profile too); its steps give back the recorded rewards exactly
    env = table.recover_environment()
    assert env.unwrapped.config.cost_profile == PROFILE and env.unwrapped.config.split == "train"
    assert env.observation_space == table.spec.observation_space and env.action_space == gymnasium.spaces.Discrete(6)
    for seed, episode in enumerate(table.iterate_episodes()):  # episode i was played from seed i
        obs, _ = env.reset(seed=seed)
        np.testing.assert_array_equal(obs, episode.observations[0])
        rewards = [env.step(int(a))[1] for a in episode.actions]
        np.testing.assert_array_equal(rewards, episode.rewards)
    env.close()

    # the transitions the agents learn from are the recorded steps (TorchRL's own Minari reader gave zeros)
    from agents.offline import transitions

    td = transitions(oracle)
    episodes = list(oracle.iterate_episodes())
    np.testing.assert_array_equal(td["action"].numpy(), np.concatenate([ep.actions for ep in episodes]))
    np.testing.assert_array_equal(td["observation"].numpy(), np.concatenate([ep.observations[:-1] for ep in episodes]))
    np.testing.assert_array_equal(td["next", "observation"][11].numpy(), episodes[0].observations[12])
    np.testing.assert_allclose(td["next", "reward"].numpy().ravel(), np.concatenate([ep.rewards for ep in episodes]),
                               rtol=1e-6)
    assert td["next", "done"].numpy().ravel().tolist() == ([False] * 11 + [True]) * 2  # truncated after 12 steps
    for algo, policy in (("cql", "epsilon"), ("bc", "oracle")):
        assert main(["train", "--dataset", f"bild-gym/serve-smollm2-bfloat16/{policy}-v0", "--algo", algo,
                     "--steps", "30", "--batch-size", "8", "--log-dir", str(tmp_path / "logs"), "--run-name", algo]) == 0
        saved = json.loads((tmp_path / "logs" / algo / "config.json").read_text())
        assert saved["env_id"] == "BiLD-Serve-v0" and saved["env"]["cost_profile"] == PROFILE
        assert json.loads((tmp_path / "logs" / algo / "offline.json").read_text())["algo"] == algo
    with pytest.raises(SystemExit):  # a run folder is never overwritten
        main(["train", "--dataset", "bild-gym/serve-smollm2-bfloat16/oracle-v0", "--algo", "bc", "--steps", "1",
              "--log-dir", str(tmp_path / "logs"), "--run-name", "bc"])
    printed = capsys.readouterr().out
    assert f"python evaluate.py --env serve --model {tmp_path / 'logs' / 'bc'} --cost-profile {PROFILE} --pair-options dtype=bfloat16" in printed
    report = evaluate(["--pair", "smollm2", "--pair-options", "dtype=bfloat16", "--cost-profile", PROFILE, "--levels", "0.3",
                       "--moving", "constant:1.0", "--select-episodes", "1", "--episodes", "2", "--episode-steps", "12",
                       "--max-prompts", "4", "--no-bandits", "--fixed-actions", "0", "5", "10", "15", "20", "--model", str(tmp_path / "logs" / "cql"),
                       str(tmp_path / "logs" / "bc"), "--out", str(tmp_path / "eval.json")])
    rows = {r["policy"]: r for r in report["levels"]["0.3"]}
    assert {"agent cql", "agent bc"} <= set(rows)
    assert any(name.startswith("agent bc on the per-batch-size table's floor") for name in rows)


def test_bild_v1_episodes_are_recorded_learnt_from_and_ranked_on_the_best_fixed_actions_floor(no_model, tmp_path,
                                                                                                 capsys):
    from agents.offline import main
    from bench import headroom

    env = ["--pair-options", "dtype=bfloat16", "--cost-profile", PROFILE, "--max-prompts", "4"]
    assert main(["record", "--env", "bild", *env, "--episodes", "2", "--eval-episodes", "2"]) == 0
    rule = minari.load_dataset("bild-gym/bild-smollm2-bfloat16/rule-v0")
    played = rule.recover_environment()
    assert played.spec.id == "BiLD-v1" and played.action_space == gymnasium.spaces.Discrete(6)  # lossless grid, off
    for seed, episode in enumerate(rule.iterate_episodes()):
        obs, _ = played.reset(seed=seed)
        np.testing.assert_array_equal(obs, episode.observations[0])
        np.testing.assert_array_equal([played.step(int(a))[1] for a in episode.actions], episode.rewards)
        assert len(set(episode.actions.tolist())) == 1  # the rule: one fixed action, chosen on validation
    played.close()
    assert main(["train", "--dataset", "bild-gym/bild-smollm2-bfloat16/oracle-v0", "--algo", "bc", "--steps", "20",
                 "--batch-size", "8", "--log-dir", str(tmp_path / "logs"), "--run-name", "bc"]) == 0
    printed = capsys.readouterr().out
    command = next(line.strip() for line in printed.splitlines() if "python -m bench.headroom" in line)
    assert f"--cost-profile {PROFILE} --pair-options dtype=bfloat16" in command and "off_switch=1" in command
    cfg = headroom.HeadroomConfig(split="test", prompts=2, select_split="validation", select_prompts=2, bandits=False,
                                  env={"pair": "smollm2", "pair_options": {"dtype": "bfloat16"}, "cost_profile": PROFILE,
                                       "actions": {"rollback_values": (0.5,), "off_switch": True}},
                                  out=str(tmp_path / "h.json"), model=(str(tmp_path / "logs" / "bc"),))
    report = headroom.run(cfg)
    names = [r["policy"] for r in report["rows"]]
    assert any(n.startswith("agent ") and "floor" not in n for n in names)
    assert any("on the best fixed action's floor" in n for n in names)


def test_dataset_ids_are_minaris():
    from dataclasses import replace

    from minari.dataset.minari_dataset import parse_dataset_id

    from agents.offline import dataset_id
    from agents.spec import preset_env

    ident = dataset_id(replace(preset_env("serve"), pair="qwen2.5-coder", pair_options={"dtype": "float32"}), "oracle")
    assert ident == "bild-gym/serve-qwen2_5-coder-float32/oracle-v0"
    assert parse_dataset_id(ident) == ("bild-gym/serve-qwen2_5-coder-float32", "oracle", 0)


def test_bad_offline_options_say_what_to_do(no_model, capsys):
    from agents.offline import main

    for argv, said in ((["record", "--policies", "greedy"], "--policies greedy: not a policy"),
                       (["train", "--dataset", "bild-gym/none/table-v0"], "record it with `python -m agents.offline record`"),
                       (["train"], "--dataset: give a Minari dataset id"),
                       (["train", "--dataset", "x", "--algo", "iql"], "--algo 'iql': choose among cql, bc")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2 and said in capsys.readouterr().err
