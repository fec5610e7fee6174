"""Sink statistics over training for each attention variant (Gu et al. 2024).

    python experiments/sinks.py --config experiments/configs/sinks.py:preset=cpu_sinks \\
        --out runs/sinks_cpu

Writes ``<out>/<dataset>/<arm>/seed=<s>/`` (one run directory per arm and seed) and a report
per dataset (``<out>/<dataset>/report.md``: the design, mean ± spread over seeds, the sink
metrics against uniform attention and initialisation, plots of the probes against step),
joined in ``<out>/report.md``. Arms are the variants of ``sweep.variants`` and, for dense
softmax, the learning rates ``sweep.dense_lrs`` (``dense_lr0.01``, ...); every arm runs at
each seed of ``sweep.seeds`` and dense also at those of ``sweep.dense_seeds`` (the seeds of
an arm train stacked).

With ``sweep.attention_maps`` (preset ``cpu_sinks``) each finished run's last
checkpoint is probed once more and its batch-mean attention weights are kept
in ``<run>/attention_maps.npz`` (``weights [L, N, T, S]`` row-normalised,
``bos_nontrigger`` and ``bos_trigger [L, N]``: the mean first-token weight of
queries whose token is not / is a trigger, and ``f_attn_raw [L, N]``: the
first-token weight before row normalisation, which for softmax_one and sink
logits leaves out the mass sent to the null column); the report then adds per-layer and per-head
first-token attention, Sink_1^eps against eps, F-Attn and the sink rate over
training, massive activations, the value-state drain, the active-dormant split
and the sink checks (``_checks`` below), with first-token attention maps
(``plots/attention_maps.png``) that notebook 04 also draws; NSA arms also get
``<arm>/nsa_branches.npz`` and a table of their branches (``save_branch_stats``).
"""

from __future__ import annotations

import os
import time
from typing import Optional

import numpy as np

from attnjax.train import cli, report, rundir, sweep, variants
from attnjax.train.config import validate
from attnjax.train import init_distributed
from attnjax.train.variants import SINK_FREE, check_variants


def build_arms(cfg, out: str) -> list[sweep.Arm]:
  """Every arm of the sweep (checked before any trains): variants x datasets, then dense's
  learning rates; each at every seed (dense also at ``sweep.dense_seeds``)."""
  seeds = sweep.parse_seeds(cfg.sweep.seeds)
  extra = cfg.sweep.get("dense_seeds", "")
  dense_seeds = seeds + [
    s
    for s in (sweep.parse_seeds(extra, key="sweep.dense_seeds") if cli.csv(extra) else [])
    if s not in seeds
  ]
  variants = check_variants(cfg.sweep.variants)
  datasets = cli.csv(cfg.sweep.datasets)
  if not datasets:
    raise ValueError("sweep.datasets is empty: name at least one, e.g. bigram_backcopy")
  lrs = sweep.parse_lrs(cfg.sweep.get("dense_lrs", ""), key="sweep.dense_lrs")
  arms = []
  for d in datasets:
    entries = [(v, v, {}) for v in variants]
    entries += [(f"dense_lr{lr:g}", "dense", {"opt.lr": lr}) for lr in lrs]
    for name, variant, changes in entries:
      a = sweep.arm(
        cfg,
        f"{d}/{name}",
        os.path.join(out, d, name),
        variant=variant,
        **{"data.name": d},
        **changes,
      )
      validate(a.config)
      arms += sweep.seeded(a, dense_seeds if name == "dense" else seeds)
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
# NSA's branches (compressed, selected, window) of a finished run.

BRANCHES = ("compressed", "selected", "window")


def save_branch_stats(run_path: str) -> Optional[str]:
  """Writes ``run_path/nsa_branches.npz`` for a finished NSA run; returns its path (None for
  other runs).

  From the last checkpoint on the probe batch, per layer, head and branch ``[L, N, 3]``:
  ``first_nontrigger`` / ``first_trigger``, the branch's row-normalised weight on its first
  key (compressed block 0, raw key 0) over queries after the first whose token is not / is
  a trigger; ``gate_nontrigger`` / ``gate_trigger``, its mean gate over those queries;
  ``sink_mass``, ``entropy``, ``max_logit`` as the layer sowed them (means over the batch).
  """
  import jax.numpy as jnp
  from flax import nnx

  from attnjax.nn import intermediates
  from attnjax.train import Trainer

  run = rundir.RunDir(run_path)
  summary = run.read_summary() or {}
  path = os.path.join(run_path, "nsa_branches.npz")
  if summary.get("status") != "finished" or not os.path.isfile(run.config):
    return None
  cfg = sweep.config_from_json(run.config)
  if variants.VARIANTS.get(cfg.variant, ({},))[0].get("family") != "nsa":
    return None
  trainer = Trainer(cfg)
  model = trainer.model()
  if not any(b.attention.config.family == "nsa" for b in model.blocks):
    return None
  if os.path.isfile(path) and os.path.getmtime(path) >= os.path.getmtime(run.summary):
    return path
  if trainer.restore_latest() == 0:
    return None
  model = trainer.model()
  t = cfg.train
  b = trainer.batches.batch("probe", 0, seq_len=t.probe_len, batch_size=t.probe_batch)
  tokens = np.asarray(b.inputs)
  _, inter = nnx.capture(lambda m, x: m(x), nnx.Intermediate)(model, jnp.asarray(tokens))
  layers = intermediates.read(inter, len(model.blocks)).layers
  trigger = np.zeros_like(tokens, bool)
  if cfg.data.name == "bigram_backcopy":
    trigger = tokens < cfg.data.bb_num_triggers
  later = np.arange(tokens.shape[1]) >= 1
  out: dict[str, list] = {
    k: []
    for k in (
      "first_nontrigger",
      "first_trigger",
      "gate_nontrigger",
      "gate_trigger",
      "sink_mass",
      "entropy",
      "max_logit",
    )
  }
  for layer in layers:
    first = np.asarray(intermediates.find(layer, "nsa_first_weight"))  # [B, N, T, 3]
    gates = np.asarray(intermediates.find(layer, "nsa_gates"))  # [B, T, N, 3]
    for name, queries in (("nontrigger", ~trigger & later), ("trigger", trigger & later)):
      m = queries[:, None, :, None]  # [B, 1, T, 1]
      count = max(int(queries.sum()), 1)
      out[f"first_{name}"].append((first * m).sum(axis=(0, 2)) / count)
      out[f"gate_{name}"].append((np.swapaxes(gates, 1, 2) * m).sum(axis=(0, 2)) / count)
    for field in ("sink_mass", "entropy", "max_logit"):
      out[field].append(np.asarray(intermediates.find(layer, f"nsa_{field}")).mean(axis=0))
  tmp = path + ".tmp.npz"
  np.savez_compressed(tmp, **{k: np.stack(v) for k, v in out.items()})
  os.replace(tmp, path)
  return path


def branch_section(root: str, runs: list[str]) -> str:
  """Markdown of the NSA arms' branches, from their ``nsa_branches.npz``."""
  rows = []
  for r in runs:
    path = os.path.join(r, "nsa_branches.npz")
    if not os.path.isfile(path):
      continue
    with np.load(path) as z:
      data = {k: z[k] for k in z.files}
    name = os.path.relpath(r, root)
    L, N, _ = data["first_nontrigger"].shape
    for layer in range(L):
      for h in range(N):
        for b, branch in enumerate(BRANCHES):
          cell = lambda key, d=2: _fmt(float(data[key][layer, h, b]), d)
          rows.append(
            f"| {name} | L{layer}H{h} | {branch} | {cell('first_nontrigger')} | "
            f"{cell('first_trigger')} | {cell('gate_nontrigger')} | {cell('gate_trigger')} | "
            f"{cell('sink_mass')} | {cell('entropy')} | {cell('max_logit', 1)} |"
          )
  if not rows:
    return ""
  return (
    "\n".join(
      [
        "\n## NSA's branches (last checkpoint, probe batch)\n",
        "Per branch: the row-normalised weight on its first key (compressed block 0 = tokens "
        "0 .. l-1, raw token 0) for non-trigger and trigger queries, its mean gate for them, "
        "and the layer's sown F-Attn (sink mass), entropy and max logit. A sink in a branch is "
        "a high first-key weight on non-trigger queries; routing the no-op through the gates "
        "is a gate that drops on non-trigger queries (Guo et al.'s dormant phase) while the "
        "branch keeps attending content.\n",
        "| arm | head | branch | first-key weight, non-trigger | first-key weight, trigger "
        "| gate, non-trigger | gate, trigger | F-Attn | entropy | max logit |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
      ]
    )
    + "\n"
  )


# ---------------------------------------------------------------------------
# The report's sink sections.


def _arm(name: str) -> str:
  """The arm of a run's name relative to a dataset's folder (``dense/seed=1`` -> ``dense``)."""
  return report.arm_folder(name)


def _probes(run_path: str) -> list[dict]:
  return rundir.read_jsonl(rundir.RunDir(run_path).probes)


def _fmt(x, digits: int = 2) -> str:
  if x is None or (isinstance(x, float) and not np.isfinite(x)):
    return "-"
  return f"{x:.{digits}f}"


def _list(xs, digits: int = 2) -> str:
  return "[" + ", ".join(_fmt(x, digits) for x in xs) + "]" if xs is not None else "-"


def formed(probe: dict, *, f_min: float = 0.5, rate_min: float = 50.0) -> bool:
  """The sink criterion (:func:`attnjax.train.report.sink_formed`): a layer puts at least
  ``f_min`` of its raw attention on the first token, with Sink_1^0.3 >= ``rate_min`` %."""
  return report.sink_formed(probe, f_min=f_min, rate_min=rate_min)


def sink_sections(root: str, runs: list[str], plots_dir: str) -> str:
  """Markdown of the sink sections (tables and figures) for the runs under ``root``."""
  from attnjax.stats import SINK_CURVE_EPS

  names = [os.path.relpath(r, root) for r in runs]
  last = {n: (_probes(r) or [{}])[-1] for n, r in zip(names, runs)}
  out = [
    "## Per layer and per head (last probe)\n",
    "F-Attn (Qiu et al.) and Sink_1^0.3 (Gu et al., % of heads x probe sequences) per layer, "
    "F-Attn per head "
    "([layer][head]); *formed*: some layer puts >= 0.5 of its raw attention (no row "
    "normalisation) on the first token and has Sink_1^0.3 >= 50%.\n",
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
  dense = [n for n in names if _arm(n) == "dense" or _arm(n).startswith("dense_")]
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
  out.append(branch_section(root, runs))
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

  The first-token weight is the raw one (no row normalisation: ``f_attn/raw`` of the probe,
  else ``f_attn_raw`` of the attention maps), so that the mass softmax_one and sink logits
  send to their null column does not count as BOS's; F-Attn (Qiu et al.'s definition on
  row-normalised weights, comparable across normalisers) is shown beside it. Each arm's
  value is the mean ± spread over its seeds.
  """
  by_arm: dict = {}
  for n in names:
    by_arm.setdefault(_arm(n), []).append(n)

  def raw(n):
    value = last[n].get("f_attn/raw")
    if value is None and maps.get(n) is not None and "f_attn_raw" in maps[n]:
      value = float(np.mean(maps[n]["f_attn_raw"]))
    return value if value is not None else last[n].get("f_attn/f_attn")

  lines = ["\n## Checks\n"]
  seeds = by_arm.get("dense", [])
  if seeds:
    ok = sum(formed(last[n]) for n in seeds)
    lines.append(
      f"- dense softmax forms the sink in {ok} of {len(seeds)} seeds "
      f"({'pass' if ok >= min(2, len(seeds)) else 'FAIL'}; needed: 2 of 3)."
    )
  base = report.spread(raw(n) for n in seeds)
  for v in SINK_FREE:
    if v not in by_arm or base is None:
      continue
    f = report.spread(raw(n) for n in by_arm[v])
    fa = report.spread(last[n].get("f_attn/f_attn") for n in by_arm[v])
    verdict = "-" if f is None else ("pass" if f.hi <= base.mean / 2 else "FAIL")
    line = (
      f"- {v}: first-token weight {report.fmt_spread(f, 2)} vs dense "
      f"{report.fmt_spread(base, 2)} (<= half: {verdict}); F-Attn on renormalised rows "
      f"{report.fmt_spread(fa, 2)}"
    )
    null = report.spread(last[n].get("null_mass/mean") for n in by_arm[v])
    if null is not None and null.mean > 0:
      line += f"; the null column takes {report.fmt_spread(null, 2)} of each row"
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
    __doc__,
    "experiments/configs/sinks.py:preset=cpu",
    argv,
    default_out="runs/sinks",
    arms=lambda cfg, args: build_arms(cfg, args.out),
  )
  init_distributed()
  t0 = time.perf_counter()
  datasets = cli.csv(cfg.sweep.datasets)
  arms = args.arms
  if not args.report_only:
    sweep.run_sweep(arms, processes=args.processes, root=args.out)
  maps = bool(cfg.sweep.get("attention_maps", False))
  if maps:
    for a in arms:
      if os.path.isdir(a.config.run_dir):
        save_attention_maps(a.config.run_dir)
        save_branch_stats(a.config.run_dir)
  setting = cfg.sweep.get("setting", cfg.preset)
  parts = [f"# sinks ({setting}, lr={cfg.opt.lr:g})\n"]
  for d in datasets:
    root = os.path.join(args.out, d)
    if os.path.isdir(root):
      order = sweep.folders([a for a in arms if a.config.data.name == d], root)
      runs = report.find_runs(root)
      rank = {n: i for i, n in enumerate(order)}
      runs.sort(key=lambda r: (rank.get(_arm(os.path.relpath(r, root)), len(rank)), r))
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
