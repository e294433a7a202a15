# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # The committed study results
#
# Every study in `configs/studies/` was run with `python -m jaxcomp.study run NAME` and its
# report committed under `docs/results/NAME/`. This notebook loads those reports (nothing is
# trained here), prints the verdict table and each study's table, and shows the plots.

# %%
import csv
import pathlib

from IPython.display import Image
from IPython.display import Markdown
from IPython.display import display

import jaxcomp

RESULTS = pathlib.Path(jaxcomp.__file__).parents[1] / "docs" / "results"
studies = sorted(p.parent.name for p in RESULTS.glob("*/report.csv"))
print(len(studies), "studies:", ", ".join(studies))

# %% [markdown]
# ## The verdicts

# %%
readme = (RESULTS / "README.md").read_text()
table = [line for line in readme.splitlines() if line.startswith("|")]
display(Markdown("\n".join(table)))

# %% [markdown]
# ## Accuracy against bytes, per study
#
# Final test accuracy (compression on at evaluation where the mode has it, mean over seeds)
# against bytes per step, read from each `report.csv`.

# %%
for name in studies:
    with open(RESULTS / name / "report.csv") as f:
        rows = list(csv.DictReader(f))
    print(f"\n{name}")
    for r in rows:
        acc = r.get("final_acc_on") or r.get("final_acc_off") or "-"
        acc = f"{float(acc):.3f}" if acc != "-" else acc
        kib = f"{float(r['wire_bytes']) / 1024:8.1f} KiB" if r.get("wire_bytes") else "   - KiB"
        print(f"  {r['variant']:24s} {r.get('optimizer', ''):5s} acc {acc}  {kib}")

# %% [markdown]
# ## The plots

# %%
for name in studies:
    for png in ("accuracy_vs_bytes.png", "state.png"):
        path = RESULTS / name / png
        if path.is_file():
            display(Markdown(f"**{name}**: `{png}`"))
            display(Image(filename=str(path)))
