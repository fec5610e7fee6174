"""Flax NNX modules: one attention layer for every attnjax variant, and a decoder LM.

Build a model::

  from flax import nnx
  from attnjax import nn

  cfg = nn.ModelConfig(vocab_size=256, d_model=128, num_layers=2,
                       attention=nn.AttentionConfig(family="qk_norm", num_heads=4))
  model = nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
  logits = model(tokens)                           # [B, T, V] float32
  logits, log_z = model(tokens, return_log_z=True) # log Z for z-loss / drift

The attention layer on its own, as research code calls it (as flax's
``MultiHeadAttention``; every family, where it can)::

  layer = nn.Attention(nn.AttentionConfig(num_heads=4), d_model=64, rngs=nnx.Rngs(0))
  y = layer(x)                                    # causal self-attention [B, T, D]
  y = layer(x, mask=keep[:, None, None, :])       # padding mask, True = may attend
  y = layer(x, segment_ids=seg, positions=pos)    # packed documents, RoPE per document
  y = layer(x, inputs_kv=memory)                  # cross-attention over [B, S, D]
  enc = nn.Attention(nn.AttentionConfig(is_causal=False), 64, rngs=nnx.Rngs(0))  # encoder
  nn.Attention(cfg, 64, rngs=rngs, attention_fn=my_fn)  # inject the attention function

attnjax's attention inside flax's own layers (``attnjax.nn.flax_interop``)::

  nnx.MultiHeadAttention(4, 64, attention_fn=nn.flax_attention_fn(normalizer="softpick"),
                         decode=False, rngs=nnx.Rngs(0))

A config is the common fields plus a family spec (:mod:`attnjax.nn.specs`);
the family keywords are a shorthand for the spec::

  nn.AttentionConfig(spec=nn.QKNormSpec(qk_norm="layer"), num_heads=4)
  nn.AttentionConfig(family="qk_norm", qk_norm="layer", num_heads=4)   # the same

Per-layer configs (e.g. alternating window and global layers)::

  local = nn.AttentionConfig(window=64)
  cfg = nn.ModelConfig(num_layers=4, layer_attention=(local, nn.AttentionConfig()) * 2)

Read statistics of one forward pass (no model code changes; this is the entry
point for the stats and experiment code)::

  stats = nn.collect_stats(model, tokens)            # weights=True, hidden=True for more
  stats["logits"]     # [B, T, V] float32
  stats["log_z"]      # [B, T]    logsumexp of the output logits
  stats["layers"][l]  # dict for layer l:
    # "max_logit", "entropy", "sink_mass", "row_sum"  [B, N]   (attnjax.AttentionStats;
    # "logsumexp"                                      [B, N, T] fields a family lacks
    #                                                            are absent)
    # "q_rms" [B, N], "k_rms" [B, K]   RMS of the projected q, k over time and head dim
    # "hidden_max_abs", "hidden_median_abs" [B]   of the block's output hidden state
    # "gate_mean" [B, N]                           gated layers only
    # "weights" [B, N, T, S]   (weights=True)      attention weights; S = T, plus one
    #                                              column at the end with kv_bias
    # "hidden" [B, T, D]       (hidden=True)       block output hidden state

``collect_stats`` runs the model under ``nnx.capture(..., nnx.Intermediate)``;
the modules sow only inside a capture, so a training step computes none of it.
The same values can be captured directly: ``nnx.capture(fn, nnx.Intermediate)``.

Sharding: parameters carry logical axis names (``"embed"``, ``"heads"``,
``"mlp"``, ``"vocab"``); ``state_shardings(model, mesh, LOGICAL_AXIS_RULES)``
maps them onto a ``("data", "model")`` mesh.

Decoding (every family; prefill + steps equals the full forward)::

  cache = nn.init_cache(model, batch_size, max_len)
  logits, cache = nn.decode_step(model, prompt, cache)
  logits, cache = nn.decode_step(model, next_token[:, None], cache)
  tokens = nn.generate(model, prompt, num_tokens=32, temperature=0.8, rng=key)

What the cache keeps is the layer's ``cache_policy`` (:mod:`attnjax.nn.kv_policies`:
``"full"``, ``"int8"``, ``"fp8"``, ``"h2o"``, ``"sinks_window"``); ``nn.cache_bytes(cache)``
measures it and ``nn.cache_bytes_for(model_config, policy, T, batch)`` predicts it.
"""

from attnjax.nn import specs
from attnjax.nn.attention import Attention
from attnjax.nn.caches import CrossCache, FeatureProjection, GatedCache, KVCache, LinearCache
from attnjax.nn.caches import H2OCache, QuantizedKVCache, cache_bytes
from attnjax.nn.kv_policies import CACHE_POLICIES, cache_bytes_for
from attnjax.nn.config import AttentionConfig, ModelConfig
from attnjax.nn.specs import (AttentionSpec, CosineSpec, DenseSpec, LinearSpec, QKNormSpec,
                              SparseSpec, register_family)
from attnjax.nn.decode import decode_step, generate, init_cache
from attnjax.nn.flax_interop import flax_attention_fn
from attnjax.nn.rope import apply_rope
from attnjax.nn.transformer import (LOGICAL_AXIS_RULES, MLP, TransformerBlock, TransformerLM,
                                    collect_stats, log_normalizer, num_params, state_shardings)

__all__ = [
    "Attention",
    "CACHE_POLICIES",
    "AttentionConfig",
    "AttentionSpec",
    "CosineSpec",
    "CrossCache",
    "DenseSpec",
    "FeatureProjection",
    "GatedCache",
    "H2OCache",
    "KVCache",
    "LOGICAL_AXIS_RULES",
    "LinearCache",
    "LinearSpec",
    "MLP",
    "ModelConfig",
    "QKNormSpec",
    "QuantizedKVCache",
    "SparseSpec",
    "TransformerBlock",
    "TransformerLM",
    "apply_rope",
    "cache_bytes",
    "cache_bytes_for",
    "collect_stats",
    "decode_step",
    "flax_attention_fn",
    "generate",
    "init_cache",
    "log_normalizer",
    "num_params",
    "register_family",
    "specs",
    "state_shardings",
]
