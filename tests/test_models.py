"""Pretrained checkpoints (attnjax.models) against transformers' own outputs, offline.

The fixtures in tests/fixtures/pretrained/ are tiny random checkpoints that
``transformers`` wrote (tests/fixtures/make_pretrained_fixtures.py, which says how and
with which versions), each with transformers' eager float32 outputs on fixed tokens:
logits, per-layer per-head sink mass and 32 greedy tokens. The default run checks one
fixture per model type; the second fixtures of a type, the reference and block-wise
implementations of every fixture and greedy generation of every fixture run under
``-m slow``.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnjax import models, nn
from attnjax._src.models import architectures
from helpers import assert_close, reduction_tolerance

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "pretrained")
ALL = sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))
# One fixture per registered model type in the default run: the one named after it (the
# richest of each).
DEFAULT = models.SUPPORTED
MORE = tuple(n for n in ALL if n not in DEFAULT)
# Encoders (bert, roberta, modernbert): no generation; tests/test_encoders.py has the rest.
ENCODERS = tuple(
  n
  for n in ALL
  if json.load(open(os.path.join(FIXTURES, n, "config.json")))["model_type"]
  in ("bert", "roberta", "modernbert")
)
LOGIT_TOL = 1e-4  # of the logits' scale (max |logit|)
SINK_TOL = 1e-5


def _expected(name: str) -> dict:
  with np.load(os.path.join(FIXTURES, name, "expected.npz")) as z:
    return {k: z[k] for k in z.files}


def _config(name: str) -> dict:
  with open(os.path.join(FIXTURES, name, "config.json")) as f:
    return json.load(f)


def _model_type(name: str) -> str:
  return _config(name)["model_type"]


_CACHE: dict = {}


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


def _load(name: str, **kwargs) -> nn.TransformerLM:
  """A fixture's model (loaded once per test module and options)."""
  key = (name, json.dumps(kwargs, sort_keys=True, default=str))
  if key not in _CACHE:
    _CACHE[key] = models.from_pretrained(os.path.join(FIXTURES, name), **kwargs)
  return _CACHE[key]


@pytest.fixture(scope="module", autouse=True)
def _drop_models():
  yield
  _CACHE.clear()


def _check_against_transformers(name: str, implementation=None) -> None:
  e = _expected(name)
  attention = None if implementation is None else {"implementation": implementation}
  if "full_layers" in e and implementation not in (None, "reference"):
    # A hybrid: a softmax engine names nothing of the recurrent layers (their own options).
    attention = {"full_attention": attention}
  model = _load(name, dtype="float32", attention=attention)
  stats = nn.layer_stats(model, jnp.asarray(e["tokens"]), view="sown")
  scale = float(np.abs(e["logits"]).max())
  err = float(np.abs(np.asarray(stats["logits"]) - e["logits"]).max())
  assert err <= LOGIT_TOL * scale, (name, implementation, err, scale)
  sink_mass = np.stack([np.asarray(layer["sink_mass"]) for layer in stats["layers"]])
  if "full_layers" in e:  # a hybrid: transformers gives the full-attention layers' weights
    sink_mass = sink_mass[e["full_layers"]]
  assert sink_mass.shape == e["sink_mass"].shape  # [L, B, N]
  np.testing.assert_allclose(
    sink_mass,
    e["sink_mass"],
    atol=SINK_TOL,
    rtol=0,
    err_msg=f"{name} implementation={implementation}",
  )


def _check_generation(name: str, **kwargs) -> None:
  e = _expected(name)
  model = _load(name, dtype="float32", **kwargs)
  tokens = nn.generate(model, jnp.asarray(e["prompt"]), num_tokens=32)
  np.testing.assert_array_equal(np.asarray(tokens), e["generated"], err_msg=name)


def test_supported_types_each_have_a_fixture():
  assert models.SUPPORTED == tuple(models.ARCHITECTURES)
  for model_type, arch in models.ARCHITECTURES.items():
    assert arch.model_type == model_type
    assert model_type in ALL and _model_type(model_type) == model_type, model_type
  assert {_model_type(n) for n in ALL} == set(models.SUPPORTED)


@pytest.mark.parametrize("name", DEFAULT)
def test_logits_and_sink_mass_equal_transformers(name):
  _check_against_transformers(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", MORE)
def test_more_fixtures_equal_transformers(name):
  _check_against_transformers(name)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["reference", "blockwise"])
@pytest.mark.parametrize("name", ALL)
def test_every_fixture_through_every_implementation(name, implementation):
  _check_against_transformers(name, implementation)


def test_reference_and_blockwise_on_sinks_windows_and_experts():
  # gpt-oss: sink logits, alternating windows shorter than the sequence, YaRN, MoE.
  _check_against_transformers("gpt_oss", "reference")
  _check_against_transformers("gpt_oss", "blockwise")


@pytest.mark.parametrize("name", ["gpt2", "gemma2"])
def test_greedy_generation_through_the_cache_equals_transformers(name):
  # gpt2: learned positions continue from the cache's index; gemma2: rolling window
  # caches, softcaps, sandwich norms.
  _check_generation(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in ALL if n not in ("gpt2", "gemma2") + ENCODERS])
def test_greedy_generation_of_every_fixture(name):
  _check_generation(name)


# ---------------------------------------------------------------------------
# Checkpoint formats: shards, bfloat16, MXFP4.


def _params(model) -> dict:
  return {
    jax.tree_util.keystr(p): np.asarray(x)
    for p, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model)))
  }


def test_sharded_checkpoint_reads_every_shard():
  # Its logits against transformers': test_more_fixtures_equal_transformers (-m slow).
  ckpt = models.Checkpoint(os.path.join(FIXTURES, "llama_sharded"))
  assert len(set(ckpt.files.values())) == 4
  params = _params(_load("llama_sharded"))
  for i in range(3):
    np.testing.assert_array_equal(
      params[f"['blocks'][{i}]['mlp']['up']['kernel']"],
      ckpt.read(f"model.layers.{i}.mlp.up_proj.weight").T,
    )
  np.testing.assert_array_equal(params["['head']['kernel']"], ckpt.read("lm_head.weight").T)


def test_bfloat16_checkpoint_reads_raw_bytes_and_keeps_its_dtype():
  path = os.path.join(FIXTURES, "qwen2_window_bf16")
  ckpt = models.Checkpoint(path)
  name = "model.layers.0.self_attn.q_proj.weight"
  assert ckpt.dtype(name) == "BF16"
  w = ckpt.read(name)
  assert w.dtype == jnp.bfloat16 and w.shape == ckpt.shape(name)
  native = _load("qwen2_window_bf16")  # dtype=None: the checkpoint's
  kernel = native.blocks[0].attention.q_proj.kernel[...]
  assert kernel.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(kernel, np.float32), np.asarray(w, np.float32).T)
  e = _expected("qwen2_window_bf16")
  logits = np.asarray(_forward(native, jnp.asarray(e["tokens"])))
  assert logits.dtype == np.float32
  # bf16 compute: within bfloat16 rounding of the float32 logits (loaded as float32 they
  # equal transformers' to rounding: test_more_fixtures_equal_transformers, -m slow).
  assert np.abs(logits - e["logits"]).max() <= 0.05 * np.abs(e["logits"]).max()


def test_mxfp4_experts_are_dequantised_as_transformers_does():
  ckpt = models.Checkpoint(os.path.join(FIXTURES, "gpt_oss_mxfp4"))
  assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in ckpt.files
  assert ckpt.dtype("model.layers.0.mlp.experts.gate_up_proj_blocks") == "U8"
  _check_against_transformers("gpt_oss_mxfp4")


def test_dequantize_mxfp4_by_hand():
  # One expert, one output row, one group of 32: bytes 0x21 = (low 1 -> 0.5, high 2 -> 1.0),
  # 0x9F = (low 15 -> -6.0, high 9 -> -0.5); scale byte 128 = 2 ** 1.
  blocks = np.zeros((1, 1, 1, 16), np.uint8)
  blocks[0, 0, 0, :2] = [0x21, 0x9F]
  scales = np.full((1, 1, 1), 128, np.uint8)
  w = models.dequantize_mxfp4(blocks, scales)
  assert w.shape == (1, 32, 1)
  np.testing.assert_array_equal(w[0, :4, 0], [1.0, 2.0, -12.0, -1.0])
  assert not np.any(w[0, 4:, 0])


def test_raw_bfloat16_reader_on_a_hand_written_file(tmp_path):
  values = np.array([[1.5, -2.0, 3.140625], [0.0, 65280.0, -0.0078125]], jnp.bfloat16)
  other = np.arange(3, dtype=np.float32)
  header = {
    "a": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
    "b": {"dtype": "F32", "shape": [3], "data_offsets": [12, 24]},
  }
  raw = json.dumps(header).encode()
  raw += b" " * (-len(raw) % 8)
  with open(tmp_path / "model.safetensors", "wb") as f:
    f.write(len(raw).to_bytes(8, "little") + raw + values.tobytes() + other.tobytes())
  (tmp_path / "config.json").write_text("{}")
  ckpt = models.Checkpoint(str(tmp_path))
  np.testing.assert_array_equal(
    np.asarray(ckpt.read("a"), np.float32), np.asarray(values, np.float32)
  )
  np.testing.assert_array_equal(ckpt.read("b"), other)


# ---------------------------------------------------------------------------
# Decoding through the caches.


@nnx.jit(static_argnames=("prefill",))
def _full_and_decoded(model, tokens, *, prefill):
  """Full forward; a prefill then one-token steps (a scan) through the model's caches."""
  B, T = tokens.shape
  full = model(tokens)
  cache = model.init_cache(B, T)
  first, cache = model.decode(tokens[:, :prefill], cache)

  def step(cache, token):
    logits, cache = model.decode(token[:, None], cache)
    return cache, logits[:, 0]

  cache, rest = jax.lax.scan(step, cache, jnp.transpose(tokens[:, prefill:]))
  return full, jnp.concatenate([first, jnp.transpose(rest, (1, 0, 2))], axis=1)


def _decode_cases():
  T = 24
  lossless = [
    ("gpt_oss", None),
    ("gemma2", None),
    ("llama", None),
    ("llama", {"cache_policy": "h2o", "cache_budget": T, "cache_recent": 4}),
    ("llama", {"cache_policy": "sinks_window", "cache_budget": T}),
  ]
  return lossless


@pytest.mark.parametrize("name,attention", _decode_cases()[:1])
def test_decode_equals_the_full_forward(name, attention):
  _check_decode(name, attention)


@pytest.mark.slow
@pytest.mark.parametrize("name,attention", _decode_cases()[1:])
def test_decode_equals_the_full_forward_for_every_lossless_policy(name, attention):
  _check_decode(name, attention)


def _check_decode(name, attention, tol=1e-5):
  model = _load(name, dtype="float32", attention=attention)
  e = _expected(name)
  full, stepwise = _full_and_decoded(model, jnp.asarray(e["tokens"]), prefill=5)
  scale = float(np.abs(e["logits"]).max())
  np.testing.assert_allclose(np.asarray(full), e["logits"], atol=LOGIT_TOL * scale, rtol=0)
  # The cache path sums the same terms in another order: tol of the logits' scale.
  assert_close(stepwise, full, "decoded against full", rtol=tol, atol=tol, scaled=True)


@pytest.mark.slow
@pytest.mark.parametrize("policy,tol", [("int8", 0.02), ("fp8", 0.1)])
def test_quantised_caches_decode_close_to_the_full_forward(policy, tol):
  model = _load("llama", dtype="float32", attention={"cache_policy": policy})
  e = _expected("llama")
  full, stepwise = _full_and_decoded(model, jnp.asarray(e["tokens"]), prefill=5)
  err = float(jnp.linalg.norm(stepwise - full) / jnp.linalg.norm(full))
  assert 0 < err < tol, err


# ---------------------------------------------------------------------------
# attention=


def test_attention_options_replace_the_checkpoints_and_keep_its_own():
  model = _load("gemma2", attention={"implementation": "reference", "normalizer": "softmax_one"})
  for block in model.blocks:
    c = block.attention.config
    assert c.implementation == "reference" and c.normalizer == "softmax_one"
    assert c.softcap == 3.0 and c.spec.scale == pytest.approx(12**-0.5)
  windows = [b.attention.config.window for b in model.blocks]
  assert windows == [5, None, 5]  # transformers' sliding_window 6 = keys i-5..i


def test_another_family_keeps_what_it_shares_and_starts_new_parameters():
  with pytest.warns(UserWarning, match="q_gain"):
    model = models.from_pretrained(
      os.path.join(FIXTURES, "mistral"), attention={"family": "qk_norm", "qk_norm": "l2"}
    )
  c = model.blocks[0].attention.config
  assert c.family == "qk_norm" and c.window == 5 and c.qk_norm == "l2"
  np.testing.assert_array_equal(np.asarray(model.blocks[0].attention.q_gain[...]), 1.0)
  # The checkpoint's weights are there.
  ckpt = models.Checkpoint(os.path.join(FIXTURES, "mistral"))
  np.testing.assert_array_equal(
    np.asarray(model.blocks[0].attention.k_proj.kernel[...]),
    ckpt.read("model.layers.0.self_attn.k_proj.weight").T,
  )


def test_dropping_sink_logits_warns_and_drops_the_tensors():
  with pytest.warns(UserWarning, match="sink_logits"):
    model = models.from_pretrained(
      os.path.join(FIXTURES, "gpt_oss"), attention={"sink_logits": False}
    )
  assert model.blocks[0].attention.sink_logits is None


@pytest.mark.parametrize(
  "attention,error,match",
  [
    ({"normalizer": "nope"}, ValueError, "normalizer"),
    ({"windw": 4}, TypeError, "windw"),
    ({"family": "linear"}, ValueError, "softcap"),  # gemma2's softcap has no equivalent
    ({"cache_policy": "h2o", "cache_budget": 8}, ValueError, "window"),
    ("reference", TypeError, "mapping"),
  ],
)
def test_bad_attention_options_name_the_field(attention, error, match):
  with pytest.raises(error, match=match):
    models.from_pretrained(os.path.join(FIXTURES, "gemma2"), attention=attention)


# attention= per layer type: StreamingLLM on the global layers of a windowed model.

_STREAMING = {"cache_policy": "sinks_window", "cache_budget": 8, "cache_recent": 6}


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text", "qwen2_window_bf16"])
def test_attention_targets_the_full_attention_layers_only(name):
  native = _load(name)
  model = _load(name, attention={"implementation": "reference", "full_attention": _STREAMING})
  types = architectures.architecture(_config(name)).layer_types(_config(name))
  assert set(types) == {"full_attention", "sliding_attention"}
  for layer_type, old, new in zip(types, native.blocks, model.blocks):
    old, new = old.attention.config, new.attention.config
    assert new.implementation == "reference"  # the shared options reach every layer
    if layer_type == "sliding_attention":
      assert new.window == old.window is not None and new.spec.cache_policy == "full"
      assert new.replace(implementation=old.implementation) == old
    else:
      assert old.window is None and new.window is None
      assert (new.spec.cache_policy, new.spec.cache_budget, new.spec.cache_recent) == (
        "sinks_window",
        8,
        6,
      )
      assert (
        new.replace(
          implementation=old.implementation,
          cache_policy="full",
          cache_budget=None,
          cache_recent=None,
        )
        == old
      )


def test_the_untargeted_form_names_the_layers_it_cannot_apply_to_and_how_to_target():
  with pytest.raises(
    ValueError,
    match=r"the sliding_attention layers \[0, 2\] cannot take "
    r"these options.*window=5.*target those by layer type: "
    r"attention=\{'full_attention': \{'cache_policy'",
  ):
    models.from_pretrained(
      os.path.join(FIXTURES, "gemma2"),
      attention={"cache_policy": "sinks_window", "cache_budget": 8},
    )
  # Where every layer can take them, as on Llama, the plain form applies to every layer.
  model = _load("llama", attention={"cache_policy": "sinks_window", "cache_budget": 8})
  assert {b.attention.config.spec.cache_policy for b in model.blocks} == {"sinks_window"}
  # A layer type's own options override the shared ones; its window can be lifted too.
  model = _load(
    "gemma2",
    attention={
      "cache_policy": "sinks_window",
      "cache_budget": 8,
      "sliding_attention": {"window": None},
    },
  )
  assert [
    (b.attention.config.window, b.attention.config.spec.cache_policy) for b in model.blocks
  ] == [(None, "sinks_window")] * 3


@pytest.mark.parametrize(
  "attention,error,match",
  [
    (
      {"sliding_attention": {"normalizer": "softmax_one"}},
      ValueError,
      r"no sliding_attention layers \(its layer types: \['full_attention'\]\)",
    ),
    (
      {"full_attention": "reference"},
      TypeError,
      r"attention\['full_attention'\] must be a "
      r"mapping",
    ),
    ({"full_attention": {"sliding_attention": {}}}, TypeError, "not nested types"),
    ({"full_attention": {"windw": 3}}, TypeError, r"attention\['full_attention'\].*windw"),
    (  # a layer type of another model: named with this checkpoint's, not as a field
      {"global_attention": {"window": 4}},
      ValueError,
      r"'global_attention' is not a layer type of this checkpoint \(its layer types: "
      r"\['full_attention'\]\)",
    ),
  ],
)
def test_bad_layer_type_targets_are_named(attention, error, match):
  with pytest.raises(error, match=match):
    models.from_pretrained(os.path.join(FIXTURES, "llama"), attention=attention)


@pytest.mark.parametrize("name", ["gemma2", pytest.param("gemma3_text", marks=pytest.mark.slow)])
def test_streaming_cache_on_the_global_layers_decodes_as_their_sinks_and_window(name):
  # The sinks_window cache (8 slots: 2 sinks + 6 recent) of the global layers evicts from the
  # 9th token on; one token at a time it equals the same layers with window=6, num_sinks=2
  # (StreamingLLM's layer; tests/test_kv_cache.py holds the two equal on one layer), and the
  # sliding layers keep their own rolling windows in both.
  e = _expected(name)
  tokens = jnp.asarray(e["tokens"])
  streaming = _load(name, dtype="float32", attention={"full_attention": _STREAMING})
  layer = _load(name, dtype="float32", attention={"full_attention": {"window": 6, "num_sinks": 2}})
  full, a = _full_and_decoded(streaming, tokens, prefill=5)
  _, b = _full_and_decoded(layer, tokens, prefill=5)
  assert tokens.shape[1] > 8
  np.testing.assert_allclose(
    np.asarray(full), e["logits"], atol=LOGIT_TOL * float(np.abs(e["logits"]).max()), rtol=0
  )
  assert_close(a, b, "sinks_window cache against window + sinks", rtol=1e-5, atol=1e-5, scaled=True)
  # The eviction bites: after the budget the decoded logits leave the full forward's.
  assert float(jnp.abs(a[:, 9:] - full[:, 9:]).max()) > 1e-3 * float(jnp.abs(full).max())


# ---------------------------------------------------------------------------
# Bad input: each a named error before anything is computed.


def _copy_fixture(tmp_path, name="llama"):
  out = tmp_path / name
  shutil.copytree(os.path.join(FIXTURES, name), out)
  return out


def _edit_config(path, **changes):
  config = json.loads((path / "config.json").read_text())
  for key, value in changes.items():
    if value is _DELETE:
      config.pop(key, None)
    else:
      config[key] = value
  (path / "config.json").write_text(json.dumps(config))


_DELETE = object()


def _rewrite_tensors(path, edit):
  from safetensors.numpy import load_file, save_file

  file = path / "model.safetensors"
  tensors = load_file(str(file))
  edit(tensors)
  save_file(tensors, str(file), metadata={"format": "pt"})


def test_not_a_checkpoint_directory(tmp_path):
  with pytest.raises(models.CheckpointError, match="not a checkpoint directory"):
    models.from_pretrained(str(tmp_path / "nowhere"))
  with pytest.raises(models.CheckpointError, match="no config.json"):
    models.from_pretrained(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
  (tmp_path / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(models.CheckpointError, match="pytorch_model.bin"):
    models.from_pretrained(str(tmp_path))
  (tmp_path / "model.safetensors").write_bytes(b"\xff" * 4)
  with pytest.raises(models.CheckpointError, match="not a safetensors file"):
    models.from_pretrained(str(tmp_path))


def test_unknown_model_type_lists_supported(tmp_path):
  path = _copy_fixture(tmp_path)
  _edit_config(path, model_type="falcon")
  with pytest.raises(
    models.CheckpointError, match="falcon.*SUPPORTED = " + re.escape(str(models.SUPPORTED))
  ):
    models.from_pretrained(str(path))


@pytest.mark.parametrize(
  "changes,match",
  [
    ({"attn_logit_softcapping": 30.0}, "attn_logit_softcapping"),  # a key llama does not read
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "dynamic"),
    (
      {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
      "low_freq_factor",
    ),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"hidden_act": "relu2"}, "hidden_act"),
    ({"quantization_config": {"quant_method": "gptq"}}, "gptq"),
    ({"pruned_heads": {"0": [1]}}, "pruned_heads"),
  ],
)
def test_config_keys_that_change_the_computation_are_named(tmp_path, changes, match):
  path = _copy_fixture(tmp_path)
  _edit_config(path, **changes)
  with pytest.raises(models.CheckpointError, match=match):
    models.from_pretrained(str(path))


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path):
  path = _copy_fixture(tmp_path)
  _rewrite_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(
    models.CheckpointError, match=r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"
  ):
    models.from_pretrained(str(path))
  path = _copy_fixture(tmp_path / "b")
  _rewrite_tensors(path, lambda t: t.update(extra=np.zeros(3, np.float32)))
  with pytest.raises(models.CheckpointError, match=r"unexpected tensors \['extra'\]"):
    models.from_pretrained(str(path))
  path = _copy_fixture(tmp_path / "c")
  _edit_config(path, intermediate_size=65)
  with pytest.raises(
    models.CheckpointError,
    match=r"gate_proj.weight' has shape \(64, 32\), the config implies "
    r"\(65, 32\)",
  ):
    models.from_pretrained(str(path))


def test_bad_dtype_and_mesh(tmp_path):
  path = os.path.join(FIXTURES, "llama")
  with pytest.raises(ValueError, match="dtype"):
    models.from_pretrained(path, dtype="int8")
  with pytest.raises(TypeError, match="mesh"):
    models.from_pretrained(path, mesh="model")


# ---------------------------------------------------------------------------
# Configs of other transformers versions (older config.json layouts).


def test_older_rope_and_window_layouts_map_as_transformers_reads_them():
  base = dict(
    vocab_size=32,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
  )
  llama = architectures.architecture(dict(base, model_type="llama"))
  cfg = llama.build(
    dict(
      base,
      model_type="llama",
      rope_theta=500000.0,
      rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
      },
    )
  )
  assert cfg.attention.rope_theta == 500000.0
  assert dict(cfg.attention.rope_scaling)["type"] == "llama3"
  qwen = dict(base, model_type="qwen2", sliding_window=8, max_window_layers=2)
  cfg = architectures.architecture(qwen).build(dict(qwen, use_sliding_window=True))
  assert [cfg.attention_for(i).window for i in range(4)] == [None, None, 7, 7]
  cfg = architectures.architecture(qwen).build(qwen)  # use_sliding_window: false by default
  assert cfg.layer_attention is None and cfg.attention.window is None
  gemma3 = dict(
    base,
    model_type="gemma3_text",
    head_dim=8,
    rope_theta=1e6,
    rope_local_base_freq=1e4,
    sliding_window_pattern=2,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
  )
  cfg = architectures.architecture(gemma3).build(gemma3)
  local, full = cfg.attention_for(0), cfg.attention_for(1)
  assert (local.rope_theta, local.rope_scaling, local.window) == (1e4, None, 4095)
  assert full.rope_theta == 1e6 and dict(full.rope_scaling) == {"type": "linear", "factor": 8.0}
  assert full.window is None and cfg.embed_scale == pytest.approx(32**0.5)


def test_older_gpt2_checkpoints_without_prefix_and_with_mask_buffers(tmp_path):
  path = _copy_fixture(tmp_path, "gpt2")

  def strip(tensors):
    for name in list(tensors):
      tensors[name[len("transformer.") :]] = tensors.pop(name)
    tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 64, 64), np.float32))
    tensors["h.0.attn.masked_bias"] = np.array(-1e4, np.float32)

  _rewrite_tensors(path, strip)
  _edit_config(path, n_ctx=64)
  old, new = _params(models.from_pretrained(str(path))), _params(_load("gpt2"))
  assert old.keys() == new.keys()
  for key in old:
    np.testing.assert_array_equal(old[key], new[key], err_msg=key)


# ---------------------------------------------------------------------------
# The registry: one class per model type, the rest generated from it.


def _model_type_strings(path: pathlib.Path) -> list[str]:
  """Model-type string constants of a module outside ``model_type = "..."`` class attributes."""
  tree = ast.parse(path.read_text())
  own = {
    id(node.value)
    for node in ast.walk(tree)
    if isinstance(node, ast.Assign)
    and isinstance(node.value, ast.Constant)
    and [getattr(t, "id", None) for t in node.targets] == ["model_type"]
  }
  return [
    f"{path.name}:{node.lineno}: {node.value!r}"
    for node in ast.walk(tree)
    if isinstance(node, ast.Constant) and node.value in models.SUPPORTED and id(node) not in own
  ]


def test_no_model_type_string_in_shared_code():
  found = [
    hit
    for path in sorted((ROOT / "attnjax" / "models").glob("*.py"))
    for hit in _model_type_strings(path)
  ]
  assert not found, found
  # Each registered class names its model type once.
  tree = ast.parse((ROOT / "attnjax" / "_src" / "models" / "architectures.py").read_text())
  named = [
    node.value.value
    for node in ast.walk(tree)
    if isinstance(node, ast.Assign)
    and isinstance(node.value, ast.Constant)
    and [getattr(t, "id", None) for t in node.targets] == ["model_type"]
  ]
  assert sorted(named) == sorted(models.SUPPORTED)


@pytest.mark.parametrize(
  "doc,detail", [("README.md", "summary"), ("docs/guides/models.md", "maps_to")]
)
def test_documentation_tables_are_the_registrys(doc, detail):
  text = (ROOT / doc).read_text()
  table = architectures.architecture_table(detail)
  assert table in text, (
    f"{doc}: its model_type table is not the registry's "
    f"(architecture_table({detail!r})); paste it:\n{table}"
  )
  assert text.count("| `model_type` |") == 1, doc


def test_an_architecture_is_one_registered_class(tmp_path):
  # A stand-in model type: Llama's hooks under another name, registered in one place.
  @architectures.register
  class StandIn(architectures.Llama):
    model_type = "llama_stand_in"
    summary = maps_to = "as llama"

  try:
    path = _copy_fixture(tmp_path)
    _edit_config(path, model_type="llama_stand_in")
    model = models.from_pretrained(str(path), dtype="float32")
    e = _expected("llama")
    logits = np.asarray(model(jnp.asarray(e["tokens"])))
    np.testing.assert_allclose(
      logits, e["logits"], atol=LOGIT_TOL * float(np.abs(e["logits"]).max()), rtol=0
    )
    assert "| `llama_stand_in` | as llama |" in architectures.architecture_table("summary")
    with pytest.raises(ValueError, match="llama_stand_in.*already registered"):
      architectures.register(StandIn)
  finally:
    del architectures.ARCHITECTURES["llama_stand_in"]
  with pytest.raises(TypeError, match="must set summary"):
    architectures.register(type("Bare", (architectures.LlamaStyle,), {"model_type": "bare"}))
  assert tuple(models.ARCHITECTURES) == models.SUPPORTED


# ---------------------------------------------------------------------------
# The ModelConfig fields the architectures use.


def test_model_config_round_trips_and_old_dicts_load():
  with open(os.path.join(FIXTURES, "gpt_oss", "config.json")) as f:
    config = json.load(f)
  mcfg = architectures.architecture(config).build(config)
  back = nn.ModelConfig.from_dict(json.loads(json.dumps(mcfg.to_dict())))
  assert back == mcfg
  old = nn.ModelConfig().to_dict()
  for name in (
    "norm_placement",
    "mlp_activation",
    "mlp_bias",
    "num_experts",
    "experts_per_token",
    "moe_alpha",
    "moe_limit",
    "learned_positions",
    "embed_scale",
    "final_softcap",
  ):
    old.pop(name)
  for name in ("qkv_bias", "out_bias", "rope_scaling"):
    old["attention"].pop(name)
  assert nn.ModelConfig.from_dict(old) == nn.ModelConfig()


@pytest.mark.parametrize(
  "changes,error,match",
  [
    (dict(norm="gemma"), ValueError, "norm"),
    (dict(norm_placement="middle"), ValueError, "norm_placement"),
    (dict(mlp="swiglu", mlp_activation="gelu_exact"), ValueError, "mlp_activation"),
    (dict(mlp="moe", num_experts=2, experts_per_token=3), ValueError, "experts_per_token"),
    (dict(num_experts=4), ValueError, "num_experts"),
    (dict(final_softcap=-1.0), ValueError, "final_softcap"),
    (dict(learned_positions=0), ValueError, "learned_positions"),
  ],
)
def test_model_config_rejects_bad_fields_by_name(changes, error, match):
  with pytest.raises(error, match=match):
    nn.ModelConfig(**changes)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(rope_scaling={"type": "ntk"}), "rope_scaling"),
    (dict(rope_scaling={"type": "linear"}), "factor"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=None), "rope_theta"),
    (
      dict(family="qk_norm", qk_norm_scope="projection", qk_norm_placement="after_rope"),
      "qk_norm_scope",
    ),
  ],
)
def test_attention_config_rejects_bad_new_fields_by_name(kwargs, match):
  with pytest.raises((TypeError, ValueError), match=match):
    nn.AttentionConfig(**kwargs)


# ---------------------------------------------------------------------------
# mesh=


def test_mesh_places_each_parameter_by_the_logical_rules():
  if jax.device_count() < 8:
    pytest.skip("needs 8 host devices (the suite's conftest sets them)")
  auto = jax.sharding.AxisType.Auto
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(auto, auto))
  path = os.path.join(FIXTURES, "gpt_oss")
  sharded = models.from_pretrained(path, mesh=mesh)
  blk = sharded.blocks[0]
  P = jax.sharding.PartitionSpec
  expected = {
    "q_proj": (blk.attention.q_proj.kernel, P(None, "model")),  # embed, heads
    "o_proj": (blk.attention.o_proj.kernel, P("model", None)),  # heads, embed
    "k_proj": (blk.attention.k_proj.kernel, P(None, "model")),
    "gate": (blk.mlp.gate, P(None, None, "model")),  # experts, embed, mlp
    "down": (blk.mlp.down, P(None, "model", None)),
    "embed": (sharded.embed.embedding, P("model", None)),  # vocab, embed
    "head": (sharded.head.kernel, P(None, "model")),
    "sinks": (blk.attention.sink_logits, P("model")),
  }
  for what, (variable, spec) in expected.items():
    value = variable[...]
    assert value.sharding.spec == spec, (what, value.sharding.spec)
    shard = value.addressable_shards[0].data.shape
    assert np.prod(shard) * 4 == np.prod(value.shape) or spec == P(), (what, shard)
  e = _expected("gpt_oss")
  plain = _load("gpt_oss")
  tokens = jnp.asarray(e["tokens"])
  logits, want = np.asarray(_forward(sharded, tokens)), np.asarray(_forward(plain, tokens))
  # The same float32 sums in another order: sharding splits the contractions (and another
  # CPU's vector width reorders them again). Each layer passes about 12 reductions in
  # sequence (2 norms, q/k/v, scores, softmax, weighted values, o_proj, router, the
  # experts' gate/up and down, their sum), then the final norm and the head; none is
  # longer than the widest of the model's dimensions and the sequence.
  with open(os.path.join(path, "config.json")) as f:
    c = json.load(f)
  length = max(
    c["hidden_size"],
    c["intermediate_size"],
    c["num_attention_heads"] * c["head_dim"],
    tokens.shape[1],
  )
  tol = reduction_tolerance(
    jnp.float32, length, depth=12 * c["num_hidden_layers"] + 2, scale=float(np.abs(want).max())
  )
  err = float(np.abs(logits - want).max())
  assert err <= tol, f"sharded logits differ by {err:.3g} > {tol:.3g}"


def test_logical_rules_follow_the_mesh_axes():
  devices = np.array(jax.devices()[:1]).reshape(1, 1)
  assert (
    models.logical_rules(jax.sharding.Mesh(devices, ("data", "model"))) == nn.LOGICAL_AXIS_RULES
  )
  rules = dict(models.logical_rules(jax.sharding.Mesh(devices, ("fsdp", "tensor"))))
  assert rules == {"embed": "fsdp", "heads": "tensor", "mlp": "tensor", "vocab": "tensor"}


# ---------------------------------------------------------------------------
# Live against transformers, where torch and transformers happen to be installed.


def test_live_random_llama_against_transformers(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config = transformers.LlamaConfig(
    vocab_size=64,
    hidden_size=24,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=1,
    tie_word_embeddings=False,
  )
  torch.manual_seed(0)
  hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
  with torch.no_grad():
    for p in hf.parameters():
      p.normal_(0.0, 0.3)
  hf.save_pretrained(tmp_path)
  tokens = np.random.default_rng(0).integers(0, 64, (2, 16))
  with torch.no_grad():
    expected = hf(torch.from_numpy(tokens)).logits.numpy()
  ours = _forward(
    models.from_pretrained(str(tmp_path), dtype="float32"), jnp.asarray(tokens, jnp.int32)
  )
  assert np.abs(np.asarray(ours) - expected).max() <= LOGIT_TOL * np.abs(expected).max()


def test_tokenizer_reads_tokenizer_json_when_tokenizers_is_installed(tmp_path):
  try:
    import tokenizers  # noqa: F401
  except ImportError:
    with pytest.raises(ImportError, match="tokenizers"):
      models.tokenizer(os.path.join(FIXTURES, "llama"))
    return
  tok = models.tokenizer(os.path.join(FIXTURES, "llama"))
  assert tok.encode("hi!").ids == [ord("h") - 31, ord("i") - 31, ord("!") - 31]
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    models.tokenizer(str(tmp_path))


def test_import_attnjax_does_not_load_flax_or_models():
  import subprocess
  import sys

  code = (
    "import sys, attnjax; assert 'flax' not in sys.modules; "
    "assert 'attnjax._src.models' not in sys.modules; "
    "m = attnjax.models; assert m.from_pretrained and 'flax' in sys.modules"
  )
  subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


# ---------------------------------------------------------------------------
# experiments/pretrained.py


def _experiment():
  import importlib.util

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location(
    "pretrained_experiment", os.path.join(root, "experiments", "pretrained.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module, os.path.join(root, "experiments", "configs", "pretrained.py")


def test_experiment_statistics_equal_transformers_and_write_the_run(tmp_path):
  # The fixture's two sequences as one token file: the experiment's windows are exactly them.
  experiment, config = _experiment()
  e = _expected("gpt_oss")
  ids = np.concatenate([e["tokens"][0], e["tokens"][1], [7]]).astype(np.int64)
  np.save(tmp_path / "tokens.npy", ids)
  out = tmp_path / "run"
  experiment.main(
    [
      "--model",
      os.path.join(FIXTURES, "gpt_oss"),
      "--text",
      str(tmp_path / "tokens.npy"),
      "--config",
      config + ":preset=cpu",
      "--config.seq_len=24",
      "--config.num_sequences=2",
      "--config.add_bos=False",
      "--config.dtype=float32",
      "--config.loss_chunk=5",
      "--out",
      str(out),
    ]
  )
  results = json.loads((out / "results.json").read_text())
  assert results["tokens"] == 24 and results["sequences"] == 2
  np.testing.assert_allclose(
    results["first_token_weight"], e["sink_mass"].mean(axis=1), atol=SINK_TOL, rtol=0
  )
  null = np.asarray(results["null_mass"])  # gpt-oss's sink logits take part of every row
  assert null.shape == (2, 4) and np.all(null > 0) and np.all(null < 1)
  targets = np.stack([ids[1:25], ids[25:49]])
  logits = e["logits"].astype(np.float64)
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  nll = lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
  assert results["nll"] == pytest.approx(nll.mean(), rel=1e-5)
  T = 24
  alpha = (1 + (T - 1) * e["sink_mass"]) / T  # [L, B, N]
  np.testing.assert_allclose(results["alpha_1"], alpha.mean(axis=1), atol=SINK_TOL)
  for i, eps in enumerate(results["sink_eps"]):
    assert results["sink_curve"][i] == pytest.approx(100 * np.mean(alpha > eps))
  L, K = 2, 2
  assert np.shape(results["value_drain"]) == (L, K) and np.all(np.isfinite(results["value_drain"]))
  assert len(results["hidden_max_abs"]) == L and results["m_act"] > 0
  report = (out / "report.md").read_text()
  assert "Sink_1^eps" in report and "perplexity" in report
  for plot in ("sink_curve", "first_token", "value_drain", "activations"):
    assert (out / "plots" / f"{plot}.png").stat().st_size > 0
  config_json = json.loads((out / "config.json").read_text())
  assert config_json["model_type"] == "gpt_oss"
  assert nn.ModelConfig.from_dict(config_json["model_config"]).attention.sink_logits


def test_experiment_reads_text_through_the_tokenizer_or_says_what_is_missing(tmp_path):
  experiment, config = _experiment()
  (tmp_path / "text.txt").write_text("To be, or not to be: that is the question. " * 4)
  argv = [
    "--model",
    os.path.join(FIXTURES, "llama"),
    "--text",
    str(tmp_path / "text.txt"),
    "--config",
    config + ":preset=cpu",
    "--config.seq_len=32",
    "--out",
    str(tmp_path / "run"),
  ]
  try:
    import tokenizers  # noqa: F401
  except ImportError:
    with pytest.raises(SystemExit, match=r"tokenizers.*attnjax\[pretrained\]"):
      experiment.main(argv)
    return
  experiment.main(argv)
  results = json.loads((tmp_path / "run" / "results.json").read_text())
  assert results["tokens"] == 32 and np.isfinite(results["perplexity"])


def test_experiment_without_tokenizer_json_ends_in_one_line_naming_the_file(tmp_path):
  """Text on a checkpoint without tokenizer.json: a message naming the file and the fixes."""
  experiment, config = _experiment()
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  for name in ("config.json", "model.safetensors"):
    (ckpt / name).symlink_to(os.path.join(FIXTURES, "llama", name))
  (tmp_path / "text.txt").write_text("some text")
  with pytest.raises(SystemExit) as info:
    experiment.main(
      [
        "--model",
        str(ckpt),
        "--text",
        str(tmp_path / "text.txt"),
        "--config",
        config + ":preset=cpu",
        "--out",
        str(tmp_path / "run"),
      ]
    )
  message = str(info.value.code)
  assert message.startswith("pretrained.py: error: ") and "\n" not in message
  assert str(ckpt / "tokenizer.json") in message and ".npy" in message
  with pytest.raises(SystemExit, match="does not exist"):  # a missing --text: one line too
    experiment.main(["--model", str(ckpt), "--text", str(tmp_path / "none.txt")])


def test_experiment_default_config_is_found_from_any_directory(tmp_path, monkeypatch):
  from attnjax._src.train.config import load_config

  experiment, config = _experiment()
  monkeypatch.chdir(tmp_path)
  cfg, _ = experiment.parse(["--model", "m", "--text", "t.npy"])
  assert cfg.seq_len == load_config(config + ":preset=cpu", [], check=False).seq_len
  assert os.path.isabs(experiment.DEFAULT_CONFIG.rpartition(":")[0])


def test_experiment_heatmaps_scale_to_the_data():
  """A model without sinks (first-token weights near 1/T) is not drawn all black."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  experiment, _ = _experiment()
  fig, ax = plt.subplots()
  im = experiment.heatmap(fig, ax, np.array([[0.02, 0.05], [0.01, 0.03]]), "first-token weight")
  assert im.get_clim() == (0, 0.05)
  assert "max 0.05" in fig.axes[-1].get_ylabel()
  plt.close(fig)


def test_experiment_token_files_and_sequences(tmp_path):
  experiment, config = _experiment()
  from attnjax._src.train.config import load_config

  cfg = load_config(config + ":preset=cpu", ["seq_len=8", "num_sequences=3"], check=False)
  ckpt = models.Checkpoint(os.path.join(FIXTURES, "llama"))
  ids = np.arange(20, dtype=np.uint16) + 3
  ids.tofile(tmp_path / "tokens.bin")
  cfg.text = str(tmp_path / "tokens.bin")
  np.testing.assert_array_equal(experiment.read_tokens(cfg, ckpt), ids)
  inputs, targets = experiment.sequences(ids.astype(np.int64), cfg, bos=1)
  # Chunks of 8 text tokens, each predicted once: from BOS and the chunk's first 7.
  np.testing.assert_array_equal(targets, [np.arange(3, 11), np.arange(11, 19)])
  np.testing.assert_array_equal(inputs, [[1, *range(3, 10)], [1, *range(11, 18)]])
  cfg.add_bos = False
  inputs, targets = experiment.sequences(ids.astype(np.int64), cfg, bos=1)
  np.testing.assert_array_equal(inputs, [np.arange(3, 11), np.arange(11, 19)])
  np.testing.assert_array_equal(targets, [np.arange(4, 12), np.arange(12, 20)])
  np.save(tmp_path / "bad.npy", np.array([0, 500]))
  cfg.text = str(tmp_path / "bad.npy")
  with pytest.raises(ValueError, match="vocabulary of 128"):
    experiment.read_tokens(cfg, ckpt)


def test_a_truncated_safetensors_file_is_named(tmp_path):
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  (ckpt / "config.json").symlink_to(os.path.join(FIXTURES, "llama", "config.json"))
  data = open(os.path.join(FIXTURES, "llama", "model.safetensors"), "rb").read()
  (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])  # an interrupted download
  path = str(ckpt / "model.safetensors")
  with pytest.raises(models.CheckpointError, match=rf"{path} is truncated: its header lists"):
    models.from_pretrained(str(ckpt))


def test_past_the_context_length_one_warning_names_both():
  experiment, _ = _experiment()
  with pytest.warns(UserWarning, match=r"T=2048 .*max_position_embeddings=128\).*seq_len=128"):
    assert experiment.warn_past_context(2048, {"max_position_embeddings": 128})
  with pytest.warns(UserWarning, match=r"n_positions=1024"):  # GPT-2's name for it
    assert experiment.warn_past_context(2048, {"n_positions": 1024})
  assert not experiment.warn_past_context(128, {"max_position_embeddings": 128})
  assert not experiment.warn_past_context(128, {})


@pytest.mark.slow
def test_experiment_warns_once_past_the_context_length(tmp_path):
  """T=80 on the llama fixture (max_position_embeddings 64): one warning, naming both."""
  experiment, config = _experiment()
  np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 128, 200))
  argv = [
    "--model",
    os.path.join(FIXTURES, "llama"),
    "--text",
    str(tmp_path / "tokens.npy"),
    "--config",
    config + ":preset=cpu",
    "--config.seq_len=80",
    "--config.num_sequences=2",
    "--out",
    str(tmp_path / "run"),
  ]
  with pytest.warns(UserWarning) as record:
    experiment.main(argv)
  past = [str(w.message) for w in record if "context length" in str(w.message)]
  assert len(past) == 1, past
  assert "T=80" in past[0] and "max_position_embeddings=64" in past[0]
