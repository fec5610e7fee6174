"""DeepSeek V2 / V3 through ``from_pretrained``: MLA, both routers, FP8 blocks, the MTP layer.

The fixtures (tests/fixtures/make_pretrained_fixtures.py) are randomised past transformers'
defaults; logits at T=24 (and sink mass) are checked with every model type in
tests/test_models.py. Here: a 48-token sequence (past YaRN's 16 original positions), greedy
generation through the latent caches, an FP8 checkpoint made from the V3 fixture, the
``attention=`` swaps, and the errors.
"""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from attnjax import models, nn
from attnjax._src.models import architectures
from attnjax._src.models.checkpoint import CheckpointError

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "pretrained")
NAMES = ("deepseek_v3", "deepseek_v2")
LOGIT_TOL = 1e-4  # of the logits' scale, as tests/test_models.py


def _expected(name):
  with np.load(os.path.join(FIXTURES, name, "expected.npz")) as z:
    return {k: z[k] for k in z.files}


@pytest.mark.parametrize("name", NAMES)
def test_long_sequence_logits_equal_transformers(name):
  e = _expected(name)
  model = models.from_pretrained(os.path.join(FIXTURES, name))
  got = np.asarray(model(jnp.asarray(e["long_tokens"])))
  scale = float(np.abs(e["long_logits"]).max())
  assert float(np.abs(got - e["long_logits"]).max()) <= LOGIT_TOL * scale


@pytest.mark.parametrize("name", NAMES)
def test_greedy_32_tokens_through_the_latent_cache_equal_transformers(name):
  e = _expected(name)
  model = models.from_pretrained(os.path.join(FIXTURES, name))
  cache = model.init_cache(1, 8)
  layer = cache[0]
  assert layer.k.shape == (1, 8, 1, model.config.attention.qk_rope_head_dim)
  assert layer.v.shape == (1, 8, 1, model.config.attention.kv_lora_rank)
  tokens = nn.generate(model, jnp.asarray(e["prompt"]), num_tokens=32)
  np.testing.assert_array_equal(np.asarray(tokens), e["generated"])


@pytest.mark.slow  # ~13 s: test_mla_nn's latent caches decode in the default
def test_absorbed_decode_equals_the_expanded_forward_on_v3():
  e = _expected("deepseek_v3")
  model = models.from_pretrained(os.path.join(FIXTURES, "deepseek_v3"))
  tokens = jnp.asarray(e["tokens"])
  full = model(tokens)
  cache = model.init_cache(2, tokens.shape[1])
  outs = []
  for t in range(tokens.shape[1]):
    logits, cache = model.decode(tokens[:, t : t + 1], cache)
    outs.append(logits)
  assert float(jnp.max(jnp.abs(jnp.concatenate(outs, 1) - full))) <= 1e-4 * float(
    jnp.max(jnp.abs(full))
  )


def _fp8_copy(tmp_path, block=(128, 128), bad_scale=False):
  """The V3 fixture with every projection and expert weight stored as FP8 e4m3 blocks and
  their ``weight_scale_inv``, as DeepSeek ships V3 (router, norms, embeddings, head kept)."""
  src = os.path.join(FIXTURES, "deepseek_v3")
  out = tmp_path / "v3_fp8"
  shutil.copytree(src, out)
  tensors = load_file(str(out / "model.safetensors"))
  for name in list(tensors):
    w = tensors[name]
    if not name.endswith(("_proj.weight", "_mqa.weight")) and ".experts." not in name:
      continue
    if "layers.3." in name or w.ndim != 2:
      continue
    rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
    padded = np.zeros((rows * block[0], cols * block[1]), np.float32)
    padded[: w.shape[0], : w.shape[1]] = w
    blocks = padded.reshape(rows, block[0], cols, block[1])
    scale = np.abs(blocks).max(axis=(1, 3)) / 448.0
    q = blocks / scale[:, None, :, None]
    tensors[name] = q.reshape(padded.shape)[: w.shape[0], : w.shape[1]].astype(
      ml_dtypes.float8_e4m3fn
    )
    tensors[name + "_scale_inv"] = scale[:, :1] if bad_scale else scale.astype(np.float32)
  save_file(
    {
      k: (v.view(np.uint8) if v.dtype == ml_dtypes.float8_e4m3fn else v) for k, v in tensors.items()
    },
    str(out / "model.safetensors"),
  )
  # safetensors.numpy cannot write float8: patch the header's dtype of those tensors.
  _retag_fp8(
    out / "model.safetensors", [k for k, v in tensors.items() if v.dtype == ml_dtypes.float8_e4m3fn]
  )
  config = json.loads((out / "config.json").read_text())
  config["quantization_config"] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(block),
  }
  (out / "config.json").write_text(json.dumps(config))
  return out


def _retag_fp8(path, names):
  """Rewrites the file's header with ``names`` as ``F8_E4M3`` (written as uint8 bytes)."""
  import struct

  raw = open(path, "rb").read()
  (size,) = struct.unpack("<Q", raw[:8])
  header = json.loads(raw[8 : 8 + size])
  for n in names:
    header[n]["dtype"] = "F8_E4M3"
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-len(text) % 8)
  open(path, "wb").write(struct.pack("<Q", len(text)) + text + raw[8 + size :])


def test_fp8_block_checkpoint_loads_within_the_quantisation_error(tmp_path):
  """FP8 e4m3 keeps 3 mantissa bits: every dequantised weight is within 2^-4 of its block's
  largest magnitude of the original (a misread scale or block is off by orders of magnitude).
  The logits are not compared: errors of that size flip the fixture's routing, whose margins
  are 1e-3."""
  path = _fp8_copy(tmp_path, block=(16, 16))
  fp8 = models.from_pretrained(str(path), dtype="float32")
  plain = models.from_pretrained(os.path.join(FIXTURES, "deepseek_v3"))
  got, want = _leaves(fp8), _leaves(plain)
  changed = 0
  for key, w in want.items():
    err = float(np.max(np.abs(got[key] - w)))
    assert err <= 2.0**-4 * float(np.max(np.abs(w))), (key, err)
    changed += err > 0
  assert changed >= 3 * 6  # the projections and experts of every layer were quantised
  assert np.all(np.isfinite(np.asarray(fp8(jnp.asarray(_expected("deepseek_v3")["tokens"])))))


def _leaves(model):
  import jax
  from flax import nnx

  return {
    jax.tree_util.keystr(p): np.asarray(x)
    for p, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model)))
  }


def test_fp8_scales_of_the_wrong_block_shape_are_named(tmp_path):
  path = _fp8_copy(tmp_path, block=(16, 16), bad_scale=True)
  with pytest.raises(CheckpointError, match=r"weight_scale_inv' has shape \(\d+, 1\)"):
    models.from_pretrained(str(path))


def test_dequantize_fp8_blocks_by_hand():
  w = np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.float8_e4m3fn)
  s = np.array([[2.0, 10.0]], np.float32)
  got = architectures.dequantize_fp8_blocks(w, s, (2, 2))
  np.testing.assert_array_equal(got, [[0, 2, 20], [6, 8, 50]])
  with pytest.raises(CheckpointError, match=r"does not tile a weight of shape \(2, 3\)"):
    architectures.dequantize_fp8_blocks(w, s[:, :1], (2, 2))


def test_kv_b_proj_shape_against_the_config_is_named(tmp_path):
  out = tmp_path / "v2"
  shutil.copytree(os.path.join(FIXTURES, "deepseek_v2"), out)
  config = json.loads((out / "config.json").read_text())
  config["v_head_dim"] = 12
  (out / "config.json").write_text(json.dumps(config))
  with pytest.raises(CheckpointError, match=r"kv_b_proj.weight' has shape \(64, 16\), the config"):
    models.from_pretrained(str(out))


@pytest.mark.parametrize(
  "key,value,match",
  [
    ("kv_lora_rank", 0, "kv_lora_rank must be a positive int"),
    ("qk_rope_head_dim", 0, "qk_rope_head_dim must be a positive int"),
    ("qk_nope_head_dim", -1, "qk_nope_head_dim must be a positive int"),
    ("qk_rope_head_dim", 3, "qk_rope_head_dim=3 must be even"),
  ],
)
def test_bad_latent_dims_in_the_config_are_named(tmp_path, key, value, match):
  out = tmp_path / "v3"
  shutil.copytree(os.path.join(FIXTURES, "deepseek_v3"), out)
  config = json.loads((out / "config.json").read_text())
  config[key] = value
  (out / "config.json").write_text(json.dumps(config))
  with pytest.raises(CheckpointError, match=match):
    models.from_pretrained(str(out))


def test_mtp_layer_is_skipped_and_attention_swaps_apply():
  path = os.path.join(FIXTURES, "deepseek_v3")
  with pytest.warns(UserWarning, match="sink_logits"):
    model = models.from_pretrained(
      path, attention={"sink_logits": True, "output_gate": "headwise", "normalizer": "softmax"}
    )
  assert len(model.blocks) == 3  # layers.3 (MTP) is in the file, not in the model
  assert model.config.attention.family == "mla" and model.config.attention.sink_logits
  logits = model(jnp.asarray(_expected("deepseek_v3")["tokens"]))
  assert np.all(np.isfinite(np.asarray(logits)))
  sig = models.from_pretrained(path, attention={"normalizer": "sigmoid"})
  stats = nn.layer_stats(sig, jnp.asarray(_expected("deepseek_v3")["tokens"]), view="sown")
  assert stats["layers"][0]["sink_mass"].shape == (2, 4)


def test_mla_layer_config_errors_name_the_field():
  with pytest.raises(ValueError, match="kv_lora_rank must be a positive int, got kv_lora_rank=0"):
    nn.AttentionConfig(family="mla", kv_lora_rank=0)
  with pytest.raises(ValueError, match="qk_rope_head_dim=5 must be even for RoPE"):
    nn.AttentionConfig(family="mla", qk_rope_head_dim=5)
  nn.AttentionConfig(family="mla", qk_rope_head_dim=5, rope_theta=None)  # Kimi: no RoPE
  with pytest.raises(ValueError, match="num_kv_heads=2: family='mla' has one latent"):
    nn.AttentionConfig(family="mla", num_heads=4, num_kv_heads=2)
  with pytest.raises(ValueError, match="kv_bias=True: family='mla'"):
    nn.AttentionConfig(family="mla", kv_bias=True)
