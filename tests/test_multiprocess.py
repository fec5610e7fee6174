"""Training across processes: ``python -m attnjax.train.launch`` under ``jax.distributed``.

Two local processes of four CPU devices each (coordinator on 127.0.0.1, gloo
collectives) train one run over the 8 devices: each process feeds its own rows
of every batch and writes its shards of every checkpoint. Their losses equal
one process's over 8 devices; a process killed with SIGKILL mid-run stops the
other, and the same command again resumes and ends where an uninterrupted run
ends, bit for bit.
"""

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from attnjax._src.train import rundir
from attnjax._src.train.loop import train
from test_mesh import SMALLER, cpu_preset, losses

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(out, steps=20, checkpoint_every=10, mesh="data=-1"):
  overrides = [f"--config.mesh.{kv}" for kv in mesh.split(",")]
  return [
    sys.executable,
    "-m",
    "attnjax.train.launch",
    "--processes",
    "2",
    "--devices-per-process",
    "4",
    "--",
    sys.executable,
    "experiments/train.py",
    "--config",
    "experiments/configs/shakespeare.py:preset=cpu",
    "--config.data.name=bigram_backcopy",
    # test_mesh.cpu_preset's model, which the comparison runs
    *(f"--config.{dotted}={value}" for dotted, value in SMALLER.items()),
    f"--config.train.steps={steps}",
    "--config.train.eval_every=1000",
    "--config.train.probe_every=1000",
    f"--config.train.checkpoint_every={checkpoint_every}",
    "--config.train.progress=false",
    "--config.train.plots=false",
    *overrides,
    "--out",
    str(out),
  ]


def env():
  # The processes compile as this one does (the suite's fast compiles, conftest), so their
  # losses can equal an in-process run's.
  fast = jax.config.read("jax_disable_most_optimizations")
  return dict(
    os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS=str(int(fast))
  )


def run(out, **kw):
  return subprocess.run(
    command(out, **kw), cwd=REPO, env=env(), capture_output=True, text=True, timeout=900
  )


@pytest.mark.parametrize(
  "mesh",
  [
    # The sequence sharded over all 8 devices, across both processes: each process feeds
    # its half of every row's tokens, and the attention ring crosses processes.
    "data=1,context=8",
    pytest.param("data=-1", marks=pytest.mark.slow),
  ],
)
def test_two_processes_train_like_one(tmp_path, mesh):
  proc = run(tmp_path / "two", mesh=mesh, steps=4, checkpoint_every=2)
  assert proc.returncode == 0, proc.stdout[-3000:]
  assert "[p0]" in proc.stdout and "[p1]" in proc.stdout
  summary = rundir.RunDir(str(tmp_path / "two")).read_summary()
  assert summary["status"] == "finished" and summary["devices"] == 8
  one = train(cpu_preset(tmp_path / "one", dict(data=8), steps=4, checkpoint_every=2))
  assert one["status"] == "finished"
  assert len(losses(tmp_path / "two")) == 4
  np.testing.assert_allclose(losses(tmp_path / "two"), losses(tmp_path / "one"), rtol=1e-5)


def _process_pids(marker: str, process_id: str) -> list[int]:
  pids = []
  for pid in os.listdir("/proc"):
    if not pid.isdigit():
      continue
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmd = f.read().decode(errors="replace")
      with open(f"/proc/{pid}/environ", "rb") as f:
        environ = f.read().decode(errors="replace").split("\0")
    except OSError:
      continue
    if (
      marker in cmd and "experiments/train.py" in cmd and f"JAX_PROCESS_ID={process_id}" in environ
    ):
      pids.append(int(pid))
  return pids


@pytest.mark.slow
def test_sigkill_of_one_process_then_the_same_command_resumes_bit_for_bit(tmp_path):
  full = run(tmp_path / "full", steps=30, checkpoint_every=5)
  assert full.returncode == 0, full.stdout[-3000:]
  out = tmp_path / "killed"
  launcher = subprocess.Popen(
    command(out, steps=30, checkpoint_every=5),
    cwd=REPO,
    env=env(),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  ckpt = out / "checkpoints" / "10"
  deadline = time.time() + 600
  while not ckpt.exists() and time.time() < deadline and launcher.poll() is None:
    time.sleep(0.2)
  assert ckpt.exists(), "no checkpoint 10 before the deadline"
  (pid,) = _process_pids(str(out), "1")
  os.kill(pid, signal.SIGKILL)
  launcher.wait(timeout=120)
  assert launcher.returncode != 0  # the other process was stopped, not left waiting
  assert rundir.RunDir(str(out)).read_summary()["status"] == "running"
  again = run(out, steps=30, checkpoint_every=5)
  assert again.returncode == 0, again.stdout[-3000:]
  summary = rundir.RunDir(str(out)).read_summary()
  assert summary["status"] == "finished" and summary["resumed_from"] >= 10
  drop = ("tokens_per_s",)
  a = [
    {k: v for k, v in r.items() if k not in drop}
    for r in rundir.read_jsonl(rundir.RunDir(str(tmp_path / "full")).metrics)
  ]
  b = [
    {k: v for k, v in r.items() if k not in drop}
    for r in rundir.read_jsonl(rundir.RunDir(str(out)).metrics)
  ]
  assert a == b
