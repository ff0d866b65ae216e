"""Training a DQN on BiLD-Serve-v0: what ``python train.py --env serve`` runs (its options and ``--help``:
``agents.serve.options``).

The main job runs in ``PHASES``, one progress line each: the pair's models fetched and converted, the cost tables
timed, the replay trees built by the rules' validation episodes (``agents.serve.validation.rule_references``; the
training prompts' trees filled by a second process meanwhile, ``start_fill``), then training. ``train`` takes the run
folder's lock and decides where the run starts: from its newest complete checkpoint with ``--resume RUN``
(``agents.serve.runs``, over the checkpoints both trainers share, ``agents.common.checkpoints``), or from step 0, what
an earlier attempt wrote set aside in ``set_aside/<n>/``. ``main`` prints the agent against the rules at the end
(``agents.serve.run_report``) and writes ``summary.json``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from stable_baselines3.common.callbacks import BaseCallback, CallbackList
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import DummyVecEnv

from agents.common.callbacks import EpisodeMetrics as CommonEpisodeMetrics
from agents.common.folders import resume_hint
from agents.common.phases import Phases
from agents.dqn import AllActionsDQN
from agents.serve import runs as serving_runs
from agents.serve.options import (DEFAULT_TIME_BUDGET_MIN, ServeTrainConfig, default_timesteps,
                                  dqn_config, parse)
from agents.serve.run_report import comparison, format_table, next_commands
from agents.serve.selection import FLOOR_MARGINS
from agents.serve.validation import (ServingEval, choose_floor, custom_scalars, default_references, eval_loads,
                                     rule_references, write_evaluations)
from agents.wrappers import PeekAll
from bild_env import SERVE_ID
from bild_env.draft_cap import AUTO
from bild_env.fill.serving import decodes
from bild_env.serving.env import ServingConfig, ServingEnv

PHASES = ("fetch and convert", "time the tables", "build trees", "train")  # the main job's, one progress line each


class EpisodeMetrics(CommonEpisodeMetrics):
    """Training episodes' summaries in TensorBoard under ``serve/`` (units in the names)."""

    def __init__(self) -> None:
        super().__init__("serve", {"speedup": "speedup_x", "goodput_tok_s": "goodput_tok_per_s",
                                   "regret": "regret_nats_per_token", "mean_batch": "mean_batch_requests"},
                         cost_profile="machine")


def train(cfg: ServeTrainConfig, env_cfg: ServingConfig, say=print, phases: Phases | None = None) -> TrainResult:
    """Train a new run, or (``cfg.resume``) go on with one from its newest complete checkpoint; the caller holds no
    lock (this takes ``train.lock``). Where it starts is both trainers' rule (``agents.common.folders.check_start``): a
    run stopped before its first complete checkpoint, or whose checkpoints all cannot be read, starts again in place,
    what it wrote moved into ``set_aside/<n>/``, never deleted. ``phases`` (default: new ones, saying through
    ``say``) times the job's ``PHASES`` and prints a progress line per phase; their summary is written to the run's
    ``summary.json``."""
    from agents.common.folders import check_start, set_aside
    from agents.common.lock import RunLock

    torch.set_num_threads(cfg.torch_threads)
    if cfg.total_timesteps is None:
        budget = DEFAULT_TIME_BUDGET_MIN if cfg.time_budget is None else cfg.time_budget
        cfg = replace(cfg, total_timesteps=default_timesteps(env_cfg), time_budget=budget)
        say(f"training for {cfg.total_timesteps} steps (the default for the pair's dtype; --total-timesteps overrides)"
            + (f", or until {budget:g} minutes into the job where this machine is slower (--time-budget)" if budget else ""))
    elif cfg.time_budget is None:
        cfg = replace(cfg, time_budget=0.0)  # the count given is trained whole
    charging = env_cfg.charging
    if env_cfg.cost_profile or charging.train_profiles:  # nobody should take these rewards for this machine's clock
        say("costs charged by " + (f"cost profile {env_cfg.cost_profile}" if env_cfg.cost_profile else
                                    f"one of the cost profiles {', '.join(charging.train_profiles)} per episode"
                                    + (f", varied up to x{charging.vary_profiles:g}" if charging.vary_profiles > 1
                                       else "")))
    run_dir = Path(cfg.log_dir) / (cfg.run_name or f"{SERVE_ID}-{env_cfg.pair}__dqn__{cfg.seed}__{int(time.time())}")
    fresh = not run_dir.exists()
    lock = RunLock.acquire(run_dir)  # RunInUse (a ConfigError) at once when another process trains it
    try:
        start = serving_runs.resume_point(run_dir, say) if (run_dir / "config.json").is_file() else None
        check_start(run_dir, cfg.resume, start, cfg.total_timesteps, say, SERVE_ID)
        if start is None and (aside := set_aside(run_dir)) is not None:
            say(f"what the earlier attempt wrote (models, logs, evaluations, checkpoints) is kept in {aside}")
        own = phases is None
        phases = phases or Phases(PHASES, say)
        try:
            return _train(cfg, env_cfg, run_dir, start, say, phases)
        finally:
            if own:
                phases.close()
    finally:
        lock.release(remove_empty_folder=fresh)


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    interrupted: str | None  # the signal that stopped training at a checkpoint, or None when the run reached its total
    table: list[dict] = field(default_factory=list)  # the agent against the rules (``run_report.comparison``)

def prepare(env_cfg: ServingConfig, phases: Phases) -> None:
    """The job's first phases: 1. fetch and convert the pair's models (once per cache folder; a custom pair is used
    as given), 2. load them and time the cost tables the env charges (once per machine; ``bild_env.decoding.costs``),
    so that the envs made next find both cached."""
    from bild_env.decoding import costs
    from bild_env.models.pairs import get_preset
    from bild_env.replay.dataset import covers, dtype_for, not_covered

    custom = env_cfg.pair_options.custom
    priced = env_cfg.cost_model is not None or env_cfg.cost_profile is not None or bool(env_cfg.charging.train_profiles)
    if priced and covers(env_cfg, "train"):  # nothing to time, nothing to fill: the models are not needed
        for phase in PHASES[:2]:
            phases.skip(phase, "the pair's decoding dataset answers every training step and a profile prices them")
        return
    if (why := not_covered(env_cfg, "train")) is not None:  # a dataset is shipped, but these options leave it
        phases.say(f"the pair's decoding dataset does not answer every training episode: {why}. The models load to "
                   "decode the rest")
    if custom:
        phases.skip(PHASES[0], "a custom pair, used as given")
    else:
        with phases.phase(PHASES[0], unit="model"):
            get_preset(env_cfg.pair).resolve()
    with phases.phase(PHASES[1], unit="forward") as bar:
        pair = env_cfg.pair_options.load(env_cfg.pair, dtype_for(env_cfg))  # as ServingEnv loads it: the envs get it
        if env_cfg.cost_model is None and env_cfg.cost_profile is None and not env_cfg.charging.train_profiles:
            bar.plan(costs.forwards_to_time(pair))  # the whole count before the first forward
            costs.load_or_calibrate_batched(pair, progress=bar)  # a profile charges its own tables: nothing to time


def start_fill(cfg: ServeTrainConfig, env_cfg: ServingConfig):
    """The fill of the training prompts' replay trees in a second process (``bild_env.fill.serving.WorkloadFill``),
    started; None without ``cfg.fill_trees``, on a machine with one core, or where the pair's decoding dataset
    (``bild_env.replay.dataset``) answers every training episode already."""
    import os

    from bild_env.fill.serving import WorkloadFill
    from bild_env.replay.dataset import covers

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not cfg.fill_trees or cores < 2 or covers(env_cfg, "train"):  # a shipped decoding dataset holds them
        return None
    return WorkloadFill(env_cfg.arguments(split="train"))


class PhaseProgress(BaseCallback):
    """Advances the train phase's bar by the env steps of every vectorised step."""

    def __init__(self, bar) -> None:
        super().__init__()
        self.bar = bar

    def _on_step(self) -> bool:
        self.bar.update(self.training_env.num_envs)
        return True


def write_summary(run_dir: Path, phases: Phases, result: dict) -> dict:
    """``summary.json``: the job's phases (wall and CPU seconds), peak memory, the machine, and ``result``."""
    from agents.common.files import write_atomic
    from bild_env.models.device import machine_description

    summary = phases.summary() | {"machine": machine_description("cpu"), "command": sys.argv} | result
    text = json.dumps(summary, indent=1, default=str) + "\n"
    write_atomic(run_dir / "summary.json", lambda f: f.write(text.encode()))
    return summary


def _train(cfg: ServeTrainConfig, env_cfg: ServingConfig, run_dir: Path, start, say, phases: Phases) -> TrainResult:
    from agents.common.callbacks import Checkpoints, StopAtCheckpoint, StopRequest, TimeBudget, stop_on_signals
    from agents.common.checkpoints import discard_after
    from agents.common.files import write_atomic, write_text_atomic
    from agents.common.folders import restore_best_model
    from agents.common.logs import make_logger
    from agents.common.replay_buffer import load_replay_buffer

    prepare(env_cfg, phases)
    train_env, eval_envs, filler = None, [], None
    try:
        with phases.phase(PHASES[2], unit="episode") as bar:  # the fixed policies' episodes fill the replay trees
            filler = start_fill(cfg, env_cfg)  # the training prompts' trees, on the other core
            train_env = make_vec_env(SERVE_ID, n_envs=cfg.n_envs, seed=cfg.seed + (start.steps if start else 0),
                                     vec_env_cls=DummyVecEnv,
                                     env_kwargs=env_cfg.arguments(split="train") | {"render_mode": None},
                                     wrapper_class=PeekAll if cfg.dqn.all_actions else None)
            if env_cfg.actions.max_draft_len == AUTO:  # the cap the training envs chose is the run's (evaluations, resume)
                chosen = train_env.envs[0].unwrapped.config.actions.max_draft_len
                env_cfg = replace(env_cfg, actions=replace(env_cfg.actions, max_draft_len=chosen))
            eval_envs = [ServingEnv(**env_cfg.arguments(split="validation") | {"load": load})
                         for load in eval_loads(env_cfg.load)]
            if start is None:
                write_text_atomic(run_dir / "config.json", cfg.spec(env_cfg).text())
            seeds = [10_000 + i for i in range(cfg.eval_episodes)]
            if filler is not None:
                bar.total += decodes(env_cfg, sum(train_env.envs[0].unwrapped.workload.sizes.values()))
            references = rule_references(eval_envs, seeds,
                                         tuple(cfg.reference_actions or default_references(eval_envs[0])),
                                         filler.counted(bar) if filler is not None else bar)
            if filler is not None and not filler.wait(bar):
                say(f"the fill of the training prompts' replay trees stopped (exit code {filler.process.exitcode}; "
                    "its error is above): training fills what is missing as it goes")
        custom_scalars(run_dir, list(references))
        if start is None:
            model = AllActionsDQN("MlpPolicy", train_env, seed=cfg.seed, device="cpu",
                                  **dqn_config(cfg).sb3_kwargs(cfg.n_envs, train_env.action_space.n))
        else:
            model = AllActionsDQN.load(start.model, env=train_env, device="cpu")
            load_replay_buffer(model, start.replay_buffer)
        model.set_logger(make_logger(run_dir, None if start is None else start.steps, say))
        evaluator = ServingEval(eval_envs, seeds, cfg.eval_freq, references, run_dir)
        if start is not None:  # the run as it stood at the checkpoint; what a killed run wrote after it goes
            state = serving_runs.read_serving_state(start.state, start.steps)
            evaluator.history, evaluator.best, evaluator.next_at = state["history"], state["best"], state["next_eval_at"]
            discard_after(run_dir, start.steps, say)
            write_evaluations(run_dir, evaluator.history)
            restore_best_model(run_dir, serving_runs.best_of(evaluator.history), say)
            say(f"resuming {run_dir.name} at step {start.steps} of {cfg.total_timesteps}")
        last = []

        def checkpoint():
            if not last or last[-1].steps != model.num_timesteps:  # not saved at this step already
                state = serving_runs.state_of(model.num_timesteps, evaluator.history, evaluator.best, evaluator.next_at)
                last.append(serving_runs.save_checkpoint(model, run_dir, state))
            return last[-1]

        every = max(1, cfg.checkpoint_freq // cfg.n_envs)  # vectorised steps; saved at the next rollout start
        stop = StopRequest()
        interrupted = None
        with phases.phase(PHASES[3], unit="step", total=max(0, cfg.total_timesteps - model.num_timesteps)) as bar:
            callbacks = [evaluator, EpisodeMetrics(), Checkpoints(checkpoint, every, stop), PhaseProgress(bar)]
            budget = None
            if cfg.time_budget:  # ends training where the machine is too slow for the count; exploration first
                budget = TimeBudget(phases.start + 60 * cfg.time_budget, stop,
                                    min_steps=int(cfg.dqn.exploration_fraction * cfg.total_timesteps),
                                    reserve_s=lambda: (1.5 + len(FLOOR_MARGINS) * cfg.floor) * evaluator.longest_s + 5.0)
                callbacks.insert(0, budget)
            for callback in callbacks:
                callback.n_calls = model.num_timesteps // cfg.n_envs  # counted from the run's start, as uninterrupted
            try:
                with stop_on_signals(stop):
                    if model.num_timesteps < cfg.total_timesteps:
                        model.learn(cfg.total_timesteps - model.num_timesteps, callback=CallbackList(callbacks),
                                    progress_bar=cfg.progress_bar, reset_num_timesteps=start is None)
            except StopAtCheckpoint as why:
                interrupted = str(why)
            if interrupted is None and stop.requested and stop.reason != TimeBudget.REASON:
                interrupted = stop.reason  # a signal in the last rollout: training ended before it could stop there
            if budget is not None and budget.stopped_at is not None and interrupted == TimeBudget.REASON:
                interrupted = None  # a whole run: evaluated and saved as at its total
                say(f"training ended by the time budget ({cfg.time_budget:g} minutes into the job) at step "
                    f"{model.num_timesteps} of {cfg.total_timesteps}; go on with `{resume_hint(run_dir)}`")
            if interrupted is None and (not evaluator.history or evaluator.history[-1]["step"] != model.num_timesteps):
                evaluator.evaluate()  # the final model, once
            checkpoint()
            write_atomic(run_dir / "model.zip", model.save)
        model.logger.close()
        best = max(evaluator.history, key=lambda row: row["return"]) if evaluator.history else None
        floor = None
        if cfg.floor and interrupted is None and best is not None and "table" in references.get("batch_table", {}):
            floor = put_on_floor(run_dir, model, best, eval_envs, seeds, references["batch_table"], say)
        table = comparison(evaluator.history, references, floor)
        write_summary(run_dir, phases, {"steps": int(model.num_timesteps), "interrupted": interrupted,
                                        "total_timesteps": cfg.total_timesteps, "time_budget_min": cfg.time_budget,
                                        "ended_by_time_budget": budget is not None and budget.stopped_at is not None,
                                        "references": references, "best_evaluation": best, "floor": floor,
                                        "last_evaluation": evaluator.history[-1] if evaluator.history else None,
                                        "result": {"table": table, "next": next_commands(run_dir)}})
        return TrainResult(run_dir, int(model.num_timesteps), interrupted, table)
    finally:
        if filler is not None:  # ended already, unless the job stopped during the tree phase
            filler.stop()
        if train_env is not None:
            train_env.close()
        for env in eval_envs:
            env.close()


def put_on_floor(run_dir: Path, model, best: dict, envs: list[ServingEnv], seeds: list[int], reference: dict,
                 say) -> dict:
    """The run's best model (``best_model.zip``, else ``model``) on the per-batch-size table's floor, chosen on the
    run's validation episodes (``agents.serve.validation.choose_floor``), written to ``floor.json``."""
    from agents.common.files import write_atomic

    path = run_dir / "best_model.zip"
    own = not path.is_file() or best["step"] == model.num_timesteps
    agent = model if own else AllActionsDQN.load(path, device="cpu")
    floor = choose_floor(envs, seeds, agent, reference) | {"model": "model.zip" if own else path.name,
                                                           "step": int(model.num_timesteps if own else best["step"])}
    floor["margin"] = f"{floor['margin']:g}"  # inf: the table itself
    text = json.dumps(floor, indent=1) + "\n"
    write_atomic(run_dir / "floor.json", lambda f: f.write(text.encode()))
    say("the agent on the per-batch-size table's floor: " + (
        "the table itself (no margin's gain over it cleared its 95% interval on validation)" if floor["margin"] == "inf"
        else f"departing from the table where its Q-values say so by more than {floor['margin']} (a gain on validation "
             "beyond its interval)") + "; floor.json")
    return floor


def main(argv: list[str] | None = None, preset: str = "serve") -> int:
    """``train.py`` for a serving run: a new one from ``preset``'s options (``agents.spec.PRESETS``), or ``--resume``."""
    from agents.config import ConfigError
    from agents.common.callbacks import sigterm_as_ctrl_c
    from bild_env.cli import setup_logging

    setup_logging()
    cfg, env_cfg = parse(argv, preset)
    run_dir = Path(cfg.log_dir) / (cfg.run_name or "?")

    def say(message: str) -> None:
        print(f"train.py: {message}", flush=True)

    phases = Phases(PHASES, say)
    try:
        with sigterm_as_ctrl_c():
            result = train(cfg, env_cfg, say, phases)
    except (FileExistsError, ConfigError) as err:
        phases.close()
        print(f"train.py: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before training started, or a second Ctrl-C / SIGTERM during it
        phases.close()
        then = (f"continue with `{resume_hint(run_dir)}` (from its newest complete checkpoint)"
                if cfg.run_name and serving_runs.complete_checkpoints(run_dir) else "start it again (the same command)")
        print(f"train.py: stopped at once, nothing saved since the last checkpoint; {then}", file=sys.stderr, flush=True)
        return 130
    if result.interrupted:
        phases.close()
        print(f"train.py: {result.interrupted}: stopped at step {result.steps} with a checkpoint; continue with "
              f"`{resume_hint(result.run_dir)}`", file=sys.stderr, flush=True)
        return 130
    peak = phases.peak_memory()
    phases.close()
    together = f", together at once {peak['together']:.0f} MB, each shared page once" if "together" in peak else ""
    print(f"run written to {result.run_dir} (step {result.steps}); peak memory {peak['max']:.0f} MB (this process "
          f"{peak['self']:.0f} MB, its largest child {peak['children']:.0f} MB{together}; in summary.json)")
    if result.table:
        print(f"\nthe agent against the rules on the run's {result.table[0]['episodes'] or ''} validation episodes "
              "(mean [95% interval]; the rules chosen on these same episodes):")
        print(format_table(result.table))
    print("\nnext:\n" + "\n".join(f"  {command}" for command in next_commands(result.run_dir)))
    return 0
