"""Distil the ``smollm2`` draft model: the command line of the :mod:`distill` package.

``python scripts/distill_draft.py <command> --flags`` is ``python -m distill <command> --flags``;
``--help`` lists the flags, and ``distill/cli.py`` describes the subcommands. Run from the
repository root, e.g. ``PYTHONPATH=. python scripts/distill_draft.py measure``.
"""

from distill.cli import main

if __name__ == "__main__":
    main()
