"""BiLD-Serve-v0's part of ``python train.py --env serve`` (the trainer is ``agents.training``, one for both envs;
the options and ``--help``: ``agents.serve.options``).

``ServeRoom`` is what the trainer adds for the serving env: the main job's ``PHASES``, one progress line each (the
pair's models fetched and converted, the cost tables timed, the replay trees built by the rules' validation
episodes, ``agents.serve.validation.rule_references``, the training prompts' trees filled by a second process
meanwhile, ``start_fill``; then training), the DQN that learns from every action (``agents.dqn.AllActionsDQN``),
the evaluations beside the rules, the time budget, the checkpoints' state (``agents.serve.runs``) and, at the end,
the agent on the per-batch-size table's floor (``put_on_floor``), the agent against the rules
(``agents.serve.run_report``) and ``summary.json``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import DummyVecEnv

from agents.common.callbacks import EpisodeMetrics as CommonEpisodeMetrics, StopRequest, TimeBudget
from agents.common.checkpoints import Checkpoint, discard_after
from agents.common.files import write_text_atomic
from agents.common.folders import restore_best_model, resume_hint
from agents.common.parse import run_name
from agents.common.phases import Phases
from agents.common.replay_buffer import load_replay_buffer
from agents.dqn import AllActionsDQN
from agents.serve import runs as serving_runs
from agents.serve.options import (DEFAULT_TIME_BUDGET_MIN, ServeOptions, ServeTrainConfig, default_timesteps,
                                  dqn_config)
from agents.serve.run_report import comparison, format_table, next_commands
from agents.serve.selection import FLOOR_MARGINS
from agents.serve.validation import (ServingEval, choose_floor, custom_scalars, default_references, rule_references,
                                     validation_envs, validation_seeds, write_evaluations)
from agents.training import Room, TrainResult
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


class ServeRoom(Room):
    """BiLD-Serve-v0's runs for ``agents.training.train`` (the options: ``agents.serve.options``)."""

    env_id, options = SERVE_ID, ServeOptions
    layout, keep, algorithm = serving_runs.LAYOUT, serving_runs.KEEP, AllActionsDQN  # its checkpoints
    read_state = staticmethod(serving_runs.read_serving_state)
    skipped = Room.say  # on stdout, with the job's phases

    def __init__(self, cfg: ServeTrainConfig, env_cfg: ServingConfig) -> None:
        self.phases = Phases(PHASES, self.say)  # the job's clock starts here
        if cfg.total_timesteps is None:
            budget = DEFAULT_TIME_BUDGET_MIN if cfg.time_budget is None else cfg.time_budget
            cfg = replace(cfg, total_timesteps=default_timesteps(env_cfg), time_budget=budget)
            self.say(f"training for {cfg.total_timesteps} steps (the default for the pair's dtype; --total-timesteps "
                     "overrides)" + (f", or until {budget:g} minutes into the job where this machine is slower "
                                     "(--time-budget)" if budget else ""))
        elif cfg.time_budget is None:
            cfg = replace(cfg, time_budget=0.0)  # the count given is trained whole
        charging = env_cfg.charging
        if env_cfg.cost_profile or charging.train_profiles:  # nobody should take these rewards for this machine's clock
            self.say("costs charged by " + (
                f"cost profile {env_cfg.cost_profile}" if env_cfg.cost_profile else
                f"one of the cost profiles {', '.join(charging.train_profiles)} per episode"
                + (f", varied up to x{charging.vary_profiles:g}" if charging.vary_profiles > 1 else "")))
        self.cfg, self.env_cfg, self.resume = cfg, env_cfg, cfg.resume
        self.run_dir = Path(cfg.log_dir) / (cfg.run_name or run_name(SERVE_ID, env_cfg, "dqn", cfg.seed))
        self.total, self.n_envs, self.checkpoint_freq = cfg.total_timesteps, cfg.n_envs, cfg.checkpoint_freq
        self.progress_bar = cfg.progress_bar
        self.train_env, self.eval_envs, self.filler = None, [], None
        self.evaluator: ServingEval | None = None
        self.budget: TimeBudget | None = None
        self.bar = None

    @classmethod
    def from_argv(cls, argv: list[str] | None, preset: str | None = None) -> ServeRoom:
        from bild_env.cli import setup_logging

        setup_logging()
        return super().from_argv(argv, preset)

    def setup(self, start: Checkpoint | None):
        """The job's phases before training: the models fetched, the cost tables timed (``prepare``), the envs made and
        the replay trees built by the rules' validation episodes (the references drawn beside the agent)."""
        cfg, env_cfg, run_dir = self.cfg, self.env_cfg, self.run_dir
        torch.set_num_threads(cfg.torch_threads)
        prepare(env_cfg, self.phases)
        with self.phases.phase(PHASES[2], unit="episode") as bar:  # the fixed policies' episodes fill the replay trees
            self.filler = filler = start_fill(cfg, env_cfg)  # the training prompts' trees, on the other core
            self.train_env = make_vec_env(SERVE_ID, n_envs=cfg.n_envs, seed=cfg.seed + (start.steps if start else 0),
                                          vec_env_cls=DummyVecEnv,
                                          env_kwargs=env_cfg.arguments(split="train") | {"render_mode": None},
                                          wrapper_class=PeekAll if cfg.dqn.all_actions else None)
            if env_cfg.actions.max_draft_len == AUTO:  # the cap the training envs chose is the run's (evaluations, resume)
                chosen = self.train_env.envs[0].unwrapped.config.actions.max_draft_len
                env_cfg = self.env_cfg = replace(env_cfg, actions=replace(env_cfg.actions, max_draft_len=chosen))
            self.eval_envs = validation_envs(env_cfg.arguments())
            if start is None:
                write_text_atomic(run_dir / "config.json", cfg.spec(env_cfg).text())
            seeds = validation_seeds(cfg.eval_episodes)
            if filler is not None:
                bar.total += decodes(env_cfg, sum(self.train_env.envs[0].unwrapped.workload.sizes.values()))
            references = rule_references(self.eval_envs, seeds,
                                         tuple(cfg.reference_actions or default_references(self.eval_envs[0])),
                                         filler.counted(bar) if filler is not None else bar)
            if filler is not None and not filler.wait(bar):
                self.say(f"the fill of the training prompts' replay trees stopped (exit code "
                         f"{filler.process.exitcode}; its error is above): training fills what is missing as it goes")
        custom_scalars(run_dir, list(references))
        self.evaluator = ServingEval(self.eval_envs, seeds, cfg.eval_freq, references, run_dir)
        return self.train_env

    def make_model(self, env, start: Checkpoint | None):
        if start is None:
            return AllActionsDQN("MlpPolicy", env, seed=self.cfg.seed, device="cpu",
                                 **dqn_config(self.cfg).sb3_kwargs(self.cfg.n_envs, env.action_space.n))
        model = AllActionsDQN.load(start.model, env=env, device="cpu")
        load_replay_buffer(model, start.replay_buffer)
        return model

    def restore(self, model, start: Checkpoint) -> None:
        """The evaluations as they stood at the checkpoint, and the best model of the steps kept."""
        evaluator = self.evaluator
        state = serving_runs.read_serving_state(start.state, start.steps)
        evaluator.history, evaluator.best, evaluator.next_at = state["history"], state["best"], state["next_eval_at"]
        discard_after(self.run_dir, start.steps, self.say)
        write_evaluations(self.run_dir, evaluator.history)
        restore_best_model(self.run_dir, serving_runs.best_of(evaluator.history), self.say)

    @contextlib.contextmanager
    def training(self, model):
        with self.phases.phase(PHASES[3], unit="step", total=max(0, self.total - model.num_timesteps)) as self.bar:
            yield

    def callbacks(self, model, stop: StopRequest) -> list[BaseCallback]:
        """The evaluations, the episode metrics, the phase's progress, and the time budget where there is one: it ends
        training where the machine is too slow for the count, exploration first."""
        cfg, evaluator = self.cfg, self.evaluator
        callbacks = [evaluator, EpisodeMetrics(), PhaseProgress(self.bar)]
        if cfg.time_budget:
            self.budget = TimeBudget(self.phases.start + 60 * cfg.time_budget, stop,
                                     min_steps=int(cfg.dqn.exploration_fraction * cfg.total_timesteps),
                                     reserve_s=lambda: (1.5 + len(FLOOR_MARGINS) * cfg.floor) * evaluator.longest_s
                                     + 5.0)
            callbacks.insert(0, self.budget)
        return callbacks

    def settle(self, model, stop: StopRequest, interrupted: str | None) -> str | None:
        """A run the time budget ended is whole (evaluated and saved as at its total); the final model is evaluated
        once."""
        if interrupted is None and stop.requested and stop.reason != TimeBudget.REASON:
            interrupted = stop.reason  # a signal in the last rollout: training ended before it could stop there
        if self.budget is not None and self.budget.stopped_at is not None and interrupted == TimeBudget.REASON:
            interrupted = None
            self.say(f"training ended by the time budget ({self.cfg.time_budget:g} minutes into the job) at step "
                     f"{model.num_timesteps} of {self.total}; go on with `{resume_hint(self.run_dir)}`")
        history = self.evaluator.history
        if interrupted is None and (not history or history[-1]["step"] != model.num_timesteps):
            self.evaluator.evaluate()  # the final model, once
        return interrupted

    def state_of(self, model) -> dict:
        ev = self.evaluator
        return serving_runs.state_of(model.num_timesteps, ev.history, ev.best, ev.next_at)

    def finish(self, model, interrupted: str | None) -> list[dict]:
        """The agent on the table's floor (a run that reached its end), the agent against the rules,
        ``summary.json``."""
        cfg, history, references = self.cfg, self.evaluator.history, self.evaluator.references
        best = max(history, key=lambda row: row["return"]) if history else None
        floor = None
        if cfg.floor and interrupted is None and best is not None and "table" in references.get("batch_table", {}):
            floor = put_on_floor(self.run_dir, model, best, self.eval_envs, self.evaluator.seeds,
                                 references["batch_table"], self.say)
        table = comparison(history, references, floor)
        budget_ended = self.budget is not None and self.budget.stopped_at is not None
        write_summary(self.run_dir, self.phases, {
            "steps": int(model.num_timesteps), "interrupted": interrupted, "total_timesteps": cfg.total_timesteps,
            "time_budget_min": cfg.time_budget, "ended_by_time_budget": budget_ended, "references": references,
            "best_evaluation": best, "floor": floor, "last_evaluation": history[-1] if history else None,
            "result": {"table": table, "next": next_commands(self.run_dir)}})
        return table

    def close(self) -> None:
        if self.filler is not None:  # ended already, unless the job stopped during the tree phase
            self.filler.stop()
        if self.train_env is not None:
            self.train_env.close()
        for env in self.eval_envs:
            env.close()

    def report(self, result: TrainResult) -> None:
        peak = self.phases.peak_memory()
        self.phases.close()
        together = f", together at once {peak['together']:.0f} MB, each shared page once" if "together" in peak else ""
        print(f"run written to {result.run_dir} (step {result.steps}); peak memory {peak['max']:.0f} MB (this process "
              f"{peak['self']:.0f} MB, its largest child {peak['children']:.0f} MB{together}; in summary.json)")
        if result.table:
            print(f"\nthe agent against the rules on the run's {result.table[0]['episodes'] or ''} validation episodes "
                  "(mean [95% interval]; the rules chosen on these same episodes):")
            print(format_table(result.table))
        print("\nnext:\n" + "\n".join(f"  {command}" for command in next_commands(result.run_dir)))

    def end(self) -> None:
        self.phases.close()


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
