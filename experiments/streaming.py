"""Evaluate window caches with 0 and 4 sink tokens at 4x the training length (StreamingLLM).

    python experiments/streaming.py --config experiments/configs/streaming.py:preset=cpu

Trains (or resumes, or reuses) ``runs/streaming/train``, then decodes
held-out sequences of ``length_factor * seq_len`` tokens one token at a time
through each cache. Writes ``runs/streaming/report.md`` (loss and perplexity
per position segment) and ``plots/loss_by_position.png``.
"""

from __future__ import annotations

import math
import os
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from attnjax import nn
from attnjax.train import cli, rundir
from attnjax.train import init_distributed
from attnjax.train import model_config
from attnjax.train.plots import save_figure, subplots
from attnjax.train import train_or_load
from attnjax.train.config import as_list


def with_attention(model: nnx.Module, cfg, vocab_size: int, **changes) -> nnx.Module:
  """A copy of ``model`` whose attention config has ``changes`` (same parameters)."""
  mcfg = model_config(cfg, vocab_size)
  mcfg = mcfg.replace(attention=mcfg.attention.replace(**changes))
  other = nn.TransformerLM(mcfg, rngs=nnx.Rngs(0))
  nnx.update(other, nnx.state(model, nnx.Param))
  return other


def token_losses_full(model, inputs, targets) -> np.ndarray:
  logits = nnx.jit(lambda m, x: m(x))(model, inputs)
  return np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def token_losses_streaming(model, inputs, targets, cache_len: int) -> np.ndarray:
  """Per-token CE decoding one token at a time through the model's (rolling) cache."""
  B, T = inputs.shape
  cache = model.init_cache(B, T)
  out = []
  for t in range(T):
    logits, cache = nn.decode_step(model, inputs[:, t : t + 1], cache)
    out.append(optax.softmax_cross_entropy_with_integer_labels(logits[:, 0], targets[:, t]))
  return np.asarray(jnp.stack(out, axis=1))


def main(argv=None) -> str:
  cfg, args = cli.parse(
    __doc__,
    "experiments/configs/streaming.py:preset=cpu",
    argv,
    default_out="runs/streaming",
    sweep=False,
  )
  init_distributed()
  t0 = time.perf_counter()
  model, trainer = train_or_load(cfg, os.path.join(args.out, "train"))
  T = cfg.data.seq_len
  L = cfg.sweep.length_factor * T
  batch = trainer.batches.batch("heldout", 1, seq_len=L, batch_size=cfg.sweep.eval_batch)
  inputs, targets = jnp.asarray(batch.inputs), jnp.asarray(batch.targets)
  vocab = trainer.batches.model_vocab_size

  arms = {f"full causal ({L} keys)": token_losses_full(model, inputs, targets)}
  for sinks in (int(s) for s in as_list(cfg.sweep.num_sinks)):
    if not 0 <= sinks < T:
      raise ValueError(f"sweep.num_sinks: {sinks} must be in [0, data.seq_len={T})")
    # T keys in the cache: `sinks` first tokens plus a window of T - sinks (query included).
    changes = dict(window=T - sinks - 1, num_sinks=sinks)
    if sinks:
      changes["streaming_rope"] = "cache"
    streaming = with_attention(model, cfg, vocab, **changes)
    arms[f"window cache {T}, {sinks} sinks"] = token_losses_streaming(streaming, inputs, targets, T)

  segments = [(s, s + T) for s in range(0, L, T)]
  lines = [
    f"# streaming ({cfg.preset}, {cfg.variant}, trained at T={T}, evaluated at {L})\n",
    f"Mean next-token loss (nats; perplexity in brackets) of {cfg.sweep.eval_batch} held-out "
    f"sequences, by position. Cache arms decode one token at a time; sink arms keep the "
    f"first tokens (BOS first) and rotate keys by cache position (StreamingLLM).\n",
    "| arm | " + " | ".join(f"pos {a}-{b - 1}" for a, b in segments) + " | all |",
    "|---|" + "---:|" * (len(segments) + 1),
  ]
  results = {}
  for name, losses in arms.items():
    seg = [float(losses[:, a:b].mean()) for a, b in segments]
    results[name] = {
      "segments": seg,
      "all": float(losses.mean()),
      "per_position": losses.mean(0).tolist(),
    }
    lines.append(
      f"| {name} | "
      + " | ".join(f"{x:.3f} ({math.exp(x):.1f})" for x in seg)
      + f" | {losses.mean():.3f} ({math.exp(losses.mean()):.1f}) |"
    )
  fig, ax = subplots(figsize=(7, 4.5))
  for name, r in results.items():
    y = np.convolve(r["per_position"], np.ones(8) / 8, mode="valid")
    ax.plot(np.arange(len(y)) + 4, y, lw=1, label=name)
  ax.axvline(T, color="k", lw=0.6, ls="--")
  ax.set(
    xlabel="position",
    ylabel="loss (nats, 8-token moving mean)",
    title="loss by position beyond the training length",
  )
  ax.legend(fontsize=8)
  save_figure(fig, os.path.join(args.out, "plots", "loss_by_position.png"))
  lines.append("\n![loss_by_position.png](plots/loss_by_position.png)\n")
  rundir.write_json(os.path.join(args.out, "results.json"), results)
  markdown = "\n".join(lines)
  path = os.path.join(args.out, "report.md")
  rundir.write_atomic(path, markdown)
  print(markdown)
  print(f"wall time {time.perf_counter() - t0:.0f} s; report: {path}")
  return markdown


if __name__ == "__main__":
  main()
