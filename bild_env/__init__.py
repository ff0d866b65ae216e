"""bild-gym: BiLD speculative decoding as a Gymnasium environment whose actions set its thresholds.

Layers, each importing only from those below it:

- ``models/`` (pairs, presets, the device) and ``prompts/`` (prompt sources): the bottom;
- ``decoding/``: the BiLD rule and session, the three decoders, forwards over KV caches, costs;
- ``replay/``: the same runner interface answered from per-prompt prefix trees;
- ``reference`` (BLEU against the target's greedy output) and ``env`` (``BiLD-v0``): the top.

Importing the package registers ``BiLD-v0`` with Gymnasium.
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

ENV_ID = "BiLD-v0"


def _register() -> None:
    """Register BiLD-v0 with Gymnasium (1.x has no entry-point plugins: importing the package does it)."""
    import gymnasium

    if ENV_ID not in gymnasium.registry:
        gymnasium.register(id=ENV_ID, entry_point="bild_env.env:BildEnv")


_register()

__all__ = [
    "DEFAULT_PAIR",
    "ENV_ID",
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
