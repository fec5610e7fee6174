"""A report's arms: runs grouped over seeds, and the sections written about them.

An arm is the folder above its seeds' run directories (``dense/lr=0.05`` holds
``seed=0``, ``seed=1``, ...); a run without a ``seed=<n>`` folder is an arm of one seed.
The sections: the design, the summary over seeds with its significance marks and words,
the sinks against uniform attention and initialisation, the learning-rate axis, the
targets of the main job, and the bare-step throughput.
"""

from __future__ import annotations

import os
import re
from typing import Optional, Sequence

from attnjax._src.train import baselines, host, rundir
from attnjax._src.train.spread import MARKS, differs, fmt_spread, legend, number, spread

_SEED_DIR = re.compile(r"^seed=(\d+)$")

# (key, header, digits) of the metrics summarised over seeds.
METRICS = (
  ("final_loss", "final loss", 3),
  ("val_loss", "val loss", 3),
  ("max_logit", "max logit", 1),
  ("max_logit_ever", "max logit (training)", 1),
  ("f_attn", "F-Attn", 3),
  ("first_token", "first-token weight", 3),
  ("sink_rate", "Sink_1^0.3 (%)", 0),
  ("probe_entropy", "entropy", 2),
  ("spike_score", "spike score (%)", 2),
  ("null_mass", "null mass", 3),
  ("f_attn_init", "F-Attn at init", 3),
  ("first_token_init", "first-token weight at init", 3),
  ("sink_rate_init", "Sink_1^0.3 at init (%)", 0),
  ("probe_entropy_init", "entropy at init", 2),
  ("initial_loss", "initial loss", 3),
)
DIGITS = {k: d for k, _, d in METRICS}
HEADERS = {k: h for k, h, _ in METRICS}
# The summary table's columns (each mean ± spread and a mark against the reference arm).
SUMMARY = ("val_loss", "max_logit", "f_attn", "first_token", "sink_rate", "probe_entropy")


def arm_folder(run: str) -> str:
  """A run's arm: its path without a trailing ``seed=<n>`` folder."""
  head, tail = os.path.split(os.path.normpath(run))
  return head if _SEED_DIR.match(tail) and head else run


def arm_rows(rows: Sequence[dict]) -> list[dict]:
  """Rows of runs (``report.row_of``) grouped into arms, in the order of their first run.

  Returns:
    One dict per arm: ``arm`` (its folder relative to the report's root), ``variant``,
    ``lr``, ``seeds`` (list), ``n`` (runs), ``diverged`` and ``failed`` (counts),
    ``runs`` (the rows), ``baseline`` (uniform attention's metrics at the arm's probe length
    and mask, or None) and, for each key of :data:`~attnjax._src.train.arm_report.METRICS`, its :class:`.Spread` over the
    seeds (None where no seed has a value).
  """
  order: list[str] = []
  by_arm: dict[str, list[dict]] = {}
  for r in rows:
    key = arm_folder(r["arm"])
    if key not in by_arm:
      order.append(key)
      by_arm[key] = []
    by_arm[key].append(r)
  out = []
  for key in order:
    runs = by_arm[key]
    first = runs[0]
    arm = {
      "arm": key,
      "variant": first["variant"],
      "lr": first["lr"],
      "seeds": [r.get("seed") for r in runs],
      "n": len(runs),
      "diverged": sum(r["status"] == "diverged" for r in runs),
      "failed": sum(r["status"] == "failed" for r in runs),
      "runs": runs,
      "baseline": first.get("baseline"),
    }
    for k, _, _ in METRICS:
      arm[k] = spread(r.get(k) for r in runs)
    out.append(arm)
  return out


def _label(a: dict) -> str:
  return a["arm"] if a["arm"] not in (a["variant"], None) else str(a["variant"])


def _lr(a: dict) -> str:
  return f"{a['lr']:g}" if a["lr"] is not None else "-"


def references(arms: Sequence[dict], reference: str) -> dict:
  """``{learning rate: the reference variant's first arm at it}``."""
  out: dict = {}
  for a in arms:
    if a["variant"] == reference:
      out.setdefault(a["lr"], a)
  return out


# ---------------------------------------------------------------------------
# The design block.


def _data_words(cfg: dict) -> str:
  d = cfg.get("data") or {}
  name = d.get("name")
  if name == "bigram_backcopy":
    return (
      f"bigram-backcopy (Guo et al. 2024): {d.get('bb_vocab_size')} ordinary tokens and BOS, "
      f"{d.get('bb_num_triggers')} of them triggers (the next token copies the one before the "
      f"trigger), bigram chain of task seed {d.get('bb_task_seed')}; BOS at position 0"
    )
  if name == "shakespeare":
    return f"Shakespeare's plays ({d.get('tokenizer')}-level), BOS at position 0"
  return f"{name} ({d.get('path')}, {d.get('tokenizer')}-level)"


def _model_words(cfg: dict, params: list[int]) -> str:
  m = cfg.get("model") or {}
  heads = m.get("num_heads") or 1
  kv = m.get("num_kv_heads") or heads
  mlp = (
    "no MLP (attention only)"
    if m.get("mlp") == "none"
    else f"{m.get('mlp')} MLP x{m.get('mlp_ratio')}"
  )
  p = sorted(set(params))
  count = (
    "-"
    if not p
    else (f"{p[0]:,} parameters" if len(p) == 1 else f"{p[0]:,}-{p[-1]:,} parameters over the arms")
  )
  return (
    f"{m.get('num_layers')} layer(s), width {m.get('d_model')}, {heads} head(s) of dim "
    f"{m.get('d_model', 0) // heads}"
    + (f" ({kv} key/value heads)" if kv != heads else "")
    + f", {mlp}, {m.get('norm')} norm, {'RoPE' if m.get('rope') else 'no positions'}, "
    f"{'tied' if m.get('tie_embeddings') else 'untied'} embeddings, {m.get('dtype')}; {count}"
  )


def _optimiser_words(cfg: dict) -> str:
  o = cfg.get("opt") or {}
  return (
    f"AdamW (b1 {o.get('b1')}, b2 {o.get('b2')}, eps {o.get('eps'):g}), independent weight "
    f"decay {o.get('weight_decay'):g} on matrices, global-norm clipping "
    f"{o.get('clip'):g}, linear warmup over {100 * o.get('warmup_frac'):g}% of the steps then "
    f"cosine decay to {100 * o.get('min_lr_frac'):g}% of the peak; z-loss {o.get('z_loss'):g}"
  )


def _count(n: int) -> str:
  return f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,}"


def design(root: str, rows: Sequence[dict], arms: Sequence[dict], sessions: Sequence[dict]) -> str:
  """The design block: model, data and tokens, length, steps, batch, optimiser, learning
  rates, seeds, probes, and the machine with its measured load."""
  if not rows:
    return "## Design\n\nNo runs.\n"
  cfgs = [rundir.read_json(rundir.RunDir(os.path.join(root, r["arm"])).config) or {} for r in rows]
  cfg = cfgs[0]
  d, t = cfg.get("data") or {}, cfg.get("train") or {}
  steps = t.get("steps") or 0
  tokens = steps * (d.get("batch_size") or 0) * (d.get("seq_len") or 0)
  by_lr: dict = {}
  for a in arms:
    by_lr.setdefault(a["lr"], []).append(str(a["variant"]))
  seeds = sorted({s for a in arms for s in a["seeds"] if s is not None})
  per_arm = sorted({a["n"] for a in arms})
  groups = [
    (rundir.RunDir(os.path.join(root, r["arm"])).read_summary() or {}).get("seed_group") or {}
    for r in rows
  ]
  stacked = [g for g in groups if g.get("stacked")]
  how = sorted({g.get("stacking", "vmap") for g in stacked})
  how = " / ".join({"map": "jax.lax.map", "vmap": "jax.vmap"}.get(h, h) for h in how)
  micro = t.get("microbatches") or 1
  lines = [
    f"- **model**: {_model_words(cfg, [r['num_params'] for r in rows if r.get('num_params')])}",
    f"- **data**: {_data_words(cfg)}",
    f"- **length and batch**: T = {d.get('seq_len')} tokens per sequence, batch "
    f"{d.get('batch_size')}" + (f" ({micro} accumulated microbatches)" if micro > 1 else ""),
    f"- **steps and tokens**: {steps} steps, {_count(tokens)} tokens per run, "
    f"{_count(tokens * len(rows))} over the {len(rows)} runs",
    f"- **optimiser**: {_optimiser_words(cfg)}",
    "- **learning rates**: "
    + "; ".join(
      f"{lr:g} ({', '.join(vs)})" if lr is not None else ", ".join(vs) for lr, vs in by_lr.items()
    ),
    f"- **seeds**: {', '.join(map(str, seeds)) or '-'} "
    f"({'/'.join(map(str, per_arm))} per arm; the seed sets the initialisation and the "
    f"training batches"
    + (
      f"; {len(stacked)} of {len(rows)} runs trained stacked: one step per arm over its "
      f"seeds, {how})"
      if stacked
      else ")"
    ),
    f"- **probes**: {t.get('probe_batch')} held-out sequences of length {t.get('probe_len')} "
    f"every {t.get('probe_every')} steps and at the end; validation on "
    f"{t.get('eval_batches')} batch(es)",
  ]
  lines += [f"- **{label}**: {words}" for label, words in host.describe(list(sessions))]
  return "## Design\n\n" + "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# The summary over seeds and its significance.


def summary_table(arms: Sequence[dict], reference: str, columns: Sequence[str] = SUMMARY) -> str:
  """Mean ± spread of each column per arm, marked against ``reference`` at the same LR."""
  refs = references(arms, reference)
  lines = [
    "| arm | LR | seeds | diverged | " + " | ".join(HEADERS[c] for c in columns) + " |",
    "|---|---:|---:|---:|" + "---:|" * len(columns),
  ]
  for a in arms:
    ref = refs.get(a["lr"])
    cells = []
    for c in columns:
      text = fmt_spread(a[c], DIGITS[c])
      if ref is not None and ref is not a and a[c] is not None:
        text += " " + MARKS[differs(a[c], ref[c])]
      cells.append(text.strip())
    lines.append(
      f"| {_label(a)} | {_lr(a)} | {a['n']} | {a['diverged']} | " + " | ".join(cells) + " |"
    )
  return "\n".join(lines) + "\n"


def significance(
  arms: Sequence[dict], reference: str, columns: Sequence[str] = SUMMARY
) -> list[str]:
  """Words for each column: which arms differ from the reference beyond the seed spread,
  and which are within noise of it."""
  out = []
  for lr, ref in references(arms, reference).items():
    others = [a for a in arms if a["lr"] == lr and a is not ref]
    if not others:
      continue
    for c in columns:
      if ref[c] is None:
        continue
      groups: dict = {1: [], -1: [], 0: [], None: []}
      for a in others:
        if a[c] is not None:
          groups[differs(a[c], ref[c])].append(f"{_label(a)} ({fmt_spread(a[c], DIGITS[c])})")
      parts = []
      if groups[1]:
        parts.append("higher beyond the seed spread: " + ", ".join(groups[1]))
      if groups[-1]:
        parts.append("lower beyond the seed spread: " + ", ".join(groups[-1]))
      if groups[0]:
        parts.append("within noise: " + ", ".join(g.split(" (")[0] for g in groups[0]))
      if groups[None]:
        parts.append(
          "one seed, no spread to judge: " + ", ".join(g.split(" (")[0] for g in groups[None])
        )
      if parts:
        out.append(
          f"- **{HEADERS[c]}** at LR {lr:g} against {reference} ({fmt_spread(ref[c], DIGITS[c])}): "
          + "; ".join(parts)
          + "."
        )
  return out


# ---------------------------------------------------------------------------
# Sinks against uniform attention and initialisation.


def sink_formed(probe: dict, *, f_min: float = 0.5, rate_min: float = 50.0) -> bool:
  """The sink criterion on a run's last probe: some layer puts at least ``f_min`` of its
  attention on the first token (the raw weight where recorded, so that a null column's
  mass does not count, else F-Attn) and has Sink_1^0.3 of at least ``rate_min`` percent."""
  f = probe.get("f_attn/raw_per_layer") or probe.get("f_attn/per_layer") or []
  s = probe.get("sink_rate/per_layer") or []
  return any(
    fl is not None and sl is not None and fl >= f_min and sl >= rate_min for fl, sl in zip(f, s)
  )


def _init_to_final(a: dict, key: str) -> str:
  return f"{fmt_spread(a[key + '_init'], DIGITS[key])} → {fmt_spread(a[key], DIGITS[key])}"


def sinks_section(arms: Sequence[dict]) -> str:
  """The sink metrics of every arm from initialisation to the end, beside uniform attention's,
  and a sentence per arm that formed a sink (or one saying none did)."""
  shown = [a for a in arms if a["f_attn"] is not None or a["first_token"] is not None]
  if not shown:
    return ""
  lines = [
    "## Sinks against uniform attention and initialisation\n",
    "Last probe, mean ± spread over seeds. *uniform*: the metric for attention spread evenly "
    "over each query's allowed keys at the probe's length and mask, computed exactly "
    "(`attnjax.stats` on uniform weights); *init*: the first probe, before any step. "
    "F-Attn (Qiu et al. 2025) renormalises each row; the first-token weight does not, so a "
    "null column's mass (softmax_one, sink logits) does not count as BOS's. A seed *forms a "
    "sink* when some layer puts at least 0.5 of its (raw) attention on the first token with "
    "Sink_1^0.3 (Gu et al. 2024) at least 50%.\n",
    "| arm | LR | mask | F-Attn: init → last (uniform) | first-token weight: init → last | "
    "Sink_1^0.3 %: init → last (uniform) | entropy: init → last (uniform) | null mass | sink formed |",
    "|---|---:|---|---|---|---|---|---:|---:|",
  ]
  words = []
  for a in shown:
    base = a["baseline"]
    u = (lambda k, d: f" ({number(base[k], d)})") if base else (lambda k, d: " (-)")
    forms = sum(sink_formed(r.get("last_probe") or {}) for r in a["runs"])
    a["formed"] = forms
    lines.append(
      f"| {_label(a)} | {_lr(a)} | {baselines.describe_mask(base) if base else 'not causal'} | "
      f"{_init_to_final(a, 'f_attn')}{u('f_attn', 3)} | {_init_to_final(a, 'first_token')} | "
      f"{_init_to_final(a, 'sink_rate')}{u('sink_rate', 0)} | "
      f"{_init_to_final(a, 'probe_entropy')}{u('entropy', 2)} | {fmt_spread(a['null_mass'], 3)} | "
      f"{forms} of {a['n']} |"
    )
    if forms:
      f = a["first_token"] or a["f_attn"]
      times = f" ({f.mean / base['first_token']:.1f}x uniform)" if base and f else ""
      words.append(
        f"- A sink formed in **{_label(a)}** at LR {_lr(a)} in {forms} of {a['n']} seeds: "
        f"first-token weight {fmt_spread(f, 3)} against {number(base['first_token'], 3) if base else '-'} "
        f"for uniform attention{times} and {fmt_spread(a['first_token_init'] or a['f_attn_init'], 3)} "
        f"at initialisation."
      )
    elif a["null_mass"] is not None and a["null_mass"].mean > 0.5:
      words.append(
        f"- {_label(a)} at LR {_lr(a)}: no sink on the first token (first-token weight "
        f"{fmt_spread(a['first_token'], 3)}), but its null column takes "
        f"{fmt_spread(a['null_mass'], 2)} of each row (seeds: "
        f"{', '.join(number(v, 2) for v in a['null_mass'].values)}): where it takes most, "
        f"the learned null logit is the sink. Its F-Attn ({fmt_spread(a['f_attn'], 2)}) "
        f"renormalises what is left of the rows."
      )
  if not any(a.get("formed") for a in shown):
    top = max(
      shown,
      key=lambda a: (
        (a["first_token"] or a["f_attn"]).mean if (a["first_token"] or a["f_attn"]) else -1
      ),
    )
    f = top["first_token"] or top["f_attn"]
    words.insert(
      0,
      f"- **No sink formed in any arm at this scale** (largest first-token weight: "
      f"{_label(top)}, {fmt_spread(f, 3)}; uniform attention gives "
      f"{number(top['baseline']['first_token'], 3) if top['baseline'] else '-'}).",
    )
  return "\n".join(lines) + "\n\n" + "\n".join(words) + "\n"


# ---------------------------------------------------------------------------
# The learning-rate axis.

STABILITY = ("final_loss", "max_logit_ever", "spike_score")


def stability_section(arms: Sequence[dict], reference: str) -> str:
  """Variants that run at several learning rates: final loss (a diverged run counts at its
  initial loss, Wortsman et al.'s convention), largest attention logit over training, loss
  spikes and divergences, and at each LR which separate from ``reference`` beyond the spread."""
  variants: dict = {}
  per_lr: dict = {}
  for a in arms:
    variants.setdefault(a["variant"], set()).add(a["lr"])
    per_lr[a["lr"]] = per_lr.get(a["lr"], 0) + 1
  base = max(per_lr, key=lambda lr: (per_lr[lr], -(lr or 0)))  # the LR most arms run at
  moved = {v for v, lrs in variants.items() if len(lrs) > 1 or base not in lrs}
  axis = [a for a in arms if a["variant"] in moved]
  if not axis:
    return ""
  axis.sort(key=lambda a: (a["lr"] or 0, a["variant"] != reference))
  lines = [
    "## Stability across learning rates (Wortsman et al. 2023)\n",
    "Variants run at more than one peak LR. Final loss: validation loss at the end, a "
    "diverged run counted at its initial loss; max logit: the largest attention logit over "
    "every training step; spike score: % of steps 7 sd above the rolling mean (OLMo 2). "
    "Marks against the reference at the same LR as in the summary.\n",
    "| arm | LR | seeds | diverged | " + " | ".join(HEADERS[c] for c in STABILITY) + " |",
    "|---|---:|---:|---:|" + "---:|" * len(STABILITY),
  ]
  refs = references(axis, reference)
  for a in axis:
    ref = refs.get(a["lr"])
    cells = []
    for c in STABILITY:
      text = fmt_spread(a[c], DIGITS[c])
      if ref is not None and ref is not a and a[c] is not None:
        text += " " + MARKS[differs(a[c], ref[c])]
      cells.append(text.strip())
    lines.append(
      f"| {_label(a)} | {_lr(a)} | {a['n']} | {a['diverged']} | " + " | ".join(cells) + " |"
    )
  words = significance(axis, reference, STABILITY)
  return "\n".join(lines) + "\n\n" + "\n".join(words) + "\n"


# ---------------------------------------------------------------------------
# The main job's targets.


def targets_section(
  arms: Sequence[dict],
  *,
  reference: str,
  stable: str,
  sink_free: Sequence[str],
  lr: float,
  factor: float = 3.0,
) -> str:
  """Whether the report shows what the main job is for: a sink in ``reference`` at ``lr`` of
  at least ``factor`` x uniform attention's first-token weight in every seed; every seed of
  each ``sink_free`` arm below half of the reference's lowest seed; and a stability metric
  on which ``stable`` and ``reference`` separate beyond the seed spread at a higher LR."""
  refs = references(arms, reference)
  ref = refs.get(lr)
  lines = ["## Targets\n"]
  if ref is None or ref["first_token"] is None:
    lines.append(
      f"- no {reference} arm at LR {lr:g} with a first-token weight: sink targets not judged"
    )
  else:
    f = ref["first_token"]
    base = ref["baseline"]
    if base:
      need = factor * base["first_token"]
      ok = min(f.values) >= need
      lines.append(
        f"- {reference} at LR {lr:g} puts {fmt_spread(f, 3)} of its attention on the first token, "
        f"{f.mean / base['first_token']:.1f}x uniform attention's {number(base['first_token'], 4)} "
        f"(target: at least {factor:g}x = {number(need, 3)} in every seed; lowest seed "
        f"{number(min(f.values), 3)}): **{'met' if ok else 'not met'}**."
      )
    floor = min(f.values) / 2
    for v in sink_free:
      a = next((x for x in arms if x["variant"] == v and x["lr"] == lr), None)
      if a is None or a["first_token"] is None:
        continue
      top = max(a["first_token"].values)
      lines.append(
        f"- {v}: first-token weight {fmt_spread(a['first_token'], 3)}; its highest seed, "
        f"{number(top, 3)}, against half of {reference}'s lowest seed, {number(floor, 3)}: "
        f"**{'met' if top < floor else 'not met'}**"
        + (
          f" (its F-Attn on renormalised rows is {fmt_spread(a['f_attn'], 2)}: the null column "
          f"takes {fmt_spread(a['null_mass'], 2)} of each row)"
          if a["null_mass"] is not None and a["null_mass"].mean > 0.1
          else ""
        )
        + "."
      )
  high = sorted({a["lr"] for a in arms if a["variant"] == stable and a["lr"] != lr and a["lr"]})
  for h in high:
    s = next(a for a in arms if a["variant"] == stable and a["lr"] == h)
    r = refs.get(h)
    if r is None:
      continue
    apart = [
      f"{HEADERS[c]} ({reference} {fmt_spread(r[c], DIGITS[c])}, {stable} {fmt_spread(s[c], DIGITS[c])})"
      for c in ("final_loss", "max_logit_ever", "spike_score")
      if differs(s[c], r[c])
    ]
    if r["diverged"] != s["diverged"]:
      apart.append(
        f"divergences ({reference} {r['diverged']} of {r['n']}, {stable} {s['diverged']} of {s['n']})"
      )
    lines.append(
      f"- stability at LR {h:g}: {reference} and {stable} separate beyond the seed spread in "
      + (", ".join(apart) if apart else "no metric")
      + f": **{'met' if apart else 'not met'}**."
    )
  if not high:
    lines.append(
      f"- no {stable} arm at a learning rate above {lr:g}: the stability target is not judged"
    )
  return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# Throughput of the bare step.


def throughput_section(root: str, arms: Sequence[dict], reference: str) -> str:
  """Tokens/s of each arm's compiled step alone, timed interleaved (``throughput.json``);
  ratios to the reference, "within noise" where the ranges over rounds overlap."""
  record = rundir.read_json(os.path.join(root, "throughput.json"))
  head = "## Throughput (bare step)\n"
  if not record:
    return head + (
      "Not measured: the arms trained in earlier sessions or in their own processes. "
      "Training-loop rates are not shown: they include probes, validation and checkpoints, "
      "and the machine's load moves them.\n"
    )
  by_dir = {os.path.normpath(os.path.abspath(x["run_dir"])): x for x in record["arms"]}
  rows = []
  for a in arms:
    x = by_dir.get(os.path.normpath(os.path.abspath(os.path.join(root, a["arm"]))))
    if x is not None:
      rows.append((a, x))
  if not rows:
    return ""
  ref = {a["lr"]: x for a, x in rows if a["variant"] == reference}
  load = record.get("load") or [None, None]
  lines = [
    head,
    f"Each arm's compiled training step alone (one call trains all its seeds), timed after "
    f"training in one window: {record['rounds']} rounds of {record['calls']} steps, every arm "
    f"once per round in an order rotated each round ({record.get('measured', '')}; load "
    f"average {number(load[0], 1)} before, {number(load[1], 1)} after). Median and range "
    f"over rounds; against {reference} at the same LR, *within noise* where the ranges "
    f"overlap. Seeds' summaries keep the loop's own rate, which includes probes and "
    f"evaluations; neither ranks arms.\n",
    f"| arm | LR | seeds per call | tokens/s (median) | range over rounds | vs {reference} |",
    "|---|---:|---:|---:|---|---|",
  ]
  import numpy as np

  for a, x in rows:
    rates = x["rates"]
    med = float(np.median(rates))
    r = ref.get(a["lr"])
    vs = "-"
    if r is not None and r is not x:
      rmed = float(np.median(r["rates"]))
      overlap = min(rates) <= max(r["rates"]) and min(r["rates"]) <= max(rates)
      vs = f"{med / rmed:.2f}x" + (" (within noise)" if overlap else "")
    lines.append(
      f"| {_label(a)} | {_lr(a)} | {x['seeds']} | {med:,.0f} | {min(rates):,.0f}-{max(rates):,.0f} | {vs} |"
    )
  return "\n".join(lines) + "\n"


def write_sections(
  root: str, rows: Sequence[dict], *, reference: str = "dense", targets: Optional[dict] = None
) -> tuple[list[dict], str, str]:
  """``(arms, design block, the other sections)`` of the runs ``rows`` under ``root``."""
  arms = arm_rows(rows)
  sessions = host.read_host(root)
  parent = os.path.dirname(os.path.normpath(root))
  if not sessions and parent:
    sessions = host.read_host(parent)  # e.g. sinks.py's per-dataset reports
  head = design(root, rows, arms, sessions)
  body = [
    "## Summary over seeds\n",
    legend() + " Val loss in nats per token at the end; max logit at the last training "
    "step (max over layers); F-Attn, first-token weight, Sink_1^0.3 and entropy at the last "
    "probe.\n",
    summary_table(arms, reference),
  ]
  words = significance(arms, reference)
  if words:
    body.append("\n".join(words) + "\n")
  for section in (
    sinks_section(arms),
    stability_section(arms, reference),
    targets_section(arms, **dict(targets, reference=reference)) if targets else "",
    throughput_section(root, arms, reference),
  ):
    if section:
      body.append(section)
  return arms, head, "\n".join(body)


def run_extras(run_path: str, config: Optional[dict]) -> dict:
  """The values a report row adds to the summary's: first and last probe, the uniform
  baseline at the run's probe length and mask, the seed."""
  probes = rundir.read_jsonl(rundir.RunDir(run_path).probes)
  first = probes[0] if probes and probes[0].get("step") == 0 else {}
  last = probes[-1] if probes else {}

  def mean(rec: dict, key: str) -> Optional[float]:
    v = rec.get(key)
    if isinstance(v, list):
      xs = [x for x in map(rundir.finite_or_none, v) if x is not None]
      return sum(xs) / len(xs) if xs else None
    return rundir.finite_or_none(v)

  return {
    "seed": (config or {}).get("seed"),
    "last_probe": last,
    "first_token": mean(last, "f_attn/raw"),
    "first_token_init": mean(first, "f_attn/raw"),
    "f_attn_init": mean(first, "f_attn/f_attn"),
    "sink_rate_init": mean(first, "sink_rate/rate"),
    "probe_entropy": mean(last, "entropy/mean"),
    "probe_entropy_init": mean(first, "entropy/mean"),
    "null_mass": mean(last, "null_mass/mean"),
    "baseline": baselines.run_baselines(config) if config else None,
  }


def final_loss(row: dict) -> Optional[float]:
  """Validation loss at the end; a diverged run counts at its initial loss (Wortsman et al.)."""
  if row["status"] == "diverged":
    return row.get("initial_loss")
  return row.get("val_loss")
