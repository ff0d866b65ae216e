"""Tree speculation in the batched decoder (``bild_env.decoding.batched_tree``): every row exact against target-only
greedy decoding of its prompt alone and against ``generate_tree`` of it alone (float32; OPT and Llama pairs, lean or
not), rows of different prompt lengths and limits and rows ending at EOS; a batch of one equal to ``generate_tree``
in every counter; the caches, the mask and the prices checked by hand."""

from __future__ import annotations

import pytest
import torch

from bild_env import generate_target_only
from bild_env.decoding.batch_costs import BatchCost
from bild_env.decoding.batched_tree import generate_batched_tree
from bild_env.decoding.batched_tree import BatchedTreeDecoder, rows_tree_mask
from bild_env.decoding.cost_model import CostModel
from bild_env.decoding.tree import Tree, TreeRule, generate_tree
from tests.test_batched_decoding import llama_pair, random_prompt  # noqa: F401 (the fixture)
from tests.test_tree import lean_llama_pair, wide_opt_pair  # noqa: F401 (the fixtures)

RULES = ["6:4:2", "3,2,1", "1,1,1", "8:6:2:0.3"]
LENGTHS = (9, 1, 30, 5)
MAX_NEW = [16, 20, 12, 18]
COUNTS = ("new_tokens", "steps", "proposed", "accepted", "full_accepts", "draft_forwards", "target_forwards",
          "draft_tokens_fed", "target_tokens_fed")


def counts(s) -> dict:
    return {name: getattr(s, name) for name in COUNTS}


@pytest.mark.parametrize("pair_name", ["tiny_pair", "agreeing_pair", "wide_opt_pair", "llama_pair", "lean_llama_pair"])
def test_each_row_equals_target_greedy_and_its_tree_alone(pair_name, request):
    pair = request.getfixturevalue(pair_name)
    prompts = [random_prompt(20 + i, n) for i, n in enumerate(LENGTHS)]
    refs = [generate_target_only(pair, p, m).new_ids for p, m in zip(prompts, MAX_NEW)]
    accepted = proposed = 0
    for rule in RULES:
        out = generate_batched_tree(pair, prompts, rule, MAX_NEW)
        for i, (prompt, limit, g) in enumerate(zip(prompts, MAX_NEW, out)):
            alone = generate_tree(pair, prompt, rule, limit)
            assert g.prompt_ids == prompt and g.new_ids == refs[i] == alone.new_ids, (rule, i)
            assert counts(g.stats) == counts(alone.stats), (rule, i)
            assert g.stats.target_forwards == g.stats.steps + 1  # one verification a step, after the prefill
            assert g.stats.new_tokens == limit or g.new_ids[-1] in pair.eos_token_ids
            accepted, proposed = accepted + g.stats.accepted, proposed + g.stats.proposed
    assert 0 < accepted < proposed


@pytest.mark.parametrize("pair_name", ["tiny_pair", "lean_llama_pair"])
def test_a_batch_of_one_is_generate_tree(pair_name, request):
    """One prompt: the same tokens and counters as ``generate_tree``, and the same prices (a batch of one is priced
    by the batch-1 cost model, as ``generate_tree`` prices it)."""
    pair = request.getfixturevalue(pair_name)
    cost = CostModel(draft=(1.0, 0.1, 0.01), target=(4.0, 0.5, 0.02), device="test")
    for seed, length in ((1, 7), (2, 24)):
        prompt = random_prompt(seed, length)
        for rule in ("3,2,1", "8:4:3", "1,1,1,1"):
            (g,) = generate_batched_tree(pair, [prompt], rule, 18, cost_model=cost)
            alone = generate_tree(pair, prompt, rule, 18, cost_model=cost)
            assert g.new_ids == alone.new_ids and counts(g.stats) == counts(alone.stats), rule
            assert g.stats.model_ms == pytest.approx(alone.stats.model_ms)


def test_rows_ending_at_eos_leave_and_the_others_go_on(tiny_pair):
    """An EOS token in one row's greedy output: that row ends there, the others run to their limits, each its
    target's greedy output with that EOS (rows leave the batch at different steps)."""
    prompts = [random_prompt(30 + i, n) for i, n in enumerate((6, 14, 3))]
    full = generate_target_only(tiny_pair, prompts[0], 20).new_ids
    saved = tiny_pair.eos_token_ids
    tiny_pair.eos_token_ids = (full[5],)
    try:
        refs = [generate_target_only(tiny_pair, p, m).new_ids for p, m in zip(prompts, (20, 10, 16))]
        for rule in ("3,2,1", "6:4:2"):
            decoder = BatchedTreeDecoder(tiny_pair)
            decoder.join(prompts, [20, 10, 16])
            sizes = []
            while len(decoder):
                decoder.step_tree(rule)
                sizes.append(len(decoder))
            assert [decoder.finished[i].new_ids for i in range(3)] == refs, rule
            assert len(set(sizes)) > 2  # rows left at different steps
    finally:
        tiny_pair.eos_token_ids = saved
    assert refs[0][-1] == full[5] and len(refs[0]) <= 6


def test_the_caches_hold_each_rows_committed_tokens_after_a_step(llama_pair):
    """After every step each row's valid slots hold its committed tokens alone, at positions 0, 1, ... (the nodes
    off the path are holes; the path's stay where they were fed), the target's all but the last token."""
    prompts = [random_prompt(40 + i, n) for i, n in enumerate((4, 11, 2))]
    decoder = BatchedTreeDecoder(llama_pair)
    decoder.join(prompts, 20)
    holes, compacted = 0, False
    while len(decoder):
        before = {role: cache.columns for role, cache in decoder.caches.items()}
        decoder.step_tree("8:4:3")
        compacted |= any(decoder.caches[role].columns < before[role] for role in before if len(decoder))
        for role, cache in decoder.caches.items():
            for r in range(len(decoder)):
                pos = sorted(cache.pos[r][cache.valid[r]].tolist())
                n = int(decoder.lens[r]) - 1
                assert pos == list(range(len(pos))) and int(cache.length[r]) == len(pos)
                assert len(pos) == n if role == "target" else len(pos) <= n
            holes += int((~cache.valid).sum())
    assert holes > 0 and compacted  # the holes were packed away (the batched decoder's compaction) on the way


def test_the_rows_mask_sees_committed_slots_and_ancestors_only():
    """Two rows over a cache of 4 slots, N = 3 new columns. Row 0: slot 0 a pad, slots 1-2 committed, node 0 of its
    tree in slot 3 (fed at the last level); it is fed nodes 1 and 2 (children of node 0), after one pad column.
    Row 1: slots 0-3 committed; it is fed 1 committed token (its root) and the root's 2 children."""
    a, b = Tree.empty(), Tree.empty()
    for token, parent in ((10, -1), (11, 0), (12, 0)):
        a.add(token, parent, 0.0)
    for token, parent in ((20, -1), (21, -1)):
        b.add(token, parent, 0.0)
    committed = torch.tensor([[False, True, True, False], [True, True, True, True]])
    seen = rows_tree_mask(committed, [0, 1], [a, b], [[1, 2], [0, 1]], [{0: 3}, {}], 3, torch.float32)[:, 0] == 0
    #                 slots 0-3   new 0-2
    assert seen[0].int().tolist() == [[0, 0, 0, 0, 1, 0, 0],   # a pad column: itself only
                                      [0, 1, 1, 1, 0, 1, 0],   # node 1: committed, node 0 (slot 3), itself
                                      [0, 1, 1, 1, 0, 0, 1]]   # node 2: likewise
    assert seen[1].int().tolist() == [[1, 1, 1, 1, 1, 0, 0],   # the committed token fed: causal
                                      [1, 1, 1, 1, 1, 1, 0],   # node 0 (a child of the root)
                                      [1, 1, 1, 1, 1, 0, 1]]   # node 1: not its sibling


def test_forwards_are_priced_by_the_batched_tables(tiny_pair):
    """One step of the fixed tree (2, 2) for two prompts (5 and 8 tokens): each row is charged the target's prefill
    of both (fed 8), the draft's prefill of both (fed 9), one draft forward of both fed 2 nodes each, and one
    verification of both fed the root and 6 nodes, each at the mean context of the rows."""
    table = BatchCost.from_table({(b, f): b * (1.0 + 0.5 * f) for b in (1, 2, 4) for f in (1, 16, 64)},
                                 per_context_ms=0.01)
    cost = CostModel(draft=(1.0, 0.1, 0.01), target=(4.0, 0.5, 0.02), device="test",
                     batched={"draft": table, "target": table})
    decoder = BatchedTreeDecoder(tiny_pair, cost)
    decoder.join([random_prompt(50, 5), random_prompt(51, 8)], 24)
    before = {rid: s.copy() for rid, s in decoder.totals.items()}
    out = decoder.step_tree(TreeRule(branching=(2, 2)))
    want = cost.batch_ms("draft", 2, 9, 0.0) + cost.batch_ms("draft", 2, 2, 7.5) + cost.batch_ms("target", 2, 7, 6.5)
    for rid in (0, 1):
        assert before[rid].model_ms == pytest.approx(cost.batch_ms("target", 2, 8, 0.0))
        assert out[rid].model_ms == pytest.approx(want)
        assert (out[rid].draft_forwards, out[rid].target_forwards, out[rid].proposed) == (2, 1, 6)
    assert (out[0].draft_tokens_fed, out[1].draft_tokens_fed) == (6 + 2, 9 + 2)
    with pytest.raises(ValueError, match="no batched table"):
        generate_batched_tree(tiny_pair, [[1, 2], [3]], "2,2", 8, cost_model=CostModel(draft=(1.0, 0.1, 0.01),
                                                                                       target=(4.0, 0.5, 0.02),
                                                                                       device="test"))


@pytest.mark.parametrize("role,fail_at", [("draft", 2), ("target", 1)])
def test_a_failed_forward_leaves_every_row_as_it_was(tiny_pair, monkeypatch, role, fail_at):
    """A draft level's forward or the verification fails (out of memory): ``BatchError``, every row as before the
    step; the batch then goes on to each row's target greedy output."""
    from bild_env.decoding.batched import BatchError
    from tests.test_batched_decoding import _failing

    prompts = [random_prompt(60 + i, n) for i, n in enumerate((4, 17))]
    decoder = BatchedTreeDecoder(tiny_pair)
    decoder.join(prompts, 16)
    decoder.step_tree("3,2,1")
    lens, tokens = decoder.lens.tolist(), decoder.tokens.tolist()
    with monkeypatch.context() as patch:
        _failing(patch, getattr(tiny_pair, role), fail_at)
        with pytest.raises(BatchError, match="OutOfMemoryError"):
            decoder.step_tree("3,2,1")
    assert decoder.lens.tolist() == lens
    assert [t[:n] for t, n in zip(decoder.tokens.tolist(), lens)] == [t[:n] for t, n in zip(tokens, lens)]
    while len(decoder):
        decoder.step_tree("3,2,1")
    for i, prompt in enumerate(prompts):
        assert decoder.finished[i].new_ids == generate_target_only(tiny_pair, prompt, 16).new_ids


def test_tree_steps_and_bild_steps_alternate(llama_pair):
    """Tree steps between lossless BiLD steps (rollback 0.5 < ln 2) on the same decoder: the holes a tree step
    leaves do not disturb the chain steps, and every row is its target's greedy output."""
    prompts = [random_prompt(70 + i, n) for i, n in enumerate((6, 13, 2))]
    decoder = BatchedTreeDecoder(llama_pair)
    decoder.join(prompts, 24)
    k = 0
    while len(decoder):
        if k % 2:
            decoder.step(0.3, 0.5)
        else:
            decoder.step_tree("6:4:2")
        k += 1
    for i, prompt in enumerate(prompts):
        assert decoder.finished[i].new_ids == generate_target_only(llama_pair, prompt, 24).new_ids
