"""The paper's agent: SB3's DQN (experience replay, target network) with a 128 -> 128 MLP Q-network.

``AllActionsDQN`` is that DQN, plus one thing: when its vec env reports in ``info["peek"]`` what every
action would have done at the state just left (``BatchedReplayVecEnv(peek=True)``, from the replay
trees), it stores those transitions, one per action, instead of only the one taken. Q-learning is
off-policy, so the extra transitions are valid experience; they make every action's estimate come
from the same states, so that comparing two actions no longer carries the spread between states
(prompts, positions): per-step rewards spread by 0.018-0.037 where good actions differ by 0.001-0.005
(docs/notes/bild-v1-agent.md, "Why the agent does not beat the best fixed pair").
Without peeks it is SB3's DQN unchanged; its saved models load with ``DQN.load``.

With ``paired_actions`` a gradient step samples states, not transitions: each sampled state brings all its
actions' transitions (they lie together in the buffer), and the loss fits every action's Q-value there
against its own target at once. The rewards of a state's actions share most of their noise (the same
requests, the same drafts, accepted or not alike); fitted together, that common part moves every action's
estimate the same way and leaves their differences, what the greedy policy reads, to the differences of the
targets. Sampled one transition at a time, each action's estimate carries the noise of its own samples.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch as th
import torch.nn.functional as F
from stable_baselines3 import DQN
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.type_aliases import GymEnv

from agents.config import DQNConfig


class AllActionsDQN(DQN):
    """SB3's ``DQN`` that learns from every action at every visited state when the env reports them (module docstring)."""

    def __init__(self, *args, paired_actions: bool = False, **kwargs) -> None:
        self.paired_actions = bool(paired_actions)
        self._unpaired_rows = False  # set once a step was stored without peeks: the buffer no longer holds whole states
        super().__init__(*args, **kwargs)

    def _setup_model(self) -> None:
        super()._setup_model()
        if self.paired_actions:
            n, rows = int(self.action_space.n), self.replay_buffer.buffer_size
            if rows % n:
                raise ValueError(f"paired_actions needs a replay buffer of whole states: {rows} positions per env is "
                                 f"not a multiple of the {n} actions (size it with DQNConfig.sb3_kwargs)")

    def _store_transition(self, replay_buffer: ReplayBuffer, buffer_action: np.ndarray, new_obs: np.ndarray,
                          reward: np.ndarray, dones: np.ndarray, infos: list[dict[str, Any]]) -> None:
        peeks = [info.get("peek") for info in infos]
        if any(p is None for p in peeks) or self._vec_normalize_env is not None or isinstance(new_obs, dict):
            self._unpaired_rows = True
            return super()._store_transition(replay_buffer, buffer_action, new_obs, reward, dones, infos)
        obs, n_envs = self._last_obs, len(infos)
        next_obs, rewards, terminated = (np.stack([p[k] for p in peeks], axis=1) for k in range(3))  # actions x envs
        no_timeouts = [{} for _ in range(n_envs)]
        for a in range(len(next_obs)):  # the taken action's transition is one of these
            replay_buffer.add(obs, next_obs[a], np.full((n_envs, 1), a), rewards[a], terminated[a], no_timeouts)
        self._last_original_obs = obs
        self._last_obs = new_obs

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        if not getattr(self, "paired_actions", False):
            return super().train(gradient_steps, batch_size)
        if getattr(self, "_unpaired_rows", False):
            raise RuntimeError("paired_actions: a step was stored without every action's peek (info['peek']), so the "
                               "replay buffer no longer holds whole states; train on an env wrapped in PeekAll "
                               "(or BatchedReplayVecEnv(peek=True)), or with --hyperparams paired_actions=false")
        self.policy.set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        losses = []
        for _ in range(gradient_steps):
            obs, next_obs, rewards, dones = self.sample_states(batch_size)
            with th.no_grad():
                b, n = rewards.shape
                next_q = self.q_net_target(next_obs.reshape(b * n, -1)).max(dim=1).values.reshape(b, n)
                target = rewards + (1 - dones) * self.gamma * next_q
            loss = F.smooth_l1_loss(self.q_net(obs), target)
            losses.append(loss.item())
            self.policy.optimizer.zero_grad()
            loss.backward()
            th.nn.utils.clip_grad_norm_(self.policy.parameters(), self.max_grad_norm)
            self.policy.optimizer.step()
        self._n_updates += gradient_steps
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/loss", np.mean(losses))

    def sample_states(self, batch_size: int) -> tuple[th.Tensor, th.Tensor, th.Tensor, th.Tensor]:
        """``batch_size`` stored states (uniformly, with replacement) with every action's transition from each:
        observations (B, obs), next observations (B, n, obs), rewards and terminations (B, n), as tensors."""
        buf, n = self.replay_buffer, int(self.action_space.n)
        states = (buf.buffer_size if buf.full else buf.pos) // n
        if states < 1:
            raise RuntimeError("paired_actions: the replay buffer holds no whole state yet")
        start = np.random.randint(0, states, size=batch_size) * n
        env = np.random.randint(0, buf.n_envs, size=batch_size)
        rows, cols = start[:, None] + np.arange(n), env[:, None]
        if not np.array_equal(buf.actions[rows, cols].reshape(batch_size, n), np.broadcast_to(np.arange(n), (batch_size, n))):
            raise RuntimeError("paired_actions: the replay buffer's rows are not whole states in action order")
        return (buf.to_torch(buf.observations[start, env]).float(),
                buf.to_torch(buf.next_observations[rows, cols]).float(),
                buf.to_torch(buf.rewards[rows, cols]).float(),
                buf.to_torch(buf.dones[rows, cols]).float())


def make_dqn(env: GymEnv, config: DQNConfig | None = None, seed: int | None = None, device: str = "cpu",
             verbose: int = 0) -> DQN:
    """A fresh ``AllActionsDQN("MlpPolicy", env, ...)`` with every hyperparameter from ``config`` (default ``DQNConfig()``).

    The Q-network maps the observation to one Q-value per action (25 with the default grids).
    Logging is set by the caller (``model.set_logger``), so no ``tensorboard_log`` is given here.
    """
    config = config or DQNConfig()
    n_envs = getattr(env, "num_envs", 1)  # a VecEnv steps several envs at once
    n_actions = env.action_space.n if getattr(env, "peek", False) else 1  # transitions stored per env step
    return AllActionsDQN("MlpPolicy", env, seed=seed, device=device, verbose=verbose,
                         **config.sb3_kwargs(n_envs, n_actions))


class QEnsemble:
    """Several DQNs trained on the same env (seeds) acting as one: the action with the highest mean Q-value over
    the members. Each member's Q-network errs by its own noise where good actions differ by little; their mean
    errs less (an SB3-style policy: ``predict(observation, state, episode_start, deterministic)``)."""

    def __init__(self, models: list) -> None:
        if len(models) < 2:
            raise ValueError(f"QEnsemble needs at least two DQN models, got {len(models)}")
        first = models[0]  # spaces compared as spaces: a Box unpickled from an older gymnasium prints otherwise
        if not all(hasattr(m, "q_net") and m.observation_space == first.observation_space
                   and m.action_space == first.action_space for m in models):
            raise ValueError("QEnsemble's members must be DQNs with the same observation and action spaces, "
                             f"got {sorted({(str(m.observation_space), str(m.action_space)) for m in models})}")
        self.models = list(models)

    def q_values(self, observation) -> tuple[np.ndarray, bool]:
        """Mean Q-value per action, (n_envs, n_actions) (one row for a single observation), and whether
        ``observation`` was a batch (SB3's ``obs_to_tensor``)."""
        import torch

        obs, vectorized = self.models[0].policy.obs_to_tensor(observation)
        with torch.no_grad():
            return torch.stack([m.q_net(obs) for m in self.models]).mean(0).cpu().numpy(), vectorized

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        q, vectorized = self.q_values(observation)
        actions = q.argmax(axis=1)
        return (actions if vectorized else actions[0]), state


def q_ensemble(members: list) -> QEnsemble | None:
    """``members`` (tuples ending in ``(model, key)``, the key what the model acts in: its env's config, its grid) as
    one ``QEnsemble`` where there are several DQNs of one key; else None."""
    if len(members) < 2 or not all(hasattr(m, "q_net") and k == members[0][-1] for *_, m, k in members):
        return None
    return QEnsemble([m for *_, m, _ in members])
