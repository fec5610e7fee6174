"""attnjax.nn.layer_stats, the one entry point for statistics per layer, and its deprecated aliases.

Each view is checked against the others on one tiny model (two layers: dense, and a gated
softmax_one layer), and each old entry point must warn once per process, naming
``layer_stats``, and return exactly what the matching view returns. The old entry points
named *probe* (a word now kept for the training loop's periodic statistics) are gone: each
raises an error naming what replaces it.
"""

import inspect
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnjax._src import deprecation as _deprecation

from attnjax import nn, stats
from attnjax._src.deprecation import RemovedError
from attnjax._src.models import perplexity
from attnjax._src.nn import statistics, transformer

B, T, V = 2, 12, 32


@pytest.fixture(scope="module")
def model_and_tokens():
  layers = (
    nn.AttentionConfig(num_heads=4, num_kv_heads=2),
    nn.AttentionConfig(
      num_heads=4, num_kv_heads=2, normalizer="softmax_one", output_gate="headwise"
    ),
  )
  cfg = nn.ModelConfig(vocab_size=V, d_model=16, num_layers=2, layer_attention=layers)
  model = nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
  return model, jax.random.randint(jax.random.key(1), (B, T), 0, V)


def assert_same(a, b):
  """Bit for bit: the same tree, every leaf equal (NaN where NaN)."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_views_agree_with_each_other(model_and_tokens):
  model, tokens = model_and_tokens
  summary = nn.layer_stats(model, tokens)
  sown = nn.layer_stats(model, tokens, view="sown")
  streaming = nn.layer_stats(model, tokens, view="streaming")
  capture = nn.layer_stats(model, tokens, view="capture")
  assert isinstance(capture, stats.LayerCapture) and capture.weights.shape == (2, B, 4, T, T)
  # The summary is the capture's statistics plus the batch loss. One program against two:
  # float32 reductions over T keys in another order differ by a few ulp at most.
  from_capture = nn.layer_stats(capture)
  assert set(summary) == set(from_capture) | {"loss"}
  for key, value in from_capture.items():
    np.testing.assert_allclose(summary[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
  logp = jax.nn.log_softmax(sown["logits"][:, :-1], axis=-1)
  loss = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
  np.testing.assert_allclose(summary["loss"], loss, rtol=1e-6)
  # The same sown AttentionStats in all four views.
  fields = ("sink_mass", "entropy", "max_logit", "row_sum")
  for l in range(2):
    for f in fields:
      per_head = sown["layers"][l][f]  # [B, N]
      np.testing.assert_allclose(streaming["layers"][l][f], per_head, rtol=1e-6, atol=1e-7)
      np.testing.assert_allclose(
        getattr(capture.attention_stats, f)[l], per_head, rtol=1e-6, atol=1e-7
      )
    np.testing.assert_allclose(
      summary["f_attn/per_head"][l], jnp.mean(sown["layers"][l]["sink_mass"], axis=0), rtol=1e-5
    )
    np.testing.assert_allclose(
      streaming["layers"][l]["value_drain"],
      stats.value_state_drain(capture.v[l]).per_head,
      rtol=1e-6,
    )
    np.testing.assert_allclose(
      streaming["layers"][l]["hidden_max_abs"],
      jnp.max(jnp.abs(capture.hidden[l]), axis=(1, 2)),
      rtol=1e-6,
    )
  # The streaming view's features give the model's logits.
  np.testing.assert_allclose(
    model.output_logits(streaming["features"]), sown["logits"], rtol=1e-5, atol=1e-5
  )
  assert float(summary["null_mass/per_layer"][1]) > 0 == float(summary["null_mass/per_layer"][0])


def test_without_jit_the_same_pass(model_and_tokens):
  model, tokens = model_and_tokens
  for view in ("summary", "streaming"):
    jitted = nn.layer_stats(model, tokens, view=view)
    eager = nn.layer_stats(model, tokens, view=view, jit=False)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6), jitted, eager)


def test_length_and_bad_input_name_the_argument(model_and_tokens):
  model, tokens = model_and_tokens
  short = nn.layer_stats(model, tokens, view="sown", length=5)
  assert short["logits"].shape == (B, 5, V)
  with pytest.raises(ValueError, match="view='heads' is not one of"):
    nn.layer_stats(model, tokens, view="heads")
  with pytest.raises(ValueError, match="never materialises"):
    nn.layer_stats(model, tokens, view="streaming", weights=True)
  with pytest.raises(ValueError, match="hidden=True is for view='sown'"):
    nn.layer_stats(model, tokens, hidden=True)
  with pytest.raises(ValueError, match=r"tokens must be integer \[B, T\], got shape"):
    nn.layer_stats(model, jnp.zeros((B, T)))
  with pytest.raises(ValueError, match="tokens must be integer"):
    nn.layer_stats(model)
  with pytest.raises(ValueError, match="2 token"):
    nn.layer_stats(model, tokens[:, :1])
  with pytest.raises(ValueError, match=f"T={T} < length=64"):
    nn.layer_stats(model, tokens, length=64)
  with pytest.raises(ValueError, match="eps"):
    nn.layer_stats(model, tokens, eps=1.5)
  with pytest.raises(ValueError, match="eps=0.2: options of view='summary', got view='sown'"):
    nn.layer_stats(model, tokens, view="sown", eps=0.2)
  with pytest.raises(TypeError, match="TransformerLM"):
    nn.layer_stats(object(), tokens)


def _warns_once(name: str, call):
  """Calls ``call`` twice after forgetting ``name``'s warning; returns the first result."""
  _deprecation._warned.discard(name)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = call()
    second = call()
  messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
  assert len(messages) == 1, (name, messages)
  assert messages[0].startswith(f"{name} is deprecated; use ") and "nn.layer_stats(" in messages[0]
  assert caught[0].filename == __file__  # points at the caller
  assert_same(first, second)
  return first


def test_each_old_entry_point_warns_once_and_returns_the_view(model_and_tokens):
  model, tokens = model_and_tokens
  new = lambda **kw: nn.layer_stats(model, tokens, **kw)
  assert_same(
    _warns_once(
      "attnjax.nn.collect_stats", lambda: nn.collect_stats(model, tokens, weights=True, hidden=True)
    ),
    new(view="sown", weights=True, hidden=True),
  )
  assert nn.collect_stats is transformer.collect_stats
  assert_same(
    _warns_once(
      "attnjax.nn.probe.capture_from_model",
      lambda: statistics.capture_from_model(model, tokens, weights=False),
    ),
    new(view="capture", weights=False, jit=False),
  )
  features, layers = _warns_once(
    "attnjax.models.probe.layer_statistics", lambda: perplexity.layer_statistics(model, tokens)
  )
  assert_same({"features": features, "layers": layers}, new(view="streaming"))
  # Through the old modules: the same objects.
  import attnjax.models.probe as old_models_probe
  import attnjax.nn.probe as old_nn_probe

  assert old_nn_probe.capture_from_model is statistics.capture_from_model
  assert old_models_probe.layer_statistics is perplexity.layer_statistics


@pytest.mark.parametrize(
  "module, name, new",
  [
    ("attnjax.nn.probe", "probe", "attnjax.nn.layer_stats(model, tokens, length=64)"),
    ("attnjax.stats", "probe_statistics", "attnjax.nn.layer_stats(capture)"),
    ("attnjax.stats", "probe", "attnjax.nn.layer_stats"),
    (
      "attnjax.train.probe",
      "run_probe",
      "attnjax.stats.to_jsonable(attnjax.nn.layer_stats(model, inputs))",
    ),
  ],
)
def test_the_old_probe_entry_points_are_gone_with_an_error_naming_the_new_one(module, name, new):
  import importlib

  public = importlib.import_module(module)
  with pytest.raises(RemovedError, match="'probe' names the training loop|runs its probes") as e:
    getattr(public, name)
  assert new in str(e.value) and isinstance(e.value, ImportError)
  with pytest.raises(ImportError, match=re.escape(f"use {new}")):
    exec(f"from {module} import {name}", {})  # the message survives a from-import


# The arguments the old entry points took (``*`` marks keyword-only ones): each still takes them.
OLD_SIGNATURES = {
  statistics.capture_from_model: "model tokens *weights=True",
  nn.collect_stats: "model tokens *weights=False *hidden=False *jit=True",
  perplexity.layer_statistics: "model tokens",
}


def test_the_summary_defaults_are_the_signature_defaults():
  defaults = {k: p.default for k, p in inspect.signature(nn.layer_stats).parameters.items()}
  for name, value in statistics._SUMMARY_DEFAULTS:
    assert defaults[name] == value, name


def arguments(fn) -> str:
  out = []
  for p in inspect.signature(fn).parameters.values():
    star = "*" if p.kind is p.KEYWORD_ONLY else ""
    default = "" if p.default is p.empty else "=" + getattr(p.default, "__name__", repr(p.default))
    out.append(f"{star}{p.name}{default}")
  return " ".join(out)


@pytest.mark.parametrize("fn", list(OLD_SIGNATURES), ids=lambda f: f.__name__)
def test_old_signatures_are_kept(fn):
  assert arguments(fn) == OLD_SIGNATURES[fn]


def test_gated_layers_report_the_first_tokens_mass_before_and_after_the_gate(model_and_tokens):
  """A gated layer's first_token_mass is its weights' key-0 column averaged over queries
  i >= 1 (softmax_one: rows below one); what passes the gate is positive and smaller."""
  model, tokens = model_and_tokens
  sown = nn.layer_stats(model, tokens, view="sown", weights=True)
  plain, gated = sown["layers"]
  assert "first_token_mass" not in plain and "gate_mean" not in plain
  w = np.asarray(gated["weights"], np.float64)  # [B, N, T, S]
  np.testing.assert_allclose(gated["first_token_mass"], w[:, :, 1:, 0].mean(-1), atol=1e-6)
  before, after = np.asarray(gated["first_token_mass"]), np.asarray(gated["first_token_gated"])
  assert np.all(after > 0) and np.all(after < before)
