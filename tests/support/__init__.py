"""Helpers shared by the test suites (imported as ``support``; pytest puts ``tests/`` on
``sys.path`` because ``tests/`` itself is not a package).

- :mod:`support.models`: the tiny random model's shape and the engine sizes suites use.
- :mod:`support.requests`: requests that run until aborted, and bounded waits.
- :mod:`support.threads`: the engine threads alive in this process.
- :mod:`support.bench`: a bench report with no runs, for the report format's tests.

The fixtures built on them (``tiny_model_factory``, ``tiny_model``, ``make_engine``,
``one_torch_thread``) live in ``tests/conftest.py``.
"""
