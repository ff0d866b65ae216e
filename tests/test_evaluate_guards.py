"""evaluate.py refuses bad options before any model loads, and never writes what it did not measure.

Both evaluations: BiLD-v1's comparison (``agents.bild.comparison``) and ``--env serve`` (``agents.serve.evaluation``).
The runs here are made by hand (a config.json as the trainers write it, an SB3 zip of the right spaces): no model of
a pair loads, and every test that gets past the checks stops where the work would start.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

REPO = Path(__file__).resolve().parents[1]
SERVE = ["--env", "serve", "--pair", "tiny-random", "--levels", "0.5", "--select-episodes", "1", "--episodes", "1",
         "--episode-steps", "4", "--max-new-tokens", "6", "--max-batch", "4", "--max-prompts", "6"]


class Spaces(gym.Env):
    """An env with the given spaces and nothing else: an SB3 model of them saves in a blink."""

    def __init__(self, observation_space, action_space):
        self.observation_space, self.action_space = observation_space, action_space

    def reset(self, seed=None, options=None):
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, False, True, {}


def save_model(path: Path, observation_space, action_space) -> Path:
    """An SB3 model of these spaces: a DQN, or for a MultiDiscrete action (one per domain) a PPO."""
    from stable_baselines3 import DQN, PPO

    if isinstance(action_space, spaces.MultiDiscrete):
        PPO("MlpPolicy", Spaces(observation_space, action_space), n_steps=8, batch_size=8,
            policy_kwargs={"net_arch": [8]}, device="cpu").save(path)
    else:
        DQN("MlpPolicy", Spaces(observation_space, action_space), buffer_size=10, policy_kwargs={"net_arch": [8]},
            device="cpu").save(path)
    return path


def serve_run(folder: Path, **env) -> Path:
    """A BiLD-Serve-v0 run folder as ``train.py --env serve`` leaves it (config.json, best_model.zip, model.zip):
    by default the trainer's env at max_batch 4 and max_new_tokens 6 (the lossless grid: 6 actions)."""
    from agents.spec import preset_env
    from agents.serve.options import ServeTrainConfig
    from bild_env.config import over
    from bild_env.migrate import fold_flat
    from bild_env.serving.config import ServingConfig
    from bild_env.serving.observations import observation_space
    from bild_env.prompts.domains import parse_mix

    cfg = over(preset_env("serve"), fold_flat(ServingConfig, dict(pair="tiny-random", max_batch=4, max_new_tokens=6, episode_steps=4,
                                                      max_prompts=6, **env)))
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(ServeTrainConfig(run_name=folder.name).spec(cfg).text())
    n = len(cfg.actions.fallback_values) * len(cfg.actions.rollback_values) + cfg.actions.off_switch
    domains = len(parse_mix(cfg.mix)) if cfg.actions.per_domain else 0
    act = spaces.MultiDiscrete([n] * domains) if cfg.actions.per_domain else spaces.Discrete(n)
    for name in ("best_model.zip", "model.zip"):
        save_model(folder / name, observation_space(domains), act)
    return folder


def bild_run(folder: Path, pair: str = "tiny-random") -> Path:
    """A BiLD-v1 run folder as ``train.py`` leaves it (``agents.config.RunConfig``'s config.json, model.zip)."""
    from agents import RunConfig
    from bild_env.env import EnvConfig
    from bild_env.observations import observation_space

    folder.mkdir(parents=True)
    RunConfig(env=EnvConfig(pair=pair, pair_options={"device": "cpu"}, max_new_tokens=8)).save(folder / "config.json")
    save_model(folder / "model.zip", observation_space("paper"), spaces.Discrete(25))
    return folder


def garble(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:300])  # a copy cut short


@pytest.fixture
def serve_stops(monkeypatch):
    """``--env serve`` with no work: building an env fails the test; ``run`` returns a small finite report and
    records that it was reached."""
    import agents.serve.bench_config as config
    import agents.serve.evaluation as bench

    reached = []
    monkeypatch.setattr(config, "ServingEnv", lambda **kw: pytest.fail("an env was built"))
    monkeypatch.setattr(bench, "run", lambda cfg, *_: reached.append(cfg) or {
        "config": asdict(cfg), "levels": {}, "moving": {}, "overall": []})
    monkeypatch.setattr(bench, "plot_goodput", lambda report, path: path)
    return reached


def serve(argv: list[str]) -> str:
    """``evaluate.py --env serve ...`` in this process; its refusal's message."""
    from agents.commands import evaluate_main as main

    with pytest.raises(SystemExit) as exc:
        main(SERVE + argv)
    assert isinstance(exc.value.code, str), exc.value.code
    assert exc.value.code.startswith("evaluate.py --env serve: error: ")
    return exc.value.code


# -- --env serve: the options ------------------------------------------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["--episodes", "0"], "--episodes must be an integer >= 1, got 0: test episodes per load level"),
    (["--select-episodes", "0"], "--select-episodes must be an integer >= 1, got 0"),
    (["--episode-steps", "0"], "episode_steps must be an integer >= 1"),
    (["--max-batch", "0"], "max_batch must be an integer >= 1"),
    (["--max-new-tokens", "0"], "max_new_tokens must be an integer >= 1"),
    (["--max-prompts", "0"], "max_prompts must be an integer >= 1"),
    (["--threads", "0"], "--threads must be an integer >= 1"),
    (["--levels", "0"], "--levels: 0 is outside (0, 4]"),
    (["--levels", "4.5"], "--levels: 4.5 is outside (0, 4]"),
    (["--levels", "nan"], "--levels: nan is outside (0, 4]"),
    (["--levels", "0.5", "0.5"], "--levels: 0.5 is given twice"),
    (["--moving", "burst:0,1"], "--moving: utilisation 0.0"),
    (["--fixed-actions", "99"], "--fixed-actions: [99] not in the env's action grid 0-25 (5 fallbacks x 5 rollbacks: 0-24, "
                                "25 speculation off)"),
    (["--fixed-actions", "15", "-1"], "--fixed-actions: [-1] not in the env's action grid 0-25"),
    (["--actions", "rollback_values=0.5", "--fixed-actions", "6"], "--fixed-actions: [6] not in the env's action grid 0-5"),
    (["--actions", "0", "15"], "--actions takes the env's action options now (KEY=VALUE, as train.py's); the fixed "
                               "actions the rules run are --fixed-actions 0"),
    (["--domains", "poetry"], "--domains: mix 'poetry': unknown domain 'poetry'"),
    (["--pair-options", "dtype=f8"], "--pair-options dtype: unknown dtype 'f8'"),
])
def test_serve_refuses_a_bad_option_before_anything_runs(argv, says, serve_stops, tmp_path):
    out = tmp_path / "s.json"
    assert says in serve(argv + ["--out", str(out)])
    assert not serve_stops and not out.exists() and not out.with_suffix(".png").exists()


@pytest.mark.parametrize("argv, says", [
    (["--score", "cumulative"], "--score is now a key of --actions: give --actions score=VALUE"),
    (["--dtype", "bfloat16"], "--dtype is now a key of --pair-options: give --pair-options dtype=VALUE"),
    (["--charge-loop", "1", "2", "3"], "--charge-loop is now a key of --charging: give --charging charge_loop=VALUE"),
    (["--actions", "space=box"], None),  # a key of the env's actions: parsed, then refused as the env refuses it
])
def test_serve_names_where_an_env_argument_given_flat_is_now(argv, says, serve_stops, tmp_path, capsys):
    """The env's arguments are the env's own options, as train.py takes them: an old flat name is a parser error naming
    the option that holds it now (exit 2)."""
    from agents.commands import evaluate_main as main

    with pytest.raises(SystemExit) as exc:
        main(SERVE + argv + ["--out", str(tmp_path / "s.json")])
    if says is None:
        assert "actions: space must be one of ('discrete', 'continuous')" in str(exc.value.code)
    else:
        assert exc.value.code == 2 and says in capsys.readouterr().err
    assert not serve_stops


def test_serve_checks_out_is_writable_and_holds_no_earlier_results(serve_stops, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    assert "cannot write into" in serve(["--out", str(tmp_path / "a-file" / "sub" / "s.json")])
    assert f"{tmp_path / 'a-file'} is a file" in serve(["--out", str(tmp_path / "a-file" / "sub" / "s.json")])
    assert "is a folder; give a file name" in serve(["--out", str(tmp_path)])
    out = tmp_path / "s.json"
    out.write_text('{"earlier": 1}\n')
    out.with_suffix(".png").write_bytes(b"earlier plot")
    says = serve(["--out", str(out)])
    assert "hold an earlier evaluation's results" in says and "--force" in says
    assert not serve_stops and out.read_text() == '{"earlier": 1}\n'  # untouched
    from agents.commands import evaluate_main as main

    assert main(SERVE + ["--out", str(out), "--force"]) == 0  # replaced, and the earlier plot is not left beside it
    assert serve_stops and json.loads(out.read_text())["levels"] == {} and not out.with_suffix(".png").exists()


def test_serve_writes_no_nan_and_fails_when_nothing_was_measured(monkeypatch, tmp_path, capsys):
    import agents.serve.evaluation as bench

    rows = [{"policy": "speculation off", "return": math.nan, "ci": [math.nan, math.nan], "speedup": np.float64("nan")}]
    monkeypatch.setattr(bench, "run", lambda cfg, *_: {"config": asdict(cfg), "levels": {"0.5": rows}, "moving": {},
                                                   "overall": rows})
    out = tmp_path / "s.json"
    says = serve(["--out", str(out)])
    assert "not finite numbers (levels.0.5[0].return = nan" in says and "nothing was measured" in says
    assert not out.exists() and "+nan" not in capsys.readouterr().out  # no file, no table of NaN


# -- --env serve: the models ------------------------------------------------------------------------
def test_serve_refuses_a_bild_v1_run_and_a_damaged_model_by_name(serve_stops, tmp_path):
    v1 = bild_run(tmp_path / "v1")
    says = serve(["--model", str(v1), "--out", str(tmp_path / "s.json")])
    assert f"--model {v1} is a BiLD-v1 run ({v1 / 'config.json'})" in says and "without --env serve" in says
    run = serve_run(tmp_path / "serve")
    garble(run / "best_model.zip")
    says = serve(["--model", str(run), "--out", str(tmp_path / "s.json")])
    assert f"cannot read the model {run / 'best_model.zip'}" in says and "truncated or garbled" in says
    assert f"--model {run / 'model.zip'}" in says  # what to do: the run's final model
    assert not serve_stops


@pytest.mark.parametrize("argv, says", [
    (["--max-batch", "8"], "trained with max_batch 4"),
    (["--max-new-tokens", "8"], "trained with max_new_tokens 6"),
])
def test_serve_refuses_settings_that_change_what_the_agent_observes(argv, says, serve_stops, tmp_path):
    run = serve_run(tmp_path / "serve")
    message = serve(["--model", str(run), "--out", str(tmp_path / "s.json")] + argv)
    option = argv[0]
    assert says in message and "observation would mean something else" in message
    assert f"give {option} {says.split()[-1]}" in message and not serve_stops


def test_serve_refuses_an_agent_observing_other_domains(serve_stops, tmp_path):
    run = serve_run(tmp_path / "serve", actions={"per_domain": True})  # trained on prose, code and chat
    says = serve(["--model", str(run), "--mix", "prose:1", "--out", str(tmp_path / "s.json")])
    assert "observes and acts for each domain of its run's workload (prose, code, chat)" in says and "--mix" in says
    assert not serve_stops


def test_serve_refuses_a_bare_model_of_other_spaces(serve_stops, tmp_path):
    from bild_env.serving.observations import observation_space

    model = save_model(tmp_path / "m.zip", observation_space(0), spaces.Discrete(6))  # no run config: the bench grid
    says = serve(["--model", str(model), "--out", str(tmp_path / "s.json")])
    assert "action space Discrete(6)" in says and "26 actions" in says and not serve_stops


def test_serve_runs_a_fitting_agent_and_warns_where_it_meets_another_system(serve_stops, tmp_path, caplog):
    from agents.commands import evaluate_main as main

    run = serve_run(tmp_path / "serve")
    assert main(SERVE + ["--model", str(run), "--out", str(tmp_path / "a.json")]) == 0
    assert serve_stops and not [r for r in caplog.records if r.name == "agents.serve.evaluation_agents"]
    other = serve_run(tmp_path / "other", reward={"latency_weight": 2.0})  # another reward: still the same observation
    assert main(SERVE + ["--model", str(other), "--out", str(tmp_path / "b.json")]) == 0
    assert "trained with latency_weight 2.0 (here 1.0)" in caplog.text


def test_agent_grid_refuses_a_bild_v1_run_by_name(tmp_path):
    from agents.config import ConfigError
    from agents.serve.evaluation_agents import agent_grid

    v1 = bild_run(tmp_path / "v1")
    with pytest.raises(ConfigError, match="is a model of a BiLD-v1 run .*without --env serve"):
        agent_grid(v1 / "model.zip")


# -- BiLD-v1 ------------------------------------------------------------------------------------------
@pytest.fixture
def bild_stops(monkeypatch):
    """BiLD-v1's comparison with no work: building an env fails the test; its ``run`` records that it was reached."""
    import agents.bild.comparison as comparison

    reached = []
    monkeypatch.setattr(comparison, "BildEnv", lambda **kw: pytest.fail("an env was built"))
    monkeypatch.setattr(comparison.Comparison, "run", lambda self: reached.append(self) or {"reached": True})
    monkeypatch.setattr(comparison.Comparison, "write", lambda self, report: None)
    return reached


def bild(tmp_path: Path, **options) -> str:
    from agents.bild.comparison import Comparison, EvalConfig
    from agents.evaluation import evaluate

    with pytest.raises(SystemExit) as exc:
        evaluate(Comparison(EvalConfig(progress_bar=False, **options)))
    assert str(exc.value.code).startswith("evaluate.py: ")
    return str(exc.value.code)


@pytest.mark.parametrize("option, value, says", [("num_prompts", 0, "--num-prompts must be an integer >= 1, got 0"),
                                                 ("grid_prompts", 0, "--grid-prompts must be an integer >= 1"),
                                                 ("threshold_runs", -1, "--threshold-runs must be an integer >= 0"),
                                                 ("k", -1, "--k must be an integer >= 0")])
def test_bild_refuses_a_bad_count(option, value, says, bild_stops, tmp_path):
    assert says in bild(tmp_path, model=str(bild_run(tmp_path / "v1")), out=str(tmp_path / "o"), **{option: value})
    assert not bild_stops and not (tmp_path / "o").exists()


def test_bild_refuses_a_serving_run_as_model_or_extra_model(bild_stops, tmp_path):
    run, v1 = serve_run(tmp_path / "serve"), bild_run(tmp_path / "v1")
    says = bild(tmp_path, model=str(run), out=str(tmp_path / "o"))
    assert "is a model of a BiLD-Serve-v0 run" in says and f"python evaluate.py --env serve --model {run}" in says
    says = bild(tmp_path, model=str(v1), extra_model=(str(run),), out=str(tmp_path / "o"))
    assert says.startswith("evaluate.py: --extra-model ") and "BiLD-Serve-v0 run" in says
    assert not bild_stops and not (tmp_path / "o").exists()  # the folder made for it is gone again


def test_bild_passes_serving_runs_over_when_choosing_the_newest_run(bild_stops, tmp_path):
    serve_run(tmp_path / "logs" / "serve")
    says = bild(tmp_path, log_dir=str(tmp_path / "logs"), out=str(tmp_path / "o"))
    assert "no trained model" in says and "of a BiLD-v1 run" in says


def test_bild_refuses_a_damaged_model_and_one_of_other_spaces_before_any_model_loads(bild_stops, tmp_path):
    v1 = bild_run(tmp_path / "v1")
    save_model(v1 / "best_model.zip", spaces.Box(-1, 1, (4,)), spaces.Discrete(2))
    says = bild(tmp_path, model=str(v1), out=str(tmp_path / "o"))
    assert "was trained for observation space Box" in says and "this env has" in says
    garble(v1 / "best_model.zip")
    says = bild(tmp_path, model=str(v1), out=str(tmp_path / "o"))
    assert f"cannot read the model {v1 / 'best_model.zip'}" in says and f"--model {v1 / 'model.zip'}" in says
    assert not bild_stops


def test_bild_checks_out_and_replaces_earlier_results_only_with_force(bild_stops, tmp_path, monkeypatch):
    from agents.bild.comparison import RESULT_FILES, Comparison, EvalConfig, clear_results
    from agents.evaluation import evaluate

    v1 = bild_run(tmp_path / "v1")
    (tmp_path / "a-file").write_text("")
    assert "a-file is a file" in bild(tmp_path, model=str(v1), out=str(tmp_path / "a-file" / "o"))
    out = tmp_path / "o"
    out.mkdir()
    (out / "results.json").write_text("{}\n")
    says = bild(tmp_path, model=str(v1), out=str(out))
    assert "holds an earlier evaluation's results (results.json)" in says and "--force" in says and not bild_stops
    assert evaluate(Comparison(EvalConfig(model=str(v1), out=str(out), force=True, progress_bar=False))) == {"reached": True}
    (out / "notes.txt").write_text("mine")
    clear_results(out)  # what --force removes before the first file is written: an evaluation's files only
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and "results.json" in RESULT_FILES
    # the default folder, evaluation/ in the run's folder (results/<pair>__<time> for a model of no run), is made only
    # once every check passed, and removed if left empty
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("agents.bild.comparison.Comparison.run", lambda self: (_ for _ in ()).throw(RuntimeError("failed")))
    with pytest.raises(RuntimeError):
        evaluate(Comparison(EvalConfig(model=str(v1), progress_bar=False)))
    assert not (v1 / "evaluation").exists() and not (tmp_path / "results").exists()


def test_bild_warns_where_the_options_override_the_run(bild_stops, tmp_path, capsys):
    from agents.bild.comparison import Comparison, EvalConfig
    from agents.evaluation import evaluate

    v1 = bild_run(tmp_path / "v1", pair="smollm2")
    evaluate(Comparison(EvalConfig(model=str(v1), env={"pair": "tiny-random"}, out=str(tmp_path / "o"), progress_bar=False)))
    err = capsys.readouterr().err
    assert "warning: --model's run was trained on other settings" in err and "--pair tiny-random (trained with smollm2)" in err
    assert bild_stops  # a warning only: the comparison goes on


def test_report_json_writes_standard_json_and_names_what_is_not_finite():
    from agents.bild.comparison import report_json

    text = report_json({"a": [np.float32(1.5), np.int64(2)], "b": None})
    assert json.loads(text) == {"a": [1.5, 2], "b": None}
    for bad in (math.nan, math.inf, np.float64("-inf")):
        with pytest.raises(ValueError, match=r"not finite numbers \(x\.y\[1\] = "):
            report_json({"x": {"y": [0.0, bad]}})


# -- the command line: exit codes -------------------------------------------------------------------
def test_the_command_line_exits_non_zero_without_a_traceback(tmp_path):
    run = serve_run(tmp_path / "serve")
    out = tmp_path / "s.json"
    for argv, says in ((SERVE + ["--episodes", "0", "--out", str(out)],
                        "evaluate.py --env serve: error: --episodes must be an integer >= 1"),
                       (["--env", "bild", "--model", str(run), "--out", str(tmp_path / "made" / "o")],
                        "evaluate.py --env serve --model")):  # a serving run given to BiLD-v1's comparison
        done = subprocess.run([sys.executable, "evaluate.py", *argv], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode != 0 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not out.exists() and not (tmp_path / "made").exists()  # nor the folder --out's lock was made in


def test_the_pretrained_serving_agent_ships_with_its_card_and_fits_the_default_evaluation(tmp_path):
    """``--model pretrained`` is the agent shipped in bild_env/assets/serve-agent: a run folder whose best model fits
    the default ``evaluate.py --env serve`` (checked from its config and saved spaces; no model of the pair loads)."""
    from agents.common.trained import choose_model, pretrained_run
    from agents.serve.bench_config import ServingBenchConfig
    from agents.serve.evaluation_agents import check_model

    path, why = choose_model("pretrained")
    assert path == pretrained_run() / "best_model.zip" and path.is_file() and "best" in why
    card = (pretrained_run() / "README.md").read_text()
    assert "python train.py --env serve" in card and "AMD EPYC" in card
    check_model(ServingBenchConfig(out=str(tmp_path / "s.json")), "pretrained")


# -- Ctrl-C and SIGTERM: what was finished is kept, exit 130, no lock left -----------------------------
STOPPING = r'''
import sys, time
from bild_env.decoding.costs import BatchCost, CostModel

COSTS = CostModel(draft=(1.0, 0.1, 0.001), target=(4.0, 0.5, 0.004), device="test")  # tests/conftest.py's

def batch_costs(pair, **_):  # tests/test_serving.py's toy_batch_costs: no timing in a test
    table = {(b, n): 4.0 + 0.5 * n * b ** 0.7 + 0.2 * b for b in (1, 2, 4, 8, 16, 32) for n in range(1, 13)}
    return CostModel(COSTS.draft, COSTS.target, "test", batched={
        "draft": BatchCost.from_table({k: v / 4 for k, v in table.items()}, ref_context=64, per_context_ms=0.001),
        "target": BatchCost.from_table(table, ref_context=64, per_context_ms=0.004)})

def wait_for_the_signal():  # the sign the test waits for; then the work "goes on" until the signal comes
    print("STOP NOW", flush=True)
    time.sleep(120)

import bild_env.decoding.costs, bild_env.env
bild_env.decoding.costs.load_or_calibrate_batched = batch_costs
bild_env.env.load_or_calibrate = lambda pair, **_: COSTS

import agents.serve.evaluation as serve
real_rows, loads = serve.test_rows, []
def test_rows(*args, **kw):  # the second load waits: the first one is written
    if loads:
        wait_for_the_signal()
    loads.append(args[4])
    return real_rows(*args, **kw)
serve.test_rows = test_rows

import agents.bild.comparison as bild
real_tqdm = bild.tqdm
def tqdm(items, desc=None, **kw):  # the second test prompt waits: every method finished the first
    for i, item in enumerate(real_tqdm(items, desc=desc, **kw)):
        if desc == "test prompts" and i == 1:
            wait_for_the_signal()
        yield item
bild.tqdm = tqdm

from agents.commands import evaluate_main
from bild_env.command import run_command
sys.exit(run_command("evaluate.py", evaluate_main))
'''


def stopped_evaluation(argv: list[str], signum: int) -> tuple[int, str]:
    """``evaluate.py argv`` (its costs made by hand), sent ``signum`` once it has finished a load (``--env serve``) or
    a test prompt (BiLD-v1): its exit status and output."""
    import signal
    import time

    child = subprocess.Popen([sys.executable, "-c", STOPPING, *argv], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal
    lines, deadline = [], time.monotonic() + 240
    for line in child.stdout:
        lines.append(line)
        if "STOP NOW" in line:  # after a progress bar's carriage return, maybe
            child.send_signal(signum)
            break
        assert time.monotonic() < deadline, "".join(lines)
    lines.append(child.communicate(timeout=120)[0])
    return child.returncode, "".join(lines)


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_serve_stopped_keeps_the_loads_done_and_exits_130(signum, tmp_path):
    import signal

    out = tmp_path / "ev.json"
    rc, output = stopped_evaluation(SERVE[:4] + ["--levels", "0.5", "1.0"] + SERVE[6:] + ["--out", str(out)],
                                    getattr(signal, signum))
    assert rc == 130 and "Traceback" not in output, output
    last = output.strip().splitlines()[-1]
    assert last == (f"evaluate.py: stopped by {signum}: {out} holds the 1 load(s) done so far (0.5), with "
                    '"complete": false; to evaluate every load, run the same command again with --force'), output
    kept = json.loads(out.read_text())
    assert kept["complete"] is False and kept["stopped"] == signum and list(kept["levels"]) == ["0.5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ev.json"]  # no lock (.ev.json.lock), no temporary file


def test_bild_stopped_keeps_the_prompts_every_method_finished_and_exits_130(tmp_path):
    """SIGTERM (a scheduler's stop; Ctrl-C takes the same path once ``sigterm_as_ctrl_c`` has turned it into one)."""
    import csv
    import signal

    signum = "SIGTERM"

    run, out = bild_run(tmp_path / "run"), tmp_path / "out"
    rc, output = stopped_evaluation(["--model", str(run), "--num-prompts", "3", "--grid-prompts", "1",
                                     "--threshold-runs", "0", "--no-bandits", "--adaptive", "", "--out", str(out)],
                                    getattr(signal, signum))
    assert rc == 130 and "Traceback" not in output, output
    assert output.strip().splitlines()[-1].startswith(f"evaluate.py: stopped by {signum}: {out} holds "), output
    assert "(the 1 of 3 test prompts every method finished" in output and "with --force" in output
    kept = json.loads((out / "results.json").read_text())
    assert kept["complete"] is False and kept["stopped"] == signum and kept["prompts_done"] == 1
    rows = list(csv.DictReader((out / "per_prompt.csv").open()))
    assert {r["prompt_index"] for r in rows} == {"0"} and len(rows) == len(kept["results"])  # a row per method
    assert not (out / ".evaluate.lock").exists() and not list(out.glob("*.tmp-*"))


def test_serve_stopped_before_any_load_writes_nothing_and_says_so(tmp_path, monkeypatch, capsys):
    import agents.serve.evaluation as se
    from agents.commands import evaluate_main
    from bild_env.command import run_command

    def stopped(cfg, done=None, say=None):
        raise KeyboardInterrupt("SIGTERM")

    monkeypatch.setattr(se, "run", stopped)
    out = tmp_path / "ev.json"
    assert run_command("evaluate.py", evaluate_main, SERVE + ["--out", str(out)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (f"evaluate.py: stopped by SIGTERM before any load was done: "
                                                        f"nothing written to {out}; run the same command again")
    assert not out.exists()
