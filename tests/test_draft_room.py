"""The draft-room analysis: the acceptance naive SD needs to break even, and the bench rows it reads."""

import math

import pytest

from bild_env.command import UsageError
from scripts.analysis.draft_room import breakeven, naive_rows, parse_shape


def test_breakeven_solves_the_limit_at_one():
    # k=1, c=0.5, v=1: (1 + a) / 1.5 = 1 at a = 0.5
    assert breakeven(1, 0.5, 1.0) == pytest.approx(0.5, abs=1e-9)
    # k=2, c=0.25, v=1.5: (1 + a + a^2) / 2 = 1 at the golden ratio's inverse
    assert breakeven(2, 0.25, 1.5) == pytest.approx((math.sqrt(5) - 1) / 2, abs=1e-9)
    # a step dearer than 2 tokens' worth never pays: k=1, c=1, v=1.5 gives at most 2 / 2.5
    assert breakeven(1, 1.0, 1.5) is None


def test_naive_rows_reads_each_domain_acceptance_and_verification_cost():
    row = {"limit_speedup": 0.9, "acceptance_rate": 0.75, "verify_ratio": 2.35}
    bench = {"reports": [{"domains": {"code": {"results": {
        "naive SD (k=3)": row, "naive SD (k<=6, stop<0.5)": {**row, "limit_speedup": None},
        "BiLD (0.45/0.5)": {**row, "limit_speedup": None}, "target only": {"limit_speedup": None}}}}}]}
    assert naive_rows(bench) == {"code": {3: (0.75, 2.35)}}


@pytest.mark.parametrize("text", ["6", "6x", "0x256", "3x100", "axb"])
def test_a_bad_shape_is_refused_naming_the_form(text):
    with pytest.raises(UsageError, match="--shapes"):
        parse_shape(text)
    assert parse_shape("6x256") == (6, 256)


@pytest.mark.parametrize("content", [None, "{}", "not json", '{"reports": [{"domains": {}}]}'])
def test_a_missing_or_unusable_bench_is_refused_saying_what_to_give(tmp_path, content):
    from scripts.analysis.draft_room import read_bench

    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UsageError, match="--bench .*give a bench.decoders JSON"):
        read_bench(str(path))
