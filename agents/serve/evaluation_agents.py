"""The agents a serving evaluation judges (``--model``): read back from their run folders (``load_agents``, their
grid: ``agent_grid``; several DQNs on one grid as one ``q_ensemble``) and checked before any model loads
(``check_model``: a readable SB3 model of a BiLD-Serve-v0 run whose observation and action mean here what they meant
in training).
"""

from __future__ import annotations


import logging
from pathlib import Path


from agents.common.checks import read_model_zip, trained_on
from agents.config import ConfigError
from agents.serve.bench_config import MEANING, SYSTEM, ServingBenchConfig, env_options, make_env
from bild_env import SERVE_ID
from bild_env.config import flat_names, over
from bild_env.serving.env import ServingConfig
from bild_env.serving.observations import N_BASE, N_COSTS, N_FORESEE
from bild_env.serving.workload import parse_mix

logger = logging.getLogger(__name__)


def load_agents(cfg: ServingBenchConfig) -> list:
    """(name, model) of every ``--model``: a model file, or a run folder's best model on validation (else its
    last), checked against the env's spaces (a clear error otherwise)."""
    from agents.common.trained import choose_model, load_agent

    if not cfg.model:
        return []
    out = []
    for p in cfg.model:
        path = choose_model(p)[0]
        grid = agent_grid(path)
        env = make_env(cfg, "test", f"constant:{cfg.levels[0]}", **grid)
        try:
            names = {n for n, _, _ in out}  # rows are keyed by name: two runs of one folder name are told apart
            name = next(n for n in (f"agent {Path(p).name}", f"agent {p}", *(f"agent {p} #{i}" for i in range(2, 99)))
                        if n not in names)
            out.append((name, load_agent(path, env), grid))
        finally:
            env.close()
    return out


# An agent's spaces, how it reads its observation and what its thresholds read: the keys of its run's env it keeps in
# any evaluation, by sub-config (``grid_of``)
GRID = {"actions": ("fallback_values", "rollback_values", "off_switch", "per_domain", "max_draft_len", "score",
                    "tree_rules"), "observe": ("batch_scale", "next", "costs"), "charging": ("read_ahead_batch",)}


def grid_of(env: ServingConfig) -> dict:
    """``env``'s ``GRID`` keys, by sub-config: what ``make_env`` gives an agent's env over the evaluation's."""
    return {sub: {k: getattr(getattr(env, sub), k) for k in keys} for sub, keys in GRID.items()}


def serve_run_env(model_path: Path) -> ServingConfig | None:
    """The env options of the serving run a model file belongs to (its ``config.json`` beside it or above
    ``checkpoints/``, read as a resume reads it); None for a model without one. A ``ConfigError`` naming the file for
    a run of another env (a BiLD-v1 run) or a config that cannot be read."""
    from agents.serve.options import saved_configs

    config, env_id = trained_on(model_path)
    if config is None:
        return None
    if env_id is not None and env_id != SERVE_ID:
        raise ConfigError(f"{model_path} is a model of a {env_id} run ({config}), not of a {SERVE_ID} one: evaluate "
                          f"it without --env serve (python evaluate.py --model {config.parent})")
    return saved_configs(config.parent)[1]  # a ConfigError naming the file and what to do where it cannot be used


def trained_world(argv: list[str] | None, defaults):
    """``defaults`` (an evaluation's config with an ``env`` field: ``ServingBenchConfig``, the clock's
    ``LoadClockConfig``; None: ``ServingBenchConfig``'s) with the world the first ``--model``'s run was trained in (its
    pair, the dtype and cost profile it was given, its batch, answer length, draft cap and tree rules) in its env, for
    the command line to override: ``--model RUN`` alone evaluates the agent, and the rules beside it, where it learnt.
    A model with no run config, or one that cannot be read (``check_model`` then says why), changes nothing."""
    import argparse
    from dataclasses import replace

    from agents.common.trained import choose_model

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--model", nargs="*", default=[])
    models = pre.parse_known_args(argv)[0].model
    try:
        run = serve_run_env(choose_model(models[0])[0]) if models else None
    except (ConfigError, OSError, ValueError):
        run = None
    base = defaults if defaults is not None else ServingBenchConfig()
    if run is None:
        return defaults
    world = {"pair": run.pair, "max_batch": run.max_batch, "max_new_tokens": run.max_new_tokens,
             "actions": {"max_draft_len": run.actions.max_draft_len, "tree_rules": tuple(run.actions.tree_rules)}}
    if run.cost_profile:
        world["cost_profile"] = run.cost_profile
    if run.pair_options.dtype not in (None, "auto"):
        world["pair_options"] = {"dtype": run.pair_options.dtype}
    return replace(base, env=over(base.env, world))


def agent_grid(model_path: Path) -> dict:
    """The action grid, observation and score a serving run was trained with (``GRID``, from
    ``serve_run_env``), all of them: its env is built on the evaluation's with these over it, so an option given for
    the rules (``--actions fallback_values=...``) never changes an agent's own; {} for a model without a run config."""
    env = serve_run_env(model_path)
    return {} if env is None else grid_of(env)


def check_model(cfg: ServingBenchConfig, given: str) -> None:
    """A ``--model`` must be a readable SB3 model of a BiLD-Serve-v0 run whose observation and action mean here what
    they meant in training (``MEANING``, the domains it observes, its spaces): a ``ValueError`` naming it otherwise;
    a warning where it acts in another system than it learnt in (``SYSTEM``) or its settings are unknown (no run
    config). Reads the run's config.json and the zip's saved spaces; no model of the pair loads."""
    from agents.common.trained import choose_model

    path = choose_model(given)[0]
    if not path.is_file():
        raise ValueError(f"--model {given}: no model file at {path}")
    config, env_id = trained_on(path)
    if env_id is not None and env_id != SERVE_ID:
        raise ValueError(f"--model {given} is a {env_id} run ({config}), not a {SERVE_ID} one: evaluate it without "
                         f"--env serve (python evaluate.py --model {given})")
    try:
        run_env = serve_run_env(path)
        grid = grid_of(run_env) if run_env is not None else {}
        here = ServingConfig(**env_options(cfg, "test", f"constant:{cfg.levels[0]}", **grid))  # the env it will act in
        if run_env is not None:  # from its run's config alone, before the zip is read
            check_meaning(given, config, run_env, here)
        check_spaces(given, path, read_model_zip(path), here, run_env is not None)
    except ConfigError as err:
        raise ValueError(f"--model {given}: {err}") from None
    if run_env is None:
        logger.warning(f"--model {given}: no run config beside {path}: it runs in this evaluation's env (max_batch "
                       f"{here.max_batch}, max_new_tokens {here.max_new_tokens}, max_draft_len "
                       f"{here.actions.max_draft_len}, "
                       f"batch_scale {here.observe.batch_scale}, BiLD-v1's grid); its spaces fit, but whether it was "
                       "trained with these settings cannot be checked")
        return
    differ = [f"{k} {run_env.setting(k)!r} (here {here.setting(k)!r})" for k in SYSTEM
              if run_env.setting(k) != here.setting(k)]
    if differ:
        logger.warning(f"--model {given} was trained with {', '.join(differ)}: it acts on models, prompts or a reward "
                       "it never learnt on (its observation keeps its meaning); its rows measure it there")


def check_meaning(given: str, config: Path, run_env: ServingConfig, here: ServingConfig) -> None:
    """Refuse a model whose observation or action would mean something else in the env it will act in (``here``)
    than in its run's (``run_env``): another action kind, other domains observed, other scales (``MEANING``)."""
    if run_env.actions.space != "discrete":
        raise ValueError(f"--model {given} acts on a {run_env.actions.space} action ({config}); this evaluation runs "
                         "agents of the discrete action only")
    if domains_of(run_env) != domains_of(here):
        raise ValueError(f"--model {given} observes{' and acts for' if run_env.actions.per_domain else ''} each "
                         f"domain of its run's workload ({', '.join(domains_of(run_env))}), but this evaluation's test workload has "
                         f"{', '.join(domains_of(here))}: its observation would mean something else; give --mix (or "
                         f"--test-mix) over the domains it was trained on, e.g. --mix {run_env.mix}")
    for name, meaning in MEANING.items():
        if run_env.setting(name) != here.setting(name):
            fix = (f"give --actions {name}={run_env.setting(name)}" if name in flat_names(ServingConfig)
                   else f"give --{name.replace('_', '-')} {run_env.setting(name)}")
            raise ValueError(f"--model {given} was trained with {name} {run_env.setting(name)} ({config}), this "
                             f"evaluation runs {name} {here.setting(name)}: {meaning}, so its observation would mean "
                             f"something else; {fix}")


def space_name(space) -> str:
    """A space in short: ``Box(14,)``, ``Discrete(6)``, ``MultiDiscrete([6, 6])``."""
    if hasattr(space, "n"):
        return f"Discrete({space.n})"
    if hasattr(space, "nvec"):
        return f"MultiDiscrete({list(space.nvec)})"
    return f"{type(space).__name__}{getattr(space, 'shape', '')}"


def domains_of(env: ServingConfig) -> tuple[str, ...]:
    """The domains an env's agent observes the shares of (and with ``per_domain`` acts for), in their order."""
    return tuple(parse_mix(env.mix)) if env.actions.per_domain else ()


def check_spaces(given: str, path: Path, saved: dict, here: ServingConfig, has_config: bool) -> None:
    """The model's saved spaces are those of the env it will act in (``here``): its observation's size (with the
    domains it observes) and its action grid."""
    n = here.actions.n_discrete
    obs_shape = (N_BASE + len(domains_of(here)) + (N_FORESEE if here.observe.next else 0)
                 + (N_COSTS if here.observe.costs else 0),)
    obs, act = saved["observation_space"], saved["action_space"]
    act_fits = (tuple(getattr(act, "nvec", ())) == (n,) * len(domains_of(here)) if here.actions.per_domain
                else getattr(act, "n", None) == n and not hasattr(act, "nvec"))
    if getattr(obs, "shape", None) == obs_shape and act_fits:
        return
    where = ("its run's config says it sees and does; the file is not that run's model?" if has_config
             else "no run config beside it: this evaluation's default grid (a model of another grid needs its run "
                  "folder)")
    raise ValueError(f"--model {given}: {path} was trained for observation space {space_name(obs)} and action space "
                     f"{space_name(act)}, but the env it would act in has Box{obs_shape} and {n} actions"
                     f"{f' per domain of {domains_of(here)}' if here.actions.per_domain else ''} ({where})")
