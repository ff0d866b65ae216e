"""An on-disk cache of tokenized prompt lists (building the long inputs of a train split takes seconds).

A list is stored under a key made of everything it depends on: the tokenizer (its full serialised
pipeline and chat template), the domain, split and options, and the data (a digest of the committed
files; for the standard library, the Python version and its folder). Files live in
``cache_dir("prompts")`` as ``.npz`` (all token ids in one int32 array plus the prompts' lengths), and
are written to a temporary name and renamed, so a reader never sees half a file. Tokenizers without a
serialised fast pipeline are not cached.
"""

from __future__ import annotations

import hashlib
import io
import logging
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np

from bild_env.paths import cache_dir, digest, write_atomic

FORMAT = 1  # bump when the way prompts are built changes, so older files are not read
logger = logging.getLogger(__name__)


def tokenizer_fingerprint(tokenizer) -> str | None:
    """A digest of a fast tokenizer's whole pipeline and chat template; None for other tokenizers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    text = backend.to_str() + "|" + str(getattr(tokenizer, "chat_template", None) or "")
    return hashlib.sha1(text.encode()).hexdigest()


@lru_cache(maxsize=8)
def file_digest(path: Path) -> str:
    """SHA-1 of a committed data file (once per process)."""
    return hashlib.sha1(Path(path).read_bytes()).hexdigest()


def python_source_key() -> str:
    """What the standard library's text depends on: the Python version and the library's folder."""
    import sysconfig

    return f"{sys.version}|{sysconfig.get_paths()['stdlib']}"


def _path(key: str) -> Path:
    return cache_dir("prompts") / f"{digest(str(FORMAT), key, length=24)}.npz"


def load(key: str) -> list[list[int]] | None:
    """The prompts stored under ``key``, or None when there are none (or the file cannot be read)."""
    path = _path(key)
    if not path.is_file():
        return None
    try:
        with np.load(path) as data:
            flat, lengths = data["ids"].tolist(), data["lengths"].tolist()
    except (OSError, ValueError, KeyError) as err:
        logger.warning(f"ignoring unreadable prompt cache {path} ({type(err).__name__}: {err})")
        return None
    out, start = [], 0
    for n in lengths:
        out.append(flat[start:start + n])
        start += n
    return out


def store(key: str, prompts: list[list[int]]) -> None:
    """Write ``prompts`` under ``key`` (atomically; a failed write is logged and ignored)."""
    path = _path(key)
    data = io.BytesIO()
    np.savez(data, ids=np.fromiter((t for p in prompts for t in p), dtype=np.int32),
             lengths=np.array([len(p) for p in prompts], dtype=np.int64))
    try:
        write_atomic(path, data.getvalue())
    except OSError as err:
        logger.warning(f"could not write the prompt cache {path} ({err})")
