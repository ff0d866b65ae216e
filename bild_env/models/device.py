"""The device a pair runs on: which device and dtype by default, its name, and synchronising it.

One helper per mechanism, called by every caller: ``sync(device)`` before reading a clock,
``device_name(device)`` for cache keys, ``machine_description(device)`` for reports (the CPU's model,
the instruction sets its kernels use, torch and the thread count; ``cpu_info()`` the same as fields),
``cpu_has_native_bf16()`` wherever a choice of dtype depends on the CPU at hand,
``explain_dtype``/``resolve_dtype`` for the dtype a pair runs in and ``log_dtype`` to say once which one and why.

The "auto" dtype is decided at run time from the machine at hand, never assumed: float16 on CUDA;
on a CPU bfloat16 when it has native bfloat16 units (AVX-512 BF16 or AMX: a SmolLM2-135M target
forward measured 20.8 ms in bf16 vs 40.5 ms in float32 fed 1 token, 23.9 vs 58.7 fed 8), else
float32 (without them torch emulates bfloat16, about 30x slower).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import torch

from bild_env.command import UsageError

logger = logging.getLogger(__name__)

DTYPES = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float32": torch.float32, "fp32": torch.float32}


class DeviceError(UsageError):
    """A device or dtype that cannot be used; the message says what to do."""


def usable_device(device: str | torch.device | None) -> torch.device:
    """``device`` as a ``torch.device`` this machine can run on (None: ``default_device()``); a ``DeviceError`` that
    names the devices it can use otherwise (torch's own error lists every device type it knows of)."""
    if device is None or isinstance(device, torch.device):
        dev = default_device() if device is None else device
    else:
        try:
            dev = torch.device(device.strip() or "cpu")
        except (RuntimeError, TypeError, ValueError):
            raise DeviceError(f"unknown device {device!r}: this machine can use {', '.join(usable_devices())}") from None
    cuda = dev.type == "cuda" and torch.cuda.is_available() and (dev.index or 0) < torch.cuda.device_count()
    mps = dev.type == "mps" and torch.backends.mps.is_available()
    if dev.type != "cpu" and not cuda and not mps:
        raise DeviceError(f"device {str(dev)!r} is not usable here: this machine can use {', '.join(usable_devices())}")
    return dev


def usable_devices() -> list[str]:
    """The devices torch can run on here: cpu, each CUDA GPU, mps."""
    found = ["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else ["cpu"]
    return found + (["mps"] if torch.backends.mps.is_available() else [])


def default_device() -> torch.device:
    """CUDA when torch sees a GPU, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def explain_dtype(dtype: str | torch.dtype | None, device: torch.device | str,
                  origin: str = "as asked") -> tuple[torch.dtype, str]:
    """The dtype to run in on ``device`` and why, as ``(dtype, reason)``.

    ``None``/"auto": float16 on CUDA; on a CPU bfloat16 when ``cpu_has_native_bf16()`` is True, else
    float32. A name of ``DTYPES`` (or a ``torch.dtype``) is taken as given (``origin`` says by whom, in
    the reason). Decides without touching the device (a ``torch.device("cuda")`` needs no GPU here).
    Raises ``DeviceError`` for other names.
    """
    device = torch.device(device)
    if isinstance(dtype, torch.dtype):
        return dtype, f"dtype {_dtype_name(dtype)} ({origin})"
    if dtype is None or (isinstance(dtype, str) and dtype.strip().lower() == "auto"):
        if device.type == "cuda":
            return torch.float16, "dtype auto -> float16: on CUDA; --dtype bfloat16 or float32 (an env's pair_options) overrides"
        if device.type != "cpu":
            return torch.float32, f"dtype auto -> float32: on {device.type}; --dtype (an env's pair_options) overrides"
        native = cpu_has_native_bf16()
        if native:
            return torch.bfloat16, ("dtype auto -> bfloat16: this CPU has native bfloat16 (AVX512-BF16/AMX); "
                                    "--dtype float32 (an env's pair_options) overrides")
        capped = bf16_kernels_capped() if native is False else None
        why = ("this torch build cannot tell whether this CPU has native bfloat16" if native is None else
               f"{capped}: torch would emulate bfloat16" if capped else
               "this CPU has no native bfloat16 (no AVX512-BF16/AMX), torch would emulate it")
        return torch.float32, f"dtype auto -> float32: {why}; --dtype bfloat16 (an env's pair_options) overrides"
    name = dtype.strip().lower() if isinstance(dtype, str) else dtype
    if name not in DTYPES:
        raise DeviceError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)} or 'auto' (float16 on CUDA; "
                          "on a CPU bfloat16 where it is native, else float32)")
    return DTYPES[name], f"dtype {_dtype_name(DTYPES[name])} ({origin})"


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """The dtype of ``explain_dtype`` without its reason."""
    return explain_dtype(dtype, device)[0]


def bf16_emulated(dtype: torch.dtype, device: torch.device | str) -> bool:
    """True when ``dtype`` is bfloat16 on a CPU that only emulates it (``cpu_has_native_bf16()`` is False)."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu" and cpu_has_native_bf16() is False


def _per_call_s(a: torch.Tensor, b: torch.Tensor, budget_s: float) -> float:
    torch.matmul(a, b)  # warm-up
    calls, start = 0, time.perf_counter()
    while True:
        torch.matmul(a, b)
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s:
            return elapsed / calls


@functools.lru_cache(maxsize=None)
def bf16_slowdown(budget_s: float = 0.05, hidden: int = 576, width: int = 1536) -> float:
    """How many times longer bfloat16 matmuls take than float32 ones on this CPU (>1: bf16 is slower).

    Times ``1 x hidden @ hidden x width`` and ``8 x hidden @ hidden x width`` (SmolLM2-135M's MLP fed
    one and eight tokens) for ``budget_s`` seconds each per dtype and returns the ratio of the summed
    per-call times. Measured once per process (about ``4 * budget_s`` seconds).
    """
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(hidden, width, generator=gen)
    total = {torch.float32: 0.0, torch.bfloat16: 0.0}
    with torch.inference_mode():
        for rows in (1, 8):
            x = torch.randn(rows, hidden, generator=gen)
            for dt in total:
                total[dt] += _per_call_s(x.to(dt), weight.to(dt), budget_s)
    return total[torch.bfloat16] / total[torch.float32]


def log_dtype(dtype: str | torch.dtype | None, device: torch.device | str, what: str = "",
              origin: str = "as asked") -> torch.dtype:
    """Resolve ``dtype`` on ``device`` and log the choice and its reason (``what`` prefixes the line).

    bfloat16 asked on a CPU that only emulates it is not refused, but logged as a WARNING with the
    slowdown measured on this CPU (``bf16_slowdown``).
    """
    dt, reason = explain_dtype(dtype, device, origin)
    prefix = f"{what}: " if what else ""
    if bf16_emulated(dt, device):
        ratio = bf16_slowdown()
        speed = f"{ratio:.1f}x slower than" if ratio >= 1 else f"{1 / ratio:.1f}x faster than"
        logger.warning("%s%s, but this CPU has no native bfloat16 (no AVX512-BF16/AMX) and torch emulates it: "
                       "bfloat16 measured %s float32 on this CPU (1x576 and 8x576 @ 576x1536 matmuls); "
                       "--dtype float32 or auto (an env's pair_options) avoids it", prefix, reason, speed)
    else:
        logger.info("%s%s", prefix, reason)
    return dt


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so that a clock read after it is honest."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# The instruction sets CPU matrix kernels use, as named in reports, and the /proc/cpuinfo flag of each.
ISA_FLAGS = (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AVX512-BF16", "avx512_bf16"), ("AMX", "amx_tile"))
# AMD CPU families (/proc/cpuinfo "cpu family") by core generation, for CPUs whose model name a hypervisor
# shortens to "AMD EPYC"; family 25 is Zen 3 without AVX-512, Zen 4 with it.
AMD_FAMILIES = {23: "Zen/Zen 2", 25: "Zen 3", 26: "Zen 5"}


def _cpuinfo_fields(text: str) -> dict[str, str]:
    """The first processor's ``key: value`` lines of /proc/cpuinfo (keys lower case)."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    return fields


def _lscpu_model() -> str | None:
    lscpu = shutil.which("lscpu")
    if lscpu is None:
        return None
    try:
        out = subprocess.run([lscpu], capture_output=True, text=True, timeout=10,
                             env=os.environ | {"LC_ALL": "C"}).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name" and value.strip() not in ("", "-"):
            return value.strip()
    return None


def _torch_isa() -> set[str]:
    """The instruction sets torch's CPU kernels detect (its dispatch level, native bfloat16, AMX)."""
    found = set()
    capability = _torch_kernels()
    if capability.startswith("AVX512"):
        found |= {"AVX2", "AVX-512"}
    elif capability.startswith("AVX2"):
        found.add("AVX2")
    try:
        if torch.cpu._is_avx512_bf16_supported():
            found.add("AVX512-BF16")
        if torch.cpu._is_amx_tile_supported():
            found.add("AMX")
    except AttributeError:
        pass
    return found


def _torch_kernels() -> str:
    """torch's CPU kernel dispatch level ("AVX512", "AVX2", "DEFAULT", ...; "unknown" where it cannot say)."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "unknown"


@functools.lru_cache(maxsize=None)
def cpu_info(cpuinfo: str = "/proc/cpuinfo") -> dict[str, object]:
    """What CPU this is, as timings depend on it (read once per process).

    ``model`` (the model name of /proc/cpuinfo, else ``lscpu``'s, else ``platform.processor()``, else
    "unknown CPU"), ``family``/``model_number``/``stepping`` (/proc/cpuinfo; "" where absent), ``core``
    (the AMD core generation of the family, "" where unknown), ``arch`` (``platform.machine()``), ``isa``
    (which of ``ISA_FLAGS`` the CPU has: its /proc/cpuinfo flags and torch's own detection, together) and
    ``kernels`` (torch's CPU dispatch level, ``torch.backends.cpu.get_cpu_capability()``).
    """
    try:
        fields = _cpuinfo_fields(Path(cpuinfo).read_text())
    except OSError:
        fields = {}
    flags = set(fields.get("flags", "").split())
    isa = {name for name, flag in ISA_FLAGS if flag in flags} | _torch_isa()
    model = fields.get("model name") or _lscpu_model() or platform.processor() or "unknown CPU"
    family = fields.get("cpu family", "")
    core = ""
    if fields.get("vendor_id") == "AuthenticAMD" and family.isdigit():
        core = AMD_FAMILIES.get(int(family), "")
        if int(family) == 25 and "AVX-512" in isa:
            core = "Zen 4"
    return {"model": " ".join(model.split()), "family": family, "model_number": fields.get("model", ""),
            "stepping": fields.get("stepping", ""), "core": core, "arch": platform.machine(),
            "isa": [name for name, _ in ISA_FLAGS if name in isa], "kernels": _torch_kernels()}


def _cpu_words(info: dict[str, object]) -> str:
    """"AMD EPYC (family 26 model 2, Zen 5; x86_64, AVX2, AVX-512, AVX512-BF16)"."""
    ident = " ".join(f"{k} {info[f]}" for k, f in (("family", "family"), ("model", "model_number")) if info[f])
    ident = ", ".join(p for p in (ident, info["core"]) if p)
    arch = ", ".join([info["arch"] or "unknown arch", *info["isa"]])
    return f"{info['model']} ({ident + '; ' if ident else ''}{arch})"


def device_name(device: torch.device | str) -> str:
    """A name of the device and thread count that timings depend on (a key of the cost-model cache).

    CUDA: the GPU's name. CPU: its architecture, model name, family/model/stepping, instruction sets,
    torch's kernel level and the thread count, e.g.
    ``cpu:x86_64:AMD EPYC:26/2/1:AVX2+AVX-512+AVX512-BF16:AVX512:2threads``.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    info = cpu_info()
    ident = "/".join(str(info[k]) for k in ("family", "model_number", "stepping"))
    return (f"cpu:{info['arch'] or 'unknown'}:{info['model']}:{ident}:{'+'.join(info['isa']) or 'no-simd'}:"
            f"{info['kernels']}:{torch.get_num_threads()}threads")


def machine_description(device: torch.device | str = "cpu") -> str:
    """The machine timings were taken on, in words, for reports and result files.

    CPU: e.g. ``AMD EPYC (family 26 model 2, Zen 5; x86_64, AVX2, AVX-512, AVX512-BF16), torch 2.13.0+cpu,
    2 threads``. CUDA: the GPU, its compute capability and torch's CUDA version, then the host CPU.
    """
    device = torch.device(device)
    cpu = _cpu_words(cpu_info())
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return (f"{torch.cuda.get_device_name(device)} (compute {major}.{minor}, CUDA {torch.version.cuda}), "
                f"torch {torch.__version__}; host {cpu}")
    threads = torch.get_num_threads()
    return f"{cpu}, torch {torch.__version__}, {threads} thread{'' if threads == 1 else 's'}"


def cpu_has_native_bf16() -> bool | None:
    """Whether this CPU does bfloat16 arithmetic in hardware (AVX-512 BF16 or AMX), as torch detects it, and torch's
    kernels may use it (``bf16_kernels_capped``: not where ``ATEN_CPU_CAPABILITY`` or ``ONEDNN_MAX_CPU_ISA`` hold
    them below it).

    None when this torch build cannot tell. Without it torch emulates bfloat16 on CPU: a bf16-autocast
    training step of the default student measured about 30x slower than float32 on a 2-core AVX2-only
    AMD EPYC (results/smollm2_draft.md).
    """
    try:
        units = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return None
    return units and bf16_kernels_capped() is None


# oneDNN's instruction sets in its order (ONEDNN_MAX_CPU_ISA's values; later ones include the earlier): products in
# bfloat16 run on the CPU's units from AVX512_CORE_BF16 on
ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI", "AVX512_CORE_BF16",
               "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX", "AVX10_1_512_AMX_FP16",
               "AVX512_CORE_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2")
ATEN_BF16_LEVELS = ("AVX512", "AVX512_BF16", "AMX")  # torch's dispatch levels whose vector kernels reach AVX-512


def bf16_kernels_capped() -> str | None:
    """Why torch's kernels may not use the CPU's bfloat16 units even where it has them, in words, or None.

    ``ATEN_CPU_CAPABILITY`` (read by torch at start: ``torch.backends.cpu.get_cpu_capability()`` says which level
    runs) below AVX-512 holds ATen's vector kernels to AVX2 or less; ``ONEDNN_MAX_CPU_ISA`` (or its older name
    ``DNNL_MAX_CPU_ISA``) below AVX512_CORE_BF16 holds oneDNN's products there. Either way bfloat16 is emulated in
    float32 arithmetic: ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` on an AVX-512 CPU behaves as an
    AVX2-only CPU, and the "auto" dtype must follow.
    """
    level = _torch_kernels()
    if level != "unknown" and level.upper() not in ATEN_BF16_LEVELS:
        return f"torch's kernels run at {level} (ATEN_CPU_CAPABILITY), below AVX-512"
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        isa = os.environ.get(var, "").strip().upper()
        if isa in ONEDNN_ISAS and ONEDNN_ISAS.index(isa) < ONEDNN_ISAS.index("AVX512_CORE_BF16"):
            return f"{var}={isa} holds oneDNN's products below AVX512_CORE_BF16"
    return None


def return_freed_memory() -> bool:
    """Give the heap's free pages back to the system (glibc's ``malloc_trim(0)``), where the C library has it.

    Loading a pair frees many weight-sized blocks (the layers' weights fused, or released by the lean forward:
    ``bild_env.models.lean``); glibc keeps blocks under its mmap threshold in the heap, where they stay in the
    process's resident memory. After loading the smollm2 pair in bfloat16 on an AMD Zen 5, its weights released, the
    process held 1,131 MB, and 797 MB after the trim (``python -m scripts.analysis.pair_memory``:
    ``results/pair_memory_smollm2_zen5.json``). Whether it could be called (not on another C library)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False
