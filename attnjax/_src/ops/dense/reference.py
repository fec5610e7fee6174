"""The readable dense engine, ``implementation="reference"`` (:func:`attnjax.dense.reference`).

It lives beside :mod:`attnjax.dense` rather than in it so that a dense call, once dispatched by
the op (``attnjax/_src/op.py``), never returns into the module that dispatched it.
"""

from __future__ import annotations

import jax.numpy as jnp

from attnjax._src import logits, masks, normalizers, options
from attnjax._src.attention_stats import stats_from_weights


def reference(inputs: options.DenseInputs, opts: options.DenseOptions, *, positions=None):
  """Materialises the ``[B, N, T, S]`` logits and weights; obviously correct.

  Order on the float32 logits: ``scale`` (and similarity), ``softcap``,
  ``bias``, then ``score_mod``; ``mask_mod`` joins every other mask; then the
  normaliser. ``positions``: None, or int ``(q_positions [T], k_positions [S])``,
  the positions the modifiers see (a subset of rows of a longer call).
  """
  q, k, v = inputs.q, inputs.k, inputs.v
  B, T, N, H = q.shape
  _, S, K, Hv = v.shape
  s = logits.scores(logits.group_queries(q, K), k, scale=opts.scale, similarity=opts.similarity)
  z, _ = logits.capped_logits(jnp.reshape(s, (B, N, T, S)), opts.softcap, inputs.bias)
  allowed = masks.make_attention_mask(
    T,
    S,
    mask=inputs.mask,
    is_causal=opts.is_causal,
    window=opts.window,
    q_segment_ids=inputs.q_segment_ids,
    kv_segment_ids=inputs.kv_segment_ids,
  )
  if opts.score_mod is not None or opts.mask_mod is not None:  # the indices they read
    q_pos, k_pos = (jnp.arange(T), jnp.arange(S)) if positions is None else positions
    grid = logits.index_grid(B, (N,), q_pos, k_pos)
    z = options.apply_score_mod(opts, inputs.score_mod_args, z, *grid)
    allowed = masks.combine_masks(
      allowed, options.apply_mask_mod(opts, inputs.mask_mod_args, *grid)
    )
  if allowed is None:
    allowed = jnp.ones((1, 1, 1, 1), bool)
  sink = None if inputs.sink_logits is None else inputs.sink_logits.astype(jnp.float32)
  # The name was validated (options.validate): the registry's normaliser itself.
  nz = normalizers.REGISTRY[opts.normalizer]
  if isinstance(nz, normalizers.WeightsOnly):
    params = {p.name: x for p, x in zip(nz.params, inputs.normalizer_params)}
    w, log_norm = nz.materialize(z, allowed, sink, params)
  else:
    w, log_norm = nz.weights(z, allowed, sink)
  w_grouped = jnp.reshape(w, (B, K, N // K, T, S))
  out = jnp.einsum("bkgts,bskh->btkgh", w_grouped, v.astype(jnp.float32))
  out = jnp.reshape(out, (B, T, N, Hv)).astype(q.dtype)
  if not opts.return_stats:
    return out
  return out, stats_from_weights(z, w, allowed, log_norm, opts.empty_row_logsumexp)
