"""The replay backend gives exactly what the live env gives (latency="model"), and persists its trees."""

from __future__ import annotations

import numpy as np
import pytest

from bild_env.env import BildEnv
from bild_env.replay import PrefixTree, TreeStore

from conftest import COSTS, assert_same_up_to_regret_rounding  # noqa: E402


def env(tiny_pair, **kwargs):
    # quality="bleu": rewards are compared exactly, and the BLEU term is a function of the tokens alone (the regret
    # term carries the float rounding of the forward that computed it)
    return BildEnv(**({"pair": "tiny-random", "pair_options": {"device": "cpu"}, "cost_model": COSTS, "max_new_tokens": 32,
                       "reward": {"quality": "bleu"}} | kwargs))


def episodes(e, seeds, actions_rng):
    """Run one episode per seed with random actions; return every (obs, reward, term, trunc, info)."""
    out = []
    for seed in seeds:
        obs, info = e.reset(seed=seed)
        out.append((obs.tolist(), info))
        done = False
        while not done:
            obs, r, term, trunc, info = e.step(int(actions_rng.integers(25)))
            out.append((obs.tolist(), r, term, trunc, info))
            done = term or trunc
        out.append(tuple(e.session.new_ids))
    return out


def test_replay_equals_live_over_random_actions_and_prompts(tiny_pair):
    live, replay = env(tiny_pair), env(tiny_pair, backend="replay")
    seeds = range(25)
    a = episodes(live, seeds, np.random.default_rng(0))
    b = episodes(replay, seeds, np.random.default_rng(0))
    assert_same_up_to_regret_rounding(a, b)
    cold = replay.runner.store.report()
    # the same episodes again: answered from the trees alone, no model forward
    assert episodes(replay, seeds, np.random.default_rng(0)) == b
    again = replay.runner.store.report()
    assert again["fills"] == cold["fills"] and again["misses"] == cold["misses"] and again["hits"] > cold["hits"]
    # other actions on warm trees (partly leaving the stored paths) still agree with live
    c = episodes(live, seeds, np.random.default_rng(1))
    d = episodes(replay, seeds, np.random.default_rng(1))
    assert_same_up_to_regret_rounding(c, d)
    report = replay.runner.store.report()
    print(f"\nreplay: {report}")
    assert report["misses"] > again["misses"] and report["nodes"] > 100
    assert 20 < report["bytes_per_prefix"] < 400


def test_trees_persist_and_later_runs_start_warm(tiny_pair):
    # stores of their own: the second env reads what the first wrote on disk, not the process-wide store's memory
    first = env(tiny_pair, backend="replay", split="validation", replay_store=TreeStore())
    a = episodes(first, range(6), np.random.default_rng(3))
    first.close()  # flushes trees to disk
    second = env(tiny_pair, backend="replay", split="validation", replay_store=TreeStore())
    b = episodes(second, range(6), np.random.default_rng(3))
    assert a == b
    report = second.runner.store.report()
    assert report["misses"] == 0 and report["fills"] == 0 and report["loads"] >= 1


def test_memory_cap_evicts_whole_trees_to_disk_and_stays_exact(tiny_pair):
    capped = env(tiny_pair, backend="replay", split="test", replay_store=TreeStore(max_nodes=60))
    live = env(tiny_pair, split="test")
    rng_seeds = list(range(8)) * 2
    assert_same_up_to_regret_rounding(episodes(capped, rng_seeds, np.random.default_rng(4)),
                                      episodes(live, rng_seeds, np.random.default_rng(4)))
    report = capped.runner.store.report()
    assert report["evictions"] > 0 and report["loads"] > 0
    assert report["trees_in_memory"] <= 3


def test_prefix_tree_round_trips_through_disk(tmp_path):
    tree = PrefixTree()
    a = tree.child(0, 5)
    b = tree.child(a, 7)
    assert tree.child(0, 5) == a and len(tree) == 3
    tree.d_arg[b], tree.d_p[b], tree.t_arg[b], tree.t_logp[b] = 3, 0.25, 4, -1.5
    tree.save(tmp_path / "t.npz")
    back = PrefixTree.load(tmp_path / "t.npz")
    assert back.child(back.child(0, 5), 7) == b and len(back) == 3
    assert (back.d_arg[b], back.d_p[b], back.t_arg[b], back.t_logp[b]) == (3, 0.25, 4, -1.5)


def test_replay_needs_model_latency(tiny_pair):
    with pytest.raises(ValueError, match="needs latency='model'"):
        env(tiny_pair, backend="replay", latency="wall")
