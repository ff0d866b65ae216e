"""BiLD-v0's reset options and peek at their edges: a typo is refused, no actions is no rows."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

ENV_DEFAULTS = {"max_new_tokens": 8, "backend": "replay"}


def test_an_unknown_reset_option_is_refused_not_ignored(make_env):
    env = make_env()
    with pytest.raises(ValueError, match=r"unknown reset option\(s\) \['prompt_idx'\]; the one option is 'prompt_index'"):
        env.reset(options={"prompt_idx": 2})
    assert env.reset(options={"prompt_index": 2})[1]["prompt_index"] == 2


def test_peek_at_no_actions_gives_no_rows(make_env):
    env = make_env().unwrapped
    env.reset(options={"prompt_index": 0})
    observations, rewards, terminated = env.peek([])
    assert observations.shape == (0, *env.observation_space.shape) and observations.dtype == np.float32
    assert rewards.shape == (0,) and terminated.shape == (0,) and terminated.dtype == bool
    one = env.peek([3])
    assert one[0].shape == (1, *env.observation_space.shape)


def test_the_env_passes_lean_to_the_pair_and_refuses_an_unknown_one():
    """``lean`` reaches load_pair (the preset's default when None); an unknown value is refused naming the choices."""
    import gymnasium

    from bild_env.models.pairs import PairError

    with pytest.raises(PairError, match="lean must be one of"):
        gymnasium.make("bild_env:BiLD-v1", pair="tiny-random", pair_options={"device": "cpu", "lean": "fast"})
    env = gymnasium.make("bild_env:BiLD-v1", pair="tiny-random", pair_options={"device": "cpu", "lean": "none"},
                         max_new_tokens=4)
    assert env.unwrapped.pair.lean == ()
    env.close()


def test_thresholds_of_an_action_outside_the_space_is_refused_as_step_refuses_it(make_env):
    env = make_env(actions={"tree_rules": ("6:8:2",)}).unwrapped
    first = (env.config.actions.fallback_values[0], env.config.actions.rollback_values[0])
    assert env.thresholds(0) == first and env.thresholds(25) is None  # a tree action: no thresholds
    for bad in (26, 99, -1, 1.5):
        with pytest.raises(ValueError, match=rf"BiLD-v0 action must be an integer in \[0, 26\).*got {bad}"):
            env.thresholds(bad)


def test_sub_config_keys_given_flat_fold_into_it_with_a_deprecation_warning():
    """``dtype=``, ``regret_weight=``, ``train_profiles=`` given flat (as before the sub-configs) build the same
    arguments as ``pair_options``, ``reward`` and ``charging`` give them, with a DeprecationWarning naming where they
    go; a key no sub-config has, or a sub-config that is no dict, is refused naming its keys."""
    from bild_env.env import BildEnv
    from bild_env.serving.env import ServingEnv

    nested = BildEnv.Config(pair="tiny-random", pair_options={"dtype": "float32", "device": "cpu"},
                            reward={"regret_weight": 3.0})
    with pytest.warns(DeprecationWarning, match=r"\['device', 'dtype', 'regret_weight'\] given flat are deprecated: "
                                                r"give them in pair_options=\{\.\.\.\}, reward=\{\.\.\.\}"):
        env = BildEnv(pair="tiny-random", dtype="float32", device="cpu", regret_weight=3.0, max_new_tokens=4)
    assert env.config == replace(nested, max_new_tokens=4)
    assert env.config.reward.bleu_weight == 2.0 and env.config.setting("regret_weight") == 3.0
    env.close()
    with pytest.warns(DeprecationWarning, match=r"give them in charging=\{\.\.\.\}"):
        serve = ServingEnv(pair="tiny-random", pair_options={"device": "cpu"}, train_profiles=["h200-opt-eager"],
                           vary_profiles=1.5, max_batch=4)
    assert serve.config.charging.train_profiles == ("h200-opt-eager",) and serve.config.charging.vary_profiles == 1.5
    serve.close()
    with pytest.raises(ValueError, match="pair_options must be a dict .* of draft, target, tokenizer, device, dtype"):
        BildEnv(pair="tiny-random", pair_options={"dtyp": "float32"})
    with pytest.raises(ValueError, match="reward must be a dict .* of latency_weight, regret_weight, bleu_weight"):
        BildEnv(pair="tiny-random", reward=10.0)
