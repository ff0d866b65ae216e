"""Train a DQN that picks BiLD's fallback and rollback thresholds at every decoding step (BiLD-v1; --env serve: BiLD-Serve-v0).

    python train.py --env quick                       # the toy pair, offline, a minute on a CPU (the default pair is smollm2)
    python train.py --env paper                       # BiLD-v1 in the paper's setting (presets: agents.spec.PRESETS)
    tensorboard --logdir logs
    python train.py --resume logs/<run_name>          # continue an interrupted run of either env (Ctrl-C saves first)

Training steps ``--n-envs`` envs together (SB3 ``make_vec_env``; on the replay backend a
``agents.vec.BatchedReplayVecEnv``, whose envs share their prefix trees and batch their model
forwards); every step count is in env steps over all envs.

A run writes ``<log_dir>/<run_name>/``: ``config.json`` (the whole config), TensorBoard events
(SB3's rollout/, train/, eval/ curves and the env's bild/ episode metrics), ``checkpoints/``
(model, replay buffer and resume state every --checkpoint-freq steps, on Ctrl-C and at the end),
``best_model.zip`` (best mean return on validation prompts; its step in ``best_model.json``),
``evaluations.npz`` and the final ``model.zip``. Ctrl-C or SIGTERM stops at the next checkpoint
boundary (a step or a few; for PPO and A2C the end of the rollout) with a checkpoint, and --resume
goes on as the uninterrupted run would, also after a kill. One process at a time trains a run
(``train.lock``). Every option and default comes from ``agents.config`` (run, algorithms) and
``bild_env.env.EnvConfig`` (environment), each checked before anything loads. The code is
``agents.training`` (the trainer, one for every env), ``agents.bild.training`` (BiLD-v1's options and room),
``agents.bild.runs`` and ``agents.common`` (run folders, checkpoints) and ``agents.bild.resume`` (what a checkpoint
adds for an exact resume); this file is only the entry point.
"""

import sys

if __name__ == "__main__":
    from agents.commands import train_main
    from bild_env.command import run_command

    sys.exit(run_command("train.py", train_main))
