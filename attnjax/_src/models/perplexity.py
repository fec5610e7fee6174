"""A long sequence's perplexity in O(T) memory: :func:`token_nll` from the final features.

Implementation of :func:`attnjax.models.token_nll`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attnjax._src.deprecation import warn_once
from attnjax._src.nn import statistics
from attnjax._src.nn.transformer import TransformerLM

Array = jnp.ndarray


def layer_statistics(model: TransformerLM, tokens: Array):
  """Deprecated: ``attnjax.nn.layer_stats(model, tokens, view="streaming")``.

  ``(features [B, T, D], [per-layer dict])`` of one forward pass in O(T) memory:
  the view's ``"features"`` and ``"layers"`` as a pair.
  """
  warn_once(
    "attnjax.models.probe.layer_statistics",
    "attnjax.nn.layer_stats(model, tokens, view='streaming')",
  )
  out = statistics.layer_stats(model, tokens, view="streaming")
  return out["features"], out["layers"]


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
