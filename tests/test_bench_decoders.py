"""bench/decoders.py: per-domain rows of every lossless method, their exactness, the limit speedup, bad options."""

from __future__ import annotations

import json

import pytest

from agents.common.stats import ratio_interval
from bench import decoders
from bild_env.decoding.stats import DecodeStats
from bild_env.models.tiny import TinySpec, ensure_tiny_pair

ROW_FIELDS = {"tokens_per_s", "speedup", "speedup_interval", "acceptance_rate", "mean_accepted_length", "cost_ratio",
              "verify_ratio", "limit_speedup", "limit_independent", "same_as_target", "lossless", "overhead", "median_ms_per_prompt",
              "new_tokens", "versus_best_chain"}


def test_the_limit_is_expected_tokens_per_step_in_target_forwards():
    # a = 0.5, k = 2: (1 - 0.5^3) / 0.5 = 1.75 tokens per step of 2 draft forwards at c = 0.1 and one target
    # forward fed 3 tokens: 1.2 target forwards with a free verify (v = 1), 1.45 at v = 1.25
    assert decoders.limit_speedup(0.5, 2, 0.1) == pytest.approx(1.75 / 1.2)
    assert decoders.limit_speedup(0.5, 2, 0.1, verify=1.25) == pytest.approx(1.75 / 1.45)
    assert decoders.limit_speedup(1.0, 3, 0.2) == pytest.approx(4 / 1.6)  # all accepted: k + 1 tokens
    assert decoders.limit_speedup(0.0, 4, 0.25) == pytest.approx(1 / 2.0)  # none: one token per step


def test_the_bound_takes_the_runs_as_measured_and_the_baselines_own_time_per_token():
    # 2.4 tokens per target forward (runs as they came), k = 3 drafts of 5 ms and a verification of 60 ms; the target
    # alone decoded at 60 ms a token: 2.4 * 60 / 75 = 1.92x; where the target alone also paid 15 ms a token outside
    # its forward (75 ms), the bound against it rises to 2.4 * 75 / 75
    assert decoders.bound_speedup(2.4, 3, 5.0, 60.0, 60.0) == pytest.approx(1.92)
    assert decoders.bound_speedup(2.4, 3, 5.0, 60.0, 75.0) == pytest.approx(2.4)
    # independent acceptance at the same mean: a = 0.6, k = 3 gives 2.176 tokens, below runs that came together
    assert decoders.limit_speedup(0.6, 3, 5 / 60, 1.0) < decoders.bound_speedup(2.4, 3, 5.0, 60.0, 60.0)


def test_the_speedup_interval_resamples_prompts_together():
    def stats(pairs):
        return [DecodeStats(new_tokens=n, wall_ms=ms) for n, ms in pairs]

    def speedup_interval(mine, base, resamples):
        return ratio_interval(*decoders._rates(mine), resamples, base=decoders._rates(base))["interval"]

    base = stats([(10, 100.0), (10, 200.0), (10, 50.0)])
    assert speedup_interval(stats([(10, 50.0), (10, 100.0), (10, 25.0)]), base, 200) == pytest.approx([2.0, 2.0])
    lo, hi = speedup_interval(stats([(10, 50.0), (10, 200.0), (10, 50.0)]), base, 200)
    assert 1.0 <= lo < hi <= 2.0
    assert speedup_interval(base, base, 0) is None
    assert speedup_interval(base[:1], base[:1], 100) is None
    assert ratio_interval(*decoders._rates(base), 0, base=decoders._rates(base[::-1]))["ratio"] == 1.0


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """A small run on tiny-random's target with another tiny draft (``--pair-options draft=``), float32."""
    draft = ensure_tiny_pair(TinySpec(alpha=0.1)) / "draft"
    out = tmp_path_factory.mktemp("bench") / "decoders.json"
    decoders.main(["--pair", "tiny-random", "--pair-options", f"draft={draft}", "--dtype", "float32", "--threads", "1",
                   "--domains", "prose", "code", "chat", "--prompts", "2", "--max-new-tokens", "12",
                   "--k", "1", "3", "--adaptive", "4:0.5", "--tree", "2,1,1", "--fallback", "0.3", "0.9", "--hf", "--timing-repeats", "1", "--bootstrap", "50",
                   "--out", str(out)])
    return json.loads(out.read_text()), str(draft)


def test_every_domain_has_a_row_per_method_with_its_fields(report):
    out, draft = report
    assert "AVX" in out["machine"] or "torch" in out["machine"]
    (r,) = out["reports"]
    assert r["models"][0] == draft and r["dtype"] == "torch.float32"
    assert list(r["domains"]) == ["prose", "code", "chat"]
    names = ["target only", "naive SD (k=1)", "naive SD (k=3)", "naive SD (k<=4, stop<0.5)", "tree (2,1,1)",
             "BiLD (0.3/0.5)", "BiLD (0.9/0.5)", "HF assisted"]
    for d in r["domains"].values():
        assert d["prompts"] == 2 and list(d["results"]) == names
        assert 0 < d["cost_ratio"] and {"draft 1", "target 1", "target 2", "target 4"} <= set(d["forward_ms"])
        assert 0 <= d["draft_agreement"]["agreement"] <= 1 and d["draft_agreement"]["positions"] > 0
        for name, row in d["results"].items():
            assert set(row) == ROW_FIELDS, name
            assert row["tokens_per_s"] > 0 and row["lossless"] and row["cost_ratio"] == d["cost_ratio"]
        sd = d["results"]["naive SD (k=3)"]
        assert 0 <= sd["acceptance_rate"] <= 1 and sd["limit_speedup"] > 0 and sd["verify_ratio"] > 0
        lo, hi = sd["speedup_interval"]
        assert lo <= hi
        adaptive = d["results"]["naive SD (k<=4, stop<0.5)"]
        assert adaptive["limit_speedup"] is None and 0 <= adaptive["acceptance_rate"] <= 1  # no i.i.d. limit for it
        tree, chains = d["results"]["tree (2,1,1)"], [n for n in names if n.startswith("naive SD")]
        fastest = max(chains, key=lambda n: d["results"][n]["tokens_per_s"])
        assert tree["versus_best_chain"]["name"] == fastest and "target 7" in d["forward_ms"]  # 6 nodes and the root
        assert tree["versus_best_chain"]["ratio"] == pytest.approx(tree["tokens_per_s"] / d["results"][fastest]["tokens_per_s"])
        assert d["results"][fastest]["versus_best_chain"] is None and tree["verify_ratio"] > 0
        assert d["results"]["target only"]["acceptance_rate"] is None
        assert d["results"]["target only"]["speedup"] == pytest.approx(1.0)


def test_lossless_methods_decode_the_target_only_tokens_in_float32(report):
    out, _ = report
    for domain, d in out["reports"][0]["domains"].items():
        for name, row in d["results"].items():
            if name != "target only":
                assert row["same_as_target"] == 1.0, (domain, name)


def test_a_rollback_of_ln2_or_more_is_marked_lossy(tiny_pair):
    rows = decoders.methods(tiny_pair, decoders.BenchConfig(fallback=(0.4,), rollback=1.0))
    assert [(m.name, m.lossless) for m in rows if m.name.startswith("BiLD")] == [("BiLD (0.4/1.0, lossy)", False)]


@pytest.mark.parametrize("argv, words", [
    (["--domains", "prose", "poetry"], "unknown domain(s) poetry; valid domains are: prose, code, chat, long"),
    (["--prompts", "0"], "--prompts must be at least 1"),
    (["--split", "train"], "held-out split"),
    (["--k", "0"], "draft length"),
    (["--fallback", "1.5"], "--fallback"),
    (["--adaptive", "4"], "give K:F"),
    (["--adaptive", "0:0.5"], "K must be at least 1"),
    (["--pair", "nope"], "unknown --pair 'nope'"),
    (["--pair", "tiny-random", "--dtype", "float32", "--domains", "long", "--prompts", "1", "--max-new-tokens", "200"],
     "drop long from --domains"),
])
def test_bad_options_exit_with_a_message(argv, words):
    with pytest.raises(SystemExit) as err:
        decoders.main(argv)
    assert isinstance(err.value.code, str) and words in err.value.code


def test_another_draft_keeps_the_presets_target_and_tokenizer():
    """``--pair-options draft=`` (here and in the envs: ``PairOptions.load``): the preset's target and its tokenizer;
    tiny-random's tokenizer is a folder of its own, and the target's folder, taken before, gave a 1-token vocabulary."""
    from bild_env import load_pair
    from bild_env.config import PairOptions

    draft = ensure_tiny_pair(TinySpec(alpha=0.1)) / "draft"
    other, own = PairOptions(draft=str(draft), device="cpu").load("tiny-random"), load_pair("tiny-random", device="cpu")
    assert other.ids[0] == str(draft) and other.ids[1] == own.ids[1]
    assert len(other.tokenizer) == len(own.tokenizer) == 50257
    assert other.tokenizer("def f(x): return x")["input_ids"] == own.tokenizer("def f(x): return x")["input_ids"]
