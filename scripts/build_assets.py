"""Rebuild a shipped asset from its public sources: one command, one subcommand per asset. Run from the repository
root only to regenerate committed files (the same sources give the same bytes); each module's docstring says what it
reads and how.

    python -m scripts.build_assets wiki        # bild_env/assets/wiki/          (scripts/build_wiki_prompts.py)
    python -m scripts.build_assets humaneval   # bild_env/assets/humaneval/     (scripts/build_humaneval_prompts.py)
    python -m scripts.build_assets chat        # bild_env/assets/instructions/  (scripts/build_chat_prompts.py)
    python -m scripts.build_assets tokenizer   # bild_env/assets/gpt2-tokenizer/ (scripts/build_tokenizer.py)
    python -m scripts.build_assets profiles --measurements ../shared/gpu   # bild_env/assets/profiles/
    python -m scripts.build_assets figures     # docs/_static/figures/ from results/ (scripts/make_figures.py; --list)

Every option after the asset's name is its own (``python -m scripts.build_assets profiles --help``).
"""

from __future__ import annotations

import importlib
import sys

ASSETS = {"wiki": "scripts.build_wiki_prompts", "humaneval": "scripts.build_humaneval_prompts",
          "chat": "scripts.build_chat_prompts", "tokenizer": "scripts.build_tokenizer",
          "profiles": "scripts.build_profiles", "figures": "scripts.make_figures"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ASSETS:
        print(__doc__ if argv[:1] in (["-h"], ["--help"]) else
              f"usage: python -m scripts.build_assets {{{','.join(ASSETS)}}} [its options]", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    sys.argv[0] = f"python -m scripts.build_assets {argv[0]}"  # what its --help and usage show
    return importlib.import_module(ASSETS[argv[0]]).main(argv[1:]) or 0


if __name__ == "__main__":
    raise SystemExit(main())
