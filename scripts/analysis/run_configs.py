"""What the trainers read from each saved run shipped here: a digest per ``config.json`` under ``results/`` and of the
shipped serving agent (BiLD-v1: ``RunConfig.load``'s run options, the run's algorithm's hyperparameters and env;
BiLD-Serve-v0: ``saved_configs``' run options with the DQN's, and env), "refused: ..." where the run is refused.

    PYTHONPATH=<a checkout of the commit> python scripts/analysis/run_configs.py | gzip -n > digests.json.gz

run with another commit's code on ``PYTHONPATH`` (from this repository's root, so that the same files are read), made
the content of ``tests/data/run_configs_read_at_954badc.json.gz``, which ``tests/test_run_spec.py`` compares today's
reader with. It uses only what both that commit and today's code have."""

from __future__ import annotations

import glob
import hashlib
import json
from pathlib import Path

SHIPPED_AGENT = "bild_env/assets/serve-agent/config.json"


def read(path: str) -> str:
    """What the trainers read from the run's config.json, as text (paths as given, relative to the repository root)."""
    if json.loads(Path(path).read_text()).get("env_id") == "BiLD-Serve-v0":
        from agents.serve.options import saved_configs

        return repr(saved_configs(Path(path).parent))
    from agents.config import RunConfig

    c = RunConfig.load(path)
    return repr((c.train, c.algo_config, c.env))


def digest(path: str) -> str:
    try:
        return hashlib.sha256(read(path).encode()).hexdigest()[:16]
    except ValueError as err:
        return "refused: " + ("removed option" if "removed after commit" in str(err) else str(err)[:80])


if __name__ == "__main__":
    paths = sorted(glob.glob("results/**/config.json", recursive=True)) + [SHIPPED_AGENT]
    print(json.dumps({p: digest(p) for p in paths}, indent=0, sort_keys=True))
