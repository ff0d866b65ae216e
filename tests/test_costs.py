"""The latency cost model: linear special case, measured tables, persistence, calibration on the tiny pair."""

from __future__ import annotations

import json
import logging

import pytest

from bild_env.decoding import costs
from bild_env.decoding.costs import CostModel, ForwardCost, calibrate, load_or_calibrate

LINEAR = CostModel(draft=(1.0, 0.1, 0.001), target=(4.0, 0.5, 0.004), device="test")
TABLE = ForwardCost(fed=(1, 2, 3, 4, 8, 12, 16, 32), ms=(40.5, 66.0, 80.8, 62.2, 58.7, 70.0, 90.0, 150.0),
                    per_context_ms=0.02, ref_context=64)


def test_a_linear_model_is_exactly_a_plus_b_fed_plus_c_context():
    for fed in range(1, 70):
        for context in (0, 1, 7, 64, 333):
            assert LINEAR.ms("draft", fed, context) == 1.0 + 0.1 * fed + 0.001 * context
            assert LINEAR.ms("target", fed, context) == 4.0 + 0.5 * fed + 0.004 * context
    assert LINEAR == CostModel(draft=ForwardCost.linear(1.0, 0.1, 0.001), target=ForwardCost.linear(4.0, 0.5, 0.004),
                               device="test")
    assert LINEAR.target.line == (4.0, 0.5) and LINEAR.target.per_context_ms == 0.004
    assert LINEAR.batch_costs("draft") == (1.0, 0.1) and LINEAR.batch_costs("target") == (4.0, 0.5)
    with pytest.raises(ValueError, match="role"):
        LINEAR.ms("drafter", 1, 0)


def test_a_table_reproduces_its_points_and_interpolates_between_them():
    model = CostModel(draft=TABLE, target=TABLE, device="test")
    for fed, ms in zip(TABLE.fed, TABLE.ms):
        assert model.ms("target", fed, 64) == ms  # exactly, at the reference context
        assert model.ms("target", fed, 164) == pytest.approx(ms + 100 * 0.02)
        assert model.ms("target", fed, 14) == pytest.approx(ms - 50 * 0.02)
    assert model.ms("target", 6, 64) == pytest.approx((62.2 + 58.7) / 2)  # halfway from 4 to 8
    assert model.ms("target", 5, 64) == pytest.approx(62.2 + (58.7 - 62.2) / 4)
    assert model.ms("target", 24, 64) == pytest.approx(120.0)  # halfway from 16 to 32
    assert model.ms("target", 64, 64) == pytest.approx(150.0 + 32 * (150.0 - 90.0) / 16)  # beyond: the last two points
    fixed, per_token = model.batch_costs("target")
    assert per_token == pytest.approx((70.0 - 40.5) / 11) and fixed == pytest.approx(40.5 - per_token)
    with pytest.raises(ValueError, match="ascending"):
        ForwardCost(fed=(2, 1), ms=(1.0, 2.0))


@pytest.mark.parametrize("model", [LINEAR, CostModel(draft=TABLE, target=TABLE, device="test")])
def test_target_only_ms_is_the_sum_of_one_token_forwards(model):
    for first, n in ((1, 1), (5, 1), (33, 64), (200, 17)):
        assert model.target_only_ms(first, n) == pytest.approx(sum(model.ms("target", 1, q - 1) for q in range(first, first + n)))
    assert LINEAR.target_only_ms(33, 64) == 64 * (4.0 + 0.5) + 0.004 * (64 * 32 + 64 * 63 / 2)  # as before, exactly


def test_save_and_load_round_trip_to_an_equal_model(tmp_path):
    for model in (LINEAR, CostModel(draft=TABLE, target=ForwardCost.linear(4.0, 0.5, 0.004), device="cpu:x:2threads")):
        path = tmp_path / "costs.json"
        model.save(path)
        assert json.loads(path.read_text())["format"] == 2
        again = CostModel.load(path)
        assert again == model and hash(again) == hash(model)
        assert again.ms("draft", 7, 99) == model.ms("draft", 7, 99)


@pytest.mark.parametrize("stored", ['{"draft": [1, 2, 3], "target": [4, 5, 6], "device": "cpu"}',  # format 1
                                    '{"format": 3, "draft": {}, "target": {}, "device": "cpu"}',
                                    "not json at all {"])
def test_a_stored_model_of_another_format_is_recalibrated_with_a_message(tiny_pair, monkeypatch, caplog, stored,
                                                                         tmp_path):
    monkeypatch.setenv("BILD_ENV_CACHE", str(tmp_path))  # the fake model below must not reach other tests
    path = costs.cost_path(tiny_pair)
    assert path.is_relative_to(tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(stored)
    fresh = CostModel(draft=TABLE, target=TABLE, device="fresh")
    calls = []
    monkeypatch.setattr(costs, "calibrate", lambda pair: calls.append(pair) or fresh)
    with caplog.at_level(logging.WARNING, logger="bild_env.decoding.costs"):
        assert load_or_calibrate(tiny_pair) == fresh
    assert calls == [tiny_pair]
    message = " ".join(r.getMessage() for r in caplog.records)
    assert str(path) in message and "format 2" in message
    if "format" in stored:
        assert f"format {json.loads(stored).get('format', 1)}" in message
    assert CostModel.load(path) == fresh  # replaced by the new one
    assert load_or_calibrate(tiny_pair) == fresh and len(calls) == 1  # and that one is reused


def test_calibrate_times_every_fed_count_on_the_tiny_pair(tiny_pair):
    model = calibrate(tiny_pair, contexts=(8, 24), repeats=2, prefill=(16, 32), progress=False)
    for role in ("draft", "target"):
        cost = getattr(model, role)
        assert cost.fed == tuple(range(1, 13)) + (16, 32) and cost.ref_context == 16
        assert all(ms > 0 for ms in cost.ms) and cost.per_context_ms >= 0
        assert [model.ms(role, f, 16) for f in cost.fed] == list(cost.ms)
        fixed, per_token = model.batch_costs(role)
        assert fixed > 0 and per_token >= 0
    assert model.device.startswith("cpu")


def test_fit_table_moves_each_count_to_the_reference_context():
    # ms = T(fed) + 0.5 * context, timed at contexts 10 and 30 (reference 20); a prefill of 16 at context 0
    t = {1: 5.0, 2: 9.0, 3: 7.0}
    rows = [(f, c, t[f] + 0.5 * c) for c in (10, 30) for f in t]
    cost = costs.fit_table(rows, [(16, 0, 40.0)])
    assert cost.ref_context == 20 and cost.per_context_ms == pytest.approx(0.5)
    for f in t:
        assert cost(f, 10) == pytest.approx(t[f] + 5.0)
    assert cost(16, 0) == pytest.approx(40.0)
