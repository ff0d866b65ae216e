"""Shared fixtures: tiny locally made model pairs, one CPU thread, a private cache folder."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# Tests never touch the network and never write into the user's cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["BILD_ENV_REAL_CACHE"] = os.environ.get(
    "BILD_ENV_CACHE", os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "bild_env")
)
os.environ["BILD_ENV_CACHE"] = tempfile.mkdtemp(prefix="bild_env_test_cache_")
# Tiny models gain nothing from threads, and two threads contending with other work run 30x slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_pair():
    from bild_env import load_pair

    return load_pair("tiny-random", device="cpu")


@pytest.fixture(scope="session")
def agreeing_pair():
    """A tiny pair whose draft agrees with the target more often (~85% of positions)."""
    from bild_env import load_pair
    from bild_env.tiny import TinySpec, ensure_tiny_pair

    folder = ensure_tiny_pair(TinySpec(alpha=0.1))
    return load_pair(draft=folder / "draft", target=folder / "target", tokenizer=folder / "tokenizer", device="cpu")
