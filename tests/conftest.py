"""Shared fixtures: tiny locally made model pairs, one CPU thread, a private cache folder."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# Tests never touch the network and never write into the user's cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["BILD_ENV_REAL_CACHE"] = os.environ.get(
    "BILD_ENV_CACHE", os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "bild_env")
)
os.environ["BILD_ENV_CACHE"] = tempfile.mkdtemp(prefix="bild_env_test_cache_")
# Tiny models gain nothing from threads, and two threads contending with other work run 30x slower.
torch.set_num_threads(1)

from bild_env.decoding.costs import CostModel  # noqa: E402  (after the environment above is set)


# A fixed cost model: deterministic rewards without timing anything.
COSTS = CostModel(draft=(1.0, 0.1, 0.001), target=(4.0, 0.5, 0.004), device="test")


@pytest.fixture
def make_env(tiny_pair, request):
    """Make BiLD-v0 envs on tiny-random (fixed costs; a module's ENV_DEFAULTS override); all closed after the test."""
    import gymnasium

    envs = []
    defaults = {"pair": "tiny-random", "pair_options": {"device": "cpu"}, "cost_model": COSTS, "max_new_tokens": 24}
    defaults |= getattr(request.module, "ENV_DEFAULTS", {})

    def make(**kwargs):  # a sub-config's dict (actions=...) over the module's
        given = {k: defaults[k] | v if isinstance(v, dict) and isinstance(defaults.get(k), dict) else v
                 for k, v in kwargs.items()}
        env = gymnasium.make("bild_env:BiLD-v0", **(defaults | given))
        envs.append(env)
        return env

    yield make
    for env in envs:
        env.close()


@pytest.fixture(scope="session")
def tiny_pair():
    from bild_env import load_pair

    return load_pair("tiny-random", device="cpu")


@pytest.fixture(scope="session")
def agreeing_pair():
    """A tiny pair whose draft agrees with the target more often (~85% of positions).

    A custom pair (no preset) defaults to dtype "auto" (bfloat16 on a CPU with native bfloat16); the
    exactness tests need float32, so it is asked for.
    """
    from bild_env import load_pair
    from bild_env.models.tiny import TinySpec, ensure_tiny_pair

    folder = ensure_tiny_pair(TinySpec(alpha=0.1))
    return load_pair(draft=folder / "draft", target=folder / "target", tokenizer=folder / "tokenizer", device="cpu",
                     dtype="float32")


def regrets_apart(record):
    """``record`` (nested lists, tuples, dicts) with every "regret" value set to None, and those values in order.

    Replay reads the regret from the forward that filled its tree, live decoding from the verifying
    forward: the same numbers up to float rounding (different matrix shapes), so tests compare the
    rest exactly and the regrets with a tolerance.
    """
    found = []

    def strip(x):
        if isinstance(x, dict):
            out = {}
            for k, v in x.items():
                if k == "regret":
                    found.append(v)
                    out[k] = None
                else:
                    out[k] = strip(v)
            return out
        if isinstance(x, (list, tuple)):
            return type(x)(strip(v) for v in x)
        return x

    return strip(record), found


def assert_same_up_to_regret_rounding(a, b):
    import pytest

    (sa, ra), (sb, rb) = regrets_apart(a), regrets_apart(b)
    assert sa == sb
    assert ra == pytest.approx(rb, rel=1e-4, abs=1e-4)  # nats; float32 logits of two differently shaped forwards


@pytest.fixture
def signals_not_ignored():
    """SIGINT and SIGTERM handled as in a foreground terminal (KeyboardInterrupt, termination) for the test, restored
    after: a test that sends one must not depend on how pytest was started (a background job of a non-interactive
    shell, ``nohup`` or ``trap "" INT`` start it with SIGINT ignored, and a trainer rightly leaves an ignored signal
    ignored)."""
    import signal

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


FILL_TESTS = ("test_workload_fill", "test_main_job_phases")  # the modules that test the tree phase's fill itself


@pytest.fixture(autouse=True)
def no_tree_fill(request, monkeypatch):
    """Serving training in-process without the tree phase's fill (a second process decoding every training prompt):
    it costs a process start per run and tests nothing but itself, which ``FILL_TESTS`` test. Training then fills
    lazily, as with ``--no-fill-trees``."""
    if request.module.__name__.rsplit(".", 1)[-1] in FILL_TESTS:
        return
    import agents.serve.training

    monkeypatch.setattr(agents.serve.training, "start_fill", lambda cfg, env_cfg: None)
