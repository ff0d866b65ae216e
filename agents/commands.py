"""The commands over both envs: ``train.py`` runs the one trainer (``agents.training``) with the room of its env,
``evaluate.py`` the one evaluator (``agents.evaluation``) with the evaluation of its env and mode.

    python train.py                          # BiLD-v1: agents.training with agents.bild.training's room
    python train.py --env serve              # BiLD-Serve-v0: the same trainer, agents.serve.training's room
    python train.py --env paper              # BiLD-v1 in the paper's setting (any preset: agents.spec.PRESETS)
    python train.py --resume RUN             # either env's run, by its spec: the room of its env
    python evaluate.py                       # BiLD-v1: agents.evaluation with agents.bild.comparison's
    python evaluate.py --env serve           # BiLD-Serve-v0: agents.serve.evaluation's (quick; --full: every rule)
    python evaluate.py --env serve --clock   # BiLD-Serve-v0 on the wall clock: agents.serve.load_clock's
    python evaluate.py --model RUN           # either env's run, by its spec: the evaluation of its env
"""

from __future__ import annotations

import sys

from agents.common.env_choice import split_env
from bild_env.command import UsageExit


def room_of(preset: str):
    """The room of preset ``preset``'s env."""
    from agents.spec import preset as spec_preset
    from bild_env.ids import SERVE_ID

    if spec_preset(preset).env_id == SERVE_ID:
        from agents.serve.training import ServeRoom

        return ServeRoom
    from agents.bild.training import BildRoom

    return BildRoom


def train_main(argv: list[str] | None = None) -> int:
    """``train.py``: the trainer (``agents.training``) on a new run from the preset ``--env`` names (``bild`` by
    default), or ``--resume RUN`` with the room of its env (its spec's; a preset named beside it is noted as unused:
    the run goes on with its saved options)."""
    from agents.training import run

    argv = sys.argv[1:] if argv is None else argv
    name, rest = split_env(argv, "--resume", "train.py")
    resumed = any(a == "--resume" or a.startswith("--resume=") for a in rest)
    if resumed and name not in ("bild", "serve") and any(a == "--env" or a.startswith("--env=") for a in argv):
        print(f"train.py: note: --env {name} gives a new run's options; --resume goes on with the run's saved ones",
              file=sys.stderr, flush=True)
    return run(room_of(name).from_argv(rest, name))


def evaluate_main(argv: list[str] | None = None) -> int:
    """``evaluate.py``: the evaluator (``agents.evaluation.evaluate``) on BiLD-v1's comparison, or with ``--env serve``
    (or a ``--model`` of a serving run, by its spec) BiLD-Serve-v0's evaluation in one of its modes (``serve_mode``:
    the cost model's quick or full evaluation, ``agents.serve.evaluation``, or the wall clock's, ``--clock``:
    ``agents.serve.load_clock``). Ctrl-C or SIGTERM (``bild_env.command.run_command`` turns it into Ctrl-C): each
    evaluation keeps what it finished (``"complete": false``) and ends in a ``bild_env.command.Stopped`` (exit 130)."""
    from agents.evaluation import evaluate

    env, rest = split_env(sys.argv[1:] if argv is None else argv, "--model")
    if env != "serve":
        from agents.bild.comparison import Comparison

        evaluate(Comparison.from_argv(rest))
        return 0
    mode, rest = serve_mode(rest)
    try:
        if mode == "clock":
            from agents.serve.load_clock import ClockEvaluation

            evaluate(ClockEvaluation.from_argv(rest))
        else:
            from agents.serve.bench_config import QUICK
            from agents.serve.evaluation import ServingEvaluation

            evaluate(ServingEvaluation.from_argv(rest, QUICK if mode == "quick" else None))
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
