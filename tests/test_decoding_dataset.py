"""Decoding datasets (``bild_env.replay.dataset``): a tiny pair's trees recorded by ``python -m bild_env.fill --record``,
replayed by both envs with no model loaded (the loader made to fail, as it does offline with an empty cache), to the
tokens the live models commit; what the recording lacks refused in one line; altered files refused; the draft's top
candidates kept in tree files (format 3)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import gymnasium
import numpy as np
import pytest

import bild_env.models.pairs
from bild_env.fill import FillConfig, record
from bild_env.replay import dataset as ds
from bild_env.replay.tree import PrefixTree, TreeFileError
from bild_env.serving.env import ServingConfig

TREE = "6:8:2:0.3"
RECORDING = FillConfig(pair="tiny-random", split="test", prompts=1, max_new_tokens=12, cover="greedy",
                       tree_rules=(TREE,), device="cpu")
PROFILE = "h200-opt-eager"


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """A recording of the tiny pair's test prompts (one per domain and source), placed where shipped datasets are."""
    root = tmp_path_factory.mktemp("datasets")
    folder = root / "tiny-random-float32"
    result = record(replace(RECORDING, record=str(folder)))
    assert result.steps > 0
    record(replace(RECORDING, record=str(folder), split="train"))  # a split to train on
    return root, folder


@pytest.fixture
def offline(shipped, monkeypatch):
    """The recording as the shipped dataset, no model loaded in the process, and loading them fails (offline)."""
    root, folder = shipped
    monkeypatch.setattr(ds, "SHIPPED", root)
    monkeypatch.setattr(ds, "_SAID", set())  # what was said once, said again in each test
    monkeypatch.setattr(bild_env.models.pairs, "_CACHE", {})
    loads = []

    def no_models(*args, **kwargs):
        loads.append(kwargs)
        raise OSError("no network: the hub and the package registry are out of reach")

    monkeypatch.setattr(bild_env.models.pairs, "load_pair", no_models)
    return folder, loads


def lossless(env) -> list[int]:
    """The actions of ``env`` whose every step commits the target's greedy tokens."""
    out = []
    for a in range(env.action_space.n):
        action = env.decode(a)
        if action.kind != "bild" or action.rollback < math.log(2):
            out.append(a)
    return out


def test_serving_env_replays_every_lossless_action_with_no_model(offline):
    folder, loads = offline
    env = gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", cost_profile=PROFILE, split="test",
                         max_new_tokens=12, actions={"rollback_values": (0.5, 4.697), "tree_rules": (TREE,)}, episode_steps=24,
                         pair_options={"load_on_miss": True})  # lossy actions in the space: opted in, never stepped
    u = env.unwrapped
    assert isinstance(u.pair, ds.RecordedPair) and not u.pair.loaded
    actions = lossless(u)
    assert len(actions) == 5 + 1 + 1  # the grid's lossless column, speculation off, the tree
    rng = np.random.default_rng(0)
    steps, misses = 0, None
    for episode in range(3):
        env.reset(seed=episode)
        misses = u._trees().counts.misses if misses is None else misses  # the process's store: the recording's too
        done = False
        while not done:
            _, _, terminated, truncated, info = env.step(int(rng.choice(actions)))
            done, steps = terminated or truncated, steps + 1
    assert steps > 20 and u._trees().counts.misses == misses
    assert not u.pair.loaded and loads == []
    env.close()


def play(env, index: int, plan: list[int]) -> list[int]:
    """One BiLD-v1 episode of prompt ``index`` taking ``plan``'s actions in turn; its output tokens."""
    env.reset(options={"prompt_index": index})
    done, i = False, 0
    while not done:
        _, _, terminated, truncated, _ = env.step(plan[i % len(plan)])
        done, i = terminated or truncated, i + 1
    return list(env.unwrapped.session.new_ids)


def test_bild_v1_replay_equals_the_live_models_and_loads_none(offline, monkeypatch):
    folder, loads = offline
    kwargs = dict(pair="tiny-random", cost_profile=PROFILE, split="test", max_prompts=1, max_new_tokens=12,
                  actions={"rollback_values": (0.5,), "off_switch": True, "tree_rules": (TREE,)})
    env = gymnasium.make("bild_env:BiLD-v1", backend="replay", **kwargs)
    u = env.unwrapped
    plans = [[0, 5, 6, 2], [6], [5], [4, 1]]  # (0.103, 0.5), off, the tree, (0.35, 0.5), ...: all lossless
    replayed = [play(env, index, plan) for index in range(len(u.prompts)) for plan in plans]
    assert not u.pair.loaded and loads == []
    monkeypatch.undo()  # the models again, decoding live
    live = gymnasium.make("bild_env:BiLD-v1", backend="live", **kwargs)
    assert live.unwrapped.prompts == u.prompts
    assert [play(live, index, plan) for index in range(len(u.prompts)) for plan in plans] == replayed
    for prompt in u.prompts:  # the recorded BLEU references are the live target's
        assert u.references.get(prompt) == live.unwrapped.references.get(prompt)


def test_a_replayed_env_defaults_to_the_actions_its_dataset_answers(offline, caplog):
    """No rollback values given: a replayed env takes the lossless ones recorded (said once, with the opt-in that
    gives the paper's grid), and every action of its space replays whole episodes with no model. Given lossy ones, it
    says at construction that their steps off the recording are refused; given lengths it did not record (every
    episode would leave it), it refuses at construction in one line naming the option and both ways out."""
    _, loads = offline
    with caplog.at_level("WARNING", logger="bild_env.replay.dataset"):
        env = gymnasium.make("bild_env:BiLD-v1", pair="tiny-random", backend="replay", cost_profile=PROFILE,
                             split="test", max_new_tokens=12, actions={"off_switch": True})
    u = env.unwrapped
    assert u.config.actions.rollback_values == (0.5,) and env.action_space.n == 5 + 1
    assert "default to those it answers" in caplog.text and "load_on_miss" in caplog.text
    for episode, action in enumerate(range(env.action_space.n)):
        env.reset(seed=episode)
        done = False
        while not done:
            _, _, terminated, truncated, _ = env.step(action)
            done = terminated or truncated
    assert not u.pair.loaded and loads == []
    paper = gymnasium.make("bild_env:BiLD-v1", pair="tiny-random", backend="replay", cost_profile=PROFILE,
                           split="test", max_new_tokens=12, pair_options={"load_on_miss": True})
    assert paper.action_space.n == 25 and not paper.unwrapped.pair.loaded  # the paper's grid; loaded on a miss only
    caplog.clear()
    with caplog.at_level("WARNING", logger="bild_env.replay.dataset"):
        lossy = gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", cost_profile=PROFILE, split="test",
                               max_new_tokens=12, actions={"rollback_values": (0.5, 4.697)})
    assert lossy.action_space.n == 11 and "(a rollback threshold of 4.697" in caplog.text
    assert "a step is refused" in caplog.text and "load_on_miss" in caplog.text
    with pytest.raises(ds.NotRecorded) as err:
        gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", cost_profile=PROFILE, split="test",
                       max_new_tokens=13)
    message = str(err.value)
    assert "\n" not in message and "tiny-random-float32" in message and "max_new_tokens 13" in message
    assert "load_on_miss" in message and loads == []


def test_a_step_off_the_recording_loads_the_models_only_where_opted_in(offline, monkeypatch, caplog):
    """A step off every recorded path (where a lossy action leads) is refused naming the action, the prompt and step
    and the opt-in, and no load starts; opted in (``load_on_miss``), it loads them, said with their fetch."""
    _, loads = offline
    preset = bild_env.models.pairs.PRESETS["tiny-random"]
    monkeypatch.setitem(bild_env.models.pairs.PRESETS, "tiny-random",
                        replace(preset, fetched=lambda: False, fetch="3 wheels, 9 GB"))
    env = gymnasium.make("bild_env:BiLD-v1", pair="tiny-random", backend="replay", cost_profile=PROFILE,
                         split="test", max_new_tokens=12)
    env.reset(options={"prompt_index": 0})
    env.unwrapped.session.tokens.append(12345)  # a prefix off every recorded path (as a lossy policy's episode reaches)
    with pytest.raises(ds.NotRecorded) as err:
        env.step(4)
    message = str(err.value)
    assert message.startswith("BiLD-v1, action 4 (0.6, 0.5): ") and "tokens generated" in message
    assert "load_on_miss" in message and "9 GB" in message and "\n" not in message and loads == []
    with caplog.at_level("WARNING", logger="bild_env.replay.dataset"):
        env = gymnasium.make("bild_env:BiLD-v1", pair="tiny-random", backend="replay", cost_profile=PROFILE,
                             split="test", max_new_tokens=12, pair_options={"load_on_miss": True})
        assert "a step loads the tiny-random models (not on this machine: a fetch of 3 wheels, 9 GB)" in caplog.text
        env.reset(options={"prompt_index": 0})
        env.unwrapped.session.tokens.append(12345)
        with pytest.raises(ds.NotRecorded, match="could not load: no network"):
            env.step(4)
    assert len(loads) == 1 and "loading the tiny-random models (not on this machine" in caplog.text


def test_what_the_recording_does_not_hold_is_refused(offline, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="prompts cut to 32 tokens, not 16"):
        gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", cost_profile=PROFILE, split="test",
                       prompt_tokens=16)
    with pytest.raises(ValueError, match="holds no validation prompts"):
        gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", cost_profile=PROFILE, split="validation")
    monkeypatch.setenv("BILD_ENV_CACHE", str(tmp_path))  # a cache with no tables of this machine (other tests time some)
    with pytest.raises(ds.NotRecorded, match="could not load"):  # no profile: this machine's tables need the models
        gymnasium.make("bild_env:BiLD-Serve-v0", pair="tiny-random", split="test")


def test_recorded_bytes_decode_as_the_tokenizer(shipped):
    _, folder = shipped
    dataset = ds.DecodingDataset.open(folder)
    tokenizer = bild_env.models.pairs.load_pair("tiny-random", device="cpu").tokenizer
    rng = np.random.default_rng(0)
    for ids in [*dataset.references.values(), *(rng.integers(0, len(tokenizer), 20).tolist() for _ in range(20))]:
        assert dataset.tokenizer.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_an_altered_file_is_refused_naming_it(shipped, tmp_path, monkeypatch):
    import shutil

    _, folder = shipped
    copy = tmp_path / "tiny-random-float32"
    shutil.copytree(folder, copy)
    monkeypatch.setattr(ds, "_CHECKED", {})
    tree = next((copy / "trees").glob("*.npz"))
    data = bytearray(tree.read_bytes())
    data[-40] ^= 1
    tree.write_bytes(bytes(data))
    dataset = ds.DecodingDataset.open(copy)
    with pytest.raises(ds.DatasetError, match=f"{tree.name} is altered"):
        dataset.tree(tree.stem)
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(ds.DatasetError, match="is not a decoding dataset"):
        ds.DecodingDataset.open(copy)


def test_a_shipped_folder_that_cannot_be_read_is_an_error_naming_it(shipped, tmp_path, monkeypatch):
    """No manifest, a manifest of another dtype than its folder's name, one whose max_new_tokens its references do
    not bear out: each refused in one line naming the folder, never skipped for the models."""
    import shutil

    _, folder = shipped
    monkeypatch.setattr(ds, "SHIPPED", tmp_path)
    copy = tmp_path / "tiny-random-float32"
    shutil.copytree(folder, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").unlink()
    with pytest.raises(ds.DatasetError, match=f"{copy} is not a decoding dataset"):
        ds.shipped("tiny-random")
    (copy / "manifest.json").write_text(json.dumps(manifest | {"dtype": "bfloat16"}))
    with pytest.raises(ds.DatasetError, match=f"folder {copy} holds a manifest of {{'dtype': 'bfloat16'}}"):
        ds.shipped("tiny-random", "float32")
    (copy / "manifest.json").write_text(json.dumps(manifest | {"max_new_tokens": 100000}))
    with pytest.raises(ds.DatasetError, match="says 100000 new tokens a prompt"):
        ds.shipped("tiny-random").references
    (tmp_path / "tiny-random-6l-float32").mkdir()  # another preset's folder is not this one's dataset
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert ds.shipped("tiny-random").name == "tiny-random-float32"


def test_recording_again_goes_on_where_it_stopped(shipped):
    _, folder = shipped
    before = json.loads((folder / "manifest.json").read_text())
    again = record(replace(RECORDING, record=str(folder)))
    assert again.steps == 0 and again.fills == 0  # every prompt held already
    assert json.loads((folder / "manifest.json").read_text())["covered"] == before["covered"]
    with pytest.raises(ValueError, match="other settings"):
        record(replace(RECORDING, record=str(folder), max_new_tokens=8))


def test_covers_says_which_training_envs_the_recording_answers_whole(offline):
    cfg = replace(ServingConfig(), pair="tiny-random", max_prompts=1, max_new_tokens=12, actions={"rollback_values": (0.5,)})
    assert ds.covers(cfg, "test")
    assert not ds.covers(replace(cfg, max_prompts=2), "test")  # one prompt a domain recorded
    assert not ds.covers(replace(cfg, split="train", mix="prose:1,long:1"), "train")  # no long inputs recorded
    assert not ds.covers(replace(cfg, actions={"rollback_values": (0.5, 4.697)}), "test")  # a lossy action leaves the path
    assert not ds.covers(replace(cfg, max_new_tokens=16), "test")
    # ... and says why not, naming the option to change
    assert ds.not_covered(cfg, "test") is None
    assert ds.not_covered(replace(cfg, max_prompts=2), "test").endswith("and max_prompts is 2 (--max-prompts 1 keeps to them)")
    assert "records 0 train prompts of 'long'" in ds.not_covered(replace(cfg, mix="prose:1,long:1"), "train")
    assert "rollback threshold of 4.697" in ds.not_covered(replace(cfg, actions={"rollback_values": (0.5, 4.697)}), "test")
    assert ds.not_covered(replace(cfg, max_new_tokens=16), "test") == "max_new_tokens 16 is above the 12 recorded"
    assert ds.not_covered(replace(cfg, pair="smollm2-wiki"), "test") is None  # no dataset shipped: nothing to say


def test_tree_files_keep_the_drafts_top_candidates(tmp_path):
    tree = PrefixTree()
    a = tree.child(0, 5)
    b = tree.child(a, 7)
    tree.d_arg[0], tree.d_p[0] = 5, 0.5
    tree.d_top[0] = ([5, 9, 11], [math.log(0.5), math.log(0.2), math.log(0.1)])
    tree.d_top[b] = ([3], [math.log(0.9)])
    tree.save(tmp_path / "t.npz")
    loaded = PrefixTree.load(tmp_path / "t.npz")
    assert loaded.d_top.keys() == {0, b}
    assert loaded.d_top[0][0] == [5, 9, 11] and np.allclose(loaded.d_top[0][1], tree.d_top[0][1])
    other = PrefixTree()
    other.child(other.child(0, 5), 7)
    other.merge(loaded)
    assert other.d_top[0][0] == [5, 9, 11] and other.d_top[2][0] == [3]
    arrays = dict(np.load(tmp_path / "t.npz"))
    arrays["top_ids"] = arrays["top_ids"].copy()
    arrays["top_ids"][1] = 10  # another candidate, within the vocabulary: the checksum tells
    np.savez(tmp_path / "u.npz", **arrays)
    with pytest.raises(TreeFileError, match="checksum"):
        PrefixTree.load(tmp_path / "u.npz")


@pytest.mark.parametrize("preset, split, profile", [("qwen2.5-coder", "test", "zen3-qwen2.5-coder-float32"),
                                                    ("smollm2", "validation", "h200-smollm2-eager")])
def test_the_shipped_datasets_replay_whole_episodes_with_no_model(preset, split, profile, monkeypatch):
    """The datasets shipped in the package, offline with no model loaded: serving episodes of every lossless action
    of the main job's grid, and BiLD-v1 episodes on the replay backend."""
    monkeypatch.setattr(bild_env.models.pairs, "_CACHE", {})
    monkeypatch.setattr(bild_env.models.pairs, "load_pair", lambda *a, **k: (_ for _ in ()).throw(OSError("offline")))
    dataset = ds.shipped(preset)
    assert dataset is not None and dataset.manifest["pair"] == preset
    serve = gymnasium.make("bild_env:BiLD-Serve-v0", pair=preset, cost_profile=profile, split=split, max_prompts=2,
                           actions={"rollback_values": (0.5,)}, episode_steps=40, max_batch=8)
    u = serve.unwrapped
    rng = np.random.default_rng(1)
    for episode in range(2):
        serve.reset(seed=episode)
        done = False
        while not done:
            _, reward, terminated, truncated, info = serve.step(int(rng.integers(serve.action_space.n)))
            assert np.isfinite(reward)
            done = terminated or truncated
    assert info["episode_summary"]["regret"] == 0.0 and not u.pair.loaded
    v1 = gymnasium.make("bild_env:BiLD-v1", pair=preset, cost_profile=profile, split=split, max_prompts=2,
                        backend="replay", max_new_tokens=dataset.manifest["max_new_tokens"], actions={"off_switch": True})
    assert v1.action_space.n == 6  # no rollback values given: the dataset's lossless grid and off
    for action in range(v1.action_space.n):
        v1.reset(options={"prompt_index": 1})
        done = False
        while not done:
            _, _, terminated, truncated, info = v1.step(action)
            done = terminated or truncated
        assert v1.unwrapped.session.new_ids == v1.unwrapped.reference  # the target's greedy output, replayed
    assert not v1.unwrapped.pair.loaded


def test_the_main_job_needs_no_model_where_the_dataset_covers_it_and_a_profile_prices_it(offline):
    from agents.common.phases import Phases
    from agents.serve.options import ServeTrainConfig
    from agents.serve.training import PHASES, prepare, start_fill

    _, loads = offline
    said = []
    env_cfg = replace(ServingConfig(), pair="tiny-random", cost_profile=PROFILE, max_prompts=1, max_new_tokens=12,
                      actions={"rollback_values": (0.5,)})
    phases = Phases(PHASES, said.append)
    prepare(env_cfg, phases)
    assert all("skipped" in phases.records[p] for p in PHASES[:2]) and loads == []
    assert start_fill(ServeTrainConfig(), env_cfg) is None  # nothing to fill either
    # options the dataset does not answer: the job says why before it loads the models (here: it cannot)
    said.clear()
    with pytest.raises(Exception):
        prepare(replace(env_cfg, max_prompts=2), Phases(PHASES, said.append))
    why = next(line for line in said if "does not answer every training episode" in line)
    assert why.endswith("it records 1 train prompts of 'prose' and max_prompts is 2 (--max-prompts 1 keeps to them). "
                        "The models load to decode the rest")
    assert loads  # ... and only then tried to


@pytest.mark.parametrize("folder", sorted(p.name for p in ds.SHIPPED.iterdir() if (p / ds.MANIFEST).is_file()))
def test_every_recorded_prompt_replays_every_lossless_episode_with_no_model(folder, monkeypatch):
    """Every prompt of the preset's prompt source each shipped dataset holds, every lossless action (the five
    fallbacks at rollback 0.5, and off): a whole BiLD-v1 episode with no model (a bfloat16 recording walks the path
    its own forwards take, which can leave the one-token greedy continuation: ``bild_env.fill.cover``)."""
    monkeypatch.setattr(bild_env.models.pairs, "_CACHE", {})
    monkeypatch.setattr(bild_env.models.pairs, "load_pair", lambda *a, **k: (_ for _ in ()).throw(OSError("offline")))
    dataset = ds.DecodingDataset.open(ds.SHIPPED / folder)
    m = dataset.manifest
    for split in m["prompts"]:
        env = gymnasium.make("bild_env:BiLD-v1", pair=m["pair"], pair_options={"dtype": m["dtype"]},
                             cost_profile=PROFILE, split=split, backend="replay", max_new_tokens=m["max_new_tokens"],
                             actions={"off_switch": True, "rollback_values": (0.5,)})
        u = env.unwrapped
        for index in range(len(u.prompts)):
            for action in range(env.action_space.n):
                env.reset(options={"prompt_index": index})
                done = False
                while not done:
                    _, _, terminated, truncated, _ = env.step(action)
                    done = terminated or truncated
        assert not u.pair.loaded and u.pair.dataset.name == folder


def test_a_command_whose_actions_leave_the_dataset_loads_the_models_for_them(offline):
    """The trainers and evaluators (``load_where_needed``) opt in where their actions leave the recording (the
    paper's grid, a length beyond it): said at construction; where they keep to it, nothing changes."""
    from bild_env.env import EnvConfig

    base = dict(pair="tiny-random", backend="replay", cost_profile=PROFILE, split="test", max_new_tokens=12)
    assert ds.load_where_needed(EnvConfig(**base)).pair_options.load_on_miss  # the paper's grid
    assert ds.load_where_needed(EnvConfig(**base | {"max_new_tokens": 13}, actions={"rollback_values": (0.5,)}))\
        .pair_options.load_on_miss
    kept = EnvConfig(**base, actions={"rollback_values": (0.5,)})
    assert ds.load_where_needed(kept) is kept
    live = EnvConfig(**base | {"backend": "live"})  # no dataset replayed
    assert ds.load_where_needed(live) is live
    serving = ServingConfig(pair="tiny-random", cost_profile=PROFILE, split="test", max_new_tokens=12)
    assert ds.load_where_needed(serving).pair_options.load_on_miss
    from agents.serve.bench_config import runs_lossy  # the serving rules opt in only where they run a lossy action

    from agents.serve.bench_config import ServingBenchConfig

    def fixed(*actions, **env):
        return ServingBenchConfig(env=ServingConfig(**env), fixed_actions=actions)

    assert not runs_lossy(fixed(0, 5, 10, 15, 20, 25)) and runs_lossy(fixed()) and runs_lossy(fixed(0, 1))
    assert not runs_lossy(fixed(0, 1, actions={"rollback_values": (0.5, 0.6)}))  # read on the env's own grid


def test_the_real_pairs_bfloat16_recording_answers_its_tree_rules_with_no_model(monkeypatch):
    """qwen2.5-coder's bfloat16 dataset records token-tree rules: every recorded rule replays whole BiLD-v1 episodes
    (64 tokens, each step's tokens the target's own argmaxes: no regret; in bfloat16 a forward fed a tree may break a
    near-tie otherwise than the one-token greedy reference) and serving episodes of tree steps, offline with no
    model."""
    monkeypatch.setattr(bild_env.models.pairs, "_CACHE", {})
    monkeypatch.setattr(bild_env.models.pairs, "load_pair", lambda *a, **k: (_ for _ in ()).throw(OSError("offline")))
    dataset = ds.shipped("qwen2.5-coder", "bfloat16")
    rules = tuple(dataset.manifest["tree_rules"])
    assert len(rules) == 3
    common = dict(pair="qwen2.5-coder", pair_options={"dtype": "bfloat16"}, cost_profile="xeon-amx-qwen2.5-coder-bf16",
                  split="validation", max_prompts=2)
    v1 = gymnasium.make("bild_env:BiLD-v1", **common, backend="replay", max_new_tokens=64,
                        actions={"rollback_values": (0.5,), "tree_rules": rules})
    u = v1.unwrapped
    for action in range(u.first_tree, v1.action_space.n):
        v1.reset(options={"prompt_index": 1})
        done = False
        while not done:
            _, _, terminated, truncated, info = v1.step(action)
            assert info["tree"] == rules[action - u.first_tree] and info["regret"] == 0.0
            done = terminated or truncated
        assert len(u.session.new_ids) == 64 or u.session.new_ids[-1] in u.pair.eos_token_ids
    serve = gymnasium.make("bild_env:BiLD-Serve-v0", **common, actions={"rollback_values": (0.5,), "tree_rules": rules},
                           episode_steps=24)
    serve.reset(seed=0)
    rng, done = np.random.default_rng(0), False
    while not done:
        _, reward, terminated, truncated, info = serve.step(int(rng.integers(serve.unwrapped.first_tree,
                                                                             serve.action_space.n)))
        done = terminated or truncated
    assert info["episode_summary"]["regret"] == 0.0 and not u.pair.loaded and not serve.unwrapped.pair.loaded
