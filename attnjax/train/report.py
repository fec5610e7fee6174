"""Reports: run directories -> one markdown table per experiment, and PNG plots.

    python experiments/report.py runs/compare       # writes runs/compare/report.md + plots/

Every number comes from the run directories (``summary.json``,
``metrics.jsonl``, ``probes.jsonl``), so a report can be rebuilt at any time,
including for a sweep that is still running.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional, Sequence

import numpy as np

from attnjax.train import rundir
from attnjax.train.plots import _save, plt

# Probe keys as attnjax.stats.probe names them, with fallbacks for older names.
_SINK_KEYS = ("sink_rate", "sink_rate_1", "sink_1", "sink_rate_k1_eps0.3")
_MACT_KEYS = ("m_act", "massive_activation", "max_activation", "m_act_mean")


def find_runs(root: str) -> list[str]:
  """Run directories (folders holding ``summary.json``) under ``root``, sorted."""
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
  """One report row from a run directory."""
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
      "f_attn": probe.get("f_attn", s.get("f_attn")),
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


COLUMNS = (
    ("variant", "variant"), ("lr", "LR"), ("val_loss", "val loss"), ("val_bpc", "BPC"),
    ("diverged", "diverged?"), ("max_logit", "max logit"), ("entropy", "entropy"),
    ("f_attn", "F-Attn"), ("sink_rate", "Sink_1^0.3 (%)"), ("m_act", "M-Act"),
    ("spike_score", "spike score (%)"), ("tokens_per_s", "tokens/s"),
)


def markdown_table(rows: list[dict], *, columns=COLUMNS) -> str:
  """A markdown table of report rows (diverged? shows the step)."""
  lines = ["| " + " | ".join(title for _, title in columns) + " |",
           "|" + "|".join("---" if k == "variant" else "---:" for k, _ in columns) + "|"]
  for r in rows:
    cells = []
    for key, _ in columns:
      if key == "diverged":
        cells.append(f"yes (step {r['diverged_step']})" if r["status"] == "diverged" else
                     ("no" if r["status"] == "finished" else r["status"]))
      elif key == "variant":
        cells.append(str(r["variant"]) if r["arm"] in (r["variant"], None) else
                     f"{r['variant']} ({r['arm']})")
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
  values = [v for v in r.get(key) or [] if v is not None and math.isfinite(v)]
  return max(values) if values else float("nan")


def plot_curves(root: str, runs: list[str], out_dir: str) -> list[str]:
  """Loss, max attention logit and F-Attn against step, one line per run."""
  paths = []
  panels = (("loss", "training loss (nats)", lambda r: r["loss"], "log"),
            ("max_logit", "max attention logit (max over layers)", lambda r: _layer_max(r, "max_logit"), "log"),
            ("f_attn", "F-Attn (mean over layers)", lambda r: float(np.nanmean(
                [v if v is not None else np.nan for v in r.get("f_attn") or [np.nan]])), "linear"))
  for name, title, get, yscale in panels:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
      recs = _train_records(run)
      if not recs:
        continue
      with np.errstate(all="ignore"):
        y = np.asarray([get(r) if r.get("loss") is not None else np.nan for r in recs], float)
      ax.plot([r["step"] for r in recs], y, lw=0.9, label=os.path.relpath(run, root))
    ax.set(xlabel="step", title=title, yscale=yscale)
    if ax.lines:
      ax.legend(fontsize=7)
    path = os.path.join(out_dir, f"{name}.png")
    _save(fig, path)
    paths.append(path)
  return paths


def write_report(root: str, *, title: Optional[str] = None, extra: str = "") -> str:
  """Writes ``root/report.md`` and ``root/plots/*.png``; returns the markdown."""
  runs = find_runs(root)
  rows = [row_of(r, root) for r in runs]
  plots = plot_curves(root, runs, os.path.join(root, "plots")) if runs else []
  unit = rows[0]["unit"] if rows else "char"
  text = [f"# {title or os.path.basename(os.path.abspath(root))}\n",
          f"{len(rows)} run(s) under `{root}`. Val loss in nats per token; BPC = bits per "
          f"{unit}; max logit, entropy: last training step (max / mean over layers); F-Attn, "
          f"Sink_1^0.3, M-Act: last probe (length-64 held-out sequences).\n",
          markdown_table(rows)]
  failed = [r for r in rows if r["status"] == "failed"]
  for r in failed:
    text.append(f"\n`{r['arm']}` failed:\n```\n{(r['error'] or '').strip()}\n```\n")
  if extra:
    text.append("\n" + extra)
  text.append("\n" + "\n".join(f"![{os.path.basename(p)}]({os.path.relpath(p, root)})" for p in plots)
              + "\n")
  markdown = "\n".join(text)
  rundir.write_atomic(os.path.join(root, "report.md"), markdown)
  return markdown
