"""One check for every table of times (``calibration.faults``), and every refusal of a profile before any work.

Shipped profiles damaged as a user might (a slope raised, every time scaled by 1e300, the target's times x1e6 from 8
tokens fed, a time written as text, a fractional fed count) are refused wherever they are named: loaded, made into an
env, given to ``train.py`` (both envs, and a resumed run's ``config.json``), each in one line naming the file, the
table and the cell. A cache holding the same faults is timed again. ``vary_profiles`` is refused where its extreme
variations are no timings; ``--time-budget`` and ``python -m bild_env.profile --batch-sizes`` are bounded at parse
time; the profile command refuses a busy machine before it times anything.
"""

from __future__ import annotations

import copy
import json
import logging
import math
from dataclasses import asdict, replace

import gymnasium
import numpy as np
import pytest

import bild_env  # noqa: F401 (registers the envs)
from bild_env import profile as profile_cmd
from bild_env.decoding import costs
from bild_env.decoding.batch_costs import BatchCost
from bild_env.decoding.calibration import MAX_FORWARD_MS, faults, model_faults
from bild_env.decoding.cost_model import CostModel
from bild_env.decoding.forward_costs import ForwardCost
from bild_env.decoding.profiles import ProfileError, check_variations, load_profile, vary
from bild_env.command import run_command

SHIPPED = json.loads(open(load_profile("h200-opt-eager").source).read())


def _tables(cm: dict) -> list[dict]:
    return [cm["draft"], cm["target"], cm["batched"]["draft"], cm["batched"]["target"]]


def steep(cm):  # only the slope raised: every forward at few cached tokens below 0 ms
    for t in _tables(cm):
        t["per_context_ms"] = 0.5


def huge(cm):  # every time x1e300: the shape of a timing, no machine's times
    for t in _tables(cm):
        t["ms"] = [[m * 1e300 for m in row] if isinstance(row, list) else row * 1e300 for row in t["ms"]]


def target_1e6(cm):  # the target's times x1e6 from 8 tokens fed upward
    for t in (cm["target"], cm["batched"]["target"]):
        scale = [1e6 if f >= 8 else 1.0 for f in t["fed"]]
        t["ms"] = ([[m * s for m, s in zip(row, scale)] for row in t["ms"]] if isinstance(t["ms"][0], list)
                   else [m * s for m, s in zip(t["ms"], scale)])


DAMAGES = {
    "steep": (steep, r"its draft table is no timing of forwards: fed 1 would take -42.95 ms with no cached tokens"),
    "batched slope": (lambda cm: cm["batched"]["target"].update(per_context_ms=0.5),
                      r"its batched target table is no timing of forwards: batch 1 fed 1 would take -23.8 ms"),
    "x1e300": (huge, r"its draft table cannot be a timing: fed 1 would take 5.049e\+300 ms .* over an hour"),
    "target x1e6 from fed 8": (target_1e6, r"its target table cannot be a timing: fed 8 takes 1.899e\+07 ms, over "
                                           r"100 times fed 7's"),
    "a time as text": (lambda cm: cm["target"]["ms"].__setitem__(0, "17.9"),
                       r"its target table's ms\[0\] is '17.9', not a number"),
    "a fractional fed count": (lambda cm: cm["draft"]["fed"].__setitem__(1, 1.5),
                               r"its draft table's fed\[1\] is 1.5, not a whole number"),
    "a fractional batch": (lambda cm: cm["batched"]["target"]["batch"].__setitem__(1, 2.5),
                           r"its batched target table's batch\[1\] is 2.5, not a whole number"),
    "a bool": (lambda cm: cm["target"].update(per_context_ms=True), r"per_context_ms is True, not a number"),
}


@pytest.fixture
def damaged(tmp_path):
    """``damaged(kind)``: the path of h200-opt-eager damaged by ``DAMAGES[kind]``, and the words its refusal holds."""

    def make(kind: str):
        d = copy.deepcopy(SHIPPED)
        DAMAGES[kind][0](d["cost_model"])
        path = tmp_path / f"{kind.replace(' ', '-')}.json"
        path.write_text(json.dumps(d))
        return path, DAMAGES[kind][1]

    return make


@pytest.mark.parametrize("kind", DAMAGES)
def test_a_damaged_profile_is_refused_naming_the_file_the_table_and_the_cell(damaged, kind):
    path, words = damaged(kind)
    with pytest.raises(ProfileError, match=words) as err:
        load_profile(path)
    message = str(err.value)
    assert message.startswith(str(path)) and "python -m bild_env.profile" in message and "\n" not in message


@pytest.mark.parametrize("kind", ["steep", "target x1e6 from fed 8", "a time as text"])
def test_both_envs_refuse_it_before_any_model_loads(damaged, kind, monkeypatch):
    from bild_env.models import pairs  # both envs load the pair through it (``PairOptions.load``)

    monkeypatch.setattr(pairs, "load_pair", lambda *a, **k: pytest.fail("a model was loaded"))
    path, words = damaged(kind)
    with pytest.raises(ProfileError, match=words):
        gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", cost_profile=str(path))
    with pytest.raises(ProfileError, match=words):
        gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random",
                       charging={"train_profiles": ("h200-opt-floor", str(path))})
    with pytest.raises(ProfileError, match=words):
        gymnasium.make("bild_env:BiLD-v1", pair="tiny-random", backend="replay", cost_profile=str(path))


def test_every_shipped_profile_passes_the_check_its_damaged_copies_fail():
    from bild_env.decoding.profiles import profile_names

    for name in profile_names():
        assert model_faults(load_profile(name).model) == (None, None), name


def test_the_check_reads_every_context_and_batch_an_env_reads():
    """0 ms or less at no cached tokens is odd (a prefill reads it), at any batch the table covers; over an hour at
    the most cached tokens an env reads (the slope is >= 0) is broken; a table within both passes."""
    table = ForwardCost((1, 8), (10.0, 12.0), per_context_ms=0.01, ref_context=96)
    assert faults({"target": table}) == (None, None)
    below = BatchCost((1, 8), (1, 8), ((10.0, 12.0), (20.0, 24.0)), per_context_ms=0.05, ref_context=96)
    broken, odd = faults({"batched target": below})  # batch 8 fed 1: 20 - 0.05 * 8 * 96 = -18.4 ms
    assert broken is None and "batch 8 fed 1 would take -18.4 ms with no cached tokens" in odd
    steep = ForwardCost((1, 8), (10.0, 12.0), per_context_ms=MAX_FORWARD_MS / 1000, ref_context=0)
    assert "at 2048 cached tokens, over an hour" in faults({"draft": steep})[0]
    assert faults({"draft": steep}, reach=100)[0] is None  # a pair of 100 positions never reads it there
    assert "fed 1 would take 0 ms" in faults({"draft": ForwardCost.linear(0.0, 0.0, 0.0)})[1]


@pytest.mark.parametrize("kind", ["steep", "a time as text", "a fractional fed count"])
def test_a_cache_with_the_same_faults_is_timed_again(kind, tiny_pair, monkeypatch, tmp_path, caplog):
    """The caches get the one check too: a stored model from an earlier boot whose slope takes more than the forward
    at no cached tokens, or whose numbers are text or fractional counts, is timed again, saying why."""
    monkeypatch.setenv("BILD_ENV_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "_LOADED", {})
    monkeypatch.setattr(costs, "_boot_id", lambda: "this boot")
    d = copy.deepcopy(SHIPPED["cost_model"])
    d.pop("batched")
    DAMAGES[kind][0](d | {"batched": {"draft": {}, "target": {}}})  # the damage to the one-sequence tables only
    path = costs.cost_path(tiny_pair)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d | {"boot": "an earlier boot"}))
    fresh = CostModel(draft=(1.0, 0.1, 0.001), target=(4.0, 0.5, 0.004), device="fresh")
    monkeypatch.setattr(costs, "calibrate", lambda pair, **_: fresh)
    with caplog.at_level(logging.WARNING, logger="bild_env.decoding.costs"):
        assert costs.load_or_calibrate(tiny_pair) == fresh
    (message,) = [r.getMessage() for r in caplog.records]
    assert str(path) in message and "recalibrating" in message
    assert ("would take -" if kind == "steep" else "not a") in message


def test_vary_profiles_beyond_any_hardware_is_refused_naming_the_largest_that_would_do():
    base = load_profile("h200-opt-eager")
    check_variations(base, 2.0)  # what the repo trains with
    with pytest.raises(ProfileError, match=r"vary_profiles 1e\+300 varies h200-opt-eager beyond any hardware .*"
                                           r"give vary_profiles <= 4\.7") as err:
        check_variations(base, 1e300)
    assert "\n" not in str(err.value)
    rng = np.random.default_rng(0)  # the extremes bound the draws: none within the span the message names fails
    for factors in np.exp(rng.uniform(-math.log(4.7), math.log(4.7), size=(40, 3))).tolist():
        vary(base, *factors)
    with pytest.raises(ProfileError, match="cannot be a timing"):
        vary(base, draft_scale=1e300)  # a variation the check refuses when drawn, not charged
    with pytest.raises(ValueError, match=r"give vary_profiles <= 4\.7"):
        gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random",
                       charging={"train_profiles": ("h200-opt-eager",), "vary_profiles": 1e300})


def test_train_profiles_given_as_one_string_is_refused_clearly():
    with pytest.raises(ValueError, match=r"train_profiles must be a tuple of cost profile names or files, e\.g\. "
                                         r"\('h200-opt-eager',\), got 'h200-opt-eager'"):
        gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", charging={"train_profiles": "h200-opt-eager"})


# -- train.py: refused at parse time, before [1/4] fetch and convert ------------------------------------------------
def _refused(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("args, words", [
    (["--cost-profile", "{steep}"], "would take -42.95 ms with no cached tokens"),
    (["--charging", "train_profiles=h200-opt-eager,{steep}"], "would take -42.95 ms with no cached tokens"),
    (["--charging", "train_profiles=h200-opt-eager", "vary_profiles=1e300"], "give vary_profiles <= 4.7"),
    (["--time-budget", "-1"], "--time-budget must be minutes > 0, or 0 for none, got -1.0"),
    (["--time-budget", "nan"], "--time-budget must be minutes > 0, or 0 for none, got nan"),
    (["--time-budget", "inf"], "--time-budget must be minutes > 0, or 0 for none, got inf"),
])
def test_train_serve_refuses_at_parse_time(args, words, damaged, tmp_path, capsys):
    from agents.serve.options import parse

    path, _ = damaged("steep")
    argv = ["--pair", "tiny-random", "--log-dir", str(tmp_path / "logs"), *(a.format(steep=path) for a in args)]
    assert words in _refused(parse, argv, capsys)
    assert not (tmp_path / "logs").exists()


def test_a_time_budget_of_0_is_none_and_positive_minutes_are_taken():
    from agents.serve.options import ServeTrainConfig

    assert ServeTrainConfig(time_budget=0.0).time_budget == 0.0 and ServeTrainConfig(time_budget=1e-6).time_budget


def test_a_resumed_serving_run_naming_a_bad_profile_is_refused_at_parse_time(damaged, tmp_path, capsys):
    from agents.spec import preset_env
    from agents.serve.options import ServeTrainConfig, parse

    path, words = damaged("steep")
    run = tmp_path / "logs" / "r"
    run.mkdir(parents=True)
    env = replace(preset_env("serve"), pair="tiny-random", cost_profile=str(path))
    (run / "config.json").write_text(ServeTrainConfig().spec(env).text())
    line = _refused(parse, ["--resume", str(run)], capsys)
    assert f"{run / 'config.json'} holds options that cannot be used ({path}: its draft table" in line


def test_train_bild_refuses_a_bad_profile_at_parse_time_new_or_resumed(damaged, tmp_path, capsys):
    from agents.bild.training import parse_config
    from agents.config import RunConfig

    path, _ = damaged("target x1e6 from fed 8")
    line = _refused(parse_config, ["--pair", "tiny-random", "--log-dir", str(tmp_path / "logs"), "--cost-profile",
                                   str(path)], capsys)
    assert line.startswith(f"train.py: error: bad environment option: {path}: its target table cannot be a timing")
    run = tmp_path / "logs" / "r"
    run.mkdir(parents=True)
    saved = RunConfig()
    replace(saved, env=replace(saved.env, pair="tiny-random", cost_profile=str(path))).save(run / "config.json")
    line = _refused(parse_config, ["--resume", str(run)], capsys)  # before it looks for a checkpoint
    assert f"{run / 'config.json'} holds options that cannot be used ({path}: its target table" in line


# -- python -m bild_env.profile ------------------------------------------------------------------------------------
PROG = "python -m bild_env.profile"


def test_the_profile_command_bounds_the_batch_at_parse_time(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert run_command(PROG, profile_cmd.main, ["--batch-sizes", "1", "100000", "--out", str(out)]) == 2
    assert "--batch-sizes must be whole numbers from 1 to 256" in capsys.readouterr().err and not out.exists()


def test_the_profile_command_refuses_a_busy_machine_before_it_times(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(profile_cmd, "busy_cores", lambda *a: 1.9)
    monkeypatch.setattr(profile_cmd, "load_pair", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "p.json"
    assert run_command(PROG, profile_cmd.main, ["--pair", "tiny-random", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "other processes keep 1.9 CPU cores busy" in err and "run it when the machine is quiet" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_the_profile_command_checks_the_one_sequence_tables_before_timing_the_batched_ones(tmp_path, monkeypatch,
                                                                                         capsys):
    noisy = CostModel(ForwardCost((1, 8), (2.0, 0.5)), ForwardCost((1, 8), (20.0, 23.0)), "cpu", "a machine")
    monkeypatch.setattr(profile_cmd, "busy_cores", lambda *a: 0.0)
    monkeypatch.setattr(profile_cmd, "calibrate", lambda pair, **kw: noisy)
    monkeypatch.setattr(profile_cmd, "calibrate_batched", lambda pair, **kw: pytest.fail("timed batched forwards"))
    out = tmp_path / "p.json"
    assert run_command(PROG, profile_cmd.main, ["--pair", "tiny-random", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "its draft table is no timing of forwards: fed 8 takes 0.5 ms" in err and "before the batched" in err
    assert "run it when quiet" in err and not out.exists()
