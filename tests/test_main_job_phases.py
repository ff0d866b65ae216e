"""The main job's phases (train.py --env serve): a progress line per phase, the time left, peak memory at the end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from agents.common.phases import Phases, peak_memory_mb


def test_a_phase_says_when_it_starts_how_far_it_is_and_when_it_ends():
    lines = []
    phases = Phases(("load", "work"), say=lines.append, every_s=0.0)
    phases.skip("load", "cached")
    with phases.phase("work", unit="step", total=4) as bar:
        bar.update(1)
        bar.total += 4  # more work found on the way
        bar.update(1)
    assert lines[0] == "[1/2] load: skipped (cached)" and lines[1].startswith("[2/2] work: started")
    assert "1/4 steps" in lines[2] and "left" in lines[2] and "2/8 steps" in lines[3]
    assert lines[-1].startswith("[2/2] work: done in") and "peak memory" in lines[-1]
    summary = phases.summary()
    assert summary["phases"]["work"]["units"] == 2 and summary["phases"]["load"]["skipped"] == "cached"
    assert summary["peak_memory_mb"]["max"] >= summary["peak_memory_mb"]["self"] > 0
    with pytest.raises(ValueError, match="unknown phase"):
        with phases.phase("rest"):
            pass
    with pytest.raises(KeyboardInterrupt):  # a phase cut short says so, not "done"
        with phases.phase("work") as bar:
            bar.update(1)
            raise KeyboardInterrupt
    assert lines[-1].startswith("[2/2] work: stopped after") and phases.summary()["phases"]["work"]["stopped"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def unit_costs(kind: str, total: int) -> list[float]:
    """Seconds per unit of work whose rate varies: ``lazy`` the main job's first training steps (1.3% of the units
    at 180x the cost: trees filled on the way); ``slow_start`` 5% at 5x; ``waves`` the rate halving and doubling in
    turns every 5% of the units; ``slowing`` and ``speeding`` a cost growing from 1 to 3 or falling from 3 to 1."""
    x = np.arange(total) / total
    return {"lazy": np.where(x < 0.0128, 180.0, 1.0), "slow_start": np.where(x < 0.05, 5.0, 1.0),
            "waves": np.where((x // 0.05) % 2 == 0, 1.0, 2.0), "slowing": 1 + 2 * x, "speeding": 3 - 2 * x}[kind].tolist()


@pytest.mark.parametrize("kind", ["lazy", "slow_start", "waves", "slowing", "speeding"])
@pytest.mark.parametrize("per_report", [1, 4])
def test_the_time_left_never_exceeds_three_times_the_real_time_left_after_the_first_tenth(kind, per_report):
    from agents.common.phases import PhaseBar

    total, clock = 2_000, FakeClock()
    costs = unit_costs(kind, total)
    bar = PhaseBar("work", "step", say=lambda _: None, every_s=1e9, total=total, clock=clock)
    assert bar.left_s() is None and "estimating" in bar.line()
    ends = np.cumsum(costs)
    for i in range(per_report, total + 1, per_report):
        clock.now = float(ends[i - 1])
        bar.update(per_report)
        left, real = bar.left_s(), float(ends[-1] - ends[i - 1])
        if i < bar.MIN_DONE * total:
            assert left is None and "estimating the time left" in bar.line()
        elif i >= 0.1 * total:
            assert left is not None and left <= 3 * real + 1e-9, (i, left, real)
    assert bar.left_s() == 0 and bar.n == bar.total == total


def test_the_count_never_passes_its_total_and_a_plan_holds_the_work_announced_on_the_way():
    from agents.common.phases import PhaseBar

    lines = []
    bar = PhaseBar("work", "forward", say=lines.append, every_s=0.0, clock=FakeClock())
    bar.plan(10)
    bar.total += 6  # announced by a part of the work the plan already counted
    bar.expect(4)
    assert bar.total == 10
    bar.update(12)  # more than the plan: the total follows
    assert bar.total == 12 and lines[-1].startswith("work: 12/12 forwards")
    bar.expect(5)  # announced past the plan: 6 + 4 + 5 = 15
    assert bar.total == 15


def test_the_main_job_prints_its_phases_and_writes_their_times_and_peak_memory(tmp_path, monkeypatch, capsys):
    import bild_env.decoding.costs as costs
    from agents.serve.training import PHASES
    from tests.test_serving import train_serve as main
    from tests.test_serving import toy_batch_costs

    monkeypatch.setattr(costs, "load_or_calibrate_batched", lambda pair, **_: toy_batch_costs())  # no timing in a test
    args = ["--pair", "tiny-random", "--total-timesteps", "80", "--n-envs", "2", "--eval-freq", "80",
            "--eval-episodes", "1", "--max-new-tokens", "8", "--max-batch", "4", "--episode-steps", "8",
            "--hyperparams", "learning_starts=20", "batch_size=16", "--mix", "prose:1", "--no-progress-bar",
            "--log-dir", str(tmp_path), "--run-name", "r"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for i, name in enumerate(PHASES, 1):
        assert f"train.py: [{i}/{len(PHASES)}] {name}: started" in out
        assert f"train.py: [{i}/{len(PHASES)}] {name}: done in" in out
    tail = out[out.index("run written to"):].splitlines()
    head = tail.index("the agent against the rules on the run's 4 validation episodes (mean [95% interval]; the rules "
                      "chosen on these same episodes):")
    assert tail[head + 1].split()[:5] == ["method", "goodput", "vs", "target-only", "(x)"]
    assert [line.split()[:2] for line in tail[head + 2: head + 4]] == [["agent", "on"], ["agent", "(best)"]]
    assert [line.split()[0] for line in tail[head + 4: head + 7]] == ["batch_table", "load_table", "best_fixed"]
    assert tail[-3:] == ["next:", f"  python evaluate.py --env serve --model {tmp_path / 'r'}   # the agent beside the "
                         "rules on test episodes", f"  tensorboard --logdir {tmp_path}   # the curves; the \"serving\" "
                         "tab draws the agent beside the rules"]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    table = summary["result"]["table"]
    floor = summary["floor"]  # the agent on the per-batch-size table's floor, first; the table itself where no margin helped
    assert table[0]["method"] == "agent on the floor" and table[0]["return"] == floor["return"] and floor["episodes"] == 4
    assert floor == json.loads((tmp_path / "r" / "floor.json").read_text())
    if floor["margin"] == "inf":
        assert floor["return"] == summary["references"]["batch_table"]["return"]
    assert table[1]["method"] == "agent (best)" and table[1]["step"] == summary["best_evaluation"]["step"]
    assert {row["method"] for row in table[2:]} == set(summary["references"])  # the agent's single evaluation, the rules
    for row in table[1:]:  # 1 episode at each of the 4 load levels
        ref = summary["references"].get(row["method"]) or summary["best_evaluation"]
        assert row["return"] == ref["return"] and row["speedup"] == ref["speedup"] and row["episodes"] == 4
        assert row["return_ci"][0] <= row["return"] <= row["return_ci"][1]
        assert row["speedup_ci"][0] <= row["speedup"] <= row["speedup_ci"][1]
    assert list(summary["phases"]) == list(PHASES) and summary["steps"] == 80
    assert all(p["wall_s"] >= 0 and p["cpu_s"] >= 0 for p in summary["phases"].values())
    assert summary["total_wall_s"] >= sum(p["wall_s"] for p in summary["phases"].values()) - 1
    assert summary["peak_memory_mb"]["max"] > 0 and summary["peak_memory_mb"]["max"] <= peak_memory_mb()["max"]
    assert summary["last_evaluation"]["step"] == 80 and "load_table" in summary["references"]


@pytest.mark.parametrize("dtype, steps", [("float32", 8_000), ("bfloat16", 20_000)])
def test_the_default_run_length_follows_the_dtype(dtype, steps):
    from dataclasses import replace

    from agents.spec import preset_env
    from agents.serve.options import default_timesteps

    assert default_timesteps(replace(preset_env("serve"), pair_options={"dtype": dtype, "device": "cpu"})) == steps


def test_the_result_table_names_every_field_and_reads_the_bare_pairs_of_older_summaries():
    from agents.serve.run_report import comparison, format_table, reference_values

    history = [{"step": 100, "return": 0.3, "speedup": 1.08, "return_ci": [0.2, 0.4], "speedup_ci": [1.06, 1.1],
                "episodes": 32},
               {"step": 200, "return": 0.1, "speedup": 1.05, "return_ci": [0.0, 0.2]}]  # an older row: no speedup_ci
    references = {"off": [0.0, 1.0],  # an older summary's bare pair
                  "best_fixed": {"return": 0.2, "return_ci": [0.1, 0.3], "speedup": 1.07, "speedup_ci": [1.0, 1.1],
                                 "episodes": 32},
                  "fixed_0.45_0.5": [0.1, 1.03]}
    rows = comparison(history, references)
    assert [r["method"] for r in rows] == ["agent (best)", "agent (last)", "best_fixed", "off", "fixed_0.45_0.5"]
    assert rows[0] | {"what": None} == {"method": "agent (best)", "what": None, "step": 100, "speedup": 1.08,
                                        "speedup_ci": [1.06, 1.1], "return": 0.3, "return_ci": [0.2, 0.4], "episodes": 32}
    assert rows[1]["speedup_ci"] is None and rows[3]["return"] == 0.0 and rows[3]["return_ci"] is None
    assert reference_values([0.1, 1.03]) == reference_values({"return": 0.1, "speedup": 1.03}) == (0.1, 1.03)
    lines = format_table(rows).splitlines()
    assert lines[1].split() == ["agent", "(best)", "1.080", "[1.060,", "1.100]", "+0.300", "[+0.200,", "+0.400]", "32"]
    assert lines[4].split() == ["off", "1.000", "+0.000"]


def test_memory_together_counts_a_child_beside_the_job():
    """The sampler sums this process and its live children: a child holding 200 MB shows in ``together``."""
    import os
    import subprocess
    import sys
    import time

    from agents.common.phases import MemorySampler, children_of, resident_mb

    if resident_mb() == 0:
        pytest.skip("no /proc on this system")
    sampler = MemorySampler(every_s=3600)  # sampled by hand below
    alone = sampler.sample()
    child = subprocess.Popen([sys.executable, "-c", "import sys; b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); "
                              "print('held', flush=True); sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        assert child.pid in children_of(os.getpid())
        both = sampler.sample()
        assert both - alone > 190, (alone, both)
        assert sampler.peak_mb >= both
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    time.sleep(0.1)
    assert child.pid not in children_of(os.getpid())
    assert sampler.sample() < both and sampler.peak_mb >= both  # the peak stays


def test_pages_a_child_shares_with_the_job_count_once_together():
    """A child forked with 200 MB the job touched shares those pages: the proportional sum counts them once, the
    resident sum twice."""
    import os

    from agents.common.phases import MemorySampler, proportional_mb, resident_mb

    if not os.path.exists("/proc/self/smaps_rollup") or not hasattr(os, "fork"):
        pytest.skip("no /proc/<pid>/smaps_rollup or fork on this system")
    held = bytearray(200 << 20)
    held[::4096] = b"x" * len(held[::4096])
    sampler = MemorySampler(every_s=3600)
    alone = sampler.sample()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: hold the shared pages until the parent has sampled
        os.close(write)
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    try:
        both = sampler.sample()
        assert abs(both - alone) < 60, (alone, both)  # the 200 MB counted once (the child's own pages are few)
        assert sampler.peak_rss_sum_mb - resident_mb() > 190  # the resident sum counts them in the child too
        assert proportional_mb() < resident_mb()
    finally:
        os.write(write, b"x")
        os.waitpid(pid, 0)


def test_a_memory_sampler_stops_once_closed_or_dropped():
    """Samplers left running in one process (a test session's) would each read /proc every second."""
    import gc
    import threading
    import time

    from agents.common.phases import MemorySampler

    before = {t for t in threading.enumerate() if t.name == "memory-sampler"}
    closed, dropped = MemorySampler(every_s=0.05), MemorySampler(every_s=0.05)
    new = [t for t in threading.enumerate() if t.name == "memory-sampler" and t not in before]
    assert len(new) == 2
    closed.close()
    del dropped
    gc.collect()
    time.sleep(0.5)
    assert not any(t.is_alive() for t in new)
    assert closed.peak_mb > 0  # its peak stays readable
