"""RLlib's PPO (or DQN) on ``BiLD-Serve-v0`` with several env runners, its metrics in TensorBoard (``pip install -e ".[cluster]"``).

    python -m agents.rllib_serve --pair tiny-random --iterations 5                   # a local Ray instance, minutes on a CPU
    python -m agents.rllib_serve --pair smollm2 --env-runners 8 --iterations 200 --ray auto   # a cluster
    python -m agents.rllib_serve --compare logs/<a train.py --env serve run> --iterations 8 --train-batch 250 \
        --out results/cluster_rllib_vs_sb3_tiny.json                               # beside SB3's DQN (+ a PNG)
    tensorboard --logdir logs

The example for RL users who scale out with RLlib rather than Stable-Baselines3 (``train.py --env
serve`` steps its envs in one process). RLlib makes each env runner's env from the registered id
(``bild_env:BiLD-Serve-v0``: Gymnasium imports ``bild_env``, which registers it) with the
``BiLD-Serve-v0`` options given here over the ``serve`` preset (``agents.spec.PRESETS``: every field of
``ServingConfig``, as ``train.py --env serve`` takes them and starts from), on the replay backend (the serving env's
only one): each runner process fills and reads the pair's trees in the shared store. Each iteration's metrics
(RLlib's ``env_runners/``, ``learners/`` and timing keys, numbers only) go to ``<log_dir>/<run_name>/`` as TensorBoard
scalars, beside train.py's runs; the final algorithm is saved to ``<run_dir>/checkpoint``
(``Algorithm.from_checkpoint``), the run's spec to ``config.json`` (``save_spec``: train.py's format). RLlib's new
API stack (RLModule, Learner, EnvRunner) throughout.

``--eval-every K`` runs the greedy policy (the RLModule's most likely action) every K iterations on the validation
episodes ``train.py --env serve`` evaluates its DQN on: ``--eval-episodes`` seeds (``validation_seeds``) at each
load the trainer validates at (``agents.serve.validation.validation_envs``), on the "validation" split, logged as
``eval/mean_reward`` and ``serving/agent_speedup_x`` as the trainer logs them. ``--compare RUN`` takes a
``train.py --env serve`` run folder: RLlib trains on that run's env options, is evaluated on its validation
episodes (checked: the best fixed action's return and speedup there equal the run's ``summary.json``), and both
learning curves (validation return and speedup against env steps) go to ``--out`` (JSON) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from agents.serve.run_report import reference_values
from agents.serve.validation import fixed_name, validation_envs, validation_seeds
from agents.spec import ENV_NOT_CLI, RunSpec, preset_env
from bild_env.cli import add_options, add_ray_option, finite_json, given
from bild_env.command import check_options
from bild_env.ids import SERVE_ID
from bild_env.serving.env import ServingConfig

INSTALL_HINT = 'agents.rllib_serve needs the cluster extra (RLlib): pip install -e ".[cluster]"'
ALGOS = ("ppo", "dqn")
HYPERPARAMS = ("lr", "gamma", "train_batch", "minibatch", "epochs")  # a run's spec: RLlibConfig's algorithm fields


@dataclass(frozen=True)
class RLlibConfig:
    """Options of the RLlib run (the env's are ``ServingConfig``'s)."""

    algo: str = field(default="ppo", metadata={"help": "ppo | dqn (RLlib's, new API stack)"})
    iterations: int = field(default=10, metadata={"help": "Algorithm.train() calls"})
    env_runners: int = field(default=2, metadata={"help": "Ray actors stepping envs (one process each)"})
    envs_per_runner: int = field(default=1, metadata={"help": "envs each runner steps"})
    train_batch: int = field(default=256, metadata={"help": (
        "env steps per training iteration (PPO: train_batch_size_per_learner; DQN: sampled at least)")})
    minibatch: int = field(default=64, metadata={"help": "PPO's SGD minibatch"})
    epochs: int = field(default=4, metadata={"help": "PPO's passes over each batch"})
    lr: float = field(default=3e-4, metadata={"help": "learning rate"})
    gamma: float = field(default=0.99, metadata={"help": "discount"})
    seed: int = field(default=0, metadata={"help": "RLlib's seed (env runners, RLModule)"})
    torch_threads: int = field(default=1, metadata={"help": (
        "torch's CPU threads in this process (train.py --env serve's default: the cost model is timed per thread "
        "count)")})
    eval_every: int = field(default=0, metadata={"help": (
        "iterations between greedy evaluations on train.py --env serve's validation episodes (0: none; --compare: 1)")})
    eval_episodes: int = field(default=8, metadata={"help": (
        "validation episodes per load level (train.py --env serve's --eval-episodes; --compare: the run's)")})
    compare: str = field(default="", metadata={"help": (
        "a train.py --env serve run folder: train on its env options, evaluate on its validation episodes")})
    out: str = field(default="", metadata={"help": (
        "--compare: the JSON of both learning curves (a PNG beside it; default: <run_dir>/rllib_vs_sb3.json)")})
    log_dir: str = field(default="logs", metadata={"help": "the run is written to <log_dir>/<run_name>/"})
    run_name: str | None = field(default=None, metadata={"help": (
        "default: BiLD-Serve-v0-<pair>__rllib-<algo>__<seed>__<unix time>")})
    ray: str | None = field(default=None, metadata={"cli": False, "help": (
        'None or "local": a new local Ray instance; else ray.init\'s address')})

    def check(self) -> None:
        if self.algo not in ALGOS:
            raise ValueError(f"--algo must be one of {ALGOS}, got {self.algo!r}")
        check_options(self, ("iterations", "env_runners", "envs_per_runner", "train_batch", "minibatch", "epochs",
                             "eval_episodes", "torch_threads"), ("eval_every",))
        if self.compare and not (Path(self.compare) / "config.json").is_file():
            raise ValueError(f"--compare takes a train.py --env serve run folder (with config.json), got {self.compare!r}")


def algo_config(cfg: RLlibConfig, env_kwargs: dict):
    """RLlib's config of ``cfg.algo`` on ``BiLD-Serve-v0`` made from its registered id with ``env_kwargs``."""
    _import_ray()
    if cfg.algo == "ppo":
        from ray.rllib.algorithms.ppo import PPOConfig

        config = PPOConfig().training(train_batch_size_per_learner=cfg.train_batch, minibatch_size=cfg.minibatch,
                                      num_epochs=cfg.epochs, lr=cfg.lr, gamma=cfg.gamma)
    else:
        from ray.rllib.algorithms.dqn import DQNConfig

        config = (DQNConfig().training(train_batch_size_per_learner=cfg.minibatch, lr=cfg.lr, gamma=cfg.gamma,
                                       num_steps_sampled_before_learning_starts=cfg.minibatch)
                  .reporting(min_sample_timesteps_per_iteration=cfg.train_batch))  # RLlib's default: 1,000 steps
    return (config.environment(f"bild_env:{SERVE_ID}", env_config=env_kwargs)
            .env_runners(num_env_runners=cfg.env_runners, num_envs_per_env_runner=cfg.envs_per_runner)
            .debugging(seed=cfg.seed))


def train(cfg: RLlibConfig, env_kwargs: dict, evaluate: Callable[[object], dict] | None = None) -> dict:
    """Build the algorithm, run ``cfg.iterations`` iterations with their metrics in TensorBoard, save it; returns each
    iteration's mean episode return (NaN before an episode ended), the run folder and, every ``cfg.eval_every``
    iterations and after the last, ``evaluate(policy)`` (default: ``ValidationEpisodes``) at its env step. With an
    evaluation, the env runners charge the evaluation envs' cost model (handed in, so that training and evaluation
    price a step alike whatever thread count each process runs with)."""
    import torch

    ray = _import_ray()
    torch.set_num_threads(cfg.torch_threads)
    owned = ValidationEpisodes(env_kwargs, cfg.eval_episodes) if cfg.eval_every and evaluate is None else None
    evaluate = evaluate or owned
    if evaluate is not None and env_kwargs.get("cost_model") is None:
        env_kwargs = env_kwargs | {"cost_model": evaluate.cost_model}
    started = not ray.is_initialized()
    if started:
        ray.init(address=None if cfg.ray in (None, "local") else cfg.ray, include_dashboard=False)
    run_dir = Path(cfg.log_dir) / (cfg.run_name or default_run_name(cfg, env_kwargs))
    save_spec(cfg, env_kwargs, run_dir, ray.__version__)
    from torch.utils.tensorboard import SummaryWriter

    algo = algo_config(cfg, env_kwargs).build_algo()
    returns, evaluations = [], []
    try:
        with SummaryWriter(str(run_dir)) as writer:
            for i in range(cfg.iterations):
                result = algo.train()
                steps = int(_get(result, "num_env_steps_sampled_lifetime") or i + 1)
                for key, value in flat_scalars(result).items():
                    writer.add_scalar(key, value, steps)
                returns.append(float(_get(result, "env_runners/episode_return_mean") or math.nan))
                print(f"iteration {i + 1}/{cfg.iterations}: {steps} env steps, mean episode return {returns[-1]:.4f}",
                      flush=True)
                if cfg.eval_every and ((i + 1) % cfg.eval_every == 0 or i + 1 == cfg.iterations):
                    row = {"step": steps, "iteration": i + 1} | evaluate(GreedyModule(algo.get_module()))
                    evaluations.append(row)
                    writer.add_scalar("eval/mean_reward", row["return"], steps)
                    writer.add_scalar("serving/agent_speedup_x", row["speedup"], steps)
                    print(f"  validation: return {row['return']:.4f}, speedup {row['speedup']:.3f}x", flush=True)
        checkpoint = algo.save_to_path(str((run_dir / "checkpoint").resolve()))
    finally:
        algo.stop()
        if owned is not None:
            owned.close()
        if started:
            ray.shutdown()
    return {"run_dir": str(run_dir), "checkpoint": str(checkpoint), "episode_return_mean": returns,
            "evaluations": evaluations}


def save_spec(cfg: RLlibConfig, env_kwargs: dict, run_dir: Path, ray_version: str) -> None:
    """The run's ``config.json`` in ``train.py``'s format (``agents.spec.RunSpec``): the env's arguments (a cost model
    handed in is left out: the evaluation's, timed on this machine), the algorithm as ``rllib-<algo>`` with its
    hyperparameters, the other options as the run's."""
    from agents.common.files import write_text_atomic

    hyperparams = {k: getattr(cfg, k) for k in HYPERPARAMS}
    run = {k: v for k, v in vars(cfg).items() if k not in (*HYPERPARAMS, "algo", "ray")}
    spec = RunSpec(SERVE_ID, {k: v for k, v in env_kwargs.items() if k != "cost_model"}, f"rllib-{cfg.algo}",
                   hyperparams, run, {"trainer": "python -m agents.rllib_serve", "ray": ray_version, "argv": sys.argv})
    run_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(run_dir / "config.json", spec.text())


class GreedyModule:
    """An RLlib RLModule as a deterministic policy with SB3's ``predict`` (what ``agents.serve.rules`` runs): the
    action the module's ``forward_inference`` picks (DQN) or the most likely one of its distribution (PPO)."""

    def __init__(self, module) -> None:
        self.module = module

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        import torch

        with torch.no_grad():
            out = self.module.forward_inference({"obs": torch.as_tensor(np.asarray(observation, np.float32)[None])})
        action = out["actions"] if "actions" in out else out["action_dist_inputs"].argmax(-1)
        return np.int64(int(np.asarray(action).reshape(-1)[0])), state


class ValidationEpisodes:
    """``train.py --env serve``'s validation episodes for these env options: ``validation_seeds(episodes)`` on each
    of ``validation_envs``; called with a policy, its mean return and speedup over them (and
    the return's 95% interval), as the trainer evaluates its DQN."""

    def __init__(self, env_kwargs: dict, episodes: int) -> None:
        self.envs, self.seeds = validation_envs(env_kwargs), validation_seeds(episodes)

    def __call__(self, policy) -> dict:
        from agents.common.stats import mean_ci
        from agents.serve.validation import returns_over

        returns, speedups = returns_over(self.envs, policy, self.seeds)
        return {"return": float(returns.mean()), "speedup": float(speedups.mean()), "return_ci": list(mean_ci(returns))}

    @property
    def cost_model(self):
        """The cost model the validation envs charge (``bild_env.decoding.costs``; the same for every env)."""
        return self.envs[0].cost_model

    def close(self) -> None:
        for env in self.envs:
            env.close()


def fixed_policies(evaluate: ValidationEpisodes) -> dict[str, dict]:
    """Every fixed action on the validation episodes, named as ``train.py --env serve``'s ``summary.json`` names them
    (``off``, ``fixed_<fallback>_<rollback>``), and ``best_fixed``: the one with the best mean return."""
    from agents.serve.rules import Fixed

    env, rows = evaluate.envs[0], {}
    for a in range(env.action_space.n):
        rows[fixed_name(env.decode(a))] = {"action": a} | evaluate(Fixed(a))
    return rows | {"best_fixed": max(rows.values(), key=lambda row: row["return"])}


def same_episodes(fixed: dict[str, dict], references: dict) -> list[str]:
    """The fixed policies whose return or speedup here differs from a serving run's ``references`` (none: the same
    validation episodes, priced by the same cost model)."""
    values = {name: reference_values(ref) for name, ref in references.items()}
    return [name for name, (ret, speed) in values.items() if name in fixed and not (
            np.isclose(fixed[name]["return"], ret, rtol=1e-6, atol=1e-9)
            and np.isclose(fixed[name]["speedup"], speed, rtol=1e-6, atol=1e-9))]


def compare(cfg: RLlibConfig) -> dict:
    """RLlib beside a ``train.py --env serve`` run (``cfg.compare``): trained on its env options, evaluated every
    ``cfg.eval_every`` iterations (1 where 0) on its validation episodes; both curves and the fixed policies' lines,
    written to ``cfg.out`` (JSON) and a PNG beside it."""
    sb3_dir = Path(cfg.compare)
    saved = RunSpec.load(sb3_dir)
    if saved.env_id != SERVE_ID:
        raise ValueError(f"--compare: {sb3_dir} is no train.py --env serve run ({saved.env_id})")
    env_kwargs = {k: v for k, v in saved.env.items() if k != "split"}
    cfg = replace(cfg, eval_every=cfg.eval_every or 1, eval_episodes=saved.run["eval_episodes"],
                  torch_threads=saved.run.get("torch_threads", 1))  # the run's cost model: timed per thread count
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(cfg.torch_threads)
    evaluate = ValidationEpisodes(env_kwargs, cfg.eval_episodes)
    try:
        references = json.loads((sb3_dir / "summary.json").read_text())["references"]
        fixed = fixed_policies(evaluate)
        differ = same_episodes(fixed, references)
        if differ or "best_fixed" not in references:
            raise RuntimeError(f"the validation episodes or their costs differ from {sb3_dir}'s: "
                               + "; ".join(f"{n}: {references[n]} there, {fixed[n]} here" for n in differ))
        checked = sorted(set(references) & set(fixed))
        report = train(cfg, env_kwargs, evaluate)
    finally:
        evaluate.close()
    sb3 = json.loads((sb3_dir / "evaluations.json").read_text())
    result = {
        "what": f"RLlib's {cfg.algo.upper()} (greedy) and SB3's DQN of train.py --env serve on the same validation "
                "episodes: mean return and speedup over target-only serving against env steps",
        "env_options": env_kwargs, "validation": {"seeds": evaluate.seeds, "loads": [e.config.load for e in evaluate.envs],
                                                  "same_as_sb3": checked,
                                                  "best_fixed": fixed["best_fixed"]},
        "references": {name: dict(zip(("return", "speedup"), reference_values(ref)))
                       for name, ref in references.items()},
        "sb3": {"run": str(sb3_dir), "algo": "dqn (agents.dqn.AllActionsDQN)", "train": saved.run | saved.hyperparams,
                "curve": sb3},
        "rllib": {"run": report["run_dir"], "config": {k: v for k, v in vars(cfg).items() if k not in ("compare", "out")},
                  "curve": report["evaluations"], "train_episode_return_mean": report["episode_return_mean"],
                  "wall_s": time.perf_counter() - t0},
        "machine": {"cpus": os.cpu_count(), "load_average_at_end": list(os.getloadavg())},
    }
    out = Path(cfg.out or Path(report["run_dir"]) / "rllib_vs_sb3.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(finite_json(result), indent=1) + "\n")
    plot_curves(result, out.with_suffix(".png"))
    return result


def plot_curves(result: dict, path: Path) -> None:
    """Validation return and speedup against env steps: SB3's DQN, RLlib, and the fixed policies' lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rllib = result["rllib"]["config"]["algo"].upper()
    for ax, key, label in ((axes[0], "return", "validation return"), (axes[1], "speedup", "speedup over target-only (x)")):
        for name, curve, style in (("SB3 DQN", result["sb3"]["curve"], "o-"), (f"RLlib {rllib}", result["rllib"]["curve"], "s-")):
            ax.plot([r["step"] for r in curve], [r[key] for r in curve], style, label=name)
        for name, ls, color in (("best_fixed", "--", "black"), ("off", ":", "grey"), ("batch_table", "-.", "green")):
            if name in result["references"]:
                ax.axhline(result["references"][name][key], ls=ls, lw=1.5, color=color, label=f"{name} (same episodes)")
        ax.set_xlabel("env steps")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    pair = result["env_options"].get("pair", "")
    fig.suptitle(f"BiLD-Serve-v0 ({pair}): greedy policies on the same validation episodes", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def flat_scalars(result: dict, prefix: str = "") -> dict[str, float]:
    """The finite numbers of RLlib's nested result dict, keyed ``env_runners/episode_return_mean`` etc."""
    out = {}
    for key, value in result.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flat_scalars(value, name + "/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[name] = float(value)
    return out


def default_run_name(cfg: RLlibConfig, env_kwargs: dict) -> str:
    pair = env_kwargs.get("pair", ServingConfig().pair)
    return f"{SERVE_ID}-{pair}__rllib-{cfg.algo}__{cfg.seed}__{int(time.time())}"


def _get(result: dict, path: str):
    for key in path.split("/"):
        if not isinstance(result, dict) or key not in result:
            return None
        result = result[key]
    return result


def _import_ray():
    try:
        import ray
        import ray.rllib  # noqa: F401
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return ray


def parse_args(argv: list[str] | None = None) -> tuple[RLlibConfig, dict]:
    parser = argparse.ArgumentParser(prog="python -m agents.rllib_serve", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, "rllib", RLlibConfig, RLlibConfig(), title="RLlib")
    add_ray_option(parser, "train")
    add_options(parser, "env", ServingConfig, preset_env("serve"), skip=ENV_NOT_CLI, title=SERVE_ID)
    namespace = parser.parse_args(argv)
    cfg = replace(RLlibConfig(), ray=namespace.ray, **given(namespace, "rllib"))
    env = given(namespace, "env")
    try:
        cfg.check()
        check_env(env)
    except ValueError as err:
        parser.error(str(err))
    return cfg, env


def check_env(env: dict) -> None:
    """The env options checked here, before Ray starts (a bad pair or device would else fail inside each env runner,
    as a stack trace from Ray's workers): ``bild_env.serving.config.validate`` and the pair preset's name."""
    from bild_env.models.pairs import get_preset
    from bild_env.serving.config import validate

    env_cfg = env_config(env)
    validate(env_cfg)
    if not env_cfg.pair_options.custom:
        get_preset(env_cfg.pair)  # a PairError naming the presets


def env_config(given: dict) -> ServingConfig:
    """The env options given on the command line over the ``serve`` preset, ``train.py --env serve``'s."""
    from bild_env.config import over

    return over(preset_env("serve"), given)


def main(argv: list[str] | None = None) -> int:
    cfg, env_kwargs = parse_args(argv)
    try:
        if cfg.compare:
            if env_kwargs:
                print(f"error: --compare trains on the run's env options; drop --{', --'.join(env_kwargs)}",
                      file=sys.stderr)
                return 2
            report = compare(cfg)
            print(json.dumps({k: report[k] for k in ("validation", "references")} | {
                "sb3_curve": report["sb3"]["curve"], "rllib_curve": report["rllib"]["curve"]}, indent=1))
            return 0
        report = train(cfg, env_config(env_kwargs).arguments())
    except ImportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(finite_json(report), indent=1))
    print(f"tensorboard --logdir {cfg.log_dir}")
    return 0


if __name__ == "__main__":  # run from the module's own name, so that Ray workers import it by that name
    from agents.rllib_serve import main as rllib_main

    from bild_env.command import run_command

    sys.exit(run_command("python -m agents.rllib_serve", rllib_main))
