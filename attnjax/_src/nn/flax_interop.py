"""attnjax attention inside flax's own attention layers.

:func:`.flax_attention_fn` returns an ``attention_fn`` that ``flax.nnx.MultiHeadAttention``
and ``flax.linen.MultiHeadDotProductAttention`` accept in place of their own:

>>> from flax import nnx
>>> import attnjax
>>> fn = attnjax.nn.flax_attention_fn(normalizer="softpick")
>>> layer = nnx.MultiHeadAttention(4, 32, attention_fn=fn, decode=False, rngs=nnx.Rngs(0))

What it does with each keyword flax passes: docs/guides/interop.md, section "Inside
flax's attention layers". Implementation behind the public module :mod:`attnjax.nn`.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from attnjax._src.ops.dense import attention as dense
from attnjax._src.nn import _layers

# Keywords of attnjax.dot_product_attention that flax passes per call, or whose output flax
# cannot take: everything else may be fixed when the adapter is made.
_PER_CALL = ("query", "key", "value", "bias", "mask", "return_stats", "return_residual")
ADAPTER_KEYWORDS: tuple[str, ...] = tuple(
  name
  for name in inspect.signature(dense.dot_product_attention).parameters
  if name not in _PER_CALL
)


def _flat_batch(x: Any, batch: tuple[int, ...], B: int):
  """``x`` of rank <= ``len(batch) + 3`` (broadcastable to ``batch + [.., .., ..]``) as rank 4
  with one batch dim (``B`` or 1)."""
  x = jnp.asarray(x)
  x = jnp.reshape(x, (1,) * (len(batch) + 3 - x.ndim) + x.shape)
  lead, tail = x.shape[: len(batch)], x.shape[len(batch) :]
  if all(d == 1 for d in lead):
    return jnp.reshape(x, (1,) + tail)
  return jnp.reshape(jnp.broadcast_to(x, batch + tail), (B,) + tail)


def _wants_stats(module: Any) -> bool:
  if module is None:
    return False
  if isinstance(module, nnx.Module):
    return _layers.capturing(module)
  return module.is_mutable_collection("intermediates")


def _sow(module: Any, stats: Any) -> None:
  if isinstance(module, nnx.Module):
    _layers.sow(module, "attention_stats", stats)
  else:
    module.sow("intermediates", "attention_stats", stats)


def flax_attention_fn(**attnjax_options: Any) -> Callable[..., jax.Array]:
  """An ``attention_fn`` for flax's attention layers that runs :func:`attnjax.dot_product_attention`.

  Args:
    **attnjax_options: keywords of :func:`attnjax.dot_product_attention`
      fixed for every call (``ADAPTER_KEYWORDS``: ``normalizer``,
      ``scale``, ``softcap``, ``window``, ``sink_logits``, ``implementation``,
      ``score_mod``, ...); the ones flax passes per call (``bias``, ``mask``)
      and the ``return_*`` flags are not among them. ``is_causal=True`` makes
      every call causal.

  Returns:
    ``attention_fn(query, key, value, bias=None, mask=None, ...)`` taking
    every keyword flax passes (see the module docstring for what each does)
    and returning ``[batch..., q_len, heads, v_head_dim]``.

  Raises:
    TypeError: an option that is not in ``ADAPTER_KEYWORDS``.
  """
  unknown = [name for name in attnjax_options if name not in ADAPTER_KEYWORDS]
  if unknown:
    raise TypeError(
      f"flax_attention_fn takes keywords of attnjax.dot_product_attention "
      f"{ADAPTER_KEYWORDS}, got {unknown}"
    )
  options = dict(attnjax_options)
  always_causal = bool(options.pop("is_causal", False))

  def attention_fn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout=True,
    dropout_rng=None,
    dropout_rate=0.0,
    deterministic=False,
    dtype=None,
    precision=None,
    module=None,
    is_causal=False,
    force_fp32_for_softmax=False,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
  ):
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
    if dropout_rate > 0.0 and not deterministic:
      raise ValueError(
        f"attnjax attention has no dropout on attention weights: make the flax layer with "
        f"dropout_rate=0.0 or call it deterministic (got dropout_rate={dropout_rate})"
      )
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
      raise ValueError(
        "qk_attn_weights_einsum / attn_weights_value_einsum (custom einsums) "
        "cannot be applied inside attnjax's attention; leave them unset"
      )
    dtype = jnp.result_type(query, key, value) if dtype is None else dtype
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    batch = query.shape[:-3]
    B = math.prod(batch)
    q, k, v = (jnp.reshape(x, (B,) + x.shape[-3:]) for x in (query, key, value))
    mask = None if mask is None else _flat_batch(jnp.asarray(mask).astype(bool), batch, B)
    bias = None if bias is None else _flat_batch(bias, batch, B)
    stats = _wants_stats(module)
    out = dense.dot_product_attention(
      q, k, v, bias, mask, is_causal=bool(is_causal) or always_causal, return_stats=stats, **options
    )
    if stats:
      out, st = out
      _sow(module, jax.tree.map(lambda x: jnp.reshape(x, batch + x.shape[1:]), st))
    return jnp.reshape(out, batch + out.shape[1:])

  return attention_fn
