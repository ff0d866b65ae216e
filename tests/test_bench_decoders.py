"""bench/decoders.py: the speculative-decoding limit it prints beside the measured speedup."""

from __future__ import annotations

import pytest

from bench import decoders
from bild_env.decoding.costs import CostModel, ForwardCost


def test_the_limit_is_expected_tokens_per_step_time_against_one_target_forward_per_token():
    cost = CostModel(draft=ForwardCost.linear(1.0, 0.0, 0.0), target=ForwardCost.linear(9.0, 1.0, 0.0), device="test")
    # a = 0.5, k = 2: (1 - 0.5^3) / 0.5 = 1.75 tokens per step of 2 draft forwards (2 ms) + a target fed 3 (12 ms);
    # target only: one token per 10 ms forward
    assert decoders.sd_limit_speedup(cost, 0.5, 2, 40) == pytest.approx(1.75 * 10.0 / 14.0)
    assert decoders.sd_limit_speedup(cost, 1.0, 3, 40) == pytest.approx(4 * 10.0 / (3 + 13.0))  # all accepted
    assert decoders.sd_limit_speedup(cost, 0.0, 4, 40) == pytest.approx(10.0 / (4 + 14.0))  # none: one token per step
