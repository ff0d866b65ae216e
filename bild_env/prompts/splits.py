"""The three splits every prompt source is cut into, the one check of a split name, and the one reader of the
committed split files."""

from __future__ import annotations

import gzip
import json
from functools import lru_cache
from pathlib import Path

SPLITS: tuple[str, ...] = ("train", "validation", "test")


def check_split(split: str, source: str = "") -> None:
    """Raise ValueError naming the valid splits when ``split`` is not one of them (``source`` names the data)."""
    if split not in SPLITS:
        what = f"{source} " if source else ""
        raise ValueError(f"unknown {what}split {split!r}; valid splits are: {', '.join(SPLITS)}")


def hash_split(key: str, seed: int = 0, validation: float = 0.1, test: float = 0.1) -> str:
    """The split of the item named ``key``: a seeded SHA-256 of the key, uniform in [0, 1), cut at the fractions.

    An item's split depends on its key alone (not on which other items exist), so it is the same on every
    machine and stays put when items are added or removed; the share per split is ``test``, ``validation``
    and the rest for "train", up to chance.
    """
    import hashlib

    u = int.from_bytes(hashlib.sha256(f"{seed}:{key}".encode()).digest()[:8], "big") / 2**64
    if u < test:
        return "test"
    return "validation" if u < test + validation else "train"


@lru_cache(maxsize=None)
def read_splits(path: Path) -> dict[str, list[dict[str, str]]]:
    """The rows of each split of a committed ``*.json.gz`` file (its ``"splits"``), read once per process."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)["splits"]
