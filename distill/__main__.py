"""``python -m distill <command> --flags``: the distillation's command line (see :mod:`distill.cli`)."""

from distill.cli import main

main(prog="python -m distill")
