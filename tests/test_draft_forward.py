"""Less work per forward: the restricted draft head, the lean Llama forward, their load_pair options and bench."""

from __future__ import annotations

import copy
import json
import types

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from bild_env import PairError, generate_bild, generate_speculative, generate_target_only, load_pair
from bild_env.decoding.kv import Row, batched_forward, crop_cache, draft_readout, single_forward
from bild_env.decoding.runner import LiveRunner
from bild_env.models import draft_head
from bild_env.models.compat import cache_kwarg
from bild_env.models.draft_head import (SubsetHead, frequent_ids, proposal_ids, proposal_logits, restrict_head,
                                        token_frequencies)
from bild_env.models.lean import LeanLlamaModel, PackedLinear, lean_unsupported, make_lean, rms_norm
from bild_env.models.tiny import TOKENIZER_DIR
from tests import test_batched_decoding as batched_tests
from tests.batched_helpers import generate_batched_bild, generate_batched_speculative
from tests.test_batched_decoding import llama_pair  # noqa: F401 (the fixture)
from tests.test_batched_decoding import test_batched_baselines_equal_their_batch_of_one_runs as baselines_equal_alone
from tests.test_batched_decoding import test_each_request_equals_its_batch_of_one_run as each_request_equals_alone

VOCAB = 50272  # the GPT-2 tokenizer's ids, padded as OPT's


def tiny_llama(layers: int, seed: int = 0, kind: str = "llama") -> torch.nn.Module:
    """A float32 random Llama with GQA (4 heads, 2 key/value heads) and tied embeddings, peaked by a scaled final norm;
    ``kind="qwen2"``: a Qwen2 of the same shape with random q/k/v biases (a forward that dropped them would not
    pass) and an untied output layer."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        initializer_range=0.2, tie_word_embeddings=kind == "llama", bos_token_id=50256,
                        eos_token_id=50256, pad_token_id=50256)
    model = model_cls(config).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)
        if kind == "qwen2":
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
        for layer in model.model.layers[2:]:  # layers a 2-layer draft lacks write little: the pair agrees often
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    return model


def save_tiny_pair(root, kind: str = "llama"):
    """A tiny pair on disk: a 4-layer target and a draft made of its embeddings, first 2 layers, norm (and head)."""
    target = tiny_llama(4, kind=kind)
    draft = tiny_llama(2, kind=kind)
    draft.load_state_dict({k: v for k, v in target.state_dict().items() if "layers.2." not in k and "layers.3." not in k})
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return root / "draft", root / "target"


@pytest.fixture(scope="module")
def llama_folders(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("tiny-llama"))


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 50257, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------- restricted head


def test_frequent_ids_are_the_most_frequent_with_the_always_ids_sorted():
    freqs = np.array([5.0, 1.0, 9.0, 1.0, 0.0, 7.0])
    assert frequent_ids(freqs, 3).tolist() == [0, 2, 5]
    assert frequent_ids(freqs, 4).tolist() == [0, 1, 2, 5]  # a tie goes to the lower id
    assert frequent_ids(freqs, 3, always=[4]).tolist() == [2, 4, 5]  # the always id replaces the least frequent
    assert frequent_ids(freqs, 6).tolist() == list(range(6))
    for bad in (0, 7):
        with pytest.raises(ValueError, match="draft vocabulary"):
            frequent_ids(freqs, bad, always=[4])


def test_token_frequencies_count_train_splits_only_each_domain_weighing_one(monkeypatch):
    import bild_env.prompts.domains as domains

    asked = []
    texts = {"prose": [[1, 1, 1, 2]], "code": [[3]], "chat": [[2, 2]], "long": [[1, 4], [4, 1]]}

    def fake_load_domain(tokenizer, domain, split, **opts):
        asked.append(split)
        return texts[domain]

    monkeypatch.setattr(domains, "load_domain", fake_load_domain)
    freqs = token_frequencies(None, 6)
    assert set(asked) == {"train"} and len(asked) == len(draft_head.FREQUENCY_DOMAINS)
    assert freqs.tolist() == pytest.approx([0.0, 0.75 + 0.5, 0.25 + 1.0, 1.0, 0.5, 0.0])


def test_token_frequencies_add_each_domains_share_of_the_targets_continuations(monkeypatch, tmp_path):
    import bild_env.prompts.domains as domains

    texts = {"prose": [[1, 1, 1, 2]], "code": [[3]], "chat": [[2, 2]], "long": [[1, 4], [4, 1]]}
    monkeypatch.setattr(domains, "load_domain", lambda tokenizer, domain, split, **opts: texts[domain])
    answers = {"code": np.array([0, 0, 0, 0, 0, 3]), "chat": np.array([1, 0, 0, 1])}  # shorter than the vocab: padded
    freqs = token_frequencies(None, 6, continuations=answers)
    assert freqs.tolist() == pytest.approx([0.5, 1.25, 1.25, 1.5, 0.5, 1.0])
    assert frequent_ids(freqs, 2).tolist() == [1, 3] and frequent_ids(freqs, 4).tolist() == [1, 2, 3, 5]  # 5: answers only
    assert draft_head.load_workload_counts(tmp_path) == {} and draft_head.load_workload_counts("org/hub-id") == {}
    np.savez_compressed(tmp_path / draft_head.COUNTS_FILE, **answers)
    loaded = draft_head.load_workload_counts(tmp_path)
    assert sorted(loaded) == ["chat", "code"] and loaded["code"].tolist() == [0, 0, 0, 0, 0, 3]


def test_subset_head_keeps_the_full_heads_logits_on_its_ids_and_minus_infinity_elsewhere():
    torch.manual_seed(0)
    full = torch.nn.Linear(8, 20, bias=False)
    ids = torch.tensor([1, 4, 5, 19])
    head = SubsetHead(full.weight, ids)
    hidden = torch.randn(2, 3, 8)
    z = head(hidden)
    assert z.shape == (2, 3, 20)
    assert torch.allclose(z[..., ids], full(hidden)[..., ids], atol=1e-6)
    outside = torch.ones(20, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(z[..., outside]).all()
    assert set(z.argmax(-1).flatten().tolist()) <= set(ids.tolist())
    head.pack()
    assert torch.allclose(head(hidden), z, atol=1e-4) and torch.isneginf(head(hidden)[..., outside]).all()


def test_draft_readout_of_a_restricted_heads_columns_gives_the_full_shape_answer_bit_for_bit():
    torch.manual_seed(0)
    full = torch.nn.Linear(8, 50, bias=False)
    ids = torch.tensor([3, 9, 10, 27, 44])
    head = SubsetHead(full.weight, ids)
    hidden = torch.randn(4, 8)
    z = head(hidden)  # (4, 50), -inf outside ids
    with proposal_logits(types.SimpleNamespace(get_output_embeddings=lambda: head)) as columns_ids:
        assert torch.equal(columns_ids, ids)
        columns = head(hidden)  # within the context the head gives its K columns alone
    assert columns.shape == (4, 5) and torch.equal(columns, z[:, ids])
    assert head(hidden).shape == (4, 50)  # and the full shape again outside it
    args, probs = draft_readout(columns, ids)
    want_args, want_probs = draft_readout(z)
    assert args == want_args and set(args) <= set(ids.tolist())
    assert probs == pytest.approx(want_probs, rel=1e-6)
    assert probs == pytest.approx(torch.softmax(z, -1).amax(-1).tolist(), rel=1e-6)
    with pytest.raises(ValueError, match="proposal_logits"):
        draft_readout(z, ids)  # full-shape logits with ids: refused, not misread


def test_proposal_logits_is_per_thread_and_nests():
    import threading

    full = torch.nn.Linear(8, 30, bias=False)
    head = SubsetHead(full.weight, torch.tensor([2, 7]))
    seen, plain = [], types.SimpleNamespace(get_output_embeddings=lambda: full)
    with proposal_logits(plain) as none:  # a full head: nothing to map
        assert none is None
        with proposal_logits(plain):
            pass
        assert head(torch.randn(1, 8)).shape == (1, 2)  # still within the outer one
        worker = threading.Thread(target=lambda: seen.append(head(torch.randn(1, 8)).shape))
        worker.start()
        worker.join()
    assert seen == [(1, 30)]  # another thread is not within it
    assert head(torch.randn(1, 8)).shape == (1, 30)


def test_restrict_head_replaces_the_output_layer_and_keeps_the_input_embedding(tiny_pair):
    model = copy.deepcopy(tiny_pair.draft)
    embedding = model.get_input_embeddings().weight.clone()
    ids = torch.arange(100, 300)
    restrict_head(model, ids)
    assert isinstance(model.get_output_embeddings(), SubsetHead)
    assert torch.equal(proposal_ids(model), ids) and proposal_ids(tiny_pair.draft) is None
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    z = single_forward(model, Row([5, 6, 7], DynamicCache(config=model.config), 2))
    assert z.shape == (2, tiny_pair.vocab_size) and 100 <= int(z[-1].argmax()) < 300


# ---------------------------------------------------------------- lean forward


@pytest.mark.parametrize("packed", [False, True, None])  # None: measured
def test_lean_forward_matches_transformers_through_prefill_steps_crops_and_batches(packed):
    base = tiny_llama(3)
    lean = copy.deepcopy(base)
    assert make_lean(lean, packed) and isinstance(lean.model, LeanLlamaModel)
    assert make_lean(lean)  # twice is once
    if packed is not None:
        assert lean.model.packed == packed
        assert isinstance(lean.get_output_embeddings(), PackedLinear) == packed
        assert lean.get_output_embeddings().weight is lean.get_input_embeddings().weight  # still tied
    layer = lean.model.layers[0].self_attn
    if not lean.model.released:  # released (packed copies only): test_released_weights_... checks them
        assert layer.k_proj.weight.data_ptr() == lean.model.qkv[0][64:].data_ptr()  # a view, not a copy
    caches = [DynamicCache(config=base.config), DynamicCache(config=base.config)]
    for feed, keep, crop_to in [(prompt(0, 20), 3, None), ([7], 1, None), ([8, 9, 10, 11], 4, 22), ([12], 1, None)]:
        if crop_to is not None:
            for cache in caches:
                crop_cache(cache, crop_to)
        za, zb = (single_forward(m, Row(feed, c, keep)) for m, c in zip((base, lean), caches))
        assert za.shape == zb.shape == (keep, VOCAB)
        assert torch.allclose(za, zb, atol=1e-4, rtol=1e-4)
        assert torch.equal(za.argmax(-1), zb.argmax(-1))
        assert caches[0].get_seq_length() == caches[1].get_seq_length()
    # padded rows (an attention mask, position ids): kv.batched_forward's
    rows = [Row([1, 2, 3], DynamicCache(config=base.config), 1), Row([4, 5], DynamicCache(config=base.config), 2)]
    rows_lean = [Row(r.ids, DynamicCache(config=base.config), r.keep) for r in rows]
    for za, zb in zip(batched_forward(base, rows), batched_forward(lean, rows_lean)):
        assert torch.allclose(za, zb, atol=1e-4, rtol=1e-4)
    ids = torch.tensor([prompt(1, 6)])
    assert torch.equal(base.generate(ids, max_new_tokens=6, do_sample=False),
                       lean.generate(ids, max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_released_weights_are_held_once_and_made_again_exactly_for_transformers_own_layers(dtype):
    """Where every product reads a packed copy, the layers' weights are released (NaN placeholders, one element's
    memory) and the lean body runs on the copies; a call it does not run makes them again, bit for bit the
    weights they were (q, k, v again views of one fused weight), and transformers' layers then compute as before.
    A transposed plan's weights are views of its copies; a plan that reads the weights keeps them."""
    from bild_env.models.lean import set_plan
    from bild_env.models.products import can_pack

    base = tiny_llama(2).to(dtype)
    if not can_pack(base.model.layers[0].self_attn.q_proj.weight):
        pytest.skip("oneDNN cannot pack here")
    names = [n for n, _ in base.named_parameters() if n.startswith("model.layers.") and n.endswith("proj.weight")]
    lean = copy.deepcopy(base)
    assert make_lean(lean, True) and lean.model.released
    layers = lean.model.base.layers
    for layer in layers:
        for linear in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
            assert torch.isnan(linear.weight).all() and linear.weight.untyped_storage().nbytes() == linear.weight.element_size()
    ids = torch.tensor([prompt(2, 9)])
    tol = 1e-4 if dtype == torch.float32 else 0.05
    want = base(input_ids=ids).logits
    got = lean(input_ids=ids, use_cache=True, past_key_values=DynamicCache(config=base.config)).logits  # lean body
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    embeds = base.get_input_embeddings()(ids)
    got = lean.model(inputs_embeds=embeds).last_hidden_state  # not the lean body's: transformers' layers, made again
    assert not lean.model.released
    assert torch.equal(got, base.model(inputs_embeds=embeds).last_hidden_state)
    base_params, lean_params = dict(base.named_parameters()), {n.replace("model.base.", "model."): p
                                                              for n, p in lean.named_parameters()}
    for name in names:
        assert torch.equal(lean_params[name], base_params[name]), name
    attn = layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == lean.model.qkv[0][64:].data_ptr()  # a view again
    set_plan(lean, ("", "transposed"))
    assert lean.model.release_originals() and not lean.model.released  # views of the transposed copies
    copy_t = lean.model.products[0][0].copies["transposed"]
    assert lean.model.qkv[0].data_ptr() == copy_t.data_ptr()
    got = lean(input_ids=ids, use_cache=True, past_key_values=DynamicCache(config=base.config)).logits
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    set_plan(lean, ("", "plain", "weight_left"))
    assert not lean.model.release_originals()  # the plan reads the weights: nothing released
    assert not any(torch.isnan(p).any() for p in lean.parameters())


def test_generate_and_assisted_generation_run_the_lean_body_whichever_keyword_holds_the_cache(monkeypatch):
    """transformers 5.24 renamed the forwards' ``past_key_values`` to ``cache`` and ``generate`` passes ``cache=``:
    both names reach the lean body (a cache given under the other name sent HF assisted generation to the
    slow path unnoticed), and the outputs stay transformers' own."""
    base, base_draft = tiny_llama(3), tiny_llama(1)
    lean, lean_draft = copy.deepcopy(base), copy.deepcopy(base_draft)
    assert make_lean(lean, False) and make_lean(lean_draft, False)
    calls = []
    original = LeanLlamaModel._lean
    monkeypatch.setattr(LeanLlamaModel, "_lean", lambda self, *a, **k: calls.append(self) or original(self, *a, **k))
    ids = torch.tensor([prompt(4, 7)])
    for name in ("past_key_values", "cache"):
        calls.clear()
        out = lean(input_ids=ids, use_cache=True, **{name: DynamicCache(config=base.config)})
        assert len(calls) == 1 and torch.allclose(out.logits, base(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    calls.clear()
    assert torch.equal(lean.generate(ids, max_new_tokens=6, do_sample=False),
                       base.generate(ids, max_new_tokens=6, do_sample=False))
    assert len(calls) == 6  # the prefill and five steps, every one lean
    calls.clear()
    got = lean.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=lean_draft, do_sample=False,
                        max_new_tokens=8)
    want = base.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=base_draft, do_sample=False,
                         max_new_tokens=8)
    assert torch.equal(got, want)
    assert any(c is lean.model for c in calls) and any(c is lean_draft.model for c in calls)


def test_lean_trims_give_the_untrimmed_logits_and_leave_other_calls_to_transformers():
    """The norms as functions and the lean causal-LM forward (``trimmed``) change no logit; a call the lean
    forward does not run (labels) goes to transformers' forward and gets its loss."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    base = tiny_llama(2)
    lean = copy.deepcopy(base)
    make_lean(lean, packed=False)
    assert not isinstance(lean.model.norms[1], torch.nn.Module)  # LlamaRMSNorm became a function
    other = torch.nn.LayerNorm(8)
    assert rms_norm(other) is other and callable(rms_norm(LlamaRMSNorm(8)))
    outs = {}
    for trimmed in (True, False):
        lean.model.trimmed = trimmed
        cache = DynamicCache(config=base.config)
        outs[trimmed] = [single_forward(lean, Row(feed, cache, keep)) for feed, keep in ((prompt(2, 12), 2), ([5], 1))]
    assert all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
    ids = torch.tensor([prompt(3, 8)])
    loss = lean(input_ids=ids, labels=ids).loss
    assert loss is not None and torch.allclose(loss, base(input_ids=ids, labels=ids).loss, atol=1e-5)


def _padded_run(model, script, monkeypatch=None) -> tuple[list, "PaddedCache"]:
    """Run ``script`` (prefills, forwards, crops, a compaction, a join) on a PaddedCache of ``model``.

    Returns, per model call, the logits at the columns that hold a token (a list of (tokens, V) tensors), and the
    cache. Rows: mixed prompt lengths (left pads), an idle row, rollbacks (holes), a row joining with an empty
    cache whose prompt is prefilled apart.
    """
    from bild_env.decoding.rows import feed_rows
    from bild_env.decoding.padded import PaddedCache

    cache = PaddedCache(model)
    tokens = torch.randint(0, 50257, (5, 64), generator=torch.Generator().manual_seed(7))
    out = []
    with torch.inference_mode():
        for op, arg in script:
            if op == "prefill":  # arg: {row: prompt length}; rows with empty caches, new ones added first
                if max(arg) >= cache.rows:
                    cache.add_rows(max(arg) + 1 - cache.rows)
                rows = torch.tensor(sorted(arg))
                end = torch.tensor([arg[r] for r in sorted(arg)])
                ids, real, pos, n = feed_rows(tokens[rows], torch.zeros_like(end), end)
                z = cache.prefill(rows, ids, real, pos, keep=n)
            elif op == "forward":  # arg: tokens fed per row (0: idle)
                end = cache.length + torch.tensor(arg)
                ids, real, pos, n = feed_rows(tokens, cache.length, end)
                z = cache.forward(ids, real, pos, keep=n)
            elif op == "crop":  # arg: tokens each row drops
                cache.crop(cache.length - torch.tensor(arg))
                continue
            else:
                cache.compact()
                continue
            out.append(z[real])
    return out, cache


PADDED_SCRIPT = [
    ("prefill", {0: 1, 1: 9, 2: 5, 3: 14}),  # a 1-token prompt beside longer ones: left pads
    ("forward", [1, 1, 1, 1]),
    ("forward", [4, 2, 0, 3]),  # row 2 idle: 4 pad columns
    ("crop", [2, 0, 1, 3]),  # rollbacks: holes
    ("forward", [1, 3, 2, 1]),
    ("prefill", {4: 6}),  # a row joins with an empty cache (its pad columns in the others' past see nothing)
    ("forward", [2, 1, 1, 4, 1]),
    ("compact", None),
    ("forward", [1, 1, 1, 1, 1]),
    ("forward", [3, 1, 4, 2, 2]),
]


@pytest.mark.parametrize("packed", [False, True])
def test_lean_forward_runs_padded_rows_and_matches_transformers(packed, monkeypatch):
    """The padded decoder's forwards (a 2-D mask with left pads and holes, explicit position ids) run the lean
    forward, not transformers' (whose forward here raises), with logits at every real token within float32
    rounding of transformers', the same argmax, and no NaN in any row's cache."""
    base = tiny_llama(3)
    lean = copy.deepcopy(base)
    assert make_lean(lean, packed)

    def refuse(*args, **kwargs):
        raise AssertionError("the lean model fell back to transformers' forward")

    monkeypatch.setattr(lean.model.base, "forward", refuse)
    want, want_cache = _padded_run(base, PADDED_SCRIPT)
    got, got_cache = _padded_run(lean, PADDED_SCRIPT)
    assert len(got) == len(want) == 8
    for za, zb in zip(want, got):
        torch.testing.assert_close(zb, za, atol=1e-4, rtol=1e-4)
        assert torch.equal(za.argmax(-1), zb.argmax(-1))
    assert torch.equal(got_cache.valid, want_cache.valid) and torch.equal(got_cache.pos, want_cache.pos)
    for layer in got_cache._cache.layers:
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()


def test_lean_masked_forward_needs_no_kernel_that_survives_queries_seeing_nothing(monkeypatch):
    """Some SDPA kernels give NaN for a query that sees no key (torch 2.13's CPU ones give zeros). With one that
    does, the lean padded forward still gives transformers' logits at real tokens and a cache without NaN: every
    query sees at least its own column, so pad columns' hidden states, keys and values stay finite."""
    import torch.nn.functional as F

    from bild_env.models import lean as lean_module

    real_sdpa = F.scaled_dot_product_attention
    blind = []

    def nan_for_blind_queries(q, k, v, attn_mask=None, **kwargs):
        a = real_sdpa(q, k, v, attn_mask=attn_mask, **kwargs)
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            sees_nothing = ~attn_mask.any(-1, keepdim=True)  # (B, 1, n, 1)
            blind.append(int(sees_nothing.sum()))
            a = a.masked_fill(sees_nothing, float("nan"))
        return a

    base = tiny_llama(2)
    lean = copy.deepcopy(base)
    assert make_lean(lean, False)
    want, _ = _padded_run(base, PADDED_SCRIPT)
    monkeypatch.setattr(lean_module, "F", types.SimpleNamespace(**{**vars(F), "scaled_dot_product_attention":
                                                                   nan_for_blind_queries}))
    got, cache = _padded_run(lean, PADDED_SCRIPT)
    assert blind and sum(blind) == 0  # masks were passed, and none left a query blind
    for za, zb in zip(want, got):
        torch.testing.assert_close(zb, za, atol=1e-4, rtol=1e-4)
    for layer in cache._cache.layers:
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()


@pytest.mark.parametrize("mask_dtype", [torch.long, torch.bool])
def test_lean_forward_with_position_ids_alone_or_a_full_mask_matches_transformers(mask_dtype):
    """Position ids alone (rows at their own offsets), and a mask of all ones (long or bool), on a cache empty or
    not, fed 1 and 4 tokens: the lean forward's logits equal transformers' within float32 rounding."""
    base = tiny_llama(3)
    lean = copy.deepcopy(base)
    assert make_lean(lean, False)
    caches = {m: DynamicCache(config=base.config) for m in ("base", "lean")}
    models = {"base": base, "lean": lean}
    past = 0
    with torch.inference_mode():
        for n, how in [(5, "positions"), (1, "positions"), (4, "mask"), (1, "mask"), (3, "both"), (2, "none")]:
            ids = torch.tensor([prompt(past, n), prompt(past + 100, n)])
            kwargs = {}
            if how in ("positions", "both"):  # row 1 sits 7 positions further on (rotary: only differences matter)
                kwargs["position_ids"] = torch.arange(past, past + n)[None] + torch.tensor([[0], [7]])
            if how in ("mask", "both"):
                kwargs["attention_mask"] = torch.ones(2, past + n, dtype=mask_dtype)
            za, zb = (models[m](ids, **cache_kwarg(caches[m]), use_cache=True, **kwargs).logits for m in ("base", "lean"))
            torch.testing.assert_close(zb, za, atol=1e-4, rtol=1e-4)
            assert torch.equal(za.argmax(-1), zb.argmax(-1))
            past += n
    assert caches["lean"].get_seq_length() == past
    # what the lean forward does not take goes to transformers': a 4-D mask, a mask of another length
    handles = lean.model._handles
    cache = caches["lean"]
    ids = torch.tensor([[1, 2], [3, 4]])
    assert handles(ids, torch.ones(2, past + 2), None, cache, None, {})
    assert not handles(ids, torch.ones(2, 1, 2, past + 2, dtype=torch.bool), None, cache, None, {})
    assert not handles(ids, torch.ones(2, past + 3), None, cache, None, {})
    assert not handles(ids, None, torch.zeros(2, 3, dtype=torch.long), cache, None, {})
    assert not handles(ids, None, None, cache, None, {"output_attentions": True})
    lean.model.padded = False  # the padded case handed to transformers' forward (what scripts.analysis.batched compares)
    assert handles(ids, None, None, cache, None, {}) and not handles(ids, torch.ones(2, past + 2), None, cache, None, {})


@pytest.fixture(scope="module")
def lean_llama_pair(llama_pair):
    """test_batched_decoding's Llama-shaped pair with the lean forward in both models (copies; packing measured)."""
    import dataclasses

    draft, target = copy.deepcopy(llama_pair.draft), copy.deepcopy(llama_pair.target)
    assert make_lean(draft) and make_lean(target)
    return dataclasses.replace(llama_pair, draft=draft, target=target, lean=("draft", "target"))


@pytest.mark.parametrize("check", [each_request_equals_alone, baselines_equal_alone], ids=["each_request", "baselines"])
def test_batched_decoder_stays_exact_per_request_with_lean_models(check, lean_llama_pair, llama_pair, request,
                                                                   monkeypatch):
    """test_batched_decoding's exactness checks (each request of a changing batch against its batch-of-one run, the
    batched baselines against theirs) on the lean pair, whose forwards must all be lean ones: the batched
    decoder's masked forwards and the batch-of-one decoders' plain ones. The outputs equal the original pair's."""

    def refuse(*args, **kwargs):
        raise AssertionError("the lean model fell back to transformers' forward")

    for model in (lean_llama_pair.draft, lean_llama_pair.target):
        monkeypatch.setattr(model.model.base, "forward", refuse)
    check("lean_llama_pair", request)
    prompts = [batched_tests.random_prompt(rid, n) for rid, n in enumerate(batched_tests.LENGTHS)]
    lean_out, _ = batched_tests.run_batched(lean_llama_pair, prompts)
    plain_out, _ = batched_tests.run_batched(llama_pair, prompts)
    assert {rid: g.new_ids for rid, g in lean_out.items()} == {rid: g.new_ids for rid, g in plain_out.items()}


def test_bench_batched_lean_padded_cell_smoke():
    """scripts.analysis.batched --lean-padded's cell on a tiny Llama: every variant timed, the checks filled in, the lean
    model's padded case switched back on."""
    from scripts.analysis.batched import LEAN_VARIANTS, _lean_padded_cell

    base = tiny_llama(2)
    lean = copy.deepcopy(base)
    assert make_lean(lean, False)
    for prefill in (False, True):
        row = _lean_padded_cell(lean, base, 3, 2, 2, 12, 2, prefill)
        assert all(row[f"{name}_ms"] > 0 for name in LEAN_VARIANTS) and row["rounds"] == 2
        assert row["max_abs_logit_diff"] < 1e-3 and row["argmax_agree"] == 1.0
        assert len(row["row_lengths"]) == 3 and row["columns"] == 12 + (0 if prefill else 2)
        assert lean.model.padded


def test_lean_forward_is_refused_for_other_architectures(tiny_pair):
    assert "not a plain LlamaForCausalLM" in lean_unsupported(tiny_pair.draft)
    assert not make_lean(copy.deepcopy(tiny_pair.draft))
    pair = load_pair("tiny-random", device="cpu", lean="both")
    assert pair.lean == () and pair.key == tiny_pair.key


# ---------------------------------------------------------------- load_pair options and exactness


def test_pair_options_are_checked_and_name_the_pair(llama_folders):
    draft, target = llama_folders
    kw = {"draft": draft, "target": target, "tokenizer": TOKENIZER_DIR, "device": "cpu", "dtype": "float32"}
    with pytest.raises(PairError, match="lean must be one of"):
        load_pair(**kw, lean="fast")
    for bad in (-1, VOCAB + 1, True, 2.5):
        with pytest.raises(PairError, match="draft_vocab"):
            load_pair(**kw, draft_vocab=bad)
    assert load_pair(**kw, draft_vocab=0).key == load_pair(**kw).key  # 0: the full head, as a custom pair's default
    plain, lean = load_pair(**kw), load_pair(**kw, lean="draft")
    assert plain.lean == () and lean.lean == ("draft",)
    assert lean.key == plain.key + "|lean=draft"
    assert isinstance(lean.draft.model, LeanLlamaModel) and not isinstance(lean.target.model, LeanLlamaModel)


def test_decoders_stay_exact_with_lean_models_and_a_restricted_draft(llama_folders):
    draft, target = llama_folders
    kw = {"draft": draft, "target": target, "tokenizer": TOKENIZER_DIR, "device": "cpu", "dtype": "float32"}
    plain = load_pair(**kw)
    fast = load_pair(**kw, lean="both", draft_vocab=20000)
    assert fast.lean == ("draft", "target") and "|draft-vocab=20000@" in fast.key
    assert isinstance(fast.draft.get_output_embeddings(), SubsetHead)
    proposed = accepted = rollbacks = 0
    for seed, length in [(0, 1), (1, 7), (2, 30), (3, 12)]:
        ids = prompt(seed, length)
        ref = plain.target.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                                    pad_token_id=50256)[0, length:].tolist()
        assert generate_target_only(fast, ids, 20).new_ids == ref
        for k in (1, 4):
            g = generate_speculative(fast, ids, k=k, max_new_tokens=20)
            assert g.new_ids == ref, (seed, k)
            proposed, accepted = proposed + g.stats.proposed, accepted + g.stats.accepted
        for fallback in (0.0, 0.6, 1.0):
            g = generate_bild(fast, ids, fallback, 0.5, 6, 20)  # rollback 0.5 < ln 2: exactly the target's greedy output
            assert g.new_ids == ref, (seed, fallback)
            rollbacks += g.stats.rollbacks
    assert 0 < accepted < proposed and rollbacks > 0  # every branch of verification ran
    # the decoders read the restricted head's K columns alone: the same proposals, with token ids
    runner, ids = LiveRunner(fast), prompt(4, 9)
    full_shape = single_forward(fast.draft, Row(ids, DynamicCache(config=fast.draft.config), 1))  # -inf outside
    assert runner.draft_next(ids) == tuple(x[0] for x in draft_readout(full_shape))
    # the batched decoder too (its draft forwards within proposal_logits)
    prompts = [prompt(seed, length) for seed, length in [(5, 3), (6, 11), (7, 25)]]
    refs = [generate_target_only(plain, p, 16).new_ids for p in prompts]
    for gens in (generate_batched_speculative(fast, prompts, k=3, max_new_tokens=16),
                 generate_batched_bild(fast, prompts, 0.6, 0.5, 6, 16)):
        assert [g.new_ids for g in gens] == refs
        assert sum(g.stats.accepted for g in gens) > 0


def test_a_restricted_draft_counts_the_token_counts_its_folder_ships(llama_folders, tmp_path):
    """With ``workload_token_counts.npz`` beside the draft, ids only the target's continuations use join the head
    (and the pair's key names the other id set)."""
    import shutil

    draft, target = llama_folders
    shipped = tmp_path / "draft"
    shutil.copytree(draft, shipped)
    rare = [50000, 50001, 50002]  # ids no train prompt of the tiny tokenizer's domains is likely to hold
    np.savez_compressed(shipped / draft_head.COUNTS_FILE, prose=np.bincount(rare * 1000, minlength=VOCAB))
    kw = {"target": target, "tokenizer": TOKENIZER_DIR, "device": "cpu", "dtype": "float32", "draft_vocab": 64}
    plain, counted = load_pair(draft=draft, **kw), load_pair(draft=shipped, **kw)
    plain_ids, counted_ids = proposal_ids(plain.draft).tolist(), proposal_ids(counted.draft).tolist()
    assert set(rare) <= set(counted_ids) and not set(rare) & set(plain_ids) and len(counted_ids) == 64
    assert plain.key.split("|draft-vocab=")[1] != counted.key.split("|draft-vocab=")[1]


def test_bench_draft_forward_smoke(tmp_path):
    import shutil

    from scripts.analysis.draft_forward import main
    from bild_env.models.tiny import ensure_tiny_pair

    other = shutil.copytree(ensure_tiny_pair() / "draft", tmp_path / "other")  # another draft timed beside
    out = tmp_path / "df.json"
    assert main(["--pair", "tiny-random", "--repeats", "3", "--profile-steps", "2", "--agreement-prompts", "1",
                 "--agreement-tokens", "3", "--domains", "chat", "--draft-vocab", "2000", "--drafts", str(other),
                 "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["machine"] and report["config"]["threads"] == 1
    # OPT: no lean variants; the other draft with its restricted head, in the same rounds
    assert set(report["forwards"]) == {"target", "draft", "draft vocab 2000", "draft other vocab 2000"}
    assert report["forwards"]["target"]["ratio_to_target"] == 1.0
    assert set(report["breakdown_profiler_ms"]["draft"]) >= {"head matmul", "layer matmuls", "attention", "other ops"}
    rates = report["agreement"]["chat"]["vocab 2000"]
    assert 0 <= rates["agreement"] <= rates["target_token_in_vocab"] <= 1


def test_a_presets_draft_vocab_applies_to_its_own_draft_unless_the_caller_says_otherwise(monkeypatch, tmp_path):
    import shutil
    from dataclasses import replace

    from bild_env.models import pairs
    from bild_env.models.tiny import ensure_tiny_pair

    monkeypatch.setitem(pairs.PRESETS, "tiny-random", replace(pairs.PRESETS["tiny-random"], draft_vocab=64))
    own = load_pair("tiny-random")
    assert len(proposal_ids(own.draft)) == 64 and "|draft-vocab=64@" in own.key
    assert proposal_ids(load_pair("tiny-random", draft_vocab=0).draft) is None  # 0: the full head
    assert len(proposal_ids(load_pair("tiny-random", draft_vocab=32).draft)) == 32
    other = shutil.copytree(ensure_tiny_pair() / "draft", tmp_path / "draft")  # another draft for the preset's target
    kw = {"draft": str(other), "tokenizer": str(ensure_tiny_pair() / "tokenizer")}
    assert proposal_ids(load_pair("tiny-random", **kw).draft) is None
    assert len(proposal_ids(load_pair("tiny-random", **kw, draft_vocab=64).draft)) == 64
