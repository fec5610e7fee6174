"""The layer interface for research code and the per-family specs.

Cross-attention, padding masks, segment ids and positions are checked against
the pure functions called directly with the layer's own projections; decode
against the full forward (packed and cross-attention); packed training
batches against the documents run one by one; configs against old dicts.
"""

import dataclasses
import json
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnjax
from attnjax._src import data, masks, nn
from attnjax._src.nn import specs
from attnjax._src.train import step as train_step
from helpers import assert_close

D = 16
B = 2


def _x(T=8, seed=0):
  return jax.random.normal(jax.random.key(seed), (B, T, D), jnp.float32)


def _layer(cfg, seed=0, **kw):
  return nn.Attention(cfg, D, rngs=nnx.Rngs(seed), **kw)


def _heads(layer, x):
  """The layer's own projections of ``x``: ``[B, T, heads, H]``."""
  return layer._project(x)


def _out(layer, o):
  """The layer's output projection of heads ``[B, T, N, H]`` (no gate)."""
  return layer.o_proj(jnp.reshape(o, o.shape[:2] + (-1,)))


def _rope(layer, x, positions):
  return nn.apply_rope(x, positions, layer.config.rope_theta)


# A packed pair of rows: row 0 has documents of lengths 3, 4, 1; row 1 of 5, 3.
SEGMENTS = jnp.array([[1, 1, 1, 2, 2, 2, 2, 3], [4, 4, 4, 4, 4, 7, 7, 7]], jnp.int32)


def _doc_positions(seg):
  seg = np.asarray(seg)
  pos = np.zeros_like(seg)
  for b in range(seg.shape[0]):
    for t in range(1, seg.shape[1]):
      pos[b, t] = 0 if seg[b, t] != seg[b, t - 1] else pos[b, t - 1] + 1
  return jnp.asarray(pos)


POSITIONS = _doc_positions(SEGMENTS)


# ---------------------------------------------------------------------------
# Against the functions called directly.


def test_cross_attention_equals_the_function_with_the_layers_projections():
  layer = _layer(nn.AttentionConfig(num_kv_heads=2))
  x, memory = _x(5), _x(7, seed=3)
  keep = jnp.array([[True] * 7, [True] * 4 + [False] * 3])
  mask = keep[:, None, None, :]
  q, _, _ = _heads(layer, x)
  _, k, v = _heads(layer, memory)
  want = _out(layer, attnjax.dot_product_attention(q, k, v, mask=mask))  # no RoPE, not causal
  assert_close(layer(x, inputs_kv=memory, mask=mask), want, rtol=2e-5, atol=2e-5)
  # Padding changes the answer (the test can fail).
  assert not np.allclose(layer(x, inputs_kv=memory), want, atol=1e-3)


def test_cross_attention_linear_and_qk_norm_families():
  x, memory = _x(5), _x(7, seed=3)
  lin = _layer(nn.AttentionConfig(family="linear", num_kv_heads=2))
  q, _, _ = _heads(lin, x)
  _, k, v = _heads(lin, memory)
  want = attnjax.linear_attention(q, k, v, is_causal=False)
  assert_close(lin(x, inputs_kv=memory), _out(lin, want), rtol=2e-5, atol=2e-5)
  qk = _layer(nn.AttentionConfig(family="qk_norm", qk_norm_placement="after_rope"))
  q, _, _ = _heads(qk, x)
  _, k, v = _heads(qk, memory)
  want = attnjax.qk_norm_attention(
    q, k, v, norm="rms", q_gain=qk.q_gain[...], k_gain=qk.k_gain[...]
  )
  assert_close(qk(x, inputs_kv=memory), _out(qk, want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
  "cfg",
  [
    nn.AttentionConfig(num_kv_heads=2),
    nn.AttentionConfig(family="cosine", window=3),
    nn.AttentionConfig(kv_bias=True, num_kv_heads=2),
  ],
  ids=["dense", "cosine_window", "kv_bias"],
)
def test_padding_mask_equals_the_function(cfg):
  layer = _layer(cfg)
  x = _x(6)
  keep = jnp.array([[True] * 6, [True] * 4 + [False] * 2])
  mask = keep[:, None, None, :]
  y = layer(x, mask=mask)
  q, k, v = _heads(layer, x)
  pos = jnp.arange(6)
  q, k = _rope(layer, q, pos), _rope(layer, k, pos)
  window = None if cfg.window is None else (cfg.window, 0)
  full = jnp.logical_and(masks.structural_mask(pos, pos, is_causal=True, window=window), mask)
  kw = {}
  if cfg.family == "cosine":
    fn = attnjax.cosine_attention
    kw = dict(temperature=layer.temperature[...])
  else:
    fn = attnjax.dot_product_attention
  if cfg.kv_bias:
    kb = jnp.broadcast_to(layer.k_bias[...][None, None], (B, 1) + k.shape[2:])
    vb = jnp.broadcast_to(layer.v_bias[...][None, None], (B, 1) + v.shape[2:])
    k, v = jnp.concatenate([k, kb], 1), jnp.concatenate([v, vb], 1)
    full = jnp.concatenate([jnp.broadcast_to(full, (B, 1, 6, 6)), jnp.ones((B, 1, 6, 1), bool)], -1)
  assert_close(y, _out(layer, fn(q, k, v, mask=full, **kw)), rtol=2e-5, atol=2e-5)
  assert not np.allclose(y, layer(x), atol=1e-4)


@pytest.mark.parametrize(
  "cfg",
  [
    nn.AttentionConfig(num_kv_heads=2),
    nn.AttentionConfig(family="qk_norm", num_kv_heads=2),
    nn.AttentionConfig(window=2, num_sinks=1),
    nn.AttentionConfig(family="sparse", pattern=("sliding_window", (("left", 3),)), block_size=4),
  ],
  ids=["dense", "qk_norm_before_rope", "sinks_window", "sparse"],
)
def test_segment_ids_and_positions_equal_the_function(cfg):
  layer = _layer(cfg)
  x = _x(8)
  y = layer(x, segment_ids=SEGMENTS, positions=POSITIONS)
  q, k, v = _heads(layer, x)
  q, k = layer.config.spec.prepare_qk(layer, q, k)
  q, k = _rope(layer, q, POSITIONS), _rope(layer, k, POSITIONS)
  allowed = layer.allowed_mask(8)  # causal, window, sinks or the pattern, by token order
  want = attnjax.dot_product_attention(q, k, v, mask=allowed, segment_ids=SEGMENTS)
  assert_close(y, _out(layer, want), rtol=2e-5, atol=2e-5)
  # Every document alone gives the same rows (sinks and windows are per row,
  # so that holds for documents starting at 0 only for plain causal layers).
  if cfg.family == "dense" and cfg.window is None:
    for b, (start, stop) in ((0, (0, 3)), (0, (3, 7)), (1, (5, 8))):
      alone = layer(x[b : b + 1, start:stop])
      assert_close(y[b, start:stop], alone[0], rtol=2e-5, atol=2e-5)


def test_explicit_positions_shift_rope_and_keep_the_mask():
  layer = _layer(nn.AttentionConfig())
  x = _x(6)
  # RoPE is relative: shifting every position by a constant changes nothing...
  assert_close(layer(x, positions=jnp.arange(6) + 5), layer(x), rtol=1e-4, atol=1e-4)
  # ... positions per row work, and other positions change the result.
  per_row = jnp.stack([jnp.arange(6), jnp.arange(6) * 2])
  y = layer(x, positions=per_row)
  assert_close(y[0], layer(x)[0], rtol=1e-4, atol=1e-4)
  assert not np.allclose(y[1], layer(x)[1], atol=1e-3)


def test_encoder_layer_is_not_causal():
  for cfg in (
    nn.AttentionConfig(is_causal=False),
    nn.AttentionConfig(family="linear", is_causal=False),
  ):
    layer = _layer(cfg)
    x = _x(6)
    q, k, v = _heads(layer, x)
    pos = jnp.arange(6)
    q, k = _rope(layer, q, pos), _rope(layer, k, pos)
    if cfg.family == "linear":
      want = attnjax.linear_attention(q, k, v, is_causal=False)
    else:
      want = attnjax.dot_product_attention(q, k, v, is_causal=False)
    assert_close(layer(x), _out(layer, want), rtol=2e-5, atol=2e-5)
    assert bool(jnp.all(layer.allowed_mask(4)))


def test_injected_attention_fn_is_called_with_the_family_arguments():
  seen = []

  def fn(q, k, v, **kwargs):
    seen.append(sorted(kwargs))
    return attnjax.dot_product_attention(q, k, v, **kwargs)

  cfg = nn.AttentionConfig(sink_logits=True, num_kv_heads=2)
  plain, injected = _layer(cfg), _layer(cfg, attention_fn=fn)
  x = _x(6)
  assert_close(injected(x), plain(x), rtol=1e-6, atol=1e-6)
  assert "sink_logits" in seen[0] and "is_causal" in seen[0]

  def doubled(q, k, v, **kwargs):
    return 2 * attnjax.dot_product_attention(q, k, v, **kwargs)

  assert not np.allclose(_layer(cfg, attention_fn=doubled)(x), plain(x), atol=1e-4)


# ---------------------------------------------------------------------------
# Decode.


@pytest.mark.parametrize(
  "attention",
  [
    nn.AttentionConfig(num_kv_heads=2),
    nn.AttentionConfig(window=3, kv_bias=True),
    nn.AttentionConfig(family="sparse", pattern=("strided", (("stride", 3),)), block_size=4),
  ],
  ids=["dense", "window_kv_bias", "sparse"],
)
def test_packed_decode_equals_the_full_forward(attention):
  cfg = nn.ModelConfig(vocab_size=11, d_model=D, num_layers=2, attention=attention)
  model = nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (B, 8), 0, 11)
  full = model(tokens, segment_ids=SEGMENTS, positions=POSITIONS)
  cache = nn.init_cache(model, B, 8)
  logits, cache = nn.decode_step(model, tokens[:, :4], cache, SEGMENTS[:, :4], POSITIONS[:, :4])
  steps = [logits]
  for t in range(4, 8):
    logits, cache = nn.decode_step(
      model, tokens[:, t : t + 1], cache, SEGMENTS[:, t : t + 1], POSITIONS[:, t : t + 1]
    )
    steps.append(logits)
  assert_close(jnp.concatenate(steps, axis=1), full, rtol=1e-4, atol=1e-4)
  # Packing matters: without segments the later documents see the earlier ones.
  assert not np.allclose(model(tokens), full, atol=1e-3)


@pytest.mark.parametrize(
  "cfg",
  [
    nn.AttentionConfig(num_kv_heads=2, output_gate="elementwise"),
    nn.AttentionConfig(family="linear"),
    nn.AttentionConfig(family="cosine", kv_bias=True),
  ],
  ids=["dense_gated", "linear", "cosine_kv_bias"],
)
def test_cross_attention_decode_caches_keys_once(cfg):
  layer = _layer(cfg)
  x, memory = _x(6), _x(5, seed=3)
  mask = jnp.array([[True] * 5, [True] * 3 + [False] * 2])[:, None, None, :]
  if cfg.family == "linear":
    mask = None
  full = layer(x, inputs_kv=memory, mask=mask)
  cache = layer.init_cache(B, 6, kv_length=5)
  assert isinstance(cache, nn.CrossCache)
  y0, cache = layer.decode(x[:, :2], cache, inputs_kv=memory, mask=mask)
  outs = [y0]
  for t in range(2, 6):  # later steps reuse the cached keys and values
    y, cache = layer.decode(x[:, t : t + 1], cache, mask=mask)
    outs.append(y)
  assert_close(jnp.concatenate(outs, axis=1), full, rtol=1e-5, atol=1e-5)
  _, k, v = _heads(layer, memory)
  assert_close(cache.k, k, rtol=2e-5, atol=2e-5)


SPARSE = dict(family="sparse", pattern=("strided", (("stride", 3),)), block_size=4)


@pytest.mark.parametrize("implementation", ["blockwise", "reference"])
def test_sparse_implementation_reaches_the_decode_and_mask_paths(implementation):
  layer = _layer(nn.AttentionConfig(**SPARSE, implementation=implementation))
  plain = _layer(nn.AttentionConfig(**SPARSE))
  x = _x(6)
  keep = jnp.array([[True] * 6, [True] * 4 + [False] * 2])[:, None, None, :]
  assert_close(layer(x, mask=keep), plain(x, mask=keep), rtol=1e-5, atol=1e-5)
  y, _ = layer.decode(x, layer.init_cache(B, 6))
  assert_close(y, plain(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "family,options,implementation",
  [
    ("sparse", dict(pattern=("causal", ())), "gathered"),
    ("dense", {}, "block_sparse"),
    ("qk_norm", {}, "chunked"),
    ("linear", {}, "xla"),
  ],
)
def test_config_rejects_an_implementation_its_family_does_not_take(family, options, implementation):
  with pytest.raises(ValueError, match=f"implementation='{implementation}'.*family='{family}'"):
    nn.AttentionConfig(family=family, implementation=implementation, **options)


def test_spec_classes_declare_their_implementations():
  from attnjax._src.ops.dense import attention as dense
  from attnjax._src.ops.sparse import attention as sparse

  assert specs.SparseSpec.implementations == sparse.IMPLEMENTATIONS
  assert specs.DenseSpec.implementations == tuple(dense.IMPLEMENTATIONS)
  for family in (specs.LinearSpec, specs.GatedSpec, specs.DeltaNetSpec):  # one vocabulary
    assert family.implementations == ("reference", "recurrent", "quadratic", "chunked")
  assert not specs.LinearSpec.takes_segment_ids and specs.SparseSpec.takes_segment_ids


def test_injected_attention_fn_serves_the_sparse_mask_and_decode_paths():
  seen = []

  def fn(q, k, v, **kwargs):
    seen.append(kwargs)
    return attnjax.dot_product_attention(q, k, v, **kwargs)

  cfg = nn.AttentionConfig(**SPARSE, implementation="blockwise")
  plain, injected = _layer(cfg), _layer(cfg, attention_fn=fn)
  x = _x(6)
  keep = jnp.array([[True] * 6, [True] * 4 + [False] * 2])[:, None, None, :]
  assert_close(injected(x, mask=keep), plain(x, mask=keep), rtol=1e-6, atol=1e-6)
  y, _ = injected.decode(x, injected.init_cache(B, 6))
  assert_close(y, plain(x), rtol=1e-5, atol=1e-5)
  assert len(seen) == 2
  assert all("mask" in kw and "pattern" not in kw and kw["implementation"] is None for kw in seen)


def test_has_null_column_follows_sink_logits_and_the_normalizer():
  assert not nn.AttentionConfig().spec.has_null_column()
  assert nn.AttentionConfig(sink_logits=True).spec.has_null_column()
  assert nn.AttentionConfig(normalizer="softmax_one").spec.has_null_column()
  assert nn.AttentionConfig(
    family="sparse", pattern=("causal", ()), normalizer="softmax_one"
  ).spec.has_null_column()
  assert not nn.AttentionConfig(family="linear").spec.has_null_column()


def test_cross_cache_rejects_inputs_kv_of_another_length():
  layer = _layer(nn.AttentionConfig())
  cache = layer.init_cache(B, 6, kv_length=5)
  with pytest.raises(ValueError, match=r"inputs_kv has shape \(2, 4, 16\).*kv_length=5"):
    layer.decode(_x(2), cache, inputs_kv=_x(4, seed=3))


# ---------------------------------------------------------------------------
# Errors name the option and the family.


@pytest.mark.parametrize(
  "cfg,call,match",
  [
    (
      nn.AttentionConfig(family="linear"),
      dict(mask=jnp.ones((1, 1, 6, 6), bool)),
      "mask: family='linear'",
    ),
    (
      nn.AttentionConfig(family="linear"),
      dict(segment_ids=jnp.zeros((B, 6), jnp.int32)),
      "segment_ids: family='linear'",
    ),
    (
      nn.AttentionConfig(family="sparse", pattern=("causal", ())),
      dict(inputs_kv=_x(4)),
      "inputs_kv: family='sparse'",
    ),
    (nn.AttentionConfig(window=2), dict(inputs_kv=_x(4)), "inputs_kv"),
    (nn.AttentionConfig(), dict(segment_ids=jnp.zeros((B, 5), jnp.int32)), "segment_ids"),
    (nn.AttentionConfig(), dict(positions=jnp.zeros((3,), jnp.int32)), "positions"),
    (nn.AttentionConfig(), dict(mask=jnp.ones((B, 1, 6, 5), bool)), "mask"),
    (nn.AttentionConfig(), dict(mask=jnp.ones((B, 1, 6, 6), jnp.float32)), "mask"),
  ],
  ids=[
    "linear_mask",
    "linear_segments",
    "sparse_cross",
    "window_cross",
    "segment_shape",
    "positions_shape",
    "mask_shape",
    "mask_dtype",
  ],
)
def test_unsupported_options_raise_naming_them(cfg, call, match):
  with pytest.raises((ValueError, TypeError), match=match):
    _layer(cfg)(_x(6), **call)


def test_decode_errors():
  enc = _layer(nn.AttentionConfig(is_causal=False))
  with pytest.raises(ValueError, match="is_causal"):
    enc.decode(_x(2), enc.init_cache(B, 4))
  layer = _layer(nn.AttentionConfig())
  with pytest.raises(ValueError, match="mask"):
    layer.decode(_x(2), layer.init_cache(B, 4), mask=jnp.ones((1, 1, 2, 6), bool))
  with pytest.raises(ValueError, match="CrossCache"):
    layer.decode(_x(2), layer.init_cache(B, 4), inputs_kv=_x(3))
  with pytest.raises(ValueError, match="is_causal"):
    nn.AttentionConfig(window=3, num_sinks=1, is_causal=False)


def test_encoder_window_is_symmetric():
  # An encoder layer's window w keeps keys i - w .. i + w (ModernBERT's local layers).
  layer = _layer(nn.AttentionConfig(window=2, is_causal=False))
  allowed = layer.allowed_mask(6)[0, 0]
  i, j = jnp.meshgrid(jnp.arange(6), jnp.arange(6), indexing="ij")
  assert bool(jnp.all(allowed == (jnp.abs(i - j) <= 2)))
  x = _x(6)
  full = _layer(nn.AttentionConfig(is_causal=False))
  nnx.update(full, nnx.state(layer))
  masked = full(x, mask=jnp.abs(i - j)[None, None] <= 2)
  np.testing.assert_allclose(layer(x), masked, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Specs and configs.


def test_config_is_common_fields_plus_a_spec():
  a = nn.AttentionConfig(family="qk_norm", qk_norm="layer", num_heads=8)
  b = nn.AttentionConfig(spec=nn.QKNormSpec(qk_norm="layer"), num_heads=8)
  assert a == b and hash(a) == hash(b) and a.family == "qk_norm"
  assert a.qk_norm == "layer" and a.window is None  # spec fields read through
  assert a.replace(window=4).spec == nn.QKNormSpec(qk_norm="layer", window=4)
  assert a.replace(num_heads=2).num_heads == 2
  assert dataclasses.replace(a, num_heads=2) == a.replace(num_heads=2)
  assert a.replace(family="linear").spec == nn.LinearSpec()
  # Options of another family at their old default are accepted (the flat record).
  assert nn.AttentionConfig(family="linear", normalizer="softmax").spec == nn.LinearSpec()


# Written by ModelConfig.to_dict before the specs (one flat record per layer).
OLD_MODEL_DICT = json.loads("""{"vocab_size": 11, "d_model": 16, "num_layers": 2, "attention": {
"family": "dense", "num_heads": 4, "num_kv_heads": null, "head_dim": null, "normalizer":
"softmax", "similarity": "dot", "qk_norm": "rms", "qk_norm_placement": "before_rope",
"qk_norm_gain": true, "qk_norm_eps": 1e-06, "qk_scale": null, "cosine_convention": "swin",
"temperature_init": null, "sink_logits": false, "output_gate": null, "kv_bias": false, "window":
null, "num_sinks": 0, "streaming_rope": "cache", "pattern": null, "block_size": 16,
"feature_map": "elu_plus_one", "num_features": 64, "stabilize_features": true,
"linear_normalize": "denominator", "chunk_size": 64, "rope_theta": 10000.0, "softcap": null,
"implementation": null, "sow_weights": false}, "layer_attention": [{"family": "qk_norm",
"num_heads": 4, "num_kv_heads": 2, "head_dim": null, "normalizer": "softmax", "similarity":
"dot", "qk_norm": "rms", "qk_norm_placement": "before_rope", "qk_norm_gain": true,
"qk_norm_eps": 1e-06, "qk_scale": null, "cosine_convention": "swin", "temperature_init": null,
"sink_logits": true, "output_gate": "elementwise", "kv_bias": true, "window": 3, "num_sinks": 1,
"streaming_rope": "cache", "pattern": null, "block_size": 16, "feature_map": "elu_plus_one",
"num_features": 64, "stabilize_features": true, "linear_normalize": "denominator",
"chunk_size": 64, "rope_theta": 10000.0, "softcap": 10.0, "implementation": null,
"sow_weights": false}, {"family": "sparse", "num_heads": 4, "num_kv_heads": null, "head_dim":
null, "normalizer": "softmax", "similarity": "dot", "qk_norm": "rms", "qk_norm_placement":
"before_rope", "qk_norm_gain": true, "qk_norm_eps": 1e-06, "qk_scale": null,
"cosine_convention": "swin", "temperature_init": null, "sink_logits": false, "output_gate":
null, "kv_bias": false, "window": null, "num_sinks": 0, "streaming_rope": "cache", "pattern":
["strided", {"stride": 4}], "block_size": 4, "feature_map": "elu_plus_one", "num_features": 64,
"stabilize_features": true, "linear_normalize": "denominator", "chunk_size": 64, "rope_theta":
10000.0, "softcap": null, "implementation": null, "sow_weights": false}], "mlp": "gelu",
"mlp_dim": null, "norm": "rms", "norm_eps": 1e-06, "tie_embeddings": true, "dtype": "float32",
"param_dtype": "float32", "remat": false}""")


def test_old_format_dicts_load_and_round_trip():
  cfg = nn.ModelConfig.from_dict(OLD_MODEL_DICT)
  first, second = cfg.layer_attention
  assert first == nn.AttentionConfig(
    family="qk_norm",
    num_kv_heads=2,
    sink_logits=True,
    output_gate="elementwise",
    kv_bias=True,
    window=3,
    num_sinks=1,
    softcap=10.0,
  )
  assert second.spec == nn.SparseSpec(pattern=("strided", (("stride", 4),)), block_size=4)
  back = nn.ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
  assert back == cfg
  # The new dicts hold only the family's own options.
  assert "feature_map" not in cfg.to_dict()["attention"]


@pytest.mark.parametrize(
  "field,value",
  [
    ("window", 3),  # a dense-kernel option that linear attention cannot take
    ("feature_map", "softmax"),  # the family's own option, invalid
    ("bogus", 1),  # no family has it
  ],
)
def test_old_format_with_a_bad_field_names_it(field, value):
  d = json.loads(json.dumps(OLD_MODEL_DICT))
  d["attention"]["family"] = "linear"
  d["attention"][field] = value
  with pytest.raises((ValueError, TypeError), match=field):
    nn.ModelConfig.from_dict(d)


@dataclasses.dataclass(frozen=True)
class _DoubledSpec(nn.DenseSpec):
  """A new family from a subclass: logits scaled by a constant; no edit to Attention."""

  family: ClassVar[str] = "test_doubled"
  factor: float = 2.0

  def kwargs(self, layer):
    return dict(super().kwargs(layer), scale=self.factor * layer.head_dim**-0.5)


def test_a_new_family_is_a_spec_and_a_registration():
  specs.register_family(_DoubledSpec)
  try:
    cfg = nn.AttentionConfig(family="test_doubled", factor=3.0)
    layer = _layer(cfg)
    x = _x(6)
    q, k, v = _heads(layer, x)
    pos = jnp.arange(6)
    want = attnjax.dot_product_attention(
      _rope(layer, q, pos),
      _rope(layer, k, pos),
      v,
      is_causal=True,
      scale=3.0 * layer.head_dim**-0.5,
    )
    assert_close(layer(x), _out(layer, want), rtol=2e-5, atol=2e-5)
    assert nn.AttentionConfig.from_dict(cfg.to_dict()) == cfg
  finally:
    specs.FAMILY_SPECS.pop("test_doubled")


def test_optional_parameters_are_declared_none():
  layer = _layer(nn.AttentionConfig(family="qk_norm", qk_norm_gain=False))
  assert layer.q_gain is None and layer.sink_logits is None and layer.gate_proj is None
  assert "q_gain" not in nnx.state(layer, nnx.Param)


def test_allowed_mask_and_compared_qk():
  layer = _layer(nn.AttentionConfig(window=2, num_sinks=1, kv_bias=True))
  m = np.asarray(layer.allowed_mask(5))[0, 0]
  assert m.shape == (5, 6) and m[:, 5].all()
  np.testing.assert_array_equal(m[4, :5], [True, False, True, True, True])
  np.testing.assert_array_equal(m[1, :5], [True, True, False, False, False])
  sparse = _layer(nn.AttentionConfig(family="sparse", pattern=("strided", (("stride", 2),))))
  np.testing.assert_array_equal(
    np.asarray(sparse.allowed_mask(6))[0, 0],
    np.asarray(sparse.config.spec.make_pattern().mask(6, 6))[0, 0],
  )
  qk = _layer(
    nn.AttentionConfig(family="qk_norm", qk_norm="l2", qk_norm_placement="after_rope", scale=4.0)
  )
  q, k, _ = _heads(qk, _x(6))
  cq, ck = qk.compared_qk(q, k)
  # l2 after RoPE
  assert_close(jnp.linalg.norm(cq, axis=-1), jnp.ones(cq.shape[:-1]), rtol=1e-5, atol=1e-5)
  cq2, _ = qk.compared_qk(q, k, positions=jnp.arange(6) + 1)
  assert not np.allclose(cq, cq2, atol=1e-3)


# ---------------------------------------------------------------------------
# Packed training batches.


def _packed_corpus():
  text = "".join(f"line {i} {'ab' * (i % 5)}\n" for i in range(60))
  tok = data.CharTokenizer.from_text(text)
  ids = tok.encode(text)
  return data.TokenData(
    train=ids, val=ids, vocab_size=tok.vocab_size, bos_id=tok.bos_id, unit="char", tokenizer=tok
  ), tok


def test_packed_batch_layout():
  corpus, tok = _packed_corpus()
  batches = data.CorpusBatches(corpus, seq_len=24, batch_size=3, seed=0, pack=True)
  b = batches.batch("train", 5)
  assert b.packed and b.inputs.shape == b.segment_ids.shape == b.weights.shape == (3, 24)
  for r in range(3):
    starts = np.flatnonzero(b.inputs[r] == tok.bos_id)
    assert starts[0] == 0 and np.all(b.positions[r][starts] == 0)
    for s in starts[1:]:  # a new document: new segment, and the target before it is dropped
      assert b.segment_ids[r, s] != b.segment_ids[r, s - 1] and b.weights[r, s - 1] == 0
    text = tok.decode(b.inputs[r, 1 : starts[1]]) if len(starts) > 1 else ""
    assert text == "" or (text.startswith("line ") and text.endswith("\n"))
  assert b.weights.sum() < b.weights.size
  np.testing.assert_array_equal(batches.batch("train", 5).inputs, b.inputs)  # deterministic
  assert not batches.batch("probe", 0).packed


def test_packed_batch_losses_equal_documents_run_one_by_one():
  corpus, tok = _packed_corpus()
  batches = data.CorpusBatches(corpus, seq_len=32, batch_size=2, seed=1, pack=True)
  b = batches.batch("train", 0)
  cfg = nn.ModelConfig(
    vocab_size=corpus.vocab_size,
    d_model=D,
    num_layers=2,
    attention=nn.AttentionConfig(num_kv_heads=2),
  )
  model = nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  packing = {k: jnp.asarray(v) for k, v in b.packing().items()}
  logits, _, _ = train_step.forward(
    graphdef, params, rest, jnp.asarray(b.inputs), stats=False, packing=packing
  )
  ce = np.asarray(train_step.cross_entropy(logits, jnp.asarray(b.targets)))
  # Each document alone, from position 0, one per row of a batch (rows never meet): padded
  # at its end to the batch's length, which a causal model's earlier positions cannot see.
  docs = [
    (r, np.flatnonzero(b.segment_ids[r] == seg))
    for r in range(2)
    for seg in np.unique(b.segment_ids[r])
  ]
  alone_inputs = np.zeros((len(docs), b.inputs.shape[1]), b.inputs.dtype)
  alone_targets = np.zeros_like(alone_inputs)
  for row, (r, idx) in enumerate(docs):
    alone_inputs[row, : idx.size] = b.inputs[r, idx]
    alone_targets[row, : idx.size] = b.targets[r, idx]
  alone = model(jnp.asarray(alone_inputs))
  ce_alone = np.asarray(train_step.cross_entropy(alone, jnp.asarray(alone_targets)))
  checked = 0
  for row, (r, idx) in enumerate(docs):
    w = b.weights[r, idx] > 0
    np.testing.assert_allclose(ce[r, idx][w], ce_alone[row, : idx.size][w], rtol=1e-4, atol=1e-5)
    checked += int(w.sum())
  assert checked == int(b.weights.sum())
  # The step's loss counts only weighted targets.
  loss = train_step.mean_loss(jnp.asarray(ce), packing)
  np.testing.assert_allclose(loss, (ce * b.weights).sum() / b.weights.sum(), rtol=1e-6)
  # Without the packing the model sees across documents: different losses.
  unpacked, _, _ = train_step.forward(graphdef, params, rest, jnp.asarray(b.inputs), stats=False)
  assert not np.allclose(
    np.asarray(train_step.cross_entropy(unpacked, jnp.asarray(b.targets))), ce, atol=1e-4
  )
