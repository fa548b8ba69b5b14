# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Memory calibration of a harness study
#
# Load a results directory (one parquet row per run), judge the analytical estimators against the
# measured peaks, refit the calibration on held-out folds, and draw the figures. Open it with
# `jupytext --to notebook notebooks/analysis.py` or run it as a script:
#
#     HARNESS_RESULTS_DIR=results/cpu_study python notebooks/analysis.py
#
# `HARNESS_NOTEBOOK_OUT` names where the figures go (default: a `notebook_figures/` folder next to the
# results).

# %%
import os
from pathlib import Path

import pandas as pd

from harness.analysis.calibrate import evaluate
from harness.analysis.plots import all_figures, world_of
from harness.analysis.report import layout_label
from harness.sweep.store import load_results

try:  # in Jupyter (IPython) tables and figures are shown inline; as a script they are printed
    from IPython import get_ipython
    from IPython.display import Image, display

    INLINE = get_ipython() is not None
except ImportError:
    INLINE = False


def show(obj):
    """A table or figure inline in Jupyter; its text (a table) or nothing (a figure) as a script."""
    if INLINE:
        display(obj)
    elif hasattr(obj, "to_string"):
        print(obj.to_string())


RESULTS_DIR = Path(os.environ.get("HARNESS_RESULTS_DIR", "results/cpu_study"))
OUT = Path(os.environ.get("HARNESS_NOTEBOOK_OUT", RESULTS_DIR / "notebook_figures"))
frame, unreadable = load_results(RESULTS_DIR)
print(f"{len(frame)} runs from {RESULTS_DIR}; unreadable files: {unreadable or 'none'}")
show(frame["status"].value_counts())

# %% [markdown]
# ## Outcomes by world size
# Impossible layouts are rows too (`invalid`), so that the study's accounting adds up.

# %%
ran = frame[frame["status"] != "invalid"]
show(pd.crosstab(world_of(ran), ran["status"], margins=True))

# %% [markdown]
# ## Each estimator on held-out runs
# The calibrated estimator is fitted with the run's world size held out (GroupKFold); the raw engines
# need no fit. APE = |predicted - measured| / measured; the safe threshold is the largest predicted
# utilisation below which no run ran out of memory.

# %%
ev = evaluate(frame, engine="torch", group_by="world")
metrics = pd.DataFrame(ev.metrics).T
print(metrics[["median_ape", "p95_ape", "max_under_prediction", "safe_threshold", "excluded_at_safe"]])
print("calibrated:", ev.model.describe())

# %% [markdown]
# ## The largest errors of the raw torch engine, by layout
# Where the analytical terms miss most is where a new term (or a runner fix) is worth looking for.

# %%
measured = ev.data.frame.loc[ev.data.measured].copy()
measured["torch_error"] = ev.predictions["torch"][ev.data.measured] / measured["peak_allocated_bytes"] - 1
measured["calibrated_error"] = (
    ev.predictions["calibrated"][ev.data.measured] / measured["peak_allocated_bytes"] - 1
)
measured["layout"] = measured.apply(layout_label, axis=1)
worst = measured.reindex(measured["torch_error"].abs().sort_values(ascending=False).index)
print("the ten largest errors of the raw torch engine (predicted / measured - 1):")
show(worst[["model_name", "layout", "train_seq_len", "torch_error", "calibrated_error"]].head(10))

# %% [markdown]
# ## Figures
# Predicted vs measured (log axes, ±10 % band, device capacity dashed), out of memory against
# utilisation (0.5-1.3), coefficients around 1 and residuals, throughput by tp × pp (a colour scale per
# panel). Shown inline in Jupyter; as a script, the paths are printed.

# %%
figures = all_figures(ev, frame, OUT)
for name, paths in figures.items():
    print(name, "->", paths[0])
    if INLINE:
        show(Image(filename=str(paths[0])))
