"""Encoders (attnjax.nn.EncoderLM) and their checkpoints: bert, roberta, modernbert.

The fixtures are tiny random checkpoints transformers 5.25 wrote
(tests/fixtures/make_encoder_fixtures.py), every LayerNorm gain and bias randomised, with
transformers' eager float32 outputs of a padded batch: the last hidden state, MLM logits (or
BertModel's pooled output) and every layer's attention weights.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnjax._src import models, nn
from helpers import reduction_tolerance

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "pretrained")
ENCODERS = ("bert", "bert_model", "roberta", "modernbert")


def _expected(name: str) -> dict:
  with np.load(os.path.join(FIXTURES, name, "expected.npz")) as z:
    return {k: z[k] for k in z.files}


_CACHE: dict = {}


def _load(name: str, **kwargs):
  key = (name, json.dumps(kwargs, sort_keys=True, default=str))
  if key not in _CACHE:
    _CACHE[key] = models.from_pretrained(os.path.join(FIXTURES, name), dtype="float32", **kwargs)
  return _CACHE[key]


@pytest.fixture(scope="module", autouse=True)
def _drop_models():
  yield
  _CACHE.clear()


def _inputs(name: str, e: dict) -> dict:
  out = {"attention_mask": jnp.asarray(e["attention_mask"])}
  if name.startswith("bert"):
    out["token_type_ids"] = jnp.asarray(e["token_type_ids"])
  return out


def _tolerance(model, scale: float) -> float:
  # float32 through L blocks, each a reduction over D (projections) and the MLP width.
  c = model.config
  return reduction_tolerance(
    jnp.float32, max(c.d_model, c.hidden_dim), depth=2 * c.num_layers + 2, scale=scale
  )


@pytest.mark.parametrize("name", ENCODERS)
def test_hidden_states_logits_and_weights_equal_transformers(name):
  e = _expected(name)
  model = _load(name)
  assert isinstance(model, nn.EncoderLM)
  tokens, inputs = jnp.asarray(e["padded_tokens"]), _inputs(name, e)
  stats = nn.layer_stats(model, tokens, view="sown", weights=True, hidden=True, **inputs)
  hidden = np.asarray(model.features(tokens, **inputs))
  # Padding queries' outputs are not used (transformers gives a padding query whose local
  # window holds no token uniform weights, attnjax zeros): compared at the tokens.
  valid = e["attention_mask"].astype(bool)
  scale = float(np.abs(e["hidden"]).max())
  np.testing.assert_allclose(
    hidden[valid], e["hidden"][valid], atol=_tolerance(model, scale), rtol=0
  )
  if "pooled" in e:
    pooled = model.pooled(jnp.asarray(hidden))
    np.testing.assert_allclose(pooled, e["pooled"], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="no MLM head"):
      model.output_logits(jnp.asarray(hidden))
  else:
    scale = float(np.abs(e["padded_logits"]).max())
    np.testing.assert_allclose(
      np.asarray(stats["logits"])[valid],
      e["padded_logits"][valid],
      atol=_tolerance(model, scale),
      rtol=0,
    )
  # The sink report's weights (sown, eager) are transformers' output_attentions.
  weights = np.stack([np.asarray(layer["weights"]) for layer in stats["layers"]])
  assert weights.shape == e["attentions"].shape  # [L, B, N, T, S]
  rows = np.broadcast_to(valid[None, :, None, :, None], weights.shape)
  np.testing.assert_allclose(weights[rows], e["attentions"][rows], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["bert", "roberta", "modernbert"])
def test_padded_rows_equal_the_unpadded_rows(name):
  e = _expected(name)
  model = _load(name)
  tokens, inputs = jnp.asarray(e["padded_tokens"]), _inputs(name, e)
  padded = np.asarray(model(tokens, **inputs))
  n = int(e["attention_mask"][1].sum())
  alone = {k: v[1:, :n] for k, v in inputs.items() if k != "attention_mask"}
  row = np.asarray(model(tokens[1:, :n], **alone))
  scale = float(np.abs(row).max())
  np.testing.assert_allclose(padded[1, :n], row[0], atol=_tolerance(model, scale), rtol=0)


def test_roberta_positions_skip_padding():
  model = _load("roberta")
  tokens = jnp.array([[0, 5, 6, 2, 1, 1], [0, 7, 1, 8, 2, 1]])
  np.testing.assert_array_equal(
    model.roberta_positions(tokens), [[2, 3, 4, 5, 1, 1], [2, 3, 1, 4, 5, 1]]
  )


def test_modernbert_alternates_global_and_symmetric_local_layers():
  model = _load("modernbert")
  windows = [b.attention.config.window for b in model.blocks]
  assert windows == [None, 3, 3, None]
  thetas = [b.attention.config.rope_theta for b in model.blocks]
  assert thetas == [160000.0, 10000.0, 10000.0, 160000.0]
  assert model.blocks[0].attn_norm is None and model.blocks[1].attn_norm is not None
  allowed = model.blocks[1].attention.allowed_mask(8)[0, 0]
  i, j = np.meshgrid(np.arange(8), np.arange(8), indexing="ij")
  np.testing.assert_array_equal(allowed, np.abs(i - j) <= 3)


@pytest.mark.parametrize("name", ["bert", "modernbert"])
def test_attention_swaps_apply_to_encoders(name):
  e = _expected(name)
  base = np.asarray(_load(name)(jnp.asarray(e["tokens"])))
  blockwise = np.asarray(
    _load(name, attention={"implementation": "blockwise"})(jnp.asarray(e["tokens"]))
  )
  scale = float(np.abs(base).max())
  np.testing.assert_allclose(blockwise, base, atol=_tolerance(_load(name), scale), rtol=0)
  with pytest.warns(UserWarning, match="initial values"):
    gated = models.from_pretrained(
      os.path.join(FIXTURES, name), dtype="float32", attention={"output_gate": "headwise"}
    )
  assert gated.blocks[0].attention.gate_proj is not None


def test_tokenizer_json_through_tokenizers():
  pytest.importorskip("tokenizers")
  tok = models.tokenizer(os.path.join(FIXTURES, "bert"))
  enc = tok.encode("The cat sat on the mat.")
  assert enc.tokens[0] == "[CLS]" and enc.tokens[-1] == "[SEP]" and "." in enc.tokens
  roberta = models.tokenizer(os.path.join(FIXTURES, "roberta"))
  ids = roberta.encode("the dog, the door.").ids
  assert ids[0] == roberta.token_to_id("<s>") and ids[-1] == roberta.token_to_id("</s>")


def _copy(tmp_path, name):
  path = tmp_path / name
  shutil.copytree(os.path.join(FIXTURES, name), path)
  return path


def _edit(path, **changes):
  config = json.loads((path / "config.json").read_text())
  config.update(changes)
  (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
  "name,head,supported",
  [
    ("bert", "BertForSequenceClassification", "BertModel, BertForMaskedLM"),
    ("roberta", "RobertaForCausalLM", "RobertaModel, RobertaForMaskedLM"),
    ("modernbert", "ModernBertForTokenClassification", "ModernBertModel, ModernBertForMaskedLM"),
  ],
)
def test_unsupported_heads_are_named_with_the_supported_ones(tmp_path, name, head, supported):
  path = _copy(tmp_path, name)
  _edit(path, architectures=[head])
  with pytest.raises(models.CheckpointError, match=f"{head}.*supported heads: {supported}"):
    models.from_pretrained(str(path))


def test_encoder_config_errors_name_the_value():
  with pytest.raises(ValueError, match="is_causal=True"):
    nn.EncoderConfig(attention=nn.AttentionConfig(is_causal=True))
  with pytest.raises(ValueError, match="position_offset=2 needs pad_token_id"):
    nn.EncoderConfig(position_offset=2, learned_positions=8)
  with pytest.raises(TypeError, match="config must be an EncoderConfig"):
    nn.EncoderLM(nn.ModelConfig(), rngs=nnx.Rngs(0))


def test_token_type_ids_and_attention_mask_shapes_are_checked():
  cfg = nn.EncoderConfig(
    vocab_size=32,
    d_model=16,
    num_layers=1,
    attention=nn.AttentionConfig(num_heads=2, is_causal=False),
  )
  model = nn.EncoderLM(cfg, rngs=nnx.Rngs(0))
  tokens = jnp.zeros((2, 5), jnp.int32)
  with pytest.raises(ValueError, match=r"token_type_ids must be int \[B, T\] = \(2, 5\).*\(2, 4\)"):
    model(tokens, token_type_ids=jnp.zeros((2, 4), jnp.int32))
  with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 6\)"):
    model(tokens, attention_mask=jnp.ones((2, 6), jnp.int32))
  with pytest.raises(ValueError, match="no decode"):
    model.init_cache(2, 8)
  no_types = nn.EncoderLM(cfg.replace(token_types=None), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="no token-type embeddings"):
    no_types(tokens, token_type_ids=tokens)


@pytest.mark.parametrize(
  "family,options",
  [
    ("dense", {"normalizer": "sigmoid"}),
    ("dense", {"normalizer": "softpick"}),
    ("qk_norm", {}),
    ("cosine", {}),
    ("sparse", {"pattern": ("sliding_window", (("left", 2), ("right", 2)))}),
  ],
)
def test_every_masking_family_pads_like_an_unpadded_row(family, options):
  attn = nn.AttentionConfig(family, num_heads=2, is_causal=False, **options)
  cfg = nn.EncoderConfig(vocab_size=32, d_model=16, num_layers=2, attention=attn)
  model = nn.EncoderLM(cfg, rngs=nnx.Rngs(1))
  tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 32)
  mask = jnp.array([[1] * 8, [1] * 5 + [0] * 3])
  padded = np.asarray(model(tokens, attention_mask=mask))
  row = np.asarray(model(tokens[1:, :5]))
  np.testing.assert_allclose(padded[1, :5], row[0], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_the_sinks_report_of_an_encoder(tmp_path):
  # experiments/pretrained.py on an encoder: mass on [CLS], [SEP] and delimiters per layer
  # and head, the mean over queries of the sown weights (equal to transformers' above).
  import importlib.util

  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location(
    "pretrained_experiment", os.path.join(repo, "experiments", "pretrained.py")
  )
  experiment = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(experiment)
  ids = np.random.default_rng(0).integers(5, 100, size=40)
  np.save(tmp_path / "ids.npy", ids)
  path = os.path.join(FIXTURES, "bert")
  markdown = experiment.main(
    [
      "--model",
      path,
      "--text",
      str(tmp_path / "ids.npy"),
      "--config.seq_len=12",
      "--out",
      str(tmp_path / "out"),
    ]
  )
  results = json.load(open(tmp_path / "out" / "results.json"))
  special = results["special_ids"]
  tokens = np.concatenate([[special["cls"]], ids[:10], [special["sep"]]])[None]
  sown = nn.layer_stats(_load("bert"), jnp.asarray(tokens), view="sown", weights=True)
  w = np.stack([np.asarray(layer["weights"])[0] for layer in sown["layers"]])  # [L, N, T, S]
  is_sep = tokens[0] == special["sep"]
  np.testing.assert_allclose(results["cls_mass"], w[..., 0].mean(-1), atol=1e-6)
  np.testing.assert_allclose(results["sep_mass"], w[..., is_sep].sum(-1).mean(-1), atol=1e-6)
  assert "on delimiters per head" in markdown and "W8A8" in markdown
