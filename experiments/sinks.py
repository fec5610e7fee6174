"""Sink statistics over training for each attention variant (Gu et al. 2024).

    python experiments/sinks.py --config experiments/configs/sinks.py:preset=cpu_sinks \\
        --out runs/sinks_cpu

Writes ``<out>/<dataset>/<arm>/`` (one run directory per arm) and a report per
dataset (``<out>/<dataset>/report.md``: final F-Attn, Sink_1^0.3, M-Act and
plots of the probes against step), joined in ``<out>/report.md``. Arms are the
variants of ``sweep.variants`` and, for dense softmax, the extra seeds
``sweep.dense_seeds`` (``dense_seed1``, ...) and learning rates
``sweep.dense_lrs`` (``dense_lr0.01``, ...).

With ``sweep.attention_maps`` (preset ``cpu_sinks``) each finished arm's last
checkpoint is probed once more and its batch-mean attention weights are kept
in ``<arm>/attention_maps.npz`` (``weights [L, N, T, S]`` row-normalised,
``bos_nontrigger`` and ``bos_trigger [L, N]``: the mean first-token weight of
queries whose token is not / is a trigger, and ``f_attn_raw [L, N]``: the
first-token weight before row normalisation, which for softmax_one and sink
logits leaves out the mass sent to the null column); the report then adds per-layer and per-head
first-token attention, Sink_1^eps against eps, F-Attn and the sink rate over
training, massive activations, the value-state drain, the active-dormant split
and the sink checks (``_checks`` below), with first-token attention maps
(``plots/attention_maps.png``) that notebook 04 also draws.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import numpy as np

from attnjax.train import cli, report, rundir, sweep
from attnjax.train.config import validate
from attnjax.train import init_distributed

# The variants that should not form a sink: their F-Attn should end
# at most half of dense softmax's.
SINK_FREE = ("sink_logits", "softmax_one", "sigmoid", "gated")


def build_arms(cfg, out: str) -> list[sweep.Arm]:
  """Every arm of the sweep: variants x datasets, then dense's extra seeds and learning rates."""
  arms = []
  for d in cli.csv(cfg.sweep.datasets):
    for v in cli.csv(cfg.sweep.variants):
      arms.append(
        sweep.arm(cfg, f"{d}/{v}", os.path.join(out, d, v), variant=v, **{"data.name": d})
      )
    extra = [
      (f"dense_seed{int(s)}", {"seed": int(s)}) for s in cli.csv(cfg.sweep.get("dense_seeds", ""))
    ]
    extra += [
      (f"dense_lr{float(lr):g}", {"opt.lr": float(lr)})
      for lr in cli.csv(cfg.sweep.get("dense_lrs", ""))
    ]
    for name, changes in extra:
      arms.append(
        sweep.arm(
          cfg,
          f"{d}/{name}",
          os.path.join(out, d, name),
          variant="dense",
          **{"data.name": d},
          **changes,
        )
      )
  for a in arms:
    validate(a.config)
  return arms


# ---------------------------------------------------------------------------
# Attention maps of a finished run (its last checkpoint, on the probe batch).


def save_attention_maps(run_path: str) -> Optional[str]:
  """Writes ``run_path/attention_maps.npz`` from the run's last checkpoint; returns its path.

  Returns None (and writes nothing) for a run without a checkpoint or not finished.
  """
  import jax.numpy as jnp

  from attnjax.nn import layer_stats
  from attnjax.train import Trainer

  run = rundir.RunDir(run_path)
  summary = run.read_summary() or {}
  path = os.path.join(run_path, "attention_maps.npz")
  if summary.get("status") != "finished" or not os.path.isfile(run.config):
    return None
  # Kept only if written after the run last finished (a longer re-run into the same folder
  # rewrites its summary, so maps of an earlier, shorter run are recomputed).
  if os.path.isfile(path) and os.path.getmtime(path) >= os.path.getmtime(run.summary):
    return path
  cfg = sweep.config_from_json(run.config)
  # The run where it is now: its config may hold a run_dir relative to where it was trained
  # (compare's runs/compare/<variant>), which from another directory (a notebook's) would
  # name no checkpoint, and the run would look as if it had none.
  cfg.run_dir = os.path.abspath(run_path)
  trainer = Trainer(cfg)
  step = trainer.restore_latest()
  if step == 0:
    return None
  t = cfg.train
  b = trainer.batches.batch("probe", 0, seq_len=t.probe_len, batch_size=t.probe_batch)
  capture = layer_stats(trainer.model(), jnp.asarray(b.inputs), view="capture")
  raw = np.asarray(capture.weights, np.float32)  # [L, B, N, T, S]
  w = raw / np.maximum(np.abs(raw).sum(-1, keepdims=True), 1e-30)  # row-normalised, as F-Attn
  tokens = np.asarray(b.inputs)
  trigger = np.zeros_like(tokens, bool)
  if cfg.data.name == "bigram_backcopy":
    trigger = tokens < cfg.data.bb_num_triggers  # trigger ids are 0 .. num_triggers - 1
  first = w[:, :, :, 1:, 0]  # [L, B, N, T-1]: queries i >= 2 (1-indexed)
  sel = trigger[None, :, None, 1:]

  def masked(m):
    m = np.broadcast_to(m, first.shape)
    return np.where(m, first, 0).sum(axis=(1, 3)) / np.maximum(m.sum(axis=(1, 3)), 1)

  tmp = path + ".tmp.npz"
  np.savez_compressed(
    tmp,
    weights=w.mean(axis=1),
    step=step,
    tokens=tokens,
    bos_nontrigger=masked(~sel),
    bos_trigger=masked(sel),
    f_attn_raw=raw[:, :, :, 1:, 0].mean(axis=(1, 3)),
    trigger_fraction=float(trigger[:, 1:].mean()),
  )
  os.replace(tmp, path)
  return path


# ---------------------------------------------------------------------------
# The report's sink sections.


def _probes(run_path: str) -> list[dict]:
  return rundir.read_jsonl(rundir.RunDir(run_path).probes)


def _fmt(x, digits: int = 2) -> str:
  if x is None or (isinstance(x, float) and not np.isfinite(x)):
    return "-"
  return f"{x:.{digits}f}"


def _list(xs, digits: int = 2) -> str:
  return "[" + ", ".join(_fmt(x, digits) for x in xs) + "]" if xs is not None else "-"


def formed(probe: dict, *, f_min: float = 0.5, rate_min: float = 50.0) -> bool:
  """The sink criterion: a layer has F-Attn >= f_min and Sink_1^0.3 >= rate_min %.

  Sink_1^0.3 of a layer is the share of its (head x probe sequence) pairs with a sink.
  """
  f = probe.get("f_attn/per_layer") or []
  s = probe.get("sink_rate/per_layer") or []
  return any(
    fl is not None and sl is not None and fl >= f_min and sl >= rate_min for fl, sl in zip(f, s)
  )


def sink_sections(root: str, runs: list[str], plots_dir: str) -> str:
  """Markdown of the sink sections (tables and figures) for the runs under ``root``."""
  from attnjax.stats import SINK_CURVE_EPS

  names = [os.path.relpath(r, root) for r in runs]
  last = {n: (_probes(r) or [{}])[-1] for n, r in zip(names, runs)}
  out = [
    "## Per layer and per head (last probe)\n",
    "F-Attn (Qiu et al.) and Sink_1^0.3 (Gu et al., % of heads x probe sequences) per layer, "
    "F-Attn per head "
    "([layer][head]); *formed*: some layer has F-Attn >= 0.5 and Sink_1^0.3 >= 50%.\n",
    "| arm | F-Attn per layer | Sink_1^0.3 per layer (%) | F-Attn per head | formed |",
    "|---|---|---|---|---|",
  ]
  for n in names:
    p = last[n]
    heads = p.get("f_attn/per_head") or []
    out.append(
      f"| {n} | {_list(p.get('f_attn/per_layer'))} | "
      f"{_list(p.get('sink_rate/per_layer'), 0)} | "
      f"{' '.join(_list(h) for h in heads) or '-'} | {'yes' if formed(p) else 'no'} |"
    )
  out += [
    "\n## Sink_1^eps against eps (last probe, % of heads x sequences)\n",
    "| arm | " + " | ".join(f"{e:g}" for e in SINK_CURVE_EPS) + " |",
    "|---|" + "---:|" * len(SINK_CURVE_EPS),
  ]
  for n in names:
    curve = last[n].get("sink_curve/rate") or [None] * len(SINK_CURVE_EPS)
    out.append(f"| {n} | " + " | ".join(_fmt(c, 0) for c in curve) + " |")
  out += [
    "\n## Massive activations, value-state drain and the active-dormant split\n",
    "M-Act: max |hidden| over the probe (Sun et al.); value drain: ||v_BOS|| / mean "
    "||v_j>=2|| per layer (Guo et al.; < 1 = drained); null mass: weight sent to the null "
    "column (softmax_one, sink logits); raw BOS weight: F-Attn before row normalisation "
    "(per head); BOS weight (rows renormalised) of non-trigger and of trigger queries "
    "per head (from `attention_maps.npz`; Guo et al.'s dormant heads park on BOS except "
    "after a trigger).\n",
    "| arm | M-Act | value drain per layer | null mass | raw BOS weight | "
    "BOS weight, non-trigger queries | BOS weight, trigger queries |",
    "|---|---:|---|---:|---|---|---|",
  ]
  for n, r in zip(names, runs):
    p = last[n]
    maps = _maps(r)
    nt = " ".join(_list(h) for h in maps["bos_nontrigger"]) if maps else "-"
    tr = " ".join(_list(h) for h in maps["bos_trigger"]) if maps else "-"
    rw = " ".join(_list(h) for h in maps["f_attn_raw"]) if maps and "f_attn_raw" in maps else "-"
    out.append(
      f"| {n} | {_fmt(p.get('massive/m_act'), 1)} | "
      f"{_list(p.get('value_drain/per_layer'))} | "
      f"{report.significant(p.get('null_mass/mean'))} | "
      f"{rw} | {nt} | {tr} |"
    )
  dense = [n for n in names if n.split("/")[-1] == "dense" or "dense_" in n.split("/")[-1]]
  if dense:
    steps = sorted({q["step"] for q in _probes(runs[names.index(dense[0])])})
    shown = [s for s in steps if s % max(1, (steps[-1] // 10) or 1) == 0] or steps
    out += [
      "\n## Dense softmax over training (F-Attn / Sink_1^0.3 %)\n",
      "Seeds and learning rates (Gu et al. 2024: sinks emerge with enough training and a "
      "large enough LR).\n",
      "| step | " + " | ".join(dense) + " |",
      "|---:|" + "---|" * len(dense),
    ]
    by_step = {n: {q["step"]: q for q in _probes(runs[names.index(n)])} for n in dense}
    for s in shown:
      cells = []
      for n in dense:
        q = by_step[n].get(s)
        cells.append(
          "-"
          if q is None
          else f"{_fmt(q.get('f_attn/f_attn'))} / {_fmt(q.get('sink_rate/rate'), 0)}"
        )
      out.append(f"| {s} | " + " | ".join(cells) + " |")
  out.append(_checks(names, last, {n: _maps(r) for n, r in zip(names, runs)}))
  figures = [
    plot_attention_maps(root, runs, plots_dir),
    plot_sink_curve(root, runs, plots_dir),
    plot_dense_over_training(root, [runs[names.index(n)] for n in dense], plots_dir),
  ]
  out.append(
    "\n"
    + "\n".join(f"![{os.path.basename(p)}]({os.path.relpath(p, root)})" for p in figures if p)
    + "\n"
  )
  return "\n".join(out)


def _checks(names: list[str], last: dict, maps: dict) -> str:
  """The sink checks: dense forms the sink in >= 2 of 3 seeds; sink-free variants <= half.

  F-Attn is measured on row-normalised weights (Qiu et al.'s definition, comparable across
  normalisers); for softmax_one and sink logits, whose rows send mass to a null column, the
  raw first-token weight (``f_attn_raw`` of the attention maps) is shown beside it.
  """
  leaf = {n.split("/")[-1]: n for n in names}
  seeds = [leaf[k] for k in leaf if k == "dense" or k.startswith("dense_seed")]
  lines = ["\n## Checks\n"]
  if seeds:
    ok = sum(formed(last[n]) for n in seeds)
    lines.append(
      f"- dense softmax forms the sink in {ok} of {len(seeds)} seeds "
      f"({'pass' if ok >= min(2, len(seeds)) else 'FAIL'}; needed: 2 of 3)."
    )
  base = last.get(leaf.get("dense", ""), {}).get("f_attn/f_attn")
  for v in SINK_FREE:
    if v in leaf and base is not None:
      f = last[leaf[v]].get("f_attn/f_attn")
      verdict = "-" if f is None else ("pass" if f <= base / 2 else "FAIL")
      line = f"- {v}: F-Attn {_fmt(f)} vs dense {_fmt(base)} (<= half: {verdict})"
      null = last[leaf[v]].get("null_mass/mean")
      m = maps.get(leaf[v])
      if null and m is not None and "f_attn_raw" in m:
        raw = float(np.mean(m["f_attn_raw"]))
        line += (
          f"; null column takes {report.significant(null)} of each row, so the raw "
          f"first-token weight is {_fmt(raw)} "
          f"(<= half of dense: {'pass' if raw <= base / 2 else 'FAIL'})"
        )
      lines.append(line + ".")
  return "\n".join(lines) + "\n"


def _maps(run_path: str) -> Optional[dict]:
  path = os.path.join(run_path, "attention_maps.npz")
  if not os.path.isfile(path):
    return None
  with np.load(path) as z:
    return {k: z[k] for k in z.files}


def plot_attention_maps(root: str, runs: list[str], out_dir: str) -> Optional[str]:
  """First-token attention maps: each arm's layer-0 (and last-layer) heads, queries x keys."""
  from attnjax.train.plots import save_figure, subplots

  items = []
  for r in runs:
    maps = _maps(r)
    if maps is None:
      continue
    w = maps["weights"]  # [L, N, T, S]
    for layer in sorted({0, w.shape[0] - 1}):
      for h in range(w.shape[1]):
        items.append((f"{os.path.relpath(r, root)} L{layer}H{h}", w[layer, h]))
  if not items:
    return None
  cols = min(4, len(items))
  rows = (len(items) + cols - 1) // cols
  fig, axes = subplots(rows, cols, figsize=(2.6 * cols, 2.5 * rows), squeeze=False)
  for ax, (title, w) in zip(axes.flat, items):
    ax.imshow(
      np.sqrt(np.abs(w[:, : w.shape[0]])), cmap="viridis", vmin=0, vmax=1, interpolation="nearest"
    )
    ax.set_title(title, fontsize=7)
    ax.set_xticks([])
    ax.set_yticks([])
  for ax in list(axes.flat)[len(items) :]:
    ax.axis("off")
  fig.suptitle(
    "sqrt of |attention weight| (rows renormalised), query rows x key columns; the "
    "sink is the first column",
    fontsize=8,
  )
  path = os.path.join(out_dir, "attention_maps.png")
  save_figure(fig, path)
  return path


def plot_sink_curve(root: str, runs: list[str], out_dir: str) -> Optional[str]:
  """Sink_1^eps against eps at the last probe, one line per arm."""
  from attnjax.stats import SINK_CURVE_EPS
  from attnjax.train.plots import save_figure, subplots

  fig, ax = subplots(figsize=(6, 4))
  for r in runs:
    curve = (_probes(r) or [{}])[-1].get("sink_curve/rate")
    if curve:
      ax.plot(
        SINK_CURVE_EPS,
        [np.nan if c is None else c for c in curve],
        "o-",
        ms=3,
        lw=0.9,
        label=os.path.relpath(r, root),
      )
  if not ax.lines:
    return None
  ax.set(xlabel="eps", ylabel="Sink_1^eps (%)", title="Sink_1^eps against eps (last probe)")
  ax.legend(fontsize=6, ncol=2)
  path = os.path.join(out_dir, "sink_curve.png")
  save_figure(fig, path)
  return path


def plot_dense_over_training(root: str, runs: list[str], out_dir: str) -> Optional[str]:
  """F-Attn and Sink_1^0.3 of the probes against step for the dense arms (seeds, LRs)."""
  from attnjax.train.plots import save_figure, subplots

  if not runs:
    return None
  fig, (ax1, ax2) = subplots(1, 2, figsize=(10, 3.6))
  for r in runs:
    recs = [q for q in _probes(r) if q.get("f_attn/f_attn") is not None]
    steps = [q["step"] for q in recs]
    label = os.path.relpath(r, root)
    ax1.plot(steps, [q["f_attn/f_attn"] for q in recs], "o-", ms=2, lw=0.9, label=label)
    ax2.plot(steps, [q.get("sink_rate/rate") for q in recs], "o-", ms=2, lw=0.9, label=label)
  ax1.axhline(0.5, color="k", ls="--", lw=0.6)
  ax1.set(xlabel="step", ylabel="F-Attn", title="dense: F-Attn over training", ylim=(0, 1))
  ax2.set(
    xlabel="step", ylabel="Sink_1^0.3 (%)", title="dense: sink rate over training", ylim=(-3, 103)
  )
  ax1.legend(fontsize=7)
  path = os.path.join(out_dir, "dense_over_training.png")
  save_figure(fig, path)
  return path


def main(argv=None) -> str:
  cfg, args = cli.parse(
    __doc__, "experiments/configs/sinks.py:preset=cpu", argv, default_out="runs/sinks"
  )
  init_distributed()
  t0 = time.perf_counter()
  datasets = cli.csv(cfg.sweep.datasets)
  arms = build_arms(cfg, args.out)
  if not args.report_only:
    sweep.run_sweep(arms, processes=args.processes)
  maps = bool(cfg.sweep.get("attention_maps", False))
  if maps:
    for a in arms:
      if os.path.isdir(a.config.run_dir):
        save_attention_maps(a.config.run_dir)
  setting = cfg.sweep.get("setting", cfg.preset)
  parts = [f"# sinks ({setting}, lr={cfg.opt.lr:g})\n"]
  order = [a.name.split("/", 1)[1] for a in arms]
  for d in datasets:
    root = os.path.join(args.out, d)
    if os.path.isdir(root):
      runs = report.find_runs(root)
      rank = {n: i for i, n in enumerate(order)}
      runs.sort(key=lambda r: (rank.get(os.path.relpath(r, root), len(rank)), r))
      extra = sink_sections(root, runs, os.path.join(root, "plots")) if maps and runs else ""
      md = report.write_report(root, title=f"sinks on {d}", order=order, extra=extra)
      parts.append(
        md.replace("](plots/", f"]({d}/plots/")
        .replace("\n# ", "\n## ", 1)
        .replace("# sinks on", "## sinks on", 1)
      )
  markdown = "\n".join(parts)
  return cli.finish(args.out, markdown, t0)


if __name__ == "__main__":
  main()
