"""Prompt sources (the bottom layer): built-in paragraphs, WikiText-2, offline Wikipedia, text files, lists."""

from bild_env.prompts.sources import load_prompts, paragraphs
from bild_env.prompts.splits import SPLITS, check_split

__all__ = ["SPLITS", "check_split", "load_prompts", "paragraphs"]
