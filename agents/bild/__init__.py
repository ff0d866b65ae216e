"""BiLD-v1's room: training (``training``, ``python train.py``), its run folders and exact resume (``runs``,
``resume``), its episode metrics (``callbacks``), and the comparison of decoding methods (``comparison``,
``python evaluate.py``) with its baselines, rollouts and evaluation helpers."""
