"""scripts.analysis.stop_rules on the tiny pair: every rule and the oracle are lossless, the oracle keeps every proposal and
needs the fewest target forwards (its runs are the longest possible), and bad options are refused by name."""

from __future__ import annotations

import pytest

from scripts.analysis.stop_rules import StopRulesConfig, check_config, oracle_speculative, run
from bild_env import generate_speculative, generate_target_only
from tests.conftest import COSTS
from tests.test_batched_decoding import random_prompt


def test_oracle_runs_are_the_longest_possible(agreeing_pair):
    for seed in range(3):
        prompt = random_prompt(seed, 6 + seed)
        ref = generate_target_only(agreeing_pair, prompt, 24, COSTS).new_ids
        oracle = oracle_speculative(agreeing_pair, prompt, ref, 6, 24, COSTS)
        assert oracle.new_ids == ref
        assert oracle.stats.accepted == oracle.stats.proposed
        for rule in ({"confidence": 0.5}, {"confidence": 0.1, "score": "cumulative"}, {"confidence": 0.0}):
            g = generate_speculative(agreeing_pair, prompt, 6, 24, COSTS, **rule)
            assert g.new_ids == ref
            assert oracle.stats.target_forwards <= g.stats.target_forwards, rule


def test_bench_stop_rules_on_the_tiny_pair(tiny_pair):
    cfg = StopRulesConfig(pair="tiny-random", domains=("prose",), prompts=2, max_new_tokens=10,
                          rules=("4:0.5", "4:0.2:cumulative"), oracle=(4,), bootstrap=50)
    result = run(cfg, COSTS)  # fixed prices: nothing is timed
    rows = result["domains"]["prose"]["methods"]
    assert set(rows) == {"naive SD (k<=4, stop<0.5)", "naive SD (k<=4, cum<0.2)", "oracle (k<=4)"}
    assert all(r["same_as_target"] == 1.0 for r in rows.values())  # float32: lossless
    assert rows["oracle (k<=4)"]["acceptance"] == 1.0
    assert result["best_rule"]["name"] in rows and not result["best_rule"]["name"].startswith("oracle")
    for r in rows.values():
        lo, hi = r["modelled"]["interval"]
        assert lo <= r["modelled"]["speedup"] <= hi
    # every rule against the first, paired by prompt: the ratio of the two speedups over the target alone
    first, cum = rows["naive SD (k<=4, stop<0.5)"], rows["naive SD (k<=4, cum<0.2)"]
    assert first["versus_first_rule"]["modelled"]["ratio"] == pytest.approx(1.0)
    assert cum["versus_first_rule"]["modelled"]["ratio"] == pytest.approx(cum["modelled"]["speedup"] / first["modelled"]["speedup"])
    lo, hi = cum["versus_first_rule"]["modelled"]["interval"]
    assert lo <= cum["versus_first_rule"]["modelled"]["ratio"] <= hi
    assert "wall" not in rows["oracle (k<=4)"]["versus_first_rule"]  # the oracle's clock is not read
    per_prompt = result["domains"]["prose"]["per_prompt"]
    assert len(per_prompt["target only"]) == 2 and all(len(p) == 3 for p in per_prompt["oracle (k<=4)"])


@pytest.mark.parametrize("change, message", [({"rules": ("8:2",)}, "--rules"), ({"rules": ()}, "--rules"),
                                             ({"oracle": (0,)}, "--oracle"), ({"split": "train"}, "test")])
def test_bad_options_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        check_config(StopRulesConfig(pair="tiny-random", **change))
