"""Selected-block attention in plain JAX over gathered blocks: the kernels' twin.

:func:`gathered` gathers each (token, key/value head)'s selected key blocks (``n *
block_size`` keys, never the ``[T, S]`` logits) and applies the normaliser's materialised
weights. Differentiable in every mode: the kernels' forward mode and second order go
through it, and ``python -m attnjax.check`` compares the kernels with it in float32.
Guide: docs/guides/kernels.md, section "Selected-block attention kernels".
"""

from __future__ import annotations

import jax.numpy as jnp

from attnjax._src import normalizers
from attnjax._src.kernels.selected.plan import Plan, canonical_blocks, slot_valid

Array = jnp.ndarray


def gathered(plan: Plan, q: Array, k: Array, v: Array, block_idx: Array):
  """``out [B, T, N, Hv]`` in ``q``'s dtype and ``lse [B, T, N]`` float32 (0 on a row with no
  key) of a planned call (see :func:`attnjax._src.kernels.selected.selected_attention`)."""
  B, T, N, K, G, bs, n = plan.B, plan.T, plan.N, plan.K, plan.G, plan.block_size, plan.n
  blocks = canonical_blocks(block_idx, plan)
  pos = blocks.idx[..., None] * bs + jnp.arange(bs, dtype=jnp.int32).reshape(1, 1, 1, 1, bs)
  t = jnp.arange(T, dtype=jnp.int32)[None, :, None, None, None]
  ok = slot_valid(blocks)[..., None] & (pos <= t) & (pos < plan.S)
  pos = jnp.reshape(jnp.minimum(pos, plan.S - 1), (B, T, K, n * bs))
  ok = jnp.reshape(ok, (B, T, K, n * bs))
  b = jnp.arange(B)[:, None, None, None]
  kh = jnp.arange(K)[None, None, :, None]
  kg, vg = k[b, pos, kh], v[b, pos, kh]  # [B, T, K, L, H]
  qg = jnp.reshape(q, (B, T, K, G, plan.H))
  z = jnp.einsum("btkgh,btklh->btkgl", qg.astype(jnp.float32), kg.astype(jnp.float32)) * plan.scale
  L = n * bs
  z = jnp.reshape(z, (B, T, N, L))
  allowed = jnp.reshape(jnp.broadcast_to(ok[:, :, :, None, :], (B, T, K, G, L)), (B, T, N, L))
  w, log_norm = normalizers.get(plan.normalizer).weights(z, allowed)
  w = jnp.where(allowed, w, 0.0)
  out = jnp.einsum("btkgl,btklh->btkgh", jnp.reshape(w, (B, T, K, G, L)), vg.astype(jnp.float32))
  out = jnp.reshape(out, (B, T, N, plan.Hv)).astype(q.dtype)
  has_key = jnp.any(allowed, axis=-1)
  lse = jnp.where(has_key, log_norm[..., 0], 0.0).astype(jnp.float32)
  return out, lse
