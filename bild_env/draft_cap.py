"""``actions={"max_draft_len": "auto"}``: the longest draft run chosen when the env is made, from the costs it charges.

What a draft token is worth depends on the machine more than on the pair: where the draft's forward costs half the
target's (the real pair in bfloat16 on a Xeon, ``xeon-amx-qwen2.5-coder-bf16``), a long run of confident draft tokens
costs more than the target saves, and the cap is worth more than any threshold (results claims 53-56); where the draft
is nearly free, long runs pay. So the cap is not fixed: ``CANDIDATES`` (up to what the env's decoding dataset
recorded) are tried on the validation split from the shortest up, until two in a row return less than the best so
far, every discrete action held fixed for whole episodes under the env's own cost model and reward, and the cap whose
best fixed action returns most is kept (the smaller on a tie). BiLD-v1 runs one episode per validation prompt;
BiLD-Serve-v0 ``SERVE_EPISODES`` episodes of up to ``SERVE_STEPS`` steps at each level of its load profile (as a
constant load; a profile of another kind as it is), the best fixed action taken per level (the per-load table's
return). The agent then acts under that cap; the test split is never read. Replayed, this takes seconds (BiLD-v1) to a
minute (BiLD-Serve-v0 with batches of 32); each process chooses once per configuration (``_CHOSEN``), so the envs of a
vector env agree.
"""

from __future__ import annotations

import logging
from dataclasses import fields, replace

import numpy as np

AUTO = "auto"
CANDIDATES = (1, 2, 3, 4, 5, 6, 8, 10)
SERVE_EPISODES = tuple(range(1000, 1004))  # BiLD-Serve-v0's validation episodes a level (the rules' seeds, 1000+)
SERVE_STEPS = 64  # and their length at most (evaluate.py --env serve's quick validation)
_CHOSEN: dict[str, tuple[int, dict[int, float]]] = {}
logger = logging.getLogger(__name__)


def check_max_draft_len(cfg) -> None:
    """Either env's ``actions.max_draft_len``: an integer >= 1, or ``"auto"`` where it can be chosen (``check_auto``);
    a ValueError saying what to give otherwise."""
    v = cfg.actions.max_draft_len
    if v == AUTO:
        check_auto(cfg)
    elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f'max_draft_len must be an integer >= 1 or "auto" (chosen on the validation split), got {v!r}')


def check_auto(cfg) -> None:
    """Refuse ``max_draft_len="auto"`` where it cannot be chosen cheaply (a ValueError saying what to give)."""
    if getattr(cfg, "backend", "replay") != "replay":
        raise ValueError('max_draft_len="auto" is chosen by replaying the validation split under every cap: it needs '
                         'backend="replay"; on backend="live" give an integer')
    if cfg.actions.space != "discrete" or getattr(cfg.actions, "per_domain", False):
        raise ValueError('max_draft_len="auto" compares the discrete actions held fixed: it needs space="discrete" '
                         "(and no per_domain actions); otherwise give an integer")
    if getattr(getattr(cfg, "charging", None), "train_profiles", ()):
        raise ValueError('max_draft_len="auto" is chosen under the costs the env charges: with train_profiles each '
                         "episode draws other costs; give an integer")


def candidates(recorded: int | None) -> tuple[int, ...]:
    """The caps tried: ``CANDIDATES`` up to ``recorded`` (the decoding dataset's own cap, where it replays one)."""
    return tuple(k for k in CANDIDATES if recorded is None or k <= recorded)


def choose_draft_cap(env) -> tuple[int, dict[int, float]]:
    """(the cap, {cap: the best fixed action's mean validation return, averaged over the loads}) for ``env`` (either
    env) made with ``max_draft_len="auto"``; said once per configuration in a process."""
    cfg = env.config
    key = repr(replace(cfg, split="validation", replay_store=None))
    if key in _CHOSEN:
        return _CHOSEN[key]
    dataset = getattr(env.pair, "dataset", None)
    caps = candidates(dataset.manifest["max_draft_len"] if dataset is not None else None)
    kwargs = {f.name: getattr(cfg, f.name) for f in fields(cfg)} | {
        "split": "validation", "cost_model": env.cost_model, "cost_profile": None,
        "actions": replace(cfg.actions, max_draft_len=caps[-1])}
    runs = env._cap_runs(kwargs)  # [(a validation twin, the reset arguments of its episodes)], a load each
    best: dict[int, float] = {}
    for cap in caps:  # up from 1, until two caps in a row return less than the best so far
        if len(best) >= 3 and max(best.values()) > max(list(best.values())[-2:]):
            break
        per_run = []
        for twin, resets in runs:
            twin.config.actions = replace(twin.config.actions, max_draft_len=cap)  # read by each reset
            per_run.append(max(np.mean([_return(twin, a, r) for r in resets]) for a in range(twin.action_space.n)))
        best[cap] = float(np.mean(per_run))
    for twin, _ in runs:
        twin.close()
    chosen = max(best, key=lambda k: (best[k], -k))
    logger.warning(f'max_draft_len="auto": {chosen} (of {list(best)} tried), the cap whose best fixed action returned most '
                   f"on the validation {_episodes(runs)} under {env.charged}'s costs "
                   f"({', '.join(f'{k}: {v:.3f}' for k, v in best.items())})")
    _CHOSEN[key] = chosen, best
    return chosen, best


def _episodes(runs: list) -> str:
    n = sum(len(resets) for _, resets in runs)
    return f"{n} prompts" if len(runs) == 1 and "options" in runs[0][1][0] else f"{n} episodes ({len(runs)} loads)"


def _return(env, action: int, reset: dict) -> float:
    env.reset(**reset)
    total, done = 0.0, False
    while not done:
        _, reward, terminated, truncated, _ = env.step(action)
        total, done = total + float(reward), terminated or truncated
    return total
