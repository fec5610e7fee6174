"""Decode-cache policies of the softmax-style layers: what the :class:`.KVCache` stores.

Implementation behind the public module :mod:`attnjax.nn.kv_policies`.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

from attnjax._src import lowering, validators
from attnjax._src.nn.caches import H2OCache, KVCache, QuantizedKVCache

Array = jnp.ndarray

CACHE_POLICIES = ("full", "int8", "fp8", "h2o", "sinks_window")
EVICTING = ("h2o", "sinks_window")
# policy -> (stored dtype name, largest stored magnitude)
QUANTIZED = {"int8": ("int8", 127.0), "fp8": ("float8_e4m3fn", 448.0)}
DEFAULT_SINKS = 4  # StreamingLLM's sink tokens


def _check_int(name: str, value: Any, minimum: int) -> None:
  validators.check_positive_int(name, value, minimum=minimum)


def validate(policy: Any, budget: Any, recent: Any) -> None:
  """Checks ``cache_policy``, ``cache_budget`` and ``cache_recent`` of a layer's config.

  Args:
    policy: a name of :data:`.CACHE_POLICIES`.
    budget: key slots per sequence and KV head (evicting policies only), or None.
    recent: the recent window (evicting policies only), or None.

  Raises:
    ValueError: an unknown policy, a budget for a policy that keeps every key, no
      budget for an evicting one, or ``budget < recent`` (each error names the field).
    TypeError: a budget or window that is not an int.
  """
  if policy not in CACHE_POLICIES:
    raise ValueError(
      f"cache_policy={policy!r} is not one of: {', '.join(repr(p) for p in CACHE_POLICIES)}"
    )
  if policy not in EVICTING:
    for name, value in (("cache_budget", budget), ("cache_recent", recent)):
      if value is not None:
        raise ValueError(
          f"{name}={value!r}: cache_policy={policy!r} keeps every key; only "
          f"{' and '.join(repr(p) for p in EVICTING)} take a budget"
        )
    return
  if budget is None:
    raise ValueError(
      f"cache_budget=None: cache_policy={policy!r} needs cache_budget, the "
      f"number of key slots kept per sequence and key/value head"
    )
  _check_int("cache_budget", budget, 1)
  if recent is not None:
    _check_int("cache_recent", recent, 1)
    if budget < recent:
      raise ValueError(
        f"cache_budget={budget} is too small for the recent window "
        f"cache_recent={recent} (cache_budget >= cache_recent)"
      )


def recent_slots(policy: str, budget: int, recent: Optional[int]) -> int:
  """The recent window of an evicting policy: ``recent``, or its default.

  Defaults: ``h2o`` half the budget (H2O's even split of heavy hitters and
  recent tokens, at least 1); ``sinks_window`` all but ``min(4, budget - 1)``
  sink slots.

  Args:
    policy: ``"h2o"`` or ``"sinks_window"``.
    budget: key slots kept.
    recent: the configured window, or None for the default.

  Returns:
    The number of most recent tokens always kept.
  """
  if recent is not None:
    return recent
  if policy == "h2o":
    return max(budget // 2, 1)
  return budget - min(DEFAULT_SINKS, budget - 1)


def check_budget(budget: int, max_len: int) -> None:
  """Raises ValueError when ``budget`` exceeds the cache's ``max_len`` (it could never fill)."""
  if budget > max_len:
    raise ValueError(
      f"cache_budget={budget} exceeds max_len={max_len}: a cache never holds "
      f"more keys than the tokens it decodes"
    )


@functools.cache
def fp8_supported() -> bool:
  """Whether JAX has float8_e4m3fn and this process's default device converts to and from it.

  Returns:
    True where ``cache_policy="fp8"`` can run (cached after the first call).
  """
  dtype = getattr(jnp, "float8_e4m3fn", None)
  if dtype is None:
    return False
  try:
    with lowering.host_eval():
      back = jnp.asarray([1.5, -3.0], jnp.float32).astype(dtype).astype(jnp.float32)
      return bool(jnp.all(back == jnp.asarray([1.5, -3.0])))
  except (TypeError, ValueError, RuntimeError, NotImplementedError):
    return False


def check_fp8() -> None:
  """Raises ValueError naming the platform where :func:`.fp8_supported` is False."""
  if not fp8_supported():
    raise ValueError(
      f"cache_policy='fp8': float8_e4m3fn is unsupported by this JAX on platform "
      f"{lowering.current_platform()!r}; use cache_policy='int8'"
    )


# ---------------------------------------------------------------------------
# Quantisation.


def quantize(x: Array, policy: str) -> tuple[Array, Array]:
  """Quantises each vector of ``x`` over its last axis with its own absmax scale.

  Args:
    x: ``[..., H]`` keys or values.
    policy: ``"int8"`` (scale ``max |x| / 127``, rounded) or ``"fp8"`` (float8_e4m3fn,
      scale ``max |x| / 448``).

  Returns:
    ``(stored [..., H] in the policy's dtype, scale [...] float32)``.
  """
  name, qmax = QUANTIZED[policy]
  x32 = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x32), axis=-1) / qmax
  y = x32 / jnp.where(scale > 0, scale, 1.0)[..., None]
  if name == "int8":
    y = jnp.clip(jnp.round(y), -qmax, qmax)
  else:
    y = jnp.clip(y, -qmax, qmax)
  return y.astype(jnp.dtype(name)), scale


def dequantize(stored: Array, scale: Array, dtype) -> Array:
  """The inverse of :func:`.quantize`: ``stored * scale``.

  Args:
    stored: ``[..., H]`` quantised values.
    scale: ``[...]`` float32 scales.
    dtype: the dtype to return.

  Returns:
    ``[..., H]`` in ``dtype``.
  """
  return (stored.astype(jnp.float32) * scale[..., None]).astype(dtype)


# ---------------------------------------------------------------------------
# Empty caches.


def init_cache(
  policy: str,
  batch_size: int,
  capacity: int,
  num_kv_heads: int,
  head_dim: int,
  dtype,
  *,
  value_dim: Optional[int] = None,
) -> Any:
  """The empty cache of ``policy``: ``capacity`` slots of ``num_kv_heads`` x ``head_dim``.

  Args:
    policy: a name of :data:`.CACHE_POLICIES`.
    batch_size: ``B``.
    capacity: key slots per sequence (the budget of an evicting policy).
    num_kv_heads: ``K``.
    head_dim: ``H``.
    dtype: keys' and values' dtype (a quantised cache stores its own).
    value_dim: ``Hv`` of the values (None: ``head_dim``; an MLA layer's latent ``R``).

  Returns:
    A :class:`~attnjax.nn.KVCache`, :class:`~attnjax.nn.QuantizedKVCache` or
    :class:`~attnjax.nn.H2OCache` of ``[B, capacity, K, H]`` keys and ``[B, capacity, K, Hv]``
    values.

  Raises:
    ValueError: ``"fp8"`` where it is unsupported.
  """
  B, C, K, H = batch_size, capacity, num_kv_heads, head_dim
  Hv = H if value_dim is None else value_dim
  index = jnp.zeros((), jnp.int32)
  if policy == "h2o":
    return H2OCache(
      k=jnp.zeros((B, C, K, H), dtype),
      v=jnp.zeros((B, C, K, Hv), dtype),
      scores=jnp.zeros((B, C, K), jnp.float32),
      positions=jnp.full((B, C, K), -1, jnp.int32),
      index=index,
      rope_positions=jnp.full((B, C, K), -1, jnp.int32),
      segment_ids=jnp.zeros((B, C, K), jnp.int32),
    )
  meta = dict(
    positions=jnp.full((C,), -1, jnp.int32),
    index=index,
    rope_positions=jnp.full((B, C), -1, jnp.int32),
    segment_ids=jnp.zeros((B, C), jnp.int32),
  )
  if policy in QUANTIZED:
    if policy == "fp8":
      check_fp8()
    stored = jnp.dtype(QUANTIZED[policy][0])
    return QuantizedKVCache(
      k=jnp.zeros((B, C, K, H), stored),
      v=jnp.zeros((B, C, K, Hv), stored),
      k_scale=jnp.zeros((B, C, K), jnp.float32),
      v_scale=jnp.zeros((B, C, K), jnp.float32),
      **meta,
    )
  return KVCache(k=jnp.zeros((B, C, K, H), dtype), v=jnp.zeros((B, C, K, Hv), dtype), **meta)


def cache_type(policy: str) -> type:
  """The cache class of ``policy`` (:class:`~attnjax.nn.KVCache` for full and sinks_window)."""
  if policy == "h2o":
    return H2OCache
  return QuantizedKVCache if policy in QUANTIZED else KVCache


def bytes_per_layer(
  policy: str,
  *,
  batch: int,
  capacity: int,
  num_kv_heads: int,
  head_dim: int,
  itemsize: int,
  value_dim: Optional[int] = None,
) -> int:
  """Bytes of one layer's cache arrays (:func:`~attnjax.nn.kv_policies.init_cache`), by formula.

  Args:
    policy: a name of :data:`~attnjax.nn.CACHE_POLICIES`.
    batch: sequences.
    capacity: slots per sequence (the budget of ``h2o``, else the cache length).
    num_kv_heads: ``K``.
    head_dim: ``H``.
    itemsize: bytes per key or value element of an unquantised cache.
    value_dim: ``Hv`` (None: ``head_dim``).

  Returns:
    The bytes :func:`attnjax.nn.cache_bytes` reports for that cache.
  """
  B, C, K, H = batch, capacity, num_kv_heads, head_dim
  width = H + (H if value_dim is None else value_dim)  # a key and a value per slot and head
  if policy == "h2o":
    return B * C * K * width * itemsize + 4 * B * C * K * 4 + 4
  meta = C * 4 + 4 + 2 * B * C * 4  # positions, index, rope positions, segment ids
  if policy in QUANTIZED:
    return B * C * K * width * 1 + 2 * B * C * K * 4 + meta
  return B * C * K * width * itemsize + meta


def cache_bytes_for(
  config,
  policy: Optional[str],
  T: int,
  batch: int = 1,
  *,
  budget: Optional[int] = None,
  recent: Optional[int] = None,
) -> int:
  """Bytes the decode caches of a model ``config`` hold for ``batch`` sequences of ``T`` tokens.

  A formula (nothing is allocated), equal to :func:`attnjax.nn.cache_bytes` of
  ``init_cache(batch, T)`` of a model built from ``config`` with that policy.

  Args:
    config: an :class:`attnjax.nn.ModelConfig` whose layers are softmax-style
      (families on the dense kernel, or sparse).
    policy: the cache policy of every layer, or None for each layer's own
      ``cache_policy`` (and ``cache_budget`` / ``cache_recent``).
    T: tokens decoded (the caches' ``max_len``).
    batch: sequences.
    budget: ``cache_budget`` of an evicting ``policy`` (clipped to ``T``).
    recent: ``cache_recent`` of an evicting ``policy`` (None = its default).

  Returns:
    Bytes, summed over the layers.

  Raises:
    ValueError: a layer of another family (linear, gated, ...), an unknown policy or
      a budget the policy cannot take; ``T`` or ``batch`` below 1.
  """
  _check_int("T", T, 1)
  _check_int("batch", batch, 1)
  itemsize = jnp.dtype(config.dtype).itemsize
  total = 0
  for i in range(config.num_layers):
    attn = config.attention_for(i)
    spec = attn.spec
    if not hasattr(spec, "cache_policy"):
      raise ValueError(
        f"cache_bytes_for covers the softmax-style families; layer {i} has family={attn.family!r}"
      )
    if policy is not None:
      evicting = policy in EVICTING
      b = None if not evicting else (min(budget, T) if isinstance(budget, int) else budget)
      spec = spec.replace(
        cache_policy=policy, cache_budget=b, cache_recent=recent if evicting else None
      )
      if evicting:
        spec.check(attn)
    if spec.cache_policy in EVICTING:
      check_budget(spec.cache_budget, T)
    capacity = spec.cache_capacity_for(T)
    K, H, Hv = spec.cache_shape(attn, config.d_model)
    total += bytes_per_layer(
      spec.cache_policy,
      batch=batch,
      capacity=capacity,
      num_kv_heads=K,
      head_dim=H,
      itemsize=itemsize,
      value_dim=Hv,
    )
  return int(total)


# ---------------------------------------------------------------------------
# H2O.


def h2o_keep(scores: Array, positions: Array, end: Array, budget: int, recent: int) -> Array:
  """Slots kept by H2O: indices into the slot axis.

  Args:
    scores: ``[B, S, K]`` accumulated attention of each slot.
    positions: ``[B, S, K]`` sequence position of each slot, -1 = empty.
    end: tokens seen (positions ``end - recent ..`` are the recent window).
    budget: slots kept (``<= S``).
    recent: the recent window, always kept.

  Returns:
    int32 ``[B, budget, K]``, ascending. The recent slots are chosen first, then the
    others by decreasing score, empty slots last (ties: the lower index).
  """
  valid = positions >= 0
  priority = jnp.where(positions >= end - recent, jnp.inf, scores.astype(jnp.float32))
  priority = jnp.where(valid, priority, -jnp.inf)
  _, idx = jax.lax.top_k(jnp.swapaxes(priority, 1, 2), budget)  # [B, K, budget]
  return jnp.swapaxes(jnp.sort(idx, axis=-1), 1, 2).astype(jnp.int32)


def h2o_decode(spec, layer, q: Array, k: Array, v: Array, call) -> tuple:
  """``(out [B, T, N, Hv], new H2OCache)``: one decode call of an ``h2o`` layer.

  ``spec`` is the layer's :class:`~.DotProductSpec`;
  ``q``, ``k``, ``v`` are the new tokens' projections (after ``prepare_qk``).
  The new tokens attend through the spec's decode step
  (:meth:`~attnjax.nn.specs.ScoreSpec.attend_cache`), with each key/value
  head's own slots; its weights add to the slots' scores, then the budget is kept.

  Args:
    spec: the layer's spec.
    layer: the :class:`~attnjax.nn.Attention` layer.
    q: ``[B, T, N, H]`` new queries.
    k: ``[B, T, K, H]`` new keys.
    v: ``[B, T, K, Hv]`` new values.
    call: the :class:`~attnjax.nn.specs.Call` holding the :class:`~attnjax.nn.H2OCache`.

  Returns:
    ``(out [B, T, N, Hv], new H2OCache)``.
  """
  cache = call.cache
  B, T, N, _ = q.shape
  _, C, K, _ = cache.k.shape
  start = cache.index
  queries = call.decode_positions(start, B, T)
  idx, seg, rope_q = queries

  def per_head(x):  # [B, T] -> [B, T, K]
    return jnp.broadcast_to(x[:, :, None], (B, T, K))

  k_store = jnp.concatenate([cache.k, k.astype(cache.k.dtype)], axis=1)  # [B, S, K, H]
  v_store = jnp.concatenate([cache.v, v.astype(cache.v.dtype)], axis=1)
  k_pos = jnp.concatenate([cache.positions, per_head(jnp.broadcast_to(idx, (B, T)))], axis=1)
  k_seg = jnp.concatenate([cache.segment_ids, per_head(seg)], axis=1)
  k_rope = jnp.concatenate([cache.rope_positions, per_head(rope_q)], axis=1)
  out, w = spec.attend_cache(
    layer,
    q,
    k_store,
    v_store,
    call,
    start=start,
    length=C,
    queries=queries,
    keys=(k_pos, k_seg, k_rope),
    weights=True,
  )
  S = k_store.shape[1]
  w = jnp.abs(w[..., :S])
  received = jnp.sum(jnp.reshape(w, (B, T, K, N // K, S)), axis=(1, 3))  # [B, K, S]
  scores = jnp.concatenate([cache.scores, jnp.zeros((B, T, K), jnp.float32)], axis=1)
  scores = scores + jnp.swapaxes(received, 1, 2)
  recent = recent_slots("h2o", C, spec.cache_recent)
  keep = h2o_keep(scores, k_pos, start + T, C, recent)  # [B, C, K]

  def take(x):
    ix = keep if x.ndim == 3 else keep[..., None]
    return jnp.take_along_axis(x, ix, axis=1)

  new = H2OCache(
    k=take(k_store),
    v=take(v_store),
    scores=take(scores),
    positions=take(k_pos),
    index=start + T,
    rope_positions=take(k_rope),
    segment_ids=take(k_seg),
  )
  return out, new
