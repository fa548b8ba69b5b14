"""Sweeps: which points of a grid to launch and the job that runs one (``launch``), claims that keep two
sweeps from running a point twice (``claims``), the store of one row file per point (``store``), and what a
sweep says while it runs (``progress``).

May import: harness.spec, harness.estimate, harness.runner (the job imports the runner only when it runs
a point); never Hydra (the CLI composes the configs) and never torch at import time.
"""
