"""The commands over both rooms: ``train.py`` and ``evaluate.py`` hand ``--env serve`` to the serving room and the rest
to BiLD-v1's.

    python train.py                          # BiLD-v1: agents.bild.training
    python train.py --env serve              # BiLD-Serve-v0: agents.serve.training (the main job)
    python train.py --env paper              # BiLD-v1 in the paper's setting (any preset: agents.spec.PRESETS)
    python train.py --resume RUN             # either env's run, by its spec: the trainer of its env
    python evaluate.py                       # BiLD-v1: agents.bild.comparison
    python evaluate.py --env serve           # BiLD-Serve-v0: agents.serve.evaluation (quick; --full: every rule)
    python evaluate.py --env serve --clock   # BiLD-Serve-v0 on the wall clock: agents.serve.load_clock
    python evaluate.py --model RUN           # either env's run, by its spec: the evaluation of its env
"""

from __future__ import annotations

import sys

from agents.common.env_choice import split_env
from bild_env.command import UsageExit


def train_main(argv: list[str] | None = None) -> int | None:
    """``train.py``: the trainer of the env of the preset ``--env`` names (``agents.spec.PRESETS``: BiLD-v1's from
    ``bild``, ``quick`` or ``paper``, the serving env's main job from ``serve``), a new run starting from the preset's
    options; ``--resume RUN`` alone continues a run with the trainer of its env (its spec's)."""
    from agents.spec import preset
    from bild_env.ids import SERVE_ID

    name, rest = split_env(sys.argv[1:] if argv is None else argv, "--resume", "train.py")
    if preset(name).env_id == SERVE_ID:
        from agents.serve.training import main
    else:
        from agents.bild.training import main
    return main(rest, name)


def evaluate_main(argv: list[str] | None = None) -> int:
    """``evaluate.py``: BiLD-v1's comparison, or with ``--env serve`` (or a ``--model`` of a serving run, by its spec)
    BiLD-Serve-v0's in one of its modes (``serve_mode``:
    the cost model's quick or full evaluation, ``agents.serve.evaluation``, or the wall clock's, ``--clock``:
    ``agents.serve.load_clock``). Ctrl-C or SIGTERM (``bild_env.command.run_command`` turns it into Ctrl-C): each
    evaluation keeps what it finished (``"complete": false``) and ends in a ``bild_env.command.Stopped`` (exit 130)."""
    env, rest = split_env(sys.argv[1:] if argv is None else argv, "--model")
    if env != "serve":
        from agents.bild.comparison import main

        return main(rest)
    mode, rest = serve_mode(rest)
    if mode == "clock":
        from agents.serve.load_clock import main as serve_main
    else:
        from agents.serve.bench_config import QUICK
        from agents.serve.evaluation import main as run_serving

        def serve_main(argv: list[str]) -> None:
            run_serving(argv, QUICK if mode == "quick" else None)

    try:
        serve_main(rest)
    except SystemExit as exc:  # a refusal ("error: ..."): said as this command's
        if isinstance(exc.code, str):
            kind = UsageExit if isinstance(exc, UsageExit) else SystemExit  # a usage error exits with 2
            raise kind(f"evaluate.py --env serve: {exc.code}") from None
        raise
    return 0


def serve_mode(argv: list[str]) -> tuple[str, list[str]]:
    """The mode ``argv`` picks and the other arguments: "quick" (no mode option: the cost model's evaluation from the
    main job's setting, minutes), "full" (``--full``: from every default, hours) or "clock" (``--clock``: the methods
    on real models and the wall clock); ``--full`` and ``--clock`` exclude each other.
    ``--load`` (the wall clock's load levels) without ``--clock`` is refused: the cost model's levels are
    ``--levels``, and a switch by another option's presence would make one command line two programs."""
    import argparse

    pre = argparse.ArgumentParser(prog="evaluate.py --env serve", add_help=False, allow_abbrev=False)
    modes = pre.add_mutually_exclusive_group()
    modes.add_argument("--full", action="store_true")
    modes.add_argument("--clock", action="store_true")
    known, rest = pre.parse_known_args(argv)
    mode = "clock" if known.clock else "full" if known.full else "quick"
    if mode != "clock" and any(a == "--load" or a.startswith("--load=") for a in rest):
        raise UsageExit("evaluate.py --env serve: error: --load gives the wall clock's load levels: add --clock to "
                        "run the methods on the clock (the cost model's evaluation takes --levels)")
    return mode, rest
