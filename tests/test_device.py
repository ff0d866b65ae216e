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


XEON = """processor	: 0
vendor_id	: GenuineIntel
cpu family	: 6
model		: 143
model name	: Intel(R) Xeon(R) Platinum 8480+
stepping	: 8
flags		: fpu sse2 avx avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8

processor	: 1
vendor_id	: GenuineIntel
model name	: another core, ignored
"""
ZEN3 = """processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 25
model		: 1
model name	: AMD EPYC 7B13
stepping	: 1
flags		: fpu sse2 avx avx2 fma
"""


@pytest.fixture
def fake_cpu(monkeypatch, tmp_path):
    """Make ``cpu_info`` read a /proc/cpuinfo text given here (torch's own detection left out)."""
    def set_(text):
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        monkeypatch.setattr(dev_mod, "_torch_isa", set)
        monkeypatch.setattr(dev_mod, "cpu_info", lambda: read(str(path)))

    read = dev_mod.cpu_info.__wrapped__
    return set_


def test_cpu_info_reads_the_model_and_instruction_sets(fake_cpu):
    fake_cpu(XEON)
    info = dev_mod.cpu_info()
    assert info["model"] == "Intel(R) Xeon(R) Platinum 8480+" and info["family"] == "6" and info["model_number"] == "143"
    assert info["isa"] == ["AVX2", "AVX-512", "AVX512-BF16", "AMX"] and info["core"] == ""
    text = dev_mod.machine_description("cpu")
    assert text.startswith("Intel(R) Xeon(R) Platinum 8480+ (family 6 model 143; ")
    assert "AVX512-BF16, AMX)" in text and f"torch {torch.__version__}" in text
    threads = torch.get_num_threads()
    assert text.endswith(f", {threads} thread" + ("s" if threads > 1 else ""))
    fake_cpu(ZEN3)
    assert dev_mod.cpu_info()["isa"] == ["AVX2"] and dev_mod.cpu_info()["core"] == "Zen 3"
    assert dev_mod.machine_description("cpu").startswith("AMD EPYC 7B13 (family 25 model 1, Zen 3; ")


def test_the_device_name_tells_cpus_and_thread_counts_apart(fake_cpu):
    fake_cpu(XEON)
    xeon = dev_mod.device_name(torch.device("cpu"))
    fake_cpu(ZEN3)
    zen3 = dev_mod.device_name(torch.device("cpu"))
    assert xeon != zen3 and "Xeon" in xeon and "AMD EPYC 7B13" in zen3 and "AMX" in xeon and "AMX" not in zen3
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert dev_mod.device_name("cpu") != zen3 and dev_mod.device_name("cpu").endswith(f":{threads + 1}threads")
    finally:
        torch.set_num_threads(threads)


def test_this_machine_is_named_by_its_cpu_model():
    info = dev_mod.cpu_info()
    if info["model"] == "unknown CPU":
        pytest.skip("neither /proc/cpuinfo, lscpu nor platform names this CPU")
    assert info["model"] in dev_mod.machine_description() and "unknown" not in dev_mod.machine_description()
    assert info["model"] in dev_mod.device_name(torch.device("cpu"))


AVX2_EMULATION = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


@pytest.mark.parametrize("isa, capped", [("AVX2", True), ("avx512_core_vnni", True), ("AVX512_CORE_BF16", False),
                                         ("AVX512_CORE_AMX", False), ("ALL", False), ("", False)])
def test_auto_dtype_follows_the_isa_onednn_may_use_not_only_the_cpu_flags(isa, capped, monkeypatch):
    """A CPU with bfloat16 units whose oneDNN is held below AVX512_CORE_BF16 emulates bfloat16: "auto" is float32."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    dtype, reason = explain_dtype("auto", "cpu")
    assert dev_mod.cpu_has_native_bf16() is (not capped)
    assert dtype == (torch.float32 if capped else torch.bfloat16)
    if capped:
        assert "ONEDNN_MAX_CPU_ISA" in reason and "--dtype bfloat16" in reason
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "ALL")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")  # ATEN_CPU_CAPABILITY=avx2
    dtype, reason = explain_dtype("auto", "cpu")
    assert dtype == torch.float32 and "ATEN_CPU_CAPABILITY" in reason


def test_under_the_avx2_emulation_auto_is_float32_and_lossless_decoding_stays_exact():
    """The whole process under the AVX2 emulation (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``), as an
    AVX2-only CPU runs: the preset pair's "auto" dtype is float32 whatever the CPU's flags, and naive speculative
    decoding and lossless BiLD give the target's greedy tokens."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from bild_env import load_pair\n"
        "from bild_env.decoding.decoders import generate_bild, generate_speculative, generate_target_only\n"
        "from bild_env.models.device import explain_dtype\n"
        "assert torch.backends.cpu.get_cpu_capability() in ('AVX2', 'DEFAULT'), torch.backends.cpu.get_cpu_capability()\n"
        "dtype, reason = explain_dtype('auto', 'cpu')\n"
        "assert dtype == torch.float32, reason\n"
        "pair = load_pair('tiny-random', device='cpu', dtype='auto')\n"
        "assert next(pair.target.parameters()).dtype == torch.float32\n"
        "for seed in range(3):\n"
        "    ids = torch.randint(4, 500, (9,), generator=torch.Generator().manual_seed(seed)).tolist()\n"
        "    ref = generate_target_only(pair, ids, 20).new_ids\n"
        "    assert generate_speculative(pair, ids, k=4, max_new_tokens=20).new_ids == ref\n"
        "    assert generate_bild(pair, ids, fallback=0.3, rollback=0.5, max_new_tokens=20).new_ids == ref\n"
        "print('ok', reason)\n")
    out = subprocess.run([sys.executable, "-c", code], env=os.environ | AVX2_EMULATION, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
