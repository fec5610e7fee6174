"""Seeds: stacked runs equal separate ones; the main job's report, its design and its words.

The stacked group trains the seeds of an arm as one step (lax.map or vmap); each seed's metrics,
probes and summary must equal a run of that seed alone (up to float summation order), also
after an interruption. The report of a tiny ``compare`` run must carry the design block,
mean ± spread columns, uniform-attention baselines equal to their closed forms and "within
noise" where two arms' spreads overlap; bad arms are usage errors before anything trains.
"""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import reduction_tolerance

from attnjax._src.train import arm_report, baselines, report, rundir, seeds, spread, sweep
from attnjax._src.train import config as config_lib
from attnjax._src.train.loop import train

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEPS = 12
pytestmark = pytest.mark.usefixtures("compilation_cache")


def tiny(run_dir, seed, **changes):
  c = config_lib.base_config()
  c.run_dir = str(run_dir)
  c.seed = seed
  c.data.update(dict(name="bigram_backcopy", seq_len=16, batch_size=8, bb_vocab_size=16))
  c.model.update(dict(d_model=16, num_layers=1, num_heads=2, mlp_ratio=2))
  c.train.update(
    dict(
      steps=STEPS,
      log_every=4,
      eval_every=6,
      eval_batches=1,
      probe_every=6,
      probe_batch=8,
      probe_len=16,
      checkpoint_every=4,
      microbatches=2,
      num_devices=1,
      progress=False,
      plots=False,
    )
  )
  for key, value in changes.items():
    config_lib.apply_overrides(c, [f"{key}={value}"])
  return c


def records(path):
  return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rundir.read_jsonl(str(path))]


def assert_same_records(a, b, what):
  """Equal keys and steps; numbers equal up to float summation order over the run."""
  assert [r.get("step") for r in a] == [r.get("step") for r in b], what
  for x, y in zip(a, b):
    assert x.keys() == y.keys(), what
    for k in x:
      if isinstance(x[k], str) or x[k] is None:
        assert x[k] == y[k], (what, k)
        continue
      u, v = np.asarray(x[k], float), np.asarray(y[k], float)
      scale = max(1.0, float(np.nanmax(np.abs(u))) if u.size else 1.0)
      # Reductions over a batch of tokens, reordered by vmap, compounding over the steps.
      tol = reduction_tolerance(jnp.float32, 8 * 16, depth=2 * STEPS, scale=scale)
      np.testing.assert_allclose(u, v, rtol=0, atol=tol, err_msg=f"{what} {k}")


def test_stacked_seeds_equal_separate_runs_also_after_a_stop(tmp_path):
  alone = [train(tiny(tmp_path / "alone" / str(s), s)) for s in (0, 1)]
  group = [tiny(tmp_path / "group" / f"seed={s}", s, **{"train.stop_after": 8}) for s in (0, 1)]
  stopped = seeds.train_seeds(group)
  assert [s["status"] for s in stopped] == ["stopped", "stopped"]
  for cfg in group:
    cfg.train.stop_after = 0
  keep = []
  resumed = seeds.train_seeds(group, keep=keep)
  for s, one, two in zip((0, 1), alone, resumed):
    assert two["status"] == "finished" and two["resumed_from"] == 8
    assert two["seed_group"] == {"seeds": [0, 1], "stacked": True, "stacking": "map"}
    a, b = tmp_path / "alone" / str(s), tmp_path / "group" / f"seed={s}"
    assert_same_records(records(a / "metrics.jsonl"), records(b / "metrics.jsonl"), f"seed {s}")
    assert_same_records(records(a / "probes.jsonl"), records(b / "probes.jsonl"), f"probes {s}")
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)
  # The seeds differ (their data and initialisation), and the group keeps its compiled step.
  assert alone[0]["val_loss"] != alone[1]["val_loss"]
  (handle,) = keep
  assert handle.seeds == 2 and handle.tokens == 2 * 8 * 16
  rates = seeds.bare_step_rates(keep, rounds=2, calls=1)
  assert len(rates["arms"][0]["rates"]) == 2 and min(rates["arms"][0]["rates"]) > 0
  assert seeds.train_seeds(group)[0]["status"] == "finished"  # ended: nothing trains again


@pytest.mark.slow  # the accelerators' stacking, on this CPU: ~10 s quiet (the default is map)
def test_vmap_stacked_seeds_equal_separate_runs(tmp_path):
  alone = [train(tiny(tmp_path / "alone" / str(s), s)) for s in (0, 1)]
  batched = seeds.train_seeds(
    [tiny(tmp_path / "vmap" / f"seed={s}", s) for s in (0, 1)], stacking="vmap"
  )
  for s, one, two in zip((0, 1), alone, batched):
    assert two["seed_group"] == {"seeds": [0, 1], "stacked": True, "stacking": "vmap"}
    a, b = tmp_path / "alone" / str(s), tmp_path / "vmap" / f"seed={s}"
    assert_same_records(records(a / "metrics.jsonl"), records(b / "metrics.jsonl"), f"seed {s}")
    assert_same_records(records(a / "probes.jsonl"), records(b / "probes.jsonl"), f"probes {s}")
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-5)


@pytest.mark.slow  # ~5 s quiet: the divergence path of the stacked loop
def test_a_stacked_group_records_divergence_per_seed(tmp_path):
  runs = seeds.train_seeds(
    [
      tiny(tmp_path / f"seed={s}", s, **{"opt.lr": 1e3, "train.checkpoint_every": 0})
      for s in (0, 1)
    ]
  )
  assert [r["status"] for r in runs] == ["diverged", "diverged"]
  for r in runs:
    steps = [x["step"] for x in rundir.read_jsonl(os.path.join(r["run_dir"], "metrics.jsonl"))]
    assert r["diverged_step"] <= max(steps) < r["diverged_step"] + 10  # patience 10


def test_groups_and_seed_settings_are_checked():
  assert sweep.parse_seeds("0, 1,2") == [0, 1, 2] and sweep.parse_seeds(3) == [3]
  for bad, match in (
    ("a,b", "'a' is not an int"),
    ("1.5", "'1.5' is not an int"),
    ([True], "True is not an int"),
    ("", "is empty"),
    ("1,1", "repeats seed 1"),
    ("-2", ">= 0"),
  ):
    with pytest.raises(ValueError, match=match):
      sweep.parse_seeds(bad)
  a, b = tiny("/x/0", 0), tiny("/x/1", 1, **{"opt.lr": 0.5})
  with pytest.raises(ValueError, match="differs from /x/0 in opt.lr"):
    seeds.check_group([a, b])
  with pytest.raises(ValueError, match="distinct run_dir"):
    seeds.check_group([a, tiny("/x/0", 1)])


# ---------------------------------------------------------------------------
# Spread, significance and baselines.


def test_spread_is_the_seed_range_below_5_seeds_then_a_t_interval():
  s = spread.spread([1.0, 2.0, 4.0, None, float("nan")])
  assert (s.n, s.mean, s.half) == (3, pytest.approx(7 / 3), pytest.approx(5 / 3))
  assert s.lo <= 1.0 and s.hi >= 4.0  # every seed inside
  xs = [1.0, 2.0, 3.0, 4.0, 5.0]
  t = spread.spread(xs)
  sd = np.std(xs, ddof=1)
  assert t.kind == "95% CI" and t.half == pytest.approx(2.7764451 * sd / math.sqrt(5), rel=1e-6)
  assert spread.differs(spread.spread([1, 2]), spread.spread([2.5, 3])) == -1
  assert spread.differs(spread.spread([1, 2]), spread.spread([1.5, 3])) == 0
  assert spread.differs(spread.spread([1.0]), spread.spread([5.0])) is None
  assert spread.fmt_spread(spread.spread([0.5, 0.7]), 2) == "0.60 ± 0.10"


def arm(variant, lr, values, **more):
  out = {k: None for k, _, _ in arm_report.METRICS}
  out.update(arm=f"{variant}/lr={lr:g}", variant=variant, lr=lr, n=len(values), runs=[], diverged=0)
  out["val_loss"] = spread.spread(values)
  out.update(more)
  return out


def test_significance_says_within_noise_only_where_the_spreads_overlap():
  arms = [
    arm("dense", 0.1, [2.0, 2.1]),
    arm("gated", 0.1, [2.05, 2.2]),  # overlaps dense
    arm("sigmoid", 0.1, [2.5, 2.6]),  # above it
    arm("relu", 0.1, [2.3]),  # one seed: no spread to judge
  ]
  (line,) = arm_report.significance(arms, "dense", ("val_loss",))
  assert "higher beyond the seed spread: sigmoid/lr=0.1 (2.550 ± 0.050)" in line
  assert "within noise: gated/lr=0.1" in line and "one seed, no spread to judge" in line
  table = arm_report.summary_table(arms, "dense", ("val_loss",))
  assert "2.550 ± 0.050 ▲" in table and "2.125 ± 0.075 ~" in table


def harmonic(n):
  return sum(1.0 / i for i in range(1, n + 1))


@pytest.mark.parametrize("T,window", [(16, None), (64, None), (64, 16)])
def test_uniform_baselines_equal_their_closed_forms(T, window):
  b = baselines.uniform_baselines(T, window)
  w = T - 1 if window is None else window
  # Query i (0-based) weighs key 0 by 1/(i+1) while it sees it (i <= w), else 0.
  assert b["f_attn"] == pytest.approx((harmonic(w + 1) - 1) / (T - 1), rel=1e-6)
  entropy = sum(math.log(min(i, w) + 1) for i in range(T)) / T
  assert b["entropy"] == pytest.approx(entropy, rel=1e-6)
  assert b["alpha_1"] == pytest.approx(harmonic(w + 1) / T, rel=1e-6)
  assert b["sink_rate"] == 0.0 and b["first_token"] == b["f_attn"]


# ---------------------------------------------------------------------------
# The main job: a tiny cpu preset with 2 seeds, and its bad inputs.


def load_experiment(name):
  spec = importlib.util.spec_from_file_location(
    f"experiments_{name}", ROOT / "experiments" / f"{name}.py"
  )
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


TINY_COMPARE = [
  "--config.train.steps=6",
  "--config.train.log_every=3",
  "--config.train.eval_every=6",
  "--config.train.eval_batches=1",
  "--config.train.probe_every=3",
  "--config.train.probe_batch=4",
  "--config.train.probe_len=16",
  "--config.train.checkpoint_every=0",
  "--config.train.microbatches=1",
  "--config.train.num_devices=1",
  "--config.train.progress=false",
  "--config.train.plots=false",
  "--config.data.batch_size=4",
  "--config.data.seq_len=16",
  "--config.model.d_model=16",
]


def test_main_job_report_at_a_tiny_size(tmp_path, capsys):
  out = tmp_path / "compare"
  md = load_experiment("compare").main(
    [
      "--out",
      str(out),
      "--config.sweep.variants=dense,sink_logits",
      "--config.sweep.high_lrs=",
      "--config.sweep.seeds=0,1",
      "--config.opt.lr=1e-4",
      *TINY_COMPARE,
    ]
  )
  assert re.search(r"wall time \d+ s", capsys.readouterr().out)
  # The design block: model, data, tokens, T, steps, batch, optimiser, LRs, seeds, machine.
  design = md.split("## Design")[1].split("## Summary")[0]
  for words in (
    "**model**: 1 layer(s), width 16, 1 head(s) of dim 16",
    "**data**: bigram-backcopy",
    "T = 16 tokens per sequence, batch 4",
    "6 steps, 384 tokens per run, 1,536 over the 4 runs",
    "**optimiser**: AdamW",
    "**learning rates**: 0.0001 (dense, sink_logits)",
    "**seeds**: 0, 1 (2 per arm",
    "trained stacked: one step per arm over its seeds, jax.lax.map",
    "**machine**:",
    "1-minute load average",
  ):
    assert words in design, (words, design)
  # Mean ± spread columns: every cell of the summary's loss column.
  summary = md.split("## Summary over seeds")[1].split("\n## ")[0]
  rows = [
    line
    for line in summary.splitlines()
    if line.startswith("| dense/") or line.startswith("| sink_logits/")
  ]
  assert len(rows) == 2 and all(re.search(r"\| \d\.\d{3,} ± \d\.\d{3,} ", r) for r in rows), rows
  # Uniform baselines equal the exact value at the probe length (T = 16) beside F-Attn.
  exact = (harmonic(16) - 1) / 15
  sinks = md.split("## Sinks against uniform attention")[1].split("\n## ")[0]
  assert f"({spread.number(exact, 3)})" in sinks and "causal, T = 16" in sinks
  assert "No sink formed in any arm at this scale" in sinks
  # "within noise" exactly where the two arms' val-loss spreads overlap (at LR 1e-4 and 6
  # steps the variants barely move, the seeds' data differ: they overlap).
  dense, sink = arm_report.arm_rows(
    [report.row_of(r, str(out)) for r in report.find_runs(str(out))]
  )
  assert spread.differs(sink["val_loss"], dense["val_loss"]) == 0
  assert "- **val loss** at LR 0.0001 against dense" in md and "within noise: sink_logits" in md
  # The bare step, timed interleaved after training.
  assert "## Throughput (bare step)" in md and "| dense/lr=0.0001 | 0.0001 | 2 |" in md
  assert (out / "plots" / "summary.png").is_file()


@pytest.mark.parametrize("script", ["compare", "sinks", "lr_sweep"])
@pytest.mark.parametrize(
  "override,words",
  [
    (
      "--config.sweep.variants=dense,softpik",
      ["'softpik' is not a variant", "did you mean 'softpick'", "known variants: alibi"],
    ),
    ("--config.sweep.seeds=0,one", ["sweep.seeds='0,one' is not a list of ints"]),
    ("--config.sweep.variants=", ["sweep.variants is empty"]),
  ],
  ids=["unknown-variant", "seeds-not-ints", "no-arms"],
)
def test_bad_arms_are_usage_errors_before_training(script, override, words, tmp_path, capsys):
  module = load_experiment(script)
  with pytest.raises(SystemExit) as e:
    module.main(["--out", str(tmp_path / "out"), override])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "usage:" in err and "error:" in err and "Traceback" not in err
  for w in words:
    assert w in err, (w, err)
  assert not (tmp_path / "out").exists()  # nothing trained, nothing written


@pytest.mark.slow  # a fresh interpreter importing jax; the in-process test above checks stderr
def test_a_bad_variant_on_the_command_line_prints_no_traceback():
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  proc = subprocess.run(
    [sys.executable, "experiments/compare.py", "--config.sweep.variants=dense,softpik"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert "'softpik' is not a variant" in proc.stderr
