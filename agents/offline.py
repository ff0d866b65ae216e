"""Offline RL on the recorded decoding: episodes of BiLD-Serve-v0 (or BiLD-v1) written as Minari datasets, and agents
learnt from them with no model and no env stepping (TorchRL's discrete CQL, or behaviour cloning), saved as run folders
the evaluations rank beside the online agents and the rules.

    python -m agents.offline record --pair-options dtype=bfloat16 --cost-profile xeon-amx-smollm2-bf16
    python -m agents.offline train --dataset bild-gym/serve-smollm2-bfloat16/epsilon-v0 --algo cql
    python evaluate.py --env serve --model logs/offline-cql-serve-smollm2-bfloat16-epsilon-v0-0 --cost-profile xeon-amx-smollm2-bf16 --pair-options dtype=bfloat16
    python -m agents.offline record --env bild --pair-options dtype=bfloat16 --cost-profile xeon-amx-smollm2-bf16

``record`` plays ``--episodes`` training episodes under each ``--policies``: ``rule``, the rule a run is judged
against, chosen on validation (on BiLD-Serve-v0 the per-batch-size table, ``agents.serve.validation.rule_references``,
on the validation episodes of ``train.py --env serve``, whose env options it takes the same way; on BiLD-v1 the best
fixed action over ``--eval-episodes`` validation prompts, on the lossless grid and off of ``bild_record_env``);
``oracle``, the per-step hindsight oracle of the env's actions (``agents.serve.rules.StepHindsight``: each step the
action whose reward is best, read from the replayed outcome); ``epsilon``, the rule with a uniformly random action
at ``--epsilon`` of the steps. Each is written with ``minari.DataCollector`` as
``bild-gym/<serve|bild>-<pair>-<dtype>/<policy>-v0`` under Minari's datasets folder (``MINARI_DATASETS_PATH``, else
``~/.minari/datasets``): observation, action and reward the env's own, ``recover_environment()`` the env they were
played in (its cost profile among its options), the reference scores speculation off (min) and the oracle (max) on
the same episodes. Where the pair's decoding dataset answers every step (``bild_env.replay.dataset``) and a cost
profile prices them, no model loads. A policy's episodes are written when all are played (an interrupted
``record`` keeps the policies written before).

``train`` learns a Q-network (the online agents' MLP, 128x128) from one dataset's transitions: ``cql``, TorchRL's
``DiscreteCQLLoss`` (Kumar et al. 2020: the TD loss and a penalty on the Q-values of actions the data did not take);
``bc``, the dataset's actions by cross-entropy (its logits are the Q-values the agent acts on). The network is saved
as an SB3 DQN (``model.zip``) in a run folder with the dataset's env as its ``config.json`` (``offline.json``: how it
was learnt), with TensorBoard curves; it prints the command that ranks it (``evaluate.py --env serve``, or for
BiLD-v1 ``python -m bench.headroom``, each agent also on the rule's floor).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from pathlib import Path

import gymnasium as gym
import numpy as np

from agents.spec import ENV_NOT_CLI, RunSpec, preset_env
from bild_env import ENV_ID, SERVE_ID
from bild_env.command import check_counts
from bild_env.serving.env import ServingConfig

POLICIES = ("rule", "oracle", "epsilon")
ALGOS = ("cql", "bc")
NET_ARCH = (128, 128)  # the online agents' (agents.config.DQNConfig.net_arch)


def dataset_id(env_cfg, policy: str) -> str:
    """``bild-gym/<env>-<pair>-<dtype>/<policy>-v0`` (env ``serve`` for a ``ServingConfig``, ``bild`` for BiLD-v1's
    ``EnvConfig``): the dtype the pair's episodes replay in (its decoding dataset's); a dot of the pair's name an
    underscore (Minari's ids take none: ``qwen2_5-coder``)."""
    from bild_env.replay.dataset import dtype_for

    dtype = dtype_for(env_cfg) or env_cfg.pair_options.dtype or "auto"
    env = "serve" if isinstance(env_cfg, ServingConfig) else "bild"
    return f"bild-gym/{env}-{env_cfg.pair.replace('.', '_')}-{dtype}/{policy}-v0"


def bild_record_env():
    """BiLD-v1's options ``record --env bild`` starts from: ``python train.py``'s (the replay backend, 32 prompts, 32
    tokens) on the lossless grid and speculation off, the actions a decoding dataset answers with no model."""
    from bild_env.config import over

    return over(preset_env("bild"), {"actions": {"rollback_values": (0.5,), "off_switch": True}})


def env_of(env_cfg, split: str) -> tuple[str, dict]:
    """The env id and JSON-ready keyword arguments of ``env_cfg`` (serving or BiLD-v1) on ``split``."""
    return (SERVE_ID if isinstance(env_cfg, ServingConfig) else ENV_ID), env_cfg.arguments(split=split)


@dataclass
class RecordConfig:
    """What ``python -m agents.offline record`` plays and writes."""

    policies: tuple[str, ...] = field(default=POLICIES, metadata={"help": f"the behaviour policies, of {', '.join(POLICIES)}"})
    episodes: int = field(default=100, metadata={"help": "training episodes played under each policy"})
    epsilon: float = field(default=0.3, metadata={"help": "the epsilon policy's share of uniformly random actions"})
    seed: int = field(default=0, metadata={"help": "the first episode's seed (episode i: seed + i, every policy alike)"})
    eval_episodes: int = field(default=8, metadata={"help": (
        "validation episodes per load level the table is chosen on (as train.py --env serve chooses it); BiLD-v1: "
        "validation prompts the best fixed action is chosen on")})

    def __post_init__(self) -> None:
        if bad := [p for p in self.policies if p not in POLICIES]:
            raise ValueError(f"--policies {' '.join(bad)}: not a policy; choose among {', '.join(POLICIES)}")
        if not self.policies:
            raise ValueError("--policies: give at least one")
        check_counts(self, {"episodes": 1, "eval_episodes": 1})
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"--epsilon must be in [0, 1], got {self.epsilon!r}")


class EpsilonRule:
    """``rule``'s action, or at ``epsilon`` of the steps one drawn uniformly from ``n`` actions."""

    def __init__(self, rule, n: int, epsilon: float, seed: int) -> None:
        self.rule, self.n, self.epsilon, self.rng = rule, n, epsilon, np.random.default_rng(seed)

    def predict(self, observation, state=None, episode_start=None, deterministic: bool = True):
        if self.rng.random() < self.epsilon:
            return np.int64(self.rng.integers(self.n)), state
        return self.rule.predict(observation, state)


def choose_rule(env_cfg, episodes: int, progress=None) -> dict:
    """The rule a run of these env options is judged with, chosen on validation: on BiLD-Serve-v0 the per-batch-size
    table (``rule_references``' ``batch_table``: its statistics, ``table`` and ``off``) on the validation episodes of
    ``train.py --env serve``; on BiLD-v1 the best fixed action (``best``, ``off``) over ``episodes`` validation
    prompts, one episode each."""
    if not isinstance(env_cfg, ServingConfig):
        from agents.bild.baselines import FixedAction
        from agents.bild.evaluation import returns_on_prompts

        env_id, kwargs = env_of(env_cfg, "validation")
        env = gym.make(env_id, **kwargs)
        prompts = list(range(min(episodes, len(env.unwrapped.prompts))))
        n = int(env.action_space.n)
        means = {}
        for a in range(n):
            means[a] = float(returns_on_prompts(env, FixedAction(a, env.observation_space.shape), prompts).returns.mean())
            if progress is not None:
                progress.update(len(prompts))
        env.close()
        best = max(means, key=lambda a: (means[a], -a))
        return {"best": best, "off": n - 1 if env_cfg.actions.off_switch else best, "means": means}
    from agents.serve.validation import rule_references, validation_envs, validation_seeds

    envs = validation_envs(env_cfg.arguments())
    try:
        return rule_references(envs, validation_seeds(episodes), (), progress)["batch_table"]
    finally:
        for env in envs:
            env.close()


def behaviour(name: str, env: gym.Env, chosen: dict, epsilon: float, seed: int):
    """The policy ``name`` acting in ``env`` (``chosen``: ``choose_rule``'s)."""
    from agents.serve.rules import Fixed, StepHindsight
    from agents.serve.validation import table_rule

    if name == "oracle":
        return StepHindsight(env, range(env.action_space.n))
    rule = Fixed(chosen["best"]) if "best" in chosen else table_rule(chosen, env.unwrapped)
    return rule if name == "rule" else EpsilonRule(rule, int(env.action_space.n), epsilon, seed)


def play(env: gym.Env, policy, seeds: list[int], bar=None) -> np.ndarray:
    """The returns of ``policy``'s episodes in ``env`` (a ``DataCollector`` records them as they are played)."""
    returns = []
    for seed in seeds:
        obs, _ = env.reset(seed=seed)
        total, done = 0.0, False
        while not done:
            action, _ = policy.predict(obs)
            obs, reward, terminated, truncated, _ = env.step(int(action))
            total += float(reward)
            done = terminated or truncated
        returns.append(total)
        if bar is not None:
            bar.update(1)
    return np.array(returns)


def record(cfg: RecordConfig, env_cfg: ServingConfig, say=print) -> list[str]:
    """Every policy of ``cfg`` played and written as a Minari dataset (the module's docstring); their ids."""
    import minari
    from tqdm.auto import tqdm

    from agents.serve.rules import Fixed, StepHindsight

    seeds = [cfg.seed + i for i in range(cfg.episodes)]
    env_id, kwargs = env_of(env_cfg, "train")
    with tqdm(desc="choose the rule on validation", unit="episode") as bar:
        chosen = choose_rule(env_cfg, cfg.eval_episodes, bar)
    rule_text = (f"the best fixed action {chosen['best']}" if "best" in chosen
                 else f"the per-batch-size table {chosen['table']}")
    say(f"the rule, chosen on validation: {rule_text} (off: action {chosen['off']})")
    reference = gym.make(env_id, **kwargs)
    with tqdm(total=2 * len(seeds), desc="reference scores (off, oracle)", unit="episode") as bar:
        off = play(reference, Fixed(chosen["off"]), seeds, bar)
        best = play(reference, StepHindsight(reference, range(reference.action_space.n)), seeds, bar)
    reference.close()
    written = []
    for name in cfg.policies:
        env = minari.DataCollector(gym.make(env_id, **kwargs), record_infos=False)
        ident = dataset_id(env_cfg, name)
        with tqdm(total=len(seeds), desc=ident, unit="episode") as bar:
            returns = play(env, behaviour(name, env, chosen, cfg.epsilon, cfg.seed), seeds, bar)
        if name == "oracle":
            best = returns
        if ident in minari.list_local_datasets():
            minari.delete_dataset(ident)  # recorded again: the newest episodes replace the old
        with warnings.catch_warnings():  # Minari asks for an author e-mail and an evaluation env: neither applies
            warnings.filterwarnings("ignore", message=r"`(author_email|eval_env)` is set to None", category=UserWarning)
            env.create_dataset(
                dataset_id=ident, algorithm_name=f"bild-gym {name}" + (f" (epsilon {cfg.epsilon:g})"
                                                                       if name == "epsilon" else ""),
                author="bild-gym", code_permalink=f"bild-gym {version('bild-gym')}: agents/offline.py",
                ref_min_score=float(off.mean()), ref_max_score=float(best.mean()),
                description=(f"{cfg.episodes} {env_id} training episodes ({env_cfg.pair}"
                             + (f", load {env_cfg.load}" if env_id == SERVE_ID else "")
                             + f", cost profile {env_cfg.cost_profile or 'the machine'}) under the {name} policy; "
                             f"mean return {returns.mean():+.3f}, speculation off {off.mean():+.3f}, the per-step oracle "
                             f"{best.mean():+.3f}; the rule: {rule_text}"))
        env.close()
        say(f"{ident}: {cfg.episodes} episodes, mean return {returns.mean():+.3f} (off {off.mean():+.3f}, oracle "
            f"{best.mean():+.3f})")
        written.append(ident)
    return written


@dataclass
class OfflineConfig:
    """How ``python -m agents.offline train`` learns from a dataset."""

    dataset: str = field(default="", metadata={"help": "the Minari dataset id (python -m agents.offline record)"})
    algo: str = field(default="cql", metadata={"help": f"one of {', '.join(ALGOS)}"})
    steps: int = field(default=20_000, metadata={"help": "gradient steps"})
    batch_size: int = field(default=256, metadata={"help": "transitions per gradient step"})
    learning_rate: float = field(default=3e-4, metadata={"help": "Adam's step size"})
    gamma: float = field(default=0.9, metadata={"help": "discount (cql): the online serving DQN's"})
    tau: float = field(default=0.005, metadata={"help": "the target network's soft update per step (cql)"})
    seed: int = field(default=0, metadata={"help": "seeds the network and the batches"})
    log_dir: str = field(default="logs", metadata={"help": "the run is written to <log_dir>/<run_name>/"})
    run_name: str | None = field(default=None, metadata={"help": (
        "folder under log_dir (default: offline-<algo>-<the dataset id's name>-<seed>)")})

    def __post_init__(self) -> None:
        if self.algo not in ALGOS:
            raise ValueError(f"--algo {self.algo!r}: choose among {', '.join(ALGOS)}")
        check_counts(self, {"steps": 1, "batch_size": 1})


def load_dataset(ident: str):
    """The local Minari dataset ``ident``, or a ``ValueError`` that says how to make it."""
    import minari

    if ident not in minari.list_local_datasets():
        have = ", ".join(sorted(minari.list_local_datasets())) or "none"
        raise ValueError(f"--dataset {ident}: no such local Minari dataset (here: {have}); record it with `python -m "
                         "agents.offline record` (its env options), or set MINARI_DATASETS_PATH to where it is")
    return minari.load_dataset(ident)


def transitions(data):
    """A Minari dataset's transitions as one TensorDict in TorchRL's layout (``observation``, ``action``, and under
    ``next``: ``observation``, ``reward``, ``done``, ``terminated``, ``truncated``). Built here from
    ``iterate_episodes``: TorchRL 0.14's ``MinariExperienceReplay`` reads a local dataset into a memory map of zeros
    (``memmap_like`` keeps the structure, not the values)."""
    import torch
    from tensordict import TensorDict

    parts = {k: [] for k in ("observation", "action", "next_observation", "reward", "terminated", "truncated")}
    for ep in data.iterate_episodes():
        parts["observation"].append(ep.observations[:-1])
        parts["next_observation"].append(ep.observations[1:])
        parts["action"].append(ep.actions)
        parts["reward"].append(ep.rewards)
        parts["terminated"].append(ep.terminations)
        parts["truncated"].append(ep.truncations)
    cat = {k: torch.as_tensor(np.concatenate(v)) for k, v in parts.items()}
    terminated, truncated = cat["terminated"].bool()[:, None], cat["truncated"].bool()[:, None]
    return TensorDict({"observation": cat["observation"].float(), "action": cat["action"].long(),
                       "next": {"observation": cat["next_observation"].float(), "reward": cat["reward"].float()[:, None],
                                "terminated": terminated, "truncated": truncated, "done": terminated | truncated}},
                      batch_size=[len(cat["action"])])


def q_network(n_obs: int, n_actions: int):
    """The MLP both algorithms fit, laid out as SB3's ``QNetwork.q_net`` (Linear, ReLU, Linear, ReLU, Linear)."""
    from torch import nn
    from torchrl.modules import MLP

    return MLP(in_features=n_obs, out_features=n_actions, num_cells=list(NET_ARCH), activation_class=nn.ReLU)


def fit(cfg: OfflineConfig, buffer, net, writer, bar) -> dict:
    """``cfg.steps`` gradient steps of ``cfg.algo`` on batches of ``buffer`` (TorchRL's replay buffer of the dataset)."""
    import torch
    from torchrl.modules import QValueActor
    from torchrl.objectives import DiscreteCQLLoss, SoftUpdate

    if cfg.algo == "cql":
        loss = DiscreteCQLLoss(QValueActor(net, in_keys=["observation"], action_space="categorical"),
                               action_space="categorical")
        loss.make_value_estimator(gamma=cfg.gamma)
        target = SoftUpdate(loss, tau=cfg.tau)
        params = list(loss.parameters())
    else:
        params = list(net.parameters())
    optim = torch.optim.Adam(params, lr=cfg.learning_rate)
    last = {}
    for step in range(1, cfg.steps + 1):
        batch = buffer.sample()
        if cfg.algo == "cql":
            out = loss(batch)
            parts = {"loss_qvalue": out["loss_qvalue"], "loss_cql": out["loss_cql"]}
        else:
            parts = {"loss_bc": torch.nn.functional.cross_entropy(net(batch["observation"]), batch["action"].long())}
        total = sum(parts.values())
        optim.zero_grad()
        total.backward()
        optim.step()
        if cfg.algo == "cql":
            target.step()
        if step % 100 == 0 or step == cfg.steps:
            last = {k: float(v.detach()) for k, v in parts.items()}
            for k, v in last.items():
                writer.add_scalar(f"offline/{k}", v, step)
        bar.update(1)
    return last


def to_sb3(net, env: gym.Env, seed: int):
    """An SB3 DQN acting with ``net``'s Q-values (what ``evaluate.py`` loads): its q_net and target both ``net``."""
    from stable_baselines3 import DQN

    model = DQN("MlpPolicy", env, buffer_size=1, learning_starts=0, seed=seed, device="cpu",
                policy_kwargs={"net_arch": list(NET_ARCH)})
    for q in (model.q_net, model.q_net_target):
        q.q_net.load_state_dict(net.state_dict())
    return model


def train(cfg: OfflineConfig, say=print) -> Path:
    """Learn from ``cfg.dataset`` (no env step, no model), save the run; its folder."""
    import torch
    from torch.utils.tensorboard import SummaryWriter
    from torchrl.data import LazyTensorStorage, ReplayBuffer
    from tqdm.auto import tqdm

    from agents.common.files import write_atomic, write_text_atomic

    data = load_dataset(cfg.dataset)
    spec = data.spec.env_spec
    if spec is None or spec.id not in (SERVE_ID, ENV_ID):
        raise ValueError(f"--dataset {cfg.dataset} was recorded on {spec.id if spec else 'no env'}, not on {SERVE_ID} "
                         f"or {ENV_ID}")
    run_dir = Path(cfg.log_dir) / (cfg.run_name or f"offline-{cfg.algo}-{cfg.dataset.split('/', 1)[1].replace('/', '-')}"
                                                    f"-{cfg.seed}")
    if (run_dir / "model.zip").exists():
        raise ValueError(f"{run_dir} holds a trained agent already: give another --run-name (or --seed), or delete it")
    torch.manual_seed(cfg.seed)
    env = data.recover_environment()
    net = q_network(int(np.prod(env.observation_space.shape)), int(env.action_space.n))
    data_td = transitions(data)
    buffer = ReplayBuffer(storage=LazyTensorStorage(len(data_td)), batch_size=cfg.batch_size)
    buffer.extend(data_td)
    say(f"{cfg.dataset}: {data.total_episodes} episodes, {data.total_steps} transitions; {cfg.algo} for "
        f"{cfg.steps} gradient steps")
    run_dir.mkdir(parents=True, exist_ok=True)
    with SummaryWriter(str(run_dir)) as writer, tqdm(total=cfg.steps, desc=f"offline {cfg.algo}", unit="step") as bar:
        losses = fit(cfg, buffer, net, writer, bar)
    model = to_sb3(net, env, cfg.seed)
    write_atomic(run_dir / "model.zip", model.save)
    # the run's spec, which each env's evaluation reads: the dataset's env, and an SB3 DQN's model file
    config = RunSpec(spec.id, dict(spec.kwargs), "dqn", {}, {"seed": cfg.seed}).text()
    offline = vars(cfg) | {"env_id": spec.id, "dataset_episodes": data.total_episodes,
                           "dataset_steps": data.total_steps, "final_losses": losses}
    for name, text in (("config.json", config), ("offline.json", json.dumps(offline, indent=1, default=str) + "\n")):
        write_text_atomic(run_dir / name, text)
    env.close()
    return run_dir


def next_command(run_dir: Path) -> str:
    """The command that ranks the agent in ``run_dir`` beside the rules on test episodes, in the world it learnt in
    (pair, dtype, cost profile; on BiLD-v1 its action grid too)."""
    saved = RunSpec.load(run_dir)
    env = saved.env
    dtype = env.get("pair_options", {}).get("dtype")
    profile = f" --cost-profile {env['cost_profile']}" if env.get("cost_profile") else ""
    world = profile + (f" --pair-options dtype={dtype}" if dtype not in (None, "auto") else "")
    if saved.env_id == SERVE_ID:
        return (f"python evaluate.py --env serve --model {run_dir}{world}   # beside the rules and the online agents, "
                "test episodes")
    acts = env["actions"]
    grid = (f" --actions fallback_values={','.join(map(str, acts['fallback_values']))} "
            f"rollback_values={','.join(map(str, acts['rollback_values']))} off_switch={int(acts['off_switch'])}")
    return (f"python -m bench.headroom --pair {env['pair']}{world}{grid} --split test --no-bandits --model {run_dir}"
            "   # beside the best fixed action and the oracle, test prompts")


def build_parser(env: str = "serve") -> argparse.ArgumentParser:
    """The command's parser; ``record``'s env options those of ``env`` (``serve``: BiLD-Serve-v0 from
    ``train.py --env serve``'s defaults; ``bild``: BiLD-v1 from ``bild_record_env``)."""
    from bild_env.cli import add_options
    from bild_env.env import EnvConfig

    parser = argparse.ArgumentParser(prog="python -m agents.offline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="write BiLD-Serve-v0 (or, --env bild, BiLD-v1) episodes as Minari datasets")
    rec.add_argument("--env", choices=("serve", "bild"), default="serve", help=(
        "the env played: serve (BiLD-Serve-v0, its options below) or bild (BiLD-v1 on the lossless grid and off: "
        "python -m agents.offline record --env bild --help lists its options)"))
    add_options(rec, "record", RecordConfig, RecordConfig(), title="record")
    if env == "serve":
        add_options(rec, "env", ServingConfig, preset_env("serve"), skip=ENV_NOT_CLI, title=f"environment ({SERVE_ID})")
    else:
        add_options(rec, "env", EnvConfig, bild_record_env(), skip=ENV_NOT_CLI, title=f"environment ({ENV_ID})")
    fit_ = commands.add_parser("train", help="learn an agent from one Minari dataset, with no env stepping")
    add_options(fit_, "train", OfflineConfig, OfflineConfig(), title="offline training")
    return parser


def main(argv: list[str] | None = None) -> int:
    from bild_env.cli import given
    from bild_env.config import over
    from bild_env.serving.env import validate

    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env", choices=("serve", "bild"), default="serve")
    env_name = pre.parse_known_args(argv[1:])[0].env if argv[:1] == ["record"] else "serve"
    parser = build_parser(env_name)
    ns = parser.parse_args(argv)
    say = lambda text: print(f"agents.offline: {text}", flush=True)  # noqa: E731
    t0 = time.perf_counter()
    try:
        if ns.command == "record":
            cfg = replace(RecordConfig(), **given(ns, "record"))
            if env_name == "bild":
                env_cfg = over(bild_record_env(), given(ns, "env"))
            else:
                env_cfg = over(preset_env("serve"), given(ns, "env"))
                validate(env_cfg)
            if env_cfg.actions.space != "discrete" or getattr(env_cfg.actions, "per_domain", False):
                raise ValueError("record: the offline agents take one Discrete action: leave --actions space and "
                                 "per_domain at their defaults")
            written = record(cfg, env_cfg, say)
            say(f"{len(written)} datasets in {time.perf_counter() - t0:.0f} s; load one with "
                f"minari.load_dataset({written[0]!r}); learn from it with `python -m agents.offline train --dataset "
                f"{written[-1]}`")
        else:
            cfg = replace(OfflineConfig(), **given(ns, "train"))
            if not cfg.dataset:
                raise ValueError("--dataset: give a Minari dataset id (python -m agents.offline record makes them)")
            run_dir = train(cfg, say)
            say(f"run written to {run_dir} in {time.perf_counter() - t0:.0f} s\n\nnext:\n  {next_command(run_dir)}")
    except (TypeError, ValueError) as err:
        parser.error(str(err))
    return 0


if __name__ == "__main__":
    sys.exit(main())
