"""``--env`` of ``train.py`` and ``evaluate.py``: which environment a command runs on (``bild``: BiLD-v1, the default;
``serve``: BiLD-Serve-v0), taken off the arguments before the env's own parser reads them, and shown on both envs'
help pages."""

from __future__ import annotations

import argparse

ENVS = {"bild": "BiLD-v1, one request at a time (the default)",
        "serve": "BiLD-Serve-v0, a batch of requests under a moving load"}


def add_env_option(parser: argparse.ArgumentParser, env: str, command: str) -> None:
    """``--env`` on ``parser``'s help page (``command``'s, for the env ``env``): what it picks and where the other env's
    options are listed. The command takes it off the arguments before this parser reads them (``split_env``)."""
    other = next(name for name in ENVS if name != env)
    parser.add_argument("--env", choices=tuple(ENVS), default=env,
                        help=f"the environment: {'; '.join(f'{k}: {v}' for k, v in ENVS.items())}. This page lists "
                             f"--env {env}'s options; python {command} --env {other} --help lists the other's")


def split_env(argv: list[str]) -> tuple[str, list[str]]:
    """``--env``'s value (``bild`` where absent) and the other arguments (argparse: ``--env serve``, ``--env=serve``;
    a value that is no env is refused with the choices, exit status 2)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--env", choices=tuple(ENVS), default="bild")
    known, rest = pre.parse_known_args(argv)
    return known.env, rest
