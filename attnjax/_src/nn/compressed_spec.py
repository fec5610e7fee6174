"""Family ``compressed``: memory-compressed attention with learned compression of keys and values.

The (RoPE'd) keys and values are compressed along the sequence by a learned strided
convolution per KV head (``projection="conv"``, Liu et al. 2018; initialised to mean
pooling) and go to :func:`attnjax.compressed_attention` with an optional raw window, or
by Linformer's learned projections (``projection="linformer"``, Wang et al. 2020;
non-causal only). Decode (conv, causal) keeps a full :class:`~.KVCache` of raw keys and
recomputes compressed attention over it at each step: exactly the full forward.

Guide: docs/guides/layers.md, section "The compressed and block-select families";
docs/guides/sparse.md. Implementation behind the public module :mod:`attnjax.nn`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, ClassVar, Optional

import jax
import jax.numpy as jnp

from attnjax._src import validators, normalizers
from attnjax._src.ops.compressed import attention as compressed
from attnjax._src.ops.dense import attention as dense
from attnjax._src.nn import _layers
from attnjax._src.nn.caches import KVCache
from attnjax._src.nn.rope import apply_rope
from attnjax._src.nn.spec_base import (
  AttentionSpec,
  Call,
  _rope,
  check_int,
  check_normalizer,
  check_type,
  init_normalizer_params,
  normalizer_param_kwargs,
  register_family,
  run_and_sow,
)

Array = jnp.ndarray

PROJECTIONS = ("conv", "linformer")


def strided_conv(x: Array, weight: Array, stride: int) -> Array:
  """``x [B, S, K, X]`` -> ``[B, ceil(S / stride), K, Y]`` with ``weight [K, stride, X, Y]``.

  Kernel = stride: block ``c`` is ``sum_s x[c * stride + s] @ weight[:, s]``
  per head; a last partial block is padded with zeros.
  """
  B, S, K, X = x.shape
  C = compressed.num_blocks(S, stride)
  x = jnp.pad(x, [(0, 0), (0, C * stride - S), (0, 0), (0, 0)])
  x = jnp.reshape(x, (B, C, stride, K, X))
  return jnp.einsum("bcskx,ksxy->bcky", x, weight.astype(x.dtype))


@dataclasses.dataclass(frozen=True)
class CompressedSpec(AttentionSpec):
  """Memory-compressed attention (:func:`attnjax.compressed_attention`) with learned compression.

  Attributes:
    stride: positions per compressed block (conv kernel and stride).
    window: raw keys of a local window seen beside the compressed ones: keys
      ``i - window .. i`` (``window + 1``, as ``window`` everywhere;
      :func:`attnjax.compressed_attention`'s ``window``), or None.
    projection: ``"conv"`` (learned strided convolution) or ``"linformer"``
      (learned ``E, F`` along the sequence; non-causal layers only).
    length: Linformer's projected length ``m``.
    max_len: Linformer's longest sequence (``E, F`` are ``[length, max_len]``).
    normalizer: a registered normaliser's name (:mod:`attnjax.normalizers`; learned
      parameters as :class:`.ScoreSpec`'s).
    softcap: ``c`` of the ``c tanh(z / c)`` logit cap, or None.
    block_size: block size of the blockwise path.
  """

  family: ClassVar[str] = "compressed"
  optional_params: ClassVar[tuple[str, ...]] = (
    "compress_k",
    "compress_v",
    "linformer_e",
    "linformer_f",
    "normalizer_params",
  )
  op: ClassVar[str] = "compressed"

  stride: int = 4
  window: Optional[int] = None
  projection: str = "conv"
  length: int = 64
  max_len: int = 512
  normalizer: str = "softmax"
  softcap: Optional[float] = None
  block_size: int = 16

  def validate(self) -> None:
    check_int("stride", self.stride)
    check_int("window", self.window, allow_none=True, minimum=0)
    check_int("length", self.length)
    check_int("max_len", self.max_len)
    check_int("block_size", self.block_size)
    check_type("projection", self.projection, str, "a str")
    validators.check_choice("projection", self.projection, PROJECTIONS)
    check_normalizer(self.normalizer)  # the live registry
    validators.check_positive_float("softcap", self.softcap)
    if self.projection == "linformer" and self.window is not None:
      raise ValueError(
        f"window={self.window}: projection='linformer' attends to its "
        f"projected rows only (no raw window)"
      )

  def check(self, config) -> None:
    if self.projection == "linformer" and config.is_causal:
      raise ValueError(
        "projection='linformer' is non-causal only (E and F mix the whole sequence, "
        "Wang et al. 2020): set is_causal=False, or use projection='conv'"
      )

  def has_null_column(self) -> bool:
    return bool(normalizers.get(self.normalizer).null_column)

  def init_params(self, layer, rngs, param_dtype) -> None:
    init_normalizer_params(layer, self.normalizer, param_dtype)
    K, H = layer.num_kv_heads, layer.head_dim
    if self.projection == "conv":
      mean = jnp.broadcast_to(jnp.eye(H, dtype=param_dtype) / self.stride, (K, self.stride, H, H))
      layer.compress_k = _layers.param(mean, ("heads", None, None, None))
      layer.compress_v = _layers.param(mean, ("heads", None, None, None))
    else:
      init = jax.nn.initializers.normal(self.max_len**-0.5)
      layer.linformer_e = _layers.param(
        init(rngs.params(), (self.length, self.max_len), param_dtype), (None, None)
      )
      layer.linformer_f = _layers.param(
        init(rngs.params(), (self.length, self.max_len), param_dtype), (None, None)
      )

  def default_function(self, layer) -> Callable:
    if self.projection == "linformer":
      return dense.dot_product_attention
    return compressed.compressed_attention

  def _compress(self, layer, k: Array, v: Array) -> tuple[Array, Array]:
    if self.projection == "conv":
      return (
        strided_conv(k, layer.compress_k[...], self.stride),
        strided_conv(v, layer.compress_v[...], self.stride),
      )
    T = k.shape[1]
    if T > self.max_len:
      raise ValueError(
        f"projection='linformer': the sequence (T={T}) is longer than max_len={self.max_len}"
      )
    e = layer.linformer_e[...][:, :T].astype(k.dtype)
    f = layer.linformer_f[...][:, :T].astype(v.dtype)
    return jnp.einsum("mt,btkh->bmkh", e, k), jnp.einsum("mt,btkh->bmkh", f, v)

  def _run(self, layer, q, k, v, *, segment_ids=None, return_stats=False, values=None):
    """Attention of ``q`` over the compressed ``k, v`` (``values``: ``(v_c, v)`` replacing them)."""
    k_c, v_c = self._compress(layer, k, v)
    if values is not None:
      v_c, v = values(v_c, v)
    impl = layer.config.implementation
    fn = self.function(layer)
    if self.projection == "linformer":
      if segment_ids is not None:
        raise ValueError(
          "segment_ids: projection='linformer' mixes the whole sequence and "
          "cannot keep packed documents apart"
        )
      return fn(
        q,
        k_c,
        v_c,
        normalizer=self.normalizer,
        softcap=self.softcap,
        implementation="reference" if impl == "reference" else None,
        return_stats=return_stats,
        **normalizer_param_kwargs(layer, self.normalizer),
      )
    return fn(
      q,
      k,
      v,
      stride=self.stride,
      pool=(k_c, v_c),
      is_causal=layer.config.is_causal,
      window=self.window,
      normalizer=self.normalizer,
      softcap=self.softcap,
      segment_ids=segment_ids,
      implementation=impl,
      return_stats=return_stats,
      block_size=self.block_size,
      **normalizer_param_kwargs(layer, self.normalizer),
    )

  def _slot_weights(self, layer, q, k, v, segment_ids) -> Array:
    """``[B, N, T, slots]``: the weights over the key slots, as attention to one-hot values."""

    def one_hot(v_c, v):
      B, C, K, _ = v_c.shape
      if self.projection == "linformer":
        return jnp.broadcast_to(jnp.eye(C)[None, :, None, :], (B, C, K, C)), v
      slots = C + v.shape[1]
      eye = jnp.eye(slots)[None, :, None, :]
      return (
        jnp.broadcast_to(eye[:, :C], (B, C, K, slots)),
        jnp.broadcast_to(eye[:, C:], (B, v.shape[1], K, slots)),
      )

    w = self._run(
      layer,
      q.astype(jnp.float32),
      k.astype(jnp.float32),
      v.astype(jnp.float32),
      segment_ids=segment_ids,
      values=one_hot,
    )
    return jnp.transpose(w, (0, 2, 1, 3))

  def attend(self, layer, q, k, v, call: Call):
    if call.cross:
      raise ValueError(
        "inputs_kv: family='compressed' cannot cross-attend (its blocks follow "
        "the positions of one sequence)"
      )
    if call.mask is not None:
      raise ValueError(
        "mask: family='compressed' takes no mask array (a mask over raw keys "
        "has no meaning for compressed ones); mark documents with segment_ids"
      )
    if call.cache is not None:
      return self._decode(layer, q, k, v, call)
    T = q.shape[1]
    positions = jnp.arange(T, dtype=jnp.int32) if call.positions is None else call.positions
    q, k = _rope(layer, q, positions), _rope(layer, k, positions)
    run = functools.partial(self._run, layer, segment_ids=call.segment_ids)
    weights = lambda: self._slot_weights(layer, q, k, v, call.segment_ids)
    return run_and_sow(layer, run, q, k, v, call, weights=weights), None

  def _decode(self, layer, q, k, v, call):
    """Writes the new raw keys, then recomputes over the whole cache (see the module docstring)."""
    cache = call.cache
    self.check_decode_cache(layer, cache, KVCache)
    B, T = q.shape[:2]
    L = cache.k.shape[1]
    start = cache.index
    idx, seg, rope_q = call.decode_positions(start, B, T)
    put = lambda x, new: jax.lax.dynamic_update_slice_in_dim(x, new.astype(x.dtype), start, axis=1)
    cache = KVCache(
      k=put(cache.k, k),
      v=put(cache.v, v),
      positions=jax.lax.dynamic_update_slice_in_dim(cache.positions, idx, start, 0),
      index=start + T,
      rope_positions=put(cache.rope_positions, rope_q),
      segment_ids=put(cache.segment_ids, seg),
    )
    k_all, theta = cache.k, layer.config.rope_theta
    if theta is not None:
      scaling = layer.config.rope_scaling
      partial = layer.config.rope_dim
      q = apply_rope(q, rope_q, theta, scaling=scaling, rotary_dim=partial)
      k_all = apply_rope(k_all, cache.rope_positions, theta, scaling=scaling, rotary_dim=partial)
    # The new queries at their positions of a full-length query sequence; other rows are dropped.
    q_all = put(jnp.zeros((B, L) + q.shape[2:], q.dtype), q)
    out = self._run(
      layer, q_all, k_all, cache.v, segment_ids=(cache.segment_ids, cache.segment_ids)
    )
    return jax.lax.dynamic_slice_in_dim(out, start, T, axis=1), cache

  def init_cache(self, layer, batch_size, max_len):
    K, H = layer.num_kv_heads, layer.head_dim
    return KVCache(
      k=jnp.zeros((batch_size, max_len, K, H), layer.dtype),
      v=jnp.zeros((batch_size, max_len, K, H), layer.dtype),
      positions=jnp.full((max_len,), -1, jnp.int32),
      index=jnp.zeros((), jnp.int32),
      rope_positions=jnp.full((batch_size, max_len), -1, jnp.int32),
      segment_ids=jnp.zeros((batch_size, max_len), jnp.int32),
    )

  def allowed_mask(self, layer, length):
    """Raw pairs ``(i, j)`` whose key reaches query ``i``: through a visible compressed block or
    the window (every pair when not causal, and for Linformer)."""
    i = jnp.arange(length)[:, None]
    j = jnp.arange(length)[None, :]
    if self.projection == "linformer" or not layer.config.is_causal:
      return jnp.ones((1, 1, length, length), bool)
    end = (j // self.stride + 1) * self.stride - 1
    allowed = end <= i
    if self.window is not None:
      allowed = allowed | ((j <= i) & (j >= i - self.window))
    return allowed[None, None]


register_family(CompressedSpec)
