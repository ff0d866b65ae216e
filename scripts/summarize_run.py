"""Print a training run's learning curves in numbers (what the README quotes from a run's TensorBoard events).

    python scripts/summarize_run.py results/smollm2-main-job/run

For each evaluation (SB3's EvalCallback on validation prompts): ``eval/mean_reward`` and
``eval/bleu`` by step. For the per-episode training scalars (``bild/episode_reward``, ``bild/bleu``,
``replay/hit_rate``): their means over the first, fifth and last tenth of the logged points.
"""

from __future__ import annotations

import argparse
import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

EVAL_TAGS = ("eval/mean_reward", "eval/bleu")
TRAIN_TAGS = ("bild/episode_reward", "bild/bleu", "replay/hit_rate")


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 3) if values else None  # None: too few points for that tenth


def summarize(run_dir: str) -> dict:
    events = EventAccumulator(run_dir, size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    tags = set(events.Tags()["scalars"])
    out: dict = {}
    for tag in EVAL_TAGS:
        if tag in tags:
            out[tag] = {e.step: round(e.value, 3) for e in events.Scalars(tag)}
    for tag in TRAIN_TAGS:
        if tag in tags:
            values = [e.value for e in events.Scalars(tag)]
            k = max(1, len(values) // 10)
            out[tag] = {"points": len(values), "first tenth": _mean(values[:k]),
                        "fifth tenth": _mean(values[4 * k : 5 * k]), "last tenth": _mean(values[-k:])}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run folder holding TensorBoard events (logs/<run_name>)")
    print(json.dumps(summarize(parser.parse_args().run_dir), indent=2))


if __name__ == "__main__":
    main()
