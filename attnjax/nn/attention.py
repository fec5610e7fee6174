"""``Attention``: one NNX layer that hosts every attention family of attnjax.

The module owns the projections and every learned quantity the pure functions
take as arrays (QK-norm gains, cosine temperatures, sink logits, output gate,
key/value bias slot, random-feature projections); the maths stay in the
functions (:func:`attnjax.dot_product_attention`, ``qk_norm_attention``,
``cosine_attention``, ``linear_attention``, ``sparse_attention``), as
``flax.nnx.MultiHeadAttention`` separates module from ``attention_fn``.

Decoding is functional: :meth:`Attention.init_cache` returns a pytree and
:meth:`Attention.decode` maps ``(x, cache) -> (y, cache)``.

- Dense-kernel families keep a :class:`KVCache` of keys stored *before* RoPE
  with the sequence position of every slot: a full cache (``max_len`` slots), a
  rolling cache of ``window`` slots for sliding windows, or ``num_sinks +
  window`` slots for StreamingLLM, whose keys are rotated at attention time by
  their sequence position (``streaming_rope="absolute"``) or by their position
  in the cache (``"cache"``, Xiao et al. 2024).
- Linear attention keeps a :class:`LinearCache`, its recurrent state.
- Sparse layers keep a full cache and mask it by the pattern's rule, by position.
- A call with ``T`` new tokens attends over the old cache concatenated with the
  new keys, masked by position with :func:`attnjax.masks.structural_mask`, then
  writes the new keys into their slots; so one path serves prefill and steps.

Statistics: under ``nnx.capture(..., nnx.Intermediate)`` the layer sows
``attention_stats`` (:class:`attnjax.AttentionStats`), ``q_rms`` ``[B, N]`` and
``k_rms`` ``[B, K]`` (RMS over time and head dim of the projected q and k),
``gate_mean`` ``[B, N]`` when gated, and ``weights`` ``[B, N, T, S]`` when asked
(``sow_weights``). Outside ``nnx.capture`` nothing is computed for them.

References:
  Qiu et al. 2025, "Gated Attention for Large Language Models" (output gate).
  Sun et al. 2024, "Massive Activations in Large Language Models" (k/v bias).
  Xiao et al. 2024, "Efficient Streaming Language Models with Attention Sinks".
  OpenAI 2025, gpt-oss model card (sink logits).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
from flax import nnx

from attnjax import feature_maps, masks, patterns
from attnjax import linear as linear_lib
from attnjax import qk_norm as qk_norm_lib
from attnjax.dense import dot_product_attention
from attnjax.sparse import sparse_attention
from attnjax.nn import _layers
from attnjax.nn.config import AttentionConfig
from attnjax.nn.rope import apply_rope
from attnjax.qk_norm import cosine_attention, qk_norm_attention

Array = jnp.ndarray


class KVCache(NamedTuple):
  """Decode cache of a dense-kernel layer.

  Attributes:
    k: ``[B, C, K, H]`` keys before RoPE (after any pre-RoPE QK norm).
    v: ``[B, C, K, Hv]`` values.
    positions: ``[C]`` int32 sequence position held by each slot; -1 = empty.
    index: ``[]`` int32, tokens seen so far (the position of the next token).
  """

  k: Array
  v: Array
  positions: Array
  index: Array


class LinearCache(NamedTuple):
  """Decode state of a linear-attention layer.

  Attributes:
    state: :class:`attnjax.linear.LinearState` (``kv_sum [B, K, F, Hv]``,
      ``k_sum [B, K, F]``), the sums over every key seen.
    index: ``[]`` int32, tokens seen so far.
  """

  state: linear_lib.LinearState
  index: Array


Cache = Union[KVCache, LinearCache]


class FeatureProjection(nnx.Variable):
  """Random-feature directions ``[m, H]`` of FAVOR+ / trig maps: state, not a trained ``Param``."""


class Attention(nnx.Module):
  """Multi-head attention of any attnjax family (see the module docstring).

  Args:
    config: the :class:`AttentionConfig`.
    d_model: model width D.
    rngs: ``nnx.Rngs`` for the parameters.
    dtype: compute dtype (projections, cache); logits are float32 regardless.
    param_dtype: parameter dtype.
  """

  def __init__(self, config: AttentionConfig, d_model: int, rngs: nnx.Rngs, *,
               dtype=jnp.float32, param_dtype=jnp.float32):
    if not isinstance(config, AttentionConfig):
      raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
    self.config = config
    self.d_model = d_model
    self.dtype = jnp.dtype(dtype)
    self.num_heads = N = config.num_heads
    self.num_kv_heads = K = config.kv_heads
    self.head_dim = H = config.head_dim_for(d_model)
    lin = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.q_proj = _layers.linear(d_model, N * H, ("embed", "heads"), **lin)
    self.k_proj = _layers.linear(d_model, K * H, ("embed", "heads"), **lin)
    self.v_proj = _layers.linear(d_model, K * H, ("embed", "heads"), **lin)
    self.o_proj = _layers.linear(N * H, d_model, ("heads", "embed"), **lin)
    if config.family == "qk_norm" and config.qk_norm_gain:
      self.q_gain = _layers.param(jnp.ones((H,), param_dtype), (None,))
      self.k_gain = _layers.param(jnp.ones((H,), param_dtype), (None,))
    if config.family == "cosine":
      shape = (N, H) if config.cosine_convention == "ngpt" else (N,)
      names = ("heads", None) if config.cosine_convention == "ngpt" else ("heads",)
      self.temperature = _layers.param(
          jnp.full(shape, config.initial_temperature, param_dtype), names)
    if config.sink_logits:
      self.sink_logits = _layers.param(jnp.zeros((N,), param_dtype), ("heads",))
    if config.output_gate is not None:
      width = N * H if config.output_gate == "elementwise" else N
      self.gate_proj = _layers.linear(d_model, width, ("embed", "heads"), use_bias=True, **lin)
    if config.family == "linear" and config.feature_map in feature_maps.RANDOM:
      factory = (feature_maps.favor_plus if config.feature_map == "favor_plus"
                 else feature_maps.trig_features)
      drawn = factory(rngs.params(), config.num_features, head_dim=H)
      self.feature_projection = FeatureProjection(drawn.projection)
      self.orthogonal_features = drawn.orthogonal
    if config.kv_bias:
      # Zero init: the slot starts as a null key of logit 0 with a zero value,
      # i.e. the layer starts as softmax-plus-one; both are learned.
      # Replicated: K can be smaller than the model axis (MQA), and the slot is tiny.
      self.k_bias = _layers.param(jnp.zeros((K, H), param_dtype), (None, None))
      self.v_bias = _layers.param(jnp.zeros((K, H), param_dtype), (None, None))

  # -------------------------------------------------------------------------
  # Public calls.

  def __call__(self, x: Array, *, sow_weights: Optional[bool] = None) -> Array:
    """Full causal self-attention of ``x`` ``[B, T, D]`` -> ``[B, T, D]``."""
    y, _ = self._forward(x, None, sow_weights)
    return y

  def decode(self, x: Array, cache: Cache, *, sow_weights: Optional[bool] = None):
    """Attends ``x`` ``[B, T, D]`` (the next ``T`` tokens) over the cache: ``(y, cache)``."""
    return self._forward(x, cache, sow_weights)

  def cache_capacity(self, max_len: int) -> int:
    """Number of key slots this layer's cache needs for sequences up to ``max_len``."""
    c = self.config
    if c.window is None:
      return max_len
    return min(max_len, c.num_sinks + c.window)

  def init_cache(self, batch_size: int, max_len: int) -> Cache:
    """An empty cache for ``batch_size`` sequences of up to ``max_len`` tokens.

    A full cache silently drops keys written past ``max_len`` (positions are
    traced, so this cannot be checked); rolling and linear caches never fill.
    """
    K, H = self.num_kv_heads, self.head_dim
    if self.config.family == "linear":
      F = self._feature_map(decoding=True).num_features(H)
      return LinearCache(state=linear_lib.zeros_state(batch_size, K, F, H),
                         index=jnp.zeros((), jnp.int32))
    C = self.cache_capacity(max_len)
    return KVCache(
        k=jnp.zeros((batch_size, C, K, H), self.dtype),
        v=jnp.zeros((batch_size, C, K, H), self.dtype),
        positions=jnp.full((C,), -1, jnp.int32),
        index=jnp.zeros((), jnp.int32))

  # -------------------------------------------------------------------------
  # Internals.

  def _project(self, x: Array):
    B, T, _ = x.shape
    N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
    q = jnp.reshape(self.q_proj(x), (B, T, N, H))
    k = jnp.reshape(self.k_proj(x), (B, T, K, H))
    v = jnp.reshape(self.v_proj(x), (B, T, K, H))
    return q, k, v

  def _norm_before_rope(self) -> bool:
    c = self.config
    return (c.family == "qk_norm" and c.qk_norm_placement == "before_rope"
            and c.rope_theta is not None)

  def _gains(self):
    if self.config.family == "qk_norm" and self.config.qk_norm_gain:
      return self.q_gain[...], self.k_gain[...]
    return None, None

  def _module_qk_norm(self, x: Array, gain: Optional[Array]) -> Array:
    """QK norm applied by the module (placement ``before_rope``), reusing the function's norm."""
    c = self.config
    y = qk_norm_lib.normalize_head(x, c.qk_norm, c.qk_norm_eps)
    if gain is not None:
      y = y * jnp.reshape(gain.astype(jnp.float32), (1, 1, 1, -1))
    return y.astype(x.dtype)

  def _allowed(self, q_positions: Array, k_positions: Array, length: int) -> Array:
    """``bool [1, 1, T, S]`` allowed pairs by position: causal, window, sinks; empty slots out."""
    c = self.config
    if c.family == "sparse":
      # The pattern's own element rule, at the cache's positions. Patterns whose
      # choice depends on the length (BigBird's random blocks) see the full
      # sequence length: the cache's capacity, max_len.
      allowed = c.make_pattern().allowed(q_positions, k_positions, (length, length))[None, None]
    elif c.num_sinks:
      # patterns.sinks_window counts the query itself in its window; ours is the left extent.
      pattern = patterns.sinks_window(c.num_sinks, c.window + 1)
      allowed = pattern.allowed(q_positions, k_positions, None)[None, None]
    else:
      window = None if c.window is None else (c.window, 0)
      allowed = masks.structural_mask(q_positions, k_positions, is_causal=True, window=window)
    valid = (k_positions >= 0)[None, None, None, :]
    return jnp.logical_and(allowed, valid)

  def _rope_positions(self, q_positions: Array, k_positions: Array, start: Optional[Array]):
    """Positions at which q and k are rotated (StreamingLLM's cache positions when asked)."""
    c = self.config
    if not (c.num_sinks and c.streaming_rope == "cache" and start is not None):
      return q_positions, k_positions
    # With the chunk's first query at p, the cache holds the sinks at 0..s-1 and the
    # window p-W..p-1 at s..s+W-1: every non-sink position shifts down by p - W - s
    # once that is positive. Exact for one-token steps; a longer chunk on a full cache
    # shares its first query's shift.
    shift = jnp.maximum(start - c.window - c.num_sinks, 0)
    k_rope = jnp.where(k_positions < c.num_sinks, k_positions, k_positions - shift)
    return q_positions - shift, k_rope

  def _attention_fn(self, *, mask, is_causal, window, return_stats):
    """The pure function for this family with every static and learned argument bound."""
    c = self.config
    common = dict(mask=mask, is_causal=is_causal, window=window, normalizer=c.normalizer,
                  softcap=c.softcap, implementation=c.implementation,
                  return_stats=return_stats)
    if c.sink_logits:
      common["sink_logits"] = self.sink_logits[...]
    if c.family == "dense":
      return lambda q, k, v: dot_product_attention(q, k, v, similarity=c.similarity, **common)
    if c.family == "qk_norm":
      if self._norm_before_rope():
        return lambda q, k, v: dot_product_attention(q, k, v, scale=c.qk_scale, **common)
      q_gain, k_gain = self._gains()
      return lambda q, k, v: qk_norm_attention(
          q, k, v, norm=c.qk_norm, q_scale=q_gain, k_scale=k_gain, eps=c.qk_norm_eps,
          scale=c.qk_scale, **common)
    if c.family == "cosine":
      temperature = self.temperature[...]
      return lambda q, k, v: cosine_attention(
          q, k, v, temperature=temperature, convention=c.cosine_convention,
          eps=c.qk_norm_eps, **common)
    if c.family == "sparse":
      if mask is not None:  # decoding: the pattern as a mask over the cache
        return lambda q, k, v: dot_product_attention(q, k, v, **common)
      sparse = dict(common, pattern=c.make_pattern(), block_size=c.block_size)
      for name in ("mask", "is_causal", "window"):
        del sparse[name]
      return lambda q, k, v: sparse_attention(q, k, v, **sparse)
    raise ValueError(f"family={c.family!r} has no softmax-style attention function")

  def _forward(self, x: Array, cache: Optional[Cache], sow_weights: Optional[bool]):
    c = self.config
    if x.ndim != 3 or x.shape[-1] != self.d_model:
      raise ValueError(f"x must be [B, T, D] with D={self.d_model}, got shape {x.shape}")
    B, T, _ = x.shape
    capture = _layers.capturing(self)
    q, k, v = self._project(x)
    if capture:
      _layers.sow(self, "q_rms", _rms(q))
      _layers.sow(self, "k_rms", _rms(k))
    if self._norm_before_rope():
      q_gain, k_gain = self._gains()
      q, k = self._module_qk_norm(q, q_gain), self._module_qk_norm(k, k_gain)

    start = None if cache is None else cache.index
    positions = jnp.arange(T, dtype=jnp.int32)
    if c.family == "linear":
      out, new_cache = self._linear(q, k, v, positions, cache, capture, sow_weights)
      return self._finish(x, out, capture), new_cache
    if cache is None:
      k_all, v_all, k_positions = k, v, positions
    else:
      positions = positions + start
      k_all = jnp.concatenate([cache.k, k], axis=1)
      v_all = jnp.concatenate([cache.v, v], axis=1)
      k_positions = jnp.concatenate([cache.positions, positions])

    if c.rope_theta is not None:
      q_rope, k_rope = self._rope_positions(positions, k_positions, start)
      q = apply_rope(q, q_rope, c.rope_theta)
      k_all = apply_rope(k_all, k_rope, c.rope_theta)

    # The plain training forward passes the structure (is_causal/window, or the
    # sparse pattern) so fast paths can skip blocks; anything else gets an
    # explicit mask by position.
    mask, is_causal, window = None, False, None
    if cache is None and c.family == "sparse":
      pass
    elif cache is None and not c.kv_bias and not c.num_sinks:
      is_causal = True
      window = None if c.window is None else (c.window, 0)
    else:
      length = T if cache is None else cache.k.shape[1]
      mask = self._allowed(positions, k_positions, length)
    if c.kv_bias:
      k_all, v_all, mask = self._append_kv_bias(k_all, v_all, mask)

    fn = self._attention_fn(mask=mask, is_causal=is_causal, window=window,
                            return_stats=capture)
    out = fn(q, k_all, v_all)
    if capture:
      out, stats = out
      _layers.sow(self, "attention_stats", stats)
      want_weights = c.sow_weights if sow_weights is None else sow_weights
      if want_weights:
        _layers.sow(self, "weights", self._weights(q, k_all, mask, is_causal, window))
    new_cache = None if cache is None else self._write(cache, k, v, positions)
    return self._finish(x, out, capture), new_cache

  def _finish(self, x: Array, out: Array, capture: bool) -> Array:
    """Output gate (if any) and output projection of the heads ``[B, T, N, Hv]``."""
    c = self.config
    B, T, _ = x.shape
    if c.output_gate is not None:
      gate = jax.nn.sigmoid(self.gate_proj(x).astype(jnp.float32))
      gate = jnp.reshape(gate, (B, T, self.num_heads, -1))
      if capture:
        _layers.sow(self, "gate_mean", jnp.mean(gate, axis=(1, 3)))
      out = (out.astype(jnp.float32) * gate).astype(out.dtype)
    return self.o_proj(jnp.reshape(out, (B, T, -1)))

  def _feature_map(self, *, decoding: bool) -> feature_maps.FeatureMap:
    c = self.config
    if c.feature_map not in feature_maps.RANDOM:
      return feature_maps.by_name(c.feature_map)
    # A carried state needs the exact (unstabilised) estimator; see AttentionConfig.
    return feature_maps.FeatureMap(
        c.feature_map, self.feature_projection[...],
        stabilize=c.stabilize_features and not decoding, orthogonal=self.orthogonal_features)

  def redraw_features(self, key: Array) -> None:
    """Draws a new random-feature projection (Performer's periodic redrawing)."""
    c = self.config
    if c.family != "linear" or c.feature_map not in feature_maps.RANDOM:
      raise ValueError(f"redraw_features needs a random feature map, this layer has "
                       f"family={c.family!r}, feature_map={c.feature_map!r}")
    self.feature_projection[...] = feature_maps.gaussian_projection(
        key, c.num_features, self.head_dim, orthogonal=self.orthogonal_features)

  def _linear(self, q, k, v, positions, cache, capture, sow_weights):
    """Linear attention: full causal forward, or a step from the cached recurrent state."""
    c = self.config
    if cache is not None:
      positions = positions + cache.index
    if c.rope_theta is not None:
      q = apply_rope(q, positions, c.rope_theta)
      k = apply_rope(k, positions, c.rope_theta)
    fm = self._feature_map(decoding=cache is not None)
    kwargs = dict(feature_map=fm, is_causal=True, normalize=c.linear_normalize,
                  implementation=c.implementation, chunk_size=c.chunk_size)
    new_cache = None
    if cache is None:
      result = linear_lib.linear_attention(q, k, v, return_stats=capture, **kwargs)
    else:
      result = linear_lib.linear_attention(q, k, v, initial_state=cache.state,
                                           return_state=True, return_stats=capture, **kwargs)
    # return_stats wraps the primary result: out, or (out, state) with return_state.
    out, stats = result if capture else (result, None)
    if cache is not None:
      out, state = out
      new_cache = LinearCache(state=state, index=cache.index + q.shape[1])
    if capture:
      _layers.sow(self, "attention_stats", stats)
      want_weights = c.sow_weights if sow_weights is None else sow_weights
      if want_weights:
        w = linear_lib.linear_attention_weights(
            q, k, feature_map=fm, is_causal=True, normalize=c.linear_normalize)
        _layers.sow(self, "weights", w)
    return out, new_cache

  def _append_kv_bias(self, k: Array, v: Array, mask: Array):
    """Appends the learned key/value slot after the real keys; every query may attend to it."""
    B = k.shape[0]
    kb = jnp.broadcast_to(self.k_bias[...].astype(k.dtype)[None, None], (B, 1) + k.shape[2:])
    vb = jnp.broadcast_to(self.v_bias[...].astype(v.dtype)[None, None], (B, 1) + v.shape[2:])
    ones = jnp.ones(mask.shape[:3] + (1,), bool)
    return (jnp.concatenate([k, kb], axis=1), jnp.concatenate([v, vb], axis=1),
            jnp.concatenate([mask, ones], axis=-1))

  def _weights(self, q, k, mask, is_causal, window) -> Array:
    """Attention weights ``[B, N, T, S]`` float32: the layer's function applied to identity values.

    Every family is linear in ``v``, so ``attn(q, k, I)`` is exactly the weight
    matrix the layer used, with its mask, normaliser and null columns; no second
    implementation of the weights is needed. Costs ``O(T S^2)``: for inspection.
    """
    B, S, K, _ = k.shape
    eye = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32)[None, :, None, :], (B, S, K, S))
    fn = self._attention_fn(mask=mask, is_causal=is_causal, window=window, return_stats=False)
    w = fn(q.astype(jnp.float32), k.astype(jnp.float32), eye)  # [B, T, N, S]
    return jnp.transpose(w, (0, 2, 1, 3))

  def _write(self, cache: KVCache, k: Array, v: Array, positions: Array) -> KVCache:
    """Writes the new keys/values into their slots; tokens evicted at once are dropped."""
    c = self.config
    C = cache.k.shape[1]
    T = k.shape[1]
    end = cache.index + T
    if c.window is None:
      slots, keep = positions, positions < C
    else:
      W, s = c.window, c.num_sinks
      ring = s + (positions - s) % max(W, 1)
      slots = jnp.where(positions < s, positions, ring)
      keep = jnp.logical_or(positions < s, jnp.logical_and(W > 0, positions >= end - W))
    slots = jnp.where(keep, slots, C)  # out of range: dropped by mode="drop"
    return KVCache(
        k=cache.k.at[:, slots].set(k.astype(cache.k.dtype), mode="drop"),
        v=cache.v.at[:, slots].set(v.astype(cache.v.dtype), mode="drop"),
        positions=cache.positions.at[slots].set(positions, mode="drop"),
        index=end)

  # -------------------------------------------------------------------------
  # Introspection (for probes: ask the layer, never re-derive it).

  def allowed_mask(self, length: int) -> Array:
    """``bool [1, 1, T, S]``: the pairs this layer's causal self-attention forward allows.

    Over positions ``0 .. T-1`` (``T = length``), by the rule the layer masks
    with (:meth:`_allowed`): causal, the sliding window, StreamingLLM sink
    tokens; a sparse layer's pattern. ``S = T``, plus one last column, open to
    every query, for the learned key/value slot when ``config.kv_bias``.
    """
    if isinstance(length, bool) or not hasattr(length, "__index__") or length < 1:
      raise ValueError(f"length must be an int >= 1, got {length!r}")
    T = int(length)
    positions = jnp.arange(T, dtype=jnp.int32)
    allowed = self._allowed(positions, positions, T)
    if self.config.kv_bias:  # as _append_kv_bias: the slot is open to every query
      allowed = jnp.concatenate([allowed, jnp.ones((1, 1, T, 1), bool)], axis=-1)
    return allowed

  def compared_qk(self, q: Array, k: Array, positions: Optional[Array] = None):
    """Raw projections q ``[B, T, N, H]``, k ``[B, T, K, H]`` as the attention compares them.

    Applies what the layer and its attention function apply before the
    ``q . k`` logits: the QK norm and gains (family ``qk_norm``, before or after
    RoPE as ``qk_norm_placement`` says, with the layer's own norm code) and
    RoPE at ``positions`` (default ``arange(T)``). Cosine attention normalises
    inside its function; cosines are invariant to that (not to the per-dim
    scale of the ``ngpt`` convention, which is left out). For linear attention
    these are the inputs of the feature map.

    Returns:
      ``(q, k)`` in the input dtypes.
    """
    c = self.config
    if q.ndim != 4 or k.ndim != 4:
      raise ValueError(f"q and k must be [B, T, heads, H], got q {q.shape} and k {k.shape}")
    if positions is None:
      q_pos = jnp.arange(q.shape[1], dtype=jnp.int32)
      k_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    else:
      if q.shape[1] != k.shape[1] or jnp.shape(positions)[-1] != q.shape[1]:
        raise ValueError(f"positions {jnp.shape(positions)} must give one position per token "
                         f"of q {q.shape} and k {k.shape} (self-attention)")
      q_pos = k_pos = positions
    q_gain, k_gain = self._gains()
    before = self._norm_before_rope()
    if before:
      q, k = self._module_qk_norm(q, q_gain), self._module_qk_norm(k, k_gain)
    if c.rope_theta is not None:
      q, k = apply_rope(q, q_pos, c.rope_theta), apply_rope(k, k_pos, c.rope_theta)
    if c.family == "qk_norm" and not before:  # qk_norm_attention's own normalisation
      q, k = self._module_qk_norm(q, q_gain), self._module_qk_norm(k, k_gain)
    return q, k


def _rms(x: Array) -> Array:
  """RMS over time and head dim: ``[B, T, heads, H] -> [B, heads]`` float32."""
  x = x.astype(jnp.float32)
  return jnp.sqrt(jnp.mean(x * x, axis=(1, 3)))
