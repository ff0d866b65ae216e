"""BiLD-Serve-v0 (bild_env.serving) and the off switch: batched step costs, load profiles, exact requests."""

from __future__ import annotations

import math

import gymnasium
import numpy as np
import pytest

from bild_env.decoding.costs import BatchCost, CostModel
from bild_env.serving import clock
from bild_env.serving.load import LoadProfile
from tests.conftest import COSTS


def train_serve(argv: list[str]) -> int:
    """``python train.py --env serve ARGV``, in this process."""
    from agents.commands import train_main

    return train_main(["--env", "serve", *argv])


def evaluate_serve(argv: list[str], defaults=None) -> dict:
    """``python evaluate.py --env serve ARGV`` (``--full`` with ``defaults`` None; ``QUICK`` is the command's), in this
    process: its report."""
    from agents.evaluation import evaluate
    from agents.serve.evaluation import ServingEvaluation

    return evaluate(ServingEvaluation.from_argv(argv, defaults))


def evaluate_clock(argv: list[str]) -> dict:
    """``python evaluate.py --env serve --clock ARGV``, in this process: its report."""
    from agents.evaluation import evaluate
    from agents.serve.load_clock import ClockEvaluation

    return evaluate(ClockEvaluation.from_argv(argv))


def toy_batch_costs() -> CostModel:
    """A batched cost table made by hand: a forward costs more with more rows and more tokens per row."""
    table = {}
    for b in (1, 2, 4, 8, 16, 32):
        for n in range(1, 13):
            table[(b, n)] = 4.0 + 0.5 * n * b ** 0.7 + 0.2 * b
    draft = {k: v / 4.0 for k, v in table.items()}
    return CostModel(COSTS.draft, COSTS.target, "test",
                     batched={"draft": BatchCost.from_table(draft, ref_context=64, per_context_ms=0.001),
                              "target": BatchCost.from_table(table, ref_context=64, per_context_ms=0.004)})


class ListWorkload:
    """A workload of given prompts per domain, drawn by weight (the env only needs domains, prompts and draw)."""

    def __init__(self, prompts: dict[str, list[list[int]]], weights: dict[str, float]) -> None:
        self.prompts, self.weights, self.domains = prompts, weights, tuple(prompts)

    def draw(self, rng, weights=None):
        p = np.array([self.weights[d] for d in self.domains] if weights is None else weights, dtype=float)
        d = self.domains[int(rng.choice(len(p), p=p / p.sum()))]
        i = int(rng.integers(len(self.prompts[d])))
        return d, i, self.prompts[d][i]


@pytest.fixture(scope="module")
def workload(tiny_pair):
    from bild_env.prompts.sources import load_prompts

    prompts = load_prompts(tiny_pair.tokenizer, "builtin", "train", 16)
    return ListWorkload({"prose": prompts[:8], "code": prompts[8:16]}, {"prose": 1.0, "code": 1.0})


@pytest.fixture
def make_serve(workload):
    envs = []

    def make(**kwargs):
        defaults = {"pair": "tiny-random", "pair_options": {"device": "cpu"}, "cost_model": toy_batch_costs(), "workload": workload,
                    "max_new_tokens": 12, "max_batch": 8, "episode_steps": 24, "load": "constant:0.5"}
        env = gymnasium.make("bild_env:BiLD-Serve-v0", **(defaults | kwargs))
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.close()


# -- the batched clock --------------------------------------------------------------------------
def test_schedule_batches_prefills_apart_and_pads_decode_rows():
    traces = [
        [("target", 5, 0), ("draft", 6, 0), ("draft", 1, 6), ("target", 3, 5)],  # joined this step: two prefills
        [("draft", 1, 20), ("draft", 1, 21), ("draft", 1, 22), ("target", 4, 20), ("target", 1, 22)],  # rolled back
        [("target", 1, 30)],  # speculation off for it (a step_off)
    ]
    assert clock.schedule(traces) == [
        ("draft", 1, 6, 0.0),  # the draft's prefill apart
        ("draft", 2, 1, 13.0),  # draft forward 1: two requests still drafting, mean context (6 + 20) / 2
        ("draft", 1, 1, 21.0),
        ("draft", 1, 1, 22.0),
        ("target", 1, 5, 0.0),  # the target's prefill apart
        ("target", 3, 4, 55 / 3),  # one verification for all three, padded to the longest row (4 tokens)
        ("target", 1, 1, 22.0),  # the token after the rollback
    ]
    costs = toy_batch_costs()
    expected = sum(costs.batch_ms(r, b, n, c) for r, b, n, c in clock.schedule(traces))
    total, target_prefill = clock.charge(costs, traces)
    assert total == pytest.approx(expected)
    assert target_prefill == pytest.approx(costs.batch_ms("target", 1, 5, 0))  # the draft's prefill is speculation's


# -- load profiles ------------------------------------------------------------------------------
def test_load_profiles_give_the_documented_utilisation():
    rng = np.random.default_rng(0)
    assert LoadProfile.parse("constant:0.5").start(rng).utilisation(0.9) == 0.5
    burst = LoadProfile.parse("burst:0.2,1.5").start(rng)
    assert [burst.utilisation(x) for x in (0.0, 0.4, 0.7)] == [0.2, 1.5, 0.2]
    steps = LoadProfile.parse("steps:0.1,0.5,1").start(rng)
    assert [steps.utilisation(x) for x in (0.0, 0.34, 0.99)] == [0.1, 0.5, 1.0]
    levels = LoadProfile.parse("levels:0.1,0.9")
    drawn = {levels.start(rng).utilisation(0.3) for _ in range(50)}
    assert drawn == {0.1, 0.9}
    daily = LoadProfile.parse("daily:0.2,1.0").start(rng)
    values = [daily.utilisation(x) for x in np.linspace(0, 1, 101)]
    assert min(values) == pytest.approx(0.2, abs=1e-3) and max(values) == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("spec", ["constant:0", "constant:-1", "constant:nan", "levels:", "burst:1", "daily:0.1",
                                  "flat:1", "constant", "constant:x", "constant:inf", 5])
def test_bad_load_profiles_are_refused_naming_the_option(spec):
    with pytest.raises(ValueError, match="load"):
        LoadProfile.parse(spec, "load")


@pytest.mark.parametrize("kwargs", [{"load": "constant:0"}, {"max_batch": 0}, {"episode_steps": 0},
                                    {"reward": {"regret_weight": float("nan")}}, {"split": "dev"}, {"max_prompts": 0},
                                    {"pair_options": {"lean": "fast"}}, {"observe": {"batch_scale": "sqrt"}}, {"mix_draw": -1.0},
                                    {"mix_draw": float("nan")}, {"code_source": "github"}])
def test_bad_serving_config_is_refused_before_any_model_loads(kwargs, monkeypatch):
    import bild_env.serving.env as serving_env

    def no_load(*args, **kw):
        raise AssertionError("a model was loaded before the configuration was checked")

    monkeypatch.setattr("bild_env.models.pairs.load_pair", no_load)  # both envs load the pair through it
    with pytest.raises(ValueError):
        serving_env.ServingEnv(**({"pair": "tiny-random", "pair_options": {"device": "cpu"}} | kwargs))


# -- the environment ----------------------------------------------------------------------------
@pytest.mark.parametrize("action", ["discrete", "continuous"])
def test_serving_env_passes_both_checkers(make_serve, action):
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    env = make_serve(actions={"space": action})
    check_env(env.unwrapped, skip_render_check=True)
    sb3_check_env(env.unwrapped)
    assert env.action_space.shape == ((3,) if action == "continuous" else ())
    if action == "discrete":
        assert env.action_space.n == 26


def test_speculation_off_is_exactly_target_only_serving(make_serve):
    """With the off switch every step runs one batched target forward of one token per request: the time
    target-only serving takes, so every reward is 0 and the speedup 1, whatever the load does."""
    env = make_serve(load="burst:0.3,1.5")
    env.reset(seed=3)
    for _ in range(24):
        obs, reward, terminated, truncated, info = env.step(25)
        assert info["off"] and info["proposed"] == 0 and info["regret"] == 0.0
        assert reward == pytest.approx(0.0, abs=1e-9)
        assert info["committed"] == info["batch_size"]
        assert not terminated
    assert truncated
    summary = info["episode_summary"]
    assert summary["speedup"] == pytest.approx(1.0) and summary["fidelity"] == 1.0


def test_every_request_gets_the_target_greedy_output_under_lossless_bild(make_serve, workload, tiny_pair):
    """Rollback 0.5 < ln 2: each finished request equals target-only greedy decoding of its prompt, whatever
    the batch it was decoded in and whichever steps were switched off."""
    from bild_env import generate_target_only

    env = make_serve(max_new_tokens=10, episode_steps=40, load="constant:0.8")
    env.reset(seed=1)
    rng = np.random.default_rng(0)
    finished = []
    for _ in range(40):
        fallback = int(rng.integers(5))
        action = 25 if rng.random() < 0.3 else fallback * 5  # rollback index 0: 0.5 nats
        _, _, _, truncated, info = env.step(action)
        finished += info["finished"]
    assert len(finished) >= 5
    for f in finished:
        prompt = workload.prompts[f["domain"]][f["prompt_index"]]
        assert f["new_ids"] == generate_target_only(tiny_pair, prompt, 10).new_ids
        assert f["regret_per_token"] == 0.0


def test_load_moves_the_batch_and_infos_name_domains(make_serve):
    low, high = make_serve(load="constant:0.05"), make_serve(load="constant:1.5")
    sizes = {}
    for name, env in (("low", low), ("high", high)):
        env.reset(seed=0)
        seen = []
        for _ in range(24):
            _, _, _, _, info = env.step(0)
            seen.append(info["batch_size"])
            assert set(info["domains"]) <= {"prose", "code"} and sum(info["domains"].values()) == info["batch_size"]
        sizes[name] = np.mean(seen)
    assert sizes["low"] < 2 <= sizes["high"]
    assert high.unwrapped.queue or max(seen) == 8  # over capacity the batch fills and requests wait


def test_each_episode_can_serve_its_own_mix(make_serve):
    """mix_draw > 0: every episode draws its domain weights (seeded: the same seed, the same mix and requests);
    nearly one-hot weights (a small concentration) give nearly one-domain episodes, each domain in its turn."""
    env = make_serve(load="constant:1.0", mix_draw=0.02)
    dominant = set()
    for seed in range(8):
        _, info = env.reset(seed=seed)
        mix = info["mix"]
        assert set(mix) == {"prose", "code"} and sum(mix.values()) == pytest.approx(1.0)
        counts = {"prose": 0, "code": 0}
        for _ in range(6):
            _, _, _, _, step_info = env.step(25)
            for d, n in step_info["domains"].items():
                counts[d] += n
        top = max(mix, key=mix.get)
        if mix[top] > 0.999:
            assert counts[top] == sum(counts.values()) > 0
            dominant.add(top)
        assert env.reset(seed=seed)[1]["mix"] == mix
    assert dominant == {"prose", "code"}
    plain = make_serve(load="constant:1.0")
    assert "mix" not in plain.reset(seed=0)[1]


def test_a_failing_request_ends_alone(make_serve):
    env = make_serve(load="constant:1.0")
    env.reset(seed=0)
    victim = env.unwrapped.active[0]

    def boom(tokens):
        raise RuntimeError("CUDA out of memory (simulated)")

    victim.runner.draft_next = boom
    others = len(env.unwrapped.active) - 1
    _, _, _, truncated, info = env.step(0)
    assert [e["error"] for e in info["errors"]] == ["RuntimeError: CUDA out of memory (simulated)"]
    assert info["errors"][0]["prompt_index"] == victim.prompt_index
    assert victim not in env.unwrapped.active and not truncated
    assert info["batch_size"] == others + 1
    del victim.runner.draft_next  # the runner goes back to the pool whole
    env.step(0)


def test_the_same_seed_gives_the_same_episode(make_serve):
    def episode(env):
        env.reset(seed=7)
        out = []
        for a in [0, 25, 7, 12, 25, 3] * 4:
            obs, reward, _, _, info = env.step(a)
            out.append((obs.tolist(), reward, info["batch_size"], info["queue"]))
        return out

    assert episode(make_serve(load="daily:0.2,1.2")) == episode(make_serve(load="daily:0.2,1.2"))


def test_peek_gives_every_action_exactly_and_leaves_the_episode_as_it_was(make_serve):
    """peek(actions) rows equal step(a) from the same state; the episode after peeks equals one without."""
    actions = [0, 25, 7, 12, 25, 3, 24, 18] * 3
    plain = make_serve(load="burst:0.2,1.5")
    peeked = make_serve(load="burst:0.2,1.5")
    plain.reset(seed=3)
    peeked.reset(seed=3)
    env = peeked.unwrapped
    tried = [0, 4, 12, 24, 25]
    for a in actions:
        obs_rows, rewards, truncated = env.peek(tried + [a])
        assert obs_rows.shape == (len(tried) + 1, *env.observation_space.shape) and env.observation_space.contains(obs_rows[0])
        obs, reward, _, trunc, info = peeked.step(a)
        ref = plain.step(a)
        assert (obs.tolist(), reward, trunc, info["batch_size"], info["queue"], info["step_ms"]) == (
            ref[0].tolist(), ref[1], ref[3], ref[4]["batch_size"], ref[4]["queue"], ref[4]["step_ms"])
        assert obs_rows[-1].tolist() == obs.tolist() and rewards[-1] == reward and truncated[-1] == trunc
        if a in tried:  # the same action tried twice in one peek gives one answer
            assert rewards[tried.index(a)] == reward
    assert len(set(np.round(rewards, 9))) > 1  # the actions differ at the last state (not one row copied)


def test_peek_is_refused_outside_an_episode(make_serve):
    env = make_serve().unwrapped
    with pytest.raises(RuntimeError, match="reset"):
        env.peek([0])


# -- the off switch in BiLD-v1 ------------------------------------------------------------------
def test_off_switch_in_bild_v1(make_env):
    env = make_env(actions={"off_switch": True}, backend="replay")
    assert env.action_space.n == 26
    env.reset(seed=0, options={"prompt_index": 0})
    _, _, _, _, info = env.step(25)
    assert info["off"] and info["draft_forwards"] == 0 and info["target_forwards"] == 1 and info["committed"] == 1
    _, _, _, _, info = env.step(0)
    assert not info["off"] and info["draft_forwards"] >= 1  # the draft catches up in one forward, then drafts
    cont = make_env(actions={"off_switch": True, "space": "continuous"})
    assert cont.action_space.shape == (3,)
    cont.reset(seed=0)
    _, _, _, _, info = cont.step(np.array([0.0, 0.0, 0.5], dtype=np.float32))
    assert info["off"]
    _, _, _, _, info = cont.step(np.array([0.0, 0.0, -0.5], dtype=np.float32))
    assert not info["off"]
    with pytest.raises(ValueError, match="3 finite numbers"):
        cont.step(np.zeros(2, dtype=np.float32))


def test_off_steps_keep_bild_exact(agreeing_pair):
    """Switching speculation off and on (the draft catching up on several tokens at once) keeps lossless BiLD
    equal to target-only greedy decoding (float32)."""
    from bild_env import generate_target_only, new_bild_session

    prompt = agreeing_pair.encode("The river rises in the hills and")
    expected = generate_target_only(agreeing_pair, prompt, 30).new_ids
    s = new_bild_session(agreeing_pair, prompt, max_new_tokens=30)
    i = 0
    while not s.done:
        if i % 5 in (1, 2):
            st = s.step_off()
            assert st.draft_forwards == 0 and st.new_tokens == 1
        else:
            s.step(fallback=0.3, rollback=0.5)
        i += 1
    assert s.new_ids == expected
    assert math.isclose(s.total.regret, 0.0)


def test_a_request_that_joins_mid_episode_pays_its_prefill_in_that_step(make_serve):
    """Its target prefill is in the step's trace and in the step's time (once: the trace holds that step only)."""
    from bild_env.serving import clock

    env = make_serve(load="constant:1.0")
    env.reset(seed=1)
    inner = env.unwrapped
    joined_steps = 0
    for _ in range(12):
        before = {id(r) for r in inner.active}
        _, _, _, _, info = env.step(15)
        for r in inner.active:
            prefills = [t for t in r.runner.trace if t[0] == "target" and t[2] == 0]
            assert len(prefills) == (id(r) not in before)  # a prefill exactly in the step it joined
        joined = [r for r in inner.active if id(r) not in before]
        if joined:
            joined_steps += 1
            traces = [list(r.runner.trace) for r in inner.active]
            step_ms, prefill_ms = clock.charge(inner.cost_model, traces)
            assert prefill_ms > 0
    assert joined_steps > 0


# -- an action per domain -----------------------------------------------------------------------
def test_per_domain_env_passes_both_checkers_and_refuses_bad_actions(make_serve):
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check_env

    env = make_serve(actions={"per_domain": True})
    check_env(env.unwrapped, skip_render_check=True)
    sb3_check_env(env.unwrapped)
    assert env.action_space.nvec.tolist() == [26, 26]  # prose, code
    assert env.observation_space.shape == (14 + 2,)  # the domain shares are observed
    env.reset(seed=0)
    for bad in (3, [3], [3, 26], [-1, 0], [0.5, 1.0], [[1, 2]]):
        with pytest.raises(ValueError, match="one integer in \\[0, 26\\) per domain"):
            env.step(bad)
    with pytest.raises(ValueError, match="per_domain"):
        env.unwrapped.peek()
    with pytest.raises(ValueError, match="discrete"):
        make_serve(actions={"per_domain": True, "space": "continuous"})


def test_one_action_for_every_domain_is_the_batch_action_exactly(make_serve):
    """per_domain with the same entry for every domain steps exactly as that action for the batch."""
    batch, each = make_serve(load="burst:0.2,1.5"), make_serve(actions={"per_domain": True}, load="burst:0.2,1.5")
    batch.reset(seed=5)
    each.reset(seed=5)
    for a in [0, 25, 7, 12, 25, 3, 24, 18] * 3:
        ref = batch.step(a)
        got = each.step(np.array([a, a]))
        assert (got[0][:14].tolist(), got[1], got[3]) == (ref[0].tolist(), ref[1], ref[3])
        running = [r.domain for r in each.unwrapped.active]  # then the shares of the domains in the batch now running
        assert got[0][14:].tolist() == pytest.approx([running.count(d) / max(len(running), 1) for d in ("prose", "code")])
        assert got[4]["per_domain"] == {d: ("off" if a == 25 else each.unwrapped.thresholds(a)) for d in ("prose", "code")}
        assert (got[4]["committed"], got[4]["proposed"], got[4]["step_ms"]) == (
            ref[4]["committed"], ref[4]["proposed"], ref[4]["step_ms"])


def test_each_request_takes_its_own_domains_thresholds(make_serve):
    """Speculation off for prose and on for code: only code requests propose draft tokens; the observed
    'off' is the share of the batch that was off, the thresholds the batch's means."""
    env = make_serve(actions={"per_domain": True}, load="constant:1.0")
    env.reset(seed=1)
    seen_mixed = False
    for _ in range(24):
        obs, _, _, truncated, info = env.step(np.array([25, 15]))  # prose off, code (0.45, 0.5)
        n_code = info["domains"].get("code", 0)
        if info["domains"].get("prose", 0) and n_code:
            seen_mixed = True
            share_off = info["domains"]["prose"] / info["batch_size"]
            assert obs[9] == pytest.approx(share_off)
            assert obs[7] == pytest.approx(share_off * 1.0 + (1 - share_off) * 0.45)
        if truncated:
            break
    summary = info["episode_summary"]["domains"]
    assert seen_mixed and summary["code"]["acceptance_rate"] > 0 and summary["prose"]["acceptance_rate"] == 0.0
    assert env.unwrapped.totals.by_domain["prose"]["proposed"] == 0 and env.unwrapped.totals.by_domain["code"]["proposed"] > 0


def test_the_code_domain_takes_the_code_source_given(monkeypatch):
    import bild_env.serving.env as serving_env

    seen = {}

    class Stop(Exception):
        pass

    def workload(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(serving_env, "Workload", workload)
    with pytest.raises(Stop):
        serving_env.ServingEnv(pair="tiny-random", pair_options={"device": "cpu"}, mix="code:1", code_source="stdlib")
    assert seen["code_source"] == "stdlib"


def test_charging_the_decoders_own_work_leaves_target_only_at_zero_and_costs_speculation(make_serve):
    """``charge_loop``: a step is charged as the padded decoder runs it plus its own work per step, forward and row
    read; target-only's reference gets the same forwards and work for its step. So speculation off still earns 0
    every step, and a speculating step from the same state is longer and earns less than without it."""
    import numpy as np

    loop = (1.0, 0.5, 0.2)
    env = make_serve(charging={"charge_loop": loop}, episode_steps=10)
    env.reset(seed=3)
    assert np.allclose([env.step(25)[1] for _ in range(10)], 0.0, rtol=0, atol=1e-9)  # off: exactly target-only
    first = {}
    for charge in ((), loop):
        env = make_serve(charging={"charge_loop": charge}, episode_steps=10)
        env.reset(seed=3)
        _, reward, _, _, info = env.step(15)  # (0.45, 0.5), from the same state
        first[charge] = (reward, info["step_ms"], info["ref_ms"], info["batch_size"])
    assert first[loop][3] == first[()][3] > 0
    assert first[loop][1] > first[()][1] and first[loop][0] < first[()][0]
    with pytest.raises(ValueError, match="charge_loop takes 3 numbers"):
        make_serve(charging={"charge_loop": (1.0, 2.0)})
    with pytest.raises(ValueError, match="finite number >= 0"):
        make_serve(charging={"charge_loop": (1.0, -2.0, 0.0)})
