"""The three splits every prompt source is cut into, and the one check of a split name."""

from __future__ import annotations

SPLITS: tuple[str, ...] = ("train", "validation", "test")


def check_split(split: str, source: str = "") -> None:
    """Raise ValueError naming the valid splits when ``split`` is not one of them (``source`` names the data)."""
    if split not in SPLITS:
        what = f"{source} " if source else ""
        raise ValueError(f"unknown {what}split {split!r}; valid splits are: {', '.join(SPLITS)}")
