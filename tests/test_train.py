"""attnjax.train: resume bit for bit, divergence, data parallelism, configs, optimizer, sweeps, report."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnjax._src.train import config as config_lib
from attnjax._src.train import optim, report, rundir, sweep
from attnjax._src.train.loop import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPARE = os.path.join(REPO, "experiments", "configs", "compare.py")
WALL_CLOCK = ("tokens_per_s",)


# Runs of one tiny config compile the same programs: conftest's compilation_cache reuses them.
pytestmark = pytest.mark.usefixtures("compilation_cache")


def tiny(run_dir, *, data="bigram_backcopy", **changes):
  """A config that compiles and trains in seconds."""
  c = config_lib.base_config()
  c.run_dir = str(run_dir)
  c.data.update(dict(name=data, seq_len=16, batch_size=8, bb_vocab_size=16))
  c.model.update(dict(d_model=16, num_layers=1, num_heads=2, mlp_ratio=2))
  c.train.update(
    dict(
      steps=12,
      log_every=4,
      eval_every=6,
      eval_batches=1,
      probe_every=6,
      probe_batch=8,
      probe_len=16,
      checkpoint_every=4,
      progress=False,
      plots=False,
    )
  )
  c.opt.lr = 1e-2
  for key, value in changes.items():
    config_lib.apply_overrides(c, [f"{key}={value}"])
  return c


def lines(path, drop=WALL_CLOCK):
  return [{k: v for k, v in r.items() if k not in drop} for r in rundir.read_jsonl(path)]


def test_stopped_run_resumes_bit_for_bit(tmp_path):
  full = train(tiny(tmp_path / "full"))
  assert full["status"] == "finished" and full["steps_done"] == 12

  cut = tiny(tmp_path / "cut", **{"train.stop_after": 10})
  stopped = train(cut)
  assert stopped["status"] == "stopped" and stopped["steps_done"] == 10
  run = rundir.RunDir(cut.run_dir)
  assert max(r["step"] for r in rundir.read_jsonl(run.metrics)) == 9  # past checkpoint 8
  cut.train.stop_after = 0
  resumed = train(cut)
  assert resumed["status"] == "finished" and resumed["resumed_from"] == 8

  a, b = lines(rundir.RunDir(full["run_dir"]).metrics), lines(run.metrics)
  assert [r["step"] for r in a] == [r["step"] for r in b]
  assert a == b  # every loss, grad norm, per-layer stat: identical, not just close
  assert lines(rundir.RunDir(full["run_dir"]).probes) == lines(run.probes)
  assert [f for f in os.listdir(run.root) if ".tmp" in f] == []


def test_absurd_lr_diverges_cleanly_and_the_sweep_goes_on_then_report(tmp_path):
  base = tiny(tmp_path, **{"train.plots": True})
  arms = [
    sweep.arm(base, "boom", str(tmp_path / "boom"), **{"opt.lr": 1e3}),
    sweep.arm(base, "ok", str(tmp_path / "ok")),
  ]
  results = sweep.run_sweep(arms, verbose=False)
  boom, ok = results
  assert boom["status"] == "diverged" and isinstance(boom["diverged_step"], int)
  assert boom["val_loss"] is None and ok["status"] == "finished"
  assert ok["val_loss"] < ok["initial_loss"]
  with open(tmp_path / "boom" / "summary.json") as f:
    assert json.load(f)["status"] == "diverged"  # strict JSON: no NaN tokens
  recorded = lines(tmp_path / "boom" / "metrics.jsonl")
  steps = [r["step"] for r in recorded if r["kind"] == "train"]
  assert boom["diverged_step"] <= max(steps) < boom["diverged_step"] + 10  # patience 10

  again = sweep.run_sweep(arms, verbose=False)  # resumable: both arms are skipped
  assert [r["status"] for r in again] == ["diverged", "finished"]

  markdown = report.write_report(str(tmp_path), title="tiny")
  assert "| variant | LR | initial loss | val loss |" in markdown
  assert "yes (step" in markdown and "| no |" in markdown
  for name in ("loss.png", "max_logit.png", "f_attn.png"):
    assert os.path.getsize(tmp_path / "plots" / name) > 1000
  assert os.path.isfile(tmp_path / "report.md")
  assert "| Sink_1^0.3 (%) |" in markdown

  # The same two arms are an LR sweep of one variant: sensitivity, max stable LR, plots.
  markdown = report.write_lr_sweep_report(str(tmp_path))
  (summary,) = json.load(open(tmp_path / "lr_sensitivity.json"))
  assert summary["max_stable_lr"] == pytest.approx(1e-2) and summary["diverged_lrs"] == [1e3]
  assert summary["lr_sensitivity"] == pytest.approx(
    0.5 * (ok["initial_loss"] - ok["val_loss"]), rel=1e-6
  )
  assert "| dense | 2 |" in markdown
  assert os.path.getsize(tmp_path / "plots" / "loss_vs_lr.png") > 1000


def test_eight_devices_match_one_device(tmp_path):
  assert jax.device_count() == 8
  curves = []
  for n in (1, 0):
    summary = train(
      tiny(
        tmp_path / f"dev{n}",
        data="shakespeare",
        **{
          "train.num_devices": n,
          "train.steps": 8,
          "train.eval_every": 8,
          "train.probe_every": 8,
          "train.checkpoint_every": 0,
        },
      )
    )
    assert summary["devices"] == (1 if n else 8)
    curves.append(
      [r["loss"] for r in lines(tmp_path / f"dev{n}" / "metrics.jsonl") if r["kind"] == "train"]
    )
  np.testing.assert_allclose(curves[0], curves[1], rtol=1e-5)
  assert curves[0][-1] < curves[0][0]


@pytest.mark.parametrize(
  "spec,overrides,error,match",
  [
    (f"{COMPARE}:preset=cpu", ["opt.lrr=1"], KeyError, r"opt.lrr.*did you mean 'opt.lr'"),
    (
      f"{COMPARE}:preset=cpu",
      ["model.num_heads=3"],
      ValueError,
      "model.d_model=64 is not divisible",
    ),
    (f"{COMPARE}:preset=cpu", ["train.steps=many"], ValueError, "train.steps"),
    (
      f"{COMPARE}:preset=cpu",
      ["data.name=text", "data.path=/no/such/file"],
      ValueError,
      "data.path",
    ),
    (f"{COMPARE}:preset=cpu", ["variant=softmaxx"], ValueError, "variant='softmaxx'"),
    (f"{COMPARE}:preset=laptop", [], ValueError, "preset='laptop'"),
    (f"{COMPARE}:presets=cpu", [], ValueError, "'presets' is unknown"),
    ("experiments/configs/missing.py", [], FileNotFoundError, "missing.py"),
  ],
  ids=[
    "unknown-key",
    "heads-not-dividing",
    "bad-int",
    "missing-file",
    "unknown-variant",
    "unknown-preset",
    "unknown-arg",
    "missing-config",
  ],
)
def test_bad_configs_fail_before_training_naming_the_key(spec, overrides, error, match):
  with pytest.raises(error, match=match):
    config_lib.load_config(spec, overrides)


def test_config_arg_and_overrides_parse_to_the_right_types():
  cfg = config_lib.load_config(
    f"{COMPARE}:preset=cpu,lr=3e-3", ["train.steps=1e2", "model.rope=false", "data.path=x"]
  )
  assert cfg.opt.lr == 3e-3 and cfg.train.steps == 100 and isinstance(cfg.train.steps, int)
  assert cfg.model.rope is False and cfg.preset == "cpu"
  spec, overrides, rest = config_lib.split_argv(
    ["--config", "a.py:preset=gpu", "--config.opt.lr=1", "--config.train.steps", "5", "--out", "o"]
  )
  assert spec == "a.py:preset=gpu" and overrides == ["opt.lr=1", "train.steps=5"]
  assert rest == ["--out", "o"]


def test_weight_decay_is_independent_of_the_peak_lr():
  params = {"w": jnp.ones((3, 3)), "gain": jnp.ones((3,))}
  zeros = jax.tree.map(jnp.zeros_like, params)
  decays = []
  for lr in (1e-3, 1.0):
    cfg = config_lib.base_config()
    cfg.opt.update(dict(lr=lr, weight_decay=0.1, clip=0.0))
    cfg.train.steps = 100
    tx = optim.make_optimizer(cfg)
    state = tx.init(params)
    for _ in range(50):  # halfway: past warmup, inside the cosine
      updates, state = tx.update(zeros, state, params)
    decays.append(updates)
  schedule_shape = float(optim.schedule(cfg)(49)) / 1.0
  np.testing.assert_allclose(decays[0]["w"], decays[1]["w"], rtol=1e-6)
  np.testing.assert_allclose(decays[0]["w"], -0.1 * schedule_shape * np.ones((3, 3)), rtol=1e-5)
  np.testing.assert_array_equal(decays[0]["gain"], 0.0)  # gains are not decayed


def test_jsonl_truncation_and_torn_lines(tmp_path):
  path = str(tmp_path / "m.jsonl")
  with rundir.JsonlWriter(path) as w:
    w.write([{"step": i, "loss": float("nan") if i == 2 else i} for i in range(5)])
  with open(path, "a") as f:
    f.write('{"step": 5, "lo')  # a kill mid-write
  assert [r["step"] for r in rundir.read_jsonl(path)] == [0, 1, 2, 3, 4]
  assert rundir.read_jsonl(path)[2]["loss"] is None
  rundir.truncate_jsonl(path, 3)
  assert [r["step"] for r in rundir.read_jsonl(path)] == [0, 1, 2]
  with open(path) as f:
    assert f.read().endswith("\n")


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_matches(tmp_path):
  """A real SIGKILL of a training process after its first checkpoint, then a resume."""
  cfg = tiny(
    tmp_path / "killed",
    **{
      "train.steps": 400,
      "train.checkpoint_every": 50,
      "train.eval_every": 100,
      "train.probe_every": 100,
    },
  )
  spec = str(tmp_path / "spec.json")
  rundir.write_json(spec, cfg.to_dict())
  env = dict(os.environ, PYTHONPATH=REPO)
  proc = subprocess.Popen([sys.executable, "-m", "attnjax._src.train.run_config", spec], env=env)
  ckpt = tmp_path / "killed" / "checkpoints"
  deadline = time.time() + 240
  while time.time() < deadline and not (
    ckpt.is_dir() and any(p.name.isdigit() and int(p.name) >= 100 for p in ckpt.iterdir())
  ):
    time.sleep(0.2)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert rundir.RunDir(cfg.run_dir).read_summary()["status"] == "running"
  resumed = train(cfg)
  assert resumed["status"] == "finished" and resumed["resumed_from"] >= 100
  reference = train(
    tiny(
      tmp_path / "reference",
      **{
        "train.steps": 400,
        "train.checkpoint_every": 50,
        "train.eval_every": 100,
        "train.probe_every": 100,
      },
    )
  )
  assert lines(tmp_path / "killed" / "metrics.jsonl") == lines(
    tmp_path / "reference" / "metrics.jsonl"
  )
  assert reference["status"] == "finished"


def test_train_or_load_trains_once_saves_the_last_step_and_reuses_the_run(tmp_path):
  from flax import nnx

  from attnjax._src.train.pretrained import train_or_load

  cfg = tiny(tmp_path / "elsewhere", **{"train.checkpoint_every": 5})  # 5 does not divide 12
  model, trainer = train_or_load(cfg, str(tmp_path / "run"))
  assert cfg.run_dir == str(tmp_path / "run") and cfg.train.checkpoint_every == 12
  assert int(trainer.state["step"]) == 12
  summary = rundir.RunDir(cfg.run_dir).summary
  written = os.path.getmtime(summary)
  again, _ = train_or_load(cfg, cfg.run_dir)  # a finished run is read, not trained again
  assert os.path.getmtime(summary) == written
  same = jax.tree.map(
    lambda a, b: bool(jnp.array_equal(a, b)),
    nnx.state(model, nnx.Param),
    nnx.state(again, nnx.Param),
  )
  assert all(jax.tree.leaves(same))
  with pytest.raises(SystemExit, match="training ended as stopped"):
    train_or_load(tiny(tmp_path, **{"train.stop_after": 4}), str(tmp_path / "stopped"))


def test_favor_approx_entry_point_writes_its_report(tmp_path):
  # The entry point is a script, not a module of the package: load it from its file.
  spec = importlib.util.spec_from_file_location(
    "favor_approx", os.path.join(REPO, "experiments", "favor_approx.py")
  )
  favor_approx = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(favor_approx)
  markdown = favor_approx.main(
    [
      "--config",
      os.path.join(REPO, "experiments/configs/favor_approx.py:preset=cpu"),
      "--config.seq_len=16",
      "--config.head_dim=8",
      "--config.num_heads=1",
      "--config.draws=2",
      "--config.num_features=8,64",
      "--config.maps=favor_plus_orthogonal,trig_iid",
      "--out",
      str(tmp_path),
    ]
  )
  results = json.load(open(tmp_path / "results.json"))
  assert set(results) == {"favor_plus_orthogonal", "trig_iid"}
  assert len(results["trig_iid"]["64"]) == 2
  # More features, smaller error (positive features, mean of 2 draws).
  assert np.mean(results["favor_plus_orthogonal"]["64"]) < np.mean(
    results["favor_plus_orthogonal"]["8"]
  )
  assert "| 64 |" in markdown and os.path.getsize(tmp_path / "plots" / "favor_error.png") > 1000


def test_divergence_needs_a_sustained_rise_or_a_nan():
  from attnjax._src.train.loop import DivergenceWatch

  def recs(losses):
    return [{"step": i, "loss": x, "grad_norm": 1.0} for i, x in enumerate(losses)]

  spike = [4.0, 3.0, 9.0, 9.0, 2.5, 2.4]  # 2 steps above 1.5 x 4.0, then recovers
  assert DivergenceWatch(1.5, 3).update(recs(spike), 4.0) is None
  watch = DivergenceWatch(1.5, 3)
  assert watch.update(recs([4.0, 3.0, 7.0, 8.0, 9.0, 9.5]), 4.0) == 2 and watch.decided_at == 4
  watch = DivergenceWatch(1.5, 3)
  assert watch.update(recs([4.0, 3.0, float("nan"), 2.0]), 4.0) == 2 and watch.decided_at == 2
  # A streak may span two reads of the device metrics.
  watch = DivergenceWatch(1.5, 3)
  assert watch.update(recs([4.0, 7.0, 7.0]), 4.0) is None
  assert watch.update([{"step": 3, "loss": 7.0, "grad_norm": 1.0}], 4.0) == 1


def test_old_run_files_with_1e308_for_inf_read_as_missing(tmp_path):
  """Files from before to_jsonable wrote +-Inf as +-1e308: readers take it as null."""
  from attnjax._src.train.loop import DivergenceWatch, final_metrics

  assert rundir.finite_or_none(1e308) is None and rundir.finite_or_none(-1e308) is None
  assert rundir.finite_or_none(float("inf")) is None and rundir.finite_or_none(None) is None
  assert rundir.finite_or_none(float("nan")) is None and rundir.finite_or_none(3) == 3.0
  run = rundir.RunDir(str(tmp_path))
  old = [
    {
      "kind": "train",
      "step": i,
      "loss": loss,
      "grad_norm": 1.0,
      "log_z": 0.0,
      "max_logit": [2.0, logit],
      "entropy": [1.0, 1.0],
      "entropy_min": [0.5, 0.5],
      "f_attn": [0.1, 0.1],
    }
    for i, (loss, logit) in enumerate([(3.0, 4.0), (2.0, 1e308), (1e308, None), (1.0, 1e308)])
  ]
  # Written as the old writer did (1e308 is a plain JSON number).
  with open(run.metrics, "w") as f:
    f.write("".join(json.dumps(r) + "\n" for r in old))
  out = final_metrics(run, {}, {}, {}, "diverged")
  assert out["max_logit_ever"] == 4.0 and out["max_logit"] == 2.0
  assert out["final_train_loss"] == pytest.approx(2.0)
  records = [r for r in rundir.read_jsonl(run.metrics)]
  assert report._layer_max(records[1], "max_logit") == 2.0
  # An old infinite loss is a divergence at once, as a null one is.
  assert DivergenceWatch(1.5, 3).update(records, 3.0) == 2


def test_microbatches_give_the_same_update(tmp_path):
  from attnjax._src.train.loop import Trainer
  from attnjax._src.train.step import make_train_step

  trainer = Trainer(tiny(tmp_path, **{"train.num_devices": 1}))
  b = trainer.batches.batch("train", 0)
  args = (trainer.rest, jnp.asarray(b.inputs), jnp.asarray(b.targets))
  outs = [
    jax.jit(make_train_step(trainer.graphdef, trainer.optimizer, microbatches=m))(
      trainer.state, *args
    )
    for m in (1, 4)
  ]
  (state1, m1), (state4, m4) = outs
  for a, b_ in zip(jax.tree.leaves(state1["params"]), jax.tree.leaves(state4["params"])):
    np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-6)
  for key in ("loss", "grad_norm", "max_logit", "f_attn", "log_z"):
    np.testing.assert_allclose(m1[key], m4[key], rtol=1e-5, atol=1e-6)


def test_microbatches_must_divide_the_batch():
  with pytest.raises(ValueError, match="train.microbatches=3"):
    config_lib.load_config(f"{COMPARE}:preset=cpu", ["train.microbatches=3"])


def _lines_file(tmp_path):
  path = tmp_path / "lines.txt"
  path.write_text("".join(f"line {i}: {'to be or not ' * (i % 4)}\n" for i in range(200)))
  return str(path)


def test_packed_training_runs_and_microbatches_split_the_packing(tmp_path):
  from attnjax._src.train.loop import Trainer
  from attnjax._src.train.step import make_train_step

  cfg = tiny(
    tmp_path / "packed", data="text", **{"data.path": _lines_file(tmp_path), "data.pack": True}
  )
  summary = train(cfg)
  assert summary["status"] == "finished" and np.isfinite(summary["val_loss"])

  trainer = Trainer(
    tiny(
      tmp_path / "mb",
      data="text",
      **{"data.path": _lines_file(tmp_path), "data.pack": True, "train.num_devices": 1},
    )
  )
  b = trainer.batches.batch("train", 0)
  assert b.packed and b.weights.min() == 0.0
  packing = {k: jnp.asarray(v) for k, v in b.packing().items()}
  args = (trainer.rest, jnp.asarray(b.inputs), jnp.asarray(b.targets), packing)
  outs = [
    jax.jit(make_train_step(trainer.graphdef, trainer.optimizer, microbatches=m))(
      trainer.state, *args
    )
    for m in (1, 4)
  ]
  (state1, m1), (state4, m4) = outs
  for a, b_ in zip(jax.tree.leaves(state1["params"]), jax.tree.leaves(state4["params"])):
    np.testing.assert_allclose(a, b_, rtol=1e-4, atol=1e-6)
  # The packing changes the loss (it is not ignored).
  _, plain = jax.jit(make_train_step(trainer.graphdef, trainer.optimizer))(trainer.state, *args[:3])
  assert abs(float(plain["loss"]) - float(m1["loss"])) > 1e-4


def test_packed_microbatches_with_unequal_weights_give_the_whole_batch_mean(tmp_path):
  """Microbatches holding different numbers of weighted targets: same loss and grads as M=1."""
  import optax
  from attnjax._src.train.loop import Trainer
  from attnjax._src.train.step import make_train_step

  trainer = Trainer(
    tiny(
      tmp_path / "mb",
      data="text",
      **{"data.path": _lines_file(tmp_path), "data.pack": True, "train.num_devices": 1},
    )
  )
  b = trainer.batches.batch("train", 0)
  packing = {k: jnp.asarray(v) for k, v in b.packing().items()}
  # Rows 0, 2, 4, ... form microbatch 0 of 2: keep only 3 weighted targets per row there.
  weights = np.asarray(b.weights, np.float32).copy()
  weights[0::2, 3:] = 0.0
  packing["weights"] = jnp.asarray(weights)
  assert weights[0::2].sum() != weights[1::2].sum()
  # An "optimizer" that keeps the gradients in its state and leaves the parameters.
  keep_grads = optax.GradientTransformation(
    lambda p: jax.tree.map(jnp.zeros_like, p),
    lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g),
  )
  state = dict(trainer.state, opt_state=keep_grads.init(trainer.state["params"]))
  args = (trainer.rest, jnp.asarray(b.inputs), jnp.asarray(b.targets), packing)
  (s1, m1), (s2, m2) = [
    jax.jit(make_train_step(trainer.graphdef, keep_grads, z_loss=1e-2, microbatches=m))(
      state, *args
    )
    for m in (1, 2)
  ]
  for key in ("loss", "z_loss", "total_loss", "grad_norm", "log_z"):
    np.testing.assert_allclose(m1[key], m2[key], rtol=1e-5, atol=1e-7, err_msg=key)
  for g1, g2 in zip(jax.tree.leaves(s1["opt_state"]), jax.tree.leaves(s2["opt_state"])):
    np.testing.assert_allclose(g1, g2, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
  "overrides,match",
  [
    (["data.pack=True", "data.name=bigram_backcopy"], "data.pack=True needs a corpus"),
    (
      ["data.pack=True", "data.name=shakespeare", "variant=linear"],
      "data.pack=True needs attention",
    ),
  ],
  ids=["bigram", "linear"],
)
def test_packing_configs_that_cannot_work_fail_naming_the_key(overrides, match):
  with pytest.raises(ValueError, match=match):
    config_lib.load_config(f"{COMPARE}:preset=cpu", overrides)


def test_packing_asks_the_family_spec_whether_it_takes_segment_ids(monkeypatch):
  from attnjax._src.nn import specs

  monkeypatch.setattr(specs.LinearSpec, "takes_segment_ids", True)
  overrides = ["data.pack=True", "data.name=shakespeare", "variant=linear"]
  cfg = config_lib.load_config(f"{COMPARE}:preset=cpu", overrides)
  assert cfg.data.pack


@pytest.mark.parametrize(
  "variant,implementation,kept",
  [
    ("dense", "blockwise", "blockwise"),
    ("linear", "blockwise", None),  # a dense kernel name: linear keeps its default
    ("linear", "reference", "reference"),  # a name linear attention takes
  ],
)
def test_model_implementation_goes_to_families_that_take_it(variant, implementation, kept):
  from attnjax._src.train.model import model_config

  cfg = config_lib.load_config(
    f"{COMPARE}:preset=cpu", [f"variant={variant}", f"model.implementation={implementation}"]
  )
  assert model_config(cfg, 11).attention.implementation == kept


def _truncate_data_files(step_dir) -> int:
  """Truncates every OCDBT data file of a checkpoint to half its size (a torn copy)."""
  count = 0
  for root, _, files in os.walk(step_dir):
    if os.path.basename(root) != "d":
      continue
    for name in files:
      path = os.path.join(root, name)
      size = os.path.getsize(path)
      with open(path, "r+b") as f:
        f.truncate(size // 2)
      count += 1
  return count


# orbax's failed read leaves an asyncio callback behind on its closed event loop (reported by
# pytest as an unraisable exception; the restore error itself is caught and reported).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_damaged_newest_checkpoint_resumes_from_the_one_before(tmp_path, capsys):
  full = train(tiny(tmp_path / "full"))
  cut = tiny(tmp_path / "cut", **{"train.stop_after": 10})
  assert train(cut)["status"] == "stopped"  # checkpoints at steps 4 and 8
  run = rundir.RunDir(cut.run_dir)
  assert _truncate_data_files(os.path.join(run.checkpoints, "8")) > 0
  cut.train.stop_after = 0
  resumed = train(cut)
  err = capsys.readouterr().err
  assert resumed["status"] == "finished" and resumed["resumed_from"] == 4
  assert "checkpoint 8 does not restore" in err and "checkpoints.damaged" in err, err
  assert "resumed from checkpoint 4 (skipped damaged checkpoint 8)" in err, err
  (skipped,) = resumed["skipped_checkpoints"]
  assert skipped["step"] == 8 and os.path.isdir(skipped["moved_to"])  # moved aside, not deleted
  assert lines(rundir.RunDir(full["run_dir"]).metrics) == lines(run.metrics)


def test_rerunning_a_run_with_another_config(tmp_path, capsys):
  cfg = tiny(tmp_path / "run")
  done = train(cfg)
  # More steps: the learning-rate schedule decays over train.steps, so a longer run is a new
  # run: an error naming the key and both values, nothing trained.
  with pytest.raises(ValueError, match=r"train\.steps: 12 -> 16"):
    train(tiny(tmp_path / "run", **{"train.steps": 16, "opt.lr": 0.02}))
  with pytest.raises(ValueError, match=r"opt\.lr: 0\.01 -> 0\.02"):
    train(tiny(tmp_path / "run", **{"opt.lr": 0.02}))
  # Logging / eval cadence may change: the ended run's summary, saying what it ignored.
  again = train(tiny(tmp_path / "run", **{"train.log_every": 2}))
  assert again == done and "train.log_every changed" in capsys.readouterr().err
  # A stopped run resumes with another eval cadence and says so.
  cut = tiny(tmp_path / "cut", **{"train.stop_after": 10})
  train(cut)
  cut.train.stop_after = 0
  cut.train.eval_every = 4
  assert train(cut)["status"] == "finished"
  assert "resuming with train.eval_every, train.stop_after changed" in capsys.readouterr().err


# -- keeping the device busy: the loop between two reads of the metrics -------------------------


def test_between_metric_reads_the_loop_only_dispatches(tmp_path, monkeypatch):
  """Between boundaries the loop moves nothing implicitly between host and device (no
  ``float()`` of a device value, no eager computation such as the LR schedule per step),
  compiles nothing, and reads the metrics once per ``log_every`` steps, all of them at once."""
  from attnjax._src.train import loop
  from attnjax._src.train import mesh as mesh_lib

  reads, lowerings, inside = [], [], [False]
  real_to_host = mesh_lib.to_host

  def to_host(tree):
    if inside[0] and isinstance(tree, list):  # the loop's metrics: one dict per step
      reads.append(len(tree))
    return real_to_host(tree)

  def lowered(event, seconds, **_):
    if inside[0] and event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
      lowerings.append(event)

  def guarded(run):
    def wrapper(self, *args):
      inside[0] = run is real_loop
      with jax.transfer_guard("disallow" if inside[0] else "allow"):
        try:
          return run(self, *args)
        finally:
          inside[0] = run is not real_loop

    return wrapper

  real_loop, real_boundary = loop.Trainer._loop, loop.Trainer._at_boundary
  monkeypatch.setattr(mesh_lib, "to_host", to_host)
  monkeypatch.setattr(loop.Trainer, "_loop", guarded(real_loop))
  monkeypatch.setattr(loop.Trainer, "_at_boundary", guarded(real_boundary))
  jax.monitoring.register_event_duration_secs_listener(lowered)
  try:
    summary = train(
      tiny(
        tmp_path / "run",
        **{
          "train.steps": 16,
          "train.eval_every": 8,
          "train.probe_every": 8,
          "train.checkpoint_every": 8,
        },
      )
    )
  finally:
    jax.monitoring.unregister_event_duration_listener(lowered)
  assert summary["status"] == "finished" and summary["steps_done"] == 16
  assert reads == [4, 4, 4, 4] and lowerings == []  # log_every=4: 16 steps, 4 reads, no compile
  times = summary["loop_time_s"]
  assert set(times) == {"batch_wait", "dispatch", "metrics_wait", "record", "boundaries"}
  assert all(v >= 0 for v in times.values()) and times["boundaries"] > 0


def test_the_train_step_donates_the_state(tmp_path):
  from attnjax._src.train.loop import Trainer

  trainer = Trainer(tiny(tmp_path))
  with jax.set_mesh(trainer.dp.mesh):
    args = trainer.dp.batch_args(trainer.batches.batch("train", 0))
    old = trainer.state
    trainer.state, _ = trainer.train_step(old, trainer.rest, *args)
  assert all(x.is_deleted() for x in jax.tree.leaves(old))  # updated in place, not copied
  assert not any(x.is_deleted() for x in jax.tree.leaves(trainer.rest))


def test_prefetch_keeps_the_order_stops_and_raises():
  from attnjax._src.train.prefetch import Prefetch

  made = []

  def make(step):
    made.append(step)
    return jnp.full((2,), step)

  batches = Prefetch(make, 3, 9, depth=2)
  for step in range(3, 7):
    np.testing.assert_array_equal(batches.get(step), [step, step])
  with pytest.raises(ValueError, match=r"the next batch is step 7"):
    batches.get(8)
  batches.close()  # mid-way: the thread ends, having built at most depth + 1 more
  assert not batches._thread.is_alive() and made == list(range(3, len(made) + 3))
  assert len(made) <= 4 + 2 + 1

  def broken(step):
    if step == 1:
      raise OSError("no such shard")
    return step

  batches = Prefetch(broken, 0, 5)
  assert batches.get(0) == 0
  with pytest.raises(OSError, match="no such shard"):
    batches.get(1)
  batches.close()
  with pytest.raises(ValueError, match="depth must be a positive int"):
    Prefetch(make, 0, 1, depth=0)


def test_prefetched_batches_give_the_run_of_batches_built_in_the_loop(tmp_path, monkeypatch):
  """The loop's batches come from a thread ahead of it: the run equals one whose batches are
  built synchronously, step by step (every metric, bit for bit)."""
  from attnjax._src.train import loop

  prefetched = train(tiny(tmp_path / "prefetched", data="shakespeare"))

  class InLoop:
    def __init__(self, make, start, stop, depth=2):
      self.make = make

    def get(self, step):
      return self.make(step)

    def close(self):
      pass

  monkeypatch.setattr(loop, "Prefetch", InLoop)
  in_loop = train(tiny(tmp_path / "in_loop", data="shakespeare"))
  assert prefetched["status"] == in_loop["status"] == "finished"
  assert lines(tmp_path / "prefetched" / "metrics.jsonl") == lines(
    tmp_path / "in_loop" / "metrics.jsonl"
  )


def test_mfu_from_the_device_kind_and_in_the_summary(tmp_path):
  from types import SimpleNamespace

  from attnjax._src.train import mfu

  h200, cpu = SimpleNamespace(device_kind="NVIDIA H200"), SimpleNamespace(device_kind="cpu")
  # device_check's figures: 164 MFLOP per token at 0.91 M tokens/s on one H200 is 15.1%.
  u = mfu.utilisation(164e6, 0.91e6, [h200])
  assert u["mfu"] == pytest.approx(164e6 * 0.91e6 / 989e12) and u["device_kind"] == "NVIDIA H200"
  assert mfu.utilisation(164e6, 8 * 0.91e6, [h200] * 8)["mfu"] == pytest.approx(u["mfu"])
  assert mfu.peak_flops("NVIDIA H100 PCIe") == 756e12 and mfu.peak_flops("TPU v5 lite") == 197e12
  assert mfu.peak_flops("TPU v5p") == 459e12 and mfu.peak_flops("TPU v6 lite") == 918e12
  for devices in ([cpu], [h200, SimpleNamespace(device_kind="NVIDIA A100-SXM4-40GB")]):
    u = mfu.utilisation(1e6, 2e3, devices)
    assert u["mfu"] is None and u["peak_flops_per_s"] is None and u["model_flops_per_s"] == 2e9
  assert mfu.utilisation(1e6, 2e3, [cpu], peak_flops_per_device=1e12)["mfu"] == pytest.approx(2e-3)
  assert mfu.utilisation(1e6, float("nan"), [h200])["mfu"] is None

  summary = train(tiny(tmp_path))
  assert summary["mfu"] is None and summary["peak_flops_per_s"] is None  # a CPU: no peak
  assert summary["model_flops_per_s"] == pytest.approx(
    summary["flops_per_token"] * summary["tokens_per_s"]
  )
  assert summary["device_kind"] == jax.devices()[0].device_kind


def test_bench_trainer_suite_measures_the_loop_against_its_step(monkeypatch):
  spec = importlib.util.spec_from_file_location(
    "bench", os.path.join(REPO, "experiments", "bench.py")
  )
  bench = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, "bench", bench)  # its dataclasses look their module up
  spec.loader.exec_module(bench)
  row = bench.trainer_vs_step(
    "cpu",
    "dense",
    8,
    data="bigram_backcopy",
    overrides=(
      "model.d_model=16",
      "model.num_layers=1",
      "model.num_heads=2",
      "data.seq_len=16",
      "data.batch_size=8",
      "data.bb_vocab_size=16",
      "train.microbatches=1",
      "train.log_every=2",
      "train.eval_batches=1",
      "train.probe_batch=8",
      "train.probe_len=16",
      "train.progress=false",
    ),
  )
  assert row["steps"] == 8 and row["tokens_per_step"] == 128
  for key in (
    "trainer_tokens_per_s",
    "trainer_all_tokens_per_s",
    "step_tokens_per_s",
    "random_tokens_per_s",
  ):
    assert np.isfinite(row[key]) and row[key] > 0, key
  assert row["ratio"] == pytest.approx(row["trainer_tokens_per_s"] / row["step_tokens_per_s"])
  assert "trainer" in bench._SUITES


def test_resolve_root_reads_a_relative_root_from_the_launch_directory(tmp_path, monkeypatch):
  (tmp_path / "runs" / "compare").mkdir(parents=True)
  (tmp_path / "notebooks").mkdir()
  monkeypatch.chdir(tmp_path / "notebooks")  # where a Jupyter kernel runs
  monkeypatch.setenv("PWD", str(tmp_path))  # where the user started Jupyter
  assert rundir.resolve_root("runs/compare") == str(tmp_path / "runs" / "compare")
  assert rundir.resolve_root(str(tmp_path / "runs")) == str(tmp_path / "runs")
  monkeypatch.delenv("PWD")
  assert rundir.resolve_root("../runs") == str(tmp_path / "runs")  # the working directory's
  with pytest.raises(
    FileNotFoundError, match=r"ATTNJAX_RUN_DIR='runs/none': not found: .*runs/none"
  ):
    rundir.resolve_root("runs/none")
