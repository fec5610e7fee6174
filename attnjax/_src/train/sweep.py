"""Sweeps: many runs, resumable, one after another in this process or one process per arm.

Implementation behind the public module :mod:`attnjax.train.sweep`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import traceback
from typing import Any, Iterable

from attnjax._src.train import rundir

_REPO = str(pathlib.Path(__file__).resolve().parents[3])


@dataclasses.dataclass
class Arm:
  """One run of a sweep: a label for the report and its full config (``run_dir`` set).

  Attributes:
    name: the label, e.g. ``"dense lr=0.01"``.
    config: the run's config.
  """

  name: str
  config: Any


def arm(base: Any, name: str, run_dir: str, **changes: Any) -> Arm:
  """An arm: a copy of ``base`` with dotted-key changes and its own run directory.

  Args:
    base: the sweep's base config (not changed).
    name: the arm's label.
    run_dir: the arm's run directory.
    **changes: ``{"opt.lr": 3e-3, "variant": "cosine"}``-style dotted keys.

  Returns:
    The :class:`.Arm`.

  Raises:
    KeyError: an unknown key (named).
  """
  cfg = copy.deepcopy(base)
  for key, value in changes.items():
    node = cfg
    parts = key.split(".")
    for p in parts[:-1]:
      node = node[p]
    if parts[-1] not in node:
      raise KeyError(f"config key {key!r} is unknown")
    node[parts[-1]] = value
  cfg.run_dir = run_dir
  return Arm(name, cfg)


def _record_failure(arm: Arm, error: str) -> dict:
  summary = {
    "status": "failed",
    "variant": arm.config.variant,
    "run_dir": arm.config.run_dir,
    "error": error,
  }
  rundir.write_json(rundir.RunDir(arm.config.run_dir).summary, summary)
  return summary


def run_in_process(arm: Arm) -> dict:
  """Trains the arm in this process; a failure is recorded as its summary, not raised.

  Args:
    arm: the :class:`.Arm`.

  Returns:
    The run's summary, or ``{"status": "failed", "error", ...}`` (also written).
  """
  from attnjax._src.train.loop import train

  try:
    return train(arm.config)
  except Exception:  # a broken arm is reported, the sweep continues
    return _record_failure(arm, traceback.format_exc(limit=3))


def run_in_subprocess(arm: Arm) -> dict:
  """Runs the arm with ``python -m attnjax._src.train.run_config`` (fresh process, own compile).

  Args:
    arm: the :class:`.Arm`.

  Returns:
    The run's summary, or a ``"failed"`` summary when the process died without one.
  """
  run = rundir.RunDir(arm.config.run_dir)
  if run.is_done():
    return run.read_summary()
  os.makedirs(run.root, exist_ok=True)
  spec = run.path("requested_config.json")
  rundir.write_json(spec, arm.config.to_dict())
  env = dict(os.environ)
  env["PYTHONPATH"] = _REPO + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run(
    [sys.executable, "-m", "attnjax._src.train.run_config", spec], env=env, check=False
  )
  summary = run.read_summary()
  if proc.returncode != 0 and (not summary or summary.get("status") == "running"):
    return _record_failure(arm, f"process exited with code {proc.returncode}")
  return summary or _record_failure(arm, "no summary written")


def run_sweep(arms: Iterable[Arm], *, processes: bool = False, verbose: bool = True) -> list[dict]:
  """Runs every arm, skipping those already ended (a rerun of a sweep resumes it).

  Args:
    arms: the :class:`.Arm` objects, run in order.
    processes: each arm in its own process (:func:`.run_in_subprocess`).
    verbose: print one line per arm.

  Returns:
    The summaries in order, each with the arm's ``"arm"`` label added.
  """
  results = []
  for a in arms:
    run = rundir.RunDir(a.config.run_dir)
    if run.is_done():
      summary = run.read_summary()
      if verbose:
        print(f"[skip] {a.name}: already {summary['status']}", flush=True)
    else:
      summary = run_in_subprocess(a) if processes else run_in_process(a)
      if verbose:
        loss = summary.get("val_loss")
        print(
          f"[{summary.get('status')}] {a.name}: val loss "
          f"{'-' if loss is None else f'{loss:.3f}'}"
          + (
            f", diverged at step {summary.get('diverged_step')}"
            if summary.get("status") == "diverged"
            else ""
          ),
          flush=True,
        )
    results.append(dict(summary, arm=a.name))
  return results


def config_from_json(path: str):
  """A ConfigDict from a resolved ``config.json``.

  Args:
    path: the file.

  Returns:
    The ``ml_collections.ConfigDict``.
  """
  import ml_collections

  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))
