"""Old names, read in one place: arguments given by their names before a change, and runs saved by earlier versions.

The envs, the command lines and the trainers hand what they were given here first and know today's names only:

- Arguments given flat (``off_switch=True``, ``dtype="float32"``: the names from before the sub-configs ``actions``,
  ``pair_options``, ``reward``...): ``folded`` moves them into their sub-config with a DeprecationWarning
  (``gymnasium.make``); ``fold_flat`` does so silently (runs saved then); ``refuse_moved`` says on a command line
  which option holds them now (``--off-switch`` -> ``--actions off_switch=VALUE``); ``refuse_renamed`` says
  that the serving evaluations' fixed actions are ``--fixed-actions`` (and the clock's ``--select-steps``
  ``--episode-steps``).
- Saved runs (``config.json``): ``bild_run`` (BiLD-v1's trainer) and ``serve_run`` (BiLD-Serve-v0's) fill in what an
  older run did not save with the behaviour it trained under, and refuse a run trained with a removed option, naming
  the commit to load it from.
"""

from __future__ import annotations

import argparse
import warnings
from dataclasses import fields, is_dataclass

from bild_env.config import flat_names

# BiLD-Serve-v0 options removed after their measured result (docs/results.md keeps it): their default, the last commit
REMOVED = {"allocate": (False, "1029c5c"), "observe_domain": (False, "61e4dff"), "batch_fills": (True, "7df3149")}


def fold_flat(cls: type, values: dict) -> dict:
    """Keyword arguments ``values`` of config ``cls`` with the keys of its sub-configs given flat (``dtype="float32"``,
    as runs saved before the sub-config hold them) moved into their sub-config (a key given there wins)."""
    owner = flat_names(cls)
    flat = {k: v for k, v in values.items() if k in owner}
    if not flat:
        return values
    out = {k: v for k, v in values.items() if k not in flat}
    for name in {owner[k][0] for k in flat}:
        nested = out.get(name)
        nested = vars(nested).copy() if is_dataclass(nested) else dict(nested or {})
        out[name] = {owner[k][1]: v for k, v in flat.items() if owner[k][0] == name} | nested
    return out


def folded(cls: type, kwargs: dict, stacklevel: int = 3) -> dict:
    """``kwargs`` of config ``cls`` with the keys of a sub-config given flat moved into it, with a DeprecationWarning
    naming the sub-config."""
    names = {f.name for f in fields(cls)}
    flat = {k: name for k, (name, _) in flat_names(cls).items() if k in kwargs and k not in names}
    if not flat:
        return kwargs
    warnings.warn(f"{sorted(flat)} given flat are deprecated: give them in " + ", ".join(
        f"{name}={{...}}" for name in sorted(set(flat.values()))), DeprecationWarning, stacklevel=stacklevel)
    return fold_flat(cls, kwargs)


def refuse_moved(parser: argparse.ArgumentParser, argv: list[str] | None, cls: type) -> None:
    """A parser error (exit 2) for an option of config ``cls`` that became a key of a sub-config option, saying which
    (``--off-switch`` -> ``--actions off_switch=VALUE``)."""
    import sys

    moved = flat_names(cls)
    for token in sys.argv[1:] if argv is None else argv:
        option = token.partition("=")[0]
        name = option.removeprefix("--").removeprefix("no-").replace("-", "_")
        if option.startswith("--") and name in moved:
            sub, key = moved[name]
            parser.error(f"{option} is now a key of --{sub.replace('_', '-')}: give --{sub.replace('_', '-')} "
                         f"{key}=VALUE")


def refuse_renamed(argv: list[str] | None) -> None:
    """The serving evaluations' options renamed when they took the env's own arguments: ``--actions 0 5 10`` (the
    rules' fixed actions; ``--actions`` takes the env's action options, ``KEY=VALUE``, as ``train.py``'s does) and the
    clock's ``--select-steps`` (the env's ``--episode-steps``): a ``UsageExit`` naming the option to give."""
    import sys

    from bild_env.command import UsageExit

    argv = sys.argv[1:] if argv is None else argv
    for i, token in enumerate(argv):
        if token == "--actions" and i + 1 < len(argv) and argv[i + 1].isdigit():
            raise UsageExit(f"error: --actions {argv[i + 1]}: --actions takes the env's action options now (KEY=VALUE, "
                            f"as train.py's); the fixed actions the rules run are --fixed-actions {argv[i + 1]} ...")
        if token.partition("=")[0] == "--select-steps":
            raise UsageExit("error: --select-steps is the env's --episode-steps now (the validation episodes' steps)")


def bild_run(data: dict, env_cls: type) -> dict:
    """A BiLD-v1 run's saved ``config.json`` (``agents.config.RunConfig``) as today's trainer reads it: runs saved
    before ``all_actions`` learned from the action taken; before ``draft_vocab``, with the draft's full head; before
    ``pair_options``, with its keys flat."""
    return data | {"dqn": {"all_actions": False} | data.get("dqn", {}),
                   "env": fold_flat(env_cls, {"draft_vocab": 0} | data.get("env", {}))}


def serve_run(saved: dict, env_cls: type) -> tuple[dict, dict]:
    """A BiLD-Serve-v0 run's saved ``config.json`` as today's trainer reads it: (its ``"train"`` object, run options
    and DQN hyperparameters flat, JSON lists as tuples; its ``"env"`` object but the split). A ValueError for a run
    trained with a removed option away from its default, naming it (the caller says "<path> was trained with ...")."""
    train = {k: tuple(v) if isinstance(v, list) else v for k, v in saved["train"].items()}
    train.setdefault("all_actions", False)  # runs saved before the option learned from the taken action only
    train.setdefault("learning_rate_final", None)  # ... at a constant step size
    train["paired_actions"] = train.get("paired_actions", False) and train["all_actions"]  # ... one at a time
    if saved.get("format", 1) < 2:  # format 1 divided the target update interval by n_envs before SB3 divided it again
        train["target_update_interval"] = max(1, train.get("target_update_interval", 1_000) // train.get("n_envs", 4))
    env = {k: tuple(v) if isinstance(v, list) else v for k, v in saved["env"].items() if k != "split"}
    for name, (default, last) in REMOVED.items():  # an option that went: a run that left it at its default still loads
        if name in env and env.pop(name) != default:
            raise ValueError(f"{name}, an option removed after commit {last} (its finding is in docs/results.md): "
                             f"load the run from that commit (git checkout {last})")
    env.setdefault("batch_scale", "linear")  # runs saved before the option read the batch size on a linear scale
    env.setdefault("draft_vocab", 0)  # runs saved before the option trained with the draft's full head
    return train, fold_flat(env_cls, env)  # runs saved before the sub-configs hold their keys flat


__all__ = ["REMOVED", "bild_run", "fold_flat", "folded", "refuse_moved", "refuse_renamed", "serve_run"]
