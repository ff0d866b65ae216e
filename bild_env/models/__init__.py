"""Model pairs (the bottom layer): presets, loading, the device they run on, and the offline pairs."""

from bild_env.models.device import DeviceError, cpu_has_native_bf16, default_device, device_name, resolve_dtype, sync
from bild_env.models.pairs import DEFAULT_PAIR, PRESETS, ModelPair, PairError, Preset, get_preset, load_pair, preset_names

__all__ = [
    "DEFAULT_PAIR", "PRESETS", "DeviceError", "ModelPair", "PairError", "Preset", "cpu_has_native_bf16", "default_device",
    "device_name", "get_preset", "load_pair", "preset_names", "resolve_dtype", "sync",
]
