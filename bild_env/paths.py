"""Where bild-gym keeps what it builds or downloads: one cache folder, one function."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"


def cache_dir(*parts: str) -> Path:
    """Return (and create) a folder under the bild-gym cache.

    The root is ``$BILD_ENV_CACHE`` if set, else ``$XDG_CACHE_HOME/bild_env``, else
    ``~/.cache/bild_env``.
    """
    root = os.environ.get("BILD_ENV_CACHE")
    if root is None:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "bild_env")
    path = Path(root, *parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def digest(*parts: str, length: int = 16) -> str:
    """A file-name-safe key of ``parts`` (SHA-1 of the parts joined by "|", first ``length`` hex digits).

    Every on-disk cache names its files with it: cost models (pair and device), references (pair and
    length), replay trees (pair; prompt token ids at full length).
    """
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:length]


def prompt_key(prompt_ids) -> str:
    """The key of a prompt's token ids (references and replay trees are stored under it)."""
    return digest(",".join(map(str, prompt_ids)), length=40)
