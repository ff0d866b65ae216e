"""The requests' prompts: a mix of domains with weights (``bild_env.prompts.domains``), drawn per arrival."""

from bild_env.prompts.domains import Workload, parse_mix

__all__ = ["Workload", "parse_mix"]
