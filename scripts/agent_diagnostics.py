"""Two diagnostics behind README's "Why the agent does not beat the best fixed pair".

    python scripts/agent_diagnostics.py rules --split validation --prompts 50
    python scripts/agent_diagnostics.py noise logs/<run>/checkpoints/dqn_replay_buffer_<steps>_steps.pkl

``rules``: sixteen hand-written adaptive policies (fallback ``lo`` when the rich observation's recent
acceptance is above ``threshold``, else ``hi``; rollback 1.0) against the best single action (0.45, 1.0),
on the replay backend. ``noise``: per action, the number, mean and standard deviation of the per-step
rewards in a DQN replay buffer (what a Q-network has to separate).
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import torch
from stable_baselines3.common.save_util import load_from_pkl

from agents.evaluation import returns_on_prompts
from bild_env.env import BildEnv

RECENT = 12  # index of "recent acceptance" in the rich observation


class Rule:
    def __init__(self, env: BildEnv, threshold: float, lo: float, hi: float) -> None:
        self.threshold, self.lo, self.hi = threshold, self.index(env, lo), self.index(env, hi)

    @staticmethod
    def index(env: BildEnv, fallback: float) -> int:
        cfg = env.config
        return cfg.fallback_values.index(fallback) * len(cfg.rollback_values) + cfg.rollback_values.index(1.0)

    def predict(self, observation, state=None, episode_start=None, deterministic=True):
        return np.int64(self.lo if observation[RECENT] > self.threshold else self.hi), state


def rules(split: str, prompts: int) -> None:
    torch.set_num_threads(1)
    env = BildEnv(backend="replay", split=split, max_prompts=prompts, max_new_tokens=32, observation="rich")
    indices = list(range(len(env.prompts)))
    base = returns_on_prompts(env, Rule(env, 2.0, 0.45, 0.45), indices).returns  # never above 2: always 0.45
    print(f"best single action (0.45, 1.0): {base.mean():+.4f} on {len(indices)} {split} prompts")
    for threshold, lo, hi in itertools.product((0.4, 0.5, 0.6, 0.7), (0.25, 0.35), (0.45, 0.6)):
        r = returns_on_prompts(env, Rule(env, threshold, lo, hi), indices).returns
        print(f"recent acceptance > {threshold}: fallback {lo}, else {hi}: {r.mean():+.4f} ({r.mean() - base.mean():+.4f})")


def noise(buffer_path: str) -> None:
    buffer = load_from_pkl(buffer_path)
    n = buffer.buffer_size if buffer.full else buffer.pos
    actions, rewards = buffer.actions[:n].reshape(-1), buffer.rewards[:n].reshape(-1)
    for a in np.unique(actions):
        r = rewards[actions == a]
        print(f"action {int(a):2d}: {len(r):5d} steps, mean reward {r.mean():+.4f}, std {r.std():.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("rules")
    p.add_argument("--split", default="validation")
    p.add_argument("--prompts", type=int, default=50)
    sub.add_parser("noise").add_argument("buffer")
    args = parser.parse_args()
    rules(args.split, args.prompts) if args.what == "rules" else noise(args.buffer)
