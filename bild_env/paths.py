"""Where bild-gym keeps what it builds or downloads: one cache folder, one function."""

from __future__ import annotations

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
