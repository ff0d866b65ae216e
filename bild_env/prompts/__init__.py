"""Prompt sources (the bottom layer): built-in paragraphs, WikiText-2, offline Wikipedia, text files, lists."""

from bild_env.prompts.sources import SPLITS, check_split, load_prompts, paragraphs

__all__ = ["SPLITS", "check_split", "load_prompts", "paragraphs"]
