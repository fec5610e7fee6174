"""The readable reference of selected-block attention (NSA's selected branch).

Every engine of the selected branch (the block-wise gather in ``ops/nsa``, the Pallas kernels
in ``kernels/selected/``) computes :func:`selected_attention` and is tested equal to it. It
materialises the ``[B, K, G, T, S]`` logits: for tests and small shapes only.
Guide: docs/guides/sparse.md, section "Native sparse attention".
"""

from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp

from attnjax._src import logits, normalizers

Array = jnp.ndarray


def check_inputs(q: Array, k: Array, v: Array, block_idx: Array, *, block_size: int) -> None:
  """Raises ValueError / TypeError naming the argument for inputs outside the interface.

  Args:
    q: ``[B, T, N, H]``.
    k: ``[B, S, K, H]``.
    v: ``[B, S, K, Hv]``.
    block_idx: ``[B, T, K, n]`` integer selection-block indices, ``-1`` an unused slot.
    block_size: keys per selection block (``>= 1``).
  """
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(
      f"q, k, v must be rank 4 ([B, T, N, H], [B, S, K, H], [B, S, K, Hv]); got q {q.shape}, "
      f"k {k.shape}, v {v.shape}"
    )
  B, T, N, H = q.shape
  if k.shape[0] != B or k.shape[3] != H or v.shape[:3] != k.shape[:3]:
    raise ValueError(
      f"k must be [B, S, K, H] and v [B, S, K, Hv] for q {q.shape}; got k {k.shape}, v {v.shape}"
    )
  K = k.shape[2]
  if K == 0 or N % K:
    raise ValueError(f"query heads N={N} must be a multiple of key/value heads K={K}")
  if block_idx.ndim != 4 or block_idx.shape[:3] != (B, T, K):
    raise ValueError(f"block_idx must be [B, T, K, n] = [{B}, {T}, {K}, n]; got {block_idx.shape}")
  if not jnp.issubdtype(block_idx.dtype, jnp.integer):
    raise TypeError(f"block_idx must be an integer array; got dtype {block_idx.dtype}")
  if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
    raise ValueError(f"block_size must be a positive int; got {block_size!r}")


def selection_mask(block_idx: Array, num_keys: int, *, block_size: int) -> Array:
  """Which keys each query row may attend: ``[B, K, T, S]`` bool.

  Key ``s`` is allowed for query ``t`` when its block ``s // block_size`` is one of
  ``block_idx[b, t, kh, :]`` (a set: a block listed twice counts once; ``-1`` and indices
  outside ``[0, ceil(S / block_size))`` select nothing) and ``s <= t`` (causal; query ``t``
  sits at position ``t``).
  """
  S = num_keys
  T = block_idx.shape[1]
  key_block = jnp.arange(S, dtype=jnp.int32) // block_size  # [S]
  idx = jnp.moveaxis(block_idx.astype(jnp.int32), 1, 2)  # [B, K, T, n]
  chosen = jnp.any(
    idx[..., None, :] == key_block[None, None, None, :, None], axis=-1
  )  # [B, K, T, S]
  causal = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None]  # [T, S]
  return jnp.logical_and(chosen, causal[None, None])


def selected_attention(
  q: Array,
  k: Array,
  v: Array,
  block_idx: Array,
  *,
  block_size: int,
  scale: float,
  normalizer: str = "softmax",
  interpret: bool = False,
  return_lse: bool = False,
) -> Union[Array, tuple[Array, Array]]:
  """Attention of each query over the key blocks it selected, causal within them.

  Heads of one GQA group (query heads ``kh * G .. kh * G + G - 1`` with ``G = N // K``)
  share ``block_idx[:, :, kh]``. Logits ``scale * <q, k>`` in float32 (float64 for float64
  inputs, so the reference is exact there), then the normaliser over the allowed keys
  (:func:`selection_mask`); a row with no allowed key gives 0.

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, S, K, H]``.
    v: values ``[B, S, K, Hv]``.
    block_idx: ``[B, T, K, n]`` int32 selection-block indices; block ``j`` covers keys
      ``[j * block_size, (j + 1) * block_size)``; ``-1`` marks an unused slot. No gradient.
    block_size: keys per selection block.
    scale: multiplies ``<q, k>``.
    normalizer: a name of ``attnjax.normalizers.NORMALIZERS``.
    interpret: accepted for the kernels' signature; the reference has nothing to interpret.
    return_lse: also return the log-normaliser.

  Returns:
    ``out [B, T, N, Hv]`` in ``q``'s dtype, and with ``return_lse`` ``lse [B, T, N]``
    float32 (float64 for float64 inputs): the second result of ``normalizers.get(normalizer).weights`` (softmax: the
    logsumexp of the allowed logits; softmax_one with its null column; the others the plain
    logsumexp of the allowed logits), 0 on a row with no allowed key.
  """
  del interpret
  check_inputs(q, k, v, block_idx, block_size=block_size)
  nz = normalizers.get(normalizer)
  K = k.shape[2]
  work = jnp.promote_types(q.dtype, jnp.float32)  # float32, or float64 under x64
  qg = logits.group_queries(q.astype(work), K)  # [B, T, K, G, H]
  z = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(work)) * scale  # [B, K, G, T, S]
  allowed = selection_mask(jax.lax.stop_gradient(block_idx), k.shape[1], block_size=block_size)
  allowed = allowed[:, :, None]  # [B, K, 1, T, S]
  w, log_norm = nz.weights(z, allowed)
  w = jnp.where(allowed, w, 0.0)
  out = jnp.einsum("bkgts,bskh->btkgh", w, v.astype(work))
  B, T, N = q.shape[:3]
  out = jnp.reshape(out, (B, T, N, v.shape[-1])).astype(q.dtype)
  if not return_lse:
    return out
  has_key = jnp.any(allowed, axis=-1, keepdims=True)
  lse = jnp.where(has_key, log_norm, 0.0)[..., 0]  # [B, K, G, T]
  lse = jnp.reshape(jnp.moveaxis(lse, 3, 1), (B, T, N)).astype(work)
  return out, lse
