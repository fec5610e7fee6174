"""Per-family attention specs: each family's options, parameters, attention call and cache.

An :class:`attnjax.nn.AttentionConfig` holds the options every layer has
(heads, head dim, RoPE, output gate, causality, implementation) and one *spec*,
a frozen dataclass of its family's options that also knows how to

- build the family's parameters on the layer (:meth:`AttentionSpec.init_params`),
- call the family's pure function with the layer's q, k, v, masks and learned
  arrays, for self-attention, cross-attention and decoding
  (:meth:`AttentionSpec.attend`),
- make its decode cache (:meth:`AttentionSpec.init_cache`),
- say which pairs its training forward allows and what q/k it compares
  (:meth:`AttentionSpec.allowed_mask`, :meth:`AttentionSpec.compared_qk`).

``Attention`` never branches on the family: a new family is one new spec class
registered with :func:`register_family`, e.g.::

  @dataclasses.dataclass(frozen=True)
  class MemoryCompressedSpec(DenseSpec):
    family: ClassVar[str] = "memory_compressed"
    stride: int = 2
    ...
  register_family(MemoryCompressedSpec)

Families: ``dense`` (:class:`DenseSpec`), ``qk_norm`` (:class:`QKNormSpec`),
``cosine`` (:class:`CosineSpec`) share the dense kernel (:class:`KernelSpec`:
normalisers, sink logits, softcap, the k/v bias slot, windows and sinks);
``sparse`` (:class:`SparseSpec`) a block-sparse pattern; ``linear``
(:class:`LinearSpec`) kernel feature maps with a recurrent decode state.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar, Literal, Optional

import jax.numpy as jnp

from attnjax import _checks, dense, feature_maps, masks, normalizers, patterns
from attnjax import linear as linear_lib
from attnjax import qk_norm as qk_norm_lib
from attnjax.nn import _layers
from attnjax.nn.caches import CrossCache, FeatureProjection, KVCache, LinearCache
from attnjax.nn.rope import apply_rope
from attnjax.sparse import sparse_attention

Array = jnp.ndarray

STREAMING_ROPE = ("cache", "absolute")
PATTERNS = ("causal", "sliding_window", "strided", "fixed", "global_window", "bigbird",
            "sinks_window")
FEATURE_MAPS = feature_maps.DETERMINISTIC + feature_maps.RANDOM

# Initial cosine temperature per convention: Swin v2 learns log(scale) from log 10;
# "scale" learns the multiplier itself; nGPT's s_qk starts at 1 (logits sqrt(H) cos).
DEFAULT_TEMPERATURE = {"swin": math.log(10.0), "scale": 10.0, "ngpt": 1.0}


def check_type(name: str, value: Any, types, what: str) -> None:
  if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
    raise TypeError(f"{name} must be {what}, got {value!r}")
  if not isinstance(value, types):
    raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")


def check_int(name: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> None:
  if value is None and allow_none:
    return
  check_type(name, value, int, "an int")
  if value < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True)
class Call:
  """One call of the layer, as a spec sees it.

  Attributes:
    mask: user mask, rank 4, broadcastable to ``[B, N, T, S]`` (None = none).
    segment_ids: ``[B, T]`` int segment ids of self-attention (None = none).
    positions: RoPE positions ``[T]`` or ``[B, T]`` (None = sequence positions).
    cross: keys and values come from a second sequence.
    cache: the self-attention decode cache (None = full forward).
    capture: statistics are being captured (``nnx.capture``).
    sow_weights: sow the attention weights too (only when capturing).
  """

  mask: Optional[Array] = None
  segment_ids: Optional[Array] = None
  positions: Optional[Array] = None
  cross: bool = False
  cache: Any = None
  capture: bool = False
  sow_weights: bool = False


def _rope(layer, x: Array, positions: Array) -> Array:
  theta = layer.config.rope_theta
  return x if theta is None else apply_rope(x, positions, theta)


def _and(a: Optional[Array], b: Optional[Array]) -> Optional[Array]:
  if a is None:
    return b
  if b is None:
    return a
  return jnp.logical_and(a, b)


def run_and_sow(layer, run: Callable, q: Array, k: Array, v: Array, call: Call, *,
                weights: Optional[Callable[[], Array]] = None) -> Array:
  """``run(q, k, v, return_stats=...)``; inside ``nnx.capture`` also sows stats and weights.

  The weights default to ``run`` applied to identity values: every family is
  linear in ``v``, so ``attn(q, k, I)`` is exactly the weight matrix the layer
  used, with its mask, normaliser and null columns (``O(T S^2)``: for inspection).
  """
  if not call.capture:
    return run(q, k, v, return_stats=False)
  out, stats = run(q, k, v, return_stats=True)
  _layers.sow(layer, "attention_stats", stats)
  if call.sow_weights:
    if weights is None:
      B, S, K, _ = k.shape
      eye = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32)[None, :, None, :], (B, S, K, S))
      w = run(q.astype(jnp.float32), k.astype(jnp.float32), eye, return_stats=False)
      w = jnp.transpose(w, (0, 2, 1, 3))  # [B, T, N, S] -> [B, N, T, S]
    else:
      w = weights()
    _layers.sow(layer, "weights", w)
  return out


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """Base of the family specs (see the module docstring).

  Subclasses set ``family`` and ``optional_params`` (names of the layer
  attributes their parameters may take; the layer declares them ``None``
  before :meth:`init_params` runs) and override the methods below.
  """

  family: ClassVar[str] = ""
  optional_params: ClassVar[tuple[str, ...]] = ()

  def __post_init__(self):
    self.validate()

  def validate(self) -> None:
    """Checks this spec's own fields (ValueError/TypeError naming the field)."""

  def check(self, config) -> None:
    """Checks the spec against the common fields of its :class:`AttentionConfig`."""

  def init_params(self, layer, rngs, param_dtype) -> None:
    """Creates the family's parameters as attributes of ``layer``."""

  def function(self, layer) -> Callable:
    """The pure attention function: the layer's injected one, or the family's."""
    return layer.attention_fn or self.default_function(layer)

  def default_function(self, layer) -> Callable:
    raise NotImplementedError

  def attend(self, layer, q: Array, k: Array, v: Array, call: Call):
    """``(out [B, T, N, Hv], new self-attention cache or None)`` of projected q, k, v."""
    raise NotImplementedError

  def init_cache(self, layer, batch_size: int, max_len: int):
    raise NotImplementedError

  def cache_capacity(self, layer, max_len: int) -> int:
    return max_len

  def allowed_mask(self, layer, length: int) -> Array:
    raise NotImplementedError

  def prepare_qk(self, layer, q: Array, k: Array):
    """q and k before RoPE, as the layer feeds them on (e.g. a pre-RoPE QK norm)."""
    return q, k

  def compared_qk(self, layer, q: Array, k: Array, positions: Array):
    """What the attention function compares: :meth:`prepare_qk`, then RoPE."""
    q, k = self.prepare_qk(layer, q, k)
    return _rope(layer, q, positions), _rope(layer, k, positions)

  def to_dict(self) -> dict[str, Any]:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

  @classmethod
  def options_from_json(cls, options: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :meth:`to_dict`'s JSON-friendly conversions (lists back to tuples)."""
    return options

  def replace(self, **changes) -> "AttentionSpec":
    return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------
# Softmax-style families.


@dataclasses.dataclass(frozen=True)
class ScoreSpec(AttentionSpec):
  """Options of every family that normalises logits (dense kernel and sparse).

  Attributes:
    normalizer: a name from :mod:`attnjax.normalizers`.
    softcap: ``c`` of the ``c tanh(z / c)`` logit cap, or None.
    sink_logits: learn a per-head null logit ``[N]`` (gpt-oss; softmax only).
  """

  optional_params: ClassVar[tuple[str, ...]] = ("sink_logits",)

  normalizer: str = "softmax"
  softcap: Optional[float] = None
  sink_logits: bool = False

  def validate(self) -> None:
    _checks.check_choice("normalizer", self.normalizer, normalizers.NORMALIZERS)
    _checks.check_positive_float("softcap", self.softcap)
    check_type("sink_logits", self.sink_logits, bool, "a bool")
    if self.sink_logits and self.normalizer != "softmax":
      raise ValueError(
          f"sink_logits=True adds a learned null column to softmax; it cannot be combined "
          f"with normalizer={self.normalizer!r}")

  def init_params(self, layer, rngs, param_dtype) -> None:
    if self.sink_logits:
      layer.sink_logits = _layers.param(jnp.zeros((layer.num_heads,), param_dtype), ("heads",))

  def kwargs(self, layer) -> dict[str, Any]:
    """Static and learned arguments of the family's function (not the masks)."""
    out = dict(normalizer=self.normalizer, softcap=self.softcap,
               implementation=layer.config.implementation)
    if self.sink_logits:
      out["sink_logits"] = layer.sink_logits[...]
    return out

  def default_function(self, layer) -> Callable:
    return dense.dot_product_attention

  # Hooks of the masks: the structure by position, and how a cache rolls.

  def allowed(self, layer, q_positions: Array, k_positions: Array, length: int) -> Array:
    """``bool [1, 1, T, S]`` pairs allowed by position; empty cache slots (-1) out."""
    raise NotImplementedError

  def rolling(self) -> tuple[Optional[int], int]:
    """``(window, num_sinks)`` of the cache's eviction rule; ``(None, 0)`` keeps every key."""
    return None, 0

  def kv_slot(self) -> bool:
    return False

  def full_call(self, layer, k: Array, v: Array, call: Call):
    """``(run, k, v)`` of the self-attention training forward (the structure, fast paths)."""
    raise NotImplementedError

  def decode_function(self, layer) -> Callable:
    return self.function(layer)

  def check_cross(self, layer) -> None:
    w, s = self.rolling()
    if w is not None or s:
      raise ValueError(f"inputs_kv: cross-attention takes no window or sinks (this layer has "
                       f"window={w}, num_sinks={s})")

  # The three calls.

  def attend(self, layer, q, k, v, call):
    q, k = self.prepare_qk(layer, q, k)
    if call.cross:
      return self._attend_cross(layer, q, k, v, call), None
    if call.cache is None:
      T = q.shape[1]
      positions = jnp.arange(T, dtype=jnp.int32) if call.positions is None else call.positions
      q, k = _rope(layer, q, positions), _rope(layer, k, positions)
      run, k, v = self.full_call(layer, k, v, call)
      return run_and_sow(layer, run, q, k, v, call), None
    return self._attend_decode(layer, q, k, v, call)

  def _attend_cross(self, layer, q, k, v, call):
    self.check_cross(layer)
    mask = call.mask
    if self.kv_slot():
      k, v, mask = self._append_kv_bias(layer, k, v, mask, q.shape[1])
    run = functools.partial(self.function(layer), mask=mask, **self.kwargs(layer))
    return run_and_sow(layer, run, q, k, v, call)

  def _attend_decode(self, layer, q, k, v, call):
    c, cache = layer.config, call.cache
    if not isinstance(cache, KVCache):
      raise TypeError(f"cache must be a KVCache for family={self.family!r}, "
                      f"got {type(cache).__name__}")
    if not c.is_causal:
      raise ValueError("decode needs is_causal=True: an encoder layer (is_causal=False) has "
                       "no decode")
    if call.mask is not None:
      raise ValueError("mask: a self-attention decode takes no mask; mark padding and packed "
                       "documents with segment_ids")
    B, T = q.shape[:2]
    start = cache.index
    idx = jnp.arange(T, dtype=jnp.int32) + start
    seg = (jnp.zeros((B, T), jnp.int32) if call.segment_ids is None
           else call.segment_ids.astype(jnp.int32))
    rope_q = jnp.broadcast_to(idx if call.positions is None else call.positions,
                              (B, T)).astype(jnp.int32)
    k_all = jnp.concatenate([cache.k, k.astype(cache.k.dtype)], axis=1)
    v_all = jnp.concatenate([cache.v, v.astype(cache.v.dtype)], axis=1)
    k_idx = jnp.concatenate([cache.positions, idx])
    k_seg = jnp.concatenate([cache.segment_ids, seg], axis=1)
    if c.rope_theta is not None:
      k_rope = jnp.concatenate([cache.rope_positions, rope_q], axis=1)
      q_rope, k_rope = self.decode_rope(layer, idx, k_idx, rope_q, k_rope, start, call)
      q = apply_rope(q, q_rope, c.rope_theta)
      k_all = apply_rope(k_all, k_rope, c.rope_theta)
    mask = self.allowed(layer, idx, k_idx, cache.k.shape[1])
    mask = jnp.logical_and(mask, seg[:, None, :, None] == k_seg[:, None, None, :])
    if self.kv_slot():
      k_all, v_all, mask = self._append_kv_bias(layer, k_all, v_all, mask, T)
    run = functools.partial(self.decode_function(layer), mask=mask, **self.kwargs(layer))
    out = run_and_sow(layer, run, q, k_all, v_all, call)
    return out, self._write(cache, k, v, idx, rope_q, seg)

  def decode_rope(self, layer, q_idx, k_idx, q_rope, k_rope, start, call):
    """RoPE positions of the decode's queries and keys (stored ones by default)."""
    return q_rope, k_rope

  def _append_kv_bias(self, layer, k, v, mask, T):
    """Appends the learned key/value slot after the real keys; every query may attend to it."""
    B = k.shape[0]
    kb = jnp.broadcast_to(layer.k_bias[...].astype(k.dtype)[None, None], (B, 1) + k.shape[2:])
    vb = jnp.broadcast_to(layer.v_bias[...].astype(v.dtype)[None, None], (B, 1) + v.shape[2:])
    if mask is None:
      mask = jnp.ones((1, 1, T, k.shape[1]), bool)
    ones = jnp.ones(mask.shape[:3] + (1,), bool)
    return (jnp.concatenate([k, kb], axis=1), jnp.concatenate([v, vb], axis=1),
            jnp.concatenate([mask, ones], axis=-1))

  def _write(self, cache: KVCache, k, v, positions, rope_positions, segment_ids) -> KVCache:
    """Writes the new keys/values into their slots; tokens evicted at once are dropped."""
    C = cache.k.shape[1]
    T = k.shape[1]
    end = cache.index + T
    W, s = self.rolling()
    if W is None:
      slots, keep = positions, positions < C
    else:
      ring = s + (positions - s) % max(W, 1)
      slots = jnp.where(positions < s, positions, ring)
      keep = jnp.logical_or(positions < s, jnp.logical_and(W > 0, positions >= end - W))
    slots = jnp.where(keep, slots, C)  # out of range: dropped by mode="drop"
    return KVCache(
        k=cache.k.at[:, slots].set(k.astype(cache.k.dtype), mode="drop"),
        v=cache.v.at[:, slots].set(v.astype(cache.v.dtype), mode="drop"),
        positions=cache.positions.at[slots].set(positions, mode="drop"),
        index=end,
        rope_positions=cache.rope_positions.at[:, slots].set(rope_positions, mode="drop"),
        segment_ids=cache.segment_ids.at[:, slots].set(segment_ids, mode="drop"))

  def init_cache(self, layer, batch_size, max_len):
    K, H = layer.num_kv_heads, layer.head_dim
    C = self.cache_capacity(layer, max_len)
    return KVCache(
        k=jnp.zeros((batch_size, C, K, H), layer.dtype),
        v=jnp.zeros((batch_size, C, K, H), layer.dtype),
        positions=jnp.full((C,), -1, jnp.int32),
        index=jnp.zeros((), jnp.int32),
        rope_positions=jnp.full((batch_size, C), -1, jnp.int32),
        segment_ids=jnp.zeros((batch_size, C), jnp.int32))

  def allowed_mask(self, layer, length):
    pos = jnp.arange(length, dtype=jnp.int32)
    allowed = jnp.broadcast_to(self.allowed(layer, pos, pos, length), (1, 1, length, length))
    if self.kv_slot():
      allowed = jnp.concatenate([allowed, jnp.ones((1, 1, length, 1), bool)], axis=-1)
    return allowed


@dataclasses.dataclass(frozen=True)
class KernelSpec(ScoreSpec):
  """Options shared by the families on the dense kernel (dense, qk_norm, cosine).

  Attributes:
    kv_bias: learn one extra key/value pair per key/value head that every query
      may attend to (Sun et al. 2024, "attention bias"); it is appended after the
      real keys, so key 0 stays the first token for sink statistics.
    window: causal sliding window: query ``i`` sees keys ``i - window .. i``.
    num_sinks: with ``window``, the first ``num_sinks`` tokens stay visible to
      every query (StreamingLLM sinks + window).
    streaming_rope: how a sinks-window decode cache rotates keys: ``"cache"``
      (StreamingLLM: keys are stored before RoPE and rotated by their position
      in the cache) or ``"absolute"`` (by their position in the sequence, which
      matches the full forward exactly). ``"cache"`` is exact for one-token
      steps; a prefill from an empty cache uses sequence positions (nothing is
      evicted yet), and a multi-token chunk on a full cache shares the shift of
      its first query.
  """

  optional_params: ClassVar[tuple[str, ...]] = ("sink_logits", "k_bias", "v_bias")

  kv_bias: bool = False
  window: Optional[int] = None
  num_sinks: int = 0
  streaming_rope: Literal["cache", "absolute"] = "cache"

  def validate(self) -> None:
    super().validate()
    check_type("kv_bias", self.kv_bias, bool, "a bool")
    check_int("window", self.window, allow_none=True, minimum=0)
    check_int("num_sinks", self.num_sinks, minimum=0)
    _checks.check_choice("streaming_rope", self.streaming_rope, STREAMING_ROPE)
    if self.num_sinks and self.window is None:
      raise ValueError(f"num_sinks={self.num_sinks} needs window (sinks + window attention)")
    if self.streaming_rope != "cache" and not self.num_sinks:
      raise ValueError(f"streaming_rope={self.streaming_rope!r} only applies with num_sinks > 0")

  def check(self, config) -> None:
    if not config.is_causal and self.window is not None:
      raise ValueError(f"window={self.window} needs is_causal=True (a causal sliding window)")

  def init_params(self, layer, rngs, param_dtype) -> None:
    super().init_params(layer, rngs, param_dtype)
    if self.kv_bias:
      # Zero init: the slot starts as a null key of logit 0 with a zero value,
      # i.e. the layer starts as softmax-plus-one; both are learned.
      # Replicated: K can be smaller than the model axis (MQA), and the slot is tiny.
      K, H = layer.num_kv_heads, layer.head_dim
      layer.k_bias = _layers.param(jnp.zeros((K, H), param_dtype), (None, None))
      layer.v_bias = _layers.param(jnp.zeros((K, H), param_dtype), (None, None))

  def rolling(self):
    return self.window, self.num_sinks

  def kv_slot(self) -> bool:
    return self.kv_bias

  def cache_capacity(self, layer, max_len):
    if self.window is None:
      return max_len
    return min(max_len, self.num_sinks + self.window)

  def allowed(self, layer, q_positions, k_positions, length):
    if not layer.config.is_causal:
      allowed = jnp.ones((1, 1, q_positions.shape[0], k_positions.shape[0]), bool)
    elif self.num_sinks:
      # patterns.sinks_window counts the query itself in its window; ours is the left extent.
      pattern = patterns.sinks_window(self.num_sinks, self.window + 1)
      allowed = pattern.allowed(q_positions, k_positions, None)[None, None]
    else:
      window = None if self.window is None else (self.window, 0)
      allowed = masks.structural_mask(q_positions, k_positions, is_causal=True, window=window)
    valid = (k_positions >= 0)[None, None, None, :]
    return jnp.logical_and(allowed, valid)

  def full_call(self, layer, k, v, call):
    c = layer.config
    fn = functools.partial(self.function(layer), **self.kwargs(layer))
    if not self.kv_bias and not self.num_sinks:
      # The structure as is_causal/window, so fast paths can skip blocks.
      window = None if self.window is None else (self.window, 0)
      extra = {} if call.segment_ids is None else {"segment_ids": call.segment_ids}
      return functools.partial(fn, mask=call.mask, is_causal=c.is_causal, window=window,
                               **extra), k, v
    T = k.shape[1]
    pos = jnp.arange(T, dtype=jnp.int32)
    mask = _and(self.allowed(layer, pos, pos, T), call.mask)
    if call.segment_ids is not None:
      mask = jnp.logical_and(mask, masks.segment_mask(call.segment_ids))
    if self.kv_bias:
      k, v, mask = self._append_kv_bias(layer, k, v, mask, T)
    return functools.partial(fn, mask=mask, is_causal=False, window=None), k, v

  def decode_rope(self, layer, q_idx, k_idx, q_rope, k_rope, start, call):
    if not (self.num_sinks and self.streaming_rope == "cache"):
      return q_rope, k_rope
    if call.positions is not None:
      raise ValueError("positions: a sinks-window decode with streaming_rope='cache' rotates "
                       "keys by their cache slot; use streaming_rope='absolute'")
    # With the chunk's first query at p, the cache holds the sinks at 0..s-1 and the
    # window p-W..p-1 at s..s+W-1: every non-sink position shifts down by p - W - s
    # once that is positive. Exact for one-token steps; a longer chunk on a full cache
    # shares its first query's shift.
    shift = jnp.maximum(start - self.window - self.num_sinks, 0)
    k_shifted = jnp.where(k_idx < self.num_sinks, k_idx, k_idx - shift)
    return q_idx - shift, k_shifted


@dataclasses.dataclass(frozen=True)
class DenseSpec(KernelSpec):
  """Scaled dot product (:func:`attnjax.dot_product_attention`).

  Attributes:
    similarity: ``"dot"`` or ``"neg_sq_euclidean"`` (``-||q - k||^2`` scores).
  """

  family: ClassVar[str] = "dense"

  similarity: Literal["dot", "neg_sq_euclidean"] = "dot"

  def validate(self) -> None:
    super().validate()
    _checks.check_choice("similarity", self.similarity, dense.SIMILARITIES)

  def kwargs(self, layer):
    return dict(super().kwargs(layer), similarity=self.similarity)


@dataclasses.dataclass(frozen=True)
class QKNormSpec(KernelSpec):
  """Normalise q and k over the head dim (:func:`attnjax.qk_norm_attention`).

  Attributes:
    qk_norm: ``"rms"``, ``"layer"`` or ``"l2"``.
    qk_norm_placement: ``"before_rope"`` (normalise the projections, then rotate;
      OLMo 2 / Qwen 3) or ``"after_rope"`` (rotate, then the attention function
      normalises).
    qk_norm_gain: learn gains ``[H]`` for q and k after the norm.
    qk_norm_eps: epsilon of the norm.
    qk_scale: logit scale (None = ``H ** -0.5``; ``"l2"`` usually needs a larger one).
  """

  family: ClassVar[str] = "qk_norm"
  optional_params: ClassVar[tuple[str, ...]] = ("q_gain", "k_gain") + KernelSpec.optional_params

  qk_norm: Literal["rms", "layer", "l2"] = "rms"
  qk_norm_placement: Literal["before_rope", "after_rope"] = "before_rope"
  qk_norm_gain: bool = True
  qk_norm_eps: float = 1e-6
  qk_scale: Optional[float] = None

  def validate(self) -> None:
    super().validate()
    _checks.check_choice("qk_norm", self.qk_norm, qk_norm_lib.NORMS)
    _checks.check_choice("qk_norm_placement", self.qk_norm_placement,
                         ("before_rope", "after_rope"))
    check_type("qk_norm_gain", self.qk_norm_gain, bool, "a bool")
    _checks.check_positive_float("qk_norm_eps", self.qk_norm_eps, allow_none=False)
    _checks.check_positive_float("qk_scale", self.qk_scale)

  def init_params(self, layer, rngs, param_dtype) -> None:
    if self.qk_norm_gain:
      H = layer.head_dim
      layer.q_gain = _layers.param(jnp.ones((H,), param_dtype), (None,))
      layer.k_gain = _layers.param(jnp.ones((H,), param_dtype), (None,))
    super().init_params(layer, rngs, param_dtype)

  def _norm_in_module(self, layer) -> bool:
    return self.qk_norm_placement == "before_rope" and layer.config.rope_theta is not None

  def _gains(self, layer):
    if self.qk_norm_gain:
      return layer.q_gain[...], layer.k_gain[...]
    return None, None

  def _norm(self, x: Array, gain: Optional[Array]) -> Array:
    y = qk_norm_lib.normalize_head(x, self.qk_norm, self.qk_norm_eps)
    if gain is not None:
      y = y * jnp.reshape(gain.astype(jnp.float32), (1, 1, 1, -1))
    return y.astype(x.dtype)

  def prepare_qk(self, layer, q, k):
    if not self._norm_in_module(layer):
      return q, k
    q_gain, k_gain = self._gains(layer)
    return self._norm(q, q_gain), self._norm(k, k_gain)

  def compared_qk(self, layer, q, k, positions):
    q, k = super().compared_qk(layer, q, k, positions)
    if self._norm_in_module(layer):
      return q, k
    q_gain, k_gain = self._gains(layer)
    return self._norm(q, q_gain), self._norm(k, k_gain)

  def default_function(self, layer):
    if self._norm_in_module(layer):
      return dense.dot_product_attention
    return qk_norm_lib.qk_norm_attention

  def kwargs(self, layer):
    out = super().kwargs(layer)
    if self._norm_in_module(layer):
      return dict(out, scale=self.qk_scale)
    q_gain, k_gain = self._gains(layer)
    return dict(out, norm=self.qk_norm, q_scale=q_gain, k_scale=k_gain, eps=self.qk_norm_eps,
                scale=self.qk_scale)


@dataclasses.dataclass(frozen=True)
class CosineSpec(KernelSpec):
  """Cosine similarity times a learned temperature (:func:`attnjax.cosine_attention`).

  Attributes:
    cosine_convention: ``"swin"``, ``"scale"`` or ``"ngpt"``.
    temperature_init: initial temperature (None = the convention's default:
      swin ``log 10``, scale ``10``, ngpt ``1``).
    qk_norm_eps: epsilon of the normalisation of q and k.
  """

  family: ClassVar[str] = "cosine"
  optional_params: ClassVar[tuple[str, ...]] = ("temperature",) + KernelSpec.optional_params

  cosine_convention: Literal["swin", "scale", "ngpt"] = "swin"
  temperature_init: Optional[float] = None
  qk_norm_eps: float = 1e-6

  def validate(self) -> None:
    super().validate()
    _checks.check_choice("cosine_convention", self.cosine_convention,
                         qk_norm_lib.COSINE_CONVENTIONS)
    if self.temperature_init is not None:
      check_type("temperature_init", self.temperature_init, (int, float), "a float")
    _checks.check_positive_float("qk_norm_eps", self.qk_norm_eps, allow_none=False)

  @property
  def initial_temperature(self) -> float:
    if self.temperature_init is not None:
      return float(self.temperature_init)
    return DEFAULT_TEMPERATURE[self.cosine_convention]

  def init_params(self, layer, rngs, param_dtype) -> None:
    ngpt = self.cosine_convention == "ngpt"
    shape = (layer.num_heads, layer.head_dim) if ngpt else (layer.num_heads,)
    names = ("heads", None) if ngpt else ("heads",)
    layer.temperature = _layers.param(
        jnp.full(shape, self.initial_temperature, param_dtype), names)
    super().init_params(layer, rngs, param_dtype)

  def default_function(self, layer):
    return qk_norm_lib.cosine_attention

  def kwargs(self, layer):
    return dict(super().kwargs(layer), temperature=layer.temperature[...],
                convention=self.cosine_convention, eps=self.qk_norm_eps)


@dataclasses.dataclass(frozen=True)
class SparseSpec(ScoreSpec):
  """A block-sparse pattern (:func:`attnjax.sparse_attention`).

  Attributes:
    pattern: ``(name, ((arg, value), ...))`` naming a factory of
      :mod:`attnjax.patterns`, e.g. ``("strided", (("stride", 4),))``;
      intersected with causal when the layer is causal.
    block_size: block size of the block-sparse computation.
  """

  family: ClassVar[str] = "sparse"

  pattern: Optional[tuple] = None
  block_size: int = 16

  def validate(self) -> None:
    super().validate()
    check_int("block_size", self.block_size)
    if self.pattern is None:
      raise ValueError("pattern=None: family='sparse' needs pattern=(name, ((arg, value), ...))")
    self.make_pattern()

  def make_pattern(self, is_causal: bool = True) -> patterns.Pattern:
    """The configured pattern, intersected with causal (decoders never look ahead)."""
    if (not isinstance(self.pattern, tuple) or len(self.pattern) != 2
        or not isinstance(self.pattern[0], str) or not isinstance(self.pattern[1], tuple)):
      raise TypeError(f"pattern must be (name, ((arg, value), ...)), got {self.pattern!r}")
    name, args = self.pattern
    _checks.check_choice("pattern name", name, PATTERNS)
    try:
      pattern = getattr(patterns, name)(**dict(args))
    except TypeError as e:
      raise TypeError(f"pattern={self.pattern!r}: bad arguments for patterns.{name}: {e}") from e
    except ValueError as e:
      raise ValueError(f"pattern={self.pattern!r}: {e}") from e
    return patterns.intersection(pattern, patterns.causal()) if is_causal else pattern

  def default_function(self, layer):
    return sparse_attention

  def decode_function(self, layer):
    return dense.dot_product_attention  # the pattern as a mask over the cache

  def check_cross(self, layer) -> None:
    raise ValueError("inputs_kv: family='sparse' cannot cross-attend (its pattern relates "
                     "positions of one sequence)")

  def allowed(self, layer, q_positions, k_positions, length):
    # The pattern's own element rule, at the cache's positions. Patterns whose
    # choice depends on the length (BigBird's random blocks) see the full
    # sequence length: the cache's capacity, max_len.
    pattern = self.make_pattern(layer.config.is_causal)
    allowed = pattern.allowed(q_positions, k_positions, (length, length))[None, None]
    valid = (k_positions >= 0)[None, None, None, :]
    return jnp.logical_and(allowed, valid)

  def full_call(self, layer, k, v, call):
    kw = self.kwargs(layer)
    extra = {} if call.segment_ids is None else {"segment_ids": call.segment_ids}
    if call.mask is None:
      return functools.partial(
          self.function(layer), pattern=self.make_pattern(layer.config.is_causal),
          block_size=self.block_size, **kw, **extra), k, v
    # sparse_attention takes no mask array: the pattern becomes a mask of the dense kernel.
    T = k.shape[1]
    pos = jnp.arange(T, dtype=jnp.int32)
    mask = jnp.logical_and(self.allowed(layer, pos, pos, T), call.mask)
    return functools.partial(dense.dot_product_attention, mask=mask, **kw, **extra), k, v

  def to_dict(self):
    out = super().to_dict()
    out["pattern"] = [self.pattern[0], dict(self.pattern[1])]
    return out

  @classmethod
  def options_from_json(cls, options):
    options = dict(options)
    pattern = options.get("pattern")
    if pattern is not None and not isinstance(pattern, tuple):
      name, args = pattern
      args = args.items() if isinstance(args, dict) else args
      options["pattern"] = (name, tuple((a, _freeze(b)) for a, b in args))
    return options


def _freeze(v):
  return tuple(v) if isinstance(v, list) else v


# ---------------------------------------------------------------------------
# Linear attention.


@dataclasses.dataclass(frozen=True)
class LinearSpec(AttentionSpec):
  """Kernel feature-map attention (:func:`attnjax.linear_attention`).

  Attributes:
    feature_map: a name from :mod:`attnjax.feature_maps` (``"elu_plus_one"``,
      ``"relu"``, ``"identity"``, ``"squared_relu"``, or the random
      ``"favor_plus"`` / ``"trig"``, whose projection ``[m, H]`` the layer draws
      at init and keeps as a non-trained variable).
    num_features: random features m of ``favor_plus`` / ``trig``.
    stabilize_features: random maps: subtract the stop-gradient maxima in the
      full forward (Performer practice). A decode state cannot carry them, so
      decoding always uses the exact estimator; with
      ``linear_normalize="denominator"`` the constants cancel and the two agree
      up to the denominator's ``eps``.
    linear_normalize: the ``normalize`` form of :func:`attnjax.linear_attention`.
    chunk_size: chunk size of the chunked implementation.

  No mask or segment ids: linear attention sums over every allowed key without
  forming the weights, so only causal, non-causal and cross-attention exist.
  """

  family: ClassVar[str] = "linear"
  optional_params: ClassVar[tuple[str, ...]] = ("feature_projection",)

  feature_map: str = "elu_plus_one"
  num_features: int = 64
  stabilize_features: bool = True
  linear_normalize: str = "denominator"
  chunk_size: int = 64

  def validate(self) -> None:
    check_int("num_features", self.num_features)
    check_int("chunk_size", self.chunk_size)
    check_type("stabilize_features", self.stabilize_features, bool, "a bool")
    _checks.check_choice("feature_map", self.feature_map, FEATURE_MAPS)
    _checks.check_choice("linear_normalize", self.linear_normalize, linear_lib.NORMALIZE)

  def check(self, config) -> None:
    if config.implementation is not None:
      _checks.check_choice("implementation", config.implementation, linear_lib.IMPLEMENTATIONS)

  def init_params(self, layer, rngs, param_dtype) -> None:
    layer.orthogonal_features = False
    if self.feature_map in feature_maps.RANDOM:
      factory = (feature_maps.favor_plus if self.feature_map == "favor_plus"
                 else feature_maps.trig_features)
      drawn = factory(rngs.params(), self.num_features, head_dim=layer.head_dim)
      layer.feature_projection = FeatureProjection(drawn.projection)
      layer.orthogonal_features = drawn.orthogonal

  def default_function(self, layer):
    return linear_lib.linear_attention

  def make_feature_map(self, layer, *, decoding: bool) -> feature_maps.FeatureMap:
    if self.feature_map not in feature_maps.RANDOM:
      return feature_maps.by_name(self.feature_map)
    # A carried state needs the exact (unstabilised) estimator; see the class docstring.
    return feature_maps.FeatureMap(
        self.feature_map, layer.feature_projection[...],
        stabilize=self.stabilize_features and not decoding, orthogonal=layer.orthogonal_features)

  def redraw(self, layer, key: Array) -> None:
    if self.feature_map not in feature_maps.RANDOM:
      raise ValueError(f"redraw_features needs a random feature map, this layer has "
                       f"family='linear', feature_map={self.feature_map!r}")
    layer.feature_projection[...] = feature_maps.gaussian_projection(
        key, self.num_features, layer.head_dim, orthogonal=layer.orthogonal_features)

  def attend(self, layer, q, k, v, call):
    c = layer.config
    if call.mask is not None:
      raise ValueError("mask: family='linear' cannot take a mask (it never forms the weights); "
                       "only causal, non-causal and cross-attention exist")
    if call.segment_ids is not None:
      raise ValueError("segment_ids: family='linear' cannot take segment_ids (packed sequences "
                       "need a mask, which linear attention cannot apply)")
    cache = call.cache
    is_causal = c.is_causal and not call.cross
    if not call.cross:
      T = q.shape[1]
      idx = jnp.arange(T, dtype=jnp.int32)
      if cache is not None:
        if not isinstance(cache, LinearCache):
          raise TypeError(f"cache must be a LinearCache for family='linear', "
                          f"got {type(cache).__name__}")
        if not c.is_causal:
          raise ValueError("decode needs is_causal=True: an encoder layer (is_causal=False) "
                           "has no decode")
        idx = idx + cache.index
      positions = idx if call.positions is None else call.positions
      q, k = _rope(layer, q, positions), _rope(layer, k, positions)
    fm = self.make_feature_map(layer, decoding=cache is not None)
    kwargs = dict(feature_map=fm, is_causal=is_causal, normalize=self.linear_normalize,
                  implementation=c.implementation, chunk_size=self.chunk_size)
    fn = self.function(layer)

    def weights():
      return linear_lib.linear_attention_weights(
          q, k, feature_map=fm, is_causal=is_causal, normalize=self.linear_normalize)

    if cache is None:
      run = functools.partial(fn, **kwargs)
      return run_and_sow(layer, run, q, k, v, call, weights=weights), None
    result = fn(q, k, v, initial_state=cache.state, return_state=True,
                return_stats=call.capture, **kwargs)
    new_cache = LinearCache(state=result[1], index=cache.index + q.shape[1])
    if call.capture:
      _layers.sow(layer, "attention_stats", result[-1])
      if call.sow_weights:
        _layers.sow(layer, "weights", weights())
    return result[0], new_cache

  def init_cache(self, layer, batch_size, max_len):
    K, H = layer.num_kv_heads, layer.head_dim
    F = self.make_feature_map(layer, decoding=True).num_features(H)
    return LinearCache(state=linear_lib.zeros_state(batch_size, K, F, H),
                       index=jnp.zeros((), jnp.int32))

  def allowed_mask(self, layer, length):
    if layer.config.is_causal:
      return jnp.tril(jnp.ones((length, length), bool))[None, None]
    return jnp.ones((1, 1, length, length), bool)


# ---------------------------------------------------------------------------
# The registry.

FAMILY_SPECS: dict[str, type[AttentionSpec]] = {}


def register_family(spec_class: type[AttentionSpec]) -> type[AttentionSpec]:
  """Makes ``spec_class`` (a frozen :class:`AttentionSpec` dataclass) a family of the layer.

  ``AttentionConfig(family=spec_class.family, ...)`` then builds it from its
  fields. Usable as a class decorator. Spec fields must not shadow the common
  fields of :class:`attnjax.nn.AttentionConfig`.
  """
  if not (isinstance(spec_class, type) and issubclass(spec_class, AttentionSpec)
          and dataclasses.is_dataclass(spec_class)):
    raise TypeError(f"spec_class must be an AttentionSpec dataclass, got {spec_class!r}")
  if not spec_class.family:
    raise ValueError(f"{spec_class.__name__}.family must name the family")
  FAMILY_SPECS[spec_class.family] = spec_class
  return spec_class


for _spec in (DenseSpec, QKNormSpec, CosineSpec, LinearSpec, SparseSpec):
  register_family(_spec)

del _spec
