"""scripts/analysis/tree_room.py: the oracle's dynamic programme on tables worked out by hand, and its tables on a tiny pair
against generate_tree's own steps."""

from __future__ import annotations

import json

import numpy as np
import pytest

from scripts.analysis.stop_rules import Recorder, price
from bild_env import generate_target_only
from bild_env.decoding.loop import Committed
from bild_env.decoding.stats import DecodeStats
from bild_env.decoding.tree import TreeRunner, parse_tree_rule, tree_step
from scripts.analysis import tree_room
from tests.conftest import COSTS
from tests.test_decoders import random_prompt

# Two rules over five positions (states 0..4; 5 is the end). A advances 1 for 1 everywhere; B advances 3 from state 1
# and 2 from state 4, 1 elsewhere, for 2 (1.5 at state 4).
ADV = [[1, 1], [1, 3], [1, 1], [1, 1], [1, 2]]
COST = [[1, 2], [1, 2], [1, 2], [1, 2], [1, 1.5]]


def test_the_oracle_mixes_the_rules_as_worked_out_by_hand():
    # C[5] = 0; C[4] = min(1 + 0, 1.5 + 0) = 1 (A); C[3] = min(1 + 1, 2 + 1) = 2 (A); C[2] = 3 (A);
    # C[1] = min(1 + C[2], 2 + C[4]) = min(4, 3) = 3 (B); C[0] = min(1 + 3, 2 + 3) = 4 (A): A, then B to 4, then A
    assert tree_room.schedule(ADV, COST) == (4.0, [0, 1, 0])
    # each rule alone: its own path. A: five steps of 1. B: 0 -> 1 -> 4 -> end, 2 + 2 + 1.5
    assert tree_room.schedule(ADV, COST, [0]) == (5.0, [0, 0, 0, 0, 0])
    assert tree_room.schedule(ADV, COST, [1]) == (5.5, [1, 1, 1])
    # the oracle/fixed ratio of this table: best fixed (A, 5) over the oracle's 4
    assert tree_room.ratio_interval([5.0], [4.0], 100) == {"ratio": 1.25, "interval": None}


def test_the_schedule_breaks_ties_to_the_rule_listed_first_and_refuses_bad_tables():
    assert tree_room.schedule([[2, 2]], [[1.0, 1.0]]) == (1.0, [0])
    assert tree_room.schedule([[2, 2]], [[1.0, 1.0]], [1]) == (1.0, [1])
    assert tree_room.schedule(np.zeros((0, 3), dtype=int), np.zeros((0, 3))) == (0.0, [])
    with pytest.raises(ValueError, match="at least one token"):
        tree_room.schedule([[0, 1]], [[1.0, 1.0]])
    with pytest.raises(ValueError, match="same shape"):
        tree_room.schedule([[1, 1]], [[1.0]])
    with pytest.raises(ValueError, match="allowed"):
        tree_room.schedule(ADV, COST, [2])


def test_the_bootstrap_interval_holds_the_ratio():
    out = tree_room.ratio_interval([5.0, 6.0, 7.0], [4.0, 5.0, 7.0], 500)
    assert out["ratio"] == pytest.approx(18 / 16)
    assert out["interval"][0] <= out["ratio"] <= out["interval"][1]


RULES = ["1,1,1,1", "2,1", "3,2,1", "4:3:2", "8:4:3:0.2"]


def _own_steps(pair, ids, rule, n, recorder):
    """generate_tree's loop, step by step: the tokens each step advanced and its forwards."""
    recorder.take()
    run = Committed(TreeRunner(pair, recorder), ids, n, pair.eos_token_ids, pair.device)
    recorder.take()
    advanced, calls = [], []
    while not run.done:
        before = len(run.tokens)
        tree_step(run, rule, DecodeStats())
        advanced.append(len(run.tokens) - before)
        calls.append(recorder.take())
    return run.new_ids, advanced, calls


@pytest.mark.parametrize("seed,length", [(0, 5), (1, 12), (2, 30)])
def test_tables_on_a_tiny_pair_follow_generate_tree(agreeing_pair, seed, length):
    pair, n = agreeing_pair, 16
    ids = random_prompt(seed, length)
    rules = [parse_tree_rule(r) for r in RULES]
    recorder = Recorder(COSTS)
    tables = tree_room.step_tables(pair, ids, rules, n, recorder)
    ref = generate_target_only(pair, ids, n).new_ids
    assert tables["reference"] == ref and tables["mismatched"] == 0  # float32: every step is on the reference
    adv = np.array(tables["adv"])
    assert adv.shape == (len(ref) - 1, len(rules)) and adv.min() >= 1
    assert (adv == np.array(tables["committed"])).all()
    steps, prefill = tree_room.priced_tables(tables, COSTS)
    assert prefill == price([("target", len(ids), 0)], COSTS)
    costs = tree_room.prompt_costs(adv, steps, prefill, [0])
    assert all(costs["oracle"] <= fixed + 1e-9 for fixed in costs["fixed"])
    for r, rule in enumerate(rules):
        new_ids, advanced, own_calls = _own_steps(pair, ids, rule, n, recorder)
        assert new_ids == ref
        path, i = [], 0  # the fixed rule's path through the table
        while i < len(adv):
            path.append(i)
            i += adv[i, r]
        assert [int(adv[i, r]) for i in path] == advanced, rule
        # the same forwards, but for the draft's catch-up: a live step feeds the draft the leaf it never saw
        for i, calls in zip(path, own_calls):
            table_calls = tables["calls"][i][r]
            assert [c for c in table_calls if c[0] == "target"] == [c for c in calls if c[0] == "target"]
            assert len(table_calls) == len(calls)
            drafts, own = ([c[1:] for c in cs if c[0] == "draft"] for cs in (table_calls, calls))
            assert drafts[1:] == own[1:]
            if drafts and i > 0:  # the first draft forward: the table's feeds 1 token, a live step 1 or 2
                assert drafts[0][0] == 1 and own[0][0] in (1, 2) and own[0][0] + own[0][1] == 1 + drafts[0][1]
        if 0 in path:  # the first step starts from an empty draft cache, as generate_tree's does
            assert tables["calls"][0][r] == own_calls[0]


def test_the_command_writes_its_summary(tiny_pair, tmp_path):
    out = tmp_path / "room.json"
    cfg = tree_room.TreeRoomConfig(pair="tiny-random", domains=("prose", "chat"), split="validation", prompts=2,
                                   max_new_tokens=10, rules=("1", "1,1,1", "2,1", "4:3:2"),
                                   profiles=("h200-opt-eager", "h200-smollm2-eager-bf16"),
                                   chosen=("h200-opt-eager=2,1",), bootstrap=50, out=str(out))
    result = tree_room.run(cfg, pair=tiny_pair, progress=False)
    assert json.loads(out.read_text())["summary"] == json.loads(json.dumps(result["summary"]))
    assert [(x["domain"], x["index"]) for x in result["per_prompt"]] == [("prose", 0), ("chat", 0), ("prose", 1),
                                                                          ("chat", 1)]
    for x in result["per_prompt"]:
        for c in x["costs"].values():
            assert c["oracle"] <= min(c["fixed"]) + 1e-9 and c["oracle_chains"] >= c["oracle"] - 1e-9
    rows = result["summary"]["h200-opt-eager"]
    assert set(rows) == {"prose", "chat", "all"}
    assert rows["all"]["chosen"] == "2,1" and rows["all"]["versus_chosen"]["ratio"] >= 1.0
    assert rows["all"]["versus_best_fixed_hindsight"]["ratio"] >= 1.0
    assert sum(rows["all"]["oracle_use"].values()) == pytest.approx(1.0)
    assert rows["all"]["chains"]["best_fixed_hindsight"] in ("1", "1,1,1")
    assert "chosen" not in result["summary"]["h200-smollm2-eager-bf16"]["all"]
    assert "| prose | 2 | 2,1 |" in tree_room.report(result)
    # the oracle over {the fixed rule, one draft token} lies between the fixed rule and the full oracle
    assert 1.0 <= rows["all"]["oracle_fixed_or_1"]["ratio"] <= rows["all"]["versus_chosen"]["ratio"] + 1e-9
    # summarised again from the stored tables, another rule named as chosen: no decoding, the same numbers
    again = tree_room.resummarise(tree_room.TreeRoomConfig(tables=str(out), chosen=("h200-opt-eager=1",),
                                                           bootstrap=50))
    assert again["summary"]["h200-opt-eager"]["all"]["chosen"] == "1"
    before, after = (r["summary"]["h200-smollm2-eager-bf16"]["all"] for r in (result, again))
    for key in ("versus_best_fixed_hindsight", "oracle_use", "chains"):
        assert after[key] == before[key]


def test_bad_options_are_refused_before_anything_loads():
    bad = [dict(rules=("1,1", "1,1")), dict(rules=("9:9",)), dict(profiles=()), dict(chosen=("h200-opt-eager=3,3",)),
           dict(chosen=("nope=1,1,1,1",)), dict(split="train"), dict(prompts=0), dict(tables="/nonexistent.json")]
    for kwargs in bad:
        with pytest.raises(ValueError):
            tree_room.check_config(tree_room.TreeRoomConfig(pair="tiny-random", **kwargs))


def test_paired_costs_sets_each_method_against_the_base_by_prompt(tmp_path, capsys):
    """scripts/analysis/paired_costs.py on a hand-made per_prompt.csv: the base's summed ms over each method's, on the prompts
    both decoded, and the speedup over the single model."""
    from scripts.analysis import paired_costs as paired

    csv = tmp_path / "per_prompt.csv"
    csv.write_text("method,prompt_index,model_ms\nsingle model,0,100\nsingle model,1,200\nbase,0,50\nbase,1,100\n"
                   "other,0,100\nother,1,\n")
    out = paired.main([str(csv), "--base", "base", "--resamples", "0"])
    assert out["base"]["speedup"] == 2.0 and out["base"]["versus_base"]["ratio"] == 1.0
    assert out["other"]["versus_base"] == {"ratio": 0.5, "interval": None}  # prompt 1 has no cost: left out
    assert out["other"]["speedup"] == 1.0
    with pytest.raises(SystemExit):
        paired.main([str(csv), "--base", "nothing"])


def test_profile_shape_reads_the_profiles_tables():
    """scripts/analysis/profile_shape.py: each figure is a ratio of the profile's own batched forward costs."""
    from bild_env.decoding.profiles import load_profile
    from scripts.analysis import profile_shape as shape

    out = shape.main(["h200-opt-floor", "--context", "48"])["h200-opt-floor"]
    m = load_profile("h200-opt-floor").model
    assert out["c"] == pytest.approx(m.batch_ms("draft", 1, 1, 48) / m.batch_ms("target", 1, 1, 48))
    assert out["b32_fed17"] == pytest.approx(m.batch_ms("target", 32, 17, 48) / m.batch_ms("target", 32, 1, 48))
    assert out["b32_fed17"] > out["v17"]  # the floor's verification grows with the tokens fed at 32 rows
