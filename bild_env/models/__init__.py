"""Model pairs (the bottom layer): presets, loading, the device they run on, and the offline pairs."""

from bild_env.models.pairs import preset_names  # the presets' names, as the commands' --pair help points to them

__all__ = ["preset_names"]
