"""``experiments/bench.py --suite gpu`` on this CPU at tiny shapes: the table a GPU run prints.

The GPU-only paths (cuDNN, ``mosaic_gpu``, ``pallas_gpu``) say "needs a CUDA GPU" in their
cells; every other path is compiled, timed back to back and divided by the column's
baseline (cuDNN on a GPU, ``jax.nn`` xla here). The JSON lines file written as the run goes
renders the same table again (what a run cut short by its timeout leaves).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEQ = (64, 128)
NORMALIZERS = ("softmax", "sigmoid")
CELL = re.compile(r"^(\d[\d.e+-]*) \((\d+\.\d\d)x\)$")


def load_bench():
  """experiments/bench.py as a module (registered: its dataclasses look their module up)."""
  path = ROOT / "experiments" / "bench.py"
  spec = importlib.util.spec_from_file_location("experiments_bench", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def table_rows(text: str) -> tuple[list[str], dict[str, list[str]]]:
  """The header's columns and ``{path: cells}`` of the first markdown table in ``text``."""
  lines = [line for line in text.splitlines() if line.startswith("|")]
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  rows = {}
  for line in lines[2:]:
    cells = [c.strip() for c in line.strip("|").split("|")]
    rows[cells[0]] = cells[1:]
  return header[1:], rows


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory):
  jsonl = tmp_path_factory.mktemp("bench") / "gpu.jsonl"
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  cmd = [
    sys.executable,
    "experiments/bench.py",
    "--suite",
    "gpu",
    "--seq",
    ",".join(map(str, SEQ)),
    "--tokens",
    "256",
    "--heads",
    "2",
    "--head-dim",
    "16",
    "--normalizers",
    ",".join(NORMALIZERS),
    "--calls",
    "2",
    "--repeats",
    "1",
    "--jsonl",
    str(jsonl),
  ]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout, jsonl


@pytest.mark.slow  # ~45 s: the gpu suite's subprocess; test_gpu_table_from_a_run_cut_short reads its table
def test_gpu_suite_table_on_the_cpu(gpu_run):
  stdout, jsonl = gpu_run
  table = stdout[stdout.index("## gpu") :]
  columns, rows = table_rows(table)
  assert columns == [f"T={T} {p}" for T in SEQ for p in ("fwd", "fwd+bwd")]
  kernels = [f"attnjax {impl} {n}" for impl in ("mosaic_gpu", "pallas_gpu") for n in NORMALIZERS]
  runs = ["jax.nn xla"] + [
    f"attnjax {how} {n}" for how in ("auto", "blockwise") for n in ("softmax", "sigmoid")
  ]
  assert list(rows) == ["jax.nn cudnn", runs[0]] + runs[1:] + kernels
  for path in ["jax.nn cudnn"] + kernels:
    assert rows[path] == ["needs a CUDA GPU"] * len(columns), (path, rows[path])
  # Every other cell is TFLOP/s and its speed over jax.nn xla (the baseline without cuDNN),
  # as the JSON lines record them.
  records = {
    (r["path"], f"T={r['T']} {r['pass']}"): r
    for r in map(json.loads, jsonl.read_text().splitlines())
    if r["kind"] == "time"
  }
  assert "Baselines: " + "; ".join(f"{c}: jax.nn xla" for c in columns) + "." in table
  for path in runs:
    assert len(rows[path]) == len(columns)
    for column, cell in zip(columns, rows[path]):
      m = CELL.match(cell)
      assert m, (path, column, cell)
      r, base = records[(path, column)], records[("jax.nn xla", column)]
      assert r["error"] is None and r["calls"] >= 1 and r["ms"] > 0
      T = int(column.split()[0][2:])
      flops = 2.0 * (256 // T) * 2 * T * T * 16 * (3.5 if "bwd" in column else 1.0)
      assert r["flops"] == flops and r["tflops"] == pytest.approx(flops / r["ms"] / 1e9)
      assert float(m.group(1)) == pytest.approx(r["tflops"], rel=5e-3)
      assert float(m.group(2)) == pytest.approx(r["tflops"] / base["tflops"], abs=5e-3)
  assert all(c.endswith("(1.00x)") for c in rows["jax.nn xla"])
  assert "auto dispatch ran: T=64 softmax -> " in table
  speedups = re.search(r"blockwise softmax over jax.nn xla: (.*)", table).group(1).split(", ")
  assert [s.rsplit(" ", 1)[0] for s in speedups] == columns


@pytest.mark.slow  # the gpu suite's subprocess (~45 s, shared with the table test)
def test_gpu_table_from_a_run_cut_short(gpu_run, tmp_path):
  # A run killed by its timeout leaves the lines written so far, the last one maybe cut: the
  # cells it timed, and "not run" for the others.
  stdout, jsonl = gpu_run
  lines = jsonl.read_text().splitlines()
  kept = [line for line in lines if '"T": 128' not in line or '"kind": "time"' not in line]
  cut = tmp_path / "cut.jsonl"
  cut.write_text("\n".join(kept) + "\n" + lines[-1][:20])
  env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "experiments/bench.py", "--gpu-table", str(cut)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr
  columns, rows = table_rows(proc.stdout)
  full_columns, full_rows = table_rows(stdout[stdout.index("## gpu") :])
  assert columns == full_columns
  assert rows == {path: cells[:2] + ["not run"] * 2 for path, cells in full_rows.items()}


def test_slow_paths_are_timed_with_fewer_calls():
  bench = load_bench()
  calls = []

  def slow(x):
    calls.append(x)
    time.sleep(0.05)
    return x

  # A warm-up and a measured call, then what fits 0.2 s: at most 4 calls in one round.
  best, median, n, rounds = bench._gpu_time(slow, (1,), calls=10, rounds=5, seconds=0.2)
  assert 1 <= n <= 4 and rounds == 1 and len(calls) == 2 + n
  assert 0.05 <= best <= median


def test_mla_suite_times_its_decode_rows_and_prints_the_cache_table(capsys):
  """``--suite mla`` at S=256: four decode rows timed, the two MLA forms equal, and the
  cache table's verdict (576 numbers per token against the 16 expanded heads' 5120)."""
  import argparse

  import numpy as np

  bench = load_bench()
  cases = list(bench.mla_suite(argparse.Namespace(sizes="256", repeats=1)))
  table = capsys.readouterr().out
  assert "| MLA latent cache (c, k_rope) | 576 | 1152 | 0.3 | 1.000 |" in table
  assert "latent / expanded heads' cache: 0.113 (target <= 0.25: met)" in table
  assert [c.baseline for c in cases] == [True, False, False, False]
  assert {c.shape for c in cases} == {"decode S=256"} and all(c.tokens == 1 for c in cases)
  assert all(isinstance(t, tuple) for t in bench.time_group(cases, 1))
  expanded, absorbed = cases[2], cases[3]
  np.testing.assert_allclose(
    expanded.fn(*expanded.args), absorbed.fn(*absorbed.args), rtol=1e-4, atol=1e-5
  )


def test_hybrid_suite_prints_attnjax_rows_and_says_when_torch_is_missing(capsys):
  """``--suite hybrid`` at T=64 with a Python that has no torch: attnjax's prefill and decode
  rows, and one line saying why transformers' side did not run."""
  import argparse

  bench = load_bench()
  args = argparse.Namespace(sizes="64", repeats=1, torch_python="/nonexistent/python")
  assert bench.hybrid_suite(args) == []
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith("| 64 |")]
  assert [r.split("|")[2].strip() for r in rows] == ["prefill", "decode"]
  assert all(r.rstrip().endswith("| - | - | - |") for r in rows)
  assert "transformers side not run: /nonexistent/python" in out
