"""Family ``nsa``: Native Sparse Attention as a layer, with its gates, compressor and cache.

The layer projects ``sigmoid(x W_g)`` gates ``[B, T, N, 3]``, owns the learned compressor of
keys and values (an MLP over each block of ``l`` RoPE'd keys with an intra-block position
encoding; ``compression="mean"`` has none) and calls :func:`attnjax.nsa_attention`. Decode
keeps an :class:`.NSACache`: the raw keys and values, and the compressed ones, each appended
when its block of ``l`` keys completes (every ``d`` tokens); a step runs the reference over
the cache at the new tokens' positions, equal to the full forward.
Guide: docs/guides/layers.md, section "The nsa and dsa families".
Implementation behind the public module :mod:`attnjax.nn`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple, Optional

import jax
import jax.numpy as jnp

from attnjax._src import validators, normalizers
from attnjax._src.attention_stats import stats_from_weights
from attnjax._src.nn import _layers
from attnjax._src.nn.caches import KVCache
from attnjax._src.nn.rope import apply_rope
from attnjax._src.nn.spec_base import AttentionSpec, Call, _rope, check_int, register_family
from attnjax._src.ops.nsa import attention as nsa_lib
from attnjax._src.ops.nsa import reference, rules

Array = jnp.ndarray

COMPRESSIONS = ("mlp", "mean")
_COMPRESSOR_FIELDS = rules.Compressor._fields


class NSACache(NamedTuple):
  """Decode cache of an ``nsa`` layer.

  Attributes:
    kv: the raw keys (before RoPE) and values seen so far (a full :class:`.KVCache`).
    k_compressed: ``[B, C, K, H]`` compressed keys of the blocks completed so far
      (``C = floor((max_len - l) / d) + 1`` slots; a slot is written when its block's last
      token arrives).
    v_compressed: ``[B, C, K, H]`` compressed values.
  """

  kv: KVCache
  k_compressed: Array
  v_compressed: Array


def _param_names(which: str) -> tuple[str, ...]:
  return tuple(f"compress_{which}_{f}" for f in _COMPRESSOR_FIELDS)


@dataclasses.dataclass(frozen=True)
class NSASpec(AttentionSpec):
  """Native Sparse Attention (:func:`attnjax.nsa_attention`) with learned gates and compressor.

  Attributes:
    block_length: ``l``, keys per compressed block.
    stride: ``d``, between compressed blocks (``d <= l``; ``l`` and ``l'`` multiples of it).
    selection_block: ``l'``, keys per selection block.
    num_selected: ``n``, selection blocks per query (a shorter sequence selects all it has).
    num_initial: leading blocks always selected.
    num_local: blocks up to the query's own always selected.
    window: ``w``: the window branch attends keys ``t - w .. t``.
    compression: ``"mlp"`` (the paper's learned compressor) or ``"mean"`` (mean pooling).
    compressor_hidden: the compressor MLP's hidden width (None: ``2 * head_dim``).
    normalizer: the normaliser of every branch (:mod:`attnjax.normalizers`).

  The gates are ``sigmoid(x W_g + b_g)`` (``nsa_gate``, ``D -> 3 N``, starting at 1/2 each).
  The layer shares its keys and values between the branches (the function also takes one
  per branch).
  """

  family: ClassVar[str] = "nsa"
  optional_params: ClassVar[tuple[str, ...]] = ("nsa_gate",) + _param_names("k") + _param_names("v")
  op: ClassVar[str] = "nsa"
  takes_segment_ids: ClassVar[bool] = False

  block_length: int = 32
  stride: int = 16
  selection_block: int = 64
  num_selected: int = 16
  num_initial: int = 1
  num_local: int = 2
  window: int = 512
  compression: str = "mlp"
  compressor_hidden: Optional[int] = None
  normalizer: str = "softmax"

  def validate(self) -> None:
    nsa_lib.check_block_sizes(self.block_length, self.stride, self.selection_block)
    check_int("num_selected", self.num_selected)
    check_int("num_initial", self.num_initial, minimum=0)
    check_int("num_local", self.num_local, minimum=0)
    if self.num_initial + self.num_local > self.num_selected:
      raise ValueError(
        f"num_initial={self.num_initial} + num_local={self.num_local} always-selected "
        f"blocks exceed num_selected={self.num_selected}"
      )
    check_int("window", self.window)
    validators.check_choice("compression", self.compression, COMPRESSIONS)
    check_int("compressor_hidden", self.compressor_hidden, allow_none=True)
    validators.check_choice("normalizer", self.normalizer, normalizers.NORMALIZERS)

  def check(self, config) -> None:
    if not config.is_causal:
      raise ValueError("is_causal=False: family='nsa' is causal self-attention (no encoder form)")

  def has_null_column(self) -> bool:
    return bool(normalizers.get(self.normalizer).null_column)

  def init_params(self, layer, rngs, param_dtype) -> None:
    D, N, H = layer.d_model, layer.num_heads, layer.head_dim
    lin = dict(rngs=rngs, dtype=layer.dtype, param_dtype=param_dtype)
    layer.nsa_gate = _layers.linear(D, 3 * N, ("embed", "heads"), use_bias=True, **lin)
    if self.compression != "mlp":
      return
    l = self.block_length
    M = self.compressor_hidden or 2 * H
    for which in ("k", "v"):
      w1 = _layers.fan_in_init(rngs.params(), (l * H, M), param_dtype)
      w2 = _layers.fan_in_init(rngs.params(), (M, H), param_dtype)
      values = (jnp.zeros((l, H), param_dtype), w1, jnp.zeros((M,), param_dtype), w2)
      values += (jnp.zeros((H,), param_dtype),)
      for name, value in zip(_param_names(which), values):
        setattr(layer, name, _layers.param(value, (None,) * value.ndim))

  def compressor(self, layer):
    """The layer's ``(key, value)`` :class:`attnjax.nsa.Compressor` pair, or None (mean)."""
    if self.compression != "mlp":
      return None
    return tuple(
      rules.Compressor(*(getattr(layer, name)[...] for name in _param_names(which)))
      for which in ("k", "v")
    )

  def default_function(self, layer):
    return nsa_lib.nsa_attention

  def gates(self, layer, x: Array) -> Array:
    """``[B, T, N, 3]`` float32 gates of the compressed, selected and window branches."""
    B, T, _ = x.shape
    g = jax.nn.sigmoid(layer.nsa_gate(x).astype(jnp.float32))
    return jnp.reshape(g, (B, T, layer.num_heads, 3))

  def options(self, length: int) -> dict:
    """The function's static options for ``length`` keys: ``num_selected`` (and the forced
    blocks) clamped to the selection blocks there are, which selects the same blocks."""
    blocks = rules.num_selection_blocks(max(length, 1), self.selection_block)
    n, n0, nl = self.num_selected, self.num_initial, self.num_local
    if n > blocks:  # every candidate is taken either way
      n = blocks
      n0 = min(n0, n)
      nl = min(nl, n - n0)
    return dict(
      block_length=self.block_length,
      stride=self.stride,
      selection_block=self.selection_block,
      num_selected=n,
      num_initial=n0,
      num_local=nl,
      window=self.window,
      normalizer=self.normalizer,
    )

  def _opts(self, layer, length: int) -> rules.NSAOptions:
    o = self.options(length)
    return rules.NSAOptions(
      block_length=o["block_length"],
      stride=o["stride"],
      selection_block=o["selection_block"],
      num_selected=o["num_selected"],
      num_initial=o["num_initial"],
      num_local=o["num_local"],
      window=o["window"],
      scale=layer.head_dim**-0.5,
      normalizers=(self.normalizer,) * 3,
    )

  def _refuse(self, call: Call) -> None:
    if call.cross:
      raise ValueError("inputs_kv: family='nsa' is causal self-attention; no cross-attention")
    if call.mask is not None:
      raise ValueError("mask: family='nsa' takes no mask (its selection is its own)")
    if call.segment_ids is not None:
      raise ValueError(
        "segment_ids: family='nsa' cannot keep packed documents apart (its compressed "
        "blocks span them)"
      )
    if call.inputs is None:
      raise ValueError(
        "family='nsa' projects its gates from the layer input: Call.inputs must be the "
        "layer's x [B, T, D]"
      )

  def attend(self, layer, q, k, v, call: Call):
    self._refuse(call)
    if call.cache is not None:
      return self._decode(layer, q, k, v, call)
    T = q.shape[1]
    positions = jnp.arange(T, dtype=jnp.int32) if call.positions is None else call.positions
    q, k = _rope(layer, q, positions), _rope(layer, k, positions)
    gates = self.gates(layer, call.inputs).astype(q.dtype)
    comp = self.compressor(layer)
    fn = self.function(layer)
    kw = dict(self.options(T), compressor=comp, implementation=layer.config.implementation)
    if not call.capture:
      return fn(q, k, v, gates, **kw), None
    out, stats = fn(q, k, v, gates, return_stats=True, **kw)
    self._sow(layer, q, k, gates, comp, stats, call)
    return out, None

  def _sow(self, layer, q, k, gates, comp, stats, call) -> None:
    """Per-branch statistics ``[B, N, 3]`` (``nsa_sink_mass``, ..., ``nsa_gate_mean``), per
    query ``nsa_first_weight [B, N, T, 3]`` and ``nsa_gates [B, T, N, 3]``, and the weights
    each raw key receives (their statistics as the layer's ``attention_stats``)."""
    branches = (stats.compressed, stats.selected, stats.window)
    for field in ("sink_mass", "entropy", "max_logit", "row_sum"):
      _layers.sow(layer, f"nsa_{field}", jnp.stack([getattr(b, field) for b in branches], -1))
    _layers.sow(layer, "nsa_gate_mean", stats.gate_mean)
    T = q.shape[1]
    opts = self._opts(layer, T)
    k32 = k.astype(jnp.float32)
    ck, _ = (None, None) if comp is None else comp
    k_c = rules.compress(k32, ck, block_length=opts.block_length, stride=opts.stride)
    zeros = jnp.zeros(k_c.shape, jnp.float32)
    _, weights = reference.attend(
      q.astype(jnp.float32),
      jnp.arange(T),
      (k32,) * 3,
      (k32,) * 3,
      k_c,
      zeros,
      gates,
      opts,
      return_weights=True,
    )
    w = weights["implied"]
    _layers.sow(layer, "nsa_first_weight", weights["first"])  # [B, N, T, 3]
    _layers.sow(layer, "nsa_gates", gates.astype(jnp.float32))  # [B, T, N, 3]
    allowed = self.allowed_mask(layer, T)
    summary = stats_from_weights(w, w, allowed, jnp.zeros(w.shape[:3] + (1,), jnp.float32))
    max_logit = jnp.max(jnp.stack([b.max_logit for b in branches], -1), axis=-1)
    summary = summary._replace(max_logit=max_logit, logsumexp=None)
    _layers.sow(layer, "attention_stats", summary)
    if call.sow_weights:
      _layers.sow(layer, "weights", w)

  # Decode.

  def init_cache(self, layer, batch_size, max_len):
    K, H = layer.num_kv_heads, layer.head_dim
    C = rules.num_compressed(max_len, self.block_length, self.stride)
    kv = KVCache(
      k=jnp.zeros((batch_size, max_len, K, H), layer.dtype),
      v=jnp.zeros((batch_size, max_len, K, H), layer.dtype),
      positions=jnp.full((max_len,), -1, jnp.int32),
      index=jnp.zeros((), jnp.int32),
      rope_positions=jnp.full((batch_size, max_len), -1, jnp.int32),
      segment_ids=jnp.zeros((batch_size, max_len), jnp.int32),
    )
    zeros = jnp.zeros((batch_size, C, K, H), layer.dtype)
    return NSACache(kv=kv, k_compressed=zeros, v_compressed=zeros)

  def _decode(self, layer, q, k, v, call):
    cache = call.cache
    self.check_decode_cache(layer, cache, NSACache)
    c = layer.config
    kv = cache.kv
    B, T = q.shape[:2]
    L = kv.k.shape[1]
    start = kv.index
    idx, seg, rope_q = call.decode_positions(start, B, T)
    put = lambda x, new: jax.lax.dynamic_update_slice_in_dim(x, new.astype(x.dtype), start, axis=1)
    kv = KVCache(
      k=put(kv.k, k),
      v=put(kv.v, v),
      positions=jax.lax.dynamic_update_slice_in_dim(kv.positions, idx, start, 0),
      index=start + T,
      rope_positions=put(kv.rope_positions, rope_q),
      segment_ids=put(kv.segment_ids, seg),
    )
    k_all = kv.k
    if c.rope_theta is not None:
      q = apply_rope(q, rope_q, c.rope_theta, scaling=c.rope_scaling)
      k_all = apply_rope(k_all, kv.rope_positions, c.rope_theta, scaling=c.rope_scaling)
    k_c, v_c = self._append_compressed(layer, cache, k_all, kv.v, start, T)
    opts = self._opts(layer, L)
    gates = self.gates(layer, call.inputs).astype(q.dtype)
    out = reference.attend(
      q, idx, (k_all,) * 3, (kv.v,) * 3, k_c, v_c, gates, opts, key_positions=kv.positions
    )
    return out, NSACache(kv=kv, k_compressed=k_c, v_compressed=v_c)

  def _append_compressed(self, layer, cache: NSACache, k_all, v_all, start, T: int):
    """The compressed keys and values with the blocks that complete in ``[start, start + T)``
    written (at most ``ceil(T / d) + 1`` of them: their number is static, their place not)."""
    l, d = self.block_length, self.stride
    C = cache.k_compressed.shape[1]
    if C == 0:
      return cache.k_compressed, cache.v_compressed
    comp = self.compressor(layer)
    ck, cv = (None, None) if comp is None else comp
    first = jnp.maximum(0, -((l - 1 - start) // d))  # ceil((start - l + 1) / d), at least 0
    slots = first + jnp.arange(math.ceil(T / d) + 1)  # candidate blocks
    done = jnp.logical_and(slots * d + l - 1 < start + T, slots < C)
    rows = jnp.clip(slots[:, None] * d + jnp.arange(l)[None, :], 0, k_all.shape[1] - 1)
    B, _, K, H = k_all.shape

    def blocks(x, compressor):
      xs = jnp.take(x, jnp.reshape(rows, (-1,)), axis=1)  # [B, M * l, K, X]
      return rules.compress(xs, compressor, block_length=l, stride=l)  # [B, M, K, X]

    new_k, new_v = blocks(k_all, ck), blocks(v_all, cv)
    target = jnp.where(done, slots, C)  # C: dropped
    k_c = cache.k_compressed.at[:, target].set(new_k.astype(cache.k_compressed.dtype), mode="drop")
    v_c = cache.v_compressed.at[:, target].set(new_v.astype(cache.v_compressed.dtype), mode="drop")
    return k_c, v_c

  def allowed_mask(self, layer, length):
    """Every causal pair: which the selection keeps depends on content."""
    return jnp.tril(jnp.ones((length, length), bool))[None, None]


register_family(NSASpec)
