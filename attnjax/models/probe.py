"""Sink statistics of a long sequence in O(T) memory: one forward pass, nothing ``T x T``.

:func:`layer_statistics` runs a model once under ``nnx.capture`` and keeps, per layer,
the :class:`~attnjax.AttentionStats` its attention function computed in the fused
pass (``sink_mass``, ``entropy``, ``max_logit``, ``logsumexp``, ``row_sum``; with
the block-wise implementation no weights are materialised), the value-state drain
of each key/value head (reduced from the value projection inside the same program),
and the block's largest and median ``|hidden|``. :func:`token_nll` takes the output
logits of a few positions at a time from the final features, so a long sequence's
perplexity never holds ``[T, V]`` logits. ``experiments/pretrained.py`` and the
``pretrained`` suite of ``experiments/bench.py`` run both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attnjax import stats
from attnjax.nn import intermediates
from attnjax.nn.transformer import TransformerLM

Array = jnp.ndarray


@nnx.jit
def layer_statistics(model: TransformerLM, tokens: Array):
  """``(features [B, T, D], [per-layer dict])`` of one forward pass of ``tokens`` ``[B, T]``.

  Each layer's dict holds the non-None ``AttentionStats`` fields (``[B, N]``;
  ``logsumexp`` ``[B, N, T]``), ``value_drain`` ``[1, K]`` (Guo et al.'s
  ``||v_1|| / mean ||v_j>1||`` per key/value head, averaged over the batch:
  :func:`attnjax.stats.value_state_drain`), and ``hidden_max_abs`` /
  ``hidden_median_abs`` ``[B]`` of the block's output. The value projections
  are reduced inside this program and never returned.
  """
  def forward(m, t):
    return m.features(t)

  features, inter = nnx.capture(forward, nnx.Intermediate,
                                method_outputs=nnx.Intermediate)(model, tokens)
  recorded = intermediates.read(inter, len(model.blocks))
  out = []
  for block, layer in zip(model.blocks, recorded.layers):
    st = layer["attention/attention_stats"]
    fields = {k: x for k, x in st._asdict().items() if x is not None}
    v = layer["attention/v_proj/__call__"]  # [B, T, K * Hv]
    v = jnp.reshape(v, v.shape[:2] + (block.attention.num_kv_heads, -1))
    out.append(dict(fields, value_drain=stats.value_state_drain(v).per_head,
                    hidden_max_abs=layer["hidden_max_abs"],
                    hidden_median_abs=layer["hidden_median_abs"]))
  return features, out


@nnx.jit(static_argnames=("chunk",))
def token_nll(model: TransformerLM, features: Array, targets: Array, *, chunk: int = 512):
  """Per-token negative log-likelihood ``[B, T]`` of ``targets`` from the model's features.

  ``features`` ``[B, T, D]`` are :meth:`~attnjax.nn.TransformerLM.features`.
  The output logits of ``chunk`` positions at a time (``jax.lax.map``): memory
  ``B chunk V`` instead of ``B T V``.
  """
  B, T, D = features.shape
  chunk = max(1, min(int(chunk), T))
  pad = (-T) % chunk
  f = jnp.pad(features, ((0, 0), (0, pad), (0, 0)))
  t = jnp.pad(targets, ((0, 0), (0, pad)))
  f = jnp.moveaxis(jnp.reshape(f, (B, -1, chunk, D)), 1, 0)
  t = jnp.moveaxis(jnp.reshape(t, (B, -1, chunk)), 1, 0)

  def one(args):
    fc, tc = args
    logits = model.output_logits(fc)
    picked = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked

  nll = jax.lax.map(one, (f, t))
  return jnp.reshape(jnp.moveaxis(nll, 0, 1), (B, -1))[:, :T]
