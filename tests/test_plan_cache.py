"""The lean products' plan (``products.choose_ways``) chosen once per model, machine, kernel caps and thread count, stored
beside the cost tables and read back by later loads."""

from __future__ import annotations

import logging

import pytest
import torch

from bild_env.models import lean, products


@pytest.fixture
def layers():
    gen = torch.Generator().manual_seed(0)
    return [tuple(torch.randn(24, 16, generator=gen) for _ in range(4)) for _ in range(3)]


@pytest.fixture
def chosen(monkeypatch, tmp_path):
    """A private cache, and ``choose_ways`` counted (no timing: every count plain)."""
    monkeypatch.setenv("BILD_ENV_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(products, "choose_ways", lambda layers, *a, **k: calls.append(len(layers)) or {
        r: "plain" if r < 4 else "transposed" for r in products.ROWS})
    return calls


def test_a_plan_is_chosen_once_then_read_back(layers, chosen):
    first = products.cached_plan(layers)
    assert first == products.row_plan({r: "plain" if r < 4 else "transposed" for r in products.ROWS}) and len(chosen) == 1
    assert products.cached_plan(layers) == first and len(chosen) == 1  # a hit
    assert products.plan_path(products.plan_key(layers)).is_file()


@pytest.mark.parametrize("change", ["ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "threads", "weights", "dtype"])
def test_a_plan_is_chosen_again_when_its_key_changes(layers, chosen, monkeypatch, change):
    products.cached_plan(layers)
    if change == "threads":
        threads = torch.get_num_threads()
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    elif change == "weights":
        layers = [tuple(w + 1 for w in layer) for layer in layers]
    elif change == "dtype":
        layers = [tuple(w.bfloat16() for w in layer) for layer in layers]
    else:
        monkeypatch.setenv(change, "AVX2")
    products.cached_plan(layers)
    assert len(chosen) == 2


def test_a_damaged_plan_is_chosen_again_with_a_warning(layers, chosen, caplog):
    products.cached_plan(layers)
    path = products.plan_path(products.plan_key(layers))
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="bild_env.models.lean"):
        assert products.cached_plan(layers) == products.cached_plan(layers)
    assert len(chosen) == 2 and str(path) in caplog.text


def test_the_lean_model_reads_its_plan_from_the_cache(chosen):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    for _ in range(2):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        assert lean.make_lean(model)
    assert len(chosen) == 1 and model.model.plan[4] == "transposed"
