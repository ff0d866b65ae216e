"""What a serving run is judged by while it trains (``train.py --env serve``): the greedy agent on fixed validation
episodes every ``--eval-freq`` steps (``ServingEval``), beside the rules run once on those episodes at the start
(``rule_references``), drawn together in TensorBoard's custom-scalars tab "serving" (``custom_scalars``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback

from agents.common.files import write_atomic
from agents.common.folders import save_best_model
from agents.common.logs import STEP_KEY
from agents.serve.progress import counting, episodes
from agents.serve.rules import BatchTable, TableGuard, dqn_q_values, returns_of
from agents.serve.run_report import episode_stats, reference_values
from agents.serve.selection import (FLOOR_MARGINS, batch_table_from, best_per_level, fixed_returns,
                                    keep_where_it_helps, off_and_on)
from bild_env.serving.env import ServingConfig, ServingEnv
from bild_env.serving.load import LoadProfile


def validation_seeds(episodes: int) -> list[int]:
    """The seeds of a serving run's validation episodes (``train.py --env serve``'s, RLlib's, the offline rule's)."""
    return [10_000 + i for i in range(episodes)]


def fixed_name(action) -> str:
    """How a run's tables name a fixed action: ``off``, ``tree <rule>``, ``fixed_<fallback>_<rollback>``."""
    return action.name or f"fixed_{action.fallback:g}_{action.rollback:g}"


def default_references(env: ServingEnv) -> tuple[int, ...]:
    """The grid's actions with fallback 0.45 and rollback 0.5 or 1 (BiLD-v1's best fixed pairs on smollm2)."""
    return tuple(a for a in range(env.n_grid) if env.thresholds(a) in ((0.45, 0.5), (0.45, 1.0)))

class ServingEval(BaseCallback):
    """Every ``freq`` steps: the greedy agent on fixed validation seeds, beside fixed policies run once on them."""

    def __init__(self, envs: list[ServingEnv], seeds: list[int], freq: int, references: dict[str, dict],
                 run_dir: Path) -> None:
        super().__init__()
        self.envs, self.seeds, self.freq, self.references, self.run_dir = envs, seeds, freq, references, run_dir
        self.best = -np.inf
        self.history: list[dict] = []
        self.next_at = freq

    def _on_step(self) -> bool:
        if self.freq and self.num_timesteps >= self.next_at:
            self.next_at += self.freq
            self.evaluate()
        return True

    longest_s = 0.0  # the longest evaluation so far, in seconds (what finishing a run takes: ``TimeBudget``)

    def evaluate(self) -> dict:
        t0 = time.perf_counter()
        returns, speedups = returns_over(self.envs, self.model, self.seeds)
        row = {"step": self.num_timesteps} | episode_stats(returns, speedups)
        self.history.append(row)
        self.logger.record(STEP_KEY, self.num_timesteps)  # every progress.csv row says its step (resume keeps rows by it)
        self.logger.record("eval/mean_reward", row["return"])
        self.logger.record("serving/agent_speedup_x", row["speedup"])
        self.logger.record("serving/agent_return", row["return"])
        for name, ref in self.references.items():
            ret, speed = reference_values(ref)
            self.logger.record(f"serving/{name}_speedup_x", speed)
            self.logger.record(f"serving/{name}_return", ret)
        self.logger.dump(self.num_timesteps)
        if row["return"] > self.best:
            self.best = row["return"]
            save_best_model(self.model, self.run_dir, row["return"])  # a copy under checkpoints/, then best_model.zip
        write_evaluations(self.run_dir, self.history)
        self.longest_s = max(self.longest_s, time.perf_counter() - t0)
        return row


def write_evaluations(run_dir: Path, history: list[dict]) -> None:
    """``evaluations.json``: every evaluation so far (step, return, speedup, return_ci), standard JSON, written whole."""
    text = json.dumps(history, indent=1, allow_nan=False) + "\n"
    write_atomic(run_dir / "evaluations.json", lambda f: f.write(text.encode()))


def rule_references(envs: list[ServingEnv], seeds: list[int], extra: tuple[int, ...],
                    progress=None) -> dict[str, dict]:
    """What the agent is drawn beside, on the validation episodes (``run_report.episode_stats``: the mean return and
    speedup over the episodes, with their intervals): every fixed action is run once;
    ``best_fixed`` is the one with the best mean over the envs (grid search), ``load_table`` the best per env (load
    level), both chosen on these same episodes (a line for the agent to reach, not an estimate of either rule on
    new episodes: ``python evaluate.py --env serve`` chooses on validation and judges on test); ``batch_table`` the
    action per batch-size bucket (``agents.serve.selection.batch_table_from``, each env a level; without the off
    switch the best fixed action stands for off), chosen on the same episodes; plus "off" and the ``extra`` fixed
    actions. ``progress`` (a tqdm-like bar, optional) is advanced by one per episode run, as it ends."""
    env, levels = envs[0], dict(enumerate(envs))
    if progress is not None:
        progress.total = (progress.total or 0) + len(envs) * len(seeds) * (env.action_space.n + 2)
    with counting(progress):
        runs = {i: fixed_returns(e, seeds) for i, e in levels.items()}  # {env: {action: (returns, speedups)}}
        grid = list(runs[0])
        off, on, mean = off_and_on(env, grid, runs, best_off=True)
        table = best_per_level(runs)
        buckets, _, _ = batch_table_from(levels, table, seeds, grid, off, on, announce=None if progress is None
                                         else lambda n: setattr(progress, "total", progress.total + n))
        rule = BatchTable(buckets, off, env.config.max_batch, env.config.observe.batch_scale)
        batch = [episodes(e, rule, seeds)[:2] for e in envs]

    def summary(parts) -> dict:
        return episode_stats(np.concatenate([r for r, _ in parts]), np.concatenate([s for _, s in parts]))

    best = max(mean, key=mean.get)
    out = {"best_fixed": summary([runs[i][best] for i in runs]),
           "load_table": summary([runs[i][a] for i, a in table.items()]),
           "batch_table": summary(batch) | {"table": {str(k): int(a) for k, a in buckets.items()},
                                            "off": int(off)}}  # the rule itself (``table_rule``)
    trees = tuple(range(env.first_tree, env.action_space.n))  # every tree rule's row, where the env has them
    for a in dict.fromkeys(((env.n_grid,) if env.config.actions.off_switch else ()) + trees + tuple(extra)):
        out[fixed_name(env.decode(a))] = summary([runs[i][a] for i in runs])
    return out


def table_rule(reference: dict, env: ServingEnv) -> BatchTable:
    """The per-batch-size table a run's ``rule_references`` chose (its ``batch_table`` entry), to act in ``env``."""
    return BatchTable({int(k): a for k, a in reference["table"].items()}, reference["off"], env.config.max_batch,
                      env.config.observe.batch_scale)


def choose_floor(envs: list[ServingEnv], seeds: list[int], model, reference: dict) -> dict:
    """The agent ``model`` (a DQN) on the run's per-batch-size table's floor: ``TableGuard`` over the table, its margin
    kept by ``agents.serve.selection.keep_where_it_helps`` on the validation episodes ``seeds`` of ``envs`` (``inf``,
    the table itself, unless a margin's gain clears its interval); with the floored agent's episode statistics."""
    env = envs[0]
    identity = {a: a for a in range(env.action_space.n)}
    guards = {m: [TableGuard(dqn_q_values(model), table_rule(reference, e), identity, m) for e in envs]
              for m in FLOOR_MARGINS}
    runs = {m: [returns_of(e, g, seeds)[:2] for e, g in zip(envs, guards[m])] for m in FLOOR_MARGINS}
    flat = {m: np.concatenate([r for r, _ in parts]) for m, parts in runs.items()}
    kept = keep_where_it_helps(flat.pop(np.inf), flat)
    parts = runs[kept["margin"]]
    return kept | episode_stats(np.concatenate([r for r, _ in parts]), np.concatenate([s for _, s in parts]))


eval_loads = LoadProfile.level_loads  # the loads validation runs at: each level of a ``levels:`` profile apart


def validation_envs(arguments: dict) -> list[ServingEnv]:
    """The envs a serving run validates on (``train.py --env serve``'s evaluations, its floor, RLlib's and the offline
    agents'), for the env ``arguments`` (``ServingConfig.arguments()``): the "validation" split, one env per load of
    ``eval_loads``."""
    load = arguments.get("load", ServingConfig().load)
    return [ServingEnv(**arguments | {"split": "validation", "load": one}) for one in eval_loads(load)]


def returns_over(envs: list[ServingEnv], policy, seeds: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Returns and speedups of ``policy`` on every env's episodes of ``seeds``, together."""
    parts = [returns_of(env, policy, seeds)[:2] for env in envs]
    return np.concatenate([r for r, _ in parts]), np.concatenate([s for _, s in parts])

def custom_scalars(run_dir: Path, references: list[str]) -> None:
    """TensorBoard's custom-scalars layout: the agent beside the fixed policies, one chart per quantity."""
    from torch.utils.tensorboard import SummaryWriter

    layout = {"serving": {  # best_fixed, load_table and batch_table: chosen on the same validation episodes
        "speedup over target-only serving at the same load (x)": [
            "Multiline", ["serving/agent_speedup_x"] + [f"serving/{r}_speedup_x" for r in references]],
        "validation return (time saved in single-request units, minus regret)": [
            "Multiline", ["serving/agent_return"] + [f"serving/{r}_return" for r in references]],
    }}
    with SummaryWriter(str(run_dir)) as writer:
        writer.add_custom_scalars(layout)
