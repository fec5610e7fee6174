"""Reports: run directories -> one markdown table per experiment, and PNG plots.

Implementation behind the public module :mod:`attnjax.train.report`.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Optional, Sequence

import numpy as np

from attnjax._src.train import arm_report, encoder_report, rundir
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
    statistics, timings; None where the run recorded none), the first and last probe's
    sink metrics (``f_attn_init``, ``first_token``, ...), the seed, ``final_loss`` (a
    diverged run's initial loss) and ``baseline``: uniform attention's metrics at the
    run's probe length and mask (None where its mask is not causal).
  """
  run = rundir.RunDir(run_path)
  s = run.read_summary() or {}
  cfg = rundir.read_json(run.config) or {}
  probe = s.get("probe") or {}
  row = {
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
    "num_params": s.get("num_params"),
    "max_logit_ever": s.get("max_logit_ever"),
  }
  row.update(arm_report.run_extras(run_path, cfg or None))
  row["final_loss"] = arm_report.final_loss(row)
  return row


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


# The report's table of every run: COLUMNS without the training loop's tokens/s (the
# machine's load moves it; the report's throughput is the bare step's, timed interleaved).
RUN_COLUMNS = tuple(c for c in COLUMNS if c[0] != "tokens_per_s")


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


def _by_arm(root: str, runs: list[str]) -> list[tuple[str, list[str]]]:
  """``[(arm label, its runs)]`` in the order of the runs (seeds of one arm together)."""
  out: dict[str, list[str]] = {}
  for run in runs:
    out.setdefault(arm_report.arm_folder(os.path.relpath(run, root)), []).append(run)
  return list(out.items())


def _mean_band(series: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """``(steps, mean, lo, hi)`` over runs of ``{step: value}``: the band is the seeds' range
  (from 5 seeds, the 95% interval of the mean) at each step (runs with a finite value)."""
  steps = sorted({s for d in series for s in d})
  mean, lo, hi = [], [], []
  for s in steps:
    sp = arm_report.spread(d.get(s) for d in series)
    mean.append(np.nan if sp is None else sp.mean)
    lo.append(np.nan if sp is None else sp.band[0])
    hi.append(np.nan if sp is None else sp.band[1])
  return np.asarray(steps), np.asarray(mean), np.asarray(lo), np.asarray(hi)


def _draw(ax, steps, mean, lo, hi, label: str, n: int, marker: str = "") -> None:
  (line,) = ax.plot(
    steps, mean, marker or "-", ms=3, lw=0.9, label=f"{label} ({n} seeds)" if n > 1 else label
  )
  if n > 1:
    ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2, lw=0)


def plot_curves(root: str, runs: list[str], out_dir: str) -> list[str]:
  """Loss, max attention logit, F-Attn and log Z against step: per arm the mean over its
  seeds, with a band of their spread (mean ± spread, as the report's tables).

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
  arms = _by_arm(root, runs)
  records = {run: _train_records(run) for run in runs}
  for name, title, ylabel, get, yscale in panels:
    fig, ax = subplots(figsize=(7, 4.5))
    for label, arm_runs in arms:
      series = []
      for run in arm_runs:
        with np.errstate(all="ignore"):
          series.append(
            {r["step"]: (get(r) if r.get("loss") is not None else np.nan) for r in records[run]}
          )
      if any(series):
        _draw(ax, *_mean_band(series), label, len(arm_runs))
    ax.set(
      xlabel="step", ylabel=ylabel, title=title + " (mean, band: spread over seeds)", yscale=yscale
    )
    if ax.lines:
      ax.legend(fontsize=7)
    path = os.path.join(out_dir, f"{name}.png")
    save_figure(fig, path)
    paths.append(path)
  return paths


PROBE_PANELS = (
  ("sink_rate/rate", "Sink_1^0.3 (%) on probe sequences", "heads with sink (%)"),
  ("f_attn/f_attn", "F-Attn on probe sequences", "attention weight on the first token"),
  (
    "f_attn/raw",
    "first-token weight (rows not renormalised) on probe sequences",
    "attention weight on the first token",
  ),
  ("massive/m_act", "M-Act (mean over layers of max |h|)", "max |hidden state|"),
)


def _probe_png(key: str) -> str:
  return "probe_" + ("first_token" if key == "f_attn/raw" else key.split("/")[0]) + ".png"


def plot_probes(root: str, runs: list[str], out_dir: str) -> list[str]:
  """Sink statistics of the probes against training step: per arm the mean over its seeds
  with error bars of their spread.

  Args:
    root: the report's root.
    runs: run directories.
    out_dir: the folder the PNGs are written to.

  Returns:
    The paths of the PNGs written.
  """
  paths = []
  arms = _by_arm(root, runs)
  probes = {run: rundir.read_jsonl(rundir.RunDir(run).probes) for run in runs}
  for key, title, ylabel in PROBE_PANELS:
    fig, ax = subplots(figsize=(7, 4.5))
    for label, arm_runs in arms:
      series = [
        {r["step"]: r.get(key) for r in probes[run] if r.get(key) is not None} for run in arm_runs
      ]
      if any(series):
        steps, mean, lo, hi = _mean_band(series)
        n = len(arm_runs)
        (line,) = ax.plot(
          steps, mean, "o-", ms=3, lw=0.9, label=f"{label} ({n} seeds)" if n > 1 else label
        )
        if n > 1:
          ax.errorbar(
            steps,
            mean,
            yerr=[mean - lo, hi - mean],
            fmt="none",
            ecolor=line.get_color(),
            capsize=2,
            lw=0.8,
          )
    ax.set(xlabel="step", ylabel=ylabel, title=title + " (mean ± spread over seeds)")
    if ax.lines:
      ax.legend(fontsize=7)
    if not ax.lines:  # a metric the runs do not record (older probes have no raw weight)
      continue
    path = os.path.join(out_dir, _probe_png(key))
    save_figure(fig, path)
    paths.append(path)
  return paths


def plot_summary(arms: list[dict], out_dir: str) -> Optional[str]:
  """``summary.png``: per arm the first-token weight (F-Attn where no raw weight), final loss
  and largest attention logit, mean with error bars of the seed spread; the first panel
  marks uniform attention's value."""
  if not arms:
    return None
  labels = [a["arm"] for a in arms]
  x = np.arange(len(arms))
  fig, axes = subplots(3, 1, figsize=(max(6.0, 0.9 * len(arms) + 2), 10), sharex=True)
  panels = (
    ("first-token weight", lambda a: a["first_token"] or a["f_attn"], "linear"),
    ("final loss (diverged: at init)", lambda a: a["final_loss"], "linear"),
    ("max attention logit (training)", lambda a: a["max_logit_ever"], "log"),
  )
  for ax, (title, get, scale) in zip(axes, panels):
    sp = [get(a) for a in arms]
    mean = np.asarray([np.nan if s is None else s.mean for s in sp])
    err = np.asarray(
      [[0.0, 0.0] if s is None else [s.mean - s.band[0], s.band[1] - s.mean] for s in sp]
    ).T
    ax.errorbar(x, mean, yerr=err, fmt="o", color="tab:blue", capsize=4, lw=1.2, ms=5)
    for xi, s in zip(x, sp):
      if s is not None:
        ax.plot([xi] * s.n, s.values, "k.", ms=3)
    if title.startswith("first"):
      base = [a["baseline"]["first_token"] if a["baseline"] else np.nan for a in arms]
      ax.plot(x, base, "r_", ms=14, mew=2, label="uniform attention")
      ax.set_ylim(bottom=0)
      ax.legend(fontsize=7)
    ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    ax.set_xlim(-0.5, len(arms) - 0.5)
    ax.set_yscale(scale)
    ax.set_title(title, fontsize=9)
  fig.suptitle(
    "mean over seeds; error bars: the seeds' range (95% interval from 5 seeds); dots: the seeds",
    fontsize=9,
  )
  fig.tight_layout()
  path = os.path.join(out_dir, "summary.png")
  save_figure(fig, path)
  return path


def write_report(
  root: str,
  *,
  title: Optional[str] = None,
  extra: str = "",
  order: Sequence[str] = (),
  targets: Optional[dict] = None,
  reference: str = "dense",
) -> str:
  """Writes ``root/report.md`` and ``root/plots/*.png``.

  The report: the design (model, data, tokens, T, steps, batch, optimiser, learning rates,
  seeds, the machine and its load from ``host.json``), the summary over seeds (mean ±
  spread, marked against ``reference`` at the same LR, "within noise" in words where the
  spreads overlap), the sinks against uniform attention and initialisation, the
  learning-rate axis, the ``targets``, the bare-step throughput (``throughput.json``), every
  run's row, and the plots (error bars or bands of the seed spread).

  Args:
    root: a folder of run directories.
    title: the report's heading (default: the folder).
    extra: markdown added after the sections.
    order: arm folders (relative to ``root``; a seeded arm's is the folder above its seeds')
      to put first, in that order.
    targets: the main job's targets (``reference``, ``stable``, ``sink_free``, ``lr``;
      :func:`attnjax.train.report.targets_section`), or None for no such section.
    reference: the variant the others are held against.

  Returns:
    The markdown.
  """
  runs = find_runs(root)
  rank = {name: i for i, name in enumerate(order)}
  key = lambda r: arm_report.arm_folder(os.path.relpath(r, root))
  runs.sort(key=lambda r: (rank.get(key(r), rank.get(os.path.relpath(r, root), len(rank))), r))
  rows = [row_of(r, root) for r in runs]
  if targets:
    reference = targets.get("reference", reference)
  arm_list, design, sections = arm_report.write_sections(
    root, rows, reference=reference, targets=targets
  )
  plots_dir = os.path.join(root, "plots")
  plots = (
    [plot_summary(arm_list, plots_dir)]
    + plot_curves(root, runs, plots_dir)
    + plot_probes(root, runs, plots_dir)
    if runs
    else []
  )
  unit = rows[0]["unit"] if rows else "char"
  probe_lens = sorted({_probe_len(r) for r in runs} - {None})
  probe_len = "/".join(str(n) for n in probe_lens) or "64"
  text = [
    f"# {title or os.path.basename(os.path.abspath(root))}\n",
    f"{len(rows)} run(s) in {len(arm_list)} arm(s) under `{root}`.\n",
    design,
    sections,
    "## Every run\n",
    f"Val loss in nats per token; BPC = bits per {unit}; max logit, entropy: last training "
    f"step (max / mean over layers); F-Attn, Sink_1^0.3, M-Act: last probe "
    f"(length-{probe_len} held-out sequences).\n",
    markdown_table(rows, columns=RUN_COLUMNS),
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
    "\n"
    + "\n".join(f"![{os.path.basename(p)}]({os.path.relpath(p, root)})" for p in plots if p)
    + "\n"
  )
  markdown = "\n".join(text)
  rundir.write_atomic(os.path.join(root, "report.md"), markdown)
  return markdown


# ---------------------------------------------------------------------------
# LR sweeps (Wortsman et al. 2023, sec. 2.2).


def lr_sweep_rows(rows: list[dict]) -> list[dict]:
  """Per variant: LR sensitivity, max stable LR and best loss over its LR grid, over seeds.

  Each seed's runs form one LR grid, whose sensitivity and max stable LR are computed as
  Wortsman et al. define them; the variant's row gives their mean and spread.

  Args:
    rows: :func:`.row_of` dicts of an LR sweep (several LRs per variant, one run per seed
      and LR).

  Returns:
    One dict per variant: ``variant``, ``num_lrs``, ``seeds`` (grids), ``lr_sensitivity``
    (mean over seeds) and ``lr_sensitivity_spread`` (:func:`attnjax.train.report.spread`'s
    half-width; 0 for one seed), ``max_stable_lr`` (the smallest over seeds, None if a seed
    had none) and ``max_stable_lrs`` (each seed's), ``best_val_loss`` and
    ``best_val_loss_spread`` (at ``best_lr``, the LR of the lowest mean final val loss),
    ``diverged_lrs`` (LRs where some seed diverged), ``max_logit_at_max_lr`` (mean over
    seeds).
  """
  from attnjax._src.train import metrics as run_metrics

  out = []
  for variant in sorted({r["variant"] for r in rows if r["variant"]}):
    runs = [
      r
      for r in rows
      if r["variant"] == variant and r["lr"] and r["status"] in ("finished", "diverged")
    ]
    by_seed: dict = {}
    for r in runs:
      by_seed.setdefault(r.get("seed"), []).append(r)
    grids = []
    for seed_runs in by_seed.values():
      seed_runs.sort(key=lambda r: r["lr"])
      if any(r["initial_loss"] is None for r in seed_runs):
        continue
      lrs = [r["lr"] for r in seed_runs]
      final = [r["val_loss"] if r["val_loss"] is not None else float("nan") for r in seed_runs]
      loss_0 = [r["initial_loss"] for r in seed_runs]
      grids.append(
        dict(
          runs=seed_runs,
          sensitivity=run_metrics.lr_sensitivity(lrs, final, loss_0),
          max_stable=run_metrics.max_stable_lr(
            lrs, final, loss_0, diverged=[r["status"] == "diverged" for r in seed_runs]
          ),
        )
      )
    if not grids:
      continue
    all_lrs = sorted({r["lr"] for g in grids for r in g["runs"]})
    at_lr = {
      lr: arm_report.spread(r["val_loss"] for g in grids for r in g["runs"] if r["lr"] == lr)
      for lr in all_lrs
    }
    finite = [lr for lr in all_lrs if at_lr[lr] is not None]
    best_lr = min(finite, key=lambda lr: at_lr[lr].mean) if finite else all_lrs[0]
    sens = arm_report.spread(g["sensitivity"] for g in grids)
    stables = [g["max_stable"] for g in grids]
    top = [r for g in grids for r in g["runs"] if r["lr"] == all_lrs[-1]]
    logit = arm_report.spread(r["max_logit"] for r in top)
    out.append(
      {
        "variant": variant,
        "num_lrs": len(all_lrs),
        "seeds": len(grids),
        "lr_sensitivity": sens.mean,
        "lr_sensitivity_spread": sens.half,
        "max_stable_lr": None if any(x is None for x in stables) else min(stables),
        "max_stable_lrs": stables,
        "best_val_loss": None if at_lr[best_lr] is None else at_lr[best_lr].mean,
        "best_val_loss_spread": None if at_lr[best_lr] is None else at_lr[best_lr].half,
        "best_lr": best_lr,
        "diverged_lrs": sorted(
          {r["lr"] for g in grids for r in g["runs"] if r["status"] == "diverged"}
        ),
        "max_logit_at_max_lr": None if logit is None else logit.mean,
      }
    )
  return out


def lr_sweep_table(summary: list[dict]) -> str:
  """The markdown table of :func:`.lr_sweep_rows` (mean ± spread over seeds).

  Args:
    summary: its dicts.

  Returns:
    The table.
  """
  lines = [
    "| variant | LRs | seeds | LR sensitivity | max stable LR (seeds) | best val loss | best LR "
    "| diverged at LR |",
    "|---|---:|---:|---:|---:|---:|---:|---|",
  ]

  def pm(mean, half):
    if mean is None:
      return "-"
    return _fmt(mean) if not half else f"{_fmt(mean)} ± {_fmt(half)}"

  for s in summary:
    stables = sorted({x for x in s.get("max_stable_lrs") or [s["max_stable_lr"]] if x is not None})
    none = any(x is None for x in s.get("max_stable_lrs") or [s["max_stable_lr"]])
    stable = (
      "-"
      if not stables
      else "-".join(f"{x:g}" for x in (stables[0], stables[-1])[: 1 + (len(stables) > 1)])
    )
    if none and stables:
      stable += " (none in a seed)"
    lines.append(
      f"| {s['variant']} | {s['num_lrs']} | {s.get('seeds', 1)} | "
      f"{pm(s['lr_sensitivity'], s.get('lr_sensitivity_spread'))} | {stable} | "
      f"{pm(s['best_val_loss'], s.get('best_val_loss_spread'))} | {s['best_lr']:g} | "
      f"{', '.join(f'{x:g}' for x in s['diverged_lrs']) or '-'} |"
    )
  return "\n".join(lines) + "\n"


def plot_lr_sweep(rows: list[dict], root: str, out_dir: str) -> list[str]:
  """``loss_vs_lr.png`` (mean over seeds, error bars of their spread) and, per variant, max
  logit against step (per LR the mean over seeds, band of their spread).

  Diverged runs count at their initial loss (Wortsman et al.'s convention) and are marked.

  Args:
    rows: :func:`.row_of` dicts of an LR sweep.
    root: the sweep's root.
    out_dir: the folder the PNGs are written to.

  Returns:
    The paths of the PNGs written.
  """
  paths = []
  fig, ax = subplots(figsize=(7, 4.5))
  variants = sorted({r["variant"] for r in rows if r["variant"]})
  for variant in variants:
    runs = [r for r in rows if r["variant"] == variant and r["lr"]]
    lrs = sorted({r["lr"] for r in runs})
    sp = [
      arm_report.spread(
        r["val_loss"] if r["val_loss"] is not None else r["initial_loss"]
        for r in runs
        if r["lr"] == lr
      )
      for lr in lrs
    ]
    y = np.asarray([np.nan if s is None else s.mean for s in sp])
    err = np.asarray(
      [[0.0, 0.0] if s is None else [s.mean - s.band[0], s.band[1] - s.mean] for s in sp]
    ).T
    (line,) = ax.plot(lrs, y, "o-", label=variant)
    ax.errorbar(lrs, y, yerr=err, fmt="none", ecolor=line.get_color(), capsize=3)
    bad = [
      (lr, yy)
      for lr, yy in zip(lrs, y)
      if any(r["status"] == "diverged" for r in runs if r["lr"] == lr)
    ]
    if bad:
      ax.plot(*zip(*bad), "x", ms=10, color=line.get_color())
  ax.set(
    xscale="log",
    xlabel="peak learning rate",
    ylabel="final val loss (x: a seed diverged, counted at loss_0)",
    title="loss vs learning rate (mean ± spread over seeds)",
  )
  ax.legend(fontsize=8)
  path = os.path.join(out_dir, "loss_vs_lr.png")
  save_figure(fig, path)
  paths.append(path)
  for variant in variants:
    fig, ax = subplots(figsize=(7, 4.5))
    runs = [r for r in rows if r["variant"] == variant and r["lr"]]
    for lr in sorted({r["lr"] for r in runs}):
      at = [r for r in runs if r["lr"] == lr]
      series = [
        {
          x["step"]: _layer_max(x, "max_logit")
          for x in _train_records(os.path.join(root, r["arm"]))
        }
        for r in at
      ]
      diverged = sum(r["status"] == "diverged" for r in at)
      label = f"lr={lr:g}" + (f" ({diverged} diverged)" if diverged else "")
      if any(series):
        _draw(ax, *_mean_band(series), label, len(at))
    ax.set(
      xlabel="step",
      ylabel="max attention logit (max over layers)",
      yscale="log",
      title=f"{variant}: max attention logit vs step (mean, band: spread over seeds)",
    )
    if ax.lines:
      ax.legend(fontsize=7)
    path = os.path.join(out_dir, f"max_logit_{variant}.png")
    save_figure(fig, path)
    paths.append(path)
  return paths


def write_lr_sweep_report(
  root: str, *, title: Optional[str] = None, order: Sequence[str] = ()
) -> str:
  """:func:`.write_report` plus the LR-sensitivity table and the LR plots.

  Args:
    root: an LR sweep's root.
    title: the report's heading.
    order: arm folders to put first (as :func:`.write_report`).

  Returns:
    The markdown.
  """
  rows = [row_of(r, root) for r in find_runs(root)]
  summary = lr_sweep_rows(rows)
  plots = plot_lr_sweep(rows, root, os.path.join(root, "plots")) if rows else []
  extra = (
    "## LR sensitivity (Wortsman et al. 2023, sec. 2.2)\n\n"
    "Sensitivity = mean over the LR grid of min(final val loss, loss_0) - best; "
    "a diverged run counts as loss_0; computed per seed, mean ± spread over seeds. Max "
    "stable LR: largest LR that neither diverged nor ended above loss_0 (the range over "
    "seeds).\n\n"
    + lr_sweep_table(summary)
    + "\n"
    + "\n".join(f"![{os.path.basename(p)}]({os.path.relpath(p, root)})" for p in plots)
    + "\n"
  )
  rundir.write_json(os.path.join(root, "lr_sensitivity.json"), summary)
  return write_report(root, title=title, extra=extra, order=order)


def _probe_len(run_path: str):
  """The run's ``train.probe_len`` from its ``config.json`` (None if unreadable)."""
  try:
    with open(rundir.RunDir(run_path).config) as f:
      return int(json.load(f)["train"]["probe_len"])
  except (OSError, ValueError, KeyError, TypeError):
    return None
