"""A bidirectional encoder LM (BERT, RoBERTa, ModernBERT) on the decoder's blocks.

``EncoderLM(config, rngs=...)(tokens, attention_mask=..., token_type_ids=...)`` returns
float32 masked-LM logits ``[B, T, V]`` (or, without a head, the features ``[B, T, D]``).
The blocks, norms, MLPs and every attention family are :class:`.TransformerLM`'s; the
encoder adds padding masks, token types, RoBERTa's positions, the MLM head and BERT's pooler.

Guide: docs/guides/encoders.md. Implementation behind the public module :mod:`attnjax.nn`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from attnjax._src.nn import _layers
from attnjax._src.nn import mlp as mlp_lib
from attnjax._src.nn.config import EncoderConfig
from attnjax._src.nn.transformer import TransformerLM, _norm

Array = jnp.ndarray


def padding_mask(attention_mask: Array) -> Array:
  """``bool [B, 1, 1, S]``: the keys a ``[B, S]`` attention mask (1 = token, 0 = padding) keeps.

  Every query, padding included, attends to the kept keys, as ``transformers`` does; a
  padded row's outputs are not used.
  """
  return jnp.asarray(attention_mask).astype(bool)[:, None, None, :]


class EncoderLM(TransformerLM):
  """A bidirectional encoder LM: :class:`.TransformerLM`'s embedding and blocks, non-causal.

  Besides the decoder's parameters (``embed``, ``blocks``, ``final_norm`` unless
  post-LN, ``position_embed``, ``token_type_embed``, ``embed_norm``), the MLM head
  ``head_dense`` / ``head_norm`` and ``output_bias`` (``config.mlm_head``), and
  ``pooler`` (``config.pooler``).

  Args:
    config: an :class:`.EncoderConfig`.
    rngs: ``nnx.Rngs``.
  """

  def __init__(self, config: EncoderConfig, rngs: nnx.Rngs):
    if not isinstance(config, EncoderConfig):
      raise TypeError(f"config must be an EncoderConfig, got {type(config).__name__}")
    super().__init__(config, rngs)
    dtype, param_dtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    D, V = config.d_model, config.vocab_size
    self.head_dense = self.head_norm = self.output_bias = self.pooler = nnx.data(None)
    if config.mlm_head:
      self.head_dense = _layers.linear(D, D, ("embed", None), use_bias=config.head_bias, **kw)
      self.head_norm = _norm(config, **kw)
      if config.output_bias:
        self.output_bias = _layers.param(jnp.zeros((V,), param_dtype), ("vocab",))
    if config.pooler:
      self.pooler = _layers.linear(D, D, ("embed", None), use_bias=True, **kw)

  def __call__(
    self,
    tokens: Array,
    *,
    attention_mask: Optional[Array] = None,
    token_type_ids: Optional[Array] = None,
    positions: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
    return_log_z: bool = False,
    sow_weights: Optional[bool] = None,
    sow_hidden: bool = False,
  ):
    """MLM logits ``[B, T, V]`` float32 of ``tokens`` ``[B, T]`` (features without a head).

    Args:
      tokens: ``[B, T]`` integer tokens.
      attention_mask: ``[B, T]`` 1 for tokens, 0 for padding (None = no padding):
        no query attends to a padding key.
      token_type_ids: ``[B, T]`` int segment types (None = 0); needs
        ``config.token_types``.
      positions: ``[T]`` or ``[B, T]`` positions (RoPE and learned position
        embeddings); None = ``0..T-1``, or RoBERTa's (``config.position_offset``).
      return_log_z: also return ``log Z = logsumexp(logits)`` ``[B, T]``.
      sow_weights: sow attention weights (under ``nnx.capture``).
      sow_hidden: sow every block's output, attention output and MLP output.
    """
    h = self.features(
      tokens,
      attention_mask=attention_mask,
      token_type_ids=token_type_ids,
      positions=positions,
      segment_ids=segment_ids,
      sow_weights=sow_weights,
      sow_hidden=sow_hidden,
    )
    if self.head_dense is None:
      if return_log_z:
        raise ValueError("return_log_z: this encoder has no MLM head (mlm_head=False)")
      return h
    return self._logits(h, return_log_z)

  def features(
    self,
    tokens: Array,
    *,
    attention_mask: Optional[Array] = None,
    token_type_ids: Optional[Array] = None,
    positions: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
    sow_weights: Optional[bool] = None,
    sow_hidden: bool = False,
  ) -> Array:
    """The last hidden states ``[B, T, D]`` (``BertModel``'s ``last_hidden_state``).

    Arguments as calling the model; ``segment_ids`` ``[B, T]`` packs documents (no
    token attends across a boundary), for the families that take them.
    """
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be integer [B, T], got {tokens.dtype} {tokens.shape}")
    mask = None
    if attention_mask is not None:
      attention_mask = jnp.asarray(attention_mask)
      if attention_mask.shape != tokens.shape:
        raise ValueError(
          f"attention_mask has shape {attention_mask.shape}, tokens {tokens.shape}: "
          f"it must be [B, T], 1 for tokens and 0 for padding"
        )
      mask = padding_mask(attention_mask)
    if token_type_ids is not None:
      token_type_ids = jnp.asarray(token_type_ids)
      if token_type_ids.shape != tokens.shape or not jnp.issubdtype(
        token_type_ids.dtype, jnp.integer
      ):
        raise ValueError(
          f"token_type_ids must be int [B, T] = {tokens.shape} like tokens, got "
          f"{token_type_ids.dtype} {token_type_ids.shape}"
        )
    if positions is None and self.config.position_offset is not None:
      positions = self.roberta_positions(tokens)
    h = self._embed(tokens, positions, token_type_ids)
    return self._blocks(
      h,
      mask=mask,
      segment_ids=segment_ids,
      positions=positions,
      sow_weights=sow_weights,
      sow_hidden=sow_hidden,
    )

  def roberta_positions(self, tokens: Array) -> Array:
    """``[B, T]`` RoBERTa positions: tokens other than ``pad_token_id`` numbered from
    ``position_offset``, padding at ``position_offset - 1``."""
    c = self.config
    keep = tokens != c.pad_token_id
    counted = jnp.cumsum(keep.astype(jnp.int32), axis=1) - 1 + c.position_offset
    return jnp.where(keep, counted, c.position_offset - 1)

  def output_logits(self, features: Array) -> Array:
    """Float32 MLM logits ``[..., T, V]`` of :meth:`features`: the head's dense layer,
    activation and norm, the output projection, ``output_bias``."""
    if self.head_dense is None:
      raise ValueError("output_logits: this encoder has no MLM head (EncoderConfig.mlm_head=False)")
    act = mlp_lib.ACTIVATIONS[self.config.head_activation]
    h = self.head_norm(act(self.head_dense(features)))
    logits = super().output_logits(h)
    if self.output_bias is not None:
      bias = self.output_bias[...].astype(jnp.float32)
      logits = logits + jnp.reshape(bias, (1,) * (logits.ndim - 1) + (-1,))
    return logits

  def pooled(self, features: Array) -> Array:
    """BERT's pooled output ``tanh(dense(features[:, 0]))`` ``[B, D]`` (needs ``config.pooler``)."""
    if self.pooler is None:
      raise ValueError("pooled: this encoder has no pooler (EncoderConfig.pooler=False)")
    return jax.nn.tanh(self.pooler(features[:, 0]))

  def decode(self, *args, **kwargs):
    raise ValueError("decode: an encoder (every layer is_causal=False) has no decode")

  def init_cache(self, *args, **kwargs):
    raise ValueError("init_cache: an encoder (every layer is_causal=False) has no decode cache")
