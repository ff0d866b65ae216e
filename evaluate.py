"""Compare a trained agent with the other decoding methods on the same held-out prompts.

    python evaluate.py                                   # the latest run in logs/ for the default pair
    python evaluate.py --model logs/<run>/model.zip --num-prompts 50 --out results/mine
    python evaluate.py --help                            # every option, with its default
    python evaluate.py --env serve --model logs/<serve-run>   # BiLD-Serve-v0: rules, ceilings and agents per load
    python evaluate.py --env serve --model pretrained         # the serving agent shipped in bild_env/assets/serve-agent
    python evaluate.py --env serve --clock --load 0.05 0.3 1.0 --model logs/<serve-run>   # ... the methods on the wall clock

Methods, run one after another on every test prompt, in the same order (interleaved, so drifts of
the machine hit them alike), after one untimed warm-up each: single model, naive speculative
decoding, Hugging Face assisted generation, BiLD with the paper's fixed thresholds, BiLD with the
best fixed pair of a grid search on validation prompts, BiLD driven by the trained agent, by any
other SB3 model given (--extra-model) and by the training-free online bandits UCBSpec and EXP3Spec (their settings
chosen on the validation prompts; --no-bandits leaves them out). Writes results.md (also printed), results.json, results.csv,
per_prompt.csv and three plots to the output folder.

Both evaluations check every option before any model loads and exit with an error naming it: counts, load levels
and actions out of range, an --out that cannot be written or already holds results (--force replaces them), a
model file that is damaged or of the other env (a BiLD-v1 run given to --env serve, or the reverse), and settings
that would change what an agent's observation means (e.g. --max-batch other than its run's). Nothing that is not
a finite number is ever printed or written: an evaluation with nothing to measure exits with an error.

The code is ``agents.bild.comparison`` (``EvalConfig``: every option and default; ``evaluate``); this
file is only the entry point, so that nothing imports a top-level module named ``evaluate`` (the
name of Hugging Face's evaluation package).
"""

import sys

if __name__ == "__main__":
    from agents.commands import evaluate_main as main
    from bild_env.command import run_command

    sys.exit(run_command("evaluate.py", main))
