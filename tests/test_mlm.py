"""The masked-LM objective: BERT's masking, an encoder run that trains, resumes and reports."""

from __future__ import annotations

import os

import numpy as np
import pytest

from attnjax import data
from attnjax._src.train import config as config_lib
from attnjax._src.train import report, rundir
from attnjax._src.train.loop import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENCODER = os.path.join(REPO, "experiments", "configs", "encoder.py")

pytestmark = pytest.mark.usefixtures("compilation_cache")


def test_masking_chooses_15_percent_split_80_10_10():
  tokens = np.random.default_rng(0).integers(0, 50, size=(256, 128))
  inputs, weights = data.mask_tokens(
    tokens, np.random.default_rng(1), rate=0.15, mask_id=50, vocab_size=50
  )
  chosen = weights > 0
  assert not chosen[:, 0].any()  # the leading BOS / [CLS] is never predicted
  assert abs(chosen[:, 1:].mean() - 0.15) < 0.005
  masked = inputs[chosen] == 50
  kept = inputs[chosen] == tokens[chosen]
  assert abs(masked.mean() - 0.8) < 0.015
  # 10% random ids (1 in 50 of which happen to equal the token) and 10% kept.
  assert abs(kept.mean() - (0.1 + 0.1 / 50)) < 0.01
  np.testing.assert_array_equal(inputs[~chosen], tokens[~chosen])


@pytest.mark.parametrize("rate", [0.0, 1.0, -0.1, 1.5, True])
def test_mask_rate_outside_0_1_is_named(rate):
  with pytest.raises(ValueError, match=r"mask_rate must be .*\(0, 1\), got"):
    data.mask_tokens(
      np.zeros((1, 4), int), np.random.default_rng(0), rate=rate, mask_id=1, vocab_size=2
    )
  cfg = config_lib.load_config(ENCODER + ":preset=cpu")
  cfg.data.mask_rate = rate
  with pytest.raises(ValueError, match="data.mask_rate must be in"):
    config_lib.validate(cfg)


def _tiny(run_dir, **changes):
  """The encoder preset, shrunk to seconds (the same code paths)."""
  cfg = config_lib.load_config(
    ENCODER + ":preset=cpu,layers=2,steps=24",
    [
      "model.d_model=32",
      "data.seq_len=32",
      "data.batch_size=8",
      "train.microbatches=1",
      "train.log_every=4",
      "train.eval_every=12",
      "train.eval_batches=1",
      "train.probe_every=12",
      "train.probe_batch=8",
      "train.probe_len=32",
      "train.checkpoint_every=8",
      "train.progress=false",
      "opt.lr=1e-2",
      f"run_dir={run_dir}",
    ]
    + [f"{k}={v}" for k, v in changes.items()],
  )
  return cfg


@pytest.mark.slow  # ~25 s: the MLM preset trained, killed, resumed and reported
def test_encoder_preset_trains_and_reports(tmp_path):
  full = train(_tiny(tmp_path / "dense"))
  assert full["status"] == "finished"
  assert full["val_loss"] < full["initial_loss"]
  probe = rundir.read_jsonl(rundir.RunDir(full["run_dir"]).probes)[-1]
  L = 2
  for position in ("attn_out", "mlp_out", "hidden"):
    assert len(probe[f"outliers/{position}/max_inf_norm"]) == L
  assert np.shape(probe["token_mass/cls"]) == (L, 4)  # per layer and head
  assert probe["outliers/loss_w8a8"] != probe["outliers/loss"]
  markdown = report.write_report(str(tmp_path))
  assert "## Encoder study" in markdown and "MLM loss (W8A8)" in markdown
  for name in ("encoder_outliers.png", "encoder_w8a8.png"):
    assert os.path.getsize(tmp_path / "plots" / name) > 0


@pytest.mark.slow
def test_encoder_run_resumes_after_a_kill(tmp_path):
  full = train(_tiny(tmp_path / "full", **{"train.probe_every": 24}))
  cut = _tiny(tmp_path / "cut", **{"train.stop_after": 10, "train.probe_every": 24})
  assert train(cut)["status"] == "stopped"
  cut.train.stop_after = 0
  resumed = train(cut)
  assert resumed["status"] == "finished" and resumed["resumed_from"] == 8
  a = rundir.read_jsonl(rundir.RunDir(full["run_dir"]).metrics)
  b = rundir.read_jsonl(rundir.RunDir(cut.run_dir).metrics)
  drop = ("tokens_per_s",)
  assert [{k: v for k, v in r.items() if k not in drop} for r in a] == [
    {k: v for k, v in r.items() if k not in drop} for r in b
  ]
  pa = rundir.read_jsonl(rundir.RunDir(full["run_dir"]).probes)
  pb = rundir.read_jsonl(rundir.RunDir(cut.run_dir).probes)
  assert pa == pb
