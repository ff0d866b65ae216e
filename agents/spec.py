"""A run's saved spec, its ``config.json``: one format for every env, trainer and algorithm.

    {"version": 3, "env_id": "BiLD-Serve-v0", "env": {...}, "algo": "dqn", "hyperparams": {...}, "run": {...},
     "meta": {...}}

``env`` is the env's own config, as ``gymnasium.make(env_id, **env)`` takes it (sub-configs as objects); ``algo`` and
``hyperparams`` the algorithm and its hyperparameters (RL Zoo's names); ``run`` the trainer's own options (steps,
seed, evaluations, checkpoints); ``meta`` how it was saved (command line, time, library versions), never read back
as an option. ``train.py`` writes it for either env (``agents.config.RunConfig``, ``agents.serve.options``), as does
``python -m agents.offline``; everything that reads a run reads it here, and a run saved by an earlier version is
read into today's spec in one place (``bild_env.migrate.run_spec``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bild_env.command import UsageError
from bild_env.ids import ENV_ID, SERVE_ID
from bild_env.migrate import SPEC_VERSION, run_spec

FILE = "config.json"


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


def spec_file(model_path: str | Path) -> Path | None:
    """The ``config.json`` of the run a model file (or run folder) belongs to: beside it, or above ``checkpoints/``;
    None for a model without one."""
    p = Path(model_path)
    for folder in (p, p.parent, p.parent.parent):
        if (folder / FILE).is_file():
            return folder / FILE
    return None


__all__ = ["FILE", "RunSpec", "spec_file"]
