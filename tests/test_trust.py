"""The kernel-trust rule of auto-dispatch, and ``python -m attnjax.check`` that feeds it.

attnjax's Pallas kernels (``vouched_by="device-check"`` in ``dense.ENGINES``)
are taken by auto-dispatch on a kind of device only once ``python -m
attnjax.check`` passed there for the call's case class (a verdict in the cache
directory or shipped with the package, for this jax version and the kernel's
current source digest), or with ``attnjax.config.kernels = "all"``
(``ATTNJAX_KERNELS=all``); ``"jax"`` (formerly ``"trusted"``) never takes them; a
multi-process run reads shipped verdicts only; a named implementation always runs. The suite's
cache directory starts empty (tests/conftest.py), and every test here points
the shipped verdicts at an empty folder of its own: the verdicts written here
are TEST verdicts, never the package's. The check runs here in interpret mode,
its verdict for the CPU's device kind, and the cuda branch is traced for a
patched device kind.
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
import numpy as np
import pytest

import attnjax
from attnjax._src import target as _target, trust as _trust, check
from attnjax._src.ops.dense import attention as dense
from helpers import rand_qkv

GPU = "NVIDIA H100 80GB HBM3"
ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
  """An empty verdict directory, an empty folder of shipped verdicts (``tmp_path/shipped``),
  and a process that has not logged its skip line yet."""
  monkeypatch.setenv("ATTNJAX_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(_trust, "SHIPPED_DIR", tmp_path / "shipped")
  monkeypatch.setattr(_trust, "_logged", [])
  _trust._load.cache_clear()
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
  assert (
    "pallas_gpu is not used on NVIDIA H100 80GB HBM3 for sigmoid causal float32 calls: not checked"
  ) in lines[0]
  assert "`python -m attnjax.check --platform cuda --kernel pallas_gpu`" in lines[0]
  assert "ATTNJAX_KERNELS=all" in lines[0] and "runs 'reference' instead" in lines[0]
  # jax's kernels are always taken where they cover the call
  q, k, v = rand_qkv(B=1, T=256, N=2, K=1, H=64, dtype=jnp.bfloat16)
  assert dense.dispatch_table(*dense.prepare(q, k, v, is_causal=True))["tpu"] == "splash"


def test_a_passing_verdict_for_this_kind_and_versions_lets_dispatch_take_the_kernel(on_gpu):
  path = _trust.write_verdict(GPU, {"pallas_gpu": {"passed": True}})
  assert path.parent.parent == on_gpu and dense.dispatch_table(*_sigmoid_call())["cuda"] == (
    "pallas_gpu"
  )
  data = json.loads(path.read_text())
  entry = data["kernels"]["pallas_gpu"]
  assert data["device_kind"] == GPU and entry["jax"] == [jax.__version__]
  assert entry["attnjax"] == attnjax.__version__
  assert entry["digest"] == _trust.digest_of("pallas_gpu")
  # a verdict of another jax version does not count
  path.write_text(json.dumps(dict(data, kernels={"pallas_gpu": dict(entry, jax=["0.0.1"])})))
  _trust._load.cache_clear()
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"
  # ... nor a failed one, nor one of another kind of device
  _trust.write_verdict(GPU, {"pallas_gpu": {"passed": False}})
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"
  _trust.write_verdict("NVIDIA A100-SXM4-80GB", {"pallas_gpu": {"passed": True}})
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"
  # another kernel's entry is kept when one is checked again
  _trust.write_verdict(GPU, {"mosaic_gpu": {"passed": True}})
  assert set(_trust.read_verdicts(GPU)) == {"pallas_gpu", "mosaic_gpu"}


def test_the_same_result_with_another_jax_version_joins_its_versions(on_gpu, monkeypatch):
  this = jax.__version__
  _trust.write_verdict(GPU, {"pallas_gpu": {"passed": True}})
  monkeypatch.setattr(jax, "__version__", "9.9.9")
  _trust.write_verdict(GPU, {"pallas_gpu": {"passed": True}})
  assert _trust.read_verdicts(GPU)["pallas_gpu"]["jax"] == sorted(["9.9.9", this])
  _trust.write_verdict(GPU, {"pallas_gpu": {"passed": False}})  # another result: replaced
  assert _trust.read_verdicts(GPU)["pallas_gpu"]["jax"] == ["9.9.9"]


def test_the_settings(on_gpu, monkeypatch):
  _trust.write_verdict(GPU, {"pallas_gpu": {"passed": True}})
  try:
    attnjax.config.kernels = "jax"  # never, even checked
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


@pytest.fixture
def fresh_warnings(monkeypatch):
  """The once-per-process record of deprecated names, empty for this test."""
  from attnjax._src import deprecation as _deprecation

  monkeypatch.setattr(_deprecation, "_warned", set())


def test_the_old_name_trusted_means_jax_and_warns_once(on_gpu, monkeypatch, fresh_warnings):
  _trust.write_verdict(GPU, {"pallas_gpu": {"passed": True}})
  try:
    with pytest.warns(
      DeprecationWarning,
      match=r"kernels = 'trusted' is deprecated; use "
      r"attnjax.config.kernels = 'jax'",
    ) as record:
      attnjax.config.kernels = "trusted"
      attnjax.config.kernels = "trusted"
    assert len(record) == 1 and attnjax.config.kernels == "jax"
    assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"  # as "jax"
    attnjax.config.kernels = None
    monkeypatch.setenv("ATTNJAX_KERNELS", "trusted")
    with pytest.warns(
      DeprecationWarning, match="ATTNJAX_KERNELS=trusted is deprecated; use ATTNJAX_KERNELS=jax"
    ) as record:
      assert attnjax.config.kernels == "jax"
      assert attnjax.config.kernels == "jax"
    assert len(record) == 1
    monkeypatch.setenv("ATTNJAX_KERNELS", "jax")
    assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"
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
  # "jax" keeps auto-dispatch off attnjax's kernels, never a kernel asked for by name:
  # pallas_gpu is traced here, and refuses to be lowered for the CPU.
  q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
  try:
    attnjax.config.kernels = "jax"
    with pytest.raises(ValueError, match="implementation='pallas_gpu' runs on a CUDA GPU only"):
      jax.jit(lambda q: attnjax.dot_product_attention(q, q, q, implementation="pallas_gpu"))(q)
  finally:
    attnjax.config.kernels = None


def test_a_multi_process_run_reads_shipped_verdicts_only(on_gpu, monkeypatch, caplog):
  # Each host has its own cache: every process must choose alike, so no local verdict is read;
  # a shipped one is the same on every host.
  caplog.set_level(logging.WARNING, logger="attnjax")
  _trust.write_verdict(GPU, {"pallas_gpu": {"passed": True}})
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"
  (line,) = [r.getMessage() for r in caplog.records if r.name == "attnjax"]
  assert "not checked: no shipped verdict" in line and "a run of 2 processes" in line
  assert "ATTNJAX_KERNELS=all" in line
  try:
    attnjax.config.kernels = "all"
    assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "pallas_gpu"
  finally:
    attnjax.config.kernels = None
  path = _trust.write_verdict(GPU, {"pallas_gpu": {"passed": True}}, shipped=True)  # TEST verdict
  assert path == on_gpu / "shipped" / "NVIDIA_H100_80GB_HBM3.json"
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "pallas_gpu"


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


def _log_lines(caplog):
  return [r.getMessage() for r in caplog.records if r.name == "attnjax"]


def test_a_shipped_verdict_counts_like_a_local_one(on_gpu):
  # The package's verdicts (here a TEST verdict in the fixture's folder, not the package's)
  # count with no local cache; a current local verdict decides before a shipped one.
  _trust.write_verdict(GPU, {"pallas_gpu": {"passed": True}}, shipped=True)
  assert not (on_gpu / "verdicts").exists()
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "pallas_gpu"
  assert _trust.verdict("pallas_gpu", GPU).source == "shipped"
  _trust.write_verdict(
    GPU, {"pallas_gpu": {"passed": False, "cases": {"sigmoid causal float32": False}}}
  )
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"


def test_the_package_ships_no_hand_written_verdict():
  # The folder holds only what `python -m attnjax.check --ship` wrote on a device: each file
  # names its device kind, and each entry its versions and the digest it was measured on.
  for path in _trust.PACKAGE_DIR.joinpath("verdicts").glob("*.json"):
    data = json.loads(path.read_text())
    assert path.name == _trust.verdict_path(data["device_kind"], shipped=True).name
    for name, entry in data["kernels"].items():
      assert {"attnjax", "jax", "digest", "cases", "passed"} <= set(entry), (path, name)
      assert entry["interpret"] is False, (path, name)


def test_a_kernel_whose_sources_changed_is_stale(on_gpu, monkeypatch, caplog, tmp_path):
  # The digest covers the kernel's package and the shared sources it runs: a copy digests
  # alike, and an edit of any of its files changes it.
  copy = tmp_path / "copy"
  for path in _trust.source_files("mosaic_gpu"):
    target = copy / path.relative_to(_trust.PACKAGE_DIR)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(path.read_bytes())
  assert _trust.digest_of("mosaic_gpu", copy) == _trust.digest_of("mosaic_gpu")
  assert _trust.digest_of("mosaic_gpu") != _trust.digest_of("pallas_gpu")
  for edited in ("kernels/mosaic_gpu/kernel.py", "normalizers.py"):
    path = copy / edited
    before = path.read_text()
    path.write_text(before.replace("def ", "def  ", 1))
    assert _trust.digest_of("mosaic_gpu", copy) != _trust.digest_of("mosaic_gpu"), edited
    path.write_text(before)
  # A verdict measured on other sources (here: this tree's digest patched) counts no more:
  # the kernel drops back to opt-in with one line saying so and naming the check.
  caplog.set_level(logging.WARNING, logger="attnjax")
  _trust.write_verdict(GPU, {"pallas_gpu": {"passed": True}}, shipped=True)
  monkeypatch.setattr(_trust, "source_digest", lambda kernel: "0" * 64)
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"
  (line,) = _log_lines(caplog)
  assert (
    "pallas_gpu is not used on NVIDIA H100 80GB HBM3 for sigmoid causal float32 calls: "
    "stale: its sources changed since its shipped verdict" in line
  )
  assert "run `python -m attnjax.check --platform cuda --kernel pallas_gpu`" in line


def test_a_verdict_is_per_case_class(on_gpu, caplog):
  # One failed case blocks the kernel for calls of its class only; a class the check has no
  # case for counts as passed only when every case did.
  caplog.set_level(logging.WARNING, logger="attnjax")
  cases = {"sigmoid causal float32": False, "sigmoid window float32": True}
  _trust.write_verdict(GPU, {"pallas_gpu": {"passed": False, "cases": cases}})
  q, k, v = rand_qkv(B=1, T=64, N=2, K=1, H=8, dtype=jnp.float32)
  table = lambda **kw: dense.dispatch_table(*dense.prepare(q, k, v, normalizer="sigmoid", **kw))
  assert table(window=(8, 0))["cuda"] == "pallas_gpu"
  assert table(is_causal=True)["cuda"] == "reference"
  assert table()["cuda"] == "reference"  # "sigmoid full float32": not checked, and a case failed
  (line,) = _log_lines(caplog)
  assert "for sigmoid causal float32 calls: failed sigmoid causal float32" in line
  assert _trust.verdict("pallas_gpu", GPU, "sigmoid full float32") == _trust.Verdict(
    "failed", "sigmoid causal float32", "local"
  )
  _trust.write_verdict(
    GPU, {"pallas_gpu": {"passed": True, "cases": {"sigmoid window float32": True}}}
  )
  assert table()["cuda"] == "pallas_gpu"


def test_the_case_class_of_a_call():
  q, k, v = rand_qkv(B=1, T=16, N=2, K=1, H=8, dtype=jnp.bfloat16)
  seg = jnp.zeros((1, 16), jnp.int32)
  klass = lambda **kw: _trust.call_class(*dense.prepare(q, k, v, **kw))
  assert klass(normalizer="sigmoid", is_causal=True) == "sigmoid causal bfloat16"
  assert klass(is_causal=True, window=(4, 0)) == "softmax window bfloat16"
  assert klass(is_causal=True, window=(4, 0), segment_ids=seg) == "softmax segments bfloat16"
  assert klass() == "softmax full bfloat16"
  assert _trust.case_class("relu", "causal", jnp.float16) == "relu causal float16"


# ---------------------------------------------------------------------------
# python -m attnjax.check


@pytest.fixture
def small_check(monkeypatch, cache):
  """The check on one small case, in interpret mode."""
  monkeypatch.setattr(check, "INTERPRET_SHAPE", (2, 16, 2, 1, 8))
  monkeypatch.setattr(check, "check_cases", lambda impl: [("sigmoid", "causal", "float32")])
  monkeypatch.setattr(
    _target, "device_kind", lambda platform: "cpu" if platform == "cuda" else None
  )
  return cache


def test_a_passing_check_writes_the_verdict_that_dispatch_reads(small_check, tmp_path):
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"
  out = tmp_path / "report.md"
  assert check.main(["--interpret", "--out", str(out)]) == 0
  entry = _trust.read_verdicts("cpu")["pallas_gpu"]
  errors = entry.pop("errors")
  assert entry == {
    "passed": True,
    "checks": 1,
    "failed": [],
    "shape": [2, 16, 2, 1, 8],
    "interpret": True,
    "cases": {"sigmoid causal float32": True},
    "attnjax": attnjax.__version__,
    "jax": [jax.__version__],
    "digest": _trust.digest_of("pallas_gpu"),
  }
  assert set(errors) == {"sigmoid causal float32"} and errors["sigmoid causal float32"] < 2e-3
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "pallas_gpu"
  text = out.read_text()
  assert "- [ok] sigmoid causal float32: max row err" in text
  assert "verdict: pallas_gpu passed on 'cpu'" in text


def test_a_failing_comparison_writes_no_passing_verdict(small_check, monkeypatch, tmp_path):
  _trust.write_verdict("cpu", {"pallas_gpu": {"passed": True}})  # an earlier, passing run

  def off_by_a_little(inputs, opts):
    out, stats = dense.reference(inputs, opts)
    return out * 1.01, stats

  monkeypatch.setattr(check, "_kernel_run", lambda impl, interpret: off_by_a_little)
  assert check.main(["--interpret", "--out", str(tmp_path / "report.md")]) == 1
  entry = _trust.read_verdicts("cpu")["pallas_gpu"]
  assert entry["passed"] is False and "sigmoid causal float32" in entry["failed"][0]
  assert entry["cases"] == {"sigmoid causal float32": False}
  assert dense.dispatch_table(*_sigmoid_call())["cuda"] == "reference"


def test_ship_writes_the_checks_own_verdict_into_the_package_folder(
  small_check, monkeypatch, tmp_path
):
  # --ship runs on a device only; here its refusal of --interpret is lifted to see what it
  # writes: the same entry as the local verdict, in the (fixture's) package folder.
  monkeypatch.setattr(check, "_refusal", lambda args: None)
  assert check.main(["--interpret", "--ship", "--out", str(tmp_path / "report.md")]) == 0
  shipped = _trust.read_verdicts("cpu", shipped=True)
  assert shipped == _trust.read_verdicts("cpu") and shipped["pallas_gpu"]["passed"] is True
  assert (small_check / "shipped" / "cpu.json").exists()


def test_all_checks_every_kernel_of_the_platform_and_ship_needs_a_device(small_check, tmp_path):
  # The lists are the dense engines vouched for by the device check, per platform.
  assert check.PLATFORM_KERNELS == {"cuda": ("pallas_gpu", "mosaic_gpu"), "tpu": ("pallas_tpu",)}
  assert check.BUILTIN == {"cuda": "cudnn", "tpu": "splash"}
  assert check.kernels_to_check("cuda", "all", interpret=True) == ("pallas_gpu", "mosaic_gpu")
  assert check.kernels_to_check("cuda", "all", interpret=False) == ("pallas_gpu",)  # no Hopper
  assert check.kernels_to_check("tpu", "all", interpret=False) == ("pallas_tpu",)
  assert check.kernels_to_check("cuda", "default", interpret=False) == ("pallas_gpu",)
  assert check.kernels_to_check("gpu", "default", interpret=False) == ("pallas_gpu",)  # an alias
  with pytest.raises(ValueError, match="--kernel pallas_tpu is not a kernel of --platform cuda"):
    check.kernels_to_check("cuda", "pallas_tpu", interpret=False)
  out = tmp_path / "report.md"
  assert check.main(["--interpret", "--ship", "--out", str(out)]) == 2
  assert check.main(["--interpret", "--kernel", "pallas_tpu", "--out", str(out)]) == 2
  assert not out.exists() and not (tmp_path / "shipped").exists()


def test_the_error_of_one_wrong_row_is_not_hidden_by_larger_rows():
  rng = np.random.default_rng(0)
  want = rng.standard_normal((4, 40, 16))
  want[0] *= 30.0  # one batch row of large gradients
  got = want * (1 + 1e-3 * rng.standard_normal(want.shape))
  assert check.row_error(got, want) < 1e-2
  got[2, 7] = want[2, 7] * 1.8  # one row 80% off, as pallas_gpu's softpick segments dq was
  assert check.row_error(got, want) > 0.5
  # divided by the tensor's largest value (the former metric), the same row hid at ~1e-2
  assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 0.05
  # a row of near-zero values is measured against a floor of the tensor's scale, not its own
  got, want = np.ones((8, 4)), np.ones((8, 4))
  want[3], got[3] = 1e-6, 2e-6
  assert check.row_error(got, want) < 1e-5


def test_the_cases_compile_in_threads_and_keep_their_order(monkeypatch):
  import threading

  threads, compile_ = set(), jax.stages.Lowered.compile

  def compile_here(self, *a, **kw):
    threads.add(threading.get_ident())
    return compile_(self, *a, **kw)

  monkeypatch.setattr(jax.stages.Lowered, "compile", compile_here)
  x = jnp.arange(3.0)
  programs = [(lambda x, i=i: x * i + jnp.sin(x) ** i, (x,)) for i in range(4)]
  compiled = check.compile_all(programs, workers=2)
  assert threading.get_ident() not in threads  # compiled by the pool, not this thread
  for (f, args), c in zip(programs, compiled):
    np.testing.assert_allclose(c(*args), f(*args), rtol=1e-6)


def test_section_3_compares_with_the_reference_at_a_small_shape():
  # On the CPU: auto-dispatch and jax.nn's XLA path stand in for cuDNN; the padding mask is
  # built inside each program from the lengths argument.
  r = check.Report()
  check.check_cudnn_and_blockwise(r, B=2, T=64, impls=(None, "xla"))
  assert len(r.lines) == 2 + 3 * 3 + 2 and not r.failed, r.lines


def test_the_speed_table_times_back_to_back_calls(monkeypatch):
  events = []
  monkeypatch.setattr(jax, "block_until_ready", lambda x: events.append("wait") or x)
  assert check._timed(lambda: events.append("call"), (), repeats=3, calls=4) >= 0
  assert events == ["call", "wait"] + (["call"] * 4 + ["wait"]) * 3


def test_a_case_takes_its_masks_as_arguments_and_the_reference_runs_at_highest_precision(
  monkeypatch,
):
  # Closed-over masks would be constants XLA folds while compiling (1.7 s for a padding mask
  # on the H200); the reference runs in fp32 at the highest precision whatever the default.
  monkeypatch.setattr(check, "INTERPRET_SHAPE", (2, 16, 2, 1, 8))
  _, window, args = check._case_args("pallas_gpu", interpret=True)
  program = check.case_program(dense.reference, "softpick", "segments", window)
  text = jax.jit(program).lower(*args["bfloat16"]).as_text()
  (main,) = [line for line in text.splitlines() if "func.func public @main" in line]
  assert "tensor<2x16xi32>" in main  # the segment ids: an argument
  assert not [
    line
    for line in text.splitlines()
    if "stablehlo.constant" in line and "tensor<2x16xi32>" in line
  ]
  with jax.default_matmul_precision("bfloat16"):
    jaxpr = str(jax.make_jaxpr(program)(*args["bfloat16"]))
  dots = [line for line in jaxpr.splitlines() if "dot_general[" in line or "precision=" in line]
  assert any("HIGHEST" in line for line in dots) and any("DEFAULT" in line for line in dots)


def test_the_commands_stop_at_once_without_the_device(tmp_path):
  if jax.default_backend() != "cpu":
    pytest.skip("checks the behaviour on a host without a GPU or TPU")
  env = dict(os.environ, PYTHONPATH=str(ROOT), ATTNJAX_CACHE_DIR=str(tmp_path))

  def run(*argv):
    return subprocess.run(
      [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )

  proc = run("-m", "attnjax.check", "--help")
  assert proc.returncode == 0 and "usage: python -m attnjax.check" in proc.stdout, proc.stderr
  assert "--interpret" in proc.stdout and "--budget" in proc.stdout
  proc = run("-m", "attnjax.check", "--out", str(tmp_path / "x.md"))
  assert proc.returncode == 2 and "needs a GPU" in proc.stdout, (proc.stdout, proc.stderr)
  proc = run("experiments/device_check.py", "--platform", "tpu", "--out", str(tmp_path / "y.md"))
  assert proc.returncode == 2 and "needs a TPU" in proc.stdout, (proc.stdout, proc.stderr)
  assert not list(tmp_path.glob("*.md")) and not (tmp_path / "verdicts").exists()
