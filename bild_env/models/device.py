"""The device a pair runs on: which device and dtype by default, its name, and synchronising it.

One helper per mechanism, called by every caller: ``sync(device)`` before reading a clock,
``device_name(device)`` for cache keys and reports, ``cpu_has_native_bf16()`` wherever a choice
of dtype depends on the CPU at hand.
"""

from __future__ import annotations

import platform

import torch

DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float32": torch.float32, "fp32": torch.float32}


class DeviceError(ValueError):
    """A device or dtype that cannot be used; the message says what to do."""


def default_device() -> torch.device:
    """CUDA when torch sees a GPU, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None``/"auto": float16 on CUDA, float32 elsewhere; else one of ``DTYPES``' names."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise DeviceError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[dtype]


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so that a clock read after it is honest."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """A name of the device and thread count that timings depend on (a key of the cost-model cache)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu:{platform.machine()}:{platform.processor() or 'unknown'}:{torch.get_num_threads()}threads"


def cpu_has_native_bf16() -> bool | None:
    """Whether this CPU does bfloat16 arithmetic in hardware (AVX-512 BF16 or AMX), as torch detects it.

    None when this torch build cannot tell. Without it torch emulates bfloat16 on CPU: a bf16-autocast
    training step of the default student measured about 30x slower than float32 on a 2-core AVX2-only
    AMD EPYC (results/smollm2_draft.md).
    """
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return None
