"""``train.py``'s command line, one for every env (``TrainOptions``): the page, and a new run's config or ``--resume
RUN``'s saved one with the few options a resume may change (``RESUMABLE``)."""

from __future__ import annotations

import argparse
import time
from dataclasses import fields
from pathlib import Path

from agents.common.env_choice import add_env_option
from agents.common.folders import find_run
from agents.config import ConfigError
from agents.spec import ENV_NOT_CLI
from bild_env.cli import add_options, given
from bild_env.migrate import refuse_moved

# What ``--resume`` may change, for every env's trainer (each has those of its run options it holds): how long and
# where the run goes on, never what it learns from or how.
RESUMABLE = ("total_timesteps", "time_budget", "log_dir", "run_name", "keep_replay_buffers", "torch_threads",
             "policy_device", "progress_bar", "verbose")


def run_name(env_id: str, env, exp: str, seed: int) -> str:
    """A new run's default name: ``<env id>-<pair>__<exp>__<seed>__<unix time>`` (pair ``custom`` where its models
    are given, ``--pair-options draft=... target=...``)."""
    return f"{env_id}-{'custom' if env.pair_options.custom else env.pair}__{exp}__{seed}__{int(time.time())}"


class TrainOptions:
    """One env's options (``agents.bild.training.BildOptions``, ``agents.serve.options.ServeOptions``), the defaults
    shown those of ``preset`` (``agents.spec.PRESETS``): a subclass sets ``preset``, ``env_id``, ``run_class``,
    ``env_class``, ``resume_help`` and the attributes below, and per preset ``run_defaults``, ``env_defaults``, ``page``
    (the parser's prog, description, epilog) and ``hyperparams_help``; it gives ``new`` (a new run's config, checked and
    named before anything loads) and ``load`` (the run in ``run_dir`` with the run options ``changes`` over its own)."""

    resume_nargs: dict = {}  # serving's --resume may be given alone: --resume --run-name NAME, the older spelling
    errors: tuple[type[Exception], ...] = (ConfigError,)  # what ``parse`` says as a usage error (exit status 2)
    run_name_resumes = False  # --run-name names the run to resume (serving's); else it is refused with --resume
    env_option_last = False  # --env after the env's options on the page (serving's), not before them

    def __init__(self, preset: str | None = None) -> None:
        self.preset = preset or self.preset

    @classmethod
    def build_parser(cls, preset: str | None = None) -> argparse.ArgumentParser:
        options = cls(preset)
        parser = argparse.ArgumentParser(formatter_class=argparse.RawDescriptionHelpFormatter, **options.page)
        parser.add_argument("--resume", metavar="RUN", default=None, help=cls.resume_help, **cls.resume_nargs)
        add_options(parser, "train", cls.run_class, options.run_defaults, skip=("resume",), title="run")
        parser.add_argument("--hyperparams", metavar="KEY=VALUE", nargs="+", action="extend", default=[],
                            help=options.hyperparams_help)
        if not cls.env_option_last:
            add_env_option(parser, options.preset, "train.py")
        add_options(parser, "env", cls.env_class, options.env_defaults, skip=ENV_NOT_CLI,
                    title=f"environment ({cls.env_id})")
        if cls.env_option_last:
            add_env_option(parser, options.preset, "train.py")
        return parser

    @classmethod
    def parse(cls, argv: list[str] | None = None, preset: str | None = None):
        """A new run's config (``new``) or ``--resume``'s (``resumed``); exits with a message on bad options."""
        options, parser = cls(preset), cls.build_parser(preset)
        refuse_moved(parser, argv, cls.env_class)
        namespace = parser.parse_args(argv)
        try:
            return options.new(namespace) if namespace.resume is None else options.resumed(namespace)
        except cls.errors as err:
            parser.error(str(err))

    def resumed(self, namespace: argparse.Namespace):
        """The run ``--resume`` names (``find_run``), read by ``load`` with the run options given over its saved ones
        (only ``RESUMABLE`` ones); ``log_dir`` and ``run_name`` where its folder now lies."""
        changes = given(namespace, "train")
        may = [k for k in RESUMABLE if k in {f.name for f in fields(self.run_class)}
               and (self.run_name_resumes or k != "run_name")]  # BiLD-v1: --resume RUN alone names the run
        refused = sorted({*(k for k in changes if k not in may), *given(namespace, "env"),
                          *(["hyperparams"] if namespace.hyperparams else [])})
        if refused:
            flags = [", ".join("--" + k.replace("_", "-") for k in keys) for keys in (refused, may)]
            raise ConfigError("--resume goes on with the run's saved config; these options cannot change: "
                              f"{flags[0]} (only {flags[1]} may; start a new run instead)")
        run = namespace.resume or (changes.get("run_name") if self.run_name_resumes else None)
        if not run:
            raise ConfigError("--resume RUN: give the run (its folder, or its name under --log-dir)")
        run_dir = find_run(run, Path(changes.get("log_dir", self.run_defaults.log_dir)))
        return self.load(run_dir, changes | {"log_dir": str(run_dir.parent), "run_name": run_dir.name})
