"""The environments' ids (Gymnasium's ``gymnasium.make`` names): the bottom floor, so every module can name them."""

ENV_ID = "BiLD-v1"  # the current version (the defaults of bild_env.env.EnvConfig)
SERVE_ID = "BiLD-Serve-v0"  # a batch of requests under a moving load (bild_env.serving.env.ServingConfig)
