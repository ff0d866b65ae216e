"""``--env`` of ``train.py`` and ``evaluate.py``: which environment a command runs on (``bild``: BiLD-v1, the default;
``serve``: BiLD-Serve-v0; for ``train.py`` any preset of ``agents.spec.PRESETS``, e.g. ``paper``), taken off the
arguments before the env's own parser reads them, and shown on both envs' help pages."""

from __future__ import annotations

import argparse
from pathlib import Path

ENVS = {"bild": "BiLD-v1, one request at a time (the default)",
        "serve": "BiLD-Serve-v0, a batch of requests under a moving load"}


def choices(command: str) -> dict[str, str]:
    """What ``--env`` picks on ``command``: ``train.py`` a preset of ``agents.spec.PRESETS`` (an env and the options
    its runs start from), ``evaluate.py`` an env."""
    if command != "train.py":
        return ENVS
    from agents.spec import PRESETS

    return {name: line for name, (line, _) in PRESETS.items()}


def add_env_option(parser: argparse.ArgumentParser, env: str, command: str) -> None:
    """``--env`` on ``parser``'s help page (``command``'s, for ``env``): what it picks and where the other env's
    options are listed. The command takes it off the arguments before this parser reads them (``split_env``)."""
    from agents.spec import preset
    from bild_env.ids import SERVE_ID

    picks = choices(command)
    other = "bild" if preset(env).env_id == SERVE_ID else "serve"  # evaluate.py's envs are presets' names too
    parser.add_argument("--env", choices=tuple(picks), default=env,
                        help=f"the environment{' and its preset' if command == 'train.py' else ''}: "
                             f"{'; '.join(f'{k}: {v}' for k, v in picks.items())}. This page lists --env {env}'s "
                             f"options; python {command} --env {other} --help lists the other's")


def split_env(argv: list[str], run_option: str | None = None, command: str = "evaluate.py") -> tuple[str, list[str]]:
    """``--env``'s value and the other arguments (argparse: ``--env serve``, ``--env=serve``; a value that is none of
    ``command``'s ``choices`` is refused with them, exit status 2). Where ``--env`` is absent, the env of the run
    ``run_option`` names (``--resume RUN``, ``--model RUN``: its spec's ``env_id``, as either trainer saves it), else
    ``bild``."""
    pre = argparse.ArgumentParser(prog=command, add_help=False, allow_abbrev=False)
    pre.add_argument("--env", choices=tuple(choices(command)), default=None)
    known, rest = pre.parse_known_args(argv)
    if known.env is not None or not run_option:
        return known.env or "bild", rest
    runs = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    runs.add_argument(run_option, dest="runs", nargs="*", default=[])
    runs.add_argument("--log-dir", default="logs")
    given = runs.parse_known_args(rest)[0]
    return (run_env(given.runs[0], Path(given.log_dir)) if given.runs else "bild"), rest


def run_env(run: str, log_dir: Path) -> str:
    """``serve`` where ``run`` (a run folder or model file, a run's name under ``log_dir``, ``pretrained``) is a
    BiLD-Serve-v0 run by its spec, else ``bild`` (also where it has none or it cannot be read: that env's command
    then says why)."""
    from agents.common.trained import PRETRAINED, pretrained_run
    from agents.spec import run_env_id
    from bild_env.ids import SERVE_ID

    path = Path(run)
    if run == PRETRAINED and not path.exists():
        path = pretrained_run()
    elif not path.exists() and (log_dir / run).is_dir():
        path = log_dir / run
    return "serve" if run_env_id(path) == SERVE_ID else "bild"
