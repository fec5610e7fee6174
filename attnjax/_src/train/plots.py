"""PNG plots of one run directory (loss, max logit per layer, F-Attn, log Z).

Implementation behind the public module :mod:`attnjax.train.plots`.
"""

from __future__ import annotations

import os

from matplotlib.figure import Figure

from attnjax._src.train import rundir


def subplots(nrows: int = 1, ncols: int = 1, **kwargs):
  """``(fig, axes)`` as pyplot's ``subplots`` gives, on a bare ``Figure``.

  Writing PNGs needs no pyplot backend, so importing this module leaves the
  caller's backend alone (a notebook keeps showing figures inline).
  """
  fig = Figure(figsize=kwargs.pop("figsize", None))
  return fig, fig.subplots(nrows, ncols, **kwargs)


def save_figure(fig, path: str) -> None:
  """Writes ``fig`` as a PNG at ``path`` atomically, creating its folder.

  The image goes to a temporary file beside ``path`` and is moved over it
  (``os.replace``), so a reader never sees a half-written plot.
  """
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp.{os.getpid()}.png"
  fig.savefig(tmp, dpi=100, bbox_inches="tight")
  os.replace(tmp, path)


def per_layer_series(records: list[dict], key: str) -> list[list[float]]:
  """``[[layer0 values over steps], [layer1 ...]]`` of a per-layer metric (NaN for missing)."""
  rows = [r[key] for r in records if isinstance(r.get(key), list)]
  if not rows:
    return []
  return [
    [(row[i] if row[i] is not None else float("nan")) for row in rows] for i in range(len(rows[0]))
  ]


def plot_run(run: rundir.RunDir) -> list[str]:
  """Writes ``plots/training.png`` (4 panels); returns the written paths."""
  metrics = rundir.read_jsonl(run.metrics)
  train = [r for r in metrics if r.get("kind") == "train"]
  val = [r for r in metrics if r.get("kind") == "val"]
  if not train:
    return []
  steps = [r["step"] for r in train]
  fig, axes = subplots(2, 2, figsize=(10, 7))
  ax = axes[0, 0]
  ax.plot(steps, [r["loss"] for r in train], label="train", lw=0.8)
  if val:
    ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val")
  ax.set(xlabel="step", ylabel="cross-entropy (nats)", title="loss")
  ax.legend()
  for ax, key, title, ylabel in (
    (axes[0, 1], "max_logit", "max attention logit", "max logit q.k * scale"),
    (axes[1, 0], "f_attn", "F-Attn (weight on BOS)", "attention weight on the first token"),
  ):
    for i, series in enumerate(per_layer_series(train, key)):
      ax.plot(steps, series, label=f"layer {i}", lw=0.8)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    if ax.lines:
      ax.legend()
  ax = axes[1, 1]
  ax.plot(steps, [r.get("log_z", float("nan")) for r in train], lw=0.8)
  ax.set(xlabel="step", ylabel="log Z (nats)", title="mean log Z of output logits")
  fig.tight_layout()
  path = os.path.join(run.plots, "training.png")
  save_figure(fig, path)
  return [path]
