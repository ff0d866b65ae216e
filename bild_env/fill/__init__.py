"""Filling the replay trees ahead of training: every fixed action's episode on every prompt, here or on Ray.

    python -m bild_env.fill --pair tiny-random --split train --prompts 16       # serial, in this process
    python -m bild_env.fill --pair smollm2 --prompts 2000 --ray                 # a local Ray instance (all cores)
    python -m bild_env.fill --pair opt --prompts 5000 --ray auto                # the cluster of `ray start`

Training on the replay backend (``backend="replay"``) answers each step from per-prompt prefix
trees and runs the models only where a tree lacks a prefix: filling the trees is the expensive part
of training. A prompt's fill plays one ``BiLD-v1`` episode of each fixed action of the grid
(``FillConfig.actions``; all of them by default) on the replay backend, so its tree holds every
prefix those policies reach, the paths a learning agent starts from. The trees go to the store of
the pair (``cache_dir("replay", digest(pair.key))``; one file per prompt, merged on write under a
lock file, so any number of processes and machines may fill one store on shared storage).

``fill_prompts`` is the work of one process, and the same function whether it runs serially
(``fill_serial``) or as a Ray task (``bild_env.fill.cluster``, needing ``pip install -e
".[cluster]"``): a prompt's tree depends only on that prompt, so a fill spread over any number of
workers equals the serial fill node for node (``tests/test_cluster.py`` checks it). A prompt's tree is
written as soon as its episodes end; a worker killed mid-task loses only the prompt it was on, and
its retry (Ray's ``max_retries``) reads back what was written and fills the rest.

Costs do not enter a tree (they only price its steps), so the fill prices with ``UNIT_COSTS``
instead of timing the models on each machine.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bild_env.decoding.cost_model import CostModel
from bild_env.config import ActionOptions, PairOptions
from bild_env.env import BildEnv, EnvConfig
from bild_env.command import writable_file
from bild_env.models.pairs import DEFAULT_PAIR
from bild_env.paths import cache_dir, prompt_key
from bild_env.prompts.splits import SPLITS
from bild_env.replay.dataset import LN2
from bild_env.replay.tree import PrefixTree, TreeFileError

UNIT_COSTS = CostModel(draft=(1.0, 0.0, 0.0), target=(1.0, 0.0, 0.0), device="fill")  # 1 ms a forward: trees ignore it
_ENV = EnvConfig()  # the env's defaults, read (never copied) by FillConfig's fields


@dataclass(frozen=True)
class FillConfig:
    """What ``python -m bild_env.fill`` fills and where it runs (every default of the command)."""

    pair: str = field(default=DEFAULT_PAIR, metadata={"help": "model pair preset: see bild_env.models.preset_names()"})
    dataset: str | None = field(default=None, metadata={"help": "prompt source (default: the preset's)"})
    split: str = field(default="train", metadata={"help": "train | validation | test"})
    prompts: int = field(default=16, metadata={"help": "fill the first N prompts of the split"})
    prompt_tokens: int = field(default=_ENV.prompt_tokens, metadata={"help": (
        "prompts are paragraphs cut to this many tokens")})
    max_new_tokens: int = field(default=_ENV.max_new_tokens, metadata={"help": "tokens generated per episode"})
    actions: tuple[int, ...] | None = field(default=None, metadata={"help": (
        "the grid actions each prompt plays one episode of (default: all of BiLD-v1's grid)")})
    cover: str = field(default="", metadata={"help": (
        '"greedy": instead of those episodes, take one step of every action (the grid, speculation off and each of '
        "--tree-rules) from every prefix of the target's greedy continuation (every start any policy over lossless "
        'actions reaches); "episodes": play them, then the same from every start of theirs too. What a decoding '
        "dataset holds (bild_env.replay.dataset)")})
    tree_rules: tuple[str, ...] = field(default=(), metadata={"help": "the token-tree rules --cover steps"})
    record: str = field(default="", metadata={"help": (
        "write a decoding dataset to this folder (bild_env.replay.dataset; needs --cover): the first N prompts of the "
        "split in each serving domain and in the preset's prompt source, each added as it is covered (run it again "
        "to go on, or with another --split to add a split)")})
    device: str | None = field(default=None, metadata={"help": (
        "default: cuda if available (on Ray: the GPU given to the task), else cpu")})
    dtype: str | None = field(default=None, metadata={"help": "default: the preset's"})
    torch_threads: int = field(default=1, metadata={"help": (
        "CPU threads for torch in each process (0: torch's default)")})
    ray: str | None = field(default=None, metadata={"cli": False, "help": (
        'None: serial; "local": a new local Ray instance; else ray.init\'s address ("auto", "ray://host:10001")')})
    group: int = field(default=2, metadata={"help": (
        "prompts per Ray task (a retry repeats the group's unfinished prompts)")})
    cpus_per_task: float = field(default=1.0, metadata={"help": "Ray: CPUs reserved for each task"})
    gpus_per_task: float | None = field(default=None, metadata={"help": (
        "Ray: GPUs given to each task (default: 1 where the cluster has GPUs, else 0)")})
    max_retries: int = field(default=3, metadata={"help": "Ray: times a task whose worker died is started again"})
    out: str = field(default="", metadata={"help": "write the report as JSON to this file"})

    def check(self) -> None:
        """ValueError on a value no fill can run with (before anything loads)."""
        for name in ("prompts", "prompt_tokens", "max_new_tokens", "group"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.torch_threads < 0 or self.max_retries < 0 or self.cpus_per_task <= 0:
            raise ValueError("--torch-threads and --max-retries must be >= 0 and --cpus-per-task > 0")
        if self.gpus_per_task is not None and self.gpus_per_task < 0:
            raise ValueError(f"--gpus-per-task must be >= 0, got {self.gpus_per_task}")
        n_grid = _ENV.actions.n_grid
        if self.actions is not None and (not self.actions or any(not 0 <= a < n_grid for a in self.actions)):
            raise ValueError(f"--actions are indices of BiLD-v1's {n_grid}-action grid (0-{n_grid - 1}), "
                             f"got {' '.join(map(str, self.actions))}")
        if self.cover not in ("", "greedy", "episodes"):
            raise ValueError(f'--cover is "greedy" or "episodes", got {self.cover!r}')
        if self.record and (not self.cover or self.ray is not None):
            raise ValueError("--record needs --cover and runs in this process (no --ray)")
        if self.tree_rules and not self.cover:
            raise ValueError("--tree-rules are the tree actions --cover steps; give --cover too")
        if self.split not in SPLITS:
            raise ValueError(f"unknown --split {self.split!r}; give one of {', '.join(SPLITS)}")
        writable_file(self.out)  # before the fill: a report that cannot be written is the work lost

    def env_kwargs(self) -> dict:
        """The ``BiLD-v1`` keyword arguments of the episodes (replay backend, unit costs, the first N prompts)."""
        return {"pair": self.pair, "dataset": self.dataset, "split": self.split, "max_prompts": self.prompts,
                "prompt_tokens": self.prompt_tokens, "max_new_tokens": self.max_new_tokens,
                "pair_options": PairOptions(device=self.device, dtype=self.dtype), "backend": "replay",
                "cost_model": UNIT_COSTS, "actions": ActionOptions(off_switch=bool(self.cover),
                                                                   tree_rules=tuple(self.tree_rules) if self.cover else ())}


@dataclass
class FillResult:
    """What one process's fill of some prompts did (``ReplayReport`` counts of its store, summed)."""

    prompts: list[int]  # prompt indices filled
    episodes: int = 0
    steps: int = 0  # the single steps ``cover`` took from step starts
    seconds: float = 0.0  # wall time of the fill, models loaded excluded
    load_seconds: float = 0.0  # loading the pair and the prompts (0 when the process had them already)
    fills: int = 0  # model forwards run
    fill_ms: float = 0.0
    hits: int = 0  # steps' questions answered from trees already on disk or filled before
    nodes: int = 0  # prefixes in the prompts' trees at the end
    pid: int = 0  # the process that ran it (a Ray worker)
    node_ip: str = ""  # its machine (Ray), "" when serial
    folder: str = ""  # the store the trees were written to

    def to_dict(self) -> dict:
        return asdict(self)


def fill_prompts(cfg: FillConfig, indices: list[int] | None = None, cache_root: str | None = None) -> FillResult:
    """Play every chosen action's episode on each prompt of ``indices`` (default: the first ``cfg.prompts`` of the
    split); write each prompt's tree as soon as its episodes end.

    ``cache_root``: the bild-gym cache (``BILD_ENV_CACHE``) to read and write, for a Ray worker whose
    environment lacks the driver's (default: this process's).
    """
    if cache_root is not None:
        os.environ["BILD_ENV_CACHE"] = cache_root
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    loads = _env.cache_info().misses
    env, load_seconds = _env(_env_key(cfg), str(cache_dir()))
    indices = [i for i in (range(cfg.prompts) if indices is None else indices) if i < len(env.prompts)]
    result = FillResult(indices, load_seconds=load_seconds if _env.cache_info().misses > loads else 0.0,
                        pid=os.getpid(), folder=str(env.runner.store.folder))
    return _fill_each(cfg, env, result, indices)


def fill_serial(cfg: FillConfig) -> list[FillResult]:
    """The fill of ``cfg.prompts`` prompts in this process, one prompt after another."""
    return [record(cfg) if cfg.record else fill_prompts(cfg)]


RECORDED_DOMAINS = ("prose", "code", "chat")  # the serving domains a recording holds (BiLD-Serve-v0's default mix)


def record(cfg: FillConfig) -> FillResult:
    """Cover the first ``cfg.prompts`` prompts of the split in each of ``RECORDED_DOMAINS`` and in the preset's prompt
    source, and add each to the decoding dataset in ``cfg.record`` as it ends (``bild_env.replay.dataset``); prompts
    the dataset holds already are skipped. Domains take turns, so a stopped recording holds some of each."""
    from tqdm import tqdm

    from bild_env.models.pairs import get_preset
    from bild_env.prompts.domains import DomainConfig, load_domain
    from bild_env.prompts.sources import load_prompts
    from bild_env.replay.dataset import Recording, byte_pieces, machine

    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    t0 = time.perf_counter()
    env, _ = _env(_env_key(cfg), str(cache_dir()))
    pair, ecfg, preset = env.pair, env.config, get_preset(cfg.pair)
    if hasattr(pair, "models"):  # a pair read from a shipped dataset: the models record (and tokenize) for real
        pair.models()
    options = asdict(DomainConfig(prompt_tokens=cfg.prompt_tokens))
    options.pop("prompt_tokens")
    dtype = str(pair.dtype).removeprefix("torch.")
    header = {"name": f"{cfg.pair}-{dtype}", "pair": cfg.pair, "pair_key": pair.key, "dtype": dtype,
              "ids": list(pair.ids), "fingerprints": list(pair.fingerprints), "draft_vocab": pair.draft_vocab,
              "lean": list(pair.lean), "lean_option": preset.lean, "draft_vocab_option": None,
              "eos_token_ids": list(pair.eos_token_ids), "max_positions": pair.max_positions,
              "vocab_size": pair.vocab_size, "max_new_tokens": cfg.max_new_tokens, "prompt_tokens": cfg.prompt_tokens,
              "prompt_options": options, "max_draft_len": ecfg.actions.max_draft_len, "score": ecfg.actions.score,
              "fallback_values": list(ecfg.actions.fallback_values),
              "rollback_values": list(ecfg.actions.rollback_values),
              "tree_rules": list(cfg.tree_rules), "cover": cfg.cover, "machine": machine()}
    rec = Recording(cfg.record, header)
    source = cfg.dataset if cfg.dataset is not None else preset.dataset
    lists = {d: load_domain(pair.tokenizer, d, cfg.split, cfg.prompts, **options, prompt_tokens=cfg.prompt_tokens)
             for d in RECORDED_DOMAINS}
    lists[source] = load_prompts(pair.tokenizer, source, cfg.split, cfg.prompt_tokens,
                                 min_prompt_tokens=options["min_prompt_tokens"], limit=cfg.prompts)
    for name, prompts in lists.items():
        rec.list_prompts(cfg.split, name, prompts)
    if "pieces.npz" not in rec.manifest["files"]:
        rec.set_pieces(*byte_pieces(pair.tokenizer, pair.vocab_size))
    order, seen = [], set()
    for i in range(max(len(p) for p in lists.values())):  # domains take turns
        for prompts in lists.values():
            if i < len(prompts) and prompt_key(prompts[i]) not in seen:
                seen.add(prompt_key(prompts[i]))
                order.append(prompts[i])
    rec.save()
    env.prompts = order
    result = FillResult(list(range(len(order))), pid=os.getpid(), folder=str(env.runner.store.folder),
                        load_seconds=time.perf_counter() - t0)
    todo = [i for i, p in enumerate(order) if not rec.done(prompt_key(p))]
    check = _decode_check(rec, pair)

    def add(index: int, steps: int) -> None:
        check(env.reference)
        rec.add(order[index], env.runner.tree, env.reference, steps)

    return _fill_each(cfg, env, result, tqdm(todo, desc=f"recording {header['name']} {cfg.split}", unit="prompt"), add)


def _fill_each(cfg: FillConfig, env: BildEnv, result: FillResult, todo, after=None) -> FillResult:
    """Play each chosen action's episode (unless ``cfg.cover`` is "greedy") and cover (with ``cfg.cover``) each prompt
    index of ``todo``; write its tree as soon as it is done, then call ``after(index, steps covered)``. ``result``
    gets the counts (its nodes: those of its prompts' trees)."""
    store = env.runner.store
    before = (store.counts.fills, store.counts.fill_ms, store.counts.hits)
    t1 = time.perf_counter()
    for index in todo:
        starts: set[tuple[int, ...]] = set()
        for action in _actions(cfg, env) if cfg.cover != "greedy" else ():
            _play(env, index, action, starts)
            result.episodes += 1
        steps = cover(env, index, starts) if cfg.cover else 0
        result.steps += steps
        store.flush()  # 3. the prompt's tree reaches disk now: a kill after this loses none of it
        if after is not None:
            after(index, steps)
    result.seconds = time.perf_counter() - t1
    result.fills, result.fill_ms, result.hits = (now - was for now, was in zip(
        (store.counts.fills, store.counts.fill_ms, store.counts.hits), before))
    result.nodes = sum(len(_read_tree(store.folder, env.prompts[i])) for i in result.prompts)
    return result


def _decode_check(rec, pair):
    """A check that the recorded token bytes decode ``ids`` as the pair's tokenizer does (BLEU reads that text)."""
    from bild_env.replay.dataset import DatasetError, DecodingDataset

    tokenizer = DecodingDataset.open(rec.folder).tokenizer

    def check(ids: list[int]) -> None:
        if tokenizer.decode(ids) != pair.decode(ids):
            raise DatasetError(f"the token bytes recorded in {rec.folder} do not decode as the tokenizer of "
                               f"{pair.name} does (a tokenizer that is not byte-level BPE): it cannot be recorded")
    return check


def groups(cfg: FillConfig, n_prompts: int) -> list[list[int]]:
    """The prompt indices of each Ray task: ``cfg.group`` consecutive prompts."""
    return [list(range(i, min(i + cfg.group, n_prompts))) for i in range(0, n_prompts, cfg.group)]


# ------------------------------------------------------------------------------------------------
def _env_key(cfg: FillConfig) -> tuple:
    """What makes one fill's env another's: its keyword arguments (hashable)."""
    return tuple(sorted(cfg.env_kwargs().items()))


@functools.lru_cache(maxsize=1)
def _env(key: tuple, cache_root: str) -> tuple[BildEnv, float]:
    """The process's env of ``key`` in ``cache_root`` (kept: the next task of a Ray worker reuses its models) and
    the seconds it took to load."""
    from bild_env.models.pairs import load_pair
    from bild_env.replay.dataset import dtype_for

    t0 = time.perf_counter()
    cfg = EnvConfig(**dict(key))
    # the models first: a fill runs them (a preset with a shipped decoding dataset would else be read from it)
    load_pair(cfg.pair, device=cfg.pair_options.device, dtype=dtype_for(cfg))
    env = BildEnv(**dict(key))
    return env, time.perf_counter() - t0


def _actions(cfg: FillConfig, env: BildEnv) -> tuple[int, ...]:
    actions = cfg.actions or tuple(range(env.n_grid))
    if max(actions) >= env.n_grid:
        raise ValueError(f"--actions are indices of the {env.n_grid}-action grid, got {max(actions)}")
    return actions


def cover(env: BildEnv, index: int, starts: set[tuple[int, ...]] = frozenset()) -> int:
    """From every start of ``starts`` (prompt + output token tuples) and every state a policy over lossless actions
    reaches on prompt ``index``, take one step of each of the env's actions (misses fill the tree); returns the steps
    taken.

    A step's answers depend on the token prefix it starts from and nothing else, so afterwards the tree answers every
    action's step from each of those starts. A lossless action (rollback below ln 2, speculation off, a token tree)
    commits the tree's own target argmaxes, one per prefix, so every such policy walks one path: the target's greedy
    continuation as the replay forwards computed it. In float32 that is the reference; in bfloat16 a forward fed many
    tokens can break a near-tie the other way than one fed one token, so the path is walked as the steps commit it,
    not read from the reference: each lossless step's end is a start to cover too.
    """
    env.reset(options={"prompt_index": index})
    session, prompt = env.session, env.prompts[index]
    actions = [env.decode(a) for a in range(env.action_space.n)]
    lossless = [a.kind != "bild" or a.rollback < LN2 for a in actions]
    todo, seen, steps = [tuple(session.tokens), *sorted(starts, key=lambda s: (len(s), s))], set(), 0
    while todo:
        start = todo.pop()
        if start in seen or len(start) - len(prompt) >= env.config.max_new_tokens or start[-1] in session.eos:
            continue
        seen.add(start)
        for action, keeps in zip(actions, lossless):
            session.tokens = list(start)  # as an episode reaching it holds: both caches over all but the last token
            env.runner.lengths = dict.fromkeys(env.runner.lengths, len(start) - 1)
            action.run(session)
            steps += 1
            if keeps and tuple(session.tokens) not in seen:
                todo.append(tuple(session.tokens))
    return steps


def _play(env: BildEnv, index: int, action: int, starts: set | None = None) -> None:
    """1. reset on prompt ``index``; 2. step the fixed ``action`` to the episode's end (misses fill the tree), adding
    each step's start (prompt + output tokens) to ``starts``."""
    env.reset(options={"prompt_index": index})
    done = False
    while not done:
        if starts is not None:
            starts.add(tuple(env.session.tokens))
        _, _, terminated, truncated, info = env.step(action)
        if "error" in info:
            raise RuntimeError(f"prompt {index}, action {action}: {info['error']}")
        done = terminated or truncated


def _read_tree(folder: Path, prompt: list[int]) -> PrefixTree:
    try:
        return PrefixTree.load(Path(folder) / f"{prompt_key(prompt)}.npz")
    except (OSError, TreeFileError):
        return PrefixTree()


__all__ = ["FillConfig", "FillResult", "UNIT_COSTS", "fill_prompts", "fill_serial", "groups"]
