"""The ceiling, the hand-written rules and the online bandits (UCBSpec, EXP3Spec) of BiLD-Serve-v0, per load level
and per domain (its code is ``agents.serve.evaluation``; ``python evaluate.py --env serve`` runs the same).

    python -m bench.serving --pair smollm2                                  # rules, bandits and ceilings
    python -m bench.serving --pair smollm2 --model logs/<run1> logs/<run2>  # and agents beside them
    python -m bench.serving --pair tiny-random --speed                      # env steps per second, warm, per load
"""

import sys

from agents.serve.bench_config import ServingBenchConfig
from agents.serve.evaluation import main, run, speed
from agents.serve.evaluation_report import markdown, plot_goodput
from agents.serve.selection import action_set

__all__ = ["ServingBenchConfig", "action_set", "main", "markdown", "plot_goodput", "run", "speed"]

if __name__ == "__main__":
    from bild_env.errors import run_command

    sys.exit(run_command("python -m bench.serving", main))
