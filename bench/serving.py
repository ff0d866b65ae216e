"""The ceiling, the hand-written rules and the online bandits (UCBSpec, EXP3Spec) of BiLD-Serve-v0, per load level
and per domain (its code is ``agents.serving_evaluation``; ``python evaluate.py --env serve`` runs the same).

    python -m bench.serving --pair smollm2                                  # rules, bandits and ceilings
    python -m bench.serving --pair smollm2 --model logs/<run1> logs/<run2>  # and agents beside them
    python -m bench.serving --pair tiny-random --speed                      # env steps per second, warm, per load
"""

import sys

from agents.serving_evaluation import ServingBenchConfig, action_set, main, markdown, plot_goodput, run, speed

__all__ = ["ServingBenchConfig", "action_set", "main", "markdown", "plot_goodput", "run", "speed"]

if __name__ == "__main__":
    from bild_env.errors import run_command

    sys.exit(run_command("python -m bench.serving", main))
