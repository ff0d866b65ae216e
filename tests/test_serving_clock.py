"""The serving clock on a real batched decoder: the padded charge, the loop's work, schedules replayed exactly."""

from __future__ import annotations

import json

import pytest

from bild_env.serving import clock
from tests.test_serving import toy_batch_costs, workload  # noqa: F401 (the fixture)

# two requests' forwards in one step: r0 drafts 3 (cached 40), is verified, rolls back and emits one more;
# r1 joined this step (target prefill of 20), prefills its draft cache, drafts once more, is verified
TRACES = [
    [("draft", 2, 40), ("draft", 1, 42), ("draft", 1, 43), ("target", 4, 41), ("target", 1, 43)],
    [("target", 20, 0), ("draft", 21, 0), ("draft", 1, 21), ("target", 2, 20)],
]


class Linear:
    """batch_ms = 1 + batch * fed + context / 100: easy to add up by hand."""

    def batch_ms(self, role: str, batch: int, fed: int, context: float) -> float:
        return (1.0 if role == "draft" else 10.0) + batch * fed + context / 100.0


def test_padded_schedule_runs_every_row_and_groups_drafts_by_position():
    assert clock.schedule(TRACES, "padded") == [
        ("draft", 1, 21, 0.0),  # r1's draft prefill, apart
        ("draft", 2, 2, 40.0),  # position 0: r0 fed 2; r1 (prefilled) idle, a pad row
        ("draft", 2, 1, 42.0),  # position 1: r0 and r1 (its first draft after the prefill), the longest context
        ("draft", 2, 1, 43.0),  # position 2: r0 alone, r1 idle
        ("target", 1, 20, 0.0),  # r1's prefill when it joined
        ("target", 2, 4, 41.0),  # the verification, padded to r0's 4
        ("target", 2, 1, 43.0),  # r0's rollback forward, r1 idle
    ]
    # the env's charge: the draft batch shrinks, r1's first draft forward groups with r0's first
    assert clock.schedule(TRACES) == [
        ("draft", 1, 21, 0.0), ("draft", 2, 2, 30.5), ("draft", 1, 1, 42.0), ("draft", 1, 1, 43.0),
        ("target", 1, 20, 0.0), ("target", 2, 4, 30.5), ("target", 1, 1, 43.0),
    ]
    with pytest.raises(ValueError, match="layout"):
        clock.schedule(TRACES, "packed")


def test_padded_charge_and_loop_by_hand():
    # draft: (1 + 21) + (1 + 4 + .40) + (1 + 2 + .42) + (1 + 2 + .43)
    # target: (10 + 20) + (10 + 8 + .41) + (10 + 2 + .43)
    draft = 22.0 + 5.40 + 3.42 + 3.43
    target = 30.0 + 18.41 + 12.43
    total, prefill = clock.charge(Linear(), TRACES, "padded")
    assert total == pytest.approx(draft + target)
    assert prefill == pytest.approx(30.0)
    # row reads: prefills 1 + 1; target 2 * 4 + 2 * 1; draft rows served 3 (r0) + 1 (r1): 16; 7 forwards, 1 step
    assert clock.loop_counts(TRACES) == (1, 7, 16)
    loop = clock.BatchLoop(step_ms=0.5, forward_ms=0.25, row_ms=0.1)
    with_loop, prefill2 = clock.charge(Linear(), TRACES, "padded", loop)
    assert with_loop == pytest.approx(draft + target + 0.5 + 7 * 0.25 + 16 * 0.1)
    assert prefill2 == prefill
    assert clock.charge(Linear(), [], "padded", loop) == (0.0, 0.0)


def test_fit_loop_recovers_known_costs_and_refuses_bad_input():
    truth = clock.BatchLoop(step_ms=0.8, forward_ms=0.3, row_ms=0.05)
    counts = [(1, f, r) for f in (2, 5, 9) for r in (4, 30, 120)]
    fitted = clock.fit_loop(counts, [truth(c) for c in counts])
    for name, value in truth.to_dict().items():
        assert getattr(fitted, name) == pytest.approx(value, abs=1e-9)
    with pytest.raises(ValueError, match="one"):
        clock.fit_loop([(1, 2)], [1.0])
    with pytest.raises(ValueError, match="row_ms"):
        clock.BatchLoop(row_ms=-1.0)


@pytest.fixture
def serve(workload):
    from bild_env.serving.env import ServingEnv

    env = ServingEnv(pair="tiny-random", pair_options={"device": "cpu"}, cost_model=toy_batch_costs(), workload=workload,
                     max_new_tokens=10, max_batch=6, episode_steps=10, load="constant:1.0")
    yield env
    env.close()


@pytest.mark.parametrize("action", [3, 25])  # BiLD 0.103/2.5 (rollbacks on the tiny pair), speculation off
def test_replayed_schedule_is_exact_and_runs_the_padded_charge(serve, action):
    from agents.serve.rules import Fixed
    from scripts.analysis.serving_clock import ScheduleReplay, record_schedule, run_interleaved

    schedule = record_schedule(serve, Fixed(action), seed=3)
    assert schedule.warm and any(s.joins for s in schedule.steps)  # requests under way at reset, and joining
    assert all(s.action == serve.decode(action) and (s.action.kind == "off") == (action == 25) for s in schedule.steps)
    replay = ScheduleReplay(serve.pair, schedule, serve.config.actions.max_draft_len)
    (times,) = run_interleaved([replay])
    assert len(times) == len(schedule.steps)
    same, n = replay.same_tokens()
    assert same == n > 0  # float32: every request's tokens are the env's
    for step, t in zip(schedule.steps, times):
        assert t.tokens == step.tokens
        # the decoder runs exactly the forwards the padded charge counts: same roles, rows, tokens fed
        modelled = sorted((r, b, f) for r, b, f, _ in clock.schedule(step.traces, "padded"))
        assert sorted((f.role, f.rows, f.fed) for f in t.forwards) == modelled
        assert t.wall_ms >= t.forward_ms > 0


def test_bench_reports_every_model_with_the_noise_floor(tmp_path, monkeypatch):
    import bild_env.decoding.costs as costs
    from scripts.analysis.serving_clock import MODELS, main

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())
    out = tmp_path / "sc.json"
    report = main(["--pair", "tiny-random", "--mix", "prose:1", "--levels", "0.3", "1.0", "--episode-steps", "4",
                   "--max-batch", "4", "--max-new-tokens", "6", "--out", str(out)])
    assert json.loads(out.read_text())["machine"]
    assert [row["level"] for row in report["levels"]] == [0.3, 1.0]
    for row in report["levels"]:
        assert set(row["models"]) == set(MODELS)
        assert set(row["noise_floor"]) == {"policy_again", "target_only_again", "ratio_of_ratios_again"}
        assert row["loop_fitted_on"] == "other levels"
        assert all(r["same_tokens"].split("/")[0] == r["same_tokens"].split("/")[1] for r in row["runs"].values())
        assert all(m["goodput_measured_tok_s"] > 0 for m in row["models"].values())
    with pytest.raises(ValueError, match="--action or --table or --batch-table"):
        main(["--pair", "tiny-random", "--action", "3", "--table", "0.3:3", "--out", str(out)])
