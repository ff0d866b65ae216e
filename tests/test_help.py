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


def test_every_option_of_the_offline_commands_has_help():
    from agents.offline import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands.choices) == {"record", "train"}
    assert not [o for sub in commands.choices.values() for o in _options_without_help(sub)]


def test_the_envs_configs_carry_their_help_in_field_metadata():
    from bild_env.cli import field_help
    from bild_env.config import CommonConfig, sub_configs
    from bild_env.env import EnvConfig
    from bild_env.serving.config import ServingConfig

    for cls in (CommonConfig, EnvConfig, ServingConfig):
        documented = {f.name for f in fields(cls) if f.metadata.get("help")}
        assert documented == {f.name for f in fields(cls)}, cls
        defaults = cls()
        for f in fields(cls):  # a sub-config's help is followed by each of its keys'
            keys = ("".join(f"; {k.name}: {k.metadata['help']}" for k in fields(getattr(defaults, f.name)))
                    if f.name in sub_configs(cls) else "")
            assert field_help(cls).get(f.name) == (f.metadata["help"] + keys if f.metadata.get("help") else None)
    assert "; bleu_weight: weight of the BLEU lost" in field_help(EnvConfig)["reward"]
    assert "bleu_weight" not in field_help(ServingConfig)["reward"]
    # a field both envs take, declared again with the serving env's default, says the serving env's help
    assert field_help(ServingConfig)["max_new_tokens"].startswith("tokens each request generates")
    assert field_help(EnvConfig)["max_new_tokens"].startswith("tokens generated per episode")


def test_a_sub_config_is_one_option_of_key_values_read_as_its_fields_types():
    """``--pair-options``, ``--reward``, ``--charging``: one option each, ``KEY=VALUE`` read as the field's type (a
    tuple comma-separated); a key the sub-config lacks is refused naming its keys. Every key carries its help."""
    from agents.bild import training
    from agents.serve import options
    from bild_env.cli import given
    from bild_env.config import PairOptions, Reward
    from bild_env.command import UsageError
    from bild_env.serving.config import Charging

    for cls in (PairOptions, Reward, Charging):
        assert all(f.metadata.get("help") for f in fields(cls)), cls
    ns = training.build_parser().parse_args(["--pair-options", "dtype=float32", "draft_vocab=none", "--reward",
                                             "regret_weight=3", "bleu_weight=0"])
    assert given(ns, "env") == {"pair_options": {"dtype": "float32", "draft_vocab": None},
                                "reward": {"regret_weight": 3.0, "bleu_weight": 0.0}}
    ns = options.build_parser().parse_args(["--charging", "train_profiles=a,b", "charge_loop=0.6,0.09,0.2"])
    assert given(ns, "env") == {"charging": {"train_profiles": ("a", "b"), "charge_loop": (0.6, 0.09, 0.2)}}
    with pytest.raises(UsageError, match="--charging 'loop=1': give KEY=VALUE, KEY one of read_ahead_batch, "
                                         "charge_loop, train_profiles, vary_profiles"):
        options.build_parser().parse_args(["--charging", "loop=1"])


def test_the_actions_option_adds_keys_given_again_and_an_old_flat_option_is_refused_naming_its_key(capsys):
    """``--actions``: a tree rule a key (its commas are the rule's), a key given again adds to its tuple, the option
    given twice adds its keys; over the serving trainer's own grid (rollback 0.5) the keys not given stay. An option
    that became a key (``--off-switch``, ``--observe-next``) exits 2 saying which option and key to give."""
    from agents.bild import training
    from agents.serve import options

    config, _ = training.parse_config(["--pair", "tiny-random", "--actions", "rollback_values=0.5,1", "tree_rules=3,2,1",
                                       "--actions", "tree_rules=6:8:2:0.3", "off_switch=yes"])
    actions = config.env.actions
    assert (actions.rollback_values, actions.tree_rules, actions.off_switch) == ((0.5, 1.0), ("3,2,1", "6:8:2:0.3"), True)
    assert actions.fallback_values == training.EnvConfig().actions.fallback_values  # not given: the default
    _, env = options.parse(["--pair", "tiny-random", "--actions", "tree_rules=6:8:2"])
    assert (env.actions.rollback_values, env.actions.off_switch, env.actions.tree_rules) == ((0.5,), True, ("6:8:2",))
    for parse, argv, says in ((training.parse_config, ["--off-switch"], "--off-switch is now a key of --actions: give "
                               "--actions off_switch=VALUE"),
                              (training.parse_config, ["--quality", "bleu"], "give --reward quality=VALUE"),
                              (options.parse, ["--observe-next"], "give --observe next=VALUE"),
                              (options.parse, ["--no-off-switch"], "give --actions off_switch=VALUE")):
        with pytest.raises(SystemExit) as exit_:
            parse(argv)
        assert exit_.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("module", ["bench.decoders", "bench.forwards", "bench.headroom", "bench.paper_table",
                                    "bild_env.fill", "bild_env.profile", "agents.offline"])
def test_no_help_page_prints_a_config_dataclass_repr(module):
    """A config dataclass without a docstring gets its signature as ``__doc__``: ``--help`` shows no such line."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "usage:" in done.stdout
    assert not [line for line in done.stdout.splitlines() if "Config(" in line and ": '" in line], module
