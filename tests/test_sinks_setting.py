"""The cpu_sinks setting: its config, one tiny arm end to end, and its new statistics."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnjax._src import stats
from attnjax._src.nn import layer_stats
from attnjax._src.stats.capture import SINK_CURVE_EPS, ProbeCapture
from attnjax._src.train.config import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU_SINKS = str(ROOT / "experiments/configs/sinks.py") + ":preset=cpu_sinks"


def _sinks_module():
  spec = importlib.util.spec_from_file_location("experiments_sinks", ROOT / "experiments/sinks.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_cpu_sinks_config_and_arms(tmp_path):
  cfg = load_config(CPU_SINKS)
  assert (cfg.model.num_layers, cfg.model.num_heads, cfg.model.mlp) == (1, 1, "none")
  assert cfg.data.name == "bigram_backcopy" and cfg.data.bb_num_triggers == 8
  arms = _sinks_module().build_arms(cfg, str(tmp_path))
  names = list(dict.fromkeys(a.group.split("/")[1] for a in arms))  # the arms, in order
  assert names[:3] == ["dense", "softmax_one", "sink_logits"]
  assert {"relu", "gla", "deltanet", "nsa", "dsa", "dense_lr0.01", "dense_lr0.1"} <= set(names)
  # Dense at seeds 0, 1 and 2 (one group: trained stacked), every other arm at seed 0.
  dense = [a.config for a in arms if a.group == "bigram_backcopy/dense"]
  assert [c.seed for c in dense] == [0, 1, 2] and {c.variant for c in dense} == {"dense"}
  assert dense[2].run_dir == str(tmp_path / "bigram_backcopy" / "dense" / "seed=2")
  assert len(arms) == len(names) + 2
  lr01 = [a.config for a in arms if a.group == "bigram_backcopy/dense_lr0.1"]
  assert [c.opt.lr for c in lr01] == [pytest.approx(0.1)] and lr01[0].variant == "dense"
  # The fast preset keeps its arms (the tests and the documented 5 minutes use it).
  cpu = load_config(str(ROOT / "experiments/configs/sinks.py") + ":preset=cpu")
  assert len(_sinks_module().build_arms(cpu, str(tmp_path))) == 22
  assert cpu.model.mlp == "gelu" and cpu.model.num_layers == 2


@pytest.mark.slow  # ~16 s of compiles; the preset's config is checked by the default tests
def test_cpu_sinks_tiny_arm_runs(tmp_path, monkeypatch):
  """One dense arm of the preset for a few steps: probes, attention maps, the sink sections.

  Trained into a relative folder (as compare's runs/compare/<variant>) and mapped from another
  working directory (a notebook's): the maps restore the run where it is, not where its
  config's run_dir pointed when it trained (notebook 04 once saw no checkpoint at all)."""
  from attnjax._src.train import sweep

  monkeypatch.chdir(tmp_path)

  module = _sinks_module()
  cfg = load_config(
    CPU_SINKS,
    [
      "sweep.variants=dense",
      "sweep.dense_seeds=",
      "sweep.dense_lrs=",
      "train.steps=4",
      "train.probe_every=2",
      "train.checkpoint_every=2",
      "train.eval_every=4",
      "train.eval_batches=1",
      "train.probe_batch=4",
      "train.probe_len=16",
      "data.batch_size=4",
      "train.microbatches=1",
      "train.num_devices=1",
      "train.progress=false",
      "train.plots=false",
    ],
  )
  (arm,) = module.build_arms(cfg, "runs")
  assert sweep.run_in_process(arm)["status"] == "finished"
  assert not pathlib.Path(arm.config.run_dir).is_absolute()
  run = str(tmp_path / arm.config.run_dir)
  (tmp_path / "notebooks").mkdir()
  monkeypatch.chdir(tmp_path / "notebooks")
  with np.load(module.save_attention_maps(run)) as z:
    assert z["weights"].shape == (1, 1, 16, 16)
    np.testing.assert_allclose(z["weights"].sum(-1), 1.0, rtol=1e-4)
    assert z["bos_nontrigger"].shape == z["f_attn_raw"].shape == (1, 1) and int(z["step"]) == 4
  root = str(tmp_path / "runs" / "bigram_backcopy")
  md = module.sink_sections(root, [run], str(tmp_path / "plots"))
  assert "Sink_1^eps against eps" in md and "| dense/seed=0 | [" in md and "## Checks" in md
  assert (tmp_path / "plots" / "attention_maps.png").is_file()


CPU_LONG = str(ROOT / "experiments/configs/sinks.py") + ":preset=cpu_long"


def test_cpu_long_config_shards_a_16k_sequence(tmp_path):
  from attnjax._src.train.config import validate

  cfg = load_config(CPU_LONG)
  assert cfg.data.seq_len == 16384 and cfg.mesh.context == 8 and cfg.mesh.data == 1
  arms = _sinks_module().build_arms(cfg, str(tmp_path))  # validates each arm on 8 devices
  assert [a.group.split("/")[1] for a in arms] == ["dense", "sink_logits", "gla"]
  with pytest.raises(
    ValueError,
    match=r"context=8 = 8 devices, but the run has 1 \(a CPU host "
    r"makes 8 devices with XLA_FLAGS=",
  ):
    validate(cfg, num_devices=1)


@pytest.mark.slow  # ~1 minute: two steps at T = 16384 over the 8 host devices
def test_cpu_long_arm_runs_sequence_sharded(tmp_path):
  from attnjax._src.train import sweep

  cfg = load_config(
    CPU_LONG,
    [
      "sweep.variants=dense",
      "train.steps=2",
      "train.probe_every=2",
      "train.checkpoint_every=2",
      "train.eval_every=2",
      "train.progress=false",
      "train.plots=false",
    ],
  )
  (arm,) = _sinks_module().build_arms(cfg, str(tmp_path))
  summary = sweep.run_in_process(arm)
  assert summary["status"] == "finished" and summary["devices"] == 8
  assert np.isfinite(summary["val_loss"]) and summary["probe"]["step"] == 2


def test_model_without_mlp():
  from flax import nnx

  from attnjax._src import nn

  cfg = nn.ModelConfig(
    vocab_size=11, d_model=16, num_layers=1, mlp="none", attention=nn.AttentionConfig(num_heads=2)
  )
  model = nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
  assert model.blocks[0].mlp is None
  logits = model(jnp.zeros((2, 5), jnp.int32))
  assert logits.shape == (2, 5, 11) and bool(jnp.all(jnp.isfinite(logits)))
  with_mlp = nn.TransformerLM(
    nn.ModelConfig(
      vocab_size=11, d_model=16, num_layers=1, attention=nn.AttentionConfig(num_heads=2)
    ),
    rngs=nnx.Rngs(0),
  )
  count = lambda m: sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param)))
  block = with_mlp.blocks[0]
  assert count(with_mlp) - count(model) == count(block.mlp) + count(block.mlp_norm)


def test_value_state_drain_closed_form():
  v = np.ones((2, 3, 5, 2, 4), np.float32)
  v[0, :, 0, 1] = 0.25  # layer 0, kv head 1: BOS value a quarter of the others
  v[1, :, 1:, 0] = 2.0  # layer 1, kv head 0: the others twice BOS
  r = stats.value_state_drain(jnp.asarray(v))
  np.testing.assert_allclose(r.per_head, [[1.0, 0.25], [0.5, 1.0]], rtol=1e-6)
  np.testing.assert_allclose(r.per_layer, [0.625, 0.75], rtol=1e-6)
  one = stats.value_state_drain(jnp.asarray(v[0]))  # one layer: L = 1
  np.testing.assert_allclose(one.per_head, [[1.0, 0.25]], rtol=1e-6)
  with pytest.raises(ValueError, match="S >= 2"):
    stats.value_state_drain(jnp.ones((2, 1, 2, 4)))


def test_probe_sink_curve_and_value_drain():
  """sink_curve/* thresholds the per-sequence alpha_1; value_drain/* is the drain of v."""
  T = 6
  w = np.zeros((1, 2, 1, T, T), np.float32)
  for i in range(T):  # sequence 0 parks every query on key 1; sequence 1 attends to itself
    w[0, 0, 0, i, 0] = 1.0
    w[0, 1, 0, i, i] = 1.0
  v = np.ones((1, 2, T, 1, 3), np.float32)
  v[:, :, 0] = 0.0
  q = k = jnp.ones((1, 2, T, 1, 3))
  out = layer_stats(ProbeCapture(weights=jnp.asarray(w), q=q, k=k, v=jnp.asarray(v)))
  # alpha_1 = 1 for sequence 0 and 1 / T for sequence 1.
  expected = [50.0 * (1.0 > e) + 50.0 * (1.0 / T > e) for e in SINK_CURVE_EPS]
  np.testing.assert_allclose(out["sink_curve/rate"], expected)
  assert out["sink_curve/per_layer"].shape == (len(SINK_CURVE_EPS), 1)
  np.testing.assert_allclose(out["value_drain/per_head"], [[0.0]])


def test_small_null_masses_keep_their_significant_digits():
  """softmax_one's null mass (0.001-0.002) reads as such in the report, not as 0.00."""
  from attnjax._src.train.report import significant

  assert [significant(x) for x in (0.0015, 0.25, 0.0, 1.234e-5)] == [
    "0.0015",
    "0.25",
    "0",
    "1.2e-05",
  ]
  assert significant(None) == "-" and significant(float("nan")) == "-"
  sinks = _sinks_module()
  last = {
    "dense": {"f_attn/f_attn": 0.8},
    "softmax_one": {"f_attn/f_attn": 0.3, "null_mass/mean": 0.0017},
  }
  lines = sinks._checks(["dense", "softmax_one"], last, {"softmax_one": {"f_attn_raw": [0.25]}})
  assert "null column takes 0.0017 of each row" in lines
  assert "softmax_one: first-token weight 0.25 vs dense 0.80 (<= half: pass)" in lines


@pytest.mark.slow  # ~30 s of compiles
def test_nsa_arm_reports_its_branches(tmp_path):
  """A tiny NSA arm: its branches' first-key weights and gates by trigger, and their table."""
  from attnjax._src.train import sweep

  module = _sinks_module()
  overrides = [
    "sweep.variants=nsa",
    "sweep.dense_seeds=",
    "sweep.dense_lrs=",
    "train.steps=2",
    "train.probe_every=2",
    "train.checkpoint_every=2",
    "train.eval_every=2",
    "train.eval_batches=1",
    "train.probe_batch=4",
    "train.probe_len=32",
    "data.batch_size=4",
    "train.microbatches=1",
    "train.num_devices=1",
    "train.progress=false",
    "train.plots=false",
  ]
  (arm,) = module.build_arms(load_config(CPU_SINKS, overrides), str(tmp_path))
  assert sweep.run_in_process(arm)["status"] == "finished"
  run = arm.config.run_dir
  with np.load(module.save_branch_stats(run)) as z:
    for key in ("first_nontrigger", "first_trigger", "gate_nontrigger", "gate_trigger"):
      assert z[key].shape == (1, 1, 3) and np.all((z[key] >= 0) & (z[key] <= 1)), key
  md = module.branch_section(str(tmp_path / "bigram_backcopy"), [run])
  assert "NSA's branches" in md and "| compressed |" in md and "| window |" in md
