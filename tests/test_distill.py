"""The pieces of the distill package that decide what the draft learns (tiny models, no fetch)."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import distill as dd


TINY_TARGET = LlamaConfig(vocab_size=97, hidden_size=32, max_position_embeddings=64, rms_norm_eps=1e-5,
                          bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _tiny_cfg(intermediate: int) -> dd.DistillConfig:
    return dd.DistillConfig(layers=2, hidden=32, intermediate=intermediate, heads=2, kv_heads=1, head_dim=16)


def _student(intermediate: int, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(dd.student_config(_tiny_cfg(intermediate), TINY_TARGET)).eval()


def test_distill_loss_is_the_kl_of_the_coarsened_distributions():
    torch.manual_seed(0)
    teacher, student = torch.randn(1, 3, 10), torch.randn(1, 3, 10)
    values, indices = teacher.topk(4, -1)
    batch = {"values": values, "indices": indices, "lse": teacher.logsumexp(-1)}
    loss = dd.distill_loss(student, batch, hard_weight=0.0)
    p, q = teacher.softmax(-1), student.softmax(-1)
    expected = []
    for t in range(3):  # top-4 outcomes of the teacher plus one bin for the other six tokens
        top = indices[0, t]
        pc = torch.cat([p[0, t, top], (1 - p[0, t, top].sum()).view(1)])
        qc = torch.cat([q[0, t, top], (1 - q[0, t, top].sum()).view(1)])
        expected.append((pc * (pc / qc).log()).sum())
    torch.testing.assert_close(loss, torch.stack(expected).mean())
    hard = dd.distill_loss(student, batch, hard_weight=0.5)
    ce = -(q[0, torch.arange(3), indices[0, :, 0]].log()).mean()
    torch.testing.assert_close(hard, loss + 0.5 * ce)


def test_pca_embedding_keeps_the_top_directions():
    torch.manual_seed(0)
    emb = torch.randn(50, 2) @ torch.randn(2, 8)  # rank 2 in 8 dims
    low = dd.pca_embedding(emb, 2)
    assert low.shape == (50, 2)
    torch.testing.assert_close(low @ low.T, emb @ emb.T, rtol=1e-4, atol=1e-3)  # all inner products kept


def test_the_two_sample_sources_draw_their_own_windows_into_their_own_folders():
    stream = torch.arange(10_000)
    cfg = dd.DistillConfig()
    target, draft = (dd.window_prompts(stream, 64, 32, dd.window_seed(cfg, src, 256)) for src in ("target", "draft"))
    assert target.shape == draft.shape == (64, 32)
    for windows in (target, draft):  # each row is a contiguous slice of the stream
        assert torch.equal(windows - windows[:, :1], torch.arange(32).expand(64, 32))
    assert not set(target[:, 0].tolist()) & set(draft[:, 0].tolist())  # no window drawn by both
    assert torch.equal(target, dd.window_prompts(stream, 64, 32, dd.window_seed(cfg, "target", 256)))  # seeded
    folders = [f for s in dd.SAMPLE_SOURCES.values() for f in (s.gen_dir, s.teacher_dir)]
    assert len(set(folders)) == 4
    cfg = dd.parse_args(["samples", "--draft-sample-chunks", "12", "--draft-sample-batch", "4"])[1]
    assert (cfg.draft_sample_chunks, cfg.draft_sample_batch, cfg.sample_chunks) == (12, 4, 0)


def test_boolean_flags_take_yes_and_no_and_refuse_anything_else(capsys):
    assert dd.parse_args(["train", "--autocast-bf16", "off"])[1].autocast_bf16 is False
    assert dd.parse_args(["train", "--autocast-bf16", "Yes"])[1].autocast_bf16 is True
    with pytest.raises(SystemExit):
        dd.parse_args(["train", "--autocast-bf16", "flase"])
    assert "not a yes/no value" in capsys.readouterr().err


def test_bf16_on_a_cpu_that_only_emulates_it_is_warned_about(monkeypatch):
    def cpu(avx512_bf16: bool, amx: bool) -> None:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")  # kernels not held below it
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)

    on_cpu = dd.DistillConfig(device="cpu")
    cpu(False, False)
    assert dd.cpu_has_native_bf16() is False
    warning = dd.warn_if_bf16_is_emulated("train", on_cpu)
    assert "--autocast-bf16 0" in warning and "--teacher-dtype float32" in warning
    assert "--autocast-bf16" not in dd.warn_if_bf16_is_emulated("teacher", on_cpu)
    assert dd.warn_if_bf16_is_emulated("train", replace(on_cpu, autocast_bf16=False, teacher_dtype="float32")) is None
    assert dd.warn_if_bf16_is_emulated("measure", on_cpu) is None
    assert dd.warn_if_bf16_is_emulated("train", replace(on_cpu, device="cuda")) is None
    for native in ((True, False), (False, True)):
        cpu(*native)
        assert dd.cpu_has_native_bf16() is True and dd.warn_if_bf16_is_emulated("train", on_cpu) is None
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported")
    assert dd.cpu_has_native_bf16() is None and dd.warn_if_bf16_is_emulated("train", on_cpu) is None


def test_load_shards_reads_only_the_shards_it_needs(tmp_path):
    for i, n in enumerate((3, 3, 2)):
        torch.save({"ids": torch.full((n, 4), i), "lse": torch.full((n,), float(i))}, tmp_path / f"shard_{i:07d}.pt")
    torch.save({"ids": torch.zeros(1, 4), "lse": torch.zeros(1)}, tmp_path / "shard_0000009.pt.tmp")  # ignored
    everything = dd.load_shards(tmp_path)
    assert everything["ids"].shape == (8, 4) and everything["lse"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    first = dd.load_shards(tmp_path, 4)
    assert first["ids"].shape == (4, 4) and first["lse"].tolist() == [0, 0, 0, 1]
    (tmp_path / "shard_0000002.pt").write_bytes(b"not a shard")  # never opened when not needed
    assert dd.load_shards(tmp_path, 6)["lse"].tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(FileNotFoundError, match="run the `teacher` command"):
        dd.load_shards(tmp_path / "none")


def test_sampling_is_seeded_and_full_length():
    model = _student(48)
    prompts = torch.randint(3, 97, (3, 5))
    a = dd.continue_prompts(model, prompts.tolist(), 16, 1.0, seed=7)[0]
    b = dd.continue_prompts(model, prompts.tolist(), 16, 1.0, seed=7)[0]
    assert a.shape == (3, 16) and torch.equal(a, b) and torch.equal(a[:, :5], prompts)


def test_the_sampler_draws_from_the_model_distribution_and_never_draws_eos():
    """One step from a fixed next-token distribution: frequencies match softmax(logits / T)."""

    class Fixed(torch.nn.Module):
        def __init__(self, logits):
            super().__init__()
            self.logits, self.w = logits, torch.nn.Parameter(torch.zeros(1))
            self.config = LlamaConfig(eos_token_id=2)
            self.generation_config = type("G", (), {"eos_token_id": [2, 0]})()

        def forward(self, ids, use_cache=True, logits_to_keep=0, **cache):  # the cache under either keyword
            out = type("O", (), {})()
            out.logits = self.logits.expand(ids.shape[0], 1, -1)
            out.past_key_values = out.cache = None
            return out

    logits = torch.tensor([0.0, 1.0, 2.0, 0.5, -1.0, 1.5])
    rows = dd.continue_prompts(Fixed(logits), [[3]] * 20_000, 2, 2.0, seed=0)[0][:, 1]
    allowed = torch.tensor([False, True, False, True, True, True])
    p = torch.where(allowed, logits / 2.0, torch.tensor(float("-inf"))).softmax(-1)
    freq = torch.bincount(rows, minlength=6).float() / rows.numel()
    assert freq[0] == 0 and freq[2] == 0
    torch.testing.assert_close(freq, p, rtol=0, atol=0.015)  # ~4 standard errors at n=20,000


def test_sampling_bench_times_the_three_parts_on_a_tiny_model(tmp_path):
    from scripts.analysis import sampling

    from bild_env.models.tiny import ensure_tiny_pair

    out = tmp_path / "bench.json"
    sampling.main(["--model", str(ensure_tiny_pair() / "draft"), "--batch", "4", "--context", "6",
                   "--dtype", "float32", "--rounds", "2", "--repeat", "2", "--out", str(out)])
    result = json.loads(out.read_text())
    assert all(result[f"{k}_ms"] > 0 and len(result["rounds_ms"][k]) == 2 for k in ("forward", "multinomial", "cdf"))
    assert result["tokens_per_s_cdf"] == pytest.approx(4 / (result["forward_ms"] + result["cdf_ms"]) * 1000)


def test_a_resumed_run_keeps_its_init_and_export_nests_the_parent_run_once():
    # resuming without --init keeps the weights the run started from; repeating it is fine;
    # another --init (which the resume would silently ignore) is refused with what to do
    saved = {"init": "/w/best_phase5.pt", "steps": 1600}
    assert dd.resumed_config(dd.DistillConfig(steps=2600), saved).init == "/w/best_phase5.pt"
    assert dd.resumed_config(dd.DistillConfig(init="/w/best_phase5.pt"), saved).init == "/w/best_phase5.pt"
    with pytest.raises(ValueError, match="move ckpt.pt"):
        dd.resumed_config(dd.DistillConfig(init="/w/other.pt"), saved)
    with pytest.raises(ValueError, match="from 'scratch'"):
        dd.resumed_config(dd.DistillConfig(init="/w/other.pt"), {})
    assert dd.resumed_config(dd.DistillConfig(), {}).init == ""
    phase5 = {"config": {"init": "/w/best_phase4.pt"}, "history": [5], "init_from": {"config": {"init": ""}}}
    phase6 = {"config": {"init": "/w/best_phase5.pt"}, "history": [6], "init_from": phase5}
    # a run from --init weights nests the record exported before it ...
    assert dd.parent_record({"init": "/w/best_phase5.pt"}, phase5, history=[6]) is phase5
    # ... but an earlier export of the same run (it went on from there) is replaced, its parent kept
    assert dd.parent_record({"init": "/w/best_phase5.pt"}, phase6, history=[6]) is phase5
    assert dd.parent_record({"init": "/w/best_phase5.pt"}, phase6, history=[6, 7]) is phase5
    # a new run from the same --init path (the asset folder, now holding phase 6's weights) nests phase 6
    assert dd.parent_record({"init": "/w/best_phase5.pt"}, phase6, history=[1, 2]) is phase6
    # a run from scratch has no parent
    assert dd.parent_record({"init": ""}, phase6, history=[6]) is None


def test_averaging_checkpoints_is_the_elementwise_mean_and_refuses_other_shapes():
    a, b, c = (_student(64, seed=s).state_dict() for s in (0, 1, 2))
    bf16 = {k: v.bfloat16() for k, v in c.items()}
    mean = dd.average_states([a, b, bf16])
    name = "model.layers.0.mlp.down_proj.weight"
    assert mean.keys() == a.keys() and mean[name].dtype == torch.float32
    assert torch.allclose(mean[name], (a[name] + b[name] + bf16[name].float()) / 3)
    # a student built from the mean loads it and is a different function from either parent
    student = _student(64)
    student.load_state_dict(mean)
    ids = torch.arange(10).unsqueeze(0)
    for seed in (0, 1, 2):
        assert not torch.allclose(student(ids).logits, _student(64, seed=seed)(ids).logits)
    with pytest.raises(ValueError, match="at least two"):
        dd.average_states([a])
    with pytest.raises(ValueError, match="one student shape"):
        dd.average_states([a, _student(96).state_dict()])


def test_export_and_average_rebuild_the_student_in_the_checkpoints_own_shape():
    saved = asdict(_tiny_cfg(64))
    cfg = dd.saved_shape(dd.DistillConfig(lr=1e-4), saved)
    assert (cfg.layers, cfg.hidden, cfg.intermediate, cfg.heads, cfg.kv_heads, cfg.head_dim) == (2, 32, 64, 2, 1, 16)
    assert cfg.lr == 1e-4  # only the shape comes from the checkpoint
    # a student built in that shape loads a state dict of that shape
    LlamaForCausalLM(dd.student_config(cfg, TINY_TARGET)).load_state_dict(_student(64).state_dict())


def test_init_takes_the_weights_of_an_exported_draft_folder_or_a_checkpoint(tmp_path):
    # an exported folder (bf16 safetensors, as committed) starts a run on a machine without the old checkpoints
    exported = _student(64, seed=1)
    exported.to(torch.bfloat16).save_pretrained(tmp_path / "draft")
    student = _student(64, seed=0)
    student.load_state_dict(dd.init_state(str(tmp_path / "draft"), student))
    name = "model.layers.1.mlp.up_proj.weight"
    assert student.state_dict()[name].dtype == torch.float32
    assert torch.equal(student.state_dict()[name], exported.state_dict()[name].float())
    # a training checkpoint (.pt) as before
    torch.save({"model": _student(64, seed=2).state_dict()}, tmp_path / "best.pt")
    assert torch.equal(dd.init_state(str(tmp_path / "best.pt"), student)[name], _student(64, seed=2).state_dict()[name])
    # another shape, or nothing there: refused with what to do
    with pytest.raises(ValueError, match="MLP 64.*the student is.*MLP 48.*--intermediate at least as large"):
        dd.init_state(str(tmp_path / "draft"), _student(48))
    narrower = dd.student_config(replace(_tiny_cfg(64), heads=4, head_dim=8), TINY_TARGET)
    LlamaForCausalLM(narrower).save_pretrained(tmp_path / "heads")
    with pytest.raises(ValueError, match="4/1 heads x 8.*the student is.*2/1 heads x 16"):
        dd.init_state(str(tmp_path / "heads"), student)
    torch.save({"model": _student(96).state_dict()}, tmp_path / "wide.pt")
    with pytest.raises(ValueError, match="mlp.gate_proj.weight is \\(96, 32\\) there, \\(64, 32\\) in the student"):
        dd.init_state(str(tmp_path / "wide.pt"), student)
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        dd.init_state(str(tmp_path / "missing"), student)


def test_init_widens_a_narrower_mlp_without_changing_the_function(tmp_path):
    narrow = _student(64, seed=1)
    narrow.to(torch.bfloat16).save_pretrained(tmp_path / "draft")
    narrow = narrow.float()
    wide = _student(96, seed=0)
    fresh_gate = wide.model.layers[0].mlp.gate_proj.weight.detach().clone()
    for source in (str(tmp_path / "draft"), _save_pt(narrow, tmp_path / "narrow.pt")):
        wide.load_state_dict(dd.init_state(source, wide))
        ids = torch.randint(0, TINY_TARGET.vocab_size, (2, 12))
        with torch.no_grad():
            assert torch.allclose(wide(ids).logits, narrow(ids).logits, atol=1e-5)
        layer = wide.model.layers[0].mlp
        assert torch.equal(layer.gate_proj.weight[:64], narrow.model.layers[0].mlp.gate_proj.weight)
        assert torch.equal(layer.gate_proj.weight[64:], fresh_gate[64:])  # the new units: the student's own rows
        assert not layer.down_proj.weight[:, 64:].any()  # ... silenced by zero down-projection columns


def _save_pt(model: LlamaForCausalLM, path: Path) -> str:
    torch.save({"model": model.state_dict()}, path)
    return str(path)


class _WordTokenizer:
    """One token per whitespace-separated word: its integer value (a stand-in for the real tokenizer)."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[int(w) for w in text.split()] for text in texts]}


def test_doc_chunks_start_every_chunk_at_an_article_start(tmp_path):
    texts = ["11 12 13", "21 22", "31 32 33 34 35 36", "41", "51 52 53"]
    chunks = dd.doc_chunks(_WordTokenizer(), texts, seq_len=6)
    # [0 11 12 13 0 21] ends inside article 2, whose rest (22) is dropped; article 3 starts the next chunk
    # and fills it alone; [0 41 0 51 52 53] is complete; nothing is left for a fourth chunk
    assert chunks.tolist() == [[0, 11, 12, 13, 0, 21], [0, 31, 32, 33, 34, 35], [0, 41, 0, 51, 52, 53]]
    assert dd.doc_chunks(_WordTokenizer(), texts, seq_len=6, max_tokens=12).shape == (2, 6)
    assert dd.doc_chunks(_WordTokenizer(), texts[:1], seq_len=6).shape == (0, 6)  # an incomplete chunk is dropped
    # the packed layout cuts the same stream anywhere
    packed = dd.chunk(dd.token_stream(_WordTokenizer(), texts), 6)
    assert packed[1].tolist() == [22, 0, 31, 32, 33, 34]
    with pytest.raises(ValueError, match="--layout must be 'packed' or 'docs'"):
        dd.split_chunks(dd.DistillConfig(layout="doc"), _WordTokenizer(), "validation")
    with pytest.raises(ValueError, match="--layout must be 'packed' or 'docs'"):  # `average` reads the folders only
        dd.teacher_dirs(dd.DistillConfig(work=str(tmp_path), layout="doc"))
    assert dd.teacher_dirs(dd.DistillConfig(work=str(tmp_path)))[0] == tmp_path / "teacher_train"
    assert dd.teacher_dirs(dd.DistillConfig(work=str(tmp_path), layout="docs")) == (
        tmp_path / "teacher_train_docs", tmp_path / "teacher_val_docs")


def test_measure_refuses_an_unknown_split_before_loading_anything(tmp_path):
    cfg = dd.DistillConfig(target=str(tmp_path / "no-target"), out=str(tmp_path / "no-draft"), measure_split="val")
    with pytest.raises(ValueError, match="unknown wiki split 'val'; valid splits are: train, validation, test"):
        dd.measure(cfg)


def _greedy_alone(model: LlamaForCausalLM, prompt: list[int], length: int) -> list[int]:
    """Greedy continuation of one prompt, batch of one, no padding (eos never drawn)."""
    ids = list(prompt)
    with torch.no_grad():
        while len(ids) < length:
            logits = model(torch.tensor([ids])).logits[0, -1]
            logits[[2]] = float("-inf")
            ids.append(int(logits.argmax()))
    return ids


def test_workload_prompts_continue_as_their_own_batch_of_one_with_the_teachers_labels():
    """Left-padded prompts of three lengths, greedy: each row is its unpadded greedy continuation, and the
    labels read while sampling equal a teacher pass over the finished rows."""
    from distill.samples import continue_prompts

    model = _student(48, seed=3)
    model.config.eos_token_id, model.generation_config.eos_token_id = 2, 2
    torch.manual_seed(1)
    prompts = [torch.randint(3, 97, (n,)).tolist() for n in (3, 7, 5)]
    rows, labels = continue_prompts(model, prompts, 12, temperature=0.0, seed=0, top_k=4)
    assert rows.shape == (3, 12)
    for row, prompt in zip(rows.tolist(), prompts):
        assert row == _greedy_alone(model, prompt, 12)
    teacher = dd.teacher_topk(model, rows, 4)
    assert torch.equal(labels["indices"], teacher["indices"])
    torch.testing.assert_close(labels["lse"], teacher["lse"], rtol=0, atol=1e-4)
    torch.testing.assert_close(labels["values"].float(), teacher["values"].float(), rtol=0, atol=1e-2)
    sampled, none = continue_prompts(model, prompts, 12, temperature=1.0, seed=5)
    again, _ = continue_prompts(model, prompts, 12, temperature=1.0, seed=5)
    assert none is None and torch.equal(sampled, again) and (sampled != 2).all()
    assert all(sampled[i, : len(p)].tolist() == p for i, p in enumerate(prompts))
    with pytest.raises(ValueError, match="between 1 and 11 tokens"):
        continue_prompts(model, [list(range(3, 15))], 12, temperature=0.0, seed=0)


def test_workload_text_plans_follow_the_mix_and_training_refuses_no_validation(tmp_path):
    from transformers import AutoTokenizer

    from bild_env.models.tiny import ensure_tiny_pair
    from distill.domains import plan

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_pair() / "tokenizer")
    cfg = dd.DistillConfig(domain_mix="prose:1,code:3")
    draws = plan(cfg, 400, seed=0, split="train", tokenizer=tokenizer)
    counts = {d: sum(1 for name, _ in draws if name == d) for d in ("prose", "code", "chat")}
    assert counts["chat"] == 0 and 250 < counts["code"] < 350 and counts["prose"] == 400 - counts["code"]
    assert draws == plan(cfg, 400, seed=0, split="train", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="--domain-val"):
        dd.train(replace(cfg, work=str(tmp_path), wiki=False))


def test_greedy_workload_text_draws_each_prompt_once_before_any_twice():
    """Greedy continuations of one prompt are one text: the greedy source draws a domain's prompts without
    replacement, and repeats only past its pool (the tiny split's chat pool is smaller than what is asked)."""
    from transformers import AutoTokenizer

    from bild_env.models.tiny import ensure_tiny_pair
    from distill.domains import SOURCES, domain_prompts, plan

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_pair() / "tokenizer")
    cfg = dd.DistillConfig(domain_mix="chat:1")
    pool = {tuple(p) for p in domain_prompts(tokenizer, "chat", "train")}
    n = len(pool) + 5
    draws = [tuple(p) for _, p in plan(cfg, n, seed=0, split="train", tokenizer=tokenizer, distinct=True)]
    assert set(draws[: len(pool)]) == pool and set(draws[len(pool):]) <= pool  # the whole pool, then again
    sampled = [tuple(p) for _, p in plan(cfg, n, seed=0, split="train", tokenizer=tokenizer)]
    assert len(set(sampled)) < len(pool)  # with replacement some prompts come twice before others once
    assert SOURCES["greedy"][0] == "greedy_domain_chunks" and hasattr(cfg, "greedy_domain_chunks")


def test_counts_of_the_targets_workload_text_are_written_beside_the_draft(tmp_path, capsys):
    """``distill counts``: per domain, every token of the target's TRAIN continuations (not the draft's), in the
    file a restricted draft head reads; a folder that is not there is refused with a message, not a traceback."""
    import numpy as np

    from bild_env.models.draft_head import load_workload_counts
    from distill.cli import main
    from distill.data import save_shard
    from distill.domains import workload_token_counts

    work = tmp_path / "work"
    cfg = dd.DistillConfig(work=str(work))
    assert workload_token_counts(cfg) == {}
    for folder in ("domains", "domains_draft"):
        (work / folder).mkdir(parents=True)
    save_shard({"ids": torch.tensor([[5, 1, 1], [2, 2, 7]]).int(), "domains": ["code", "chat"]},
               work / "domains", "gen_0000000.pt")
    save_shard({"ids": torch.tensor([[1, 3, 3]]).int(), "domains": ["code"]}, work / "domains", "gen_0000002.pt")
    save_shard({"ids": torch.tensor([[9, 9, 9]]).int(), "domains": ["code"]}, work / "domains_draft", "gen_0000000.pt")
    counts = workload_token_counts(cfg)
    assert counts["code"].tolist() == [0, 3, 0, 2, 0, 1] and counts["chat"].tolist() == [0, 0, 2, 0, 0, 0, 0, 1]
    out = tmp_path / "draft"
    out.mkdir()
    main(["counts", "--work", str(work), "--out", str(out)])
    saved = load_workload_counts(out)
    assert {d: c.tolist() for d, c in saved.items()} == {d: c.tolist() for d, c in counts.items()}
    with pytest.raises(SystemExit, match="python -m distill counts: .*is not a folder"):
        main(["counts", "--work", str(work), "--out", str(tmp_path / "missing")])
    assert np.load(out / "workload_token_counts.npz").files == ["chat", "code"]


def test_init_layers_starts_a_shallower_student_from_chosen_layers(tmp_path):
    # a 3-layer trained draft, exported and as a checkpoint; a 2-layer student picks its layers 0 and 2
    deep_cfg = replace(_tiny_cfg(64), layers=3)
    torch.manual_seed(4)
    deep = LlamaForCausalLM(dd.student_config(deep_cfg, TINY_TARGET)).eval()
    deep.to(torch.bfloat16).save_pretrained(tmp_path / "deep")
    torch.save({"model": deep.state_dict()}, tmp_path / "deep.pt")
    cfg = replace(_tiny_cfg(64), init=str(tmp_path / "deep"), init_layers="0,2")
    assert dd.init_layers(cfg) == [0, 2]
    for source in ("deep", "deep.pt"):
        student = _student(64)
        student.load_state_dict(dd.init_state(str(tmp_path / source), student, dd.init_layers(cfg)))
        got, src = student.state_dict(), {k: v.float() for k, v in deep.state_dict().items()}
        for name in ("self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            assert torch.equal(got[f"model.layers.0.{name}"], src[f"model.layers.0.{name}"])
            assert torch.equal(got[f"model.layers.1.{name}"], src[f"model.layers.2.{name}"])
        assert torch.equal(got["model.embed_tokens.weight"], src["model.embed_tokens.weight"])
        assert torch.equal(got["model.norm.weight"], src["model.norm.weight"])
    # the student is the deep draft without its layer 1: run that by hand on the deep model and compare
    deep32 = LlamaForCausalLM(dd.student_config(deep_cfg, TINY_TARGET))
    deep32.load_state_dict({k: v.float() for k, v in deep.state_dict().items()})
    deep32.model.layers = torch.nn.ModuleList([deep32.model.layers[0], deep32.model.layers[2]])
    deep32.model.layers[1].self_attn.layer_idx = 1
    deep32.config.num_hidden_layers = 2
    ids = torch.arange(12).unsqueeze(0)
    assert torch.allclose(student(ids).logits, deep32.eval()(ids).logits, atol=1e-5)
    # without --init-layers another depth is refused with what to pass, not a load_state_dict error
    with pytest.raises(ValueError, match="has 3 layers, the student 2; pass --layers 3, or --init-layers"):
        dd.init_state(str(tmp_path / "deep.pt"), _student(64))
    with pytest.raises(ValueError, match="--layers \\(or --init-layers"):
        dd.init_state(str(tmp_path / "deep"), _student(64))
    with pytest.raises(ValueError, match="has 3 layers \\(0-2\\)"):
        dd.init_state(str(tmp_path / "deep.pt"), _student(64), [0, 3])


@pytest.mark.parametrize("given, message", [
    ("0,x", "not a list of integers"), ("0", "give --layers \\(2\\) distinct"), ("1,1", "distinct"),
    ("-1,0", "distinct non-negative"), ("0,1,2", "give --layers \\(2\\)")])
def test_a_malformed_init_layers_is_refused_before_anything_loads(given, message):
    with pytest.raises(ValueError, match=message):
        dd.init_layers(replace(_tiny_cfg(64), init="/nowhere", init_layers=given))
    with pytest.raises(ValueError, match="needs --init"):
        dd.init_layers(replace(_tiny_cfg(64), init_layers="0,1"))
    assert dd.init_layers(_tiny_cfg(64)) is None


def test_a_resumed_run_keeps_its_init_layers():
    saved = {"init": "/w/draft", "init_layers": "0,3,5"}
    assert dd.resumed_config(dd.DistillConfig(), saved).init_layers == "0,3,5"
    with pytest.raises(ValueError, match="not --init-layers '0,2,5'"):
        dd.resumed_config(dd.DistillConfig(init_layers="0,2,5"), saved)


def test_a_run_from_init_weights_scores_them_first_so_best_is_never_worse(tmp_path, monkeypatch):
    """Step 0 of a run from ``--init`` evaluates the weights it starts from: when no later evaluation beats them
    (here the learning rate is 0, so none can), best.pt holds those very weights, and the history says so."""
    import distill.training as tr

    start = _student(64, seed=5)
    torch.save({"model": start.state_dict()}, tmp_path / "init.pt")
    torch.manual_seed(0)
    ids = torch.randint(3, 97, (6, 12))
    teacher = torch.randn(6, 12, 97)
    values, indices = teacher.topk(4, -1)
    data = {"ids": ids, "values": values.half(), "indices": indices.int(), "lse": teacher.logsumexp(-1)}
    monkeypatch.setattr(tr, "build_all_samples", lambda cfg: None)
    monkeypatch.setattr(tr, "build_domain_data", lambda cfg: None)
    monkeypatch.setattr(tr, "_training_data", lambda cfg, work: (data, data))
    monkeypatch.setattr(tr, "build_student", lambda cfg: _student(64, seed=9))
    cfg = replace(_tiny_cfg(64), work=str(tmp_path / "w"), wiki=False, domain_val=6, init=str(tmp_path / "init.pt"),
                  steps=2, eval_every=1, batch_size=2, lr=0.0, warmup_steps=0, threads=1, device="cpu",
                  autocast_bf16=False)
    (tmp_path / "w").mkdir()
    tr.train(cfg)
    best = torch.load(tmp_path / "w" / "best.pt", weights_only=False)
    ckpt = torch.load(tmp_path / "w" / "ckpt.pt", weights_only=False)
    assert best["step"] == 0 and all(torch.equal(best["model"][k], v) for k, v in start.state_dict().items())
    assert [h["step"] for h in ckpt["history"]] == [0, 1, 2]
    assert ckpt["history"][0]["val_acceptance"] == best["val_acceptance"] == ckpt["best"]
