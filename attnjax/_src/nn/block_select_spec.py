"""The ``block_select`` family: content-selected block-sparse attention (MoBA) as an nn layer.

Training forward: :func:`attnjax.block_select_attention` (gathered path). The default
``query_pool="first"`` fixes a block's selection once its first token is seen, so
decoding token by token equals the full forward. Decode keeps a
:class:`.BlockSelectCache`: the full :class:`~.KVCache` plus the (RoPE'd) first query of
the current block, which scores the complete key blocks of the cache.

Guide: docs/guides/layers.md, section "The compressed and block-select families";
docs/guides/sparse.md, section "Content-selected blocks (MoBA)".
Implementation behind the public module :mod:`attnjax.nn`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import jax.numpy as jnp

from attnjax._src import validators
from attnjax._src.ops.dense import attention as dense
from attnjax._src.ops.block_select import attention as block_select_lib
from attnjax._src.nn.caches import KVCache
from attnjax._src.nn.rope import apply_rope
from attnjax._src.nn.softmax_specs import ScoreSpec
from attnjax._src.nn.spec_base import check_int, register_family, run_and_sow

Array = jnp.ndarray


class BlockSelectCache(NamedTuple):
  """Decode cache of a ``block_select`` layer.

  Attributes:
    kv: the keys and values seen so far (a full :class:`.KVCache`).
    block_query: ``[B, N, H]`` the compared (RoPE'd) first query of the block
      that holds the next position (read when that position is not a block start).
  """

  kv: KVCache
  block_query: Array


@dataclasses.dataclass(frozen=True)
class BlockSelectSpec(ScoreSpec):
  """Content-selected block-sparse attention (:func:`attnjax.block_select_attention`).

  Attributes:
    block_size: positions per query and key block.
    top_k: earlier key blocks each query block keeps besides its own.
    query_pool: ``"first"`` (strictly causal, has a decode) or ``"mean"``
      (non-causal layers only: with a causal layer the call refuses it, as a
      block's mean query holds its later tokens).

  Also the logit options of :class:`.ScoreSpec` (normaliser, softcap, sink
  logits); not its modifiers (ALiBi, relative bias, score_mod, mask_mod).
  """

  family: ClassVar[str] = "block_select"
  op: ClassVar[str] = "block_select"
  DENSE_EQUIVALENT: ClassVar[dict[str, Any]] = {"gathered": None, "reference": "reference"}

  block_size: int = 16
  top_k: int = 2
  query_pool: str = "first"

  def validate(self) -> None:
    super().validate()
    check_int("block_size", self.block_size)
    check_int("top_k", self.top_k, minimum=0)
    validators.check_choice("query_pool", self.query_pool, block_select_lib.QUERY_POOLS)
    if self.cache_policy != "full":
      raise ValueError(
        f"cache_policy={self.cache_policy!r}: family='block_select' decodes "
        f"over a full KV cache only (its blocks are whole runs of positions)"
      )
    if self.has_modifiers():
      raise ValueError(
        "family='block_select' takes no alibi, relative_bias, score_mod or "
        "mask_mod (its selected keys are gathered per head)"
      )

  def default_function(self, layer):
    return block_select_lib.block_select_attention

  def check_cross(self, layer) -> None:
    raise ValueError(
      "inputs_kv: family='block_select' cannot cross-attend (it selects blocks of its own sequence)"
    )

  def full_call(self, layer, k, v, call):
    if call.mask is not None:
      raise ValueError(
        "mask: family='block_select' takes no mask; mark padding and packed "
        "documents with segment_ids"
      )
    extra = {} if call.segment_ids is None else {"segment_ids": call.segment_ids}
    return (
      functools.partial(
        self.function(layer),
        block_size=self.block_size,
        top_k=self.top_k,
        is_causal=layer.config.is_causal,
        query_pool=self.query_pool,
        **self.kwargs(layer),
        **extra,
      ),
      k,
      v,
    )

  def allowed_mask(self, layer, length):
    """The pairs a selection may allow (causal, or all); which it keeps depends on content."""
    pos = jnp.arange(length)
    allowed = (
      pos[None, :] <= pos[:, None] if layer.config.is_causal else jnp.ones((length, length), bool)
    )
    return allowed[None, None]

  # Decode.

  def init_cache(self, layer, batch_size, max_len):
    if self.query_pool != "first":
      raise ValueError(
        f"query_pool={self.query_pool!r}: a block's pooled query needs its later "
        f"tokens, so only query_pool='first' can decode"
      )
    kv = super().init_cache(layer, batch_size, max_len)
    return BlockSelectCache(
      kv=kv, block_query=jnp.zeros((batch_size, layer.num_heads, layer.head_dim), layer.dtype)
    )

  def decode_kwargs(self, layer):
    out = self.kwargs(layer)
    impl = out["implementation"]
    out["implementation"] = impl if impl is None else self.DENSE_EQUIVALENT[impl]
    return out

  def _attend_decode(self, layer, q, k, v, call):
    c, cache = layer.config, call.cache
    self.check_decode_cache(layer, cache, BlockSelectCache)
    if call.mask is not None:
      raise ValueError(
        "mask: a self-attention decode takes no mask; mark padding and packed "
        "documents with segment_ids"
      )
    kv = cache.kv
    B, T, N, _ = q.shape
    K = k.shape[2]
    bs = self.block_size
    start = kv.index
    idx, seg, rope_q = call.decode_positions(start, B, T)
    k_all = jnp.concatenate([kv.k, k.astype(kv.k.dtype)], axis=1)
    v_all = jnp.concatenate([kv.v, v.astype(kv.v.dtype)], axis=1)
    k_idx = jnp.concatenate([kv.positions, idx])
    k_seg = jnp.concatenate([kv.segment_ids, seg], axis=1)
    if c.rope_theta is not None:
      k_rope = jnp.concatenate([kv.rope_positions, rope_q], axis=1)
      q = apply_rope(q, rope_q, c.rope_theta, scaling=c.rope_scaling, rotary_dim=c.rope_dim)
      k_all = apply_rope(k_all, k_rope, c.rope_theta, scaling=c.rope_scaling, rotary_dim=c.rope_dim)
    # Each token's block representative: its block's first query (this call's, or the cache's).
    first = (idx // bs) * bs
    from_new = first >= start
    q_first = jnp.take(q, jnp.clip(first - start, 0, T - 1), axis=1)
    q_rep = jnp.where(
      from_new[None, :, None, None], q_first, cache.block_query.astype(q.dtype)[:, None]
    )
    # Mean key of every block of the cache (empty slots in a bucket of their own).
    S = k_all.shape[1]
    nb = -(-S // bs)
    k_block = jnp.where(k_idx >= 0, k_idx // bs, nb)
    onehot = (k_block[:, None] == jnp.arange(nb)[None, :]).astype(jnp.float32)  # [S, nb]
    k_sum = jnp.einsum("bskh,sj->bjkh", k_all.astype(jnp.float32), onehot)
    counts = jnp.maximum(jnp.sum(onehot, axis=0), 1.0)
    k_pooled = k_sum / counts[None, :, None, None]
    scores = block_select_lib.block_scores(q_rep, k_pooled)  # [B, K, T, nb]
    own = idx // bs
    candidate = jnp.arange(nb)[None, :] < own[:, None]
    sel = block_select_lib.top_blocks(scores, candidate[None, None], self.top_k)  # [B, K, T, ks]
    chosen = jnp.any(sel[..., None] == jnp.arange(nb)[None, None, None, None], axis=3)
    chosen = jnp.logical_or(chosen, (jnp.arange(nb)[None, :] == own[:, None])[None, None])
    slot_chosen = jnp.take(chosen, jnp.minimum(k_block, nb - 1), axis=3)  # [B, K, T, S]
    structure = jnp.logical_and(k_idx[None, :] >= 0, k_idx[None, :] <= idx[:, None])
    mask = jnp.logical_and(slot_chosen, structure[None, None])
    mask = jnp.logical_and(mask, (seg[:, :, None] == k_seg[:, None, :])[:, None])
    mask = jnp.repeat(mask, N // K, axis=1)
    run = functools.partial(
      layer.attention_fn or dense.dot_product_attention, mask=mask, **self.decode_kwargs(layer)
    )
    out = run_and_sow(layer, run, q, k_all, v_all, call)
    last_first = ((start + T - 1) // bs) * bs
    block_query = jnp.where(
      last_first >= start,
      jnp.take(q, jnp.clip(last_first - start, 0, T - 1), axis=1),
      cache.block_query.astype(q.dtype),
    )
    new_kv = self._write(kv, k, v, idx, rope_q, seg)
    return out, BlockSelectCache(kv=new_kv, block_query=block_query.astype(cache.block_query.dtype))


register_family(BlockSelectSpec)
