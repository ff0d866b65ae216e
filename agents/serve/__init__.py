"""BiLD-Serve-v0's room: training (``training``, ``python train.py --env serve``) and its run folders (``runs``), the
rules a serving engineer writes (``rules``), the evaluation of rules and agents per load level (``evaluation``,
``python evaluate.py --env serve``) and on the wall clock (``load_clock``), and the run's report (``run_report``)."""
