"""``python -m bild_env.fill``: fill the replay trees of a pair's prompts, serially or with Ray (``--ray [ADDRESS]``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from bild_env.cli import add_options, add_ray_option, finite_json, given, setup_logging
from bild_env.command import run_command
from bild_env.fill import FillConfig, FillResult, fill_serial

EPILOG = """examples:
  python -m bild_env.fill --pair tiny-random --prompts 8                   # serial, seconds
  python -m bild_env.fill --pair smollm2 --prompts 500 --ray               # a local Ray instance on this machine
  python -m bild_env.fill --pair opt --prompts 5000 --ray auto             # the cluster started by `ray start --head`
"""


def parse_config(argv: list[str] | None = None) -> FillConfig:
    parser = argparse.ArgumentParser(prog="python -m bild_env.fill", description=__doc__.split(":", 1)[1].strip(),
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(parser, "fill", FillConfig, FillConfig(), title="fill")
    add_ray_option(parser, "fill with Ray tasks")
    namespace = parser.parse_args(argv)
    cfg = replace(FillConfig(), ray=namespace.ray, **given(namespace, "fill"))
    try:
        cfg.check()
    except ValueError as err:
        parser.error(str(err))
    return cfg


def run(cfg: FillConfig) -> dict:
    """Fill, and report what each process did and the throughput (prompts and episodes per second of wall time)."""
    t0 = time.perf_counter()
    if cfg.ray is None:
        results = fill_serial(cfg)
    else:
        from bild_env.fill.cluster import fill_on_ray

        results = fill_on_ray(cfg, cfg.prompts, progress=lambda done, total: print(
            f"\r{done}/{total} tasks done", end="", file=sys.stderr, flush=True))
        print(file=sys.stderr)
    return summarize(cfg, results, time.perf_counter() - t0)


def summarize(cfg: FillConfig, results: list[FillResult], wall_s: float) -> dict:
    prompts = sum(len(r.prompts) for r in results)
    episodes = sum(r.episodes for r in results)
    return {"config": finite_json({k: getattr(cfg, k) for k in cfg.__dataclass_fields__}),
            "mode": "serial" if cfg.ray is None else f"ray ({cfg.ray})",
            "wall_s": wall_s, "prompts": prompts, "episodes": episodes,
            "prompts_per_s": prompts / wall_s, "episodes_per_s": episodes / wall_s,
            "fills": sum(r.fills for r in results), "nodes": sum(r.nodes for r in results),
            "workers": len({(r.node_ip, r.pid) for r in results}),
            "store": sorted({r.folder for r in results}), "tasks": [r.to_dict() for r in results]}


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    setup_logging()
    report = run(cfg)
    print(f"{report['mode']}: {report['prompts']} prompts ({report['episodes']} episodes, {report['fills']} model "
          f"forwards, {report['nodes']} prefixes) in {report['wall_s']:.1f} s = {report['prompts_per_s']:.2f} "
          f"prompts/s by {report['workers']} worker(s); trees in {', '.join(report['store'])}")
    if cfg.out:
        Path(cfg.out).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.out).write_text(json.dumps(finite_json(report), indent=1) + "\n")
    return 0


sys.exit(run_command("python -m bild_env.fill", main))
