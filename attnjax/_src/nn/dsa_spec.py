"""Family ``dsa``: DeepSeek Sparse Attention as a layer, with its lightning indexer and cache.

The indexer's queries ``[B, T, NI, HI]``, key ``[B, T, HI]`` and head weights are
projected from the layer input with its gradient stopped (DeepSeek-V3.2 detaches the
indexer's input), so the language-model loss never trains them; the indexer learns from
:func:`attnjax.dsa.indexer_loss`, which the layer adds as its gradient (see
``indexer_loss_weight``). Decode keeps a :class:`.DSACache`: the raw keys and values and
the indexer's keys.
Guide: docs/guides/layers.md, section "The nsa and dsa families".
Implementation behind the public module :mod:`attnjax.nn`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from attnjax._src import validators, normalizers
from attnjax._src.nn import _layers
from attnjax._src.nn.caches import KVCache
from attnjax._src.nn.rope import apply_rope
from attnjax._src.nn.spec_base import (
  AttentionSpec,
  Call,
  _rope,
  check_int,
  check_type,
  register_family,
  run_and_sow,
)
from attnjax._src.ops.dense import attention as dense
from attnjax._src.ops.dsa import attention as dsa_lib

Array = jnp.ndarray


class DSACache(NamedTuple):
  """Decode cache of a ``dsa`` layer.

  Attributes:
    kv: the raw keys (before RoPE) and values seen so far (a full :class:`.KVCache`).
    index_k: ``[B, C, HI]`` the indexer's key of each slot (RoPE applied).
  """

  kv: KVCache
  index_k: Array


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def with_indexer_gradient(out, index, target, weight: float, top_k):
  """``out`` unchanged; its VJP also gives ``index = (q_I, k_I, w)`` the gradient of
  ``weight * indexer_loss(*target, *index, top_k=top_k)`` (``target = (q, k)`` gets none): as
  if that loss were added to the training loss, since nothing else reaches the indexer."""
  del index, target
  return out


def _inject_fwd(out, index, target, weight, top_k):
  return out, (index, target)


def _inject_bwd(weight, top_k, res, ct):
  index, target = res
  grads = jax.grad(lambda idx: weight * dsa_lib.indexer_loss(*target, *idx, top_k=top_k))(index)
  return ct, grads, jax.tree.map(jnp.zeros_like, target)


with_indexer_gradient.defvjp(_inject_fwd, _inject_bwd)


@dataclasses.dataclass(frozen=True)
class DSASpec(AttentionSpec):
  """DeepSeek Sparse Attention (:func:`attnjax.dsa_attention`) with its lightning indexer.

  Attributes:
    top_k: keys per query (a shorter sequence keeps them all).
    index_heads: ``NI``, the indexer's heads.
    index_head_dim: ``HI``, their width (even with RoPE).
    normalizer: the main attention's normaliser.
    indexer_loss_weight: the indexer's KL loss enters training as ``weight *
      dKL/d(indexer)`` on its parameters (0: the indexer is not trained).
    warmup: DeepSeek's first stage: dense causal attention, the indexer trained by the KL
      over every key; False: sparse attention over the top-k keys, the KL over them.

  Parameters: ``index_q_proj`` (``D -> NI HI``), ``index_k_proj`` (``D -> HI``),
  ``index_w_proj`` (``D -> NI``; the weights are scaled by ``(NI HI)^-1/2``).
  """

  family: ClassVar[str] = "dsa"
  optional_params: ClassVar[tuple[str, ...]] = ("index_q_proj", "index_k_proj", "index_w_proj")
  op: ClassVar[str] = "dsa"

  top_k: int = 2048
  index_heads: int = 4
  index_head_dim: int = 32
  normalizer: str = "softmax"
  indexer_loss_weight: float = 1.0
  warmup: bool = False

  def validate(self) -> None:
    check_int("top_k", self.top_k)
    check_int("index_heads", self.index_heads)
    check_int("index_head_dim", self.index_head_dim)
    validators.check_choice("normalizer", self.normalizer, normalizers.NORMALIZERS)
    check_type("indexer_loss_weight", self.indexer_loss_weight, (int, float), "a float")
    if self.indexer_loss_weight < 0:
      raise ValueError(f"indexer_loss_weight must be >= 0, got {self.indexer_loss_weight}")
    check_type("warmup", self.warmup, bool, "a bool")

  def check(self, config) -> None:
    if not config.is_causal:
      raise ValueError("is_causal=False: family='dsa' is causal self-attention (no encoder form)")
    if config.rope_theta is not None and self.index_head_dim % 2:
      raise ValueError(f"index_head_dim={self.index_head_dim} must be even for RoPE")

  def has_null_column(self) -> bool:
    return bool(normalizers.get(self.normalizer).null_column)

  def init_params(self, layer, rngs, param_dtype) -> None:
    D, NI, HI = layer.d_model, self.index_heads, self.index_head_dim
    lin = dict(rngs=rngs, dtype=layer.dtype, param_dtype=param_dtype)
    layer.index_q_proj = _layers.linear(D, NI * HI, ("embed", "heads"), **lin)
    layer.index_k_proj = _layers.linear(D, HI, ("embed", None), **lin)
    layer.index_w_proj = _layers.linear(D, NI, ("embed", None), **lin)

  def default_function(self, layer):
    return dsa_lib.dsa_attention

  def indexer(self, layer, x: Array, positions: Array):
    """``(q_I [B, T, NI, HI], k_I [B, T, HI], w [B, T, NI])`` of ``x`` (gradient stopped)."""
    B, T, _ = x.shape
    NI, HI = self.index_heads, self.index_head_dim
    x = jax.lax.stop_gradient(x)
    iq = jnp.reshape(layer.index_q_proj(x), (B, T, NI, HI))
    ik = jnp.reshape(layer.index_k_proj(x), (B, T, 1, HI))
    iq, ik = _rope(layer, iq, positions), _rope(layer, ik, positions)
    w = layer.index_w_proj(x) * (NI * HI) ** -0.5
    return iq, ik[:, :, 0], w

  def _top_k(self, length: int) -> int:
    return length if self.warmup else min(self.top_k, max(length, 1))

  def _refuse(self, call: Call) -> None:
    if call.cross:
      raise ValueError("inputs_kv: family='dsa' is causal self-attention; no cross-attention")
    if call.mask is not None:
      raise ValueError("mask: family='dsa' takes no mask; mark packed documents with segment_ids")
    if call.inputs is None:
      raise ValueError(
        "family='dsa' projects its indexer from the layer input: Call.inputs must be the "
        "layer's x [B, T, D]"
      )

  def attend(self, layer, q, k, v, call: Call):
    self._refuse(call)
    if call.cache is not None:
      return self._decode(layer, q, k, v, call)
    T = q.shape[1]
    positions = jnp.arange(T, dtype=jnp.int32) if call.positions is None else call.positions
    q, k = _rope(layer, q, positions), _rope(layer, k, positions)
    iq, ik, w = self.indexer(layer, call.inputs, positions)
    top_k = self._top_k(T)
    fn = functools.partial(
      self.function(layer),
      index_q=iq,
      index_k=ik,
      index_weights=w,
      top_k=top_k,
      normalizer=self.normalizer,
      segment_ids=call.segment_ids,
      implementation=layer.config.implementation,
    )
    out = run_and_sow(layer, fn, q, k, v, call)
    if call.capture:
      kl_top_k = None if self.warmup else top_k
      loss = dsa_lib.indexer_loss(q, k, iq, ik, w, top_k=kl_top_k, segment_ids=call.segment_ids)
      _layers.sow(layer, "indexer_loss", loss)
    if self.indexer_loss_weight > 0:
      out = with_indexer_gradient(
        out,
        (iq, ik, w),
        (jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)),
        float(self.indexer_loss_weight),
        None if self.warmup else top_k,
      )
    return out, None

  def indexer_loss(self, layer, x: Array) -> Array:
    """The KL loss of the layer's indexer on ``x`` ``[B, T, D]`` (the stage's: dense in the
    warm-up, over the top-k keys after): a loss whose gradient reaches only the indexer."""
    B, T, _ = x.shape
    positions = jnp.arange(T, dtype=jnp.int32)
    q, k, _ = layer._project(x)
    q, k = _rope(layer, q, positions), _rope(layer, k, positions)
    iq, ik, w = self.indexer(layer, x, positions)
    top_k = None if self.warmup else self._top_k(T)
    return dsa_lib.indexer_loss(q, k, iq, ik, w, top_k=top_k)

  # Decode.

  def init_cache(self, layer, batch_size, max_len):
    K, H = layer.num_kv_heads, layer.head_dim
    kv = KVCache(
      k=jnp.zeros((batch_size, max_len, K, H), layer.dtype),
      v=jnp.zeros((batch_size, max_len, K, H), layer.dtype),
      positions=jnp.full((max_len,), -1, jnp.int32),
      index=jnp.zeros((), jnp.int32),
      rope_positions=jnp.full((batch_size, max_len), -1, jnp.int32),
      segment_ids=jnp.zeros((batch_size, max_len), jnp.int32),
    )
    index_k = jnp.zeros((batch_size, max_len, self.index_head_dim), layer.dtype)
    return DSACache(kv=kv, index_k=index_k)

  def _decode(self, layer, q, k, v, call):
    cache = call.cache
    self.check_decode_cache(layer, cache, DSACache)
    c = layer.config
    kv = cache.kv
    B, T, N, _ = q.shape
    L = kv.k.shape[1]
    start = kv.index
    idx, seg, rope_q = call.decode_positions(start, B, T)
    put = lambda x, new: jax.lax.dynamic_update_slice_in_dim(x, new.astype(x.dtype), start, axis=1)
    iq, ik, w = self.indexer(layer, call.inputs, rope_q)
    kv = KVCache(
      k=put(kv.k, k),
      v=put(kv.v, v),
      positions=jax.lax.dynamic_update_slice_in_dim(kv.positions, idx, start, 0),
      index=start + T,
      rope_positions=put(kv.rope_positions, rope_q),
      segment_ids=put(kv.segment_ids, seg),
    )
    index_k = put(cache.index_k, ik)
    k_all = kv.k
    if c.rope_theta is not None:
      q = apply_rope(q, rope_q, c.rope_theta, scaling=c.rope_scaling)
      k_all = apply_rope(k_all, kv.rope_positions, c.rope_theta, scaling=c.rope_scaling)
    # The indexer over the cache, causality and segments before the top-k.
    scores = dsa_lib.index_scores(iq, index_k, w)  # [B, T, L]
    allowed = (kv.positions[None, :] >= 0) & (kv.positions[None, :] <= idx[:, None])
    allowed = jnp.logical_and(allowed[None], seg[:, :, None] == kv.segment_ids[:, None, :])
    top_k = L if self.warmup else min(self.top_k, L)  # selects as the full forward does
    keys = dsa_lib.top_keys(scores, allowed, top_k)  # [B, T, top_k]
    chosen = jnp.any(keys[..., None] == jnp.arange(L)[None, None, None, :], axis=-2)
    mask = jnp.logical_and(chosen, allowed)[:, None]  # [B, 1, T, L]
    run = functools.partial(
      layer.attention_fn or dense.dot_product_attention,
      mask=mask,
      normalizer=self.normalizer,
      implementation="reference" if c.implementation == "reference" else None,
    )
    out = run_and_sow(layer, run, q, k_all, kv.v, call)
    return out, DSACache(kv=kv, index_k=index_k)

  def allowed_mask(self, layer, length):
    """Every causal pair: which the top-k keeps depends on content."""
    return jnp.tril(jnp.ones((length, length), bool))[None, None]


register_family(DSASpec)
