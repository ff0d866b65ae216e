"""Envs stepped together with batched fills give exactly what live envs give, one by one."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import DummyVecEnv
from transformers import DynamicCache

from bild_env.decoding.kv import Row, batched_forward, single_forward
from bild_env.models.pairs import load_pair
from agents.vec import BatchedReplayVecEnv
from bild_env.replay.batching import CoopBatcher, Request
from bild_env.replay.store import ReplayReport, TreeStore

from conftest import COSTS, assert_same_up_to_regret_rounding  # noqa: E402

KWARGS = {"render_mode": None, "pair": "tiny-random", "pair_options": {"device": "cpu"}, "cost_model": COSTS, "max_new_tokens": 24}


@pytest.mark.parametrize("role", ["draft", "target"])
def test_batched_forward_matches_each_rows_own_forward(tiny_pair, role):
    model = getattr(load_pair("tiny-random", device="cpu"), role)
    rng = torch.Generator().manual_seed(0)
    spec = [(0, 5, 5), (7, 1, 1), (12, 3, 2), (0, 1, 1), (20, 6, 6)]  # (cached, new, logits kept)
    alone, together = [], []
    for past, new, keep in spec:
        tokens = torch.randint(5, 1000, (past + new,), generator=rng).tolist()
        caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
        if past:
            for cache in caches:
                single_forward(model, Row(tokens[:past], cache, 1))
        alone.append(Row(tokens[past:], caches[0], keep))
        together.append(Row(tokens[past:], caches[1], keep))
    expected = [single_forward(model, row) for row in alone]
    got = batched_forward(model, together)
    for e, g, a, t in zip(expected, got, alone, together):
        assert g.shape == e.shape
        assert torch.equal(g.argmax(-1), e.argmax(-1))
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        assert t.cache.get_seq_length() == a.cache.get_seq_length()
    # the appended caches are right: a second round on them agrees too
    expected = [single_forward(model, Row([7, 8, 9], row.cache, 3)) for row in alone]
    got = batched_forward(model, [Row([7, 8, 9], row.cache, 3) for row in together])
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def run(vec, actions):
    """Step ``vec`` through ``actions`` (steps x n_envs); return everything it returned."""
    out = [vec.reset().tolist()]
    for a in actions:
        obs, rewards, dones, infos = vec.step(a)
        for info in infos:
            if "episode" in info:  # Monitor's record: "t" is wall-clock time since the start
                del info["episode"]["t"]
            if "terminal_observation" in info:
                info["terminal_observation"] = info["terminal_observation"].tolist()
        out.append((obs.tolist(), rewards.tolist(), dones.tolist(), infos))
    return out


def test_batched_replay_vec_env_equals_live_envs_one_by_one(tiny_pair):
    n, steps = 4, 120
    actions = np.random.default_rng(0).integers(25, size=(steps, n))
    live = make_vec_env("bild_env:BiLD-v0", n_envs=n, seed=7, env_kwargs=KWARGS, vec_env_cls=DummyVecEnv)
    batched = make_vec_env("bild_env:BiLD-v0", n_envs=n, seed=7, env_kwargs=KWARGS | {"backend": "replay"},
                           vec_env_cls=BatchedReplayVecEnv, vec_env_kwargs={"store": TreeStore()})  # counts of its own
    a, b = run(live, actions), run(batched, actions)
    assert sum(d.count(True) for _, _, d, _ in a[1:]) > 2 * n  # several episodes ended (and auto-reset) per env
    assert_same_up_to_regret_rounding(a, b)
    report = batched.envs[0].unwrapped.runner.store.report()
    sizes = batched.batcher.batch_sizes
    assert max(sizes) > 1  # misses of several envs ran as one forward
    assert report["fills"] == sum(sizes.values()) and report["fill_rows"] == sum(k * v for k, v in sizes.items())
    assert report["fill_rows"] > report["fills"]
    # the envs share one tree store: what one filled, the others read
    runners = [e.unwrapped.runner for e in batched.envs]
    assert all(r.store is runners[0].store for r in runners)
    # the same actions from the same seeds on new envs over that store: all answers from the trees, no forward
    again = make_vec_env("bild_env:BiLD-v0", n_envs=n, seed=7, env_kwargs=KWARGS | {"backend": "replay"},
                         vec_env_cls=BatchedReplayVecEnv, vec_env_kwargs={"store": runners[0].store})
    fills = runners[0].store.counts.fills
    assert run(again, actions) == b
    assert runners[0].store.counts.fills == fills
    live.close(), batched.close(), again.close()


def test_an_error_in_one_env_reaches_the_caller_and_the_others_unwind(tiny_pair):
    vec = make_vec_env("bild_env:BiLD-v0", n_envs=3, seed=0, env_kwargs=KWARGS | {"backend": "replay"},
                       vec_env_cls=BatchedReplayVecEnv)
    vec.reset()
    with pytest.raises(ValueError, match="action"):
        vec.step(np.array([0, 99, 0]))
    obs, _, _, _ = vec.step(np.array([0, 1, 2]))  # still usable
    assert obs.shape == (3, 7)
    vec.close()


def test_coop_batcher_runs_jobs_in_order_and_aborts_waiting_ones(tiny_pair):
    pair = load_pair("tiny-random", device="cpu")
    batcher, order, counts = CoopBatcher(), [], ReplayReport()

    def request(ids):
        return Request("draft", pair.draft, Row(ids, DynamicCache(config=pair.draft.config), 1), (1.0, 0.0), counts)

    def job(i, forwards):
        def fn():
            for k in range(forwards):
                order.append((i, k))
                batcher.forward(request([5, 6]))
            return i
        return fn

    assert batcher.run([job(0, 2), job(1, 0), job(2, 3)]) == [0, 1, 2]
    assert order == [(0, 0), (2, 0), (0, 1), (2, 1), (2, 2)]  # env order within each round
    assert batcher.batch_sizes == {2: 2, 1: 1}

    def bad_row():  # a request the batched forward rejects, raised in the scheduling (main) thread
        batcher.forward(request([]))

    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="new tokens"):
        batcher.run([job(0, 5), bad_row, job(2, 5)])
    assert not {t.name for t in threading.enumerate()} - before  # the waiting jobs were woken and unwound


def test_plan_batches_keeps_long_rows_apart_from_padded_short_ones():
    from bild_env.replay.batching import plan_batches

    # three one-token rows and a 40-token prompt: padding the short rows to 40 would cost 3 x 40 tokens
    assert plan_batches([1, 40, 1, 1], fixed_ms=70.0, token_ms=11.0) == [[0, 2, 3], [1]]
    assert plan_batches([1, 40, 1, 1], fixed_ms=70.0, token_ms=0.0) == [[0, 2, 3, 1]]  # padding is free: one batch
    assert plan_batches([3, 2], fixed_ms=1.0, token_ms=10.0) == [[1], [0]]  # 1 + 10*2*3 > (1 + 20) + (1 + 30)
    assert plan_batches([], 1.0, 1.0) == []


def test_episodes_start_their_fills_from_the_prompts_kept_path_cache(tiny_pair):
    from bild_env.env import BildEnv

    from bild_env.replay import TreeStore

    kw = KWARGS | {"backend": "replay"}
    capped = BildEnv(**kw | {"replay_store": TreeStore()})  # stores of their own: the cap below stays here
    free = BildEnv(**kw | {"split": "validation", "replay_store": TreeStore()})
    rng = np.random.default_rng(0)
    for env in (capped, free):
        for seed in range(6):
            env.reset(seed=seed, options={"prompt_index": seed % 2})
            done = False
            while not done:
                _, _, term, trunc, _ = env.step(int(rng.integers(25)))
                done = term or trunc
    report = free.runner.store.report()
    assert report["path_caches"] == 4  # 2 prompts x 2 models
    assert report["path_cache_reuses"] > 0 and report["path_cache_bytes"] > 0
    # a cap smaller than one cache keeps none, and the env still works (fills start from empty caches)
    capped.runner.store.limit_path_caches(1)
    capped.reset(seed=99, options={"prompt_index": 3})
    capped.step(0)
    report = capped.runner.store.report()
    assert report["path_cache_bytes"] == 0 and report["path_caches"] == 0


def test_prefetched_references_equal_target_only_decoding(tiny_pair, tmp_path):
    from bild_env.prompts.sources import load_prompts
    from bild_env.decoding.decoders import generate_target_only
    from bild_env.reference import ReferenceStore

    pair = load_pair("tiny-random", device="cpu")
    prompts = load_prompts(pair.tokenizer, "builtin", "train", 32, limit=12)  # 15 to 22 tokens: padded batches
    store = ReferenceStore(pair, 24, folder=tmp_path)
    assert store.prefetch(prompts + prompts[:2], batch_size=5, progress=False) == 12  # duplicates computed once
    assert all(store.get(p) == generate_target_only(pair, p, 24).new_ids for p in prompts)
    assert ReferenceStore(pair, 24, folder=tmp_path).prefetch(prompts, progress=False) == 0  # on disk already
