"""Tree speculation: exact against target-only greedy decoding (OPT and Llama pairs of several shapes, lean or not),
its masks, acceptance, caches and charges checked by hand."""

from __future__ import annotations

import copy

import pytest
import torch

from bild_env import generate_speculative, generate_target_only, load_pair
from bild_env.decoding.cost_model import CostModel
from bild_env.decoding.loop import Committed
from bild_env.decoding.stats import DecodeStats
from bild_env.decoding.tree import (Tree, TreeRule, TreeRunner, _grow, accept_path, generate_tree, parse_tree_rule,
                                    tree_mask, tree_step)
from bild_env.models.compat import cache_kwarg
from bild_env.models.lean import make_lean
from bild_env.models.tiny import TinySpec, ensure_tiny_pair
from tests.test_batched_decoding import llama_pair  # noqa: F401 (the fixture)
from tests.test_decoders import random_prompt

RULES = ["1,1,1,1", "3,2,1", "2,2,2", "4:2:2", "8:4:3", "16:6:4", "8:6:2:0.3"]
CASES = [(seed, length) for seed in range(3) for length in (1, 9, 30)]


@pytest.fixture(scope="module")
def lean_llama_pair(llama_pair):
    """The Llama pair with the lean forward (the tree's 4-D masks run through it, not transformers' model)."""
    pair = copy.copy(llama_pair)
    pair.draft, pair.target = copy.deepcopy(llama_pair.draft), copy.deepcopy(llama_pair.target)
    assert make_lean(pair.draft, packed=False) and make_lean(pair.target, packed=False)
    return pair


@pytest.fixture(scope="module")
def wide_opt_pair():
    """An OPT pair of another shape: hidden 96, 6 heads, a 5-layer target over a 2-layer draft, another seed."""
    folder = ensure_tiny_pair(TinySpec(seed=3, hidden=96, heads=6, target_layers=5, draft_layers=2, alpha=0.15))
    return load_pair(draft=folder / "draft", target=folder / "target", tokenizer=folder / "tokenizer", device="cpu",
                     dtype="float32")


@pytest.mark.parametrize("pair_name", ["tiny_pair", "agreeing_pair", "wide_opt_pair", "llama_pair", "lean_llama_pair"])
def test_trees_equal_target_greedy(pair_name, request):
    pair = request.getfixturevalue(pair_name)
    seen = DecodeStats()
    for seed, length in CASES:
        ids = random_prompt(seed, length)
        ref = generate_target_only(pair, ids, 20).new_ids
        for rule in RULES:
            g = generate_tree(pair, ids, rule, 20)
            assert g.new_ids == ref, (seed, length, rule)
            seen += g.stats
    # the exactness above covered paths that stop inside the tree, at a leaf, and off the draft's first choice
    assert 0 < seen.full_accepts < seen.steps and 0 < seen.accepted < seen.proposed


@pytest.mark.parametrize("pair_name", ["tiny_pair", "lean_llama_pair"])
def test_a_chain_shaped_tree_is_naive_sd(pair_name, request):
    """The fixed tree (1,)*k grows naive SD's k-token chain: the same tokens, forwards and tokens fed."""
    pair = request.getfixturevalue(pair_name)
    fields = ("steps", "accepted", "proposed", "draft_forwards", "target_forwards", "draft_tokens_fed",
              "target_tokens_fed", "new_tokens")
    for seed, length in CASES[:5]:
        ids = random_prompt(seed, length)
        for k in (1, 3):
            chain = generate_speculative(pair, ids, k, 20)
            tree = generate_tree(pair, ids, ",".join(["1"] * k), 20)
            assert tree.new_ids == chain.new_ids
            assert {f: getattr(tree.stats, f) for f in fields} == {f: getattr(chain.stats, f) for f in fields}


def test_the_mask_lets_a_node_see_the_prefix_and_its_ancestors_only():
    tree = Tree.empty()
    for token, parent in ((10, -1), (11, -1), (12, 0), (13, 0), (14, 1), (15, 2)):
        tree.add(token, parent, 0.0)
    # the cache holds 2 committed tokens and nodes 0, 1 (fed at the last level); the forward feeds nodes 2..5
    seen = tree_mask(tree, [0, 1], [2, 3, 4, 5], prefix=2, fed_tokens=0, dtype=torch.float32)[0, 0] == 0
    #            prefix  n0 n1 | n2 n3 n4 n5
    expected = [[1, 1, 1, 0, 1, 0, 0, 0],   # node 2: parent 0
                [1, 1, 1, 0, 0, 1, 0, 0],   # node 3: parent 0
                [1, 1, 0, 1, 0, 0, 1, 0],   # node 4: parent 1
                [1, 1, 1, 0, 1, 0, 0, 1]]   # node 5: parent 2, grandparent 0
    assert seen.int().tolist() == expected
    # committed tokens fed first (causal), then the root's children
    seen = tree_mask(tree, [], [0, 1], prefix=1, fed_tokens=2, dtype=torch.float32)[0, 0] == 0
    assert seen.int().tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]


def test_acceptance_follows_the_targets_choices_and_stops_at_eos():
    tree = Tree.empty()
    for token, parent in ((5, -1), (6, -1), (7, 1), (8, 1), (9, 3), (50256, 2)):
        tree.add(token, parent, 0.0)
    # argmax[0]: after the root; argmax[1 + i]: after node i
    assert accept_path(tree, [6, 0, 8, 0, 9, 4, 0], 4, frozenset()) == ([1, 3, 4], 4)
    assert accept_path(tree, [6, 0, 8, 0, 9, 4, 0], 2, frozenset()) == ([1, 3], 9)  # the limit
    assert accept_path(tree, [6, 0, 7, 50256, 0, 0, 1], 4, frozenset({50256})) == ([1, 2, 5], 1)  # EOS ends it
    assert accept_path(tree, [3, 0, 7, 0, 0, 0, 0], 4, frozenset()) == ([], 3)  # no child is the target's choice


def test_draft_children_are_its_top_choices_after_each_path(tiny_pair):
    """Every node's children are the draft's most likely tokens after the prefix and the node's path (as a plain
    forward of that sequence gives them), so the tree masks and positions make each node see its path alone."""
    ids = random_prompt(7, 12)
    run = Committed(TreeRunner(tiny_pair), ids, 20, tiny_pair.eos_token_ids)
    tree = _grow(run.runner, run.tokens, TreeRule(branching=(3, 2, 2)), 3, run.eos)
    assert len(tree.tokens) == 3 + 6 + 12
    for parent in [-1, *range(9)]:
        path = [] if parent < 0 else [tree.tokens[i] for i in reversed(tree.ancestry(parent))]
        logits = tiny_pair.draft(torch.tensor([run.tokens + path])).logits[0, -1]
        children = [t for t, p in zip(tree.tokens, tree.parents) if p == parent]
        assert children == logits.topk(len(children)).indices.tolist()


def test_the_stop_ends_growth_where_the_draft_is_unsure(tiny_pair):
    """With a stop, a level is grown only while its most likely path's cumulative probability reaches it: at a stop
    near 1 only the root's children are proposed (one draft forward a step); the output stays the target's."""
    ids = random_prompt(5, 10)
    ref = generate_target_only(tiny_pair, ids, 16).new_ids
    unsure = generate_tree(tiny_pair, ids, TreeRule(8, 6, 2, stop=0.999999), 16)
    assert unsure.new_ids == ref and unsure.stats.draft_forwards == unsure.stats.steps
    sure = generate_tree(tiny_pair, ids, TreeRule(8, 6, 2), 16)
    assert sure.new_ids == ref and sure.stats.draft_forwards > sure.stats.steps


def test_caches_hold_the_committed_tokens_after_each_step(tiny_pair):
    """After a step both caches hold the committed tokens only (the followed nodes gathered out of the tree's
    columns): their keys equal a fresh forward's."""
    ids = random_prompt(2, 9)
    run = Committed(TreeRunner(tiny_pair), ids, 24, tiny_pair.eos_token_ids)
    counts = DecodeStats()
    while not run.done:
        tree_step(run, TreeRule(8, 4, 3), counts)
        for role in ("draft", "target"):
            model, cache = getattr(tiny_pair, role), run.runner.caches[role]
            n = run.runner.lengths[role]
            assert cache.get_seq_length() == n and n <= len(run.tokens) - 1 and run.runner.columns[role] == []
            from transformers import DynamicCache

            fresh = DynamicCache(config=model.config)
            model(torch.tensor([run.tokens[:n]]), **cache_kwarg(fresh), use_cache=True)
            for a, b in zip(cache.layers, fresh.layers):
                torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-4)
                torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-4)
    assert counts.accepted > counts.steps  # paths longer than one node were gathered


def test_a_verification_is_charged_by_the_nodes_it_feeds(tiny_pair):
    """One step of the fixed tree (2, 2) after a 5-token prompt, priced by a linear cost model by hand: the draft
    fed the root's context (its prefill, 6 tokens) then the 2 depth-1 nodes; the target fed the root and 6 nodes."""
    cost = CostModel(draft=(1.0, 0.1, 0.01), target=(4.0, 0.5, 0.02), device="test")
    run = Committed(TreeRunner(tiny_pair, cost), random_prompt(4, 5), 24, tiny_pair.eos_token_ids)
    before = run.runner.stats.copy()
    tree_step(run, TreeRule(branching=(2, 2)), DecodeStats())
    s = run.runner.stats - before
    assert (s.draft_forwards, s.draft_tokens_fed, s.target_forwards, s.target_tokens_fed) == (2, 8, 1, 7)
    draft_ms = (1.0 + 0.1 * 6 + 0.01 * 0) + (1.0 + 0.1 * 2 + 0.01 * 6)
    target_ms = 4.0 + 0.5 * 7 + 0.02 * 5
    assert s.model_ms == pytest.approx(draft_ms + target_ms)


def test_bad_rules_are_refused_with_the_forms():
    assert parse_tree_rule("16:6:4") == TreeRule(16, 6, 4)
    assert parse_tree_rule("3,2,1").nodes == 3 + 6 + 6
    assert parse_tree_rule("3,2,1").name == "tree (3,2,1)"
    assert parse_tree_rule("8:6:2:0.25") == TreeRule(8, 6, 2, stop=0.25)
    assert parse_tree_rule("8:6:2:0.25").name == "tree (8 nodes, depth<=6, top-2, cum<0.25)"
    for bad in ("16:6", "a,b", "0:2:2", "3,0", "", "100:4:4", "4,4,4,4", "8:6:2:1.5", "8:6:2:0.1:3"):
        with pytest.raises(ValueError, match=r"N:D:W|must be|at most"):
            parse_tree_rule(bad)


@pytest.mark.real_pair
def test_trees_equal_target_greedy_on_smollm2():
    """The smollm2 pair in float32, lean, the draft's restricted head: trees give the target's greedy tokens."""
    from bild_env.models.smollm2 import draft_path
    from bild_env.models.wheels import is_converted
    from bild_env.prompts.domains import load_domain
    from tests.test_smollm2 import _real_target

    folder = _real_target()
    if not is_converted(folder):
        pytest.skip(f"converted SmolLM2 target not in the cache ({folder}); "
                    "run `python -c 'from bild_env.models.smollm2 import ensure_target; ensure_target()'` once")
    pair = load_pair(draft=draft_path(), target=folder, tokenizer=folder, device="cpu", dtype="float32",
                     lean="both", draft_vocab=16384)
    for domain in ("prose", "chat"):
        for prompt in load_domain(pair.tokenizer, domain, "test", 2):
            ref = generate_target_only(pair, prompt, 24).new_ids
            for rule in ("3,2,1", "12:5:3"):
                assert generate_tree(pair, prompt, rule, 24).new_ids == ref, (domain, rule)


def test_bench_stop_rules_prices_trees_again_by_profiles(tiny_pair, tmp_path):
    """scripts.analysis.stop_rules with trees and two profiles: the machine's own prices again (the same speedups), and one
    where only a target forward costs (1 ms, whatever it is fed): there a speedup is the ratio of target forwards."""
    from scripts.analysis.stop_rules import StopRulesConfig, run
    from tests.conftest import COSTS

    COSTS.save(tmp_path / "same.json")
    forwards_only = CostModel(draft=(0.0, 0.0, 0.0), target=(1.0, 0.0, 0.0), device="test")
    (tmp_path / "nested.json").write_text('{"a": {"b": ' + __import__("json").dumps(forwards_only.to_dict()) + "}}")
    cfg = StopRulesConfig(pair="tiny-random", domains=("prose",), prompts=2, max_new_tokens=10, rules=("4:0.5",),
                          oracle=(), trees=("3,2,1", "8:4:3"), bootstrap=50,
                          profiles=(str(tmp_path / "same.json"), f"{tmp_path / 'nested.json'}:a.b"))
    result = run(cfg, COSTS)
    d = result["domains"]["prose"]
    assert {"tree (3,2,1)", "tree (8 nodes, depth<=4, top-3)"} <= set(d["methods"])
    assert all(r["same_as_target"] == 1.0 for r in d["methods"].values())
    same, flat = d["profiles"][str(tmp_path / "same.json")], d["profiles"][f"{tmp_path / 'nested.json'}:a.b"]
    for name, row in d["methods"].items():
        assert same[name]["speedup"] == pytest.approx(row["modelled"]["speedup"])
    tokens = {name: sum(x[0] for x in rows) for name, rows in d["per_prompt"].items()}
    assert len(set(tokens.values())) == 1  # lossless: every method commits the same tokens
    forwards = {name: sum(row["per_prompt_ms"]) for name, row in flat.items()}  # 1 ms a target forward
    for name, row in flat.items():  # target only takes one forward per token (the prefill gives the first)
        assert row["speedup"] == pytest.approx(tokens[name] / forwards[name])
    best = result["profiles"][f"{tmp_path / 'nested.json'}:a.b"]["best_tree"]
    assert best["best_chain_rule"] == "naive SD (k<=4, stop<0.5)"
    ratio = best["versus_best_chain"]["prose"]["ratio"]
    assert ratio == pytest.approx(forwards["naive SD (k<=4, stop<0.5)"] / forwards[best["name"]])


def test_the_cost_scripts_write_cost_models_the_bench_reads(tmp_path):
    """scripts/analysis/tree_costs.py on the tiny pair and scripts/analysis/assemble_cpu_profile.py on the repo's quiet runs: each
    writes a cost model ``scripts.analysis.stop_rules --profiles FILE:cost_model`` reads, v(1) = 1."""
    from scripts.analysis.stop_rules import read_profile
    from scripts.analysis.assemble_cpu_profile import AssembleConfig, assemble
    from scripts.analysis.tree_costs import TreeCostsConfig, run

    timed = run(TreeCostsConfig(pair="tiny-random", fed=(1, 2, 4), context=8, rounds=1, stored=False))
    assert timed["v"]["1"] == 1.0 and all(ms > 0 for cells in timed["least_ms"].values() for ms in cells.values())
    assembled = assemble(AssembleConfig())
    assert assembled["v"]["1"] == 1.0 and 0 < assembled["c"] < 1
    for result, name in ((timed, "timed.json"), (assembled, "assembled.json")):
        (tmp_path / name).write_text(__import__("json").dumps(result))
        cost = read_profile(f"{tmp_path / name}:cost_model")
        assert cost.ms("target", 4, 8) > 0 and cost.ms("draft", 1, 8) > 0
    target_1 = assembled["target_1_ms"]
    assert read_profile(f"{tmp_path / 'assembled.json'}:cost_model").ms("draft", 3, 100) == pytest.approx(
        assembled["c"] * target_1)


def test_the_lean_forward_runs_a_tree_mask_itself(lean_llama_pair, llama_pair):
    """A tree's 4-D additive mask runs through the lean body (not transformers' model), with the logits of
    transformers' model under the same mask and positions."""
    from transformers import DynamicCache

    tree = Tree.empty()
    for token, parent in ((11, -1), (12, -1), (13, 0), (14, 1)):
        tree.add(token, parent, 0.0)
    prompt = random_prompt(1, 6)
    ids = torch.tensor([prompt + tree.tokens])
    mask = tree_mask(tree, [], [0, 1, 2, 3], prefix=0, fed_tokens=6, dtype=torch.float32)
    positions = torch.tensor([list(range(6)) + [5 + d for d in tree.depths]])
    lean, plain = lean_llama_pair.target, llama_pair.target
    assert lean.model._handles(ids, mask, positions, DynamicCache(config=lean.config), None, {})
    out = [m(input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwarg(DynamicCache(config=m.config)),
             use_cache=True).logits for m in (lean, plain)]
    torch.testing.assert_close(out[0], out[1], atol=1e-4, rtol=1e-4)
