"""Print a training run's learning curves in numbers (what the documentation quotes from a run's TensorBoard events).

    python -m scripts.analysis.summarize_run results/smollm2-main-job/run

For each evaluation (SB3's EvalCallback on validation prompts): ``eval/mean_reward`` and
``eval/bleu`` by step. For the per-episode training scalars (``bild/episode_reward``, ``bild/bleu``,
``replay/hit_rate``): their means over the first, fifth and last tenth of the logged points.
The numbers come from ``agents.bild.runs.summarize``; this is its command line.
"""

from __future__ import annotations

import argparse
import json

from agents.config import ConfigError
from agents.bild.runs import summarize


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run folder holding TensorBoard events (logs/<run_name>)")
    try:
        print(json.dumps(summarize(parser.parse_args(argv).run_dir), indent=2))
    except ConfigError as err:
        parser.error(str(err))


if __name__ == "__main__":
    main()
