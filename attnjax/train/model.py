"""From a run config to an ``attnjax.nn.TransformerLM`` (the only place the loop meets the model)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from attnjax.train.variants import attention_kwargs


def model_config(cfg: Any, vocab_size: int):
  """``attnjax.nn.ModelConfig`` of ``cfg.model`` with the attention of ``cfg.variant``."""
  from attnjax import nn

  m = cfg.model
  attn = attention_kwargs(cfg.variant)
  if m.window > 0:
    attn["window"] = (int(m.window), 0)
  attention = nn.AttentionConfig(**attn)
  return nn.ModelConfig(
      vocab_size=vocab_size, d_model=m.d_model, num_layers=m.num_layers, num_heads=m.num_heads,
      num_kv_heads=m.num_kv_heads or None, mlp_ratio=m.mlp_ratio, attention=attention,
      dtype=m.dtype)


def build_model(cfg: Any, vocab_size: int, *, seed: int) -> nnx.Module:
  from attnjax import nn

  return nn.TransformerLM(model_config(cfg, vocab_size), rngs=nnx.Rngs(seed))


def count_params(params: Any) -> int:
  return int(sum(x.size for x in jax.tree.leaves(params)))


def flops_per_token(cfg: Any, num_params: int, num_embedding: int) -> float:
  """Training FLOPs per token: 6 x non-embedding params + attention (Kaplan; PaLM appendix B).

  Attention: causal QK^T and AV over ~T/2 keys per query, 2 matmuls x 2
  FLOPs x 3 (forward + backward) = 6 * L * T * D for the full square, halved
  for causality. The output projection through the tied embedding matrix is
  a real matmul, so it counts (6 * V * D).
  """
  m = cfg.model
  T = cfg.data.seq_len
  attention = 6.0 * m.num_layers * T * m.d_model  # 12 L T D / 2 (causal)
  return 6.0 * (num_params - num_embedding) + 6.0 * num_embedding + attention
