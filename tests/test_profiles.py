"""Hardware cost profiles: shipped and written ones load and are checked, both envs charge them, the command writes one."""

from __future__ import annotations

import json
import math

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import bild_env  # noqa: F401 (registers the envs)
from bild_env import profile as profile_cmd
from bild_env.decoding.batch_costs import BatchCost
from bild_env.decoding.cost_model import CostModel
from bild_env.decoding.forward_costs import ForwardCost
from bild_env.decoding.profiles import (MACHINE, PROFILE_FORMAT, CostProfile, ProfileError, load_profile,
                                        profile_names, vary)

SHIPPED = ("h200-opt-eager", "h200-opt-floor", "h200-smollm2-eager", "h200-smollm2-eager-bf16", "zen5-smollm2-bf16",
           "zen3-qwen2.5-coder-float32", "xeon-amx-qwen2.5-coder-bf16", "xeon-amx-smollm2-bf16")


def linear_profile(tmp_path, draft_ms=1.0, target_ms=10.0, batched=False, name="lin"):
    """A profile whose forwards cost constants: every charge can be computed by hand."""
    tables = None
    if batched:
        flat = lambda ms: BatchCost((1, 2, 4), (1, 8), ((ms, ms),) * 3)  # noqa: E731
        tables = {"draft": flat(draft_ms), "target": flat(target_ms)}
    model = CostModel(draft=(draft_ms, 0.0, 0.0), target=(target_ms, 0.0, 0.0), batched=tables)
    path = tmp_path / f"{name}.json"
    CostProfile(name, model, device="a test device", dtype="float32", shapes="constants").save(path)
    return path


def test_shipped_profiles_load_and_say_what_they_are():
    assert set(SHIPPED) <= set(profile_names())
    opt = load_profile("h200-opt-eager")
    assert opt.dtype == "float16" and "H200" in opt.device and "OPT-6.7B" in opt.shapes
    assert "random weights" in opt.note and "never from these models" in opt.note  # what a profile is, said in it
    assert opt.c == pytest.approx(5.0489 / 16.7011, rel=1e-3)  # the measured draft / target forward, fed 1
    assert 1.1 < opt.v(8) < 1.2 and opt.largest_batch == 64
    assert "h200-opt-eager" in opt.label and "c 0.302" in opt.label
    floor = load_profile("h200-opt-floor")
    assert floor.c == pytest.approx(0.3222 / 3.7767, rel=1e-3)
    assert floor.model.batched["target"](64, 8, 0) == pytest.approx(11.1445, rel=1e-6)  # a timed cell, unchanged
    assert load_profile("h200-smollm2-eager-bf16").dtype == "bfloat16"
    xeon = load_profile("xeon-amx-qwen2.5-coder-bf16")  # timed on native bfloat16 units, its card says where and how
    assert xeon.dtype == "bfloat16" and "AMX" in xeon.device and "bild_env.profile --pair qwen2.5-coder" in xeon.timed
    assert 0.9 < xeon.v(8) < 1.0 and xeon.c == pytest.approx(0.472, abs=5e-4) and xeon.largest_batch == 8
    assert load_profile("xeon-amx-smollm2-bf16").largest_batch == 32


@pytest.mark.parametrize("change, words", [
    (lambda d: d.update(format="bild-gym cost profile 0"), "not a cost profile of format"),
    (lambda d: d["cost_model"]["target"]["ms"].__setitem__(0, float("nan")), "finite"),
    (lambda d: d["cost_model"]["draft"]["ms"].__setitem__(3, 0.001), "no timing of forwards"),
    (lambda d: d.pop("cost_model"), "holds no cost_model"),
    (lambda d: d.update(dtype=""), "must be text"),
])
def test_a_broken_profile_is_refused_saying_what_to_do(tmp_path, change, words):
    d = json.loads(open(load_profile("h200-opt-eager").source).read())
    change(d)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(d, allow_nan=True))
    with pytest.raises(ProfileError, match=words) as err:
        load_profile(path)
    assert "python -m bild_env.profile" in str(err.value) or "must be text" in str(err.value)


def test_unknown_names_folders_and_non_json_are_refused(tmp_path):
    with pytest.raises(ProfileError, match="h200-opt-eager"):  # the message lists the shipped names
        load_profile("no-such-profile")
    with pytest.raises(ProfileError, match="is a folder"):
        load_profile(tmp_path)
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ProfileError, match="not JSON"):
        load_profile(tmp_path / "x.json")


def test_bild_v1_charges_the_profile_as_computed_by_hand(tmp_path):
    """Constant forwards (draft 1 ms, target 10 ms): an episode costs the prefill's target forward plus 1 ms per draft
    forward and 10 ms per target forward, and target-only decoding 10 ms per token."""
    path = linear_profile(tmp_path)
    env = gymnasium.make("bild_env:BiLD-v1", pair="tiny-random", backend="replay", max_prompts=2, max_new_tokens=12,
                         actions={"off_switch": True}, cost_profile=str(path))
    for action in (25, 4, 0):  # speculation off, the paper's pair, the most eager pair
        _, info = env.reset(options={"prompt_index": 0})
        assert info["cost_profile"] == "lin" and info["prefill_ms"] == 10.0
        drafts = targets = 0
        done = False
        while not done:
            _, _, term, trunc, info = env.step(action)
            assert info["cost_profile"] == "lin"
            drafts, targets, done = drafts + info["draft_forwards"], targets + info["target_forwards"], term or trunc
        summary = info["episode_summary"]
        assert summary["latency_ms"] == pytest.approx(10.0 + drafts * 1.0 + targets * 10.0)
        assert summary["target_only_ms"] == pytest.approx(10.0 * summary["new_tokens"])
    check_env(env.unwrapped, skip_render_check=True)
    env.close()


def test_the_machine_is_named_where_no_profile_is_charged():
    env = gymnasium.make("bild_env:BiLD-v1", pair="tiny-random", backend="replay", max_prompts=1, max_new_tokens=4)
    assert env.reset(seed=0)[1]["cost_profile"] == MACHINE
    env.close()


def test_serving_env_charges_a_profile_and_refuses_a_batch_beyond_it(tmp_path):
    path = linear_profile(tmp_path, batched=True)
    env = gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", cost_profile=str(path), max_batch=4,
                         max_prompts=2, episode_steps=3)
    _, info = env.reset(seed=0)
    assert info["cost_profile"] == "lin"
    _, _, _, _, info = env.step(env.action_space.n - 1)  # speculation off: one target forward of the batch
    assert info["cost_profile"] == "lin" and info["step_ms"] >= 10.0
    check_env(env.unwrapped, skip_render_check=True)
    env.close()
    with pytest.raises(ProfileError, match="max_batch 5 is above the largest batch .* 4"):
        gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", cost_profile=str(path), max_batch=5)
    with pytest.raises(ProfileError, match="no batched tables"):
        gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", cost_profile=str(linear_profile(tmp_path)),
                       max_batch=2)


def test_a_profile_and_another_cost_model_are_not_both_charged(tmp_path):
    with pytest.raises(ProfileError, match="not both"):
        gymnasium.make("bild_env:BiLD-v1", pair="tiny-random", backend="replay", cost_profile="h200-opt-eager",
                       cost_model=CostModel(draft=(1.0, 0.0, 0.0), target=(2.0, 0.0, 0.0)))
    with pytest.raises(ValueError, match="latency='model'"):
        gymnasium.make("bild_env:BiLD-v1", pair="tiny-random", latency="wall", cost_profile="h200-opt-eager")


def test_vary_scales_the_draft_and_the_growths_keeping_the_targets_single_token_forward():
    base = load_profile("h200-opt-eager")
    v = vary(base, draft_scale=2.0, fed_growth=0.5, batch_growth=3.0)
    t, bt = base.model.target, base.model.target
    assert v.model.target(1, t.ref_context) == pytest.approx(t(1, t.ref_context))
    assert v.c == pytest.approx(2 * base.c)
    rise = lambda p: p.model.target(8, t.ref_context) - p.model.target(1, t.ref_context)  # noqa: E731
    assert rise(v) == pytest.approx(0.5 * rise(base))
    b0, b1 = base.model.batched["target"], v.model.batched["target"]
    assert b1(1, 1, b0.ref_context) == pytest.approx(b0(1, 1, b0.ref_context))
    assert b1(32, 1, b0.ref_context) - b1(1, 1, b0.ref_context) == pytest.approx(
        3.0 * (b0(32, 1, b0.ref_context) - b0(1, 1, b0.ref_context)))
    assert v.name != base.name and "variation of h200-opt-eager" in v.note
    for bad in (0, -1.0, math.nan, math.inf):
        with pytest.raises(ProfileError, match="finite number > 0"):
            vary(base, draft_scale=bad)
    assert bt is base.model.target  # the base is left as it was


def test_the_profile_command_writes_a_profile_every_reader_accepts(tmp_path, monkeypatch):
    """The command's plumbing (the timing itself is costs.calibrate's, tested there): tables in, a checked file out."""
    single = CostModel(ForwardCost((1, 8), (2.0, 2.5)), ForwardCost((1, 8), (20.0, 23.0)), "cpu", "a machine")
    tables = {"draft": BatchCost((1, 2), (1, 8), ((2.0, 2.5), (2.2, 2.9))),
              "target": BatchCost((1, 2), (1, 8), ((20.0, 23.0), (21.0, 26.0)))}
    monkeypatch.setattr(profile_cmd, "calibrate", lambda pair, **kw: single)
    monkeypatch.setattr(profile_cmd, "calibrate_batched", lambda pair, **kw: tables)
    monkeypatch.setattr(profile_cmd, "busy_cores", lambda *a: 0.0)  # a quiet machine (test_profile_checks: a busy one)
    out = tmp_path / "mine.json"
    assert profile_cmd.main(["--pair", "tiny-random", "--batch-sizes", "1", "2", "--out", str(out)]) == 0
    written = load_profile(out)
    assert written.name == "mine" and written.dtype == "float32" and written.largest_batch == 2
    assert written.c == pytest.approx(0.1) and "torch" in written.software and "OPTForCausalLM 4 layers x 64 wide" in written.shapes
    assert json.loads(out.read_text())["format"] == PROFILE_FORMAT
    env = gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", cost_profile=str(out), max_batch=2,
                         max_prompts=1, episode_steps=2)
    env.reset(seed=0)
    env.close()


def test_the_profile_command_refuses_options_before_any_work(tmp_path, capsys):
    from bild_env.command import run_command

    assert run_command("python -m bild_env.profile", profile_cmd.main, ["--pair", "tiny-random"]) == 2
    assert "--out FILE is required" in capsys.readouterr().err
    assert run_command("python -m bild_env.profile", profile_cmd.main, ["--out", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    assert run_command("python -m bild_env.profile", profile_cmd.main,
                       ["--out", str(tmp_path / "p.json"), "--sampling", "every"]) == 2
    assert "--sampling must be" in capsys.readouterr().err and not (tmp_path / "p.json").exists()


def test_serving_across_profiles_draws_each_episodes_hardware_and_observes_it(tmp_path):
    cheap = linear_profile(tmp_path, draft_ms=1.0, target_ms=10.0, batched=True, name="cheap")
    dear = linear_profile(tmp_path, draft_ms=5.0, target_ms=10.0, batched=True, name="dear")
    env = gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random",
                         charging={"train_profiles": (str(cheap), str(dear))}, observe={"costs": True}, max_batch=4, max_prompts=2, episode_steps=3)
    plain = gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", cost_profile=str(cheap), max_batch=4,
                           max_prompts=2, episode_steps=3)
    assert env.observation_space.shape[0] == plain.observation_space.shape[0] + 3
    seen = {}
    for seed in range(8):
        obs, info = env.reset(seed=seed)
        seen[info["cost_profile"]] = obs[-3:]
        assert env.observation_space.contains(obs)
    assert set(seen) == {"cheap", "dear"}  # both drawn over eight seeds
    # constant forwards: c is the draft's over the target's, and nothing rises with tokens fed or with the batch
    assert seen["cheap"] == pytest.approx([0.1, 0.0, 0.0]) and seen["dear"] == pytest.approx([0.5, 0.0, 0.0])
    env.reset(seed=3)
    first = env.unwrapped.charged
    assert env.reset(seed=3)[1]["cost_profile"] == first  # the draw follows the seed
    check_env(env.unwrapped, skip_render_check=True)
    for e in (env, plain):
        e.close()
    varied = gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random",
                            charging={"train_profiles": (str(dear),), "vary_profiles": 2.0}, observe={"costs": True}, max_batch=4, max_prompts=2, episode_steps=3)
    c = [varied.reset(seed=s)[0][-3] for s in range(6)]
    assert all(0.25 <= x <= 1.0 for x in c) and len(set(np.round(c, 6))) == 6  # 0.5 times a factor in [1/2, 2]
    varied.close()


@pytest.mark.parametrize("kwargs, words", [
    (dict(charging={"train_profiles": ("h200-opt-eager",)}, cost_profile="h200-opt-eager"), "give it alone"),
    (dict(charging={"vary_profiles": 2.0}), "give train_profiles with it"),
    (dict(charging={"train_profiles": ("h200-opt-eager",), "vary_profiles": 0.5}),
     "vary_profiles must be a finite number >= 1"),
    (dict(charging={"train_profiles": ("h200-opt-eager", "nope")}), "no cost profile 'nope'"),
])
def test_serving_across_profiles_refuses_what_makes_no_sense(kwargs, words):
    with pytest.raises(ValueError, match=words):
        gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", **kwargs)


def test_the_serving_bench_chooses_its_rules_under_other_profiles(tmp_path):
    from agents.serve.bench_config import ServingBenchConfig, env_options
    from bild_env.serving.env import ServingConfig

    cfg = ServingBenchConfig(env=ServingConfig(pair="tiny-random", cost_profile="h200-opt-floor"),
                             select_profiles=("h200-opt-eager", "zen5-smollm2-bf16"))
    val, test = env_options(cfg, "validation", "constant:0.3"), env_options(cfg, "test", "constant:0.3")
    assert val["charging"].train_profiles == ("h200-opt-eager", "zen5-smollm2-bf16") and val["cost_profile"] is None
    assert test["cost_profile"] == "h200-opt-floor" and test["charging"].train_profiles == ()


def test_the_paper_table_prices_every_method_under_a_profile(tmp_path):
    """bench.paper_table on tiny-random (float32): every lossless method decodes the single model's tokens (the same
    BLEU on every prompt), speedups are the single model's mean latency over each method's, differences are paired."""
    from bench import paper_table

    out = tmp_path / "t2.json"
    report = paper_table.main(["--pair", "tiny-random", "--prompts", "3", "--select-prompts", "2", "--max-new-tokens",
                               "6", "--cost-profile", str(linear_profile(tmp_path)), "--out", str(out)])
    assert json.loads(out.read_text())["cost_profile"] == "lin"
    rows = {r["method"].split(" (")[0]: r for r in report["rows"]}
    single = rows["single model"]
    assert single["speedup"] == 1.0 and single["latency_ms"] == pytest.approx(10.0 * 6)  # constant 10 ms per token
    for name in ("naive speculative decoding", "naive SD, confidence stop"):
        assert rows[name]["bleu"] == pytest.approx(single["bleu"]) and rows[name]["exact_match"] == single["exact_match"]
    for r in report["rows"]:
        assert r["speedup"] == pytest.approx(single["latency_ms"] / r["latency_ms"])
    paper = rows["BiLD"]
    assert paper["minus_paper_fixed_ms"] == 0.0
    assert rows["BiLD"]["latency_ms"] == pytest.approx(float(np.mean(paper["per_prompt_latency_ms"])))
    assert report["prompts_run"] == {"test": 3, "validation": 2}
    assert paper_table.markdown(report).startswith("pair tiny-random (torch.float32), 3 test prompts, 6 new tokens")
    fewer = report | {"config": report["config"] | {"prompts": 12}}  # asked for more than the split (or a dataset) held
    assert "3 test prompts (of 12 asked: the split, or the decoding dataset replayed, holds 3)" in paper_table.markdown(fewer)


def test_the_serving_bench_accepts_an_agent_that_observes_the_hardware(tmp_path):
    from agents.serve.evaluation_agents import check_spaces
    from bild_env.serving.env import ServingConfig
    from bild_env.serving.observations import observation_space

    here = ServingConfig(observe={"costs": True})
    n = len(here.actions.fallback_values) * len(here.actions.rollback_values) + 1
    saved = {"observation_space": observation_space(0, False, True), "action_space": gymnasium.spaces.Discrete(n)}
    check_spaces("run", tmp_path / "m.zip", saved, here, True)  # fits: no error
    with pytest.raises(ValueError, match=r"Box\(17,\).*Box\(14,\)"):
        check_spaces("run", tmp_path / "m.zip", saved, ServingConfig(), True)
