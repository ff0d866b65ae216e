"""BiLD under serving conditions: a batch of concurrent requests, a load that moves, a mixed workload.

``env`` (``ServingEnv``, registered as ``BiLD-Serve-v0``), ``clock`` (what a batched step costs),
``load`` (load profiles), ``observations`` (what the agent sees), ``workload`` (the requests' prompts).
"""
