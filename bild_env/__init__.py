"""bild-gym: BiLD speculative decoding as a Gymnasium environment whose actions set its thresholds."""

from bild_env.decoding.bild import FIXED_FALLBACK, FIXED_ROLLBACK, BildSession, first_rollback, should_fall_back
from bild_env.decoding.decoders import (
    generate_bild,
    generate_speculative,
    generate_target_only,
    new_bild_session,
)
from bild_env.models.pairs import ModelPair, PairError, load_pair, preset_names
from bild_env.decoding.stats import DecodeStats, Generation

ENV_ID = "BiLD-v0"


def _register() -> None:
    """Register BiLD-v0 with Gymnasium (1.x has no entry-point plugins: importing the package does it)."""
    import gymnasium

    if ENV_ID not in gymnasium.registry:
        gymnasium.register(id=ENV_ID, entry_point="bild_env.env:BildEnv")


_register()

__all__ = [
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
