"""The replay tree store: one per pair and process, bounded loss, merged writes, damaged files set aside; and the
inputs the env refuses before any model loads."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from bild_env.env import BildEnv
from bild_env.paths import cache_dir, digest, prompt_key
from bild_env.replay import PrefixTree, TreeStore, disk_report
from bild_env.replay.tree import ARRAYS, check_arrays, checksum

from conftest import COSTS, assert_same_up_to_regret_rounding  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KWARGS = {"pair": "tiny-random", "pair_options": {"device": "cpu"}, "cost_model": COSTS, "max_new_tokens": 16}
# make_env's overrides; quality="bleu": live and replay rewards are compared exactly (the regret term carries float
# rounding of the forward that computed it, the BLEU term depends on the tokens alone)
ENV_DEFAULTS = {"max_new_tokens": 16, "reward": {"quality": "bleu"}}


def texts(n: int = 2) -> list[str]:
    """Prompts no other test uses: their trees start empty, in memory and on disk."""
    tag = uuid.uuid4().hex[:8]
    return [f"Store test {tag} number {i}: the river rises in the hills and flows south to the sea." for i in range(n)]


def episode(env, index: int, seed: int) -> list:
    """One episode on prompt ``index`` with random actions from ``seed``: everything reset and step returned."""
    rng = np.random.default_rng(seed)
    obs, info = env.reset(seed=0, options={"prompt_index": index})
    out, done = [(obs.tolist(), info)], False
    while not done:
        obs, reward, terminated, truncated, info = env.step(int(rng.integers(25)))
        out.append((obs.tolist(), reward, terminated, truncated, info))
        done = terminated or truncated
    return out


def tree_file(env) -> Path:
    """The file of the tree of ``env``'s first prompt."""
    e = env.unwrapped
    return cache_dir("replay", digest(e.pair.key)) / f"{prompt_key(e.prompts[0])}.npz"


# ------------------------------------------------------------------------------------------------
# one store per pair and process
def test_a_second_env_in_one_process_starts_warm_with_the_first_left_open(make_env):
    dataset = texts(3)
    first = make_env(backend="replay", dataset=dataset)
    a = [episode(first, i % 3, i) for i in range(6)]
    store = first.unwrapped.runner.store
    before = store.report()
    second = make_env(backend="replay", dataset=dataset)  # the first is still open, nothing was flushed
    assert second.unwrapped.runner.store is store
    b = [episode(second, i % 3, i) for i in range(6)]
    after = store.report()
    assert a == b
    assert after["fills"] == before["fills"] and after["misses"] == before["misses"]
    assert after["hits"] > before["hits"]


def test_an_explicit_store_still_wins(make_env):
    own = TreeStore()
    env = make_env(backend="replay", dataset=texts(1), replay_store=own)
    assert env.unwrapped.runner.store is own and own is not TreeStore.for_folder(own.folder)


# ------------------------------------------------------------------------------------------------
# bounded loss: periodic writes and writes at exit
@pytest.mark.parametrize("store_kwargs", [{"flush_every": 1}, {"flush_seconds": 0.0}])
def test_changed_trees_reach_disk_periodically_without_close(make_env, store_kwargs):
    env = make_env(backend="replay", dataset=texts(1), replay_store=TreeStore(**store_kwargs))
    path = tree_file(env)
    episode(env, 0, 1)
    assert path.is_file()  # written during the episode, no close() yet
    tree = PrefixTree.load(path)
    assert len(tree) > 1 and env.unwrapped.runner.store.report()["writes"] >= 1


def test_a_store_is_written_when_garbage_collected(tiny_pair):
    env = BildEnv(**KWARGS, backend="replay", dataset=texts(1), replay_store=TreeStore())
    path = tree_file(env)
    episode(env, 0, 2)
    del env  # no close(): the store's finalizer writes its changed trees
    gc.collect()
    assert len(PrefixTree.load(path)) > 1


def test_changed_trees_are_written_at_interpreter_exit(tmp_path):
    code = ("import sys; from bild_env.replay import TreeStore\n"
            "store = TreeStore(sys.argv[1])\n"
            "tree, _ = store.open('k')\n"
            "tree.d_arg[tree.child(0, 5)], tree.d_p[1] = 3, 0.5\n"
            "store.changed('k')\n")  # no flush: written at exit
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    tree = PrefixTree.load(tmp_path / "k.npz")
    assert tree.d_arg[tree.child(0, 5)] == 3


# ------------------------------------------------------------------------------------------------
# merge, never overwrite
def test_two_stores_writing_one_prompt_keep_the_union_on_disk(make_env, monkeypatch, tmp_path):
    # a cache of its own: trees that earlier tests filled for this prompt would give both stores every prefix at
    # open, and b's episodes nothing a lacks (this failed in a full CI run, depending on which tests ran before)
    monkeypatch.setenv("BILD_ENV_CACHE", str(tmp_path))
    dataset = texts(1)
    # no periodic write during the test (on a loaded machine a 60 s flush of one store could merge the other's
    # prefixes into it before the check): only the writes at close() are under test
    a = make_env(backend="replay", dataset=dataset, replay_store=TreeStore(flush_seconds=float("inf")))
    b = make_env(backend="replay", dataset=dataset, replay_store=TreeStore(flush_seconds=float("inf")))
    for seed in range(3):
        episode(a, 0, seed)
    in_a = a.unwrapped.runner.tree.prefixes()
    # other actions, other prefixes: b goes on until it holds one a lacks (the prompt is new every run, and on some
    # prompts the toy draft agrees with the target so often that three episodes of each visit the same prefixes)
    b_seeds = []
    for seed in range(10, 40):
        episode(b, 0, seed)
        b_seeds.append(seed)
        in_b = b.unwrapped.runner.tree.prefixes()
        if len(b_seeds) >= 3 and set(in_b) - set(in_a):
            break
    assert set(in_b) - set(in_a)
    a.close()
    b.close()  # writes after a: merges a's tree first
    on_disk = PrefixTree.load(tree_file(a)).prefixes()
    assert set(in_a) | set(in_b) <= set(on_disk)
    assert all(on_disk[p] & known == known for p, known in (in_a | in_b).items())  # no number lost either
    report = b.unwrapped.runner.store.report()
    assert report["merges"] == 1 and report["conflicts"] == 0
    # a third store replays both envs' episodes from the merged file alone
    c = make_env(backend="replay", dataset=dataset, replay_store=TreeStore())
    for seed in [*range(3), *b_seeds]:
        episode(c, 0, seed)
    assert c.unwrapped.runner.store.report()["fills"] == 0


def test_merge_matches_nodes_by_their_token_path_and_counts_disagreements():
    mine, theirs = PrefixTree(), PrefixTree()
    x = mine.child(mine.child(0, 5), 7)
    mine.d_arg[x], mine.d_p[x] = 3, 0.5
    theirs.child(0, 9)  # other node ids for the same paths
    y = theirs.child(theirs.child(0, 5), 7)
    theirs.d_arg[y], theirs.d_p[y], theirs.t_arg[y], theirs.t_top[y] = 4, 0.25, 2, -0.1
    z = theirs.child(y, 1)
    theirs.t_arg[z] = 6
    assert mine.merge(theirs) == 1  # d_arg 3 vs 4: mine kept
    assert (mine.d_arg[x], mine.d_p[x], mine.t_arg[x]) == (3, 0.5, 2)
    assert mine.t_arg[mine.child(x, 1)] == 6 and set(theirs.prefixes()) <= set(mine.prefixes())
    assert mine.merge(theirs) == 1 and len(mine) == 5  # idempotent


def test_merge_keeps_t_logp_and_t_top_from_one_forward():
    """In bfloat16 two forwards round the same log-probability differently (by up to ~0.1 nat): a node whose
    t_top one process read (its draft token unknown then) and whose t_logp another read with its own t_top
    must take both of the other's, or t_logp could exceed t_top and the file be refused when read back."""
    mine, theirs = PrefixTree(), PrefixTree()
    x, y = mine.child(0, 5), theirs.child(0, 5)
    mine.t_arg[x], mine.t_top[x] = 2, -0.30  # this forward read the target before the draft token was known
    theirs.d_arg[y], theirs.d_p[y], theirs.t_arg[y] = 2, 0.9, 2
    theirs.t_logp[y] = theirs.t_top[y] = -0.20  # the draft token is the target's argmax, read by another forward
    mine.d_arg[x], mine.d_p[x] = 2, 0.9
    assert mine.merge(theirs) == 1  # the two t_top disagree: counted
    assert (mine.t_logp[x], mine.t_top[x]) == pytest.approx((-0.20, -0.20))  # a pair, never -0.20 over -0.30
    arrays = {name: np.asarray(getattr(mine, name)) for name in ARRAYS}
    check_arrays(arrays)  # the integrity check the store runs on load passes


# ------------------------------------------------------------------------------------------------
# integrity
def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "random bytes":
        path.write_bytes(np.random.default_rng(0).bytes(len(data)))
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    else:
        with np.load(path) as f:
            arrays = {k: f[k] for k in f.files}
        if how == "arrays of different lengths":  # a format 1 file (no checksum) with one array cut short
            arrays = {k: v for k, v in arrays.items() if k not in ("nodes", "checksum", "format")}
            arrays["d_arg"] = arrays["d_arg"][:-1]
        else:  # "shifted array": the stored checksum no longer matches
            arrays["t_arg"] = np.roll(arrays["t_arg"], 1)
        with open(path, "wb") as f:
            np.savez(f, **arrays)


@pytest.mark.parametrize("how", ["random bytes", "truncated", "empty", "arrays of different lengths", "shifted array"])
def test_a_damaged_tree_file_is_reported_set_aside_and_recomputed(make_env, caplog, how):
    dataset = texts(1)
    live = make_env(dataset=dataset)
    expected = [episode(live, 0, seed) for seed in range(2)]
    writer = make_env(backend="replay", dataset=dataset, replay_store=TreeStore())
    episode(writer, 0, 0)
    writer.close()
    path = tree_file(writer)
    _damage(path, how)
    replay = make_env(backend="replay", dataset=dataset, replay_store=TreeStore())
    with caplog.at_level(logging.WARNING, logger="bild_env.replay.store"):
        got = [episode(replay, 0, seed) for seed in range(2)]
    assert_same_up_to_regret_rounding(got, expected)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "damaged" in warnings[0], warnings
    assert len(list(path.parent.glob(path.name + ".bad-*"))) == 1  # set aside, kept for a look
    store = replay.unwrapped.runner.store
    assert store.report()["damaged_files"] == 1 and store.report()["loads"] == 0
    replay.close()
    assert len(PrefixTree.load(path)) > 1  # computed again and written


def test_a_file_of_the_first_format_is_set_aside_and_filled_again(make_env, caplog):
    dataset = texts(1)
    live = make_env(dataset=dataset)
    expected = episode(live, 0, 3)
    writer = make_env(backend="replay", dataset=dataset, replay_store=TreeStore())
    episode(writer, 0, 3)
    writer.close()
    path = tree_file(writer)
    with np.load(path) as f:
        old = {k: f[k] for k in ("parent", "token", "d_arg", "t_arg", "d_p", "t_logp")}  # no t_top, no checksum
    old["d_p"][-1] = 1.0 - old["d_p"][-1] / 2  # altered in range: nothing in a file without a checksum would tell
    with open(path, "wb") as f:
        np.savez(f, **old)
    replay = make_env(backend="replay", dataset=dataset, replay_store=TreeStore())
    with caplog.at_level(logging.WARNING, logger="bild_env.replay.store"):
        assert_same_up_to_regret_rounding(episode(replay, 0, 3), expected)
    assert "without a checksum" in caplog.text and replay.unwrapped.runner.store.report()["loads"] == 0
    assert list(path.parent.glob(path.name + ".bad-*"))


def test_checksum_covers_every_array():
    tree = PrefixTree()
    tree.child(0, 5)
    tree.d_top[0] = ([5, 6], [-0.1, -2.5])  # the draft's top candidates: their arrays too
    arrays = tree.arrays()
    base = checksum(arrays)
    for name in arrays:
        changed = dict(arrays)
        changed[name] = arrays[name].copy()
        changed[name][-1] = -0.5 if arrays[name].dtype.kind == "f" else 3  # differs from every value of this tree
        assert checksum(changed) != base, name


def test_stray_tmp_files_are_ignored_and_old_ones_cleaned(tiny_pair):
    folder = cache_dir("replay", digest(tiny_pair.key))
    old, new = folder / f"{uuid.uuid4().hex}.tmp.npz", folder / f"{uuid.uuid4().hex}.123-abcd.tmp.npz"
    for f in (old, new):
        f.write_bytes(b"half a write")
    os.utime(old, (time.time() - 120, time.time() - 120))
    store = TreeStore()
    store.attach(folder)
    assert not old.exists() and new.exists()  # a recent one may belong to a writer still at work
    tree, is_new = store.open(new.name.split(".")[0])
    assert is_new and len(tree) == 1
    report = disk_report(folder)  # what `python -m bild_env.replay` prints: tmp files are no trees
    assert report["damaged"] == [] and report["prompt_trees"] == len(list(folder.glob("*[0-9a-f].npz")))
    new.unlink()


# ------------------------------------------------------------------------------------------------
# inputs refused before any model loads
@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("bild_env.models.pairs.load_pair", refuse)  # both envs load the pair through it


@pytest.mark.parametrize("index", [1.7, "a", True, -1, 99])
def test_prompt_index_must_be_an_integer_in_range(make_env, index):
    env = make_env()
    with pytest.raises(ValueError, match=r"prompt_index'\] must be an integer in \[0, 18\).*got " + repr(index)[:3]):
        env.reset(options={"prompt_index": index})
    assert env.reset(options={"prompt_index": np.int64(2)})[1]["prompt_index"] == 2


@pytest.mark.parametrize("value", [0, -3, 1.5, True])
def test_max_prompts_must_be_at_least_one(no_model_loads, value):
    with pytest.raises(ValueError, match=rf"max_prompts must be an integer >= 1 .*got {value!r}"):
        BildEnv(**KWARGS, max_prompts=value)


def test_a_binary_dataset_file_is_refused_naming_the_file(no_model_loads, tmp_path):
    binary = tmp_path / "data.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ValueError, match="is not a UTF-8 text file") as err:
        BildEnv(**KWARGS, dataset=str(binary))
    assert str(binary) in str(err.value)
    with pytest.raises(ValueError, match="unknown dataset"):
        BildEnv(**KWARGS, dataset=str(tmp_path / "missing.txt"))


@pytest.mark.parametrize("name, value", [("latency_weight", float("nan")), ("bleu_weight", float("inf"))])
def test_weights_must_be_finite(no_model_loads, name, value):
    with pytest.raises(ValueError, match=rf"{name} must be a finite number >= 0, got {value!r}: give a weight"):
        BildEnv(**KWARGS, reward={name: value})


def test_node_count_follows_growth_and_membership_and_the_cap_evicts(tmp_path):
    store = TreeStore(max_nodes=5)
    store.attach(tmp_path)
    a, _ = store.open("a")
    assert store.nodes == 1
    node = a.child(0, 3)
    assert store.nodes == 2  # a tree grew after the last count
    a.child(node, 4)
    b, _ = store.open("b")
    b.child(0, 9)
    assert store.nodes == 5  # and a tree joined
    store.evict()
    assert store.nodes == 5 and store.counts.evictions == 0  # at the cap, nothing goes
    b.child(0, 8)
    store.release("a")
    store.changed("a")
    store.evict()  # 6 > 5: "a", no longer open, goes (written first)
    assert store.counts.evictions == 1 and store.nodes == 3
    again, new = store.open("a")  # read back from disk, whole
    assert not new and again is not a and len(again) == 3 and store.nodes == 6
