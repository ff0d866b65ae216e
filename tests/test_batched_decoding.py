"""The batched decoder (continuous batching) against each request's batch-of-one run, on tiny pairs.

Exact per request in float32: the output and every counter of every step equal the request's own
``BildSession`` (``generate_speculative``, ``generate_target_only``) under the same thresholds, for
8 requests of mixed prompt lengths joining at different steps, on the OPT tiny pair and a Llama-shaped
one (grouped-query attention, rotary positions). Then the tensor rule against the scalar one, the
padded cache on its own, bad input and a failing forward.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from bild_env import generate_speculative, generate_target_only, new_bild_session
from bild_env.decoding.batched import BatchedDecoder, BatchError, first_rollback_rows, generate_batched_target_only
from bild_env.decoding.bild import first_rollback
from bild_env.decoding.padded import PaddedCache
from bild_env.decoding.stats import DecodeStats
from tests.batched_helpers import generate_batched_bild, generate_batched_speculative

LN2 = math.log(2)
COUNTS = ("new_tokens", "proposed", "accepted", "full_accepts", "fallbacks", "max_draft_hits", "rollbacks",
          "discarded", "mismatches", "steps", "guesses", "guesses_right", "low_guesses", "low_guesses_right",
          "draft_forwards", "target_forwards", "draft_tokens_fed", "target_tokens_fed")
SPEC_COUNTS = ("new_tokens", "proposed", "accepted", "full_accepts", "steps", "draft_forwards", "target_forwards",
               "draft_tokens_fed", "target_tokens_fed")
LENGTHS = (1, 7, 30, 12, 3, 45, 18, 5)  # 8 requests' prompt lengths
JOIN_AT = (0, 0, 0, 1, 2, 2, 4, 7)  # the batch step before which each request joins
MAX_NEW = (24, 16, 30, 20, 24, 12, 28, 18)


def random_prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 50257, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def counts(s: DecodeStats, names=COUNTS) -> dict:
    return {name: getattr(s, name) for name in names}


@pytest.fixture(scope="module")
def llama_pair():
    """A Llama-shaped tiny pair (GQA, RoPE, RMSNorm, SwiGLU), random weights, built like tiny-random's OPT pair:
    a peaked target and a draft made of its first two layers (the other two write into the residual scaled)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from bild_env.models.pairs import ModelPair
    from bild_env.models.tiny import GPT2_EOS, TOKENIZER_DIR

    def config(layers: int) -> LlamaConfig:
        return LlamaConfig(vocab_size=50272, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           initializer_range=0.2, bos_token_id=GPT2_EOS, eos_token_id=GPT2_EOS, pad_token_id=GPT2_EOS,
                           tie_word_embeddings=False)

    torch.manual_seed(0)
    target = LlamaForCausalLM(config(4)).eval()
    with torch.no_grad():
        target.model.norm.weight.mul_(6.0)
        for layer in target.model.layers[2:]:
            layer.self_attn.o_proj.weight.mul_(0.2)
            layer.mlp.down_proj.weight.mul_(0.2)
    draft = LlamaForCausalLM(config(2)).eval()
    draft.load_state_dict(target.state_dict(), strict=False)  # the target's embeddings, first 2 layers, norm, head
    return ModelPair("tiny-llama", draft.requires_grad_(False), target.requires_grad_(False),
                     AutoTokenizer.from_pretrained(TOKENIZER_DIR), torch.device("cpu"), torch.float32, (GPT2_EOS,), 256)


def thresholds(rid: int, k: int) -> tuple[float, float] | None:
    """Request ``rid``'s thresholds at its k-th step (None: speculation off). rid % 4 == 0 rolls back below
    ln 2 (exact), rid % 4 == 2 never rolls back; the fallback threshold moves with the step."""
    if (rid + k) % 5 == 3:
        return None
    return (0.0, 0.103, 0.3, 0.6)[(rid + k) % 4], (0.5, 2.0, math.inf, 4.697)[rid % 4]


def run_batched(pair, prompts) -> tuple[dict, dict]:
    """Decode ``prompts`` joining at ``JOIN_AT`` with per-request ``thresholds``: {rid: Generation}, {rid: [step stats]}."""
    decoder = BatchedDecoder(pair, max_draft_len=6)
    steps: dict = {rid: [] for rid in range(len(prompts))}
    t = 0
    while t <= max(JOIN_AT) or len(decoder):
        joining = [rid for rid, at in enumerate(JOIN_AT) if at == t]
        if joining:
            decoder.join([prompts[r] for r in joining], [MAX_NEW[r] for r in joining], joining)
        if len(decoder):
            plan = [thresholds(rid, len(steps[rid])) for rid in decoder.ids]
            out = decoder.step([p[0] if p else 0.0 for p in plan], [p[1] if p else 0.0 for p in plan],
                               [p is None for p in plan])
            for rid, s in out.items():
                steps[rid].append(s)
        t += 1
    return decoder.finished, steps


def run_alone(pair, prompt, rid) -> tuple:
    session = new_bild_session(pair, prompt, MAX_NEW[rid], max_draft_len=6)
    steps = []
    while not session.done:
        plan = thresholds(rid, len(steps))
        steps.append(session.step_off() if plan is None else session.step(*plan))
    return session, steps


@pytest.mark.parametrize("pair_name", ["tiny_pair", "llama_pair"])
def test_each_request_equals_its_batch_of_one_run(pair_name, request):
    pair = request.getfixturevalue(pair_name)
    prompts = [random_prompt(rid, length) for rid, length in enumerate(LENGTHS)]
    finished, steps = run_batched(pair, prompts)
    assert sorted(finished) == list(range(len(prompts)))
    seen = DecodeStats()
    for rid, prompt in enumerate(prompts):
        session, alone = run_alone(pair, prompt, rid)
        g = finished[rid]
        assert g.prompt_ids == prompt and g.new_ids == session.new_ids, rid
        assert [counts(s) for s in steps[rid]] == [counts(s) for s in alone], rid
        assert [s.regret for s in steps[rid]] == pytest.approx([s.regret for s in alone], rel=1e-4, abs=1e-4)
        assert counts(g.stats) == counts(session.total), rid  # the prefill included
        if rid % 4 == 0:  # rollback 0.5 < ln 2 at every step: the target's greedy output
            assert g.new_ids == generate_target_only(pair, prompt, MAX_NEW[rid]).new_ids
        if rid % 4 == 2:
            assert g.stats.rollbacks == 0
        seen += g.stats
    # the comparison covered every branch: rollbacks in some requests, fallbacks, full accepts, steps off
    assert seen.rollbacks > 0 and seen.fallbacks > 0 and seen.full_accepts > 0 and seen.max_draft_hits > 0
    assert sum(thresholds(rid, k) is None for rid in steps for k in range(len(steps[rid]))) > 0
    print(f"\n{pair_name}: {seen.steps} request-steps, {seen.rollbacks} rollbacks, {seen.fallbacks} fallbacks, "
          f"{seen.full_accepts} full accepts, acceptance {seen.acceptance_rate:.2f}")


@pytest.mark.parametrize("pair_name", ["tiny_pair", "llama_pair"])
def test_batched_baselines_equal_their_batch_of_one_runs(pair_name, request):
    pair = request.getfixturevalue(pair_name)
    prompts = [random_prompt(10 + rid, length) for rid, length in enumerate(LENGTHS)]
    for k in (1, 3):
        for prompt, limit, g in zip(prompts, MAX_NEW, generate_batched_speculative(pair, prompts, k, list(MAX_NEW))):
            ref = generate_speculative(pair, prompt, k, limit)
            assert g.new_ids == ref.new_ids and counts(g.stats, SPEC_COUNTS) == counts(ref.stats, SPEC_COUNTS)
    alone = [name for name in SPEC_COUNTS if name != "steps"]  # generate_target_only counts no steps; step_off does
    for prompt, limit, g in zip(prompts, MAX_NEW, generate_batched_target_only(pair, prompts, list(MAX_NEW))):
        ref = generate_target_only(pair, prompt, limit)
        assert g.new_ids == ref.new_ids and counts(g.stats, alone) == counts(ref.stats, alone)
        assert g.stats.steps == limit - 1 and g.stats.proposed == 0
    # lossless: BiLD below ln 2 equals them too
    for prompt, limit, g in zip(prompts, MAX_NEW, generate_batched_bild(pair, prompts, 0.2, 0.5, 4, list(MAX_NEW))):
        assert g.new_ids == generate_target_only(pair, prompt, limit).new_ids


def test_eos_ends_a_request_and_it_leaves_the_batch(tiny_pair):
    ids = [random_prompt(11, 9), random_prompt(12, 4)]
    ref = generate_target_only(tiny_pair, ids[0], 12).new_ids
    saved = tiny_pair.eos_token_ids
    tiny_pair.eos_token_ids = (ref[4],)
    try:
        decoder = BatchedDecoder(tiny_pair)
        decoder.join(ids, 12)
        sizes = []
        while len(decoder):
            decoder.step(0.1, 0.5)
            sizes.append(len(decoder))
        alone = generate_target_only(tiny_pair, ids[1], 12).new_ids
    finally:
        tiny_pair.eos_token_ids = saved
    assert decoder.finished[0].new_ids == ref[: ref.index(ref[4]) + 1]
    assert decoder.finished[1].new_ids == alone
    assert sizes[0] == 2 or sizes[-1] == 0


def test_tensor_rollback_rule_is_first_rollback():
    rng = random.Random(0)
    for _ in range(200):
        B, D = rng.randint(1, 6), rng.randint(1, 7)
        distances = torch.tensor([[rng.choice([0.1, 0.6, 1.0, 4.0, 5.0, 9.0]) for _ in range(D)] for _ in range(B)])
        drafts = torch.randint(0, 3, (B, D))
        argmax = torch.randint(0, 3, (B, D))
        pending = torch.tensor([rng.randint(0, D) for _ in range(B)])
        threshold = torch.tensor([rng.choice([0.0, 0.5, 4.0, 4.697, math.inf]) for _ in range(B)], dtype=torch.float64)
        got = first_rollback_rows(distances.double(), drafts, argmax, pending, threshold).tolist()
        for r in range(B):
            n = int(pending[r])
            want = first_rollback(distances[r, :n].tolist(), drafts[r, :n].tolist(), argmax[r, :n].tolist(),
                                  float(threshold[r]))
            assert got[r] == (n if want is None else want)


def test_padded_cache_crop_and_compact_keep_each_rows_logits(tiny_pair):
    """Rows of 3 lengths; a forward, a rollback of one row, another forward, compaction: the next logits
    of every row equal a fresh batch-of-one forward over its tokens."""
    from bild_env.decoding.rows import feed_rows

    model = tiny_pair.target
    rows = [random_prompt(s, n) for s, n in ((1, 5), (2, 17), (3, 9))]
    cache = PaddedCache(model)
    cache.add_rows(3)
    tokens = torch.zeros((3, 40), dtype=torch.long)
    for r, ids in enumerate(rows):
        tokens[r, : len(ids)] = torch.tensor(ids)
    lens = torch.tensor([len(ids) for ids in rows])
    with torch.inference_mode():
        ids, real, pos, _ = feed_rows(tokens, torch.zeros_like(lens), lens)
        cache.prefill(torch.arange(3), ids, real, pos, keep=1)
        for step, grow in enumerate(([3, 1, 2], [2, 2, 1])):
            for r, n in enumerate(grow):
                tokens[r, int(lens[r]) : int(lens[r]) + n] = torch.tensor(random_prompt(20 + 3 * step + r, n))
            end = lens + torch.tensor(grow)
            ids, real, pos, _ = feed_rows(tokens, cache.length, end)
            cache.forward(ids, real, pos, keep=1)
            lens = end
            if step == 0:  # row 0 rolls back 2 tokens, row 2 one
                lens = lens - torch.tensor([2, 0, 1])
                cache.crop(lens)
        assert cache.waste > 0
        columns = cache.columns
        cache.compact()
        assert cache.columns == int(lens.max()) < columns
        nxt = torch.tensor([[7], [8], [9]])
        z = cache.forward(nxt, torch.ones((3, 1), dtype=torch.bool), lens[:, None], keep=1)
        for r in range(3):
            seq = tokens[r, : int(lens[r])].tolist() + [int(nxt[r])]
            want = model(torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(z[r, -1], want, atol=1e-4, rtol=1e-4)
    assert torch.equal(cache.length, lens + 1)


def test_bad_input_names_the_request_and_changes_nothing(tiny_pair):
    pair = tiny_pair
    decoder = BatchedDecoder(pair)
    with pytest.raises(ValueError, match="the batch is empty"):
        decoder.step()
    with pytest.raises(ValueError, match="no prompts"):
        generate_batched_bild(pair, [])
    decoder.join([random_prompt(0, 6), random_prompt(1, 3)], 10, ["a", "b"])
    with pytest.raises(ValueError, match=r"request 'c': .*shorten the prompt"):
        decoder.add(random_prompt(2, pair.max_positions - 4), 10, "c")
    with pytest.raises(ValueError, match=r"request 'c': the prompt is empty"):
        decoder.join([random_prompt(3, 4), []], 10, ["d", "c"])
    with pytest.raises(ValueError, match=r"request 'e': prompt token ids must lie in"):
        decoder.add([1, 10**7], 10, "e")
    with pytest.raises(ValueError, match=r"request 'a': the id is already in use"):
        decoder.add([1, 2], 10, "a")
    with pytest.raises(ValueError, match=r"request 'f': max_new_tokens must be an integer >= 1"):
        decoder.add([1, 2], 0, "f")
    assert decoder.ids == ["a", "b"]  # nothing joined, "d" neither
    with pytest.raises(ValueError, match=r"request 'b': fallback threshold must be a probability"):
        decoder.step([0.1, 1.5], 4.0)
    with pytest.raises(ValueError, match=r"request 'a': rollback threshold"):
        decoder.step(0.1, [float("nan"), 4.0])
    with pytest.raises(ValueError, match="one per running request"):
        decoder.step([0.1, 0.2, 0.3], 4.0)
    with pytest.raises(ValueError, match="k must be"):
        decoder.step_speculative(0)
    while len(decoder):  # still exact after all of that
        decoder.step(0.1, 0.5)
    for rid, seed, n in (("a", 0, 6), ("b", 1, 3)):
        assert decoder.finished[rid].new_ids == generate_target_only(pair, random_prompt(seed, n), 10).new_ids


def _failing(monkeypatch, model, fail_at: int) -> list:
    """Make ``model``'s ``fail_at``-th forward from now raise an out-of-memory error; returns the call count."""
    calls = [0]
    forward = model.forward

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", flaky)
    return calls


@pytest.mark.parametrize("role,fail_at", [("target", 1), ("draft", 1), ("draft", 3), ("target", 2)])
def test_a_failed_forward_leaves_every_request_as_it_was(tiny_pair, monkeypatch, role, fail_at):
    pair = tiny_pair
    prompts = {"short": random_prompt(0, 4), "long": random_prompt(1, 40), "late": random_prompt(2, 60)}
    decoder = BatchedDecoder(pair, max_draft_len=4)
    decoder.join([prompts["short"], prompts["long"]], 20, ["short", "long"])
    decoder.step(0.1, 0.5)
    decoder.add(prompts["late"], 20, "late")  # longer than the draft cache: its first draft forward widens it
    before = {rid: tokens for rid, tokens in zip(decoder.ids, decoder.tokens.tolist())}
    lens = decoder.lens.tolist()
    with monkeypatch.context() as patch:
        _failing(patch, getattr(pair, role), fail_at)
        with pytest.raises(BatchError, match=r"requests \['short', 'long', 'late'\] failed .*OutOfMemoryError.*"
                                             r"request 'late' holds the most cache") as info:
            decoder.step(0.1, 0.5)
    assert info.value.request_ids == ["short", "long", "late"]
    assert decoder.lens.tolist() == lens
    assert {rid: t[:n] for (rid, t), n in zip(before.items(), lens)} == {
        rid: t[:n] for rid, t, n in zip(decoder.ids, decoder.tokens.tolist(), lens)}
    while len(decoder):
        decoder.step(0.1, 0.5)
    for rid, prompt in prompts.items():  # rollback 0.5 < ln 2: each equals its target-only output
        assert decoder.finished[rid].new_ids == generate_target_only(pair, prompt, 20).new_ids, rid


def test_a_failed_join_names_the_joining_requests_and_the_batch_goes_on(tiny_pair, monkeypatch):
    pair = tiny_pair
    decoder = BatchedDecoder(pair)
    decoder.add(random_prompt(0, 8), 12, "x")
    decoder.step(0.1, 0.5)
    with monkeypatch.context() as patch:
        _failing(patch, pair.target, 1)
        with pytest.raises(BatchError, match=r"requests \['y', 'z'\] could not join .*OutOfMemoryError") as info:
            decoder.join([random_prompt(1, 30), random_prompt(2, 5)], 12, ["y", "z"])
    assert info.value.request_ids == ["y", "z"] and decoder.ids == ["x"]
    decoder.join([random_prompt(1, 30)], 12, ["y"])  # the same id can join once it failed
    while len(decoder):
        decoder.step(0.1, 0.5)
    assert decoder.finished["x"].new_ids == generate_target_only(pair, random_prompt(0, 8), 12).new_ids
    assert decoder.finished["y"].new_ids == generate_target_only(pair, random_prompt(1, 30), 12).new_ids


def test_remove_and_step_reports(tiny_pair):
    decoder = BatchedDecoder(tiny_pair)
    ids = decoder.join([random_prompt(s, 5 + 3 * s) for s in range(4)], 16)
    assert ids == [0, 1, 2, 3] and decoder.add(random_prompt(9, 3), 16) == 4
    out = decoder.step(0.103, 4.697)
    step = decoder.last_step
    assert sorted(out) == ids + [4] and step.rows == 5
    assert step.forward_ms + step.readout_ms <= step.wall_ms and 0 <= step.bookkeeping <= step.overhead <= 1
    assert step.target_forwards >= 1 and step.draft_forwards >= 1
    for s in out.values():
        assert s.steps == 1 and s.proposed == s.accepted + s.discarded
        assert s.draft_forwards == s.proposed + s.fallbacks  # with no drafting request at its length limit
        assert s.wall_ms == step.wall_ms and 0 < s.forward_ms <= step.forward_ms + 1e-9
    partial = decoder.remove(2)
    assert 2 not in decoder.ids and len(partial.new_ids) == partial.stats.new_tokens >= 2
    assert decoder.draft_p.shape == (4,) and bool(((decoder.draft_p > 0) & (decoder.draft_p <= 1)).all())
    while len(decoder):
        decoder.step_speculative(3)
    assert sorted(decoder.finished) == [0, 1, 3, 4]
    assert all(len(g.new_ids) == 16 == g.stats.new_tokens for g in decoder.finished.values())


def test_bench_batched_reports_shares_and_equal_outputs(tiny_pair, tmp_path, capsys):
    from scripts.analysis import batched

    report = batched.main(["--batch", "7", "--max-new-tokens", "6", "--out", str(tmp_path / "b.json")])
    assert [row["method"] for row in report["methods"]] == ["bild", "sd", "off"]
    assert len(set(report["prompt_lengths"])) > 1  # 6 test prompts, one used again shorter
    for row in report["methods"]:
        assert row["same_outputs"] == row["requests"] == 7
        b = row["batched"]
        assert b["forward_share"] + b["readout_share"] + b["bookkeeping_share"] == pytest.approx(1.0)
        assert 0 < b["forward_share"] < 1 and b["ms_per_step"] > 0
    assert "bookkeeping" in capsys.readouterr().out
    layout = batched.main(["--layout", "--batch", "3", "--repeats", "2", "--out", str(tmp_path / "l.json")])
    assert [(r["model"], r["fed"]) for r in layout["layout"]] == [("draft", 1), ("draft", 4), ("target", 1), ("target", 4)]
    assert all(r["padded_ms"] > 0 and r["per_request_caches_ms"] > 0 for r in layout["layout"])
