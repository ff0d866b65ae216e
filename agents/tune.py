"""Seeds and sweeps of ``train.py`` as one Ray Tune call (``pip install -e ".[cluster]"``), with a summary over seeds.

    python -m agents.tune --seeds 0 1 2 -- --pair tiny-random --total-timesteps 2000       # 3 seeds, this machine
    python -m agents.tune --seeds 0 1 2 --grid hyperparams=gamma=0.9,gamma=0.99 --ray auto -- --pair smollm2
    python -m agents.tune --seeds 0 1 2 -- --env serve --pair smollm2 --total-timesteps 8000    # the serving trainer
    python -m agents.tune --seeds 0 1 --grid hyperparams=n_steps=32,n_steps=64 -- --algo ppo --pair tiny-random

Everything after ``--`` is ``train.py``'s options, shared by every trial (``--env serve`` among them: the serving
trainer, ``agents.serve.training``, on BiLD-Serve-v0). A trial is one configuration (one point of ``--grid``:
``option=value,value,...`` per option of ``train.py``, all combinations) and one seed, trained by ``train.py`` in a
process of its own with its ``--seed``, ``--log-dir`` and ``--run-name <name>__<point>__<seed>``: a normal run
folder under ``--log-dir`` (TensorBoard reads them all; ``train.py --resume RUN`` continues any of them, with the
trainer its spec names), with train.py's run lock. Running the same command again skips
the finished runs and resumes the others from their newest checkpoint (one killed before its first starts again in
place, its earlier attempt set aside, as train.py starts any such run), as a trial Ray starts again after a failure
does (``--max-failures``).

The summary (printed, and written as JSON to ``--out``, default ``<log_dir>/<name>.tune.json``)
gives, per configuration, the mean over seeds of the final and of the best validation return (the runs'
``evaluations.npz``; a serving run's ``evaluations.json``, with its speedup over target-only serving at the final
and at the best evaluation, and the fixed policies it is drawn beside, from its ``summary.json``) with its 95%
percentile-bootstrap interval (``agents.common.stats.mean_ci``).
Ray Tune schedules the trials (``--cpus-per-trial``, ``--gpus-per-trial``); nothing here does.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from agents.common.stats import mean_ci
from agents.serve.run_report import reference_values
from agents.bild.runs import Evaluations, checkpoints
from agents.serve.runs import complete_checkpoints
from agents.spec import FILE, RunSpec
from bild_env.ids import SERVE_ID
from bild_env.cli import add_options, add_ray_option, finite_json, given

ROOT = Path(__file__).resolve().parents[1]  # where train.py lies (a trial's process starts there)
TRAIN = ROOT / "train.py"
OWNED = ("--seed", "--run-name", "--log-dir", "--resume")  # train.py options the sweep sets for each trial
INSTALL_HINT = 'agents.tune needs the cluster extra (Ray Tune): pip install -e ".[cluster]"'
# What the summary gives the mean and interval of over seeds (a metric a trial lacks is left out of its row)
METRICS = ("eval_return_final", "eval_return_best", "eval_speedup_final", "eval_speedup_at_best")


@dataclass(frozen=True)
class SweepConfig:
    """Options of ``python -m agents.tune`` (train.py's own come after ``--``)."""

    seeds: tuple[int, ...] = field(default=(0, 1, 2), metadata={"help": "one trial per seed and configuration"})
    grid: tuple[str, ...] | None = field(default=None, metadata={"help": (
        "option=value,value,... of train.py (without --), one per option: all combinations")})
    name: str = field(default="sweep", metadata={"help": (
        "the sweep's name: the first part of its runs' names (<name>__<point>__<seed>)")})
    log_dir: str = field(default="logs", metadata={"help": (
        "the runs' folder (train.py's --log-dir; shared storage on a cluster)")})
    storage: str | None = field(default=None, metadata={"help": (
        "Ray Tune's own results (default: Ray's, ~/ray_results; shared storage on a cluster)")})
    ray: str | None = field(default=None, metadata={"cli": False, "help": (
        'None or "local": a new local Ray instance; else ray.init\'s address')})
    cpus_per_trial: float = field(default=1.0, metadata={"help": "CPUs Ray reserves for each trial"})
    gpus_per_trial: float = field(default=0.0, metadata={"help": (
        "GPUs Ray gives each trial (its train.py sees them as cuda)")})
    max_failures: int = field(default=2, metadata={"help": "times a failed trial is started again (resuming its run)"})
    out: str = field(default="", metadata={"help": "the summary's JSON file (default: <log_dir>/<name>.tune.json)"})

    def points(self) -> list[tuple[tuple[str, str], ...]]:
        """Every configuration of the grid: ((option, value), ...) in the order given; [()] without a grid."""
        axes = []
        for entry in self.grid or ():
            option, sep, values = entry.partition("=")
            if not sep or not option or not values:
                raise ValueError(f"--grid takes option=value,value,... (a train.py option without --), got {entry!r}")
            axes.append([(option.removeprefix("--"), v) for v in values.split(",")])
        return list(itertools.product(*axes))


@dataclass(frozen=True)
class Trial:
    """One run of the sweep: its configuration, seed and folder."""

    point: tuple[tuple[str, str], ...]
    seed: int
    run_dir: Path


def run_name(name: str, point: tuple[tuple[str, str], ...], seed: int) -> str:
    """``<name>__<option=value-...>__<seed>`` (a folder name: no '/')."""
    tag = "-".join(f"{o}={v}" for o, v in point) or "default"
    return f"{name}__{tag}__{seed}".replace("/", "_")


def serving(run_dir: Path) -> bool:
    """Whether the run is one of the serving trainer (BiLD-Serve-v0), by its spec (``config.json``)."""
    return RunSpec.load(run_dir).env_id == SERVE_ID


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the run's checkpoints a resume can start from (of its trainer's kind, by its spec), newest first;
    none for a run that has not saved its spec."""
    if not (run_dir / FILE).is_file():
        return []
    return [c.steps for c in (complete_checkpoints if serving(run_dir) else checkpoints)(run_dir)]


def trial_argv(train_args: list[str], trial: Trial) -> list[str]:
    """train.py's arguments for ``trial``: a resume (to the sweep's ``--total-timesteps``, if it gives one) when its
    run has a checkpoint, else a new run with its options."""
    if checkpoint_steps(trial.run_dir):  # train.py picks the run's trainer by its spec
        return ["--resume", str(trial.run_dir), *_option(train_args, "--total-timesteps")]
    grid = [a for option, value in trial.point for a in (f"--{option}", value)]
    return [*train_args, *grid, "--seed", str(trial.seed), "--log-dir", str(trial.run_dir.parent),
            "--run-name", trial.run_dir.name]


def finished(train_args: list[str], run_dir: Path) -> bool:
    """Whether the run has its final model and has trained the sweep's ``--total-timesteps`` (or its own total)."""
    steps = checkpoint_steps(run_dir) if (run_dir / "model.zip").is_file() else []
    if not steps:
        return False
    total = _option(train_args, "--total-timesteps")
    wanted = int(total[1]) if total else RunSpec.load(run_dir).run["total_timesteps"]
    return steps[0] >= wanted


def run_trial(train_args: list[str], trial: Trial, log: Path) -> dict:
    """Train ``trial`` to its end with train.py in a process of its own (skipped when its run has finished; resumed
    when it has a checkpoint); its metrics read from the run folder. RuntimeError when train.py fails."""
    if not finished(train_args, trial.run_dir):
        with open(log, "a") as out:
            done = subprocess.run([sys.executable, str(TRAIN), *trial_argv(train_args, trial)], cwd=ROOT,
                                  stdout=out, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            tail = log.read_text()[-2000:]
            raise RuntimeError(f"train.py failed (exit {done.returncode}) for {trial.run_dir}:\n{tail}")
    return serving_metrics(trial.run_dir) if serving(trial.run_dir) else run_metrics(trial.run_dir)


def run_metrics(run_dir: Path) -> dict:
    """The final and the best mean validation return of a run (None without evaluations) and its last evaluation's step."""
    evaluations = Evaluations.read(run_dir / "evaluations.npz")
    best = evaluations.best()
    return {"eval_return_final": float(np.mean(evaluations.results[-1])) if evaluations.results else None,
            "eval_return_best": None if best is None else best[1],
            "eval_step_final": evaluations.timesteps[-1] if evaluations.timesteps else None,
            "run_dir": str(run_dir)}


def serving_metrics(run_dir: Path) -> dict:
    """A serving run's validation metrics (its ``evaluations.json``: the greedy agent on fixed validation episodes):
    the final and the best mean return, the speedup over target-only serving at the final evaluation and at the best
    one (``best_model.zip``'s), the last evaluation's step (None without evaluations), and the fixed policies' return
    and speedup on the same episodes (``summary.json``'s ``references``; {} without one)."""
    path = run_dir / "evaluations.json"
    history = json.loads(path.read_text()) if path.is_file() else []
    best = max(history, key=lambda row: row["return"]) if history else None
    summary = run_dir / "summary.json"
    references = json.loads(summary.read_text()).get("references", {}) if summary.is_file() else {}
    return {"eval_return_final": history[-1]["return"] if history else None,
            "eval_return_best": best["return"] if best else None,
            "eval_speedup_final": history[-1]["speedup"] if history else None,
            "eval_speedup_at_best": best["speedup"] if best else None,
            "eval_step_final": history[-1]["step"] if history else None,
            "references": {name: dict(zip(("return", "speedup"), reference_values(ref)))
                           for name, ref in references.items()},
            "run_dir": str(run_dir)}


def summarize(trials: list[tuple[Trial, dict]]) -> list[dict]:
    """Per configuration: each metric's mean over seeds with its 95% bootstrap interval, and every seed's value (and
    a serving run's fixed policies, the same for every seed: its first run's)."""
    rows = []
    for point in dict.fromkeys(t.point for t, _ in trials):
        mine = [(t, m) for t, m in trials if t.point == point]
        row = {"config": dict(point), "seeds": [t.seed for t, _ in mine], "runs": [m["run_dir"] for _, m in mine]}
        for metric in (m for m in METRICS if any(m in metrics for _, metrics in mine)):
            values = np.array([m[metric] for _, m in mine if m.get(metric) is not None], dtype=float)
            low, high = mean_ci(values) if len(values) else (None, None)
            row[metric] = {"mean": float(values.mean()) if len(values) else None, "ci95": [low, high],
                           "per_seed": values.tolist()}
        if any("references" in m for _, m in mine):
            row["references"] = next(m["references"] for _, m in mine if "references" in m)
        rows.append(row)
    return rows


def sweep(cfg: SweepConfig, train_args: list[str]) -> dict:
    """Run every trial of ``cfg`` with Ray Tune (joining ``cfg.ray``, or this process's running Ray) and summarize."""
    tune, started = _start_ray(cfg.ray)
    try:
        log_dir = Path(cfg.log_dir).resolve()
        trainable = tune.with_resources(tune.with_parameters(_tune_trial, train_args=train_args, name=cfg.name,
                                                             log_dir=str(log_dir)),
                                        {"cpu": cfg.cpus_per_trial, "gpu": cfg.gpus_per_trial})
        space = {"seed": tune.grid_search(list(cfg.seeds)), "point": tune.grid_search([list(p) for p in cfg.points()])}
        run_config = tune.RunConfig(name=cfg.name, storage_path=str(Path(cfg.storage).resolve()) if cfg.storage else None,
                                    failure_config=tune.FailureConfig(max_failures=cfg.max_failures), verbose=0)
        grid = tune.Tuner(trainable, param_space=space, run_config=run_config).fit()
    finally:
        if started:
            import ray

            ray.shutdown()
    failed = [str(r.error).splitlines()[0] for r in grid if r.error is not None]
    trials = [(_trial(r.config["point"], r.config["seed"], cfg.name, log_dir), r.metrics) for r in grid
              if r.error is None]
    trials.sort(key=lambda tm: (cfg.points().index(tm[0].point), cfg.seeds.index(tm[0].seed)))
    return {"name": cfg.name, "train_args": train_args, "log_dir": str(log_dir), "trials": len(grid),
            "failed": failed, "configs": summarize(trials)}


# ------------------------------------------------------------------------------------------------
def _tune_trial(config: dict, train_args: list[str], name: str, log_dir: str) -> None:
    """A Ray Tune trial (in a Ray worker, in Tune's trial folder): train its run, report its metrics."""
    from ray import tune

    trial = _trial(config["point"], config["seed"], name, Path(log_dir))
    tune.report(run_trial(train_args, trial, Path("train.log").resolve()))


def _trial(point, seed: int, name: str, log_dir: Path) -> Trial:
    point = tuple(tuple(p) for p in point)
    return Trial(point, int(seed), Path(log_dir) / run_name(name, point, int(seed)))


def _option(argv: list[str], name: str) -> list[str]:
    """``[name, value]`` of the last ``name value`` or ``name=value`` in ``argv``; [] when absent."""
    found: list[str] = []
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            found = [name, argv[i + 1]]
        elif arg.startswith(name + "="):
            found = [name, arg.split("=", 1)[1]]
    return found


def _start_ray(address: str | None):
    try:
        import ray
        from ray import tune
    except ImportError as err:
        raise SystemExit(f"error: {INSTALL_HINT}") from err
    if ray.is_initialized():
        return tune, False
    ray.init(address=None if address in (None, "local") else address, include_dashboard=False)
    return tune, True


def parse_args(argv: list[str] | None = None) -> tuple[SweepConfig, list[str]]:
    argv = sys.argv[1:] if argv is None else argv
    ours, train_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m agents.tune", usage="%(prog)s [options] -- [train.py options]",
                                     description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, "sweep", SweepConfig, SweepConfig(), title="sweep")
    add_ray_option(parser, "run the trials")
    namespace = parser.parse_args(ours)
    cfg = replace(SweepConfig(), ray=namespace.ray, **given(namespace, "sweep"))
    owned = sorted({a.split("=")[0] for a in train_args} & set(OWNED))
    if owned:
        parser.error(f"{', '.join(owned)} are set by the sweep for each trial; give --seeds, --name and --log-dir "
                     "(before --) instead")
    try:
        cfg.points()
    except ValueError as err:
        parser.error(str(err))
    if not cfg.seeds:
        parser.error("--seeds needs at least one seed")
    return cfg, train_args


def main(argv: list[str] | None = None) -> int:
    cfg, train_args = parse_args(argv)
    report = sweep(cfg, train_args)
    out = Path(cfg.out or Path(cfg.log_dir) / f"{cfg.name}.tune.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(finite_json(report), indent=1) + "\n")
    for row in report["configs"]:
        final, speedup = row["eval_return_final"], row.get("eval_speedup_final")
        shown = "no evaluations" if final["mean"] is None else (
            f"final validation return {final['mean']:.4f} [{final['ci95'][0]:.4f}, {final['ci95'][1]:.4f}]")
        if speedup and speedup["mean"] is not None:
            shown += f", speedup {speedup['mean']:.3f}x [{speedup['ci95'][0]:.3f}, {speedup['ci95'][1]:.3f}]"
        print(f"{json.dumps(row['config']) if row['config'] else 'default'}: seeds {row['seeds']}: {shown}")
    for error in report["failed"]:
        print(f"failed: {error}", file=sys.stderr)
    print(f"summary: {out}; tensorboard --logdir {cfg.log_dir}")
    return 1 if report["failed"] else 0


if __name__ == "__main__":  # run from the module's own name, so that Ray workers import the trial function by it
    from agents.tune import main as tune_main

    from bild_env.command import run_command

    sys.exit(run_command("python -m agents.tune", tune_main))
