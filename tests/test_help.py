"""Option help lives with the config fields (``field(..., metadata={"help": ...})``): every option of both trainers'
command lines says what it does, and the configs' help reads as ``--help`` shows it."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest


def _options_without_help(parser: argparse.ArgumentParser) -> list[str]:
    return [action.option_strings[0] for action in parser._actions
            if action.option_strings and not (action.help or "").strip() and action.help != argparse.SUPPRESS]


@pytest.mark.parametrize("module", ["agents.bild.training", "agents.serve.options"])
def test_every_option_of_train_py_help_and_train_py_env_serve_help_has_help(module):
    import importlib

    parser = importlib.import_module(module).build_parser()  # train.py --help; train.py --env serve --help
    assert not _options_without_help(parser)


def test_the_envs_configs_carry_their_help_in_field_metadata():
    from bild_env.cli import field_help
    from bild_env.config import CommonConfig
    from bild_env.env import EnvConfig
    from bild_env.serving.config import ServingConfig

    for cls in (CommonConfig, EnvConfig, ServingConfig):
        documented = {f.name for f in fields(cls) if f.metadata.get("help")}
        assert documented == {f.name for f in fields(cls)} - {"fallback_values", "rollback_values"}, cls
        assert field_help(cls) == {f.name: f.metadata["help"] for f in fields(cls) if f.metadata.get("help")}
    # a field both envs take, declared again with the serving env's default, says the serving env's help
    assert field_help(ServingConfig)["max_new_tokens"].startswith("tokens each request generates")
    assert field_help(EnvConfig)["max_new_tokens"].startswith("tokens generated per episode")
