"""A run's saved spec, its ``config.json``: one format for every env, trainer and algorithm.

    {"version": 3, "env_id": "BiLD-Serve-v0", "env": {...}, "algo": "dqn", "hyperparams": {...}, "run": {...},
     "meta": {...}}

``env`` is the env's own config, as ``gymnasium.make(env_id, **env)`` takes it (sub-configs as objects); ``algo`` and
``hyperparams`` the algorithm and its hyperparameters (RL Zoo's names); ``run`` the trainer's own options (steps,
seed, evaluations, checkpoints); ``meta`` how it was saved (command line, time, library versions), never read back
as an option. ``train.py`` writes it for either env (``agents.config.RunConfig``, ``agents.serve.options``), as does
``python -m agents.offline``; everything that reads a run reads it here, and a run saved by an earlier version is
read into today's spec in one place (``bild_env.migrate.run_spec``).

A run starts from a preset (``PRESETS``, ``python train.py --env NAME``): a spec holding what differs from the env's
and the algorithm's own defaults; the command line's options go over it, and the run saves the whole spec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bild_env.command import UsageError
from bild_env.env import PAPER_SETTING
from bild_env.ids import ENV_ID, SERVE_ID
from bild_env.migrate import SPEC_VERSION, run_spec

FILE = "config.json"
ENV_NOT_CLI = ("split",)  # the env argument no command line takes: each command picks the split it runs on


def _env_classes() -> dict[str, type]:
    from bild_env.env import EnvConfig
    from bild_env.serving.env import ServingConfig

    return {ENV_ID: EnvConfig, SERVE_ID: ServingConfig}


def _tuples(values: dict) -> dict:
    """JSON lists back into the tuples the configs hold (one level: a sub-config's object checks its own keys)."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}


@dataclass(frozen=True)
class RunSpec:
    """What a run is: the env it trained on and how (``config.json``)."""

    env_id: str
    env: dict[str, Any]
    algo: str = "dqn"
    hyperparams: dict[str, Any] = field(default_factory=dict)
    run: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        """The spec as ``config.json`` holds it."""
        return json.dumps({"version": SPEC_VERSION, "env_id": self.env_id, "env": self.env, "algo": self.algo,
                           "hyperparams": self.hyperparams, "run": self.run, "meta": self.meta},
                          indent=1, default=_plain) + "\n"

    @classmethod
    def from_json(cls, data: Any) -> RunSpec:
        """The spec of a saved ``config.json``'s content, of any version; a ValueError saying what is wrong."""
        spec = run_spec(data, _env_classes())
        return cls(spec["env_id"], _tuples(spec["env"]), spec["algo"], _tuples(spec["hyperparams"]),
                   _tuples(spec["run"]), spec["meta"])

    @classmethod
    def load(cls, path: str | Path) -> RunSpec:
        """The spec in the file (or run folder) ``path``; a ``UsageError`` naming the file and what to do when it
        cannot be read."""
        path = Path(path)
        path = path / FILE if path.is_dir() else path
        try:
            data = json.loads(path.read_bytes())
        except (OSError, ValueError) as err:  # no file, no JSON, bytes that are not text
            raise UsageError(f"{path} cannot be read ({type(err).__name__}: {' '.join(str(err).split())[:120]}): "
                             "restore it from a copy of the run, or train anew under another --run-name") from None
        try:
            return cls.from_json(data)
        except ValueError as err:
            raise UsageError(f"{path}: {err}") from None

    def make(self, **overrides: Any):
        """The run's env: ``gymnasium.make(env_id, **env)`` with ``overrides`` over its arguments (a split, a cost
        model, a render mode), e.g. ``RunSpec.load("logs/<run>").make(split="test")``."""
        import gymnasium

        return gymnasium.make(self.env_id, **(self.env | overrides))


def _plain(value: Any) -> Any:
    """What ``json`` cannot write itself: a config's dataclass as its fields, anything else as its text."""
    from dataclasses import asdict, is_dataclass

    return asdict(value) if is_dataclass(value) else str(value)


# The starting points of a run, ``python train.py --env NAME`` (``bild`` where none is named): the env, its arguments
# where the command line is silent (over the env's own defaults) and the algorithm's hyperparameters (over its
# ``agents.config`` defaults) and run options (over the trainer's own defaults), with a line for the help page.
_LAPTOP = {"backend": "replay", "max_prompts": 32, "max_new_tokens": 32}  # exact replay; 32 prompts warm their trees
PRESETS: dict[str, tuple[str, RunSpec]] = {
    "bild": ("BiLD-v1, one request at a time, on a laptop CPU: the replay backend, the first 32 training prompts, 32 "
             "tokens an episode", RunSpec(ENV_ID, _LAPTOP)),
    "quick": ("BiLD-v1 as 'bild' on the toy pair (tiny-random: random weights, nothing to download), 2,000 steps: "
              "a minute on a laptop CPU", RunSpec(ENV_ID, _LAPTOP | {"pair": "tiny-random"},
                                                 run={"total_timesteps": 2_000})),
    "paper": ("BiLD-v1 as 'bild' in the BiLD paper's setting (BiLD-v0: its 5x5 grid, BLEU reward, observation)",
              RunSpec(ENV_ID, _LAPTOP | PAPER_SETTING)),
    # the lossless grid (rollback 0.5 < ln 2: every answer the target's greedy one) and speculation off, 6 actions
    # (on BiLD-v1's whole grid, 26 actions, the same DQN lost to speculation off on validation); each episode its own
    # mix (mix_draw 1: chosen on validation over the fixed mix, on the mix and on one with a domain the agents never
    # saw; docs/notes/serving-agents-by-draft.md). The DQN: a short horizon, as the load changes within tens of
    # steps; sooner learning and target updates; a larger buffer.
    "serve": ("BiLD-Serve-v0, a batch of requests under a moving load: the main job (the lossless grid and "
              "speculation off, four load levels, 64-step episodes, 40 prompts a domain)",
              RunSpec(SERVE_ID, {"actions": {"rollback_values": (0.5,)}, "load": "levels:0.05,0.15,0.3,1.0",
                                 "episode_steps": 64, "max_prompts": 40, "mix_draw": 1.0}, "dqn",
                      {"buffer_size": 100_000, "learning_starts": 500, "gamma": 0.9, "target_update_interval": 250,
                       "paired_actions": True})),
}


def preset(name: str) -> RunSpec:
    """The preset ``name`` of ``PRESETS``; a ``UsageError`` naming the presets for another name."""
    if name not in PRESETS:
        raise UsageError(f"no preset {name!r}: choose one of {', '.join(PRESETS)}")
    return PRESETS[name][1]


def preset_env(name: str):
    """The env config preset ``name`` starts from: its env's config class with the preset's arguments over its own
    defaults (``bild_env.config.over``)."""
    from bild_env.config import over

    spec = preset(name)
    return over(_env_classes()[spec.env_id](), spec.env)


def spec_file(model_path: str | Path) -> Path | None:
    """The ``config.json`` of the run a model file (or run folder) belongs to: beside it, or above ``checkpoints/``;
    None for a model without one."""
    p = Path(model_path)
    for folder in (p, p.parent, p.parent.parent):
        if (folder / FILE).is_file():
            return folder / FILE
    return None


def run_env_id(model_path: str | Path) -> str | None:
    """The env id of the run a model file (or run folder) belongs to (``spec_file``); None without a spec or where it
    cannot be read (its reader says why)."""
    path = spec_file(model_path)
    try:
        return None if path is None else RunSpec.load(path).env_id
    except ValueError:
        return None


__all__ = ["ENV_NOT_CLI", "FILE", "PRESETS", "RunSpec", "preset", "preset_env", "run_env_id", "spec_file"]
