"""Exact replay (above decoding): answer the runner's questions from per-prompt prefix trees.

``tree`` (PrefixTree and its file format), ``store`` (TreeStore: owns the trees of a pair, in
memory and on disk), ``runner`` (ReplayRunner: the runner interface over a store, filling on a
miss), ``batching`` (CoopBatcher: several runners' fills as one batched forward).
``python -m bild_env.replay [folder]`` prints what the replay cache holds.
"""

from bild_env.replay.batching import CoopBatcher, active_batcher, plan_batches
from bild_env.replay.runner import ReplayRunner
from bild_env.replay.store import ReplayReport, TreeStore, disk_report, sharing
from bild_env.replay.tree import PrefixTree

__all__ = ["CoopBatcher", "PrefixTree", "ReplayReport", "ReplayRunner", "TreeStore", "active_batcher", "disk_report",
           "plan_batches", "sharing"]
