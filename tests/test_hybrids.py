"""Hybrid checkpoints (Qwen3-Next, Qwen3.5, Kimi Linear): mixed caches, the VLM wrapper,
layer-type targeting and bad input.

Logits and full-layer sink mass against transformers: tests/test_models.py (one fixture per
model type); these fixtures are tiny random checkpoints with T = 80 > the delta rule's chunk
of 64, Hv = 2 Hk value heads, Dk != Dv, mlp_only_layers and an MTP tensor
(tests/fixtures/make_pretrained_fixtures.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnjax import models, nn
from attnjax.models import Checkpoint, CheckpointError

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "pretrained")
HYBRIDS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "kimi_linear")


def _expected(name):
  with np.load(os.path.join(FIXTURES, name, "expected.npz")) as z:
    return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def qwen3_next():
  return models.from_pretrained(os.path.join(FIXTURES, "qwen3_next"), dtype="float32")


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


def test_layers_map_to_their_families(qwen3_next):
  families = [b.attention.config.family for b in qwen3_next.blocks]
  assert families == ["gated_deltanet"] * 3 + ["qk_norm"]
  linear = qwen3_next.blocks[0].attention.config
  assert (linear.num_heads, linear.kv_heads, linear.head_dim, linear.value_dim) == (4, 2, 8, 12)
  assert linear.value_grouping and linear.short_conv == 4 and linear.rope_theta is None
  full = qwen3_next.blocks[3].attention.config
  assert full.output_gate == "elementwise" and full.rope_dim == 4  # 0.25 of head_dim 16
  cfg = qwen3_next.config
  assert cfg.moe_dense_layers == (1,) and cfg.moe_shared_gate and cfg.norm == "rms_plus_one"


def test_checkpoints_carry_the_mtp_tensors_the_loader_skips():
  ckpt = Checkpoint(os.path.join(FIXTURES, "qwen3_next"))
  assert any(n.startswith("mtp.") for n in ckpt.names())


@pytest.mark.parametrize("name", ["qwen3_next", "kimi_linear"])
def test_greedy_tokens_through_mixed_caches_equal_transformers(name):
  # Recurrent state caches (with conv tails) on the linear layers, KV caches (Qwen) or
  # latent caches (Kimi's MLA) on the full layers.
  e = _expected(name)
  model = models.from_pretrained(os.path.join(FIXTURES, name), dtype="float32")
  caches = model.init_cache(2, 8)
  kinds = {type(c).__name__ for c in caches}
  assert kinds == {"GatedCache", "KVCache"}, kinds
  tokens = nn.generate(model, jnp.asarray(e["prompt"]), num_tokens=32)
  np.testing.assert_array_equal(np.asarray(tokens), e["generated"])


def test_qwen3_5_vlm_loads_its_text_model_and_says_so(caplog):
  with caplog.at_level(logging.INFO, logger="attnjax.models"):
    model = models.from_pretrained(os.path.join(FIXTURES, "qwen3_5"), dtype="float32")
  notes = [r.getMessage() for r in caplog.records if r.name == "attnjax.models"]
  assert len(notes) == 1 and "text model alone" in notes[0], notes
  assert any(
    n.startswith("model.visual.") for n in Checkpoint(os.path.join(FIXTURES, "qwen3_5")).names()
  )
  e = _expected("qwen3_5")
  logits = np.asarray(_forward(model, jnp.asarray(e["tokens"])))
  assert np.abs(logits - e["logits"]).max() <= 1e-4 * np.abs(e["logits"]).max()


def test_attention_targets_layer_types(qwen3_next):
  path = os.path.join(FIXTURES, "qwen3_next")
  e = _expected("qwen3_next")
  tokens = jnp.asarray(e["tokens"])
  # The linear layers' engine: the recurrence instead of the chunk form, same logits.
  recurrent = models.from_pretrained(
    path, dtype="float32", attention={"linear_attention": {"implementation": "recurrent"}}
  )
  assert [b.attention.config.implementation for b in recurrent.blocks] == ["recurrent"] * 3 + [None]
  # float32 rounding of two orders of summation, amplified by four layers of large random
  # weights: the suite's logit tolerance (1e-4 of the logits' scale).
  scale = float(np.abs(e["logits"]).max())
  np.testing.assert_allclose(
    np.asarray(_forward(recurrent, tokens)),
    np.asarray(_forward(qwen3_next, tokens)),
    atol=1e-4 * scale,
    rtol=0,
  )
  # Sink logits on the full layers: a new parameter (warned), only there.
  with pytest.warns(UserWarning, match="sink_logits"):
    sinks = models.from_pretrained(
      path, dtype="float32", attention={"full_attention": {"sink_logits": True}}
    )
  assert [b.attention.config.sink_logits for b in sinks.blocks] == [False] * 3 + [True]
  # What each swap changes, read from the streaming statistics: sink logits (initialised
  # to 0) take part of every full-layer row (null mass), nowhere else.
  base = nn.layer_stats(qwen3_next, tokens, view="streaming")["layers"]
  with_sinks = nn.layer_stats(sinks, tokens, view="streaming")["layers"]
  assert np.all(np.asarray(with_sinks[3]["row_sum"]) < 1 - 1e-3)
  np.testing.assert_allclose(base[3]["row_sum"], 1.0, atol=1e-5)
  for l in range(3):
    np.testing.assert_array_equal(with_sinks[l]["row_sum"], base[l]["row_sum"])
  # The gate off: its q_proj half goes unused (warned) and the logits change.
  with pytest.warns(UserWarning, match="gate_proj"):
    ungated = models.from_pretrained(
      path, dtype="float32", attention={"full_attention": {"output_gate": None}}
    )
  assert ungated.blocks[3].attention.gate_proj is None
  assert np.abs(np.asarray(_forward(ungated, tokens)) - e["logits"]).max() > 1e-2
  # The gate acts after the weights: the full layer (the last) attends as before, with the
  # first-token mass of transformers' output_attentions, and reports no gate.
  plain = nn.layer_stats(ungated, tokens, view="streaming")["layers"][3]
  assert "gate_mean" not in plain and "first_token_gated" not in plain
  np.testing.assert_allclose(plain["sink_mass"], e["sink_mass"][0], atol=1e-5, rtol=0)
  np.testing.assert_allclose(plain["sink_mass"], base[3]["sink_mass"], atol=1e-6, rtol=0)


def test_kimi_layer_types_are_its_own_and_take_targeted_options():
  # Kimi Linear builds on DeepSeek V3 (every layer full); its KDA layers are linear_attention.
  path = os.path.join(FIXTURES, "kimi_linear")
  types = models.ARCHITECTURES["kimi_linear"].layer_types(Checkpoint(path).config)
  assert types == ["linear_attention", "full_attention"] * 2
  model = models.from_pretrained(
    path,
    attention={
      "linear_attention": {"implementation": "recurrent"},
      "full_attention": {"implementation": "blockwise"},
    },
  )
  assert [b.attention.config.implementation for b in model.blocks] == ["recurrent", "blockwise"] * 2


def _copy(tmp_path, name, edit):
  out = tmp_path / name
  shutil.copytree(os.path.join(FIXTURES, name), out)
  with open(out / "config.json") as f:
    config = json.load(f)
  edit(config)
  with open(out / "config.json", "w") as f:
    json.dump(config, f)
  return str(out)


@pytest.mark.parametrize(
  "name, edit, match",
  [
    (
      "qwen3_next",
      lambda c: c["layer_types"].__setitem__(0, "mamba"),
      r"layer_types entry 'mamba' is not a layer type",
    ),
    (
      "qwen3_next",
      lambda c: c.__setitem__("linear_conv_kernel_dim", 3),
      r"linear_attn\.conv1d\.weight' has shape \(80, 1, 4\), the config implies \(80, 1, 3\)",
    ),
    (
      "qwen3_5_text",
      lambda c: c.__setitem__("linear_num_value_heads", 3),
      r"linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2",
    ),
    (
      "kimi_linear",
      lambda c: c.__setitem__("linear_conv_kernel_dim", 2),
      r"q_conv1d\.weight' has shape \(32, 1, 4\), the config implies \(32, 1, 2\)",
    ),
  ],
)
def test_bad_checkpoints_name_the_tensor_or_key_before_reading(
  tmp_path, monkeypatch, name, edit, match
):
  path = _copy(tmp_path, name, edit)
  read = []
  monkeypatch.setattr(Checkpoint, "read", lambda self, n: read.append(n))
  with pytest.raises(CheckpointError, match=match):
    models.from_pretrained(path, dtype="float32")
  assert read == []  # nothing half-loaded: no weight was read


# ---------------------------------------------------------------------------
# Analysis: experiments/pretrained.py's report on a hybrid.


def _experiment():
  import importlib.util

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location(
    "pretrained_experiment", os.path.join(root, "experiments", "pretrained.py")
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module, os.path.join(root, "experiments", "configs", "pretrained.py")


def test_sink_report_covers_gates_and_recurrent_state(tmp_path):
  """The report on Qwen3-Next: the full layer's first-token mass equals transformers'
  output_attentions (stored in the fixture), before the gate and times it; the linear layers'
  decay and beta means and the state norm over time, whose last value is the norm of the
  state a prefill leaves in the recurrent cache."""
  experiment, config = _experiment()
  e = _expected("qwen3_next")
  T = e["tokens"].shape[1]
  ids = np.concatenate([e["tokens"][0], e["tokens"][1], [7]]).astype(np.int64)
  np.save(tmp_path / "tokens.npy", ids)
  out = tmp_path / "run"
  argv = ["--model", os.path.join(FIXTURES, "qwen3_next"), "--text", str(tmp_path / "tokens.npy")]
  argv += ["--config", config + ":preset=cpu", f"--config.seq_len={T}"]
  argv += ["--config.num_sequences=2", "--config.add_bos=False", "--config.dtype=float32"]
  experiment.main(argv + ["--out", str(out)])
  results = json.loads((out / "results.json").read_text())
  # The default block-wise engine goes to the full layers only (a hybrid's linear layers
  # keep their chunked default).
  assert results["attention"] == {"full_attention": {"implementation": "blockwise"}}
  full = [int(f) for f in e["full_layers"]]
  assert results["sink_layers"] == full == [3]
  tol = 1e-5  # float32 softmax weights of T = 80 keys, means of ~80 of them
  np.testing.assert_allclose(
    results["first_token_weight"][3], e["sink_mass"][0].mean(axis=0), atol=tol, rtol=0
  )
  assert results["alpha_1"][0] is None and results["null_mass"][0] is None
  gate = results["gate"][3]
  assert [results["gate"][l] for l in (0, 1, 2)] == [None] * 3
  before, after = np.asarray(gate["first_token_mass"]), np.asarray(gate["first_token_gated"])
  np.testing.assert_allclose(before, e["first_key_weight"][0].mean(axis=0), atol=tol, rtol=0)
  # The sigmoid gate only scales: what passes lies between 0 and the mass before it.
  assert np.all(after > 0) and np.all(after < before)
  assert np.all((np.asarray(gate["gate_mean"]) > 0) & (np.asarray(gate["gate_mean"]) < 1))
  np.testing.assert_allclose(gate["passed"], after / before, rtol=1e-6)
  assert results["recurrence"][3] is None
  model = models.from_pretrained(os.path.join(FIXTURES, "qwen3_next"), dtype="float32")
  tokens = jnp.asarray(e["tokens"])
  _, caches = nn.decode_step(model, tokens, model.init_cache(2, T))
  for l in (0, 1, 2):
    rec = results["recurrence"][l]
    for key in ("decay_mean", "beta_mean"):
      assert np.shape(rec[key]) == (4,) and all(0 < x < 1 for x in rec[key]), (l, key)
    assert len(rec["state_norm"]) == T and np.all(np.isfinite(rec["state_norm"]))
    state = np.asarray(caches[l].state, np.float64)  # [B, N, Dk, Dv]
    final = np.sqrt((state**2).sum(axis=(2, 3))).mean()
    np.testing.assert_allclose(rec["state_norm"][-1], final, rtol=1e-4)
  report = (out / "report.md").read_text()
  assert "## Output gates" in report and "## Recurrent layers" in report
