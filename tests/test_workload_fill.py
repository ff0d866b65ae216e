"""The training prompts' replay trees filled ahead of training (``bild_env.fill.serving``): each prompt decoded alone
by every action leaves the fixed policies' serving episodes nothing to fill."""

from __future__ import annotations

import pytest


@pytest.fixture
def private_store(monkeypatch, tmp_path):
    from bild_env.replay import TreeStore

    monkeypatch.setenv("BILD_ENV_CACHE", str(tmp_path))
    return TreeStore()


def test_a_workload_fill_leaves_every_fixed_policy_nothing_to_fill(private_store):
    from agents.serve.rules import Fixed, returns_of
    from bild_env.fill.serving import decodes, fill_workload
    from bild_env.serving.env import ServingConfig, ServingEnv
    from tests.test_serving import toy_batch_costs

    kwargs = dict(pair="tiny-random", mix="prose:1,code:1", split="train", max_prompts=3, max_new_tokens=8,
                  max_batch=4, episode_steps=8, actions={"rollback_values": (0.5,)}, cost_model=toy_batch_costs(),
                  replay_store=private_store)
    done = []
    assert fill_workload(kwargs, done.append) == decodes(ServingConfig(**kwargs), 6) == 6 * 6  # 2 domains x 3 prompts
    assert done == [6] * 6 and private_store.counts.fills > 0
    filled = private_store.counts.fills
    env = ServingEnv(**kwargs)
    try:
        for action in range(env.action_space.n):  # 5 fallbacks at rollback 0.5, and speculation off
            returns_of(env, Fixed(action), [0, 1, 2])
    finally:
        env.close()
    assert private_store.counts.fills == filled and private_store.counts.hits > 0


def test_the_fill_runs_in_a_child_process_and_counts_its_decodes(private_store, monkeypatch):
    from agents.common.phases import PhaseBar
    from bild_env.fill.serving import WorkloadFill

    kwargs = dict(pair="tiny-random", mix="prose:1", split="train", max_prompts=2, max_new_tokens=8, max_batch=4,
                  episode_steps=8, actions={"rollback_values": (0.5,)})
    bar = PhaseBar("fill", "decode", say=lambda _: None, every_s=1e9, total=12)
    fill = WorkloadFill(kwargs)
    counted = fill.counted(bar)
    counted.update(0)
    assert fill.wait(bar) and fill.process.exitcode == 0 and bar.n == bar.total == 12  # 2 prompts x 6 actions


def test_a_fill_that_fails_says_so_and_leaves_the_rest_to_the_envs(private_store, capfd):
    from bild_env.fill.serving import WorkloadFill

    fill = WorkloadFill(dict(pair="no-such-pair", split="train"))
    assert fill.wait() is False and fill.process.exitcode != 0
    assert "no-such-pair" in capfd.readouterr().err  # the child's error, on stderr
