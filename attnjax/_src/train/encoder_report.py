"""The encoder study's part of a report: outliers, W8A8 loss and token mass per arm and seed.

Reads the last probe of each masked-LM run (``outliers/...``, ``token_mass/...``, written by
the training loop's encoder probe) and writes a table (mean and spread over the seeds of
each variant) and two plots. Implementation behind :mod:`attnjax.train.report`.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import numpy as np

from attnjax._src.train import rundir
from attnjax._src.train.plots import save_figure, subplots

# (name, header, how a run's last probe gives it)
METRICS = (
  ("inf_norm", "max inf-norm (residual)", lambda p: max(p["outliers/hidden/max_inf_norm"])),
  ("attn_inf_norm", "max inf-norm (attn out)", lambda p: max(p["outliers/attn_out/max_inf_norm"])),
  ("kurtosis", "avg kurtosis (residual)", lambda p: float(np.mean(p["outliers/hidden/kurtosis"]))),
  (
    "delimiter_share",
    "top outliers at delimiters",
    lambda p: float(np.mean(p["outliers/hidden/delimiter_share"])),
  ),
  (
    "first_share",
    "top outliers at [CLS]",
    lambda p: float(np.mean(p["outliers/hidden/first_token_share"])),
  ),
  ("cls_mass", "mass on [CLS]", lambda p: float(np.mean(p["token_mass/cls"]))),
  ("delimiter_mass", "mass on delimiters", lambda p: float(np.mean(p["token_mass/delimiters"]))),
  ("loss", "MLM loss (float)", lambda p: p["outliers/loss"]),
  ("loss_w8a8", "MLM loss (W8A8)", lambda p: p["outliers/loss_w8a8"]),
  ("w8a8_gap", "W8A8 - float", lambda p: p["outliers/loss_w8a8"] - p["outliers/loss"]),
)


def last_probe(run_path: str) -> Optional[dict]:
  """The last probe record of a run that has the encoder probe's keys, else None."""
  probes = [r for r in rundir.read_jsonl(rundir.RunDir(run_path).probes) if "outliers/loss" in r]
  return probes[-1] if probes else None


def _variant(run_path: str) -> str:
  cfg = rundir.read_json(rundir.RunDir(run_path).config) or {}
  return str(cfg.get("variant", os.path.basename(run_path)))


def _seed(run_path: str) -> int:
  cfg = rundir.read_json(rundir.RunDir(run_path).config) or {}
  return int(cfg.get("seed", 0))


def study(runs: list[str]) -> dict[str, dict]:
  """``{variant: {"seeds": [...], metric: [value per seed]}}`` of the encoder runs."""
  out: dict[str, dict] = {}
  for run in runs:
    probe = last_probe(run)
    if probe is None:
      continue
    entry = out.setdefault(_variant(run), {"seeds": [], **{m: [] for m, _, _ in METRICS}})
    entry["seeds"].append(_seed(run))
    for name, _, value in METRICS:
      try:
        entry[name].append(float(value(probe)))
      except (KeyError, TypeError, ValueError):
        entry[name].append(math.nan)
  return out


def _cell(values: list[float]) -> str:
  v = np.asarray(values, float)
  v = v[np.isfinite(v)]
  if not len(v):
    return "-"
  if len(v) == 1:
    return f"{v[0]:.3g}"
  return f"{v.mean():.3g} ± {v.std(ddof=1):.2g}"


def table(results: dict[str, dict]) -> str:
  """Markdown: one row per variant, each metric as mean ± sample std over its seeds."""
  head = "| variant | seeds | " + " | ".join(h for _, h, _ in METRICS) + " |"
  lines = [head, "|---|---:|" + "---:|" * len(METRICS)]
  for variant, entry in results.items():
    cells = [_cell(entry[m]) for m, _, _ in METRICS]
    lines.append(f"| {variant} | {len(entry['seeds'])} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def plot(runs: list[str], out_dir: str) -> list[str]:
  """``encoder_outliers.png`` (max inf-norm of the residual per layer, last probe) and
  ``encoder_w8a8.png`` (MLM loss, float and W8A8, against step), one line per run."""
  paths = []
  fig, ax = subplots(figsize=(7, 4.5))
  fig2, ax2 = subplots(figsize=(7, 4.5))
  for run in runs:
    records = [r for r in rundir.read_jsonl(rundir.RunDir(run).probes) if "outliers/loss" in r]
    if not records:
      continue
    label = f"{_variant(run)} s{_seed(run)}"
    norms = records[-1]["outliers/hidden/max_inf_norm"]
    ax.plot(range(len(norms)), norms, "o-", ms=3, lw=0.9, label=label)
    steps = [r["step"] for r in records]
    line = ax2.plot(steps, [r["outliers/loss"] for r in records], "o-", ms=3, lw=0.9, label=label)
    ax2.plot(
      steps,
      [r["outliers/loss_w8a8"] for r in records],
      "x--",
      ms=4,
      lw=0.9,
      color=line[0].get_color(),
    )
  ax.set(xlabel="layer", ylabel="max |x| of the residual stream", title="Outliers per layer")
  ax2.set(xlabel="step", ylabel="masked-LM loss (o float, x W8A8)", title="Float and W8A8 loss")
  for axis in (ax, ax2):
    if axis.lines:
      axis.legend(fontsize=7)
  for figure, name in ((fig, "encoder_outliers.png"), (fig2, "encoder_w8a8.png")):
    path = os.path.join(out_dir, name)
    save_figure(figure, path)
    paths.append(path)
  return paths


def section(runs: list[str], out_dir: str) -> tuple[str, list[str]]:
  """``(markdown, plots)`` of the encoder study, or ``("", [])`` without encoder runs."""
  results = study(runs)
  if not results:
    return "", []
  text = (
    "## Encoder study (Bondarenko et al. 2023)\n\n"
    "Last probe of each run, mean ± sample std over seeds: max |x| over layers of the "
    "residual stream and the attention output, token kurtosis averaged over layers, the "
    "share of the 100 largest residual entries at delimiters and at [CLS], attention mass "
    "on [CLS] and delimiters (mean over layers and heads), masked-LM loss in float and "
    "with every linear layer's weight and input fake-quantised to 8 bits (per tensor).\n\n"
    + table(results)
  )
  return text, plot(runs, out_dir)
