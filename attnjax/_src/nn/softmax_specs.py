"""Softmax-style family specs: dense, qk_norm and cosine (the dense kernel), and sparse.

(Over 600 lines: the shared options of every logit family, modifiers included, and
their three calls stay in one place.)

:class:`.ScoreSpec` holds what every family with logits shares (normaliser,
softcap, sink logits) and the three calls (self-attention, cross-attention,
decode over a :class:`~.KVCache`, under a cache policy of
:mod:`attnjax.nn.kv_policies`); :class:`.DotProductSpec` adds the dense kernel's
k/v bias slot, windows and sinks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar, Literal, Optional

import jax
import jax.numpy as jnp

from attnjax._src import validators, deprecation, masks, mods, normalizers, patterns
from attnjax._src.ops.dense import attention as dense
from attnjax._src.ops.cosine import attention as cosine_lib
from attnjax._src.ops.qk_norm import attention as qk_norm_lib
from attnjax._src.nn import _layers, kv_policies
from attnjax._src.nn.spec_base import (
  DEFAULT_TEMPERATURE,
  PATTERNS,
  STREAMING_ROPE,
  AttentionSpec,
  Call,
  check_int,
  check_normalizer,
  check_type,
  init_normalizer_params,
  normalizer_param_kwargs,
  register_family,
  run_and_sow,
)
from attnjax._src.ops.sparse import attention as sparse_lib

Array = jnp.ndarray

QK_NORM_PLACEMENTS = ("before_rope", "after_rope")
QK_NORM_SCOPES = ("head", "projection")


@dataclasses.dataclass(frozen=True)
class ScoreSpec(AttentionSpec):
  """Options of every family that normalises logits (dense kernel and sparse).

  Attributes:
    normalizer: a registered normaliser's name (:mod:`attnjax.normalizers`); one that
      declares learned parameters gets them as ``normalizer_params`` (an ``nnx.Dict`` of
      ``[N]`` or scalar parameters at their ``init``).
    softcap: ``c`` of the ``c tanh(z / c)`` logit cap, or None.
    sink_logits: learn a per-head null logit ``[N]`` (gpt-oss; softmax only).
    alibi: add ALiBi's ``-slope_n |i - j|`` (:func:`attnjax.mods.alibi`, fixed
      slopes); RoPE is then not applied, whatever ``rope_theta`` says.
    relative_bias: add a learned T5 bucketed relative bias; the layer owns the
      table ``relative_bias_table [relative_buckets, N]`` (zero init).
      Bidirectional buckets unless the layer is causal.
    relative_buckets: number of T5 buckets.
    relative_max_distance: distance where the log buckets saturate.
    score_mod: any further score modifier (static, hashable, no args; see
      :mod:`attnjax.mods`), applied after ALiBi and the relative bias.
    mask_mod: a mask modifier (static, hashable, no args), intersected with the
      layer's masks. Modifiers are for full forwards (training, prefill
      without a cache, cross-attention); a decode with a cache raises.
    cache_policy: what a decode cache keeps (:mod:`attnjax.nn.kv_policies`):
      ``"full"``, ``"int8"``, ``"fp8"``, ``"h2o"`` or ``"sinks_window"``. The
      training forward is the same for every policy.
    cache_budget: key slots per sequence and key/value head of ``"h2o"`` and
      ``"sinks_window"`` (at most the cache's ``max_len``); None otherwise.
    cache_recent: the latest tokens always kept within the budget (None = the
      policy's default: half the budget for ``h2o``, all but 4 sink slots for
      ``sinks_window``); the rest are heavy hitters (``h2o``) or the first
      tokens (``sinks_window``).
  """

  optional_params: ClassVar[tuple[str, ...]] = (
    "sink_logits",
    "relative_bias_table",
    "normalizer_params",
  )
  op: ClassVar[str] = "dense"

  normalizer: str = "softmax"
  softcap: Optional[float] = None
  sink_logits: bool = False
  alibi: bool = False
  relative_bias: bool = False
  relative_buckets: int = 32
  relative_max_distance: int = 128
  score_mod: Optional[Callable[..., Any]] = None
  mask_mod: Optional[Callable[..., Any]] = None
  cache_policy: Literal["full", "int8", "fp8", "h2o", "sinks_window"] = "full"
  cache_budget: Optional[int] = None
  cache_recent: Optional[int] = None

  def validate(self) -> None:
    kv_policies.validate(self.cache_policy, self.cache_budget, self.cache_recent)
    check_type("alibi", self.alibi, bool, "a bool")
    check_type("relative_bias", self.relative_bias, bool, "a bool")
    check_int("relative_buckets", self.relative_buckets, minimum=4)
    check_int("relative_max_distance", self.relative_max_distance, minimum=2)
    for name in ("score_mod", "mask_mod"):
      fn = getattr(self, name)
      if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be a callable (see attnjax.mods) or None, got {fn!r}")
    nz = check_normalizer(self.normalizer)  # the live registry
    validators.check_positive_float("softcap", self.softcap)
    check_type("sink_logits", self.sink_logits, bool, "a bool")
    if self.sink_logits and not nz.accepts_sink_logits:
      raise ValueError(
        f"sink_logits=True adds a learned null column to softmax; it cannot be combined "
        f"with normalizer={self.normalizer!r}"
      )

  def init_params(self, layer, rngs, param_dtype) -> None:
    init_normalizer_params(layer, self.normalizer, param_dtype)
    if self.sink_logits:
      layer.sink_logits = _layers.param(jnp.zeros((layer.num_heads,), param_dtype), ("heads",))
    if self.relative_bias:
      layer.relative_bias_table = _layers.param(
        jnp.zeros((self.relative_buckets, layer.num_heads), param_dtype), (None, "heads")
      )

  def has_modifiers(self) -> bool:
    return bool(
      self.alibi or self.relative_bias or self.score_mod is not None or self.mask_mod is not None
    )

  def modifier_kwargs(self, layer) -> dict[str, Any]:
    """``score_mod`` / ``score_mod_args`` / ``mask_mod`` of the layer's modifiers (or {})."""
    return mods.layer_kwargs(
      num_heads=layer.num_heads,
      alibi=self.alibi,
      relative_bias=None
      if not self.relative_bias
      else (
        mods.t5_relative_bias(
          self.relative_buckets,
          self.relative_max_distance,
          bidirectional=not layer.config.is_causal,
        ),
        layer.relative_bias_table[...],
      ),
      score_mod=self.score_mod,
      mask_mod=self.mask_mod,
    )

  def has_null_column(self) -> bool:
    return bool(self.sink_logits or normalizers.get(self.normalizer).null_column)

  def kwargs(self, layer) -> dict[str, Any]:
    """Static and learned arguments of the family's function (not the masks)."""
    out = dict(
      normalizer=self.normalizer, softcap=self.softcap, implementation=layer.config.implementation
    )
    if self.sink_logits:
      out["sink_logits"] = layer.sink_logits[...]
    out.update(normalizer_param_kwargs(layer, self.normalizer))
    out.update(self.modifier_kwargs(layer))
    return out

  def decode_kwargs(self, layer) -> dict[str, Any]:
    """``kwargs`` of ``decode_function`` (the family's by default)."""
    return self.kwargs(layer)

  def default_function(self, layer) -> Callable:
    return dense.dot_product_attention

  # Hooks of the masks: the structure by position, and how a cache rolls.

  def allowed(self, layer, q_positions: Array, k_positions: Array, length: int) -> Array:
    """``bool [1, 1, T, S]`` pairs allowed by position; empty cache slots (-1) out."""
    raise NotImplementedError

  def rolling(self) -> tuple[Optional[int], int]:
    """``(window, num_sinks)`` of the layer's window and sinks; ``(None, 0)`` = none."""
    return None, 0

  def cache_rolling(self) -> tuple[Optional[int], int]:
    """``(window, num_sinks)`` of the cache's eviction rule; ``(None, 0)`` keeps every key.

    The layer's window and sinks, or those of ``cache_policy="sinks_window"``
    (``cache_recent`` latest slots after ``cache_budget - cache_recent`` sinks).
    """
    if self.cache_policy == "sinks_window":
      recent = kv_policies.recent_slots("sinks_window", self.cache_budget, self.cache_recent)
      return recent, self.cache_budget - recent
    return self.rolling()

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
      raise ValueError(
        f"inputs_kv: cross-attention takes no window or sinks (this layer has "
        f"window={w}, num_sinks={s})"
      )

  # The three calls.

  def attend(self, layer, q, k, v, call):
    q, k = self.prepare_qk(layer, q, k)
    if call.cross:
      return self._attend_cross(layer, q, k, v, call), None
    if call.cache is None:
      T = q.shape[1]
      positions = jnp.arange(T, dtype=jnp.int32) if call.positions is None else call.positions
      if not self.alibi:  # ALiBi replaces RoPE
        q, k = self.rotate(layer, q, positions), self.rotate(layer, k, positions)
      run, k, v = self.full_call(layer, k, v, call)
      weights = self.sown_weights(layer, run, q, k, v)
      return run_and_sow(layer, run, q, k, v, call, weights=weights), None
    return self._attend_decode(layer, q, k, v, call)

  def _attend_cross(self, layer, q, k, v, call):
    self.check_cross(layer)
    mask = call.mask
    if self.kv_slot():
      k, v, mask = self._append_kv_bias(layer, k, v, mask, q.shape[1])
    run = functools.partial(self.function(layer), mask=mask, **self.kwargs(layer))
    return run_and_sow(layer, run, q, k, v, call, weights=self.sown_weights(layer, run, q, k, v))

  def _attend_decode(self, layer, q, k, v, call):
    cache, policy = call.cache, self.cache_policy
    if self.has_modifiers():
      raise NotImplementedError(
        "decode with a cache: alibi, relative_bias, score_mod and mask_mod see call-local "
        "positions; run the full forward (no cache) for layers with modifiers"
      )
    self.check_decode_cache(layer, cache, kv_policies.cache_type(policy))
    if call.mask is not None:
      raise ValueError(
        "mask: a self-attention decode takes no mask; mark padding and packed "
        "documents with segment_ids"
      )
    if policy == "h2o":
      return kv_policies.h2o_decode(self, layer, q, k, v, call)
    scales = None
    if policy in kv_policies.QUANTIZED:
      # The new tokens attend as the cache will return them (quantised), so a
      # decode does not depend on how the sequence is split into calls.
      (k, k_scale), (v, v_scale) = (kv_policies.quantize(x, policy) for x in (k, v))
      scales = (k_scale, v_scale)
      old_k = kv_policies.dequantize(cache.k, cache.k_scale, layer.dtype)
      old_v = kv_policies.dequantize(cache.v, cache.v_scale, layer.dtype)
      new_k = kv_policies.dequantize(k, k_scale, layer.dtype)
      new_v = kv_policies.dequantize(v, v_scale, layer.dtype)
    else:
      old_k, old_v = cache.k, cache.v
      new_k, new_v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
    B, T = q.shape[:2]
    start = cache.index
    queries = call.decode_positions(start, B, T)
    idx, seg, rope_q = queries
    keys = (
      jnp.concatenate([cache.positions, idx]),
      jnp.concatenate([cache.segment_ids, seg], axis=1),
      jnp.concatenate([cache.rope_positions, rope_q], axis=1),
    )
    out = self.attend_cache(
      layer,
      q,
      jnp.concatenate([old_k, new_k], axis=1),
      jnp.concatenate([old_v, new_v], axis=1),
      call,
      start=start,
      length=cache.k.shape[1],
      queries=queries,
      keys=keys,
    )
    return out, self._write(cache, k, v, idx, rope_q, seg, scales)

  def attend_cache(
    self,
    layer,
    q: Array,
    k: Array,
    v: Array,
    call: Call,
    *,
    start: Array,
    length: int,
    queries: tuple,
    keys: tuple,
    weights: bool = False,
  ):
    """The decode step: the new tokens' ``q`` attend to ``k``, ``v`` (the cache's, then theirs).

    RoPE (``decode_rope``), the mask (``allowed`` and the segments),
    the k/v bias slot and the family's function, as every cache policy decodes.

    Args:
      layer: the :class:`~attnjax.nn.Attention` layer.
      q: ``[B, T, N, H]`` queries of the new tokens, before RoPE.
      k: ``[B, S, K, H]`` keys, cached then new, as stored (before RoPE).
      v: ``[B, S, K, Hv]`` values, likewise.
      call: the layer call (its ``positions``, for the sinks-window RoPE).
      start: the cache's index (tokens seen before this call).
      length: the cache's capacity (the sequence length patterns see).
      queries: ``(idx [T], seg [B, T], rope [B, T])`` of the new tokens
        (:meth:`~attnjax.nn.specs.Call.decode_positions`).
      keys: ``(positions, segment_ids, rope_positions)`` of the keys: ``[S]``,
        ``[B, S]``, ``[B, S]`` (one slot layout for every key/value head), or
        each ``[B, S, K]`` (slots per key/value head, ``cache_policy="h2o"``);
        position -1 = an empty slot.
      weights: also return the attention weights (``cache_policy="h2o"``).

    Returns:
      ``out [B, T, N, Hv]``, or with ``weights`` ``(out, w [B, T, N, S'])``:
      ``w`` is the function applied to identity values (with
      ``implementation="reference"`` unless an ``attention_fn`` is injected),
      over the keys and then the k/v bias slot, and ``out`` is ``w`` times ``v``.
    """
    c = layer.config
    idx, seg, q_rope = queries
    k_idx, k_seg, k_rope = keys
    B, T, N, _ = q.shape
    K = k.shape[2]
    if c.rope_theta is not None:
      q_rope, k_rope = self.decode_rope(layer, idx, k_idx, q_rope, k_rope, start, call)
      q, k = self.rotate(layer, q, q_rope), self.rotate(layer, k, k_rope)
    if k_idx.ndim == 1:
      mask = self.allowed(layer, idx, k_idx, length)
      mask = jnp.logical_and(mask, seg[:, None, :, None] == k_seg[:, None, None, :])
    else:  # each key/value head's own slots: the same rule at its positions, [B, K, T, S]
      per_head = jax.vmap(jax.vmap(lambda p: self.allowed(layer, idx, p, length)[0, 0]))
      mask = per_head(jnp.swapaxes(k_idx, 1, 2))
      same = seg[:, None, :, None] == jnp.swapaxes(k_seg, 1, 2)[:, :, None, :]
      mask = jnp.logical_and(mask, same)
      mask = jnp.repeat(mask, N // K, axis=1)  # query head n uses key/value head n // G
    if self.kv_slot():
      k, v, mask = self._append_kv_bias(layer, k, v, mask, T)
    kwargs = self.decode_kwargs(layer)
    if weights and layer.attention_fn is None:
      kwargs["implementation"] = "reference"  # identity values: any value width
    run = functools.partial(self.decode_function(layer), mask=mask, **kwargs)
    if not weights:
      return run_and_sow(layer, run, q, k, v, call, weights=self.sown_weights(layer, run, q, k, v))
    return self.attend_with_weights(layer, run, q, k, v, call)

  def attend_with_weights(self, layer, run: Callable, q: Array, k: Array, v: Array, call: Call):
    """``(out [B, T, N, Hv], w [B, T, N, S'])`` of ``run(q, k, v)`` (the decode step of
    :meth:`attend_cache` with ``weights``): ``w`` is ``run`` applied to identity values, and
    ``out`` is ``w`` times ``v``."""
    B, T, N, _ = q.shape
    K = k.shape[2]
    width = k.shape[1]
    eye = jnp.broadcast_to(
      jnp.eye(width, dtype=jnp.float32)[None, :, None, :], (B, width, K, width)
    )
    held = {}

    def run_from_weights(q_, k_, v_, return_stats=False):
      res = run(q_.astype(jnp.float32), k_.astype(jnp.float32), eye, return_stats=return_stats)
      w, stats = res if return_stats else (res, None)
      held["w"] = w  # [B, T, N, width]
      grouped = jnp.reshape(w, (B, T, K, N // K, width))
      out = jnp.einsum("btkgs,bskh->btkgh", grouped, v_.astype(jnp.float32))
      out = jnp.reshape(out, (B, T, N, -1)).astype(q_.dtype)
      return (out, stats) if return_stats else out

    out = run_and_sow(
      layer, run_from_weights, q, k, v, call, weights=lambda: jnp.transpose(held["w"], (0, 2, 1, 3))
    )
    return out, held["w"]

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
    return (
      jnp.concatenate([k, kb], axis=1),
      jnp.concatenate([v, vb], axis=1),
      jnp.concatenate([mask, ones], axis=-1),
    )

  def _write(self, cache, k, v, positions, rope_positions, segment_ids, scales=None):
    """Writes the new keys/values (and their ``scales``) into their slots.

    Tokens evicted at once are dropped. ``cache`` is a :class:`~.KVCache` or a
    :class:`~.QuantizedKVCache` (``k``, ``v`` already stored
    form); the same type is returned.
    """
    C = cache.k.shape[1]
    T = k.shape[1]
    end = cache.index + T
    W, s = self.cache_rolling()
    if W is None:
      slots, keep = positions, positions < C
    else:
      ring = s + (positions - s) % max(W, 1)
      slots = jnp.where(positions < s, positions, ring)
      keep = jnp.logical_or(positions < s, jnp.logical_and(W > 0, positions >= end - W))
    slots = jnp.where(keep, slots, C)  # out of range: dropped by mode="drop"
    changes = {}
    if scales is not None:
      changes = dict(
        k_scale=cache.k_scale.at[:, slots].set(scales[0], mode="drop"),
        v_scale=cache.v_scale.at[:, slots].set(scales[1], mode="drop"),
      )
    return cache._replace(
      k=cache.k.at[:, slots].set(k.astype(cache.k.dtype), mode="drop"),
      v=cache.v.at[:, slots].set(v.astype(cache.v.dtype), mode="drop"),
      positions=cache.positions.at[slots].set(positions, mode="drop"),
      index=end,
      rope_positions=cache.rope_positions.at[:, slots].set(rope_positions, mode="drop"),
      segment_ids=cache.segment_ids.at[:, slots].set(segment_ids, mode="drop"),
      **changes,
    )

  def cache_capacity_for(self, max_len: int) -> int:
    """Key slots of the decode cache for ``max_len`` tokens (the layer's window, the budget)."""
    if self.cache_policy in kv_policies.EVICTING:
      return min(max_len, self.cache_budget)
    return max_len

  def cache_capacity(self, layer, max_len):
    return self.cache_capacity_for(max_len)

  def init_cache(self, layer, batch_size, max_len):
    if self.cache_policy in kv_policies.EVICTING:
      kv_policies.check_budget(self.cache_budget, max_len)
    K, H, Hv = self.cache_shape(layer.config, layer.d_model)
    return kv_policies.init_cache(
      self.cache_policy,
      batch_size,
      self.cache_capacity(layer, max_len),
      K,
      H,
      layer.dtype,
      value_dim=Hv,
    )

  def cache_shape(self, config, d_model: int) -> tuple[int, int, int]:
    """``(K, H, Hv)``: key/value heads, key and value widths of the decode cache's slots (the
    layer's own; MLA's one latent head)."""
    H = config.head_dim_for(d_model)
    return config.kv_heads, H, self.value_head_dim(H)

  def allowed_mask(self, layer, length):
    pos = jnp.arange(length, dtype=jnp.int32)
    allowed = jnp.broadcast_to(self.allowed(layer, pos, pos, length), (1, 1, length, length))
    if self.kv_slot():
      allowed = jnp.concatenate([allowed, jnp.ones((1, 1, length, 1), bool)], axis=-1)
    return allowed


@dataclasses.dataclass(frozen=True)
class DotProductSpec(ScoreSpec):
  """Options shared by the dot-product families (dense, qk_norm, cosine).

  Attributes:
    kv_bias: learn one extra key/value pair per key/value head that every query
      may attend to (Sun et al. 2024, "attention bias"); it is appended after the
      real keys, so key 0 stays the first token for sink statistics.
    window: sliding window: query ``i`` sees keys ``i - window .. i`` (causal), or
      ``i - window .. i + window`` in an encoder layer (``is_causal=False``, ModernBERT's
      local layers).
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

  optional_params: ClassVar[tuple[str, ...]] = (
    "sink_logits",
    "k_bias",
    "v_bias",
    "normalizer_params",
  )

  kv_bias: bool = False
  window: Optional[int] = None
  num_sinks: int = 0
  streaming_rope: Literal["cache", "absolute"] = "cache"

  @property
  def plain_values(self) -> bool:  # type: ignore[override]
    """False with ``kv_bias``: its learned value slot mixes in beside the given values."""
    return not self.kv_bias

  def validate(self) -> None:
    super().validate()
    check_type("kv_bias", self.kv_bias, bool, "a bool")
    check_int("window", self.window, allow_none=True, minimum=0)
    check_int("num_sinks", self.num_sinks, minimum=0)
    validators.check_choice("streaming_rope", self.streaming_rope, STREAMING_ROPE)
    if self.num_sinks and self.window is None:
      raise ValueError(f"num_sinks={self.num_sinks} needs window (sinks + window attention)")
    if (
      self.streaming_rope != "cache" and not self.num_sinks and self.cache_policy != "sinks_window"
    ):
      raise ValueError(
        f"streaming_rope={self.streaming_rope!r} only applies with num_sinks > 0 "
        f"or cache_policy='sinks_window'"
      )
    if self.cache_policy in kv_policies.EVICTING and self.window is not None:
      raise ValueError(
        f"cache_policy={self.cache_policy!r} cannot be combined with "
        f"window={self.window}: the window already bounds the cache (use "
        f"cache_policy='full', or no window)"
      )

  def check(self, config) -> None:
    if not config.is_causal and (self.num_sinks or self.cache_policy in kv_policies.EVICTING):
      raise ValueError(
        f"num_sinks={self.num_sinks}, cache_policy={self.cache_policy!r}: sinks and "
        f"evicting caches need is_causal=True (a decoder)"
      )

  def structure_window(self, config) -> Optional[tuple[int, int]]:
    """The ``(left, right)`` window of the layer: ``(w, 0)`` causal, ``(w, w)`` in an encoder."""
    if self.window is None:
      return None
    return (self.window, 0) if config.is_causal else (self.window, self.window)

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

  def cache_capacity_for(self, max_len):
    if self.window is None:
      return super().cache_capacity_for(max_len)
    return min(max_len, self.num_sinks + self.window)

  def allowed(self, layer, q_positions, k_positions, length):
    if not layer.config.is_causal:
      allowed = jnp.ones((1, 1, q_positions.shape[0], k_positions.shape[0]), bool)
      if self.window is not None:
        allowed = masks.structural_mask(
          q_positions, k_positions, window=self.structure_window(layer.config)
        )
    elif self.num_sinks:
      pattern = patterns.sinks_window(self.num_sinks, self.window)
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
      window = self.structure_window(c)
      extra = {} if call.segment_ids is None else {"segment_ids": call.segment_ids}
      return (
        functools.partial(fn, mask=call.mask, is_causal=c.is_causal, window=window, **extra),
        k,
        v,
      )
    T = k.shape[1]
    pos = jnp.arange(T, dtype=jnp.int32)
    mask = masks.combine_masks(self.allowed(layer, pos, pos, T), call.mask)
    if call.segment_ids is not None:
      mask = jnp.logical_and(mask, masks.segment_mask(call.segment_ids))
    if self.kv_bias:
      k, v, mask = self._append_kv_bias(layer, k, v, mask, T)
    return functools.partial(fn, mask=mask, is_causal=False, window=None), k, v

  def decode_rope(self, layer, q_idx, k_idx, q_rope, k_rope, start, call):
    window, num_sinks = self.cache_rolling()
    if not (num_sinks and self.streaming_rope == "cache"):
      return q_rope, k_rope
    if call.positions is not None:
      raise ValueError(
        "positions: a sinks-window decode with streaming_rope='cache' rotates "
        "keys by their cache slot; use streaming_rope='absolute'"
      )
    # With the chunk's first query at p, the cache holds the sinks at 0..s-1 and the
    # window p-W..p-1 at s..s+W-1: every non-sink position shifts down by p - W - s
    # once that is positive. Exact for one-token steps; a longer chunk on a full cache
    # shares its first query's shift.
    shift = jnp.maximum(start - window - num_sinks, 0)
    k_shifted = jnp.where(k_idx < num_sinks, k_idx, k_idx - shift)
    return q_idx - shift, k_shifted


@dataclasses.dataclass(frozen=True)
class DenseSpec(DotProductSpec):
  """Scaled dot product (:func:`attnjax.dot_product_attention`).

  Attributes:
    similarity: ``"dot"`` or ``"neg_sq_euclidean"`` (``-||q - k||^2`` scores).
    scale: logit scale (None = ``H ** -0.5``), e.g. Gemma's
      ``query_pre_attn_scalar ** -0.5``.
  """

  family: ClassVar[str] = "dense"

  similarity: Literal["dot", "neg_sq_euclidean"] = "dot"
  scale: Optional[float] = None

  def validate(self) -> None:
    super().validate()
    validators.check_choice("similarity", self.similarity, dense.SIMILARITIES)
    validators.check_positive_float("scale", self.scale)

  def kwargs(self, layer):
    return dict(super().kwargs(layer), similarity=self.similarity, scale=self.scale)


@deprecation.renamed_fields(qk_scale="scale")
@dataclasses.dataclass(frozen=True)
class QKNormSpec(DotProductSpec):
  """Normalise q and k over the head dim (:func:`attnjax.qk_norm_attention`).

  Attributes:
    qk_norm: ``"rms"``, ``"layer"`` or ``"l2"``.
    qk_norm_placement: ``"before_rope"`` (normalise the projections, then rotate;
      OLMo 2 / Qwen 3) or ``"after_rope"`` (rotate, then the attention function
      normalises).
    qk_norm_gain: learn gains ``[H]`` for q and k after the norm.
    qk_norm_eps: epsilon of the norm.
    scale: logit scale (None = ``H ** -0.5``; ``"l2"`` usually needs a larger one), as
      :class:`.DenseSpec`'s (formerly ``qk_scale``, still accepted with a
      ``DeprecationWarning``).
    qk_norm_scope: ``"head"`` (over each head's ``H`` dims; Qwen 3, Gemma 3) or
      ``"projection"`` (over the whole projection, ``N H`` for q and ``K H``
      for k, before the heads are split; OLMo 2). The gains have that many
      entries; ``"projection"`` normalises in the module, before RoPE.
    qk_norm_gain_offset: the gains multiply as ``offset + gain`` (Gemma 3
      stores ``w`` of ``(1 + w)``, offset 1; 0 = the gains themselves).
  """

  family: ClassVar[str] = "qk_norm"
  op: ClassVar[str] = "qk_norm"
  optional_params: ClassVar[tuple[str, ...]] = ("q_gain", "k_gain") + DotProductSpec.optional_params

  qk_norm: Literal["rms", "layer", "l2"] = "rms"
  qk_norm_placement: Literal["before_rope", "after_rope"] = "before_rope"
  qk_norm_gain: bool = True
  qk_norm_eps: float = 1e-6
  scale: Optional[float] = None
  qk_norm_scope: Literal["head", "projection"] = "head"
  qk_norm_gain_offset: float = 0.0

  def validate(self) -> None:
    super().validate()
    validators.check_choice("qk_norm", self.qk_norm, qk_norm_lib.NORMS)
    validators.check_choice("qk_norm_placement", self.qk_norm_placement, QK_NORM_PLACEMENTS)
    check_type("qk_norm_gain", self.qk_norm_gain, bool, "a bool")
    validators.check_positive_float("qk_norm_eps", self.qk_norm_eps, allow_none=False)
    validators.check_positive_float("scale", self.scale)
    validators.check_choice("qk_norm_scope", self.qk_norm_scope, QK_NORM_SCOPES)
    check_type("qk_norm_gain_offset", self.qk_norm_gain_offset, (int, float), "a float")
    if self.qk_norm_scope == "projection" and self.qk_norm_placement != "before_rope":
      raise ValueError(
        f"qk_norm_scope='projection' normalises the projections before RoPE; "
        f"it needs qk_norm_placement='before_rope', got "
        f"{self.qk_norm_placement!r}"
      )
    if self.qk_norm_gain_offset and not self.qk_norm_gain:
      raise ValueError(f"qk_norm_gain_offset={self.qk_norm_gain_offset} needs qk_norm_gain=True")

  def init_params(self, layer, rngs, param_dtype) -> None:
    if self.qk_norm_gain:
      H = layer.head_dim
      q_size, k_size = H, H
      if self.qk_norm_scope == "projection":
        q_size, k_size = layer.num_heads * H, layer.num_kv_heads * H
      init = 1.0 - self.qk_norm_gain_offset  # the gains start as ones
      layer.q_gain = _layers.param(jnp.full((q_size,), init, param_dtype), (None,))
      layer.k_gain = _layers.param(jnp.full((k_size,), init, param_dtype), (None,))
    super().init_params(layer, rngs, param_dtype)

  def _norm_in_module(self, layer) -> bool:
    if self.qk_norm_scope == "projection":
      return True
    return self.qk_norm_placement == "before_rope" and layer.config.rope_theta is not None

  def _gains(self, layer):
    """The float32 gains the norm multiplies by (offset included), or ``(None, None)``."""
    if self.qk_norm_gain:
      offset = float(self.qk_norm_gain_offset)
      return tuple(g[...].astype(jnp.float32) + offset for g in (layer.q_gain, layer.k_gain))
    return None, None

  def _norm(self, x: Array, gain: Optional[Array]) -> Array:
    if self.qk_norm_scope == "projection":  # over the heads and their dims together
      B, T, n, H = x.shape
      y = qk_norm_lib.normalize_head(
        jnp.reshape(x, (B, T, 1, n * H)), self.qk_norm, self.qk_norm_eps
      )
      if gain is not None:
        y = y * jnp.reshape(gain.astype(jnp.float32), (1, 1, 1, -1))
      return jnp.reshape(y, x.shape).astype(x.dtype)
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
      return dict(out, scale=self.scale)
    q_gain, k_gain = self._gains(layer)
    return dict(
      out, norm=self.qk_norm, q_gain=q_gain, k_gain=k_gain, eps=self.qk_norm_eps, scale=self.scale
    )


@dataclasses.dataclass(frozen=True)
class CosineSpec(DotProductSpec):
  """Cosine similarity times a learned temperature (:func:`attnjax.cosine_attention`).

  Attributes:
    cosine_convention: ``"swin"``, ``"scale"`` or ``"ngpt"``.
    temperature_init: initial temperature (None = the convention's default:
      swin ``log 10``, scale ``10``, ngpt ``1``).
    qk_norm_eps: epsilon of the normalisation of q and k.
  """

  family: ClassVar[str] = "cosine"
  op: ClassVar[str] = "cosine"
  optional_params: ClassVar[tuple[str, ...]] = ("temperature",) + DotProductSpec.optional_params

  cosine_convention: Literal["swin", "scale", "ngpt"] = "swin"
  temperature_init: Optional[float] = None
  qk_norm_eps: float = 1e-6

  def validate(self) -> None:
    super().validate()
    validators.check_choice(
      "cosine_convention", self.cosine_convention, cosine_lib.COSINE_CONVENTIONS
    )
    if self.temperature_init is not None:
      check_type("temperature_init", self.temperature_init, (int, float), "a float")
    validators.check_positive_float("qk_norm_eps", self.qk_norm_eps, allow_none=False)

  @property
  def initial_temperature(self) -> float:
    if self.temperature_init is not None:
      return float(self.temperature_init)
    return DEFAULT_TEMPERATURE[self.cosine_convention]

  def init_params(self, layer, rngs, param_dtype) -> None:
    ngpt = self.cosine_convention == "ngpt"
    shape = (layer.num_heads, layer.head_dim) if ngpt else (layer.num_heads,)
    names = ("heads", None) if ngpt else ("heads",)
    layer.temperature = _layers.param(jnp.full(shape, self.initial_temperature, param_dtype), names)
    super().init_params(layer, rngs, param_dtype)

  def default_function(self, layer):
    return cosine_lib.cosine_attention

  def kwargs(self, layer):
    return dict(
      super().kwargs(layer),
      temperature=layer.temperature[...],
      convention=self.cosine_convention,
      eps=self.qk_norm_eps,
    )


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
  op: ClassVar[str] = "sparse"
  # The dense kernel's implementation standing for each of ours where the
  # layer masks by the pattern instead (decode, an explicit mask).
  DENSE_EQUIVALENT: ClassVar[dict[str, Optional[str]]] = {
    "blockwise": None,
    "reference": "reference",
  }

  pattern: Optional[tuple] = None
  block_size: int = 16

  def validate(self) -> None:
    super().validate()
    check_int("block_size", self.block_size)
    if self.cache_policy in kv_policies.EVICTING:
      raise ValueError(
        f"cache_policy={self.cache_policy!r}: family='sparse' masks its cache "
        f"by the pattern and keeps every key; use 'full', 'int8' or 'fp8'"
      )
    if self.pattern is None:
      raise ValueError("pattern=None: family='sparse' needs pattern=(name, ((arg, value), ...))")
    self.make_pattern()

  def make_pattern(self, is_causal: bool = True) -> patterns.Pattern:
    """The configured pattern, intersected with causal (decoders never look ahead)."""
    if (
      not isinstance(self.pattern, tuple)
      or len(self.pattern) != 2
      or not isinstance(self.pattern[0], str)
      or not isinstance(self.pattern[1], tuple)
    ):
      raise TypeError(f"pattern must be (name, ((arg, value), ...)), got {self.pattern!r}")
    name, args = self.pattern
    validators.check_choice("pattern name", name, PATTERNS)
    try:
      pattern = getattr(patterns, name)(**dict(args))
    except TypeError as e:
      raise TypeError(f"pattern={self.pattern!r}: bad arguments for patterns.{name}: {e}") from e
    except ValueError as e:
      raise ValueError(f"pattern={self.pattern!r}: {e}") from e
    return patterns.intersection(pattern, patterns.causal()) if is_causal else pattern

  def default_function(self, layer):
    return sparse_lib.sparse_attention

  def masked_function(self, layer) -> Callable:
    """The function of the paths that mask by the pattern (decode, an explicit mask).

    The injected ``attention_fn`` if any (it then receives the dense kernel's
    keywords, ``decode_kwargs``), else :func:`attnjax.dot_product_attention`.
    """
    return layer.attention_fn or dense.dot_product_attention

  def decode_function(self, layer):
    return self.masked_function(layer)  # the pattern as a mask over the cache

  def decode_kwargs(self, layer):
    """``kwargs`` for the dense kernel: our implementation name mapped to its equivalent."""
    out = self.kwargs(layer)
    impl = out["implementation"]
    impl = self.deprecated_implementations.get(impl, impl)  # an old name: its engine's
    out["implementation"] = impl if impl is None else self.DENSE_EQUIVALENT[impl]
    return out

  def check_cross(self, layer) -> None:
    raise ValueError(
      "inputs_kv: family='sparse' cannot cross-attend (its pattern relates "
      "positions of one sequence)"
    )

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
      return (
        functools.partial(
          self.function(layer),
          pattern=self.make_pattern(layer.config.is_causal),
          block_size=self.block_size,
          **kw,
          **extra,
        ),
        k,
        v,
      )
    # sparse_attention takes no mask array: the pattern becomes a mask of the dense kernel.
    T = k.shape[1]
    pos = jnp.arange(T, dtype=jnp.int32)
    mask = jnp.logical_and(self.allowed(layer, pos, pos, T), call.mask)
    return (
      functools.partial(
        self.masked_function(layer), mask=mask, **self.decode_kwargs(layer), **extra
      ),
      k,
      v,
    )

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


for _spec in (DenseSpec, QKNormSpec, CosineSpec, SparseSpec):
  register_family(_spec)
del _spec
