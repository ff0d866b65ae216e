"""Drafting allocated across a batch (``ServingConfig.allocate``): the depth rule by hand, the session's depth stop,
and the env serving exactly under it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from bild_env.decoding import allocation
from bild_env.serving import clock
from tests.test_serving import make_serve, workload  # noqa: F401 (the fixtures)
from tests.test_serving_clock import Linear

RUNS = [[0.9, 0.9, 0.5], [0.8, 0.2]]  # two requests' per-token scores along the runs their drafts would propose


def test_allocate_depth_by_hand():
    # Linear: target 10 + batch * fed + context / 100, draft 1 + batch * fed + ...; at context 0, batch 2:
    # a token is worth target-only's 12 ms / 2 = 6 ms. Depth 1: cumulative 0.9 + 0.8 = 1.7 -> 10.2 ms; its cost the
    # verification's extra column (2 ms) and the draft forward of depth 2 (both rows go on: 1 + 2 = 3 ms): 5 ms.
    # Depth 2: 0.81 + 0.16 -> 5.82 ms against 2 + 3 (padded: r1 rides along) = 5. Depth 3: 0.405 -> 2.43 against 2
    # (the last depth any run has: no draft forward after it). Depth 4: nobody drafts.
    for padded in (True, False):
        assert allocation.allocate_depth(RUNS, 0.5, Linear(), 2, 0.0, 4, padded) == 3
    # price 0.6 (odds 1.5): depth 1 10.2 * 0.4 >= 5 * 0.6; depth 2 5.82 * 0.4 = 2.33 < 3: the batch proposes 1
    assert allocation.allocate_depth(RUNS, 0.6, Linear(), 2, 0.0, 4, True) == 1
    # the shrinking batch drafts depth 3 with r0 alone (2 ms, not 3): at 0.54 depth 2 then costs 4 and passes
    # (5.82 * 0.46 = 2.68 >= 4 * 0.54 = 2.16), where the padded batch (5 * 0.54 = 2.7) stops; depth 3 passes
    # (2.43 * 0.46 = 1.118 >= 2 * 0.54 = 1.08)
    assert allocation.allocate_depth(RUNS, 0.54, Linear(), 2, 0.0, 4, False) == 3
    assert allocation.allocate_depth(RUNS, 0.54, Linear(), 2, 0.0, 4, True) == 1
    # the decoder's work: depth 1 also pays 2 rows read (1 ms) and a forward with 2 rows read (1 + 1): 8 ms, passes;
    # depth 2 pays 2 + 1 + 3 + 1 + 0.5 (one row read) = 7.5 > 5.82: stops
    loop = clock.BatchLoop(step_ms=0.0, forward_ms=1.0, row_ms=0.5)
    assert allocation.allocate_depth(RUNS, 0.5, Linear(), 2, 0.0, 4, True, loop) == 1
    # price 0 drafts as far as the runs and max_draft_len go; price 1 proposes nothing
    assert allocation.allocate_depth(RUNS, 0.0, Linear(), 2, 0.0, 2, True) == 2
    assert allocation.allocate_depth(RUNS, 1.0, Linear(), 2, 0.0, 4, True) == 0
    # one sure token: in a batch of 2 it is worth 12 / 2 = 6 ms against a column of 2 rows (2 ms); in a batch of 4
    # (rows that draft nothing ride along) 14 / 4 = 3.5 ms against a column of 4 rows (4 ms)
    assert allocation.allocate_depth([[1.0]], 0.5, Linear(), 2, 0.0, 4, True) == 1
    assert allocation.allocate_depth([[1.0]], 0.5, Linear(), 4, 0.0, 4, True) == 0
    with pytest.raises(ValueError, match=r"price must be in \[0, 1\]"):
        allocation.allocate_depth(RUNS, 1.5, Linear(), 2, 0.0, 4)
    with pytest.raises(ValueError, match="hold every run"):
        allocation.allocate_depth(RUNS, 0.5, Linear(), 1, 0.0, 4)


def test_a_depth_stops_the_run_withholds_the_next_prediction_and_stays_exact(agreeing_pair):
    from bild_env import generate_target_only, new_bild_session

    prompt = agreeing_pair.encode("The river rises in the hills and")
    expected = generate_target_only(agreeing_pair, prompt, 30).new_ids
    s = new_bild_session(agreeing_pair, prompt, max_new_tokens=30, max_draft_len=4)
    depths = [0, 1, 2, 3, 4]
    i = 0
    while not s.done:
        depth = depths[i % len(depths)]
        before = s.remaining
        st = s.step(fallback=0.0, rollback=0.5, depth=depth)
        assert st.proposed <= depth
        if st.proposed == depth < 4 and before > depth:  # stopped by the depth: its next prediction drafted, withheld
            assert st.fallbacks == 1 and st.draft_forwards >= 1
        if depth == 0:
            assert st.proposed == 0 and st.new_tokens == 1
        i += 1
    assert s.new_ids == expected
    assert math.isclose(s.total.regret, 0.0)
    s = new_bild_session(agreeing_pair, prompt, max_new_tokens=4)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="depth must be a whole number"):
            s.step(0.0, 0.5, bad)


def test_allocated_serving_is_exact_checked_and_follows_the_price(make_serve, workload, tiny_pair):
    """``allocate``: the fallback values are prices. Price 1 proposes nothing (every speculating step drafts one
    depth and withholds it); price 0 drafts every request to max_draft_len (or its end); every finished request is
    target-only greedy decoding of its prompt (rollback 0.5 nats)."""
    from gymnasium.utils.env_checker import check_env

    from bild_env import generate_target_only

    check_env(make_serve(allocate=True).unwrapped, skip_render_check=True)
    env = make_serve(allocate=True, fallback_values=(0.0, 0.5, 1.0), rollback_values=(0.5,), max_draft_len=3,
                     max_new_tokens=10, episode_steps=40, load="constant:0.8")
    env.reset(seed=1)
    rng = np.random.default_rng(0)
    finished, full = [], 0
    for _ in range(40):
        action = int(rng.integers(4))  # price 0, 0.5, 1 or off
        _, _, _, truncated, info = env.step(action)
        finished += info["finished"]
        if action == 2:
            assert info["proposed"] == 0
        if action == 0:
            assert info["proposed"] <= 3 * info["batch_size"]
            full += info["proposed"] == 3 * info["batch_size"]
    assert full >= 1 and len(finished) >= 5
    for f in finished:
        prompt = workload.prompts[f["domain"]][f["prompt_index"]]
        assert f["new_ids"] == generate_target_only(tiny_pair, prompt, 10).new_ids
        assert f["regret_per_token"] == 0.0
    with pytest.raises(ValueError, match="allocate sets one price"):
        make_serve(allocate=True, per_domain=True)


@pytest.fixture
def allocating(workload):  # noqa: F811 (the fixture)
    from bild_env.serving.env import ServingEnv
    from tests.test_serving import toy_batch_costs

    env = ServingEnv(pair="tiny-random", device="cpu", cost_model=toy_batch_costs(), workload=workload,
                     max_new_tokens=10, max_batch=6, episode_steps=10, load="constant:1.0", allocate=True,
                     fallback_values=(0.0, 0.5), rollback_values=(2.5,), max_draft_len=4)
    yield env
    env.close()


@pytest.mark.parametrize("action", [0, 1])  # price 0 (every run to 4), price 0.5; rollback 2.5 (rollbacks on the tiny pair)
def test_the_batched_decoder_replays_the_allocated_depths_exactly(allocating, action):
    """``scripts.analysis.serving_clock`` replays an allocated episode through ``BatchedDecoder.step(depth=)``: every request's
    tokens are the env's (float32) and every step runs the forwards the padded charge counts."""
    from agents.serve.rules import Fixed
    from scripts.analysis.serving_clock import ScheduleReplay, record_schedule, run_interleaved

    schedule = record_schedule(allocating, Fixed(action), seed=3)
    depths = [s.depth for s in schedule.steps]
    assert all(d is not None and 0 <= d <= 4 for d in depths)
    if action == 0:
        assert max(depths) == 4
    replay = ScheduleReplay(allocating.pair, schedule, allocating.config.max_draft_len)
    (times,) = run_interleaved([replay])
    same, n = replay.same_tokens()
    assert same == n > 0
    for step, t in zip(schedule.steps, times):
        assert t.tokens == step.tokens
        modelled = sorted((r, b, f) for r, b, f, _ in clock.padded_schedule(step.traces))
        assert sorted((f.role, f.rows, f.fed) for f in t.forwards) == modelled


def test_the_batched_decoder_refuses_a_bad_depth(tiny_pair):
    from bild_env.decoding.batched import BatchedDecoder

    d = BatchedDecoder(tiny_pair, 4)
    d.add([1, 2, 3], 4)
    with pytest.raises(ValueError, match="depth must be a whole number"):
        d.step(0.0, 0.5, depth=-1)


def test_the_live_decoder_allocates_by_price_and_stays_exact(agreeing_pair):
    """``BatchedDecoder.step(price=)``: price 1 proposes nothing (one draft forward, its tokens withheld), price 0
    drafts every run to ``max_draft_len``; at any price every request is target-only greedy decoding (rollback 0.5,
    float32), and a session replaying each step's ``last_depth`` makes the same tokens."""
    from bild_env import generate_target_only
    from bild_env.decoding.batched import BatchedDecoder
    from bild_env.decoding.bild import BildSession
    from bild_env.decoding.runner import LiveRunner
    from tests.test_serving import toy_batch_costs

    texts = ["The river rises in the hills and", "def add(a, b):", "Once upon a time there"]
    prompts = [agreeing_pair.encode(t) for t in texts]
    d = BatchedDecoder(agreeing_pair, 4)
    d.join(prompts, 12)
    with pytest.raises(ValueError, match="set the decoder's allocation"):
        d.step(0.0, 0.5, price=0.5)
    d.allocation = (toy_batch_costs(), clock.BatchLoop(0.1, 0.1, 0.01))
    with pytest.raises(ValueError, match=r"price must be in \[0, 1\]"):
        d.step(0.0, 0.5, price=1.5)
    stats = d.step(0.0, 0.5, price=1.0)
    assert d.last_depth == 0 and all(s.proposed == 0 and s.draft_forwards >= 1 for s in stats.values())
    stats = d.step(0.0, 0.5, price=0.0)
    assert d.last_depth == 4 and all(s.proposed == 4 for s in stats.values())
    depths = [0, 4]
    while len(d):
        d.step(0.0, 0.5, price=0.5)
        depths.append(d.last_depth)
    for rid, prompt in zip(range(3), prompts):
        assert d.finished[rid].new_ids == generate_target_only(agreeing_pair, prompt, 12).new_ids
    session = BildSession(LiveRunner(agreeing_pair), prompts[0], 12, agreeing_pair.eos_token_ids, 4)
    for depth in depths:
        if session.done:
            break
        session.step(0.0, 0.5, depth)
    assert session.new_ids == d.finished[0].new_ids


def test_the_serving_bench_sets_the_allocations_rules_beside_the_thresholds_table(tmp_path, monkeypatch):
    """``evaluate.py --env serve --allocate``: the rules' actions are prices (labelled so), and the thresholds' per-batch-size
    table chosen on validation runs beside them, every row paired with it."""
    import bild_env.decoding.costs as costs
    from agents.serve.evaluation import main
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())
    out = tmp_path / "serving.json"
    report = main(["--pair", "tiny-random", "--levels", "0.1", "1.0", "--moving", "burst:0.1,1.0", "--allocate",
                   "--select-episodes", "2", "--episodes", "2", "--episode-steps", "6", "--max-new-tokens", "6",
                   "--max-batch", "4", "--actions", "0", "15", "--max-prompts", "6", "--no-bandits", "--out", str(out)])
    assert set(report["chosen"]["threshold_batch_table"].values()) <= {"(0.103, 0.5)", "(0.45, 0.5)", "off"}
    assert all(v.startswith("(price ") or v == "off" for v in report["chosen"]["table"].values())
    for rows in list(report["levels"].values()) + [report["overall"]] + list(report["moving"].values()):
        names = [r["policy"].split(" (")[0] for r in rows]
        assert "per-batch-size table" in names and "per-batch-size table of thresholds" in names
        mine = next(r for r in rows if r["policy"].startswith("per-batch-size table of thresholds"))
        assert mine["minus_threshold_table"] == 0.0
        assert all("minus_threshold_table_ci" in r for r in rows)


def test_the_load_clock_runs_the_price_rule_live_and_exactly(tmp_path, monkeypatch):
    """``evaluate.py --env serve --clock --load --allocate``: the tables' prices run in the decoder (``step(price=)``), the
    thresholds' table beside them; in float32 every request's tokens are the env's under the depths the decoder
    chose, and lossless ones the target's greedy tokens."""
    import bild_env.decoding.costs as costs
    from agents.commands import evaluate_main as main
    from tests.test_serving import toy_batch_costs
    from tests.test_serving_load_clock import TINY

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())
    out = tmp_path / "clock.json"
    assert main(["--env", "serve", "--clock", "--load", "0.3", "--allocate", "--table", "0.3:15", "--batch-table", "0:15,1:5",
                 "--threshold-batch-table", "0:15", "--charge-loop", "0.1", "0.1", "0.01", "--out", str(out)] + TINY) == 0
    methods = json.loads(out.read_text())["levels"]["0.3"]["methods"]
    assert "per-batch-size table of thresholds" in methods and "BiLD fixed (0.103, 4.697)" in methods
    for name in ("per-load table", "per-batch-size table", "per-batch-size table of thresholds"):
        for r in methods[name]["runs"]:
            n = len(r["requests"])
            assert r["equal_env"] == f"{n}/{n}" and r["equal_greedy"] == f"{n}/{n}"
            prices = [k for k in r["actions"] if k != "off"]
            assert prices and all(k.startswith("(price") == (name != "per-batch-size table of thresholds")
                                  for k in prices)
    with pytest.raises(SystemExit):
        main(["--env", "serve", "--clock", "--load", "0.3", "--threshold-batch-table", "0:15", "--out", str(out), "--force"] + TINY)
