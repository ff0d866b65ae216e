"""RLlib's PPO (or DQN) on ``BiLD-Serve-v0`` with several env runners, its metrics in TensorBoard (``pip install -e ".[cluster]"``).

    python -m agents.rllib_serve --pair tiny-random --iterations 5                   # a local Ray instance, minutes on a CPU
    python -m agents.rllib_serve --pair smollm2 --env-runners 8 --iterations 200 --ray auto   # a cluster
    tensorboard --logdir logs

The example for RL users who scale out with RLlib rather than Stable-Baselines3 (``train.py --env
serve`` steps its envs in one process). RLlib makes each env runner's env from the registered id
(``bild_env:BiLD-Serve-v0``: Gymnasium imports ``bild_env``, which registers it) with the
``BiLD-Serve-v0`` options given here (every field of ``ServingConfig``, as ``train.py --env serve``
takes them), on the replay backend (the serving env's only one): each runner process fills and reads
the pair's trees in the shared store. Each iteration's metrics (RLlib's ``env_runners/``,
``learners/`` and timing keys, numbers only) go to ``<log_dir>/<run_name>/`` as TensorBoard
scalars, beside train.py's runs; the final algorithm is saved to ``<run_dir>/checkpoint``
(``Algorithm.from_checkpoint``). RLlib's new API stack (RLModule, Learner, EnvRunner) throughout.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from bild_env.cli import add_options, finite_json, given
from bild_env.ids import SERVE_ID
from bild_env.serving.env import ServingConfig

INSTALL_HINT = 'agents.rllib_serve needs the cluster extra (RLlib): pip install -e ".[cluster]"'
ALGOS = ("ppo", "dqn")
ENV_NOT_CLI = ("split",)  # the runners train on "train"


@dataclass(frozen=True)
class RLlibConfig:
    """Options of the RLlib run (the env's are ``ServingConfig``'s)."""

    algo: str = "ppo"  # ppo | dqn (RLlib's, new API stack)
    iterations: int = 10  # Algorithm.train() calls
    env_runners: int = 2  # Ray actors stepping envs (one process each)
    envs_per_runner: int = 1  # envs each runner steps
    train_batch: int = 256  # env steps per training iteration (PPO: train_batch_size_per_learner; DQN: sampled at least)
    minibatch: int = 64  # PPO's SGD minibatch
    epochs: int = 4  # PPO's passes over each batch
    lr: float = 3e-4  # learning rate
    gamma: float = 0.99  # discount
    seed: int = 0  # RLlib's seed (env runners, RLModule)
    log_dir: str = "logs"  # the run is written to <log_dir>/<run_name>/
    run_name: str | None = None  # default: BiLD-Serve-v0-<pair>__rllib-<algo>__<seed>__<unix time>
    ray: str | None = field(default=None, metadata={"cli": False})  # None or "local": a new local Ray instance; else ray.init's address

    def check(self) -> None:
        if self.algo not in ALGOS:
            raise ValueError(f"--algo must be one of {ALGOS}, got {self.algo!r}")
        for name in ("iterations", "env_runners", "envs_per_runner", "train_batch", "minibatch", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")


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


def train(cfg: RLlibConfig, env_kwargs: dict) -> dict:
    """Build the algorithm, run ``cfg.iterations`` iterations with their metrics in TensorBoard, save it; returns each
    iteration's mean episode return (NaN before an episode ended) and the run folder."""
    ray = _import_ray()
    started = not ray.is_initialized()
    if started:
        ray.init(address=None if cfg.ray in (None, "local") else cfg.ray, include_dashboard=False)
    run_dir = Path(cfg.log_dir) / (cfg.run_name or default_run_name(cfg, env_kwargs))
    from torch.utils.tensorboard import SummaryWriter

    algo = algo_config(cfg, env_kwargs).build_algo()
    returns = []
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
        checkpoint = algo.save_to_path(str((run_dir / "checkpoint").resolve()))
    finally:
        algo.stop()
        if started:
            ray.shutdown()
    return {"run_dir": str(run_dir), "checkpoint": str(checkpoint), "episode_return_mean": returns}


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
    parser.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                        help="the Ray cluster ('auto': the one `ray start` runs here; default: a new local Ray instance)")
    add_options(parser, "env", ServingConfig, ServingConfig(), skip=ENV_NOT_CLI, title=SERVE_ID)
    namespace = parser.parse_args(argv)
    cfg = replace(RLlibConfig(), ray=namespace.ray, **given(namespace, "rllib"))
    try:
        cfg.check()
    except ValueError as err:
        parser.error(str(err))
    return cfg, given(namespace, "env")


def main(argv: list[str] | None = None) -> int:
    cfg, env_kwargs = parse_args(argv)
    try:
        report = train(cfg, env_kwargs)
    except ImportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(finite_json(report), indent=1))
    print(f"tensorboard --logdir {cfg.log_dir}")
    return 0


if __name__ == "__main__":  # run from the module's own name, so that Ray workers import it by that name
    from agents.rllib_serve import main as rllib_main

    sys.exit(rllib_main())
