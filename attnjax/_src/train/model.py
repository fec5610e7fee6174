"""From a run config to an ``attnjax.nn.TransformerLM`` or ``EncoderLM`` (the only place the
loop meets the model)."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from attnjax._src.train.variants import attention_kwargs


def is_encoder(cfg: Any) -> bool:
  """Whether the run trains an encoder (``data.objective="mlm"``)."""
  return cfg.data.get("objective", "causal") == "mlm"


def model_config(cfg: Any, vocab_size: int):
  """``attnjax.nn.ModelConfig`` of ``cfg.model`` with the attention of ``cfg.variant``
  (an ``EncoderConfig``, every layer bidirectional, for ``data.objective="mlm"``)."""
  from attnjax._src import nn

  m = cfg.model
  encoder = is_encoder(cfg)
  attn = attention_kwargs(cfg.variant, d_model=m.d_model, num_heads=m.num_heads)
  if encoder:
    attn["is_causal"] = False
  if m.window > 0:
    attn["window"] = int(m.window)
  # model.implementation names a kernel of the dense family; a family whose
  # function does not take that name keeps its own default.
  spec_class = nn.specs.FAMILY_SPECS[attn.get("family", "dense")]
  if m.implementation and spec_class.takes_implementation(m.implementation):
    attn["implementation"] = m.implementation
  attention = nn.AttentionConfig(
    num_heads=m.num_heads,
    num_kv_heads=m.num_kv_heads or None,
    rope_theta=10000.0 if m.rope else None,
    **attn,
  )
  placement = m.get("norm_placement", "") or ("post_residual" if encoder else "pre")
  common = dict(
    vocab_size=vocab_size,
    d_model=m.d_model,
    num_layers=m.num_layers,
    attention=attention,
    mlp=m.mlp,
    mlp_dim=m.mlp_ratio * m.d_model if m.mlp == "gelu" else None,
    norm=m.norm,
    tie_embeddings=m.tie_embeddings,
    dtype=m.dtype,
    remat=m.remat,
    norm_placement=placement,
  )
  if encoder:
    # BERT's encoder: LayerNorm'd embeddings, one token type, an MLM head; RoPE positions.
    return nn.EncoderConfig(
      **common,
      norm_eps=1e-6,
      token_types=None,
      embed_norm=True,
      mlp_activation=None,
      mlp_bias=False,
    )
  return nn.ModelConfig(**common)


def build_model(cfg: Any, vocab_size: int, *, seed: int) -> nnx.Module:
  from attnjax._src import nn

  model_class = nn.EncoderLM if is_encoder(cfg) else nn.TransformerLM
  return model_class(model_config(cfg, vocab_size), rngs=nnx.Rngs(seed))


def count_params(params: Any) -> int:
  return int(sum(x.size for x in jax.tree.leaves(params)))


def flops_per_token(cfg: Any, num_params: int) -> float:
  """Training FLOPs per token: ``6 N`` plus attention (Kaplan et al. 2020; PaLM appendix B).

  ``N`` counts every parameter: the tied embedding is also the output
  projection, a real ``[D, V]`` matmul. Attention adds the ``QK^T`` and ``AV``
  matmuls: ``2 matmuls x 2 FLOPs x D x T`` per token and layer forward, x3
  with the backward, halved for the causal mask: ``6 L T D``.
  """
  m = cfg.model
  return 6.0 * num_params + 6.0 * m.num_layers * cfg.data.seq_len * m.d_model
