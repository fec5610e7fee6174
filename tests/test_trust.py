"""The kernel-trust rule of auto-dispatch, and ``python -m attnjax.check`` that feeds it.

attnjax's Pallas kernels (``vouched_by="device-check"`` in ``dense.ENGINES``)
are taken by auto-dispatch on a kind of device only once ``python -m
attnjax.check`` passed there (a verdict in the cache directory for this attnjax
and jax version), or with ``attnjax.config.kernels = "all"``
(``ATTNJAX_KERNELS=all``); ``"trusted"`` never takes them; a multi-process run
decides from the setting alone; a named implementation always runs. The suite's
cache directory starts empty (tests/conftest.py). The check runs here in
interpret mode, its verdict for the CPU's device kind, and the cuda branch is
traced for a patched device kind.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import attnjax
from attnjax import _target, _trust, check, dense
from helpers import rand_qkv

GPU = "NVIDIA H100 80GB HBM3"
ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """An empty verdict directory and a process that has not logged its skip line yet."""
  monkeypatch.setenv("ATTNJAX_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(_trust, "_logged", [])
  return tmp_path


@pytest.fixture
def on_gpu(monkeypatch, cache):
  """The cuda branch traced for an H100 (as on a host with one, or under a mesh of them); no
  TPU known."""
  monkeypatch.setattr(_target, "device_kind", lambda platform: GPU if platform == "cuda" else None)
  return cache


def _sigmoid_call(T=64, dtype=jnp.float32):
  q, k, v = rand_qkv(B=1, T=T, N=2, K=1, H=8, dtype=dtype)
  return dense.prepare(q, k, v, normalizer="sigmoid", is_causal=True)


def test_an_unchecked_kernel_is_skipped_with_one_log_line(on_gpu, caplog):
  caplog.set_level(logging.WARNING, logger="attnjax")
  assert attnjax.config.kernels == "checked"
  table = dense.dispatch_table(*_sigmoid_call())
  assert table == {"cpu": "reference", "cuda": "reference", "tpu": "reference"}
  assert dense.dispatch_table(*_sigmoid_call(T=256))["cuda"] == "blockwise"
  lines = [r.getMessage() for r in caplog.records if r.name == "attnjax"]
  assert len(lines) == 1, lines  # once per process; nothing about the TPU nobody can check here
  assert "pallas_gpu is not used on NVIDIA H100 80GB HBM3" in lines[0]
  assert "`python -m attnjax.check`" in lines[0] and "ATTNJAX_KERNELS=all" in lines[0]
  assert "runs 'reference' instead" in lines[0]
  # jax's kernels are always taken where they cover the call
  q, k, v = rand_qkv(B=1, T=256, N=2, K=1, H=64, dtype=jnp.bfloat16)
  assert dense.dispatch_table(*dense.prepare(q, k, v, is_causal=True))["tpu"] == "splash"


def test_a_passing_verdict_for_this_kind_and_versions_lets_dispatch_take_the_kernel(on_gpu):
  path = _trust.write_verdict(GPU, {"pallas_gpu": {"passed": True}})
  assert path.parent.parent == on_gpu and dense.dispatch_table(*_sigmoid_call())["cuda"] == (
      "pallas_gpu")
  data = json.loads(path.read_text())
  assert data["device_kind"] == GPU and data["jax"] == jax.__version__
  assert data["attnjax"] == attnjax.__version__
  # a verdict of another jax (or attnjax) version does not count
  path.write_text(json.dumps(dict(data, jax="0.0.1")))
  _trust._load.cache_clear()
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"
  # ... nor a failed one, nor one of another kind of device
  _trust.write_verdict(GPU, {"pallas_gpu": {"passed": False}})
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"
  _trust.write_verdict("NVIDIA A100-SXM4-80GB", {"pallas_gpu": {"passed": True}})
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"
  # another kernel's entry is kept when one is checked again
  _trust.write_verdict(GPU, {"mosaic_gpu": {"passed": True}})
  assert set(_trust.read_verdict(GPU)["kernels"]) == {"pallas_gpu", "mosaic_gpu"}


def test_the_settings(on_gpu, monkeypatch):
  _trust.write_verdict(GPU, {"pallas_gpu": {"passed": True}})
  try:
    attnjax.config.kernels = "trusted"  # never, even checked
    assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"
    attnjax.config.kernels = "all"  # always, checked or not
    assert dense.dispatch_table(*_sigmoid_call())["tpu"] == "pallas_tpu"
    attnjax.config.kernels = None  # back to the environment's
    monkeypatch.setenv("ATTNJAX_KERNELS", "all")
    assert attnjax.config.kernels == "all"
    assert dense.dispatch_table(*_sigmoid_call())["tpu"] == "pallas_tpu"
    monkeypatch.setenv("ATTNJAX_KERNELS", "sometimes")
    with pytest.raises(ValueError, match="ATTNJAX_KERNELS='sometimes' is not one of"):
      dense.dispatch_table(*_sigmoid_call())
    with pytest.raises(ValueError, match="attnjax.config.kernels='yes' is not one of"):
      attnjax.config.kernels = "yes"
  finally:
    attnjax.config.kernels = None


def test_a_change_of_setting_retraces(on_gpu):
  traced = []

  @jax.jit
  def f(q):
    traced.append(1)
    return attnjax.dot_product_attention(q, q, q, normalizer="sigmoid")

  q = jnp.ones((1, 16, 2, 8))
  f(q)
  f(q)
  try:
    attnjax.config.kernels = "all"
    f(q)
  finally:
    attnjax.config.kernels = None
  assert len(traced) == 2


def test_a_named_kernel_always_runs(monkeypatch):
  # "trusted" keeps auto-dispatch off attnjax's kernels, never a kernel asked for by name:
  # pallas_gpu is traced here, and refuses to be lowered for the CPU.
  q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
  try:
    attnjax.config.kernels = "trusted"
    with pytest.raises(ValueError, match="implementation='pallas_gpu' runs on a CUDA GPU only"):
      jax.jit(lambda q: attnjax.dot_product_attention(q, q, q, implementation="pallas_gpu"))(q)
  finally:
    attnjax.config.kernels = None


def test_a_multi_process_run_decides_from_the_setting_alone(on_gpu, monkeypatch, caplog):
  # Each host has its own verdicts: every process must choose alike, so none is read.
  caplog.set_level(logging.WARNING, logger="attnjax")
  _trust.write_verdict(GPU, {"pallas_gpu": {"passed": True}})
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"
  line, = [r.getMessage() for r in caplog.records if r.name == "attnjax"]
  assert "a run of 2 processes reads no verdict" in line and "ATTNJAX_KERNELS=all" in line
  try:
    attnjax.config.kernels = "all"
    assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "pallas_gpu"
  finally:
    attnjax.config.kernels = None


def test_the_cache_directory(monkeypatch, tmp_path):
  monkeypatch.setenv("ATTNJAX_CACHE_DIR", str(tmp_path / "mine"))
  assert _trust.cache_dir() == tmp_path / "mine"
  monkeypatch.delenv("ATTNJAX_CACHE_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert _trust.cache_dir() == tmp_path / "xdg" / "attnjax"
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert _trust.cache_dir() == tmp_path / "home" / ".cache" / "attnjax"
  assert _trust.verdict_path("TPU v5 lite").name == "TPU_v5_lite.json"


# ---------------------------------------------------------------------------
# python -m attnjax.check


@pytest.fixture
def small_check(monkeypatch, cache):
  """The check on one small case, in interpret mode."""
  monkeypatch.setattr(check, "INTERPRET_SHAPE", (2, 16, 2, 1, 8))
  monkeypatch.setattr(check, "check_cases", lambda impl: [("sigmoid", "causal", "float32")])
  monkeypatch.setattr(_target, "device_kind",
                      lambda platform: "cpu" if platform == "cuda" else None)
  return cache


def test_a_passing_check_writes_the_verdict_that_dispatch_reads(small_check, tmp_path):
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"
  out = tmp_path / "report.md"
  assert check.main(["--interpret", "--out", str(out)]) == 0
  verdict = _trust.read_verdict("cpu")
  assert verdict["kernels"]["pallas_gpu"] == {"passed": True, "checks": 1, "failed": [],
                                              "shape": [2, 16, 2, 1, 8], "interpret": True}
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "pallas_gpu"
  text = out.read_text()
  assert "- [ok] sigmoid causal float32" in text and "verdict: pallas_gpu passed on 'cpu'" in text


def test_a_failing_comparison_writes_no_passing_verdict(small_check, monkeypatch, tmp_path):
  _trust.write_verdict("cpu", {"pallas_gpu": {"passed": True}})  # an earlier, passing run

  def off_by_a_little(inputs, opts):
    out, stats = dense.reference(inputs, opts)
    return out * 1.01, stats

  monkeypatch.setattr(check, "_kernel_run", lambda impl, interpret: off_by_a_little)
  assert check.main(["--interpret", "--out", str(tmp_path / "report.md")]) == 1
  entry = _trust.read_verdict("cpu")["kernels"]["pallas_gpu"]
  assert entry["passed"] is False and "sigmoid causal float32" in entry["failed"][0]
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"


def test_the_commands_stop_at_once_without_the_device(tmp_path):
  if jax.default_backend() != "cpu":
    pytest.skip("checks the behaviour on a host without a GPU or TPU")
  env = dict(os.environ, PYTHONPATH=str(ROOT), ATTNJAX_CACHE_DIR=str(tmp_path))

  def run(*argv):
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)

  proc = run("-m", "attnjax.check", "--help")
  assert proc.returncode == 0 and "usage: python -m attnjax.check" in proc.stdout, proc.stderr
  assert "--interpret" in proc.stdout and "--budget" in proc.stdout
  proc = run("-m", "attnjax.check", "--out", str(tmp_path / "x.md"))
  assert proc.returncode == 2 and "needs a GPU" in proc.stdout, (proc.stdout, proc.stderr)
  proc = run("experiments/device_check.py", "--platform", "tpu", "--out", str(tmp_path / "y.md"))
  assert proc.returncode == 2 and "needs a TPU" in proc.stdout, (proc.stdout, proc.stderr)
  assert not list(tmp_path.glob("*.md")) and not (tmp_path / "verdicts").exists()
