"""Write notebooks/01..03 with nbformat (outputs cleared). Run: python build_notebooks.py /work/main/notebooks"""

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

SETUP = '''\
import os
from pathlib import Path

import numpy as np
import pandas as pd
import xarray as xr
import seaborn as sns
import matplotlib.pyplot as plt

from submerge.diagnostics import plot  # the "base · fine-tunes" line of the figures' titles
from submerge.diagnostics.groups import check_store
from submerge.diagnostics.tables import long_frame, ordered

pd.set_option("display.precision", 4)
STORE = Path(os.environ.get("SUBMERGE_STORE", "runs/demo.zarr"))
if not STORE.exists() and (Path("..") / STORE).exists():  # notebook opened from notebooks/
    STORE = Path("..") / STORE
if not STORE.exists():
    raise FileNotFoundError(f"no store at {STORE}: build the example with "
                            "`python notebooks/make_example_store.py --out runs/demo.zarr`, "
                            "or point SUBMERGE_STORE at your own store")
from submerge.diagnostics.store import Store

hint = Store(STORE).consolidation_hint()
if hint:  # a store written before submerge consolidated its metadata, or changed by hand
    print("note:", hint)
try:
    tree = xr.open_datatree(STORE, engine="zarr")  # the consolidated metadata: one file read, no warning
except Exception:  # older xarray: go through the toolkit's reader
    tree = Store(STORE).open()
groups = sorted(node.path for node in tree.subtree if node.has_data)
print(f"store {STORE}\\nbase model: {(tree.attrs.get('base_model') or {}).get('spec')}\\ngroups: {groups}")
for note in check_store(STORE):  # groups of a run that stopped half-way, absent chunks
    print("partial data:", note)'''


def notebook(cells):
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


md, code = new_markdown_cell, new_code_cell

linearity = notebook([
    md("# 01 · How linear are the fine-tuning updates, submodule by submodule?\n\n"
       "The **Non-linearity Score** (seed 002, Eq. 19) walks a fine-tune's task vector from the base, "
       "θ_k = θ0 + (k/N)τ, and measures how far the module's outputs F_k stray from a straight line: "
       "0 means perfectly linear. The **Projection Distance** (Eq. 8) asks whether merging several "
       "task vectors moves a module's output along the sum of their separate effects (0 = yes).\n\n"
       "Set `SUBMERGE_STORE` to the store written by `diag linearity` / `diag projection` "
       "(default `runs/demo.zarr`, made by `notebooks/make_example_store.py` on a toy model)."),
    code(SETUP),
    md("## Mean ± std per level (seed 002 Table 17)\n\n"
       "Each cell averages every module of a level and every sample. Modules a fine-tune did not change "
       "score NaN and are left out (flag `unchanged`). The reference column is the paper's Llama-2-7B "
       "result; the claim to check on any model is **model ≫ layer ≥ MLP > attention**."),
    code('''\
# each store group's owner has its layout, its summary table (what `diag linearity` and `diag report` print)
# and its figures
from submerge.diagnostics.linearity.nonlinearity import LINEARITY, nonlinearity_by_level, nonlinearity_per_layer
from submerge.diagnostics.linearity.projection import (PROJECTION, projection_multi, projection_pairs,
                                                      projection_per_layer)

linearity = tree["linearity"].to_dataset()
about = plot.describe(dict(tree.attrs), linearity)
scores = long_frame(linearity.nonlinearity_score).dropna(subset=["nonlinearity_score"])
summary = LINEARITY.summary(linearity)  # mean and std per level (rows) and task
table = pd.DataFrame({task: summary[(task, "mean")].map("{:.3g}".format) + " ± "
                      + summary[(task, "std")].map("{:.2g}".format) for task in map(str, linearity.task.values)})
table["Llama-2-7B (Table 17)"] = pd.Series({"model": "2.76 ± 0.34", "layer": "0.16", "attn": "0.023", "mlp": "0.20"})
print(f"{int(linearity.unchanged.sum())} (task, module) pairs were unchanged by their fine-tune")
table'''),
    code('''\
level_means = scores.groupby("level").nonlinearity_score.mean().reindex(ordered(scores.level))
order = [level for level in ("model", "layer", "mlp", "attn") if level in level_means.index]
print("mean score per level:", ", ".join(f"{level} {level_means[level]:.3g}" for level in order))
holds = all(level_means[a] >= level_means[b] for a, b in zip(order, order[1:]))
print("model ≥ layer ≥ MLP ≥ attention holds here:", holds)'''),
    md("## Where along the depth?\n\n"
       "Each panel is one kind of submodule; a line is one fine-tune (median over samples, band = "
       "interquartile range; heads pool every head of the layer). Dashed lines are the whole model's "
       "score: the gap between them and the submodule lines is why merging submodule by submodule works."),
    code('fig = nonlinearity_per_layer(linearity, about)'),
    md("## Attention vs MLP\n\n"
       "The distributions over all modules and samples, then a per-layer comparison: in how many layers is "
       "the MLP less linear than the attention block of the same layer?"),
    code('fig = nonlinearity_by_level(linearity, about)'),
    code('''\
per_layer = (scores[scores.level.isin(["attn", "mlp"])]
             .groupby(["task", "layer", "level"]).nonlinearity_score.mean().unstack("level"))
if {"attn", "mlp"} <= set(per_layer.columns):
    per_layer["mlp / attn"] = per_layer["mlp"] / per_layer["attn"]
    share = (per_layer["mlp"] > per_layer["attn"]).groupby("task").mean()
    print("share of layers where MLP > attention:", share.map("{:.0%}".format).to_dict())
per_layer'''),
    md("## Projection Distance over the α grid\n\n"
       "For each pair of fine-tunes the merged update θ0 + α₁τ₁ + α₂τ₂ is compared with the sum of the "
       "separate output changes. Low values everywhere in a level's panel mean that level can be merged "
       "with per-module weights α without leaving the linear regime."),
    code('''\
if "projection" in tree.children:
    projection = tree["projection"].to_dataset()
    display(PROJECTION.summary(projection))  # the table of `diag projection`
    fig = projection_pairs(projection, plot.describe(dict(tree.attrs), projection))
else:
    projection = None
    print("no group 'projection' in this store: run `diag projection ... --out STORE` to add it")'''),
    code('''\
if projection is not None:
    fig = projection_per_layer(projection, plot.describe(dict(tree.attrs), projection))
    multi = projection_multi(projection, plot.describe(dict(tree.attrs), projection))
    if multi is None:
        print("no subset of three or more fine-tunes in this store")'''),
    md("**Reading.** Submodule scores far below the model's, and small Projection Distances at the "
       "attention/MLP level, are what justify solving α per submodule; notebook 03 turns these numbers "
       "into the choice of merge granularity."),
])

interference = notebook([
    md("# 02 · Where do the task matrices interfere?\n\n"
       "Weight-space diagnostics need no data: for every 2-D weight matrix and the task matrices "
       "Δ_t = W_t − W_0 the store holds **STI** (TSV-M's singular task interference; high = the tasks' "
       "singular vectors overlap), **SAR** (Iso-C's subspace alignment ratio to the merged matrix; low = "
       "a task is poorly represented by the merge), **I(k)** (CART's row-space interference at rank "
       "fraction k, on plain and centred task matrices), and per pair the cosine and sign-conflict rate. "
       "Written by `diag interference`."),
    code(SETUP),
    code('''\
# the group's owner: its summary table (what `diag interference` and `diag report` print) and its figures
from submerge.diagnostics.interference.driver import (INTERFERENCE, interference_per_layer, interference_rank,
                                                      matrix_table)

HAVE_INTERFERENCE = "interference" in tree.children
if HAVE_INTERFERENCE:
    interference = tree["interference"].to_dataset().load()
    about = plot.describe(dict(tree.attrs), interference)
    print(f"{interference.sizes['matrix']} matrices, tasks: {list(map(str, interference.task.values))}")
else:
    print("This store has no 'interference' group, so there is nothing to show here.\\n"
          f"Add it with: diag interference --model ... --finetuned ... --out {STORE}")'''),
    md("## One row per matrix, and the means per kind of matrix\n\n"
       "`I(k=0.08)` is taken at CART's reported optimum rank fraction; task metrics are averaged over "
       "tasks and pair metrics over the pairs t < t'; STI/Σσ is TSV-M's STI divided by the kept singular values."),
    code('''\
if HAVE_INTERFERENCE:
    per_matrix = matrix_table(interference)
    display(INTERFERENCE.summary(interference))  # the means per level
    display(per_matrix.head(10))'''),
    md("## Per layer: attention vs MLP\n\n"
       "Colour places each cell between the lowest and highest value of its metric (the numbers are "
       "the values). High STI, I(k) or sign conflict and low SAR mark interference."),
    code('''\
if HAVE_INTERFERENCE:
    fig = interference_per_layer(interference, about)'''),
    code('''\
if HAVE_INTERFERENCE:
    blocks = per_matrix[per_matrix.level.isin(["attn", "mlp"])]
    long = blocks.melt(id_vars=["level", "layer"], var_name="metric", value_name="value")
    grid = sns.catplot(long, x="level", y="value", col="metric", kind="box", sharey=False, col_wrap=4,
                       height=2.8, aspect=0.9, order=["attn", "mlp"])
    grid.set_titles("{col_name}")
    grid.figure.suptitle("attention vs MLP matrices, distribution over matrices", y=1.03)'''),
    md("## Where does interference concentrate?\n\n"
       "The matrices and layers with the highest normalised STI and row-space interference, and how much "
       "of the total STI the top fifth of the layers carries."),
    code('''\
if HAVE_INTERFERENCE:
    i_column = [c for c in per_matrix.columns if c.startswith("I(k=") and "centred" not in c][0]
    display(per_matrix.nlargest(8, "STI/Σσ")[["level", "layer", "STI/Σσ", i_column, "SAR"]])
    layers = per_matrix[per_matrix.layer >= 0].groupby("layer")["STI/Σσ"].sum().sort_values(ascending=False)
    top = max(1, len(layers) // 5)
    print(f"top {top} of {len(layers)} layers by STI: {list(layers.index[:top])}; "
          f"they hold {layers.iloc[:top].sum() / layers.sum():.0%} of the total normalised STI")'''),
    md("## Row-space interference against the rank\n\n"
       "CART truncates each centred task matrix to a low rank: interference should fall as k grows, "
       "while the reconstruction error R(k) falls too; the knee is where low-rank merging pays."),
    code('''\
if HAVE_INTERFERENCE:
    fig = interference_rank(interference, about)'''),
    md("## Which pairs of fine-tunes collide?\n\nMean cosine and sign-conflict rate over all matrices."),
    code('''\
if HAVE_INTERFERENCE and interference.sizes["task"] > 1:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    for ax, name in zip(axes, ["cosine", "sign_conflict"]):
        pair = interference[name].mean("matrix").to_pandas()
        pair.index, pair.columns = list(map(str, pair.index)), list(map(str, pair.columns))
        sns.heatmap(pair, annot=True, fmt=".3f", cmap="rocket_r", square=True, ax=ax)
        ax.set_title(f"{name}, mean over matrices")
        ax.set_xlabel("task"); ax.set_ylabel("task")'''),
])

choose = notebook([
    md("# 03 · Choose the merge granularity, solve α, merge\n\n"
       "`diag plan` picks the **finest granularity whose levels are all nearly linear**: mean "
       "Non-linearity Score ≤ `NL_MAX` and mean Projection Distance ≤ `PD_MAX`, trying attn-mlp, then "
       "layer, then model (head-mlp only when asked: seed 002 Table 3 finds head level unstable). This "
       "notebook recomputes that decision from the store with pandas, so the thresholds can be explored, "
       "and compares the closed-form α (Eq. 12–14) of each granularity."),
    code(SETUP),
    code('''\
from submerge.diagnostics.evaluate import EVAL, eval_bars
from submerge.diagnostics.linearity.alpha import ALPHA, alpha_heatmap, alpha_objective

NL_MAX = 0.5   # mean Non-linearity Score allowed per level (Table 17: attn 0.023, MLP 0.20, model 2.76)
PD_MAX = 0.2   # mean Projection Distance allowed per level
ORDER = ["attn-mlp", "layer", "model"]            # finest first; "head-mlp" only on request
LEVELS_OF = {"model": ["model"], "layer": ["layer"], "attn-mlp": ["attn", "mlp"], "head-mlp": ["head", "mlp"]}
alphas = {name: tree["alpha"][name].to_dataset() for name in tree["alpha"].children} if "alpha" in tree.children else {}
print("α solved for granularities:", list(alphas) or "none")'''),
    md("## What this store holds, and what the plan still needs\n\n"
       "The README's first command (`diag linearity ... --out runs/demo.zarr`) writes only the group "
       "`linearity`. The decision below needs it (and uses `projection` when present); a plan and a merge "
       "also need the closed-form α of the chosen granularity (`alpha/<granularity>`, from `diag alpha`). "
       "Each missing group is listed with the command that adds it to this store; the sections below then "
       "show what they can and say what is missing."),
    code('''\
NEEDED = {
    "linearity": ("required: the Non-linearity Score per level", f"diag linearity --out {STORE}"),
    "projection": ("optional: adds the Projection Distance test", f"diag projection --out {STORE}"),
    "alpha": ("required for a plan and a merge: α per submodule",
              " && ".join(f"diag alpha --granularity {g} --out {STORE}" for g in ORDER)),
    "eval": ("optional: held-out loss of merged models", f"diag eval --merged planned=merged/ --out {STORE}"),
}
missing = {group: why for group, why in NEEDED.items() if group not in tree.children}
for group, (why, command) in missing.items():
    print(f"missing group '{group}' ({why}).\\n    add it with: {command}")
if not missing:
    print("every group is present")
print("(without --model the commands run on the demo kit; add the --model/--finetuned/--data of your run)")'''),
    md("## Level statistics\n\nMean over every module of a level (and every sample, or every subset and α)."),
    code('''\
stats = pd.DataFrame(index=pd.Index(["model", "layer", "attn", "mlp", "head"], name="level"))
if "linearity" in tree.children:
    nl = long_frame(tree["linearity"].to_dataset().nonlinearity_score)
    stats["nonlinearity_score"] = nl.groupby("level").nonlinearity_score.mean()
if "projection" in tree.children:
    pdist = long_frame(tree["projection"].to_dataset().projection_distance)
    stats["projection_distance"] = pdist.groupby("level").projection_distance.mean()
stats = stats.dropna(how="all")
stats'''),
    md("## The decision\n\nA level fails when its mean score is above a threshold; a granularity is chosen "
       "when all its levels pass and its α are in the store. The model level is the fallback."),
    code('''\
def choose(stats, nl_max=NL_MAX, pd_max=PD_MAX, order=ORDER, available=None):
    reasons = []
    for granularity in order:
        if available is not None and granularity not in available:
            reasons.append(f"{granularity}: no alpha/{granularity} in the store")
            continue
        failing = []
        for level in LEVELS_OF[granularity]:
            nl = stats.get("nonlinearity_score", pd.Series(dtype=float)).get(level, np.nan)
            pdv = stats.get("projection_distance", pd.Series(dtype=float)).get(level, np.nan)
            if np.isnan(nl):
                failing.append(f"no score for {level}")
            elif nl > nl_max:
                failing.append(f"{level} NL {nl:.3g} > {nl_max}")
            if not np.isnan(pdv) and pdv > pd_max:
                failing.append(f"{level} PD {pdv:.3g} > {pd_max}")
        if not failing or granularity == "model":
            reasons.append(f"{granularity}: chosen" + (f" (fallback: {'; '.join(failing)})" if failing else ""))
            return granularity, reasons
        reasons.append(f"{granularity}: rejected ({'; '.join(failing)})")
    return None, reasons


chosen, reasons = choose(stats, available=set(alphas))
print("\\n".join(reasons))
print("→ granularity:", chosen)
if chosen is None:
    print("no granularity can be planned yet: its α are missing. The thresholds alone would choose",
          choose(stats)[0], "— add its α with `diag alpha --granularity", choose(stats)[0], f"--out {STORE}`")'''),
    code('''\
# The same rule under other thresholds: which granularity would be chosen?
grid = pd.DataFrame({pd_max: {nl_max: choose(stats, nl_max, pd_max, available=set(alphas))[0]
                              for nl_max in (0.05, 0.1, 0.25, 0.5, 1.0, 3.0)}
                     for pd_max in (0.05, 0.1, 0.2, 0.4)})
grid = grid.fillna("none available")
grid.index.name, grid.columns.name = "NL_MAX", "PD_MAX"
grid'''),
    code('''\
try:  # cross-check against the toolkit's planner (merge/plan.py), when it is installed
    from submerge.merge.plan import PlanError, choose_granularity
    level_stats = {level: {k: float(v) for k, v in row.dropna().items()} for level, row in stats.iterrows()}
    print("submerge.merge.plan.choose_granularity →",
          choose_granularity(level_stats, nl_max=NL_MAX, pd_max=PD_MAX, available=set(alphas) - {"head-mlp"})[0])
except ImportError as error:
    print("submerge.merge.plan not available:", error)
except PlanError as error:  # the store lacks what the planner needs (see "What this store holds")
    print("submerge.merge.plan cannot plan on this store yet:", error)'''),
    md("## α per granularity\n\nWhite is uniform weighting 1/T; red gives a fine-tune more weight in that "
       "submodule, blue less. Least-squares fallbacks (ill-conditioned systems) are counted in the table."),
    code('''\
# the table `diag alpha` printed for each granularity (per level: mean α, objectives, fallbacks)
if alphas:
    display(pd.concat({name: ALPHA.summary(data) for name, data in alphas.items()}, names=["granularity"]))
else:
    print("no α in this store yet (see above)")'''),
    code('''\
for name, data in alphas.items():
    fig = alpha_heatmap(data, plot.describe(dict(tree.attrs), data))'''),
    code('''\
# Same layer, two granularities: do attention and MLP want different weights than the whole layer?
if {"layer", "attn-mlp"} <= set(alphas):
    layer = alphas["layer"].isel(granularity=0, drop=True).alpha
    parts = alphas["attn-mlp"].isel(granularity=0, drop=True).alpha
    compare = {}
    for module in map(str, parts.module.values):
        layer_name = module.rsplit(".", 1)[0]
        for task in map(str, parts.task.values):
            row = compare.setdefault((layer_name, task), {"layer": float(layer.sel(module=layer_name, task=task))})
            row[module.rsplit(".", 1)[1]] = float(parts.sel(module=module, task=task))
    compare = pd.DataFrame.from_dict(compare, orient="index").rename_axis(["layer", "task"])
    display(compare.head(12))'''),
    md("## Does the solved α beat uniform weights?\n\n"
       "The store keeps the merge objective (Eq. 10, on the replayed module outputs) at the solved α and at "
       "α = 1/T, and the linearised objective (Eq. 22/33) at both. The solved α minimises the linearised "
       "objective by construction; the true objective shows whether linearity held well enough."),
    code('''\
rows = {}
for name, data in alphas.items():
    data = data.isel(granularity=0, drop=True)
    rows[name] = {"objective α": float(data.objective_alpha.sum()), "objective 1/T": float(data.objective_uniform.sum()),
                  "linearised α": float(data.linearized_objective_alpha.sum()),
                  "linearised 1/T": float(data.linearized_objective_uniform.sum())}
if alphas:
    objectives = pd.DataFrame.from_dict(rows, orient="index")
    objectives["reduction"] = 1 - objectives["objective α"] / objectives["objective 1/T"]
    display(objectives)
    fig = alpha_objective(alphas, plot.describe(dict(tree.attrs), next(iter(alphas.values()))))
else:
    print("no alpha group: nothing to compare yet (diag alpha --granularity ... adds one)")'''),
    md("## Evaluation (when the store has an `eval` group)"),
    code('''\
if "eval" in tree.children:
    evaluation = tree["eval"].to_dataset()
    display(EVAL.summary(evaluation))  # the table `diag eval` printed
    fig = eval_bars(evaluation, plot.describe(dict(tree.attrs), evaluation))
else:
    print("no 'eval' group: evaluate merged checkpoints with `diag eval` to compare them here")'''),
    md("## Plan and merge\n\nThe commands that turn this store into a merged Hugging Face checkpoint "
       "(thresholds and other options: `diag plan --help`)."),
    code('''\
plan_granularity = chosen or "auto"
if not alphas:
    print(f"first solve α (see above): diag alpha --granularity {choose(stats)[0] or 'attn-mlp'} --out {STORE}")
print(f"diag plan {STORE} --granularity {plan_granularity} --out plan.yaml   # or --granularity auto")
print("diag merge plan.yaml --out merged/")
print(f"diag report {STORE} --out {STORE.with_suffix('')}-report   # every figure of this notebook as PNG")'''),
])

out = Path(sys.argv[1])
for name, nb in [("01_linearity", linearity), ("02_interference", interference),
                 ("03_choose_granularity_and_merge", choose)]:
    nbformat.validate(nb)
    nbformat.write(nb, out / f"{name}.ipynb")
    print("wrote", out / f"{name}.ipynb")
