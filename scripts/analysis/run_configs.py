"""What the trainers read from each saved run shipped here: per ``config.json`` under ``results/`` and of the shipped
serving agent, a digest of the option values read (BiLD-v1: ``RunConfig.load``'s run options, the run's algorithm's
hyperparameters and env; BiLD-Serve-v0: ``saved_configs``' run options with the DQN's, and env), "refused: ..." where
the run is refused; and per env the options read (``keys``: dotted paths such as
``env.actions.fallback_values``).

    PYTHONPATH=<a checkout of the commit> python scripts/analysis/run_configs.py | gzip -n > digests.json.gz

run with another commit's code on ``PYTHONPATH`` (from this repository's root, so that the same files are read), made
the content of ``tests/data/run_configs_read_at_954badc.json.gz``, which ``tests/test_run_spec.py`` compares today's
reader with over that commit's ``keys`` (an option added since is not in the digest; one renamed or removed changes
it). It uses only what both that commit and today's code have."""

from __future__ import annotations

import glob
import hashlib
import json
from dataclasses import fields, is_dataclass
from pathlib import Path

SHIPPED_AGENT = "bild_env/assets/serve-agent/config.json"


def _flat(obj, prefix: str) -> dict[str, str]:
    """``obj``'s option values by dotted path, sub-configs opened, each value as its ``repr``."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        out |= _flat(value, f"{prefix}{f.name}.") if is_dataclass(value) else {prefix + f.name: repr(value)}
    return out


def read(path: str) -> tuple[str, dict[str, str]]:
    """The env id of the run's config.json and the option values the trainers read from it (paths relative to the
    repository root)."""
    if json.loads(Path(path).read_text()).get("env_id") == "BiLD-Serve-v0":
        from agents.serve.options import saved_configs

        train, env = saved_configs(Path(path).parent)
        return "BiLD-Serve-v0", _flat(train, "run.") | _flat(env, "env.")
    from agents.config import RunConfig

    c = RunConfig.load(path)
    return "BiLD-v1", _flat(c.train, "run.") | _flat(c.algo_config, "hyperparams.") | _flat(c.env, "env.")


def digest(values: dict[str, str], keys: list[str]) -> str:
    """The digest of ``values`` at ``keys`` (a key ``values`` lacks counts as missing)."""
    shown = json.dumps([(k, values.get(k, "<missing>")) for k in sorted(keys)])
    return hashlib.sha256(shown.encode()).hexdigest()[:16]


def read_all() -> tuple[dict[str, tuple[str, dict[str, str]] | str], dict[str, list[str]]]:
    """Every shipped run's env id and values (or why it is refused), and per env id the union of its runs' keys."""
    runs, keys = {}, {}
    for p in sorted(glob.glob("results/**/config.json", recursive=True)) + [SHIPPED_AGENT]:
        try:
            runs[p] = read(p)
            keys.setdefault(runs[p][0], set()).update(runs[p][1])
        except ValueError as err:
            runs[p] = "refused: " + ("removed option" if "removed after commit" in str(err) else str(err)[:80])
    return runs, {env_id: sorted(k) for env_id, k in keys.items()}


if __name__ == "__main__":
    runs, keys = read_all()
    print(json.dumps({"keys": keys, "digests": {p: v if isinstance(v, str) else digest(v[1], keys[v[0]])
                                                for p, v in runs.items()}}, indent=0, sort_keys=True))
