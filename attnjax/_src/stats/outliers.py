"""Activation outliers and their cost under 8-bit quantisation (Bondarenko et al. 2023).

Per layer, at each position of the block (attention output, MLP output, residual stream):
the largest ``|x|`` (the infinity norm) and where it occurs, the average kurtosis, and the
share of the top outliers at delimiter tokens or at the first token; and the uniform
fake quantisation (W8A8) whose loss the paper reports beside the float loss.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import validators
from attnjax._src.stats.inputs import _stack_layers, shape_of

Array = jnp.ndarray

# The positions of a block the statistics read (the names the blocks sow them under).
POSITIONS = ("attn_out", "mlp_out", "hidden")


class OutlierStats(NamedTuple):
  """Outlier statistics of one position of every layer (each field ``[L]``).

  Attributes:
    max_inf_norm: ``max |x|`` over the batch, tokens and model dim (padding left out).
    max_token: the token position ``t`` of that largest entry (first sequence it occurs in).
    max_dim: its model dimension ``d``.
    kurtosis: the average over tokens of the kurtosis of each token's ``[D]`` vector.
    delimiter_share: of the ``top_k`` largest ``|x|`` entries, the share at delimiter tokens.
    first_token_share: of the same entries, the share at the first token (position 0).
  """

  max_inf_norm: Array
  max_token: Array
  max_dim: Array
  kurtosis: Array
  delimiter_share: Array
  first_token_share: Array


def outlier_arrays(
  x, tokens, delimiter_ids: tuple[int, ...], attention_mask=None, top_k: int = 100
) -> OutlierStats:
  """:func:`outlier_statistics` without its argument checks, traceable (static ids, top_k)."""
  x = _stack_layers("x", x, 3, "[B, T, D]")
  L, B, T, D = x.shape
  tokens = jnp.asarray(tokens)
  if tokens.shape != (B, T) or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(
      f"tokens must be int [B, T] = {(B, T)} like x {shape_of(x)}, got "
      f"{tokens.dtype} {shape_of(tokens)}"
    )
  valid = jnp.ones((B, T), bool)
  if attention_mask is not None:
    if np.shape(attention_mask) != (B, T):
      raise ValueError(
        f"attention_mask must be [B, T] = {(B, T)}, got shape {shape_of(attention_mask)}"
      )
    valid = jnp.asarray(attention_mask).astype(bool)
  mag = jnp.where(valid[None, :, :, None], jnp.abs(x), 0.0)  # padding never an outlier
  flat = jnp.reshape(mag, (L, B * T * D))
  index = jnp.argmax(flat, axis=-1)
  max_token = (index // D) % T
  max_dim = index % D
  centred = x - jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(centred**2, axis=-1)
  m4 = jnp.mean(centred**4, axis=-1)
  ok = jnp.logical_and(var > 0, valid[None])
  kurt = jnp.where(ok, m4 / jnp.where(ok, var, 1.0) ** 2, 0.0)
  kurtosis = jnp.sum(kurt, axis=(1, 2)) / jnp.maximum(jnp.sum(ok, axis=(1, 2)), 1)
  k = min(int(top_k), B * T * D)
  _, top = jax.lax.top_k(flat, k)  # [L, k]
  token_of = top // D  # index into B * T
  is_delim = jnp.isin(jnp.reshape(tokens, (-1,)), jnp.asarray(delimiter_ids, tokens.dtype))
  delimiter_share = jnp.mean(is_delim[token_of], axis=-1)
  first_token_share = jnp.mean(token_of % T == 0, axis=-1)
  return OutlierStats(
    max_inf_norm=jnp.max(flat, axis=-1),
    max_token=max_token.astype(jnp.int32),
    max_dim=max_dim.astype(jnp.int32),
    kurtosis=kurtosis,
    delimiter_share=delimiter_share.astype(jnp.float32),
    first_token_share=first_token_share.astype(jnp.float32),
  )


_outlier_jit = jax.jit(outlier_arrays, static_argnames=("delimiter_ids", "top_k"))


def outlier_statistics(
  x, tokens, *, delimiter_ids: Sequence[int] = (), attention_mask=None, top_k: int = 100
) -> OutlierStats:
  """Outliers of one position of every layer (Bondarenko et al. 2023, sec. 3 and 5).

  Definitions, per layer ``l`` over the batch's tokens (padding left out):
  ``max_inf_norm = max |x|`` (the infinity norm of the activation tensor) with the token
  position and dimension where it occurs; ``kurtosis``, the mean over tokens of the Pearson
  kurtosis ``E[(x - mu)^4] / sigma^4`` of each token's ``[D]`` vector (3 for a Gaussian,
  large when a few dimensions carry outliers; as :func:`attnjax.stats.kurtosis`); and, of the
  ``top_k`` entries of largest ``|x|``, the share at delimiter tokens (``[SEP]``, ``.``,
  ``,``: ``delimiter_ids``) and the share at the first token.

  Args:
    x: ``[L, B, T, D]`` (or ``[B, T, D]``, or a list per layer): one position of each
      block, e.g. the attention output, the MLP output or the residual stream.
    tokens: ``[B, T]`` int: the token ids (to find the delimiters).
    delimiter_ids: the delimiter token ids.
    attention_mask: ``[B, T]`` 1 for tokens, 0 for padding (None = no padding).
    top_k: how many of the largest entries the shares count.

  Returns:
    :class:`OutlierStats`, each field ``[L]``.

  References:
    Bondarenko, Nagel and Blankevoort 2023, "Quantizable Transformers: Removing Outliers
    by Helping Attention Heads Do Nothing" (max infinity norm, average kurtosis; outliers
    at delimiter tokens, sec. 3).
  """
  if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
    raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
  ids = tuple(int(i) for i in delimiter_ids)
  return _outlier_jit(x, tokens, ids, attention_mask, top_k)


def fake_quantize(x, *, bits: int = 8, symmetric: bool = True) -> Array:
  """Uniform per-tensor fake quantisation: ``x`` rounded to ``2**bits`` levels, in ``x``'s dtype.

  Symmetric (weights): step ``s = max|x| / (2**(bits-1) - 1)``, levels ``s * q`` for integer
  ``|q| <= 2**(bits-1) - 1``. Asymmetric (activations): step ``s = (max x - min x) /
  (2**bits - 1)`` and zero point ``z = round(-min x / s)``, levels ``s * (q - z)`` for
  ``0 <= q <= 2**bits - 1``. The range is the tensor's own (a per-tensor min-max range over
  the call's batch). An error of at most ``s / 2`` per entry (none at the range's ends).

  Args:
    x: any float array.
    bits: the integer width (8: W8A8).
    symmetric: the symmetric grid (weights) or the asymmetric one (activations).

  Returns:
    The quantised values, ``x``'s shape and dtype.

  References:
    Bondarenko et al. 2023, sec. 5 (W8A8, per-tensor, symmetric weights, asymmetric
    activations); Nagel et al. 2021, "A White Paper on Neural Network Quantization".
  """
  validators.check_floating("x", jnp.asarray(x))
  if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 16:
    raise ValueError(f"bits must be an int in [2, 16], got {bits!r}")
  x32 = jnp.asarray(x).astype(jnp.float32)
  if symmetric:
    levels = 2 ** (bits - 1) - 1
    step = jnp.max(jnp.abs(x32)) / levels
    safe = jnp.where(step > 0, step, 1.0)
    q = jnp.clip(jnp.round(x32 / safe), -levels, levels)
    out = q * safe
  else:
    levels = 2**bits - 1
    low, high = jnp.min(x32), jnp.max(x32)
    step = (high - low) / levels
    safe = jnp.where(step > 0, step, 1.0)
    zero = jnp.round(-low / safe)
    q = jnp.clip(jnp.round(x32 / safe) + zero, 0, levels)
    out = (q - zero) * safe
  return jnp.where(step > 0, out, x32).astype(jnp.asarray(x).dtype)


def quantization_step(x, *, bits: int = 8, symmetric: bool = True) -> Array:
  """The step ``s`` :func:`fake_quantize` uses for ``x`` (scalar float32)."""
  x32 = jnp.asarray(x).astype(jnp.float32)
  if symmetric:
    return jnp.max(jnp.abs(x32)) / (2 ** (bits - 1) - 1)
  return (jnp.max(x32) - jnp.min(x32)) / (2**bits - 1)


def masked_lm_loss(logits, targets, weights: Optional[Array] = None) -> Array:
  """Mean cross-entropy of ``logits`` ``[B, T, V]`` at ``targets`` ``[B, T]`` where
  ``weights`` (``[B, T]``, default ``targets >= 0``) is nonzero; float32 scalar."""
  targets = jnp.asarray(targets)
  if weights is None:
    weights = targets >= 0
  w = jnp.asarray(weights).astype(jnp.float32)
  logp = jax.nn.log_softmax(jnp.asarray(logits).astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(logp, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
  return -jnp.sum(picked * w) / jnp.maximum(jnp.sum(w), 1.0)
