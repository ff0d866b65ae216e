"""bild-gym: BiLD speculative decoding as a Gymnasium environment whose actions set its thresholds.

Layers, each importing only from those below it:

- ``models/`` (pairs, presets, the device) and ``prompts/`` (prompt sources): the bottom;
- ``decoding/``: the BiLD rule and session, the three decoders, forwards over KV caches, costs;
- ``replay/``: the same runner interface answered from per-prompt prefix trees;
- ``reference`` (BLEU against the target's greedy output), ``observations`` and ``env``: the top.

Importing the package registers ``BiLD-v1`` (the defaults), ``BiLD-v0`` (the paper's setting) and
``BiLD-Serve-v0`` (``serving/``: a batch of concurrent requests under a moving load) with Gymnasium.
"""

from bild_env.decoding.bild import FIXED_FALLBACK, FIXED_ROLLBACK, BildSession, first_rollback, should_fall_back
from bild_env.decoding.decoders import (
    generate_bild,
    generate_speculative,
    generate_target_only,
    new_bild_session,
)
from bild_env.decoding.stats import DecodeStats, Generation
from bild_env.models.pairs import DEFAULT_PAIR, ModelPair, PairError, load_pair, preset_names

from bild_env.ids import ENV_ID, SERVE_ID  # noqa: E402 (the ids of the envs registered below)


def _register() -> None:
    """Register BiLD-v0 (the paper's setting) and BiLD-v1 with Gymnasium (1.x has no entry-point plugins:
    importing the package does it)."""
    import gymnasium

    for env_id, entry_point in (("BiLD-v0", "paper_env"), (ENV_ID, "BildEnv")):  # v0: the paper's setting under the
        if env_id not in gymnasium.registry:                                   # caller's (``bild_env.env.paper_env``)
            gymnasium.register(id=env_id, entry_point=f"bild_env.env:{entry_point}")
    if SERVE_ID not in gymnasium.registry:  # truncates itself after episode_steps: no TimeLimit wrapper
        gymnasium.register(id=SERVE_ID, entry_point="bild_env.serving.env:ServingEnv")


_register()

__all__ = [
    "DEFAULT_PAIR",
    "ENV_ID",
    "SERVE_ID",
    "FIXED_FALLBACK",
    "FIXED_ROLLBACK",
    "BildSession",
    "DecodeStats",
    "Generation",
    "ModelPair",
    "PairError",
    "first_rollback",
    "generate_bild",
    "generate_speculative",
    "generate_target_only",
    "load_pair",
    "new_bild_session",
    "preset_names",
    "should_fall_back",
]
