"""Old names, read in one place: arguments given by their names before a change, and runs saved by earlier versions.

The envs, the command lines and the trainers hand what they were given here first and know today's names only:

- Arguments given flat (``off_switch=True``, ``dtype="float32"``: the names from before the sub-configs ``actions``,
  ``pair_options``, ``reward``...): ``folded`` moves them into their sub-config with a DeprecationWarning
  (``gymnasium.make``); ``fold_flat`` does so silently (runs saved then); ``refuse_moved`` says on a command line
  which option holds them now (``--off-switch`` -> ``--actions off_switch=VALUE``); ``refuse_renamed`` says
  that the serving evaluations' fixed actions are ``--fixed-actions`` (and the clock's ``--select-steps``
  ``--episode-steps``).
- Saved runs (``config.json``): ``run_spec`` reads a run of any version (BiLD-v1's trainer's, BiLD-Serve-v0's, an
  offline run's) as today's one spec (``agents.spec.RunSpec``), fills in what an older run did not save with the
  behaviour it trained under, and refuses a run trained with a removed option, naming the commit to load it from.
"""

from __future__ import annotations

import argparse
import functools
import warnings
from dataclasses import fields, is_dataclass

from bild_env.config import flat_names as config_keys

# BiLD-Serve-v0 options removed after their measured result (docs/results.md keeps it): their default, the last commit
REMOVED = {"allocate": (False, "1029c5c"), "observe_domain": (False, "61e4dff"), "batch_fills": (True, "7df3149")}


# Keys whose name changed when a sub-config took them: the name given flat before -> the key's name there
RENAMED_FLAT = {"action": "space", "observe_next": "next", "observe_costs": "costs"}


@functools.cache
def flat_names(cls: type) -> dict[str, tuple[str, str]]:
    """``{the name an argument had given flat: (the sub-config holding it now, its key there)}`` for config ``cls``:
    a key's own name, or its ``RENAMED_FLAT`` one."""
    keys = config_keys(cls)
    renamed = {old: keys[new] for old, new in RENAMED_FLAT.items() if new in keys}
    return {k: v for k, v in keys.items() if k not in {RENAMED_FLAT[old] for old in renamed}} | renamed


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
    (``--off-switch`` -> ``--actions off_switch=VALUE``); a key that is also a field of ``cls`` itself is its option."""
    import sys
    from dataclasses import fields

    own = {f.name for f in fields(cls)}
    moved = {name: where for name, where in flat_names(cls).items() if name not in own}
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


SPEC_VERSION = 3  # of a run's saved spec, config.json (agents.spec.RunSpec)
# Before version 3 a serving run saved its run options and its DQN's hyperparameters in one "train" object: these
# were its run options (the rest were hyperparameters); an offline run's "offline" held its algorithm.
SERVE_RUN_KEYS = frozenset({"total_timesteps", "seed", "n_envs", "run_name", "log_dir", "eval_freq", "eval_episodes",
                            "reference_actions", "checkpoint_freq", "torch_threads", "fill_trees", "progress_bar",
                            "time_budget", "floor", "resume"})


def run_spec(saved: dict, env_classes: dict[str, type]) -> dict:
    """A run's saved ``config.json`` of any version as today's spec: ``{"version", "env_id", "env", "algo",
    "hyperparams", "run", "meta"}`` (``env`` the keyword arguments of ``gymnasium.make(env_id, ...)``; ``env_classes``
    the config class of each env id, for arguments an older version gave flat). What an older run did not save is
    filled in with the behaviour it trained under. A ValueError saying what is wrong: a file of no version, a version
    newer than this code's, a run trained with a removed option away from its default (naming the commit to load it
    from)."""
    if not isinstance(saved, dict):
        raise ValueError("no JSON object: restore it from a copy of the run")
    version = saved.get("version", 2 if "env_id" in saved else 1)
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"its version {version!r} is no whole number: correct it there")
    if version > SPEC_VERSION:
        raise ValueError(f"spec version {version}, newer than this code's {SPEC_VERSION}: update bild-gym to read it")
    if version < SPEC_VERSION and (bad := [k for k in ("train", "env") if not isinstance(saved.get(k, {}), dict)]):
        raise ValueError(f"its {bad[0]!r} is no JSON object: correct it there")
    if version == SPEC_VERSION:
        spec = dict(saved)
    elif saved.get("env_id") is not None:  # BiLD-Serve-v0's trainer (its "format" 1 or 2), or an offline run
        spec = _serve_run(saved)
    else:  # BiLD-v1's trainer (agents.config.RunConfig): "train", one object per algorithm, "env", "meta"
        spec = _bild_run(saved)
    spec.setdefault("algo", "dqn")
    for key, kind in (("env_id", str), ("algo", str), ("env", dict), ("hyperparams", dict), ("run", dict),
                      ("meta", dict)):
        if not isinstance(spec.setdefault(key, {} if kind is dict else None), kind):
            raise ValueError(f"its {key!r} is no {'JSON object' if kind is dict else 'string'}: correct it there")
    if spec["env_id"] not in env_classes:
        raise ValueError(f"its env {spec['env_id']!r} is none of {sorted(env_classes)}: correct it there")
    spec["version"] = SPEC_VERSION
    if version < SPEC_VERSION:  # runs saved before the sub-configs hold their keys flat
        spec["env"] = fold_flat(env_classes[spec["env_id"]], spec["env"])
    return spec


def _bild_run(data: dict) -> dict:
    """BiLD-v1's ``config.json`` before version 3: runs saved before ``all_actions`` learned from the action taken;
    before ``draft_vocab``, with the draft's full head; before ``--algo``, a DQN."""
    train = dict(data.get("train", {}))
    algo = train.pop("algo", "dqn")
    hyperparams = data.get(algo, {})
    if algo == "dqn":
        hyperparams = {"all_actions": False} | hyperparams
    return {"env_id": "BiLD-v1", "env": {"draft_vocab": 0} | data.get("env", {}), "algo": algo,
            "hyperparams": hyperparams, "run": train, "meta": data.get("meta", {})}


def _serve_run(saved: dict) -> dict:
    """BiLD-Serve-v0's ``config.json`` before version 3 (one ``"train"`` object of run options and hyperparameters, a
    ``"format"``); a ValueError for a run trained with a removed option away from its default."""
    train = dict(saved.get("train", {}))
    train.pop("offline", None)  # python -m agents.offline's runs noted themselves here (offline.json holds it all)
    algo = "dqn"  # the SB3 algorithm of the model files (an offline run's too)
    hyperparams = {k: v for k, v in train.items() if k not in SERVE_RUN_KEYS}
    hyperparams.setdefault("all_actions", False)  # runs saved before the option learned from the taken action only
    hyperparams.setdefault("learning_rate_final", None)  # ... at a constant step size
    hyperparams["paired_actions"] = hyperparams.get("paired_actions", False) and hyperparams["all_actions"]
    if saved.get("format", 1) < 2:  # format 1 divided the target update interval by n_envs before SB3 divided it again
        hyperparams["target_update_interval"] = max(1, hyperparams.get("target_update_interval", 1_000)
                                                    // train.get("n_envs", 4))
    env = {k: v for k, v in saved.get("env", {}).items() if k != "split"}
    for name, (default, last) in REMOVED.items():  # an option that went: a run that left it at its default still loads
        if name in env and env.pop(name) != default:
            raise ValueError(f"the run was trained with {name}, an option removed after commit {last} (its finding is "
                             f"in docs/results.md): load the run from that commit (git checkout {last})")
    env.setdefault("batch_scale", "linear")  # runs saved before the option read the batch size on a linear scale
    env.setdefault("draft_vocab", 0)  # runs saved before the option trained with the draft's full head
    return {"env_id": saved["env_id"], "env": env, "algo": algo, "hyperparams": hyperparams,
            "run": {k: v for k, v in train.items() if k in SERVE_RUN_KEYS}, "meta": {}}


__all__ = ["REMOVED", "SPEC_VERSION", "fold_flat", "folded", "refuse_moved", "refuse_renamed", "run_spec"]
