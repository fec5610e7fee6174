"""Reports: run directories -> one markdown table per experiment, and PNG plots.

Implementation behind the public module :mod:`attnjax.train.report`.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional, Sequence

import numpy as np

from attnjax._src.train import encoder_report, rundir
from attnjax._src.train.plots import save_figure, subplots

# Probe keys as attnjax.nn.layer_stats names them, with fallbacks for older names.
_SINK_KEYS = ("sink_rate/rate",)
_MACT_KEYS = ("massive/m_act",)
_FATTN_KEYS = ("f_attn/f_attn",)


def find_runs(root: str) -> list[str]:
  """Run directories (folders holding ``summary.json``) under ``root``, sorted.

  Args:
    root: a folder of runs, e.g. ``runs/compare``.

  Returns:
    Their paths.
  """
  out = []
  for dirpath, _, files in os.walk(root):
    if "summary.json" in files and "checkpoints" not in dirpath:
      out.append(dirpath)
  return sorted(out)


def _first(d: dict, keys: Sequence[str]) -> Optional[float]:
  for k in keys:
    if d.get(k) is not None:
      return d[k]
  return None


def row_of(run_path: str, root: str) -> dict:
  """One report row from a run directory.

  Args:
    run_path: the run directory.
    root: the report's root (the row's ``arm`` is the path relative to it).

  Returns:
    A dict of the summary's and the config's values (variant, LR, status, losses,
    statistics, timings; None where the run recorded none).
  """
  run = rundir.RunDir(run_path)
  s = run.read_summary() or {}
  cfg = rundir.read_json(run.config) or {}
  probe = s.get("probe") or {}
  return {
    "arm": os.path.relpath(run_path, root),
    "variant": s.get("variant", cfg.get("variant")),
    "lr": (cfg.get("opt") or {}).get("lr"),
    "status": s.get("status", "?"),
    "diverged_step": s.get("diverged_step"),
    "steps": s.get("steps_done"),
    "initial_loss": s.get("initial_loss"),
    "final_train_loss": s.get("final_train_loss"),
    "val_loss": s.get("val_loss"),
    "val_bpc": s.get("val_bpc"),
    "unit": s.get("unit") or "char",
    "max_logit": s.get("max_logit"),
    "entropy": s.get("entropy"),
    "f_attn": _first(probe, _FATTN_KEYS),
    "sink_rate": _first(probe, _SINK_KEYS),
    "m_act": _first(probe, _MACT_KEYS),
    "spike_score": s.get("spike_score"),
    "tokens_per_s": s.get("tokens_per_s"),
    "log_z": s.get("log_z"),
    "compile_s": s.get("compile_s"),
    "train_time_s": s.get("train_time_s"),
    "error": s.get("error"),
  }


def _fmt(x: Any, digits: int = 3) -> str:
  if x is None or (isinstance(x, float) and not math.isfinite(x)):
    return "-"
  if isinstance(x, float):
    if abs(x) >= 1e4 or (abs(x) < 1e-3 and x != 0):
      return f"{x:.2e}"
    return f"{x:.{digits}f}"
  return str(x)


def significant(x: Any, digits: int = 2) -> str:
  """``x`` to ``digits`` significant digits; ``"-"`` for None or a non-finite value.

  For masses that may be small: softmax_one's null mass of 0.001-0.002 reads ``0.0015``, where
  two decimals would show ``0.00``.

  >>> significant(0.0015), significant(0.25), significant(None)
  ('0.0015', '0.25', '-')

  Args:
    x: a number or None.
    digits: significant digits.

  Returns:
    The text.
  """
  if x is None or not math.isfinite(float(x)):
    return "-"
  return f"{float(x):.{digits}g}"


COLUMNS = (
  ("variant", "variant"),
  ("lr", "LR"),
  ("initial_loss", "initial loss"),
  ("val_loss", "val loss"),
  ("val_bpc", "BPC"),
  ("diverged", "diverged?"),
  ("max_logit", "max logit"),
  ("entropy", "entropy"),
  ("f_attn", "F-Attn"),
  ("sink_rate", "Sink_1^0.3 (%)"),
  ("m_act", "M-Act"),
  ("spike_score", "spike score (%)"),
  ("tokens_per_s", "tokens/s"),
)


def markdown_table(rows: list[dict], *, columns=COLUMNS) -> str:
  """A markdown table of report rows (the "diverged?" column shows the step).

  Args:
    rows: :func:`.row_of` dicts.
    columns: ``(key, header)`` pairs.

  Returns:
    The table, one line per row.
  """
  lines = [
    "| " + " | ".join(title for _, title in columns) + " |",
    "|" + "|".join("---" if k == "variant" else "---:" for k, _ in columns) + "|",
  ]
  for r in rows:
    cells = []
    for key, _ in columns:
      if key == "diverged":
        cells.append(
          f"yes (step {r['diverged_step']})"
          if r["status"] == "diverged"
          else ("no" if r["status"] == "finished" else r["status"])
        )
      elif key == "variant":
        cells.append(
          str(r["variant"]) if r["arm"] in (r["variant"], None) else f"{r['variant']} ({r['arm']})"
        )
      elif key == "lr":
        cells.append(f"{r['lr']:g}" if r["lr"] is not None else "-")
      elif key == "tokens_per_s":
        cells.append(f"{r[key]:.0f}" if r[key] else "-")
      else:
        cells.append(_fmt(r.get(key)))
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def _train_records(run_path: str) -> list[dict]:
  return [r for r in rundir.read_jsonl(rundir.RunDir(run_path).metrics) if r.get("kind") == "train"]


def _layer_max(r: dict, key: str) -> float:
  values = [v for v in map(rundir.finite_or_none, r.get(key) or []) if v is not None]
  return max(values) if values else float("nan")


def plot_curves(root: str, runs: list[str], out_dir: str) -> list[str]:
  """Loss, max attention logit and F-Attn against step, one line per run.

  Args:
    root: the report's root (labels are paths relative to it).
    runs: run directories.
    out_dir: the folder the PNGs are written to.

  Returns:
    The paths of the PNGs written.
  """
  paths = []
  panels = (
    ("loss", "training loss (nats)", "cross-entropy (nats)", lambda r: r["loss"], "log"),
    (
      "max_logit",
      "max attention logit (max over layers)",
      "max logit q.k * scale",
      lambda r: _layer_max(r, "max_logit"),
      "log",
    ),
    (
      "f_attn",
      "F-Attn (mean over layers)",
      "attention weight on the first token",
      lambda r: float(
        np.nanmean([v if v is not None else np.nan for v in r.get("f_attn") or [np.nan]])
      ),
      "linear",
    ),
    (
      "log_z",
      "mean log Z of the output logits (drift)",
      "log Z (nats)",
      lambda r: r["log_z"] if r.get("log_z") is not None else np.nan,
      "linear",
    ),
  )
  for name, title, ylabel, get, yscale in panels:
    fig, ax = subplots(figsize=(7, 4.5))
    for run in runs:
      recs = _train_records(run)
      if not recs:
        continue
      with np.errstate(all="ignore"):
        y = np.asarray([get(r) if r.get("loss") is not None else np.nan for r in recs], float)
      ax.plot([r["step"] for r in recs], y, lw=0.9, label=os.path.relpath(run, root))
    ax.set(xlabel="step", ylabel=ylabel, title=title, yscale=yscale)
    if ax.lines:
      ax.legend(fontsize=7)
    path = os.path.join(out_dir, f"{name}.png")
    save_figure(fig, path)
    paths.append(path)
  return paths


PROBE_PANELS = (
  ("sink_rate/rate", "Sink_1^0.3 (%) on probe sequences", "heads with sink (%)"),
  ("f_attn/f_attn", "F-Attn on probe sequences", "attention weight on the first token"),
  ("massive/m_act", "M-Act (mean over layers of max |h|)", "max |hidden state|"),
)


def plot_probes(root: str, runs: list[str], out_dir: str) -> list[str]:
  """Sink statistics of the probes against training step, one line per run.

  Args:
    root: the report's root.
    runs: run directories.
    out_dir: the folder the PNGs are written to.

  Returns:
    The paths of the PNGs written.
  """
  paths = []
  for key, title, ylabel in PROBE_PANELS:
    fig, ax = subplots(figsize=(7, 4.5))
    for run in runs:
      recs = [r for r in rundir.read_jsonl(rundir.RunDir(run).probes) if r.get(key) is not None]
      if recs:
        ax.plot(
          [r["step"] for r in recs],
          [r[key] for r in recs],
          "o-",
          ms=3,
          lw=0.9,
          label=os.path.relpath(run, root),
        )
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    if ax.lines:
      ax.legend(fontsize=7)
    path = os.path.join(out_dir, "probe_" + key.split("/")[0] + ".png")
    save_figure(fig, path)
    paths.append(path)
  return paths


def write_report(
  root: str, *, title: Optional[str] = None, extra: str = "", order: Sequence[str] = ()
) -> str:
  """Writes ``root/report.md`` and ``root/plots/*.png``.

  Args:
    root: a folder of run directories.
    title: the report's heading (default: the folder).
    extra: markdown added after the table.
    order: run folders (relative to ``root``) to put first, in that order.

  Returns:
    The markdown.
  """
  runs = find_runs(root)
  rank = {name: i for i, name in enumerate(order)}
  runs.sort(key=lambda r: (rank.get(os.path.relpath(r, root), len(rank)), r))
  rows = [row_of(r, root) for r in runs]
  plots = (
    (
      plot_curves(root, runs, os.path.join(root, "plots"))
      + plot_probes(root, runs, os.path.join(root, "plots"))
    )
    if runs
    else []
  )
  unit = rows[0]["unit"] if rows else "char"
  probe_lens = sorted({_probe_len(r) for r in runs} - {None})
  probe_len = "/".join(str(n) for n in probe_lens) or "64"
  text = [
    f"# {title or os.path.basename(os.path.abspath(root))}\n",
    f"{len(rows)} run(s) under `{root}`. Val loss in nats per token; BPC = bits per "
    f"{unit}; max logit, entropy: last training step (max / mean over layers); F-Attn, "
    f"Sink_1^0.3, M-Act: last probe (length-{probe_len} held-out sequences).\n",
    markdown_table(rows),
  ]
  failed = [r for r in rows if r["status"] == "failed"]
  for r in failed:
    text.append(f"\n`{r['arm']}` failed:\n```\n{(r['error'] or '').strip()}\n```\n")
  encoders, encoder_plots = encoder_report.section(runs, os.path.join(root, "plots"))
  if encoders:
    text.append("\n" + encoders)
    plots = plots + encoder_plots
  if extra:
    text.append("\n" + extra)
  text.append(
    "\n" + "\n".join(f"![{os.path.basename(p)}]({os.path.relpath(p, root)})" for p in plots) + "\n"
  )
  markdown = "\n".join(text)
  rundir.write_atomic(os.path.join(root, "report.md"), markdown)
  return markdown


# ---------------------------------------------------------------------------
# LR sweeps (Wortsman et al. 2023, sec. 2.2).


def lr_sweep_rows(rows: list[dict]) -> list[dict]:
  """Per variant: LR sensitivity, max stable LR and best loss over its LR grid.

  Args:
    rows: :func:`.row_of` dicts of an LR sweep (several LRs per variant).

  Returns:
    One dict per variant: ``variant``, ``num_lrs``, ``lr_sensitivity`` and
    ``max_stable_lr`` (:mod:`attnjax.train.metrics`), ``best_val_loss``, ``best_lr``,
    ``diverged_lrs``.
  """
  from attnjax._src.train import metrics as run_metrics

  out = []
  for variant in sorted({r["variant"] for r in rows if r["variant"]}):
    runs = sorted(
      (
        r
        for r in rows
        if r["variant"] == variant and r["lr"] and r["status"] in ("finished", "diverged")
      ),
      key=lambda r: r["lr"],
    )
    if not runs or any(r["initial_loss"] is None for r in runs):
      continue
    lrs = [r["lr"] for r in runs]
    final = [r["val_loss"] if r["val_loss"] is not None else float("nan") for r in runs]
    loss_0 = [r["initial_loss"] for r in runs]
    best = min(runs, key=lambda r: r["val_loss"] if r["val_loss"] is not None else float("inf"))
    out.append(
      {
        "variant": variant,
        "num_lrs": len(runs),
        "lr_sensitivity": run_metrics.lr_sensitivity(lrs, final, loss_0),
        "max_stable_lr": run_metrics.max_stable_lr(
          lrs, final, loss_0, diverged=[r["status"] == "diverged" for r in runs]
        ),
        "best_val_loss": best["val_loss"],
        "best_lr": best["lr"],
        "diverged_lrs": [r["lr"] for r in runs if r["status"] == "diverged"],
        "max_logit_at_max_lr": runs[-1]["max_logit"],
      }
    )
  return out


def lr_sweep_table(summary: list[dict]) -> str:
  """The markdown table of :func:`.lr_sweep_rows`.

  Args:
    summary: its dicts.

  Returns:
    The table.
  """
  lines = [
    "| variant | LRs | LR sensitivity | max stable LR | best val loss | best LR | diverged at LR |",
    "|---|---:|---:|---:|---:|---:|---|",
  ]
  for s in summary:
    lines.append(
      f"| {s['variant']} | {s['num_lrs']} | {_fmt(s['lr_sensitivity'])} | "
      f"{'-' if s['max_stable_lr'] is None else format(s['max_stable_lr'], 'g')} | "
      f"{_fmt(s['best_val_loss'])} | {s['best_lr']:g} | "
      f"{', '.join(f'{x:g}' for x in s['diverged_lrs']) or '-'} |"
    )
  return "\n".join(lines) + "\n"


def plot_lr_sweep(rows: list[dict], root: str, out_dir: str) -> list[str]:
  """``loss_vs_lr.png`` and, per variant, max logit against step.

  Diverged runs are drawn at their initial loss (Wortsman et al.'s convention).

  Args:
    rows: :func:`.row_of` dicts of an LR sweep.
    root: the sweep's root.
    out_dir: the folder the PNGs are written to.

  Returns:
    The paths of the PNGs written.
  """
  paths = []
  fig, ax = subplots(figsize=(7, 4.5))
  for variant in sorted({r["variant"] for r in rows if r["variant"]}):
    runs = sorted((r for r in rows if r["variant"] == variant and r["lr"]), key=lambda r: r["lr"])
    lrs = [r["lr"] for r in runs]
    y = [
      r["val_loss"] if r["val_loss"] is not None else (r["initial_loss"] or np.nan) for r in runs
    ]
    (line,) = ax.plot(lrs, y, "o-", label=variant)
    bad = [(r["lr"], yy) for r, yy in zip(runs, y) if r["status"] == "diverged"]
    if bad:
      ax.plot(*zip(*bad), "x", ms=10, color=line.get_color())
  ax.set(
    xscale="log",
    xlabel="peak learning rate",
    ylabel="final val loss (x: diverged, at loss_0)",
    title="loss vs learning rate",
  )
  ax.legend(fontsize=8)
  path = os.path.join(out_dir, "loss_vs_lr.png")
  save_figure(fig, path)
  paths.append(path)
  for variant in sorted({r["variant"] for r in rows if r["variant"]}):
    fig, ax = subplots(figsize=(7, 4.5))
    for r in sorted(
      (r for r in rows if r["variant"] == variant and r["lr"]), key=lambda r: r["lr"]
    ):
      recs = _train_records(os.path.join(root, r["arm"]))
      ax.plot(
        [x["step"] for x in recs],
        [_layer_max(x, "max_logit") for x in recs],
        lw=0.9,
        label=f"lr={r['lr']:g}" + (" (diverged)" if r["status"] == "diverged" else ""),
      )
    ax.set(
      xlabel="step",
      ylabel="max attention logit (max over layers)",
      yscale="log",
      title=f"{variant}: max attention logit vs step",
    )
    if ax.lines:
      ax.legend(fontsize=7)
    path = os.path.join(out_dir, f"max_logit_{variant}.png")
    save_figure(fig, path)
    paths.append(path)
  return paths


def write_lr_sweep_report(root: str, *, title: Optional[str] = None) -> str:
  """:func:`.write_report` plus the LR-sensitivity table and the LR plots.

  Args:
    root: an LR sweep's root.
    title: the report's heading.

  Returns:
    The markdown.
  """
  rows = [row_of(r, root) for r in find_runs(root)]
  summary = lr_sweep_rows(rows)
  plots = plot_lr_sweep(rows, root, os.path.join(root, "plots")) if rows else []
  extra = (
    "## LR sensitivity (Wortsman et al. 2023, sec. 2.2)\n\n"
    "Sensitivity = mean over the LR grid of min(final val loss, loss_0) - best; "
    "a diverged run counts as loss_0. Max stable LR: largest LR that neither diverged "
    "nor ended above loss_0.\n\n"
    + lr_sweep_table(summary)
    + "\n"
    + "\n".join(f"![{os.path.basename(p)}]({os.path.relpath(p, root)})" for p in plots)
    + "\n"
  )
  rundir.write_json(os.path.join(root, "lr_sensitivity.json"), summary)
  return write_report(root, title=title, extra=extra)


def _probe_len(run_path: str):
  """The run's ``train.probe_len`` from its ``config.json`` (None if unreadable)."""
  try:
    with open(rundir.RunDir(run_path).config) as f:
      return int(json.load(f)["train"]["probe_len"])
  except (OSError, ValueError, KeyError, TypeError):
    return None
