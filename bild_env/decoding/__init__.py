"""Decoding (above models and prompts): the BiLD rule and session, the decoders, forwards over KV caches, costs.

Floors, each importing only from those below it (``[tool.importlinter]`` in pyproject.toml holds them to it):

- the cost tables, no timing (``forward_costs`` < ``batch_costs`` < ``cost_model``), the KV-cache forwards
  (``kv``) and the statistics (``stats``);
- forwards counted and priced (``runner``; ``padded`` for batches) < the committed tokens (``loop``) < the BiLD
  rule and session (``bild``) < the one-request decoders (``decoders``) < the batched decoder (``batched``);
- the calibration, which runs the decoders: the decoding loop's own work fitted on the clock (``loop_costs``) <
  the forwards timed and the tables stored per machine (``costs``, which re-exports the tables' names).

Nothing here knows of reinforcement learning; the env is a thin adapter over ``BildSession``.
"""
