"""The evaluator of ``python evaluate.py``, one for every env.

``evaluate.py`` (``agents.commands.evaluate_main``) picks the evaluation by ``--env`` (or by the spec of the run
``--model`` names) and, for the serving env, its mode: ``agents.bild.comparison.Comparison`` (BiLD-v1: every method
on the same test prompts, on the wall clock), ``agents.serve.evaluation.ServingEvaluation`` (BiLD-Serve-v0: the rules
and agents per load level, under the cost model) or ``agents.serve.load_clock.ClockEvaluation`` (the same methods
on real models and the wall clock). ``evaluate`` runs one, the same for all:

1. every option checked before any model loads (``check``, or when the evaluation is made from its command line);
2. ``run``: the measurement, what it finishes kept as it goes;
3. ``write``: the whole report written (beside the run evaluated, or at ``--out``) and printed.

Ctrl-C or SIGTERM (``bild_env.command.run_command`` turns the latter into Ctrl-C) ends it with what it finished
kept, marked ``"complete": false`` (``stopped``): a ``bild_env.command.Stopped``, exit status 130. A model that
cannot run here (a ``ConfigError``) ends it with an error.
"""

from __future__ import annotations

from bild_env.command import Stopped, signal_name


class Evaluation:
    """What one evaluation differs in: a subclass is made from its options (or ``from_argv``: parsed and checked)
    and gives the steps ``evaluate`` calls in order."""

    prog = "evaluate.py"

    @classmethod
    def from_argv(cls, argv: list[str] | None, **defaults) -> Evaluation:
        """The evaluation of a command line (``evaluate.py``'s, ``--env`` taken off); exits with a usage message on
        bad options."""
        raise NotImplementedError

    def check(self) -> None:
        """Every option, before any model loads (a clear exit otherwise)."""

    def run(self) -> dict:
        """The measurement: its report."""
        raise NotImplementedError

    def write(self, report: dict) -> None:
        """The whole report, written and printed."""
        raise NotImplementedError

    def stopped(self, name: str) -> Stopped:
        """Stopped by signal ``name`` during ``run`` or ``write``: what was finished written, the ``Stopped`` to raise
        saying what is kept and what to run."""
        return Stopped(f"stopped by {name} before any result was written: run the same command again")

    def close(self) -> None:
        """On every path out of ``evaluate``."""


def evaluate(evaluation: Evaluation) -> dict:
    """Check, run and write ``evaluation`` (the module's steps): its report."""
    from agents.config import ConfigError

    try:
        evaluation.check()
        report = evaluation.run()
        evaluation.write(report)
        return report
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM under run_command
        raise evaluation.stopped(signal_name(err)) from None
    except ConfigError as err:  # a model that cannot run here (agents.common.trained.load_agent)
        raise SystemExit(f"error: {err}") from None
    finally:
        evaluation.close()
