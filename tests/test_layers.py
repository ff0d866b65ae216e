"""The house without circles: the import contracts of pyproject.toml's ``[tool.importlinter]`` hold.

Each floor imports only from the floors below it (bild_env: the envs over the runners over the decoders over the
models over the prompts; within decoding/ and models/ too), bild_env imports nothing of agents, distill or
Stable-Baselines3, nothing below the envs imports Gymnasium, and no two modules import each other in a circle.
``lint-imports`` (import-linter, in the ``test`` and ``lint`` extras) checks the code of this checkout; it runs
here so that the README's test command covers it. Skipped, saying so, where import-linter is not installed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def test_the_import_contracts_hold():
    pytest.importorskip("importlinter", reason="import-linter is not installed (pip install -e '.[lint]')")
    # --no-cache: no .import_linter_cache folder left in the checkout; the checkout's own code (cwd first on the path)
    done = subprocess.run([sys.executable, "-c", LINT_IMPORTS, "--no-cache"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"lint-imports found a broken contract:\n{done.stdout}\n{done.stderr}"
    assert " 0 broken." in done.stdout
