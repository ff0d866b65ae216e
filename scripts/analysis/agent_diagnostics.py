"""The diagnostics behind the design note "The BiLD-v1 agent against the best fixed pair" (docs/notes/bild-v1-agent.md).

    python -m scripts.analysis.agent_diagnostics rules --split validation --prompts 50
    python -m scripts.analysis.agent_diagnostics noise logs/<run>/checkpoints/dqn_replay_buffer_<steps>_steps.pkl
    python -m scripts.analysis.agent_diagnostics lookahead --prompts 30
    python -m scripts.analysis.agent_diagnostics rollouts --train-prompts 128 --episodes 3 --target one-step
    python -m scripts.analysis.agent_diagnostics rollouts --train-prompts 128 --episodes 3 --target switch

``rules``: sixteen hand-written adaptive policies (fallback ``lo`` when the rich observation's recent
acceptance is above ``threshold``, else ``hi``; rollback 1.0) against the best single action (0.45, 1.0),
on the replay backend. ``noise``: per action, the number, mean and standard deviation of the per-step
rewards in a DQN replay buffer (what a Q-network has to separate).

``lookahead`` and ``rollouts`` restrict the actions to the five fallbacks at rollback 1.0 (nearly
lossless: every rollout stays on the prompt's cached greedy path, so thousands of rollouts take
seconds), around the best single action (0.45, 1.0):

* ``lookahead``: on validation prompts, the per-prompt oracle of those five fixed actions and the
  per-step hindsight oracle (at every step the action whose "this action, then (0.45, 1.0) to the
  end" return is highest, knowing that return).
* ``rollouts``: one step of policy improvement, learned. On training prompts, at every state of
  episodes that play (0.45, 1.0) or, half the time, a random one of the five, the advantage of each
  action over (0.45, 1.0) by exact rollouts on the replay trees (``one-step``: the action, then
  (0.45, 1.0); ``switch``: the action for the rest of the episode); a 128x128 MLP regresses the five
  advantages on the observation; the greedy policy (an action only where its predicted advantage
  exceeds a margin, else (0.45, 1.0)) is then played on validation prompts against (0.45, 1.0).
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import fields, replace

import numpy as np
import torch
from stable_baselines3.common.save_util import load_from_pkl

from tqdm import tqdm

from agents.spec import preset_env
from agents.bild.evaluation import Scripted, lookahead_returns, returns_on_prompts
from bild_env.env import BildEnv
from bild_env.replay.tree import MISSING, STRIDE

RECENT = 12  # index of "recent acceptance" in the rich observation


class Rule:
    def __init__(self, env: BildEnv, threshold: float, lo: float, hi: float) -> None:
        self.threshold, self.lo, self.hi = threshold, self.index(env, lo), self.index(env, hi)

    @staticmethod
    def index(env: BildEnv, fallback: float) -> int:
        cfg = env.config
        return cfg.actions.fallback_values.index(fallback) * len(cfg.actions.rollback_values) + cfg.actions.rollback_values.index(1.0)

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


FALLBACKS = (0.103, 0.25, 0.35, 0.45, 0.6)  # the candidates, each at rollback 1.0
BASE = (0.45, 1.0)


def main_job_env(split: str, prompts: int, observation: str = "context") -> BildEnv:
    """The main job's env (replay backend, 32 new tokens) on ``split``."""
    cfg = replace(preset_env("bild"), split=split, max_prompts=prompts, observation=observation)
    return BildEnv(**{f.name: getattr(cfg, f.name) for f in fields(cfg)})


def grid_index(env: BildEnv, fallback: float, rollback: float) -> int:
    cfg = env.config
    return cfg.actions.fallback_values.index(fallback) * len(cfg.actions.rollback_values) + cfg.actions.rollback_values.index(rollback)


def next_draft_p(env: BildEnv, obs: np.ndarray) -> np.ndarray:
    """``obs`` plus the draft's max probability for the next token and the one after (its own greedy chain),
    read from the replay tree (0.5 where the tree lacks it): what the next step's first draft forwards see."""
    runner, tree = env.runner, env.runner.tree
    extra = [0.5, 0.5]
    if tree is not None:
        node = runner.node_at(env.session.tokens)
        for j in range(2):
            if node is None or tree.d_arg[node] == MISSING:
                break
            extra[j] = tree.d_p[node]
            node = tree.children.get(node * STRIDE + tree.d_arg[node])
    return np.concatenate([obs, extra]).astype(np.float32)


FEATURES = {"none": lambda env, obs: obs, "next-draft-p": next_draft_p}


def play(env: BildEnv, prompt: int, actions: list[int], then: int, features=FEATURES["none"]):
    """Play ``actions`` then ``then`` to the end: the observation before each step and each step's reward."""
    obs, _ = env.reset(options={"prompt_index": prompt})
    observations, rewards = [features(env, obs)], []
    while True:
        t = len(rewards)
        obs, reward, terminated, truncated, _ = env.step(actions[t] if t < len(actions) else then)
        rewards.append(reward)
        if terminated or truncated:
            return observations, rewards
        observations.append(features(env, obs))


def lookahead(prompts: int) -> None:
    torch.set_num_threads(1)
    env = main_job_env("validation", prompts)
    cand, base = [grid_index(env, f, 1.0) for f in FALLBACKS], grid_index(env, *BASE)
    indices = list(range(prompts))
    fixed = np.array([returns_on_prompts(env, Scripted([], a), indices).returns for a in cand])
    hindsight = lookahead_returns(env, indices, base, cand)
    b = fixed[cand.index(base)]
    print(f"{prompts} validation prompts, return (minus {BASE}):")
    for f, r in zip(FALLBACKS, fixed):
        print(f"  fixed ({f}, 1.0): {r.mean():+.4f} ({(r - b).mean():+.4f})")
    print(f"  per-prompt oracle of the five: {fixed.max(0).mean():+.4f} ({(fixed.max(0) - b).mean():+.4f})")
    print(f"  per-step hindsight oracle: {hindsight.mean():+.4f} ({(hindsight - b).mean():+.4f})")


def rollouts(train_prompts: int, episodes: int, target: str, observation: str, val_prompts: int, seed: int,
             extra: str = "none") -> None:
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    env = main_job_env("train", train_prompts, observation)
    cand, base = [grid_index(env, f, 1.0) for f in FALLBACKS], grid_index(env, *BASE)
    horizon = env.config.max_new_tokens
    xs, ys = [], []
    for _ in range(episodes):
        for i in tqdm(range(train_prompts), desc="rollout advantages"):
            prefix: list[int] = []
            while True:
                observations, rewards = play(env, i, prefix, base, FEATURES[extra])
                s = len(prefix)
                if s >= len(rewards):
                    break
                returns = []
                for a in cand:
                    plan = prefix + ([a] if target == "one-step" else [a] * horizon)
                    returns.append(sum(play(env, i, plan, base)[1][s:]))
                xs.append(observations[s])
                ys.append(np.array(returns) - returns[cand.index(base)])
                prefix.append(base if rng.random() < 0.5 else int(rng.choice(cand)))
    x, y = torch.tensor(np.array(xs, np.float32)), torch.tensor(np.array(ys, np.float32))
    print(f"{len(x)} states; mean advantage per action {np.round(y.mean(0).numpy(), 4).tolist()} "
          f"(fallbacks {FALLBACKS}); per-state best {y.max(1).values.mean():+.4f}")
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                              torch.nn.ReLU(), torch.nn.Linear(128, len(cand)))
    optimizer = torch.optim.Adam(net.parameters(), 1e-3, weight_decay=1e-4)
    for _ in range(3000):
        batch = torch.randint(len(x), (256,))
        loss = ((net(x[batch]) - y[batch]) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        print(f"fit: RMSE {float(((net(x) - y) ** 2).mean().sqrt()):.4f} against a mean |advantage| of {float(y.abs().mean()):.4f}")
    val = main_job_env("validation", val_prompts, observation)

    def episode(prompt: int, margin: float | None) -> float:
        obs, _ = val.reset(options={"prompt_index": prompt})
        total = 0.0
        while True:
            action = base
            if margin is not None:
                with torch.no_grad():
                    q = net(torch.as_tensor(FEATURES[extra](val, obs))[None])[0].numpy()
                action = cand[int(q.argmax())] if q.max() > margin else base
            obs, reward, terminated, truncated, _ = val.step(action)
            total += reward
            if terminated or truncated:
                return total

    b = np.array([episode(i, None) for i in range(val_prompts)])
    print(f"{val_prompts} validation prompts: {BASE} returns {b.mean():+.4f}")
    for margin in (0.0, 0.002, 0.005, 0.01):
        d = np.array([episode(i, margin) for i in range(val_prompts)]) - b
        print(f"  learned, margin {margin}: {b.mean() + d.mean():+.4f}, minus {BASE} {d.mean():+.4f} "
              f"(95% interval +-{1.96 * d.std(ddof=1) / np.sqrt(len(d)):.4f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("rules")
    p.add_argument("--split", default="validation")
    p.add_argument("--prompts", type=int, default=50)
    sub.add_parser("noise").add_argument("buffer")
    sub.add_parser("lookahead").add_argument("--prompts", type=int, default=30)
    p = sub.add_parser("rollouts")
    p.add_argument("--train-prompts", type=int, default=128)
    p.add_argument("--episodes", type=int, default=3)
    p.add_argument("--target", choices=("one-step", "switch"), default="one-step")
    p.add_argument("--observation", default="context")
    p.add_argument("--val-prompts", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra", choices=tuple(FEATURES), default="none",
                   help="features added to the observation (next-draft-p: the draft's confidence for the next two tokens)")
    args = parser.parse_args()
    if args.what == "rules":
        rules(args.split, args.prompts)
    elif args.what == "noise":
        noise(args.buffer)
    elif args.what == "lookahead":
        lookahead(args.prompts)
    else:
        rollouts(args.train_prompts, args.episodes, args.target, args.observation, args.val_prompts, args.seed, args.extra)
