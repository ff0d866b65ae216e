"""Model pairs (the bottom layer): presets, loading, the device they run on, and the offline pairs."""

from bild_env.models.device import (DeviceError, bf16_emulated, bf16_slowdown, cpu_has_native_bf16, default_device,
                                    device_name, explain_dtype, log_dtype, resolve_dtype, sync)
from bild_env.models.pairs import DEFAULT_PAIR, PRESETS, ModelPair, PairError, Preset, get_preset, load_pair, preset_names

__all__ = [
    "DEFAULT_PAIR", "PRESETS", "DeviceError", "ModelPair", "PairError", "Preset", "bf16_emulated", "bf16_slowdown",
    "cpu_has_native_bf16", "default_device", "device_name", "explain_dtype", "get_preset", "load_pair", "log_dtype",
    "preset_names", "resolve_dtype", "sync",
]
