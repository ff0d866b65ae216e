"""The speed/quality front: do learned agents push it beyond the 25 fixed threshold pairs?

    python -m scripts.analysis.front --model logs/<run1> logs/<run2> ...               # runs that trained already
    python -m scripts.analysis.front --train-weights 1 3 10 30 --algo dqn              # train one agent per regret weight first

On ``--prompts`` prompts of ``--split`` (replay backend, cost-model latency, the same prompts for
every policy), every fixed action and every agent is run once per prompt; each becomes a point
(latency per sentence, regret in nats per token: the quality lost against the target's own choice).
The fixed pairs that no other pair beats on both axes form the grid-search front. An agent left of
or below that front has pushed it outward; its distance is reported as the latency the front needs
for the agent's regret (interpolated between front points) minus the agent's.

With ``--train-weights``, one run per weight is trained first (``python train.py`` with
``--reward regret_weight=W --algo A --total-timesteps N``, into ``--log-dir``; a run that exists is read,
not trained again). Writes ``--out`` (JSON) and a plot beside it (``.png``).
"""

from __future__ import annotations

import sys

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from agents.config import ConfigError
from agents.bild.evaluation import returns_on_prompts
from agents.bild.runs import run_config_of
from agents.common.trained import choose_model, load_agent
from bench.headroom import agent_env_config, fixed_table, make_env
from bild_env.cli import parse_dataclass, setup_logging
from bild_env.env import EnvConfig
from bild_env.command import UsageExit
from bild_env.models.pairs import DEFAULT_PAIR
from bild_env.replay.store import TreeStore


@dataclass
class FrontConfig:
    """Options of the front benchmark (the CLI is generated from it)."""

    pair: str = field(default=DEFAULT_PAIR, metadata={"help": "model pair preset"})
    split: str = field(default="test", metadata={"help": "prompts the policies are placed on"})
    prompts: int = field(default=100, metadata={"help": "how many (the first N of the split)"})
    max_new_tokens: int = field(default=32, metadata={"help": "tokens per episode (the main job's)"})
    model: tuple[str, ...] = field(default=(), metadata={"help": "SB3 model files or run folders to place"})
    train_weights: tuple[float, ...] = field(default=(), metadata={"help": (
        "train one agent per regret weight first (see the module docstring)")})
    algo: str = field(default="dqn", metadata={"help": "the algorithm trained with --train-weights"})
    action: str = field(default="discrete", metadata={"help": "the action space trained with --train-weights"})
    total_timesteps: int = field(default=30_000, metadata={"help": "steps of each run trained with --train-weights"})
    log_dir: str = field(default="logs/front", metadata={"help": "where --train-weights runs are written"})
    threads: int = field(default=1, metadata={"help": "torch CPU threads"})
    out: str = field(default="results/front.json", metadata={"help": (
        "JSON with every point; the plot is written beside it (.png)")})


def pareto(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower latency and lower regret), by latency."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def front_latency(front: list[tuple[float, float]], regret: float) -> float | None:
    """The latency the front needs to keep regret at ``regret`` (front points sorted by latency, regret falling);
    linear between points, None above the front's worst regret (no fixed pair is that lossy and that slow)."""
    if regret >= front[0][1]:
        return front[0][0] if regret == front[0][1] else None
    for (l0, r0), (l1, r1) in zip(front, front[1:]):
        if r1 <= regret <= r0:
            return l0 + (l1 - l0) * (r0 - regret) / (r0 - r1) if r0 != r1 else l0
    return front[-1][0]  # at or below the front's best regret: its slowest (most careful) point


def train_runs(cfg: FrontConfig) -> list[str]:
    from agents.commands import train_main

    runs = []
    for weight in cfg.train_weights:
        name = f"{cfg.algo}_{cfg.action}_w{weight:g}"
        run = Path(cfg.log_dir) / name
        if not (run / "model.zip").is_file():
            argv = ["--algo", cfg.algo, "--actions", f"space={cfg.action}", "--reward", f"regret_weight={weight}", "--pair", cfg.pair,
                    "--total-timesteps", str(cfg.total_timesteps), "--log-dir", cfg.log_dir, "--run-name", name,
                    "--max-new-tokens", str(cfg.max_new_tokens)]
            if train_main(argv) != 0:
                raise SystemExit(f"scripts.analysis.front: training {name} failed (see above)")
        runs.append(str(run))
    return runs


def run(cfg: FrontConfig) -> dict:
    torch.set_num_threads(cfg.threads)
    models = list(cfg.model) + train_runs(cfg)
    base = EnvConfig(pair=cfg.pair, backend="replay", split=cfg.split, max_prompts=cfg.prompts,
                     max_new_tokens=cfg.max_new_tokens, replay_store=TreeStore())
    env = make_env(base)
    env.references.prefetch(env.prompts)
    prompts = list(range(len(env.prompts)))
    table = fixed_table(env, prompts, f"fixed actions ({cfg.split})")
    fixed = [{"action": a, "thresholds": env.thresholds(a)} | table[a].means() for a in sorted(table)]
    points = [(p["latency_ms"], p["regret"]) for p in fixed]
    front_ids = pareto(points)
    front = [points[i] for i in front_ids]
    agents = []
    for path in models:
        file, _ = choose_model(path)
        agent_cfg = agent_env_config(path, replace(base, cost_model=env.cost_model))
        agent_env = env if agent_cfg == env.config else make_env(agent_cfg)
        model = load_agent(file, agent_env)
        means = returns_on_prompts(agent_env, model, prompts, desc=str(file)).means()
        run_cfg = run_config_of(file)
        needed = front_latency(front, means["regret"])
        agents.append({"model": str(file), "algo": run_cfg.train.algo if run_cfg else None,
                       "regret_weight": run_cfg.env.reward.regret_weight if run_cfg else None, **means,
                       "front_latency_ms": needed,
                       "ahead_of_front_ms": None if needed is None else needed - means["latency_ms"]})
    env.close()
    return {"config": asdict(cfg), "device": env.cost_model.device, "dtype": str(env.pair.dtype), "fixed": fixed,
            "front": [fixed[i]["action"] for i in front_ids], "agents": agents}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    fixed = report["fixed"]
    ax.scatter([p["latency_ms"] for p in fixed], [p["regret"] for p in fixed], c="0.6", s=30, label="25 fixed pairs")
    for p in fixed:
        ax.annotate(f"{p['thresholds'][0]}/{p['thresholds'][1]}", (p["latency_ms"], p["regret"]), fontsize=6,
                    color="0.4")
    by_action = {p["action"]: p for p in fixed}
    front = [by_action[a] for a in report["front"]]
    ax.step([p["latency_ms"] for p in front], [p["regret"] for p in front], where="post", c="k", lw=1,
             label="grid-search front")
    for a in report["agents"]:
        label = f"{a['algo'] or 'agent'}" + (f", regret weight {a['regret_weight']:g}" if a["regret_weight"] is not None else "")
        ax.scatter([a["latency_ms"]], [a["regret"]], marker="*", s=200, label=label)
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_xlabel("latency per sentence, ms (cost model)")
    ax.set_ylabel("regret, nats per token (lower: closer to the target's own choice)")
    cfg = report["config"]
    ax.set_title(f"Speed/quality front: {cfg['prompts']} {cfg['split']} prompts, {cfg['pair']} ({report['dtype']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(report: dict) -> str:
    lines = ["| policy | latency ms | regret nats/token | fidelity | return | front's latency at that regret | ahead of the front ms |",
             "|---|---|---|---|---|---|---|"]
    by_action = {p["action"]: p for p in report["fixed"]}
    for a in report["front"]:
        p = by_action[a]
        lines.append(f"| fixed {p['thresholds'][0]}/{p['thresholds'][1]} (front) | {p['latency_ms']:.1f} | "
                     f"{p['regret']:.4f} | {p['fidelity']:.4f} | {p['return']:+.4f} | | |")
    for a in report["agents"]:
        need = "n/a" if a["front_latency_ms"] is None else f"{a['front_latency_ms']:.1f}"
        ahead = "n/a" if a["ahead_of_front_ms"] is None else f"{a['ahead_of_front_ms']:+.1f}"
        lines.append(f"| {a['algo']} w={a['regret_weight']} ({a['model']}) | {a['latency_ms']:.1f} | {a['regret']:.4f} | "
                     f"{a['fidelity']:.4f} | {a['return']:+.4f} | {need} | {ahead} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    setup_logging()
    cfg = parse_dataclass(FrontConfig, argv, __doc__)
    try:
        report = run(cfg)
    except ConfigError as err:  # a run folder whose config.json or model cannot be read, named
        raise UsageExit(f"scripts.analysis.front: {err}") from err
    print(markdown(report))
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    from bild_env.command import run_command

    sys.exit(run_command("python -m scripts.analysis.front", main))
