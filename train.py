"""Train a DQN that picks BiLD's fallback and rollback thresholds at every decoding step (BiLD-v0).

    python train.py --total-timesteps 2000            # tiny-random pair, offline, minutes on a CPU
    tensorboard --logdir logs
    python train.py --resume logs/<run_name>          # continue an interrupted run (Ctrl-C saves first)

Training steps ``--n-envs`` envs together (SB3 ``make_vec_env``; on the replay backend a
``agents.vec.BatchedReplayVecEnv``, whose envs share their prefix trees and batch their model
forwards); every step count is in env steps over all envs.

A run writes ``<log_dir>/<run_name>/``: ``config.json`` (the whole config), TensorBoard events
(SB3's rollout/, train/, eval/ curves and the env's bild/ episode metrics), ``checkpoints/``
(model + replay buffer every --checkpoint-freq steps, on Ctrl-C and at the end),
``best_model.zip`` (best mean return on validation prompts), ``evaluations.npz`` and the final
``model.zip``. Every option and default comes from ``agents.config`` (run, DQN) and
``bild_env.env.EnvConfig`` (environment). The code is ``agents.training`` (options, training) and
``agents.runs`` (run folders, checkpoints); this file is only the entry point.
"""

import sys

if __name__ == "__main__":
    from agents.training import main

    sys.exit(main())
