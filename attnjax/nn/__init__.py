"""Flax NNX modules: one attention layer for every attnjax variant, and a decoder LM.

Build a model:

>>> import jax
>>> from flax import nnx
>>> from attnjax import nn
>>> cfg = nn.ModelConfig(vocab_size=64, d_model=32, num_layers=2,
...                      attention=nn.AttentionConfig(family="qk_norm", num_heads=4))
>>> model = nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
>>> tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, 64)   # [B, T]
>>> logits = model(tokens)                           # float32
>>> logits, log_z = model(tokens, return_log_z=True) # log Z for z-loss / drift
>>> logits.shape, log_z.shape                        # [B, T, V], [B, T]
((2, 16, 64), (2, 16))

The attention layer on its own, as research code calls it (as flax's
``MultiHeadAttention``; every family, where it can):

>>> import jax.numpy as jnp
>>> x = jax.random.normal(jax.random.key(1), (2, 16, 32))          # [B, T, D]
>>> memory = jax.random.normal(jax.random.key(2), (2, 12, 32))     # [B, S, D]
>>> keep = jnp.arange(16)[None, :] < jnp.array([[16], [12]])       # [B, T] valid tokens
>>> seg = jnp.array([[0] * 10 + [1] * 6] * 2)                      # [B, T] documents
>>> pos = jnp.array([list(range(10)) + list(range(6))] * 2)        # positions per document
>>> layer = nn.Attention(nn.AttentionConfig(num_heads=4), d_model=32, rngs=nnx.Rngs(0))
>>> y = layer(x)                                    # causal self-attention [B, T, D]
>>> y = layer(x, mask=keep[:, None, None, :])       # padding mask, True = may attend
>>> y = layer(x, segment_ids=seg, positions=pos)    # packed documents, RoPE per document
>>> y = layer(x, inputs_kv=memory)                  # cross-attention over [B, S, D]
>>> y.shape
(2, 16, 32)
>>> enc = nn.Attention(nn.AttentionConfig(is_causal=False), 32, rngs=nnx.Rngs(0))  # encoder
>>> import attnjax
>>> custom = nn.Attention(nn.AttentionConfig(num_heads=4), 32, rngs=nnx.Rngs(0),
...                       attention_fn=attnjax.dot_product_attention)  # injected function

attnjax's attention inside flax's own layers (``attnjax.nn.flax_interop``):

>>> flax_layer = nnx.MultiHeadAttention(
...     4, 32, attention_fn=nn.flax_attention_fn(normalizer="softpick"), decode=False,
...     rngs=nnx.Rngs(0))
>>> flax_layer(x).shape
(2, 16, 32)

A config is the common fields plus a family spec (:mod:`attnjax.nn.specs`);
the family keywords are a shorthand for the spec:

>>> (nn.AttentionConfig(spec=nn.QKNormSpec(qk_norm="layer"), num_heads=4)
...  == nn.AttentionConfig(family="qk_norm", qk_norm="layer", num_heads=4))
True

Per-layer configs (e.g. alternating window and global layers):

>>> local = nn.AttentionConfig(window=64)
>>> layered = nn.ModelConfig(num_layers=4, layer_attention=(local, nn.AttentionConfig()) * 2)

Read statistics of one forward pass (no model code changes; this is the entry
point for the stats and experiment code):

>>> stats = nn.layer_stats(model, tokens, view="sown")  # weights=True, hidden=True for more
>>> stats["logits"].shape, stats["log_z"].shape    # [B, T, V] float32, [B, T]
((2, 16, 64), (2, 16))
>>> stats["layers"][0]["sink_mass"].shape          # dict for layer 0, fields [B, N]
(2, 4)

Its default view, ``"summary"``, reduces the same pass to every statistic of
:mod:`attnjax.stats` over the layers (sink rate, F-Attn, q/k geometry, ...;
:mod:`attnjax.nn.probe`); ``"streaming"`` keeps a long sequence in O(T) memory.
In the ``"sown"`` view each layer's dict holds (absent where a family lacks them):

- ``"max_logit"``, ``"entropy"``, ``"sink_mass"``, ``"row_sum"`` ``[B, N]`` and
  ``"logsumexp"`` ``[B, N, T]`` (the fields of :class:`attnjax.AttentionStats`);
- ``"q_rms"`` ``[B, N]``, ``"k_rms"`` ``[B, K]``: RMS of the projected q, k over time and
  head dim;
- ``"hidden_max_abs"``, ``"hidden_median_abs"`` ``[B]``: of the block's output hidden state;
- ``"gate_mean"`` ``[B, N]``: gated layers only;
- ``"weights"`` ``[B, N, T, S]`` (``weights=True``): attention weights; ``S = T``, plus one
  column at the end with ``kv_bias``;
- ``"hidden"`` ``[B, T, D]`` (``hidden=True``): the block's output hidden state.

``layer_stats`` runs the model under ``nnx.capture(..., nnx.Intermediate)``;
the modules sow only inside a capture, so a training step computes none of it.
The same values can be captured directly: ``nnx.capture(fn, nnx.Intermediate)``.

Sharding: parameters carry logical axis names (``"embed"``, ``"heads"``,
``"mlp"``, ``"vocab"``); ``state_shardings(model, mesh, LOGICAL_AXIS_RULES)``
maps them onto a ``("data", "model")`` mesh.

Decoding (every family; prefill + steps equals the full forward):

>>> prompt = tokens[:, :4]
>>> cache = nn.init_cache(model, batch_size=2, max_len=16)
>>> logits, cache = nn.decode_step(model, prompt, cache)               # prefill
>>> logits, cache = nn.decode_step(model, prompt[:, -1:], cache)       # one step, [B, 1]
>>> out = nn.generate(model, prompt, 8, temperature=0.8, rng=jax.random.key(0))
>>> out.shape                                      # [B, 4 + 8]
(2, 12)

What the cache keeps is the layer's ``cache_policy`` (:mod:`attnjax.nn.kv_policies`:
``"full"``, ``"int8"``, ``"fp8"``, ``"h2o"``, ``"sinks_window"``); ``nn.cache_bytes(cache)``
measures it and ``nn.cache_bytes_for(model_config, policy, T, batch)`` predicts it.
"""

from attnjax.nn import specs
from attnjax._src.nn import (CACHE_POLICIES, LOGICAL_AXIS_RULES, MLP, Attention, AttentionConfig,
                             AttentionSpec, CosineSpec, CrossCache, DenseSpec, FeatureProjection,
                             GatedCache, H2OCache, KVCache, LinearCache, LinearSpec, ModelConfig,
                             QKNormSpec, QuantizedKVCache, SparseSpec, TransformerBlock,
                             TransformerLM, apply_rope, cache_bytes, cache_bytes_for,
                             collect_stats, decode_step, flax_attention_fn, generate, init_cache,
                             layer_stats, log_normalizer, num_params, register_family,
                             state_shardings)

__all__ = ["CACHE_POLICIES", "LOGICAL_AXIS_RULES", "MLP", "Attention", "AttentionConfig",
    "AttentionSpec", "CosineSpec", "CrossCache", "DenseSpec", "FeatureProjection", "GatedCache",
    "H2OCache", "KVCache", "LinearCache", "LinearSpec", "ModelConfig", "QKNormSpec",
    "QuantizedKVCache", "SparseSpec", "TransformerBlock", "TransformerLM", "apply_rope",
    "cache_bytes", "cache_bytes_for", "collect_stats", "decode_step", "flax_attention_fn",
    "generate", "init_cache", "layer_stats", "log_normalizer", "num_params", "register_family",
    "specs", "state_shardings"]
