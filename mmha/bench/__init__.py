"""The benchmark harness: ``python -m mmha.bench`` (kernel against peers, ``cli``), the
whole-step benchmark (``python -m mmha.bench.step``), the dispatcher's sweep
(``python -m mmha.bench.sweep``); ``timing`` says how calls are timed, ``floor`` measures what a
pure read of the same bytes costs, ``methods`` holds mmha and the peers, ``report`` the summaries,
the speed bar, tables and plots."""

from .cli import main

__all__ = ["main"]
