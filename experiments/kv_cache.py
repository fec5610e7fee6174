"""Held-out perplexity against cache bytes for each KV-cache policy.

    python experiments/kv_cache.py --config experiments/configs/kv_cache.py:preset=cpu

Trains (or resumes, or reuses) ``runs/kv_cache/train``, then decodes held-out
sequences of ``data.seq_len`` tokens one token at a time through the caches of
:mod:`attnjax.nn.kv_policies` (``full``, ``int8``, ``fp8``, and ``h2o`` and
``sinks_window`` with budgets of ``sweep.budgets`` x the length), with the same
trained parameters. Writes ``runs/kv_cache/report.md`` (the table),
``results.json`` and ``plots/perplexity_vs_bytes.png``. The last columns are
the bytes each policy would hold for the ``gpu`` preset model at
``sweep.gpu_len`` tokens (one sequence, budgets scaled to that length), by
:func:`attnjax.nn.cache_bytes_for`.
"""

from __future__ import annotations

import math
import os
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from attnjax import nn
from attnjax.nn import kv_policies
from attnjax.train import cli, rundir
from attnjax.train.config import apply_preset, as_list, base_config
from attnjax.train import init_distributed
from attnjax.train import model_config
from attnjax.train.plots import save_figure, subplots
from attnjax.train import train_or_load


def with_cache_policy(model: nnx.Module, mcfg: nn.ModelConfig, policy: str, budget) -> nnx.Module:
  """A copy of ``model`` (same parameters) whose layers decode through ``policy``."""
  layers = tuple(
    mcfg.attention_for(i).replace(cache_policy=policy, cache_budget=budget)
    for i in range(mcfg.num_layers)
  )
  other = nn.TransformerLM(mcfg.replace(layer_attention=layers), rngs=nnx.Rngs(0))
  nnx.update(other, nnx.state(model, nnx.Param))
  return other


@nnx.jit
def decoded_losses(model, inputs, targets):
  """``(per-token CE [B, T], final cache)`` decoding one token at a time (a scan)."""
  B, T = inputs.shape
  cache = model.init_cache(B, T)

  def step(cache, xs):
    token, target = xs
    logits, cache = model.decode(token[:, None], cache)
    return cache, optax.softmax_cross_entropy_with_integer_labels(logits[:, 0], target)

  cache, losses = jax.lax.scan(step, cache, (jnp.transpose(inputs), jnp.transpose(targets)))
  return jnp.transpose(losses), cache


def arms(policies: list[str], budgets: list[float], length: int) -> list[tuple[str, str, float]]:
  """``(name, policy, budget fraction or 0)`` of each arm, in table order."""
  out = []
  for policy in policies:
    if policy not in kv_policies.CACHE_POLICIES:
      raise ValueError(
        f"sweep.policies: {policy!r} is not one of: {', '.join(kv_policies.CACHE_POLICIES)}"
      )
    if policy not in kv_policies.EVICTING:
      out.append((policy, policy, 0.0))
      continue
    for f in budgets:
      if not 0 < f <= 1:
        raise ValueError(f"sweep.budgets: {f} must be a fraction in (0, 1]")
      out.append((f"{policy} {budget_for(f, length)}/{length}", policy, f))
  return out


def budget_for(fraction: float, length: int) -> int:
  return max(1, round(fraction * length))


def _mib(n: int) -> str:
  return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def main(argv=None) -> str:
  cfg, args = cli.parse(
    __doc__,
    "experiments/configs/kv_cache.py:preset=cpu",
    argv,
    default_out="runs/kv_cache",
    sweep=False,
  )
  init_distributed()
  t0 = time.perf_counter()
  model, trainer = train_or_load(cfg, os.path.join(args.out, "train"))
  batch = trainer.batches.batch(
    "heldout", 1, seq_len=cfg.data.seq_len, batch_size=cfg.sweep.eval_batch
  )
  markdown = evaluate(
    cfg, model, trainer.batches.model_vocab_size, batch.inputs, batch.targets, args.out
  )
  path = os.path.join(args.out, "report.md")
  rundir.write_atomic(path, markdown)
  print(markdown)
  print(f"wall time {time.perf_counter() - t0:.0f} s; report: {path}")
  return markdown


def evaluate(cfg, model: nnx.Module, vocab: int, inputs, targets, out: str) -> str:
  """Decodes ``inputs`` ``[B, L]`` through every arm; writes results, plot; returns the table."""
  inputs, targets = jnp.asarray(inputs), jnp.asarray(targets)
  L = inputs.shape[1]
  mcfg = model_config(cfg, vocab)
  gpu_cfg = apply_preset(base_config(), "gpu")
  gpu_cfg.variant = cfg.variant
  gpu_model = model_config(gpu_cfg, vocab)
  G = int(cfg.sweep.gpu_len)
  budgets = [float(b) for b in as_list(cfg.sweep.budgets)]

  forward = optax.softmax_cross_entropy_with_integer_labels(
    nnx.jit(lambda m, x: m(x))(model, inputs), targets
  )
  results = {"full forward (no cache)": {"loss": float(forward.mean()), "policy": None}}
  for name, policy, fraction in arms(as_list(cfg.sweep.policies), budgets, L):
    budget = budget_for(fraction, L) if fraction else None
    losses, cache = decoded_losses(with_cache_policy(model, mcfg, policy, budget), inputs, targets)
    gpu_budget = budget_for(fraction, G) if fraction else None
    results[name] = {
      "policy": policy,
      "budget": budget,
      "loss": float(losses.mean()),
      "cache_bytes": nn.cache_bytes(cache),
      "bytes_per_sequence": nn.cache_bytes_for(mcfg, policy, L, 1, budget=budget),
      "gpu_budget": gpu_budget,
      "gpu_bytes": nn.cache_bytes_for(gpu_model, policy, G, 1, budget=gpu_budget),
    }
  full = results.get("full")
  for r in results.values():
    r["perplexity"] = math.exp(r["loss"])
    if full is not None:
      r["ppl_vs_full_cache"] = r["perplexity"] / math.exp(full["loss"])
      if "gpu_bytes" in r:
        r["gpu_bytes_vs_full"] = r["gpu_bytes"] / full["gpu_bytes"]

  B = inputs.shape[0]
  lines = [
    f"# kv_cache ({cfg.preset}, {cfg.variant}, {mcfg.num_layers} layers, "
    f"trained and evaluated at T={L})\n",
    f"Held-out perplexity of {B} sequences of {L} tokens ({B * L} predictions), decoded "
    f"one token at a time through each cache policy, with the same parameters. Cache bytes: "
    f"what the caches hold after decoding the batch (keys, values, scales, scores, "
    f"positions), and per sequence. The gpu columns: the `gpu` preset model "
    f"({gpu_model.num_layers} layers, d_model {gpu_model.d_model}, {gpu_model.dtype}) "
    f"caching {G} tokens of one sequence, budgets scaled to {G}.\n",
    f"| arm | perplexity | / full cache | cache bytes | per sequence | gpu @ {G} | gpu / full |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  for name, r in results.items():
    if r["policy"] is None:
      lines.append(
        f"| {name} | {r['perplexity']:.3f} | "
        f"{r.get('ppl_vs_full_cache', float('nan')):.4f} | - | - | - | - |"
      )
      continue
    lines.append(
      f"| {name} | {r['perplexity']:.3f} | {r.get('ppl_vs_full_cache', float('nan')):.4f} | "
      f"{_mib(r['cache_bytes'])} | {_mib(r['bytes_per_sequence'])} | "
      f"{_mib(r['gpu_bytes'])} | {r.get('gpu_bytes_vs_full', float('nan')):.3f} |"
    )
  if full is not None and "int8" in results:
    ratio = results["int8"]["ppl_vs_full_cache"]
    lines.append(
      f"\nint8 / full-cache perplexity: {ratio:.4f} "
      f"({'within' if abs(ratio - 1) <= 0.01 else 'NOT within'} 1%)."
    )

  fig, ax = subplots(figsize=(7, 4.5))
  markers = {"full": "o", "int8": "s", "fp8": "D", "h2o": "^", "sinks_window": "v"}
  for policy in markers:
    pts = [
      (r["bytes_per_sequence"], r["perplexity"], n)
      for n, r in results.items()
      if r["policy"] == policy
    ]
    if pts:
      x, y, names = zip(*sorted(pts))
      ax.plot(x, y, marker=markers[policy], lw=1, label=policy)
      for xi, yi, n in zip(x, y, names):
        ax.annotate(
          n.split(" ")[-1] if " " in n else "",
          (xi, yi),
          fontsize=7,
          textcoords="offset points",
          xytext=(4, 4),
        )
  ax.set_xscale("log")
  ax.set(
    xlabel=f"cache bytes per sequence (T={L})",
    ylabel="held-out perplexity",
    title="perplexity vs KV-cache bytes",
  )
  ax.legend(fontsize=8)
  save_figure(fig, os.path.join(out, "plots", "perplexity_vs_bytes.png"))
  lines.append("\n![perplexity_vs_bytes.png](plots/perplexity_vs_bytes.png)\n")
  rundir.write_json(os.path.join(out, "results.json"), results)
  return "\n".join(lines)


if __name__ == "__main__":
  main()
