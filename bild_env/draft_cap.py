"""``actions={"max_draft_len": "auto"}`` (BiLD-v1): the longest draft run chosen when the env is made, from the costs
it charges.

What a draft token is worth depends on the machine more than on the pair: where the draft's forward costs half the
target's (the real pair in bfloat16 on a Xeon, ``xeon-amx-qwen2.5-coder-bf16``), a long run of confident draft tokens
costs more than the target saves, and the cap is worth more than any threshold (results claim 53); where the draft is
nearly free, long runs pay. So the cap is not fixed: each of ``CANDIDATES`` (up to what the env's decoding dataset
recorded) is tried on the validation split, every discrete action held fixed for whole episodes under the env's own
cost model and reward, and the cap of the best (action, cap) is kept (the smaller on a tie). The agent then acts
under that cap; the test split is never read. Replayed, this takes a fraction of a second a cap; each process
chooses once per configuration (``_CHOSEN``), so the envs of a vector env and the evaluation env agree.
"""

from __future__ import annotations

import logging
from dataclasses import fields, replace

import numpy as np

AUTO = "auto"
CANDIDATES = (1, 2, 3, 4, 5, 6, 8, 10)
_CHOSEN: dict[str, tuple[int, dict[int, float]]] = {}
logger = logging.getLogger(__name__)


def check_auto(cfg) -> None:
    """Refuse ``max_draft_len="auto"`` where it cannot be chosen cheaply (a ValueError saying what to give)."""
    if cfg.backend != "replay":
        raise ValueError('max_draft_len="auto" is chosen by replaying the validation split under every cap: it needs '
                         'backend="replay" (the default); on backend="live" give an integer')
    if cfg.actions.space != "discrete":
        raise ValueError('max_draft_len="auto" compares the discrete actions held fixed: it needs space="discrete"; '
                         "with continuous actions give an integer")


def candidates(recorded: int | None) -> tuple[int, ...]:
    """The caps tried: ``CANDIDATES`` up to ``recorded`` (the decoding dataset's own cap, where it replays one)."""
    return tuple(k for k in CANDIDATES if recorded is None or k <= recorded)


def choose_draft_cap(env) -> tuple[int, dict[int, float]]:
    """(the cap, {cap: the best fixed action's mean validation return}) for BiLD-v1 ``env`` made with
    ``max_draft_len="auto"``; said once per configuration in a process."""
    cfg = env.config
    key = repr(replace(cfg, split="validation", replay_store=None))
    if key in _CHOSEN:
        return _CHOSEN[key]
    dataset = getattr(env.pair, "dataset", None)
    caps = candidates(dataset.manifest["max_draft_len"] if dataset is not None else None)
    kwargs = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    twin = type(env)(**kwargs | {"split": "validation", "cost_model": env.cost_model, "cost_profile": None,
                                 "actions": replace(cfg.actions, max_draft_len=caps[-1])})
    best: dict[int, float] = {}
    for cap in caps:
        twin.config.actions = replace(twin.config.actions, max_draft_len=cap)  # read by each reset
        best[cap] = max(np.mean([_return(twin, a, p) for p in range(len(twin.prompts))])
                        for a in range(twin.action_space.n))
    twin.close()
    chosen = max(best, key=lambda k: (best[k], -k))
    logger.warning(f'max_draft_len="auto": {chosen} (of {list(caps)}), the cap whose best fixed action returned most '
                   f"on the {len(twin.prompts)} validation prompts under {env.charged}'s costs "
                   f"({', '.join(f'{k}: {v:.3f}' for k, v in best.items())})")
    _CHOSEN[key] = chosen, best
    return chosen, best


def _return(env, action: int, prompt: int) -> float:
    env.reset(options={"prompt_index": prompt})
    total, done = 0.0, False
    while not done:
        _, reward, terminated, truncated, _ = env.step(action)
        total, done = total + float(reward), terminated or truncated
    return total
