"""The quality signal read from the verification: regret 0 for lossless decoding on any dtype, and the
env's reward with quality="regret"."""

from __future__ import annotations

import numpy as np
import pytest

from bild_env import generate_bild, generate_speculative, load_pair
from bild_env.prompts.sources import load_prompts

from conftest import COSTS  # noqa: E402


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lossless_bild_has_zero_regret_and_lossy_bild_does_not(dtype):
    pair = load_pair("tiny-random", device="cpu", dtype=dtype)
    prompts = load_prompts(pair.tokenizer, "builtin", "validation", 16)
    lossy_regret, lossy_mismatches = 0.0, 0
    for prompt in prompts:
        # rollback below ln 2: every kept draft token is the target's argmax (BILD_SPEC section 1)
        exact = generate_bild(pair, prompt, fallback=0.3, rollback=0.5, max_new_tokens=24)
        assert (exact.stats.regret, exact.stats.mismatches, exact.stats.fidelity) == (0.0, 0, 1.0)
        assert generate_speculative(pair, prompt, k=3, max_new_tokens=24).stats.regret == 0.0
        lossy = generate_bild(pair, prompt, fallback=0.03, rollback=8.0, max_new_tokens=24)
        assert (lossy.stats.regret > 0) == (lossy.stats.mismatches > 0)
        lossy_regret += lossy.stats.regret
        lossy_mismatches += lossy.stats.mismatches
    assert lossy_mismatches > 0 and lossy_regret > 0


def test_regret_reward_charges_the_regret_of_each_step(make_env):
    rng = np.random.default_rng(0)
    bleu_env = make_env(reward={"bleu_weight": 0.0})  # reward: the latency term alone
    regret_env = make_env(reward={"quality": "regret", "regret_weight": 3.0})
    charged = 0.0
    for seed in range(4):
        bleu_env.reset(seed=seed)
        regret_env.reset(seed=seed)
        done = False
        while not done:
            action = int(rng.integers(25))
            _, r_latency, term, trunc, info_a = bleu_env.step(action)
            _, r_regret, _, _, info_b = regret_env.step(action)
            assert info_a == info_b
            assert r_regret == pytest.approx(r_latency - 3.0 * info_b["regret"] / 24, abs=1e-12)
            charged += info_b["regret"]
            done = term or trunc
    assert charged > 0  # random actions keep some tokens the target would not have chosen


@pytest.mark.parametrize("bad, message", [({"reward": {"quality": "rouge"}}, "quality must be one of"),
                                          ({"reward": {"regret_weight": float("nan")}},
                                           "regret_weight must be a finite number"),
                                          ({"reward": {"latency_weight": float("inf")}},
                                           "latency_weight must be a finite number")])
def test_bad_quality_options_are_refused(make_env, bad, message):
    with pytest.raises(ValueError, match=message):
        make_env(**bad)
