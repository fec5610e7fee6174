"""``Attention``: one NNX layer that hosts every attention family of attnjax.

The layer owns the projections, the output gate and the parameters its family spec
(:mod:`attnjax.nn.specs`) creates; the maths stay in the pure functions, and an
``attention_fn`` can be injected, as ``flax.nnx.MultiHeadAttention`` separates module
from ``attention_fn``. The layer never branches on the family: the spec builds the
attention call and the cache. Decoding is functional (:meth:`.Attention.init_cache`,
:meth:`.Attention.decode`); under ``nnx.capture`` it sows its statistics.

Guides: docs/guides/layers.md (calls, families, what the layers sow),
docs/guides/kv_caches.md (decode caches), docs/guides/context_parallel.md, section
"In the layers". Implementation behind the public module :mod:`attnjax.nn`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from attnjax._src import validators
from attnjax._src.nn import _layers
from attnjax._src.nn.caches import Cache, CrossCache
from attnjax._src.nn.config import AttentionConfig
from attnjax._src.nn.specs import Call

Array = jnp.ndarray


class Attention(nnx.Module):
  """Multi-head attention of any attnjax family (see the module docstring).

  Args:
    config: the :class:`.AttentionConfig`.
    d_model: model width D.
    rngs: ``nnx.Rngs`` for the parameters.
    dtype: compute dtype (projections, cache); logits are float32 regardless.
    param_dtype: parameter dtype.
    attention_fn: the pure attention function to call instead of the family's
      (None), on every path (forward, cross-attention, decode), as flax's
      ``MultiHeadAttention(attention_fn=...)``. It receives ``(q, k, v)`` and
      the keyword arguments of the function the family calls on that path
      (e.g. :func:`attnjax.dot_product_attention`'s ``mask``, ``is_causal``,
      ``window``, ``normalizer``, ``implementation``, ``return_stats``, ...).
      A sparse layer calls :func:`attnjax.sparse_attention` (``pattern``,
      ``block_size``) only in a forward without ``mask``; when decoding or
      given a ``mask`` it masks by the pattern and calls the dense kernel's
      signature (its ``implementation`` mapped: ``"blockwise"`` -> None).
  """

  def __init__(
    self,
    config: AttentionConfig,
    d_model: int,
    rngs: nnx.Rngs,
    *,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    attention_fn: Optional[Callable] = None,
  ):
    if not isinstance(config, AttentionConfig):
      raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
    if attention_fn is not None and not callable(attention_fn):
      raise TypeError(f"attention_fn must be callable, got {type(attention_fn).__name__}")
    self.config = config
    self.d_model = d_model
    self.dtype = jnp.dtype(dtype)
    self.attention_fn = attention_fn
    self.num_heads = N = config.num_heads
    self.num_kv_heads = K = config.kv_heads
    self.head_dim = H = config.head_dim_for(d_model)
    lin = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    del K
    # q_proj, k_proj, v_proj and o_proj, or the family's own (MLA's latent projections).
    config.spec.init_projections(self, d_model, lin)
    # Optional parameters, declared up front; the spec fills in those it uses.
    self.gate_proj = nnx.data(None)
    for name in config.spec.optional_params:
      setattr(self, name, nnx.data(None))
    if config.output_gate is not None:
      Hv = config.spec.value_head_dim(H)
      width = N * Hv if config.output_gate == "elementwise" else N
      self.gate_proj = _layers.linear(d_model, width, ("embed", "heads"), use_bias=True, **lin)
    # After the gate: the random-feature draw keeps its place in the rngs stream.
    config.spec.init_params(self, rngs, param_dtype)

  # -------------------------------------------------------------------------
  # Public calls.

  def __call__(
    self,
    x: Array,
    *,
    inputs_kv: Optional[Array] = None,
    mask: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
    positions: Optional[Array] = None,
    sow_weights: Optional[bool] = None,
  ) -> Array:
    """Attention of ``x`` ``[B, T, D]`` -> ``[B, T, D]``.

    Args:
      x: the queries' sequence (and keys' and values', without ``inputs_kv``).
      inputs_kv: ``[B, S, D]``: cross-attention over this second sequence
        (keys and values projected from it; never causal, no RoPE).
      mask: bool, True = may attend, broadcastable to ``[B, N, T, S]``
        (``S = T`` in self-attention), e.g. a padding mask ``[B, 1, 1, S]``;
        intersected with the layer's own structure (causal, window, pattern).
      segment_ids: ``[B, T]`` int: packed sequences; no token attends across
        a segment boundary (self-attention).
      positions: ``[T]`` or ``[B, T]`` int RoPE positions (default
        ``0..T-1``), e.g. restarting at 0 in every packed document. Causality
        and windows follow the token order, not these positions.
      sow_weights: sow the weights (under ``nnx.capture``); None = the config's.
    """
    y, _ = self._forward(
      x,
      None,
      inputs_kv=inputs_kv,
      mask=mask,
      segment_ids=segment_ids,
      positions=positions,
      sow_weights=sow_weights,
    )
    return y

  def decode(
    self,
    x: Array,
    cache: Cache,
    *,
    inputs_kv: Optional[Array] = None,
    mask: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
    positions: Optional[Array] = None,
    sow_weights: Optional[bool] = None,
  ):
    """Attends ``x`` ``[B, T, D]`` (the next ``T`` tokens) over the cache: ``(y, cache)``.

    Self-attention: ``segment_ids`` ``[B, T]`` (default 0) and ``positions``
    (default the sequence positions) of the new tokens are stored with their
    keys; a packed decode passes them on every call; ``mask`` is not taken
    (mark padding with segment ids). Cross-attention (a :class:`.CrossCache`):
    pass ``inputs_kv`` on the first call to fill the cache; ``mask``
    ``[B, N, T, S]`` is taken on every call.
    """
    if cache is None:
      raise ValueError("cache is None: build one with init_cache(batch_size, max_len)")
    return self._forward(
      x,
      cache,
      inputs_kv=inputs_kv,
      mask=mask,
      segment_ids=segment_ids,
      positions=positions,
      sow_weights=sow_weights,
    )

  def cache_capacity(self, max_len: int) -> int:
    """Number of key slots this layer's self-attention cache needs for ``max_len`` tokens."""
    return self.config.spec.cache_capacity(self, max_len)

  def init_cache(self, batch_size: int, max_len: int, *, kv_length: Optional[int] = None) -> Cache:
    """An empty cache for ``batch_size`` sequences of up to ``max_len`` tokens.

    With ``kv_length`` (S), a :class:`.CrossCache` for cross-attention over a
    second sequence of S tokens, filled by the first ``decode(..., inputs_kv=)``.
    A full cache silently drops keys written past ``max_len`` (positions are
    traced, so this cannot be checked); rolling, evicting (``cache_policy``
    ``"h2o"``, ``"sinks_window"``: ``cache_budget <= max_len``) and linear
    caches never fill.
    """
    if kv_length is not None:
      if not self.config.spec.takes_cross:
        raise ValueError(
          f"kv_length={kv_length}: family={self.config.family!r} cannot cross-attend (its "
          f"keys and values are made from the queries' own sequence)"
        )
      K, H = self.num_kv_heads, self.head_dim
      return CrossCache(
        k=jnp.zeros((batch_size, kv_length, K, H), self.dtype),
        v=jnp.zeros((batch_size, kv_length, K, H), self.dtype),
      )
    return self.config.spec.init_cache(self, batch_size, max_len)

  def redraw_features(self, key: Array) -> None:
    """Draws a new random-feature projection (Performer's periodic redrawing)."""
    redraw = getattr(self.config.spec, "redraw", None)
    if redraw is None:
      raise ValueError(
        f"redraw_features needs a random feature map, this layer has family={self.config.family!r}"
      )
    redraw(self, key)

  def allowed_mask(self, length: int) -> Array:
    """``bool [1, 1, T, S]``: the pairs this layer's self-attention training forward allows.

    Over positions ``0..T-1`` with ``T = length``; ``S = T`` plus one column
    (the k/v bias slot, always allowed) with ``kv_bias``. Causal, window and
    sinks as the layer applies them; the sparse family's pattern.
    """
    if isinstance(length, bool) or not hasattr(length, "__index__") or length < 1:
      raise ValueError(f"length must be an int >= 1, got {length!r}")
    return self.config.spec.allowed_mask(self, int(length))

  def compared_qk(self, q: Array, k: Array, positions: Optional[Array] = None):
    """What the attention function compares, from raw projections ``[B, T, heads, H]``.

    Applies the QK norm and gains in their placement and RoPE at ``positions``
    (default ``arange(T)``). Cosine attention normalises inside its function
    (cosines do not change); for linear attention these are the feature map's inputs.
    """
    if q.ndim != 4 or k.ndim != 4:
      raise ValueError(f"q and k must be [B, T, heads, H], got q {q.shape} and k {k.shape}")
    if positions is None:
      positions = jnp.arange(q.shape[1], dtype=jnp.int32)
    elif q.shape[1] != k.shape[1] or jnp.shape(positions)[-1] != q.shape[1]:
      raise ValueError(
        f"positions {jnp.shape(positions)} must give one position per token "
        f"of q {q.shape} and k {k.shape} (self-attention)"
      )
    return self.config.spec.compared_qk(self, q, k, positions)

  # -------------------------------------------------------------------------
  # Internals.

  def _heads(self, proj: nnx.Linear, x: Array, heads: int) -> Array:
    B, T, _ = x.shape
    return jnp.reshape(proj(x), (B, T, heads, self.head_dim))

  def _project(self, x: Array):
    """Raw projections ``(q [B, T, N, H], k [B, T, K, H], v [B, T, K, H])`` of ``x`` (the
    family's own for a family that projects otherwise)."""
    return self.config.spec.project(self, x)

  def _check_sequence(self, name: str, x: Array) -> None:
    if x.ndim != 3 or x.shape[-1] != self.d_model:
      raise ValueError(f"{name} must be [B, T, D] with D={self.d_model}, got shape {x.shape}")

  def _forward(self, x, cache, *, inputs_kv, mask, segment_ids, positions, sow_weights):
    self._check_sequence("x", x)
    B, T, _ = x.shape
    N, K = self.num_heads, self.num_kv_heads
    capture = _layers.capturing(self)
    cross = inputs_kv is not None or isinstance(cache, CrossCache)
    if cross and not self.config.spec.takes_cross:
      raise ValueError(
        f"inputs_kv: family={self.config.family!r} cannot cross-attend (its keys and values "
        f"are made from the queries' own sequence)"
      )
    if inputs_kv is not None and cache is not None and not isinstance(cache, CrossCache):
      raise ValueError(
        f"inputs_kv: this cache is a {type(cache).__name__}, not a CrossCache; "
        f"build one with init_cache(batch_size, max_len, kv_length=S)"
      )
    if inputs_kv is not None:
      self._check_sequence("inputs_kv", inputs_kv)
      if inputs_kv.shape[0] != B:
        raise ValueError(
          f"inputs_kv batch {inputs_kv.shape[0]} differs from x batch {B} "
          f"(x {x.shape}, inputs_kv {inputs_kv.shape})"
        )
      if isinstance(cache, CrossCache) and inputs_kv.shape[1] != cache.k.shape[1]:
        raise ValueError(
          f"inputs_kv has shape {inputs_kv.shape}: its length "
          f"{inputs_kv.shape[1]} must equal the CrossCache's "
          f"kv_length={cache.k.shape[1]}"
        )
      q = self._heads(self.q_proj, x, N)
      k = self._heads(self.k_proj, inputs_kv, K)
      v = self._heads(self.v_proj, inputs_kv, K)
    elif cross:
      q = self._heads(self.q_proj, x, N)
      k, v = cache.k, cache.v
    else:
      q, k, v = self._project(x)
    if capture:
      _layers.sow(self, "q_rms", _rms(q))
      _layers.sow(self, "k_rms", _rms(k))
    S = k.shape[1]
    if mask is not None:
      mask = validators.as_rank4("mask", mask, (B, N, T, S), kind="mask")
    if segment_ids is not None:
      if cross:
        raise ValueError(
          "segment_ids: cross-attention takes no segment_ids; pass a mask [B, N, T, S] instead"
        )
      segment_ids = jnp.asarray(segment_ids)
      if segment_ids.shape != (B, T) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(
          f"segment_ids must be int [B, T] = {(B, T)}, got {segment_ids.dtype} {segment_ids.shape}"
        )
    if positions is not None:
      if cross:
        raise ValueError("positions: cross-attention applies no RoPE, so it takes no positions")
      positions = jnp.asarray(positions)
      if positions.shape not in ((T,), (B, T)):
        raise ValueError(
          f"positions must be [T] or [B, T] with B={B}, T={T}, got {positions.shape}"
        )
    want_weights = self.config.sow_weights if sow_weights is None else sow_weights
    call = Call(
      mask=mask,
      segment_ids=segment_ids,
      positions=positions,
      cross=cross,
      cache=None if cross else cache,
      capture=capture,
      sow_weights=bool(capture and want_weights),
      inputs=x,
    )
    out, new_cache = self.config.spec.attend(self, q, k, v, call)
    if cross and cache is not None:
      new_cache = CrossCache(k=k.astype(cache.k.dtype), v=v.astype(cache.v.dtype))
    first = None
    if capture and self.gate_proj is not None and cache is None and not cross and T > 1:
      first = self._first_key_weight(q, k, v, call)
    return self._finish(x, out, capture, first), new_cache

  def _first_key_weight(self, q: Array, k: Array, v: Array, call: Call) -> Optional[Array]:
    """``[B, T, N]`` float32: each query's weight on key 0 (the row's softmax weight, sink
    logits' share left out), from the layer's own attention on one-hot values (the values
    of key 0 all ones, the others zero); None for a family whose values are not mixed as
    given (MLA's latent)."""
    if not self.config.spec.plain_values:
      return None
    one_hot = jnp.zeros(v.shape, v.dtype).at[:, 0].set(1)
    quiet = dataclasses.replace(call, capture=False, sow_weights=False)
    out, _ = self.config.spec.attend(self, q, k, one_hot, quiet)
    return jnp.mean(out.astype(jnp.float32), axis=-1)

  def _finish(self, x: Array, out: Array, capture: bool, first: Optional[Array] = None) -> Array:
    """Output gate (if any) and output projection of the heads ``[B, T, N, Hv]``.

    Capturing, a gated layer sows its gate's mean ``gate_mean [B, N]`` and, with ``first``
    (each query's weight on key 0, ``[B, T, N]``), the gate's effect on the first token's
    share of the output: ``first_token_mass`` (the mean over queries ``i >= 1`` of the
    weight on key 0, before the gate) and ``first_token_gated`` (the same weight times the
    query's mean gate over the head's channels: what passes the gate), both ``[B, N]``.
    """
    B, T, _ = x.shape
    if self.gate_proj is not None:
      gate = jax.nn.sigmoid(self.gate_proj(x).astype(jnp.float32))
      gate = jnp.reshape(gate, (B, T, self.num_heads, -1))
      if capture:
        _layers.sow(self, "gate_mean", jnp.mean(gate, axis=(1, 3)))
        if first is not None:
          later = first[:, 1:]
          _layers.sow(self, "first_token_mass", jnp.mean(later, axis=1))
          gated = later * jnp.mean(gate[:, 1:], axis=-1)
          _layers.sow(self, "first_token_gated", jnp.mean(gated, axis=1))
      out = (out.astype(jnp.float32) * gate).astype(out.dtype)
    return self.o_proj(jnp.reshape(out, (B, T, -1)))


def _rms(x: Array) -> Array:
  """RMS over time and head dim: ``[B, T, heads, H] -> [B, heads]`` float32."""
  x = x.astype(jnp.float32)
  return jnp.sqrt(jnp.mean(x * x, axis=(1, 3)))
