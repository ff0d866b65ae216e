"""The commands over both rooms: ``train.py`` and ``evaluate.py`` hand ``--env serve`` to the serving room and the rest
to BiLD-v1's.

    python train.py                          # BiLD-v1: agents.bild.training
    python train.py --env serve              # BiLD-Serve-v0: agents.serve.training (the main job)
    python evaluate.py                       # BiLD-v1: agents.bild.comparison
    python evaluate.py --env serve           # BiLD-Serve-v0: agents.serve.evaluation (quick; --full: every rule)
    python evaluate.py --env serve --load .. # BiLD-Serve-v0 on the wall clock: agents.serve.load_clock
"""

from __future__ import annotations

import sys

from agents.common.env_choice import split_env
from bild_env.errors import UsageExit


def train_main(argv: list[str] | None = None) -> int | None:
    """``train.py``: BiLD-v1's trainer, or with ``--env serve`` the serving env's main job."""
    env, rest = split_env(sys.argv[1:] if argv is None else argv)
    if env == "serve":
        from agents.serve.training import main
    else:
        from agents.bild.training import main
    return main(rest)


def evaluate_main(argv: list[str] | None = None) -> int:
    """``evaluate.py``: BiLD-v1's comparison, or with ``--env serve`` BiLD-Serve-v0's (``agents.serve.evaluation``).
    Ctrl-C or SIGTERM (``bild_env.errors.run_command`` turns it into Ctrl-C): each evaluation keeps what it finished
    (``"complete": false``) and ends in a ``bild_env.errors.Stopped`` (exit 130)."""
    env, rest = split_env(sys.argv[1:] if argv is None else argv)
    if env == "serve":
        if any(a == "--load" or a.startswith("--load=") for a in rest):  # the methods on the wall clock
            from agents.serve.load_clock import main as serve_main
        else:  # the quick evaluation where the command line is silent, or --full: python -m bench.serving's
            from agents.serve.bench_config import QUICK
            from agents.serve.evaluation import main as run_serving

            full = "--full" in rest
            rest = [a for a in rest if a != "--full"]

            def serve_main(argv: list[str]) -> None:
                run_serving(argv, None if full else QUICK)

        try:
            serve_main(rest)
        except SystemExit as exc:  # a refusal ("error: ..."): said as this command's
            if isinstance(exc.code, str):
                kind = UsageExit if isinstance(exc, UsageExit) else SystemExit  # a usage error exits with 2
                raise kind(f"evaluate.py --env serve: {exc.code}") from None
            raise
        return 0
    from agents.bild.comparison import main

    return main(rest)
