"""What both envs' trainers and evaluations share, written once: ``train.py``'s command line (``parse``), run folders
(``folders``) and their lock (``lock``), files written whole (``files``), checkpoints written as one unit and the
resume point past torn ones (``checkpoints``, ``replay_buffer``), logs that continue across a resume (``logs``),
callbacks and signals (``callbacks``), evaluation statistics (``stats``), trained agents read back (``trained``),
result checks (``checks``), progress lines (``phases``) and the bandit baselines (``bandits``)."""
