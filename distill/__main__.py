"""``python -m distill <command> --flags``: the distillation's command line (see :mod:`distill.cli`)."""

import sys

from bild_env.command import run_command
from distill.cli import main

sys.exit(run_command("python -m distill", lambda argv: main(argv, prog="python -m distill")))
