"""Fixed-seed trajectories of ``BiLD-v1`` / ``BiLD-v0`` and ``BiLD-Serve-v0`` pinned at one commit.

Recorded at commit 82270287635feac7aa1c3fa95112a50fc6b38d2b (``RECORDED_AT``), before the actions were decoded in
one place (``bild_env.actions``), the envs given one base and the serving step its own server: a refactor must
leave every number here as it was. When an option went (the serving env's ``allocate`` after
commit 1029c5c, ``observe_domain`` after 61e4dff), its case was recorded again without it at the last commit that had
it (and ``info`` lost ``depth``). Each case makes an env on the tiny-random pair under options that exercise every
action kind (BiLD pairs, the off switch, tree rules, per-domain choices, continuous actions)
and the options on the step path (observations, cost profiles, the charged loop), steps a fixed action sequence
from ``reset(seed=...)``, and stores the observations, rewards, terminated / truncated, the numbers of ``info``
and, on the replay backend, what ``peek`` returns at one state. The test runs the cases again and compares: exact
for integers, strings and flags, floats to a relative 1e-4 or an absolute 1e-4 (the replay trees a case reads may
have been filled by another test's batched forwards, equal to float rounding: a regret read from such a tree
differed by 1.8e-5 relative in a full run of the suite; and the cases were recorded on an AVX2-only CPU, where a
float32 forward sums in another order than on AVX-512 units: on a Zen 5 a regret of 0.0063 came out 1.5e-5 higher,
while under ``ATEN_CPU_CAPABILITY=avx2`` it was as pinned).

Regenerate (only when a change of behaviour is meant, naming the commit in ``RECORDED_AT``)::

    REGENERATE=1 python -m pytest tests/test_trajectories_pinned.py
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import gymnasium
import numpy as np
import pytest

from tests.conftest import COSTS
from tests.test_serving import toy_batch_costs

RECORDED_AT = "82270287635feac7aa1c3fa95112a50fc6b38d2b"
DATA = Path(__file__).parent / "data" / "trajectories_pinned.json"
TREES = ("3,2,1", "6:8:2:0.3")  # two tree rules: actions 26 and 27 after the grid (0-24) and the off switch (25)
DISCRETE = [4, 25, 26, 12, 27, 0, 24, 25, 7, 26, 18, 27, 3, 25, 9, 26]  # every kind, in turn
CONTINUOUS = [[-1.0, 1.0, -1.0], [0.2, -0.4, -0.5], [0.0, 0.0, 0.5], [1.0, -1.0, -0.1], [-0.6, 0.3, 1.0],
              [0.5, 0.9, -1.0], [-0.2, -0.8, -0.3], [0.9, 0.1, 0.2]]

# BiLD-v1 / BiLD-v0: (env id, options, actions, seed, the step peek() is asked at or None)
BILD_CASES = {
    "v1-replay-off-trees-rich": ("BiLD-v1", {"backend": "replay", "actions": {"off_switch": True, "tree_rules": TREES},
                                             "observation": "rich"}, DISCRETE, 3, 2),
    "v1-live-off-trees-context": ("BiLD-v1", {"backend": "live", "actions": {"off_switch": True, "tree_rules": TREES},
                                              "observation": "context"}, DISCRETE, 5, None),
    "v1-replay-continuous-off-foresee": ("BiLD-v1", {"backend": "replay", "actions": {"space": "continuous", "off_switch": True,
                                                                                      "score": "cumulative"},
                                                     "observation": "foresee"},
                                         CONTINUOUS, 7, 1),
    "v0-replay-bleu-oracle": ("BiLD-v0", {"backend": "replay", "actions": {"score": "oracle:0.5"}}, [7, 0, 24, 12, 3, 19], 11,
                              None),
}
BILD_BASE = {"pair": "tiny-random", "pair_options": {"device": "cpu"}, "cost_model": COSTS, "max_new_tokens": 12}
BILD_INFO = ("fallback", "rollback", "off", "tree", "committed", "proposed", "accepted", "latency_ms", "bleu",
             "regret", "mismatches", "draft_forwards", "target_forwards")

# BiLD-Serve-v0: (options, actions, seed, the step peek() is asked at or None, the actions peek tries or None: all)
SERVE_CASES = {
    "off-trees-next-burst": ({"actions": {"tree_rules": TREES}, "observe": {"next": True}, "load": "burst:0.3,1.5"}, DISCRETE, 1, 3,
                             None),
    "per-domain-mix-draw": ({"actions": {"per_domain": True}, "mix_draw": 1.0, "load": "levels:0.2,1.0"},
                           [[4, 25], [25, 12], [0, 24], [25, 25], [7, 3], [18, 25], [12, 12], [24, 0]], 2, 2,
                           [[4, 25], [25, 4], [0, 0]]),
    "continuous-off-daily": ({"actions": {"space": "continuous"}, "load": "daily:0.2,1.2"}, CONTINUOUS, 3, 1,
                             [[0.0, 0.0, -1.0], [0.0, 0.0, 1.0]]),
    "loop-next-oracle": ({"charging": {"charge_loop": (0.05, 0.01, 0.001), "read_ahead_batch": 6}, "observe": {"next": True},
                          "actions": {"score": "oracle:0.5"}, "load": "steps:0.4,1.2,0.1"}, [4, 25, 12, 0, 24, 7, 25, 18], 4, 2, None),
    "train-profiles-costs": ({"charging": {"train_profiles": ("h200-opt-eager", "zen5-smollm2-bf16"),
                                           "vary_profiles": 2.0}, "observe": {"costs": True}, "cost_model": None, "load": "constant:0.7"},
                             [4, 25, 12, 0, 24, 7, 25, 18], 5, None, None),
}
SERVE_STEPS = 12  # an episode: truncated after the last action
SERVE_INFO = ("off", "fallback", "rollback", "batch_size", "queue", "utilisation", "arrival_rate", "step_ms", "ref_ms",
              "idle_ms", "committed", "proposed", "accepted", "regret", "mismatches", "goodput_tok_s",
              "domains", "cost_profile", "tree", "per_domain")


def _plain(x):
    """``x`` as JSON holds it: arrays and tuples as lists, numpy scalars as Python's, floats to 8 significant digits
    (the comparison's tolerance is coarser; the file stays small)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, np.ndarray)):
        return [_plain(v) for v in x]
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(f"{float(x):.8g}")
    return x


def _continuous(options: dict) -> bool:
    return options.get("actions", {}).get("space") == "continuous"


def _peeked(env, actions) -> dict:
    obs, rewards, flags = env.unwrapped.peek(actions)
    return {"obs": obs.tolist(), "rewards": rewards.tolist(), "flags": flags.tolist()}


def run_bild(name: str) -> dict:
    env_id, options, actions, seed, peek_at = BILD_CASES[name]
    env = gymnasium.make(f"bild_env:{env_id}", **(BILD_BASE | options))
    try:
        out = {"resets": [], "steps": [], "summaries": []}
        ended = True
        for i, action in enumerate(actions):
            if ended:  # the next episode, on the next seed, until the actions are spent
                obs, info = env.reset(seed=seed + len(out["resets"]))
                out["resets"].append({"obs": obs.tolist(), "prompt_index": info["prompt_index"]})
            if i == peek_at:
                out["peek"] = _peeked(env, None if not _continuous(options) else actions[:4])
            obs, reward, terminated, truncated, info = env.step(np.asarray(action, dtype=np.float32)
                                                                if isinstance(action, list) else action)
            out["steps"].append({"obs": obs.tolist(), "reward": reward, "terminated": terminated,
                                 "truncated": truncated, "info": {k: info.get(k) for k in BILD_INFO}})
            ended = terminated or truncated
            if ended:
                out["summaries"].append(info.get("episode_summary"))
        return _plain(out)
    finally:
        env.close()


def run_serve(name: str, workload) -> dict:
    options, actions, seed, peek_at, peek_actions = SERVE_CASES[name]
    actions = (actions * 2)[:SERVE_STEPS]
    base = {"pair": "tiny-random", "pair_options": {"device": "cpu"}, "cost_model": toy_batch_costs(), "workload": workload,
            "max_new_tokens": 10, "max_batch": 6, "episode_steps": len(actions)}
    env = gymnasium.make("bild_env:BiLD-Serve-v0", **(base | options))
    try:
        obs, info = env.reset(seed=seed)
        out = {"reset": {"obs": obs.tolist(), "info": info}, "steps": []}
        for i, action in enumerate(actions):
            if i == peek_at:
                out["peek"] = _peeked(env, peek_actions)
            if isinstance(action, list):
                action = np.asarray(action, dtype=np.float32 if _continuous(options) else np.int64)
            obs, reward, terminated, truncated, info = env.step(action)
            step = {"obs": obs.tolist(), "reward": reward, "terminated": terminated, "truncated": truncated,
                    "info": {k: info.get(k) for k in SERVE_INFO},
                    "finished": [[f["domain"], f["prompt_index"], f["new_tokens"], f["latency_ms"], f["queued_ms"]]
                                 for f in info["finished"]],
                    "errors": len(info["errors"])}
            out["steps"].append(step)
            if terminated or truncated:
                out["summary"] = info.get("episode_summary")
                break
        return _plain(out)
    finally:
        env.close()


@pytest.fixture(scope="module")
def serve_workload(tiny_pair):
    from bild_env.prompts.sources import load_prompts
    from tests.test_serving import ListWorkload

    prompts = load_prompts(tiny_pair.tokenizer, "builtin", "train", 16)
    return ListWorkload({"prose": prompts[:8], "code": prompts[8:16]}, {"prose": 1.0, "code": 1.0})


def record(workload) -> dict:
    """Every case's trajectory (what the JSON holds)."""
    return {"recorded_at": RECORDED_AT,
            "bild": {name: run_bild(name) for name in BILD_CASES},
            "serve": {name: run_serve(name, workload) for name in SERVE_CASES}}


def assert_same(got, want, where: str = "") -> None:
    """``got`` equals ``want``: floats to a relative 1e-4 or an absolute 1e-4 (module docstring: float32 kernels
    of other CPUs), everything else exactly."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool) and isinstance(got, (int, float)):
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-4), f"{where}: {got!r} != {want!r}"
    else:
        assert got == want and type(got) is type(want), f"{where}: {got!r} != {want!r}"


@pytest.fixture(scope="module")
def pinned(serve_workload):
    if os.environ.get("REGENERATE"):
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(json.dumps(record(serve_workload), separators=(",", ":")) + "\n")
    return json.loads(DATA.read_text())


def test_pinned_at_a_commit(pinned):
    assert pinned["recorded_at"] == RECORDED_AT
    assert sorted(pinned["bild"]) == sorted(BILD_CASES) and sorted(pinned["serve"]) == sorted(SERVE_CASES)


@pytest.mark.parametrize("name", list(BILD_CASES))
def test_bild_trajectory_as_pinned(pinned, name):
    assert_same(run_bild(name), pinned["bild"][name], name)


@pytest.mark.parametrize("name", list(SERVE_CASES))
def test_serve_trajectory_as_pinned(pinned, serve_workload, name):
    assert_same(run_serve(name, serve_workload), pinned["serve"][name], name)
