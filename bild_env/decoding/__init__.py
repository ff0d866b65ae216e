"""Decoding (above models): the BiLD rule and session, the three decoders, forwards over KV caches, costs, stats.

Nothing here knows of reinforcement learning; the env is a thin adapter over ``BildSession``.
"""
