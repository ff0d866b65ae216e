"""The dtype a pair runs in: "auto" decided from the machine at hand, explicit names, and what is logged."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from bild_env.models import device as dev_mod
from bild_env.models.device import DeviceError, explain_dtype, log_dtype, resolve_dtype


@pytest.fixture
def native_bf16(monkeypatch):
    """Set what ``cpu_has_native_bf16`` answers: ``native_bf16(True/False/None)``."""
    def set_(answer):
        monkeypatch.setattr(dev_mod, "cpu_has_native_bf16", lambda: answer)
    return set_


@pytest.mark.parametrize("auto", [None, "auto"])
def test_auto_is_float16_on_cuda_without_needing_a_gpu(auto, native_bf16):
    for answer in (True, False):
        native_bf16(answer)
        assert resolve_dtype(auto, torch.device("cuda")) == torch.float16
        assert resolve_dtype(auto, "cuda") == torch.float16


@pytest.mark.parametrize("auto", [None, "auto"])
def test_auto_on_cpu_follows_native_bf16(auto, native_bf16):
    native_bf16(True)
    dtype, reason = explain_dtype(auto, torch.device("cpu"))
    assert dtype == torch.bfloat16 and "native bfloat16" in reason and "--dtype float32" in reason
    for answer in (False, None):  # emulated, or torch cannot tell: float32
        native_bf16(answer)
        dtype, reason = explain_dtype(auto, torch.device("cpu"))
        assert dtype == torch.float32 and "--dtype bfloat16" in reason


def test_explicit_names_win(native_bf16):
    for answer in (True, False):
        native_bf16(answer)
        for device in ("cpu", "cuda"):
            assert resolve_dtype("float32", device) == torch.float32
            assert resolve_dtype("fp32", device) == torch.float32
            assert resolve_dtype("bfloat16", device) == torch.bfloat16
            assert resolve_dtype("bf16", device) == torch.bfloat16
            assert resolve_dtype("float16", device) == torch.float16
            assert resolve_dtype(torch.float16, device) == torch.float16


def test_unknown_dtype_names_the_valid_ones():
    with pytest.raises(DeviceError, match="unknown dtype 'float8'") as info:
        resolve_dtype("float8", "cpu")
    for name in ("float16", "bfloat16", "float32", "'auto'"):
        assert name in str(info.value)


def test_bf16_on_a_cpu_that_emulates_it_is_warned_about_with_a_measured_slowdown(native_bf16, monkeypatch, caplog):
    native_bf16(False)
    monkeypatch.setattr(dev_mod, "bf16_slowdown", lambda: 31.4)  # measuring is tested below
    with caplog.at_level(logging.INFO, logger="bild_env.models.device"):
        assert log_dtype("bfloat16", "cpu", "pair x") == torch.bfloat16  # not refused
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert re.search(r"bfloat16 measured \d+\.\dx slower than float32 on this CPU", warnings[0].getMessage())
    assert "31.4x" in warnings[0].getMessage() and warnings[0].getMessage().startswith("pair x: ")
    caplog.clear()
    native_bf16(True)  # native: no warning, an info line
    with caplog.at_level(logging.INFO, logger="bild_env.models.device"):
        log_dtype("bfloat16", "cpu")
        log_dtype("bfloat16", "cuda")
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO]


def test_bf16_slowdown_is_measured():
    ratio = dev_mod.bf16_slowdown.__wrapped__(budget_s=0.002, hidden=16, width=32)
    assert ratio > 0 and ratio == ratio  # a finite positive number (its size depends on the CPU)


@pytest.fixture
def empty_pair_cache(monkeypatch):
    """Load pairs afresh here (so their log lines happen), leaving the process-wide cache as it was."""
    from bild_env.models import pairs

    monkeypatch.setattr(pairs, "_CACHE", {})


def test_tiny_random_loads_in_float32_by_default(native_bf16, empty_pair_cache, caplog):
    from bild_env import load_pair

    native_bf16(True)  # even where auto would pick bfloat16
    with caplog.at_level(logging.INFO, logger="bild_env.models.device"):
        pair = load_pair("tiny-random", device="cpu")
    assert pair.dtype == torch.float32 and pair.key.endswith("|float32")
    assert next(p for p in pair.target.parameters()).dtype == torch.float32
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "tiny-random preset's default" in lines[0] and "float32" in lines[0]
    assert load_pair("tiny-random", device="cpu") is pair  # cached: not logged again
    assert len(caplog.records) == 1


@pytest.mark.parametrize("native", [True, False])
def test_a_custom_folder_pair_loads_as_auto(native, native_bf16, empty_pair_cache, caplog):
    from bild_env import load_pair
    from bild_env.models.tiny import ensure_tiny_pair

    native_bf16(native)
    folder = ensure_tiny_pair()
    with caplog.at_level(logging.INFO, logger="bild_env.models.device"):
        pair = load_pair(draft=folder / "draft", target=folder / "target", tokenizer=folder / "tokenizer", device="cpu")
    expected = torch.bfloat16 if native else torch.float32
    assert pair.name == "custom" and pair.dtype == expected
    assert next(p for p in pair.draft.parameters()).dtype == expected
    assert pair.key.endswith("|" + str(expected).removeprefix("torch."))
    assert any("dtype auto -> " + str(expected).removeprefix("torch.") in r.getMessage() for r in caplog.records)
