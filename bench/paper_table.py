"""The BiLD paper's Table 2 in structure: each decoding method's latency per generation and quality, by a cost model.

    python -m bench.paper_table --cost-profile h200-opt-eager --model logs/<run1> logs/<run2> logs/<run3>
    python -m bench.paper_table --model logs/<run1> ...          # this machine's own cost model
    python -m bench.paper_table --pair tiny-random --prompts 4 --select-prompts 4 --max-new-tokens 8   # seconds

The paper (Kim et al. 2023, with the DQN of the short paper this project implements) reports mean latency per
generated sentence on WikiText-2 with OPT-125M drafting for OPT-6.7B on one RTX 4090: single model 208.13 ms, naive
speculative decoding 124.30 ms, BiLD at (0.103, 4.697) 101.24 ms, BiLD with the DQN 96.86 ms. Here every method
decodes the same ``--prompts`` prompts of ``--split`` (the pair's preset dataset: the smollm2 pair's is English
Wikipedia lead sections, the paper's source; WikiText-2 itself needs the Hugging Face hub) on the replay backend, each
generation's latency charged by one cost model: this machine's (timed once, cached) or a hardware profile's
(``--cost-profile``: the timings of the profile's shapes on its device; the tokens are still the pair's own).

Rows (``ROWS``): the single model (target only: the env's speculation-off action at every step); naive speculative
decoding with k drafts (fallback 0, rollback 0.5 < ln 2: lossless; k of ``K_CHOICES`` chosen on the select split);
a confidence-stopped naive SD (BiLD's fallback at 0.5 with the lossless rollback, at most 8 drafts: like transformers'
adaptive length, except that the unsure token is withheld, its draft forward paid, as BiLD's fallback does); BiLD at the
paper's (0.103, 4.697); BiLD at the best pair of the 5 x 5 grid (chosen on the select split by mean return, as
grid search does); each agent given (``--model``; deterministic; several DQNs also as their Q-ensemble). Each row:
mean latency per generation (ms) with its 95% bootstrap interval, the speedup over the single model on the same
prompts, BLEU against the target's greedy output, the share of outputs equal to it (the paper's rollback 4.697 is
lossy), acceptance; the agents' and the best pair's latency differences to the paper's fixed pair, paired by prompt.
Writes ``--out`` (JSON, every per-prompt latency) and prints the table beside the paper's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch
from tqdm import tqdm

from agents.bild.baselines import FixedAction, FixedThresholds
from agents.bild.evaluation import PromptResults, returns_on_prompts
from agents.common.stats import mean_ci
from bench.headroom import (BENCH_ENV, bench_env, best_action, check_models, env_report, fixed_table, make_env,
                            own_options, prompts_ran, run_agents, run_bench)
from bild_env.decoding.bild import FIXED_FALLBACK, FIXED_ROLLBACK
from bild_env.env import EnvConfig
from bild_env.command import check_options
from bild_env.replay.store import TreeStore

PAPER_MS = {"single model": 208.13, "naive speculative decoding": 124.30, "BiLD (0.103, 4.697)": 101.24,
            "BiLD + DQN": 96.86}  # Kim et al. / the DQN paper, OPT-125M -> OPT-6.7B, WikiText-2, one RTX 4090
K_CHOICES = (2, 4, 6, 8, 10)  # naive SD's draft lengths the select split chooses among
LOSSLESS = 0.5  # a rollback threshold below ln 2: every token the target would not pick is rolled back
ADAPTIVE = (0.5, 8)  # the confidence-stopped naive SD: fall back below this confidence, at most this many drafts


@dataclass
class PaperTableConfig:
    """Options of the paper-table benchmark (the CLI is generated from it)."""

    split: str = field(default="test", metadata={"help": "prompts the methods are compared on"})
    prompts: int = field(default=100, metadata={"help": "how many (the first N of the split)"})
    select_split: str = field(default="validation", metadata={"help": (
        "prompts naive SD's k and the best grid pair are chosen on")})
    select_prompts: int = field(default=50, metadata={"help": "how many"})
    model: tuple[str, ...] = field(default=(), metadata={"help": (
        "BiLD-v1 agents (SB3 model files or run folders); several DQNs also as their Q-ensemble")})
    threads: int = field(default=1, metadata={"help": "torch CPU threads"})
    out: str = field(default="results/paper_table.json", metadata={"help": "JSON with every per-prompt number"})
    env: EnvConfig = field(default_factory=lambda: replace(BENCH_ENV), metadata={"cli": False, "help": (
        "the replayed env the methods run in: BENCH_ENV with the env's arguments given (ENV_OPTIONS; a dict of some of "
        "them is read over BENCH_ENV); its actions are each method's own")})

    def __post_init__(self) -> None:
        self.env = bench_env(self.env)
        check_options(self, at_least_one=("prompts", "select_prompts", "threads"))
        check_options(self.env, at_least_one=("max_new_tokens",))


ENV_OPTIONS = ("pair", "pair_options", "dataset", "max_new_tokens", "cost_profile")  # the env arguments it takes


def _fixed(env, fallback: float, rollback: float, prompts: list[int], desc: str) -> PromptResults:
    return returns_on_prompts(env, FixedThresholds(env, fallback, rollback), prompts, desc=desc)


def _method_env(base: EnvConfig, fallback: float, k: int, cost_model, store):
    """A one-action env for a naive-SD method: that fallback, the lossless rollback, at most ``k`` drafts."""
    actions = replace(base.actions, fallback_values=(fallback,), rollback_values=(LOSSLESS,), max_draft_len=k)
    return make_env(replace(base, actions=actions, cost_model=cost_model, replay_store=store))


def _row(name: str, res: PromptResults, single: np.ndarray, against: dict[str, PromptResults] | None = None) -> dict:
    """A method's row: latency per generation with its interval, speedup over the single model, quality; for each of
    ``against`` (``paper_fixed``, ``best_pair``) the latency and BLEU differences to it, paired by prompt."""
    ms = res.summaries["latency_ms"]
    out = {"method": name, "latency_ms": float(ms.mean()), "latency_ms_ci95": list(mean_ci(ms)),
           "speedup": float(single.mean() / ms.mean()), "bleu": float(res.summaries["bleu"].mean()),
           "exact_match": float(res.summaries["exact_match"].mean()),
           "acceptance": float(res.summaries["acceptance_rate"].mean()), "return": float(res.returns.mean()),
           "per_prompt_latency_ms": ms.tolist()}
    for key, base in (against or {}).items():
        diff = ms - base.summaries["latency_ms"]
        out[f"minus_{key}_ms"], out[f"minus_{key}_ms_ci95"] = float(diff.mean()), list(mean_ci(diff))
        out[f"minus_{key}_bleu"] = float((res.summaries["bleu"] - base.summaries["bleu"]).mean())
    return out


def run(cfg: PaperTableConfig) -> dict:
    check_models(cfg.model)
    torch.set_num_threads(cfg.threads)
    store = TreeStore()
    base = replace(cfg.env, replay_store=store)
    select = make_env(replace(base, split=cfg.select_split, max_prompts=cfg.select_prompts))
    cost = select.cost_model
    test_cfg = replace(base, split=cfg.split, max_prompts=cfg.prompts, cost_model=cost)
    env = make_env(test_cfg)
    off_env = make_env(replace(test_cfg, actions=replace(test_cfg.actions, off_switch=True)))
    prompts, chosen = list(range(len(env.prompts))), list(range(len(select.prompts)))
    for e in (select, env):
        e.references.prefetch(e.prompts)

    # 1. what the select split chooses: naive SD's k and the best pair of the grid
    k_means = {}
    for k in tqdm(K_CHOICES, desc=f"naive SD k ({cfg.select_split})", leave=False):
        e = _method_env(replace(base, split=cfg.select_split, max_prompts=cfg.select_prompts), 0.0, k, cost, store)
        k_means[k] = float(_fixed(e, 0.0, LOSSLESS, chosen, None).summaries["latency_ms"].mean())
    k = min(k_means, key=lambda x: (k_means[x], x))
    best = best_action(fixed_table(select, chosen, f"grid ({cfg.select_split})"))

    # 2. every method on the test prompts
    single = _single(off_env, prompts)
    single_ms = single.summaries["latency_ms"]
    paper = _fixed(env, FIXED_FALLBACK, FIXED_ROLLBACK, prompts, "BiLD (0.103, 4.697)")
    naive = _fixed(_method_env(test_cfg, 0.0, k, cost, store), 0.0, LOSSLESS, prompts, f"naive SD k={k}")
    adaptive = _fixed(_method_env(test_cfg, ADAPTIVE[0], ADAPTIVE[1], cost, store), ADAPTIVE[0], LOSSLESS, prompts,
                      "adaptive naive SD")
    grid = _fixed(env, *env.thresholds(best), prompts, f"BiLD best pair {env.thresholds(best)}")
    both = {"paper_fixed": paper, "best_pair": grid}
    rows = [_row("single model", single, single_ms), _row(f"naive speculative decoding (k = {k})", naive, single_ms),
            _row(f"naive SD, confidence stop (BiLD fallback {ADAPTIVE[0]}, lossless, at most {ADAPTIVE[1]})", adaptive,
                 single_ms),
            _row("BiLD (0.103, 4.697)", paper, single_ms, {"paper_fixed": paper}),
            _row(f"BiLD, best grid pair {env.thresholds(best)} (chosen on {cfg.select_split})", grid, single_ms,
                 {"paper_fixed": paper})]
    ran, models = run_agents(cfg.model, test_cfg, prompts)  # each in an env of its own
    rows += [_row(f"BiLD + {'the ' if name.startswith('agents') else ''}{name}", res, single_ms, both)
             for name, res in ran]
    for e in [select, env, off_env] + [e for _, e in models]:
        e.close()
    return {"config": own_options(cfg) | {"env": env_report(cfg.env, ENV_OPTIONS)}, "cost_profile": env.charged,
            "cost_model": (env.cost_profile.label if env.cost_profile
                           else f"this machine's: {cost.machine or cost.device}"),
            "prompts_run": {cfg.split: len(prompts), cfg.select_split: len(chosen)},
            "dtype": str(env.pair.dtype), "naive_k_chosen": k, "naive_k_select_ms": k_means,
            "best_pair": list(env.thresholds(best)), "rows": rows, "paper_ms": PAPER_MS}


def _single(env, prompts: list[int]) -> PromptResults:
    """The single model: the speculation-off action (the env's last) at every step."""
    return returns_on_prompts(env, FixedAction(env.action_space.n - 1, env.observation_space.shape), prompts,
                              desc="single model")


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [f"pair {cfg['env']['pair']} ({report['dtype']}), {prompts_ran(report)}, "
             f"{cfg['env']['max_new_tokens']} "
             f"new tokens; latency charged by {report['cost_model']}", "",
             "| method | latency ms [95% CI] | speedup | minus BiLD (0.103, 4.697), ms [paired 95% CI] | minus the best "
             "grid pair, ms [paired 95% CI] | BLEU | equal to greedy | acceptance |", "|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        lo, hi = r["latency_ms_ci95"]
        diff, best = ("" if f"minus_{k}_ms" not in r else (
            f"{r[f'minus_{k}_ms']:+.2f} [{r[f'minus_{k}_ms_ci95'][0]:+.2f}, {r[f'minus_{k}_ms_ci95'][1]:+.2f}]")
            for k in ("paper_fixed", "best_pair"))
        lines.append(f"| {r['method']} | {r['latency_ms']:.2f} [{lo:.2f}, {hi:.2f}] | {r['speedup']:.3f}x | {diff} | {best} | "
                     f"{r['bleu']:.1f} | {100 * r['exact_match']:.0f}% | {r['acceptance']:.3f} |")
    single = PAPER_MS["single model"]
    lines += ["", "the paper (OPT-125M -> OPT-6.7B, WikiText-2, RTX 4090): "
              + ", ".join(f"{name} {ms:.2f} ms ({single / ms:.2f}x)" for name, ms in PAPER_MS.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    return run_bench("bench.paper_table", PaperTableConfig, ENV_OPTIONS, run, markdown, argv, __doc__)


if __name__ == "__main__":
    import sys

    from bild_env.command import run_command

    sys.exit(run_command("python -m bench.paper_table", main))
