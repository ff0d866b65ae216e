"""The decoding methods ``evaluate.py`` compares on BiLD-v1, each a function of a prompt index giving a ``Row``
(latency, model time, tokens, acceptance, reward): the decoders (target only, naive SD with its chosen ``k``, BiLD,
the adaptive ones, Hugging Face's assisted generation), and policies of the env (the agent, fixed thresholds, the
grid search's best pair, the bandits).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from agents.bild.rollout import run_episode
from bild_env import generate_speculative
from bild_env.decoding.decoders import generate_hf_assisted, parse_adaptive
from bild_env.env import BildEnv

K_CHOICES = (1, 2, 3, 4, 6, 8)  # draft lengths naive SD is tried with when --k is not given


# -- one method on one prompt --------------------------------------------------------------------
@dataclass
class Row:
    method: str
    prompt_index: int
    latency_ms: float  # wall clock, per sentence
    model_ms: float | None  # cost model, per sentence
    new_tokens: int
    proposed: int
    accepted: int
    target_forwards: int
    new_ids: list[int] = field(repr=False)
    reward: float | None = None
    thresholds: list[tuple[float, float]] = field(default_factory=list, repr=False)
    regret: float | None = None  # nats, summed over the output (None: not read, e.g. HF assisted)
    mismatches: int | None = None  # output tokens that differ from the target's argmax where they were verified


def decoder_method(env: BildEnv, name: str, fn: Callable) -> Callable[[int], Row]:
    def run(i: int) -> Row:
        g = fn(env.prompts[i])
        s = g.stats
        return Row(name, i, s.wall_ms, s.model_ms, s.new_tokens, s.proposed, s.accepted, s.target_forwards, g.new_ids,
                   regret=s.regret, mismatches=s.mismatches)
    return run


def choose_k(env: BildEnv, cost, out: Path, progress_bar: bool) -> int:
    """Naive SD's draft length: the k of ``K_CHOICES`` with the least cost-model time on ``env``'s prompts.

    Naive SD is exact, so time is all that differs; the cost model makes the choice deterministic
    (wall clock on a few prompts is noisy). The times are saved to ``out/naive_sd_k.json``.
    """
    times = {}
    for k in tqdm(K_CHOICES, desc="naive SD draft length", disable=not progress_bar):
        gens = [generate_speculative(env.pair, p, k, env.config.max_new_tokens, cost) for p in env.prompts]
        times[k] = sum(g.stats.model_ms for g in gens) / sum(g.stats.new_tokens for g in gens)
    best = min(times, key=times.get)
    (out / "naive_sd_k.json").write_text(json.dumps({"cost_model_ms_per_token": times, "chosen": best}, indent=2) + "\n")
    return best


def adaptive_methods(env: BildEnv, adaptive: str, cost) -> dict[str, Callable[[int], Row]]:
    """Naive SD's adaptive length (``"K:F"``, ``bild_env.decoding.decoders.parse_adaptive``) as a row; {} for ""."""
    if not adaptive:
        return {}
    k, f = parse_adaptive(adaptive)
    name = f"naive SD (k<={k}, stop<{f})"
    return {name: decoder_method(env, name, lambda p: generate_speculative(env.pair, p, k, env.config.max_new_tokens,
                                                                           cost, confidence=f))}


def hf_assisted_method(env: BildEnv) -> Callable[[int], Row]:
    """``target.generate(assistant_model=draft)`` with transformers' defaults; target forwards counted by a hook."""
    def run(i: int) -> Row:
        out = generate_hf_assisted(env.pair, env.prompts[i], env.config.max_new_tokens)
        stats = out.stats
        return Row("HF assisted", i, stats.wall_ms, None, len(out.new_ids), 0, 0, stats.target_forwards, out.new_ids)
    return run


def policy_method(env: BildEnv, name: str, policy) -> Callable[[int], Row]:
    """BiLD in the env (wrapped or not) driven by ``policy``; latency = decoding wall time + the policy's own time."""
    base = env.unwrapped

    def run(i: int) -> Row:
        ep = run_episode(env, policy, prompt_index=i)
        if ep.error is not None:
            raise RuntimeError(f"{name} on prompt {i}: {ep.error}")
        s = base.session.total
        return Row(name, i, s.wall_ms + ep.policy_ms, s.model_ms, s.new_tokens, s.proposed, s.accepted,
                   s.target_forwards, list(base.session.new_ids), ep.episode_return,
                   [base.shown_thresholds(a) for a in ep.actions], s.regret, s.mismatches)
    return run

