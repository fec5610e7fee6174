"""Sweeps: many runs, resumable, one after another in this process or one process per arm.

The seeds of an arm (:func:`.seeded`) form a group that trains as one stacked program
(:func:`attnjax.train.train_seeds`).

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
import time
import traceback
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from attnjax._src.train import rundir

_REPO = str(pathlib.Path(__file__).resolve().parents[3])


@dataclasses.dataclass
class Arm:
  """One run of a sweep: a label for the report and its full config (``run_dir`` set).

  Attributes:
    name: the label, e.g. ``"dense lr=0.01"``.
    config: the run's config.
    group: arms with the same non-empty group, next to each other in a sweep, differ only in
      their seed and train together (:func:`.seeded` sets it).
  """

  name: str
  config: Any
  group: str = ""


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


def parse_seeds(value: Any, *, key: str = "sweep.seeds") -> list[int]:
  """The seeds of a setting: ``"0,1,2"``, one int, or a list of ints; distinct, ``>= 0``.

  Args:
    value: the setting's value.
    key: the setting's name, for messages.

  Returns:
    The seeds, in the order given.

  Raises:
    ValueError: an empty setting, an item that is not an int (a bool, a float, a word), a
      negative seed or a repeated one; the message names ``key`` and the item.
  """
  items = str(value).split(",") if isinstance(value, str) else value
  if isinstance(items, (int, np.integer)) and not isinstance(items, bool):
    items = [items]
  if not isinstance(items, (list, tuple)):
    raise ValueError(f"{key}={value!r} is not a list of ints; give e.g. {key}=0,1,2")
  seeds = []
  for item in items:
    text = item.strip() if isinstance(item, str) else None
    if text == "":
      continue
    if text is not None and text.lstrip("-").isdigit():
      item = int(text)
    if isinstance(item, bool) or not isinstance(item, (int, np.integer)):
      raise ValueError(
        f"{key}={value!r} is not a list of ints: {item!r} is not an int; give e.g. {key}=0,1,2"
      )
    if item < 0:
      raise ValueError(f"{key}={value!r}: seeds must be >= 0, got {int(item)}")
    if int(item) in seeds:
      raise ValueError(f"{key}={value!r} repeats seed {int(item)}; each seed once")
    seeds.append(int(item))
  if not seeds:
    raise ValueError(f"{key} is empty; give at least one seed, e.g. {key}=0,1,2")
  return seeds


def seeded(arm: Arm, seeds: Sequence[int]) -> list[Arm]:
  """The arm once per seed, as one group: run dirs ``<run_dir>/seed=<s>``.

  Args:
    arm: the arm (its config's ``seed`` is replaced).
    seeds: the seeds (:func:`attnjax.train.sweep.parse_seeds` checks a setting).

  Returns:
    One :class:`.Arm` per seed, named ``"<name> seed=<s>"``, all of group ``arm.name``.
  """
  out = []
  for s in seeds:
    cfg = copy.deepcopy(arm.config)
    cfg.seed = int(s)
    cfg.run_dir = os.path.join(arm.config.run_dir, f"seed={int(s)}")
    out.append(Arm(f"{arm.name} seed={int(s)}", cfg, group=arm.name))
  return out


def variant_lr_arms(
  base: Any, out: str, pairs: Sequence[tuple[str, float]], seeds: Sequence[int]
) -> list[Arm]:
  """The arms of variants at learning rates, each at every seed (one group per pair).

  Run directories ``<out>/<variant>/lr=<lr>/seed=<s>``; every config is validated before
  any arm trains.

  Args:
    base: the sweep's config.
    out: the sweep's folder.
    pairs: ``(variant, peak LR)`` of each arm, in order.
    seeds: the seeds of every arm.

  Returns:
    The :class:`.Arm` objects, seeds of one pair next to each other.

  Raises:
    ValueError: a config that does not validate (the key named).
  """
  from attnjax._src.train.config import validate

  arms = []
  for variant, lr in pairs:
    a = arm(
      base,
      f"{variant} lr={float(lr):g}",
      os.path.join(out, variant, f"lr={float(lr):g}"),
      variant=variant,
      **{"opt.lr": float(lr)},
    )
    validate(a.config)
    arms += seeded(a, seeds)
  return arms


def folders(arms: Iterable[Arm], root: str) -> list[str]:
  """The arms' folders relative to ``root``, in order, each once: a seeded arm's is the
  folder above its seeds' run directories (what a report calls the arm)."""
  out: list[str] = []
  for a in arms:
    path = os.path.dirname(a.config.run_dir) if a.group else a.config.run_dir
    rel = os.path.relpath(path, root)
    if rel not in out:
      out.append(rel)
  return out


def parse_lrs(text: Any, *, key: str) -> list[float]:
  """Learning rates of a comma-separated setting; ValueError naming ``key`` for one that is
  not a positive number."""
  out = []
  for item in str(text).split(","):
    if not item.strip():
      continue
    try:
      lr = float(item)
    except ValueError:
      raise ValueError(f"{key}={text!r}: {item.strip()!r} is not a number") from None
    if not lr > 0:
      raise ValueError(f"{key}={text!r}: learning rates must be > 0, got {lr:g}")
    out.append(lr)
  return out


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


def run_group_in_process(arms: Sequence[Arm], *, keep: Optional[list] = None) -> list[dict]:
  """Trains arms that differ only in their seed together in this process
  (:func:`attnjax.train.train_seeds`, which appends to ``keep``); a failure is recorded as
  each arm's summary."""
  from attnjax._src.train.seeds import train_seeds

  try:
    return train_seeds([a.config for a in arms], keep=keep)
  except Exception:  # a broken group is reported, the sweep continues
    error = traceback.format_exc(limit=3)
    return [_record_failure(a, error) for a in arms]


def run_in_subprocess(arm: Arm) -> dict:
  """Runs the arm with ``python -m attnjax._src.train.run_config`` (fresh process, own compile).

  Args:
    arm: the :class:`.Arm`.

  Returns:
    The run's summary, or a ``"failed"`` summary when the process died without one.
  """
  return run_group_in_subprocess([arm])[0]


def run_group_in_subprocess(arms: Sequence[Arm]) -> list[dict]:
  """Runs arms that differ only in their seed in one fresh process, together (one run: alone).

  Args:
    arms: the :class:`.Arm` objects.

  Returns:
    Their summaries, or ``"failed"`` summaries for runs the process left without one.
  """
  runs = [rundir.RunDir(a.config.run_dir) for a in arms]
  if all(r.is_done() for r in runs):
    return [r.read_summary() for r in runs]
  specs = []
  for a, run in zip(arms, runs):
    os.makedirs(run.root, exist_ok=True)
    specs.append(run.path("requested_config.json"))
    rundir.write_json(specs[-1], a.config.to_dict())
  env = dict(os.environ)
  env["PYTHONPATH"] = _REPO + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run(
    [sys.executable, "-m", "attnjax._src.train.run_config", *specs], env=env, check=False
  )
  out = []
  for a, run in zip(arms, runs):
    summary = run.read_summary()
    if proc.returncode != 0 and (not summary or summary.get("status") == "running"):
      summary = _record_failure(a, f"process exited with code {proc.returncode}")
    out.append(summary or _record_failure(a, "no summary written"))
  return out


def groups(arms: Iterable[Arm]) -> list[list[Arm]]:
  """``arms`` cut into the runs that train together: neighbours of one non-empty group."""
  out: list[list[Arm]] = []
  for a in arms:
    if out and a.group and out[-1][0].group == a.group:
      out[-1].append(a)
    else:
      out.append([a])
  return out


def run_sweep(
  arms: Iterable[Arm], *, processes: bool = False, verbose: bool = True, root: Optional[str] = None
) -> list[dict]:
  """Runs every arm, skipping those already ended (a rerun of a sweep resumes it).

  Neighbouring arms of one group (:func:`.seeded`) train together.

  Args:
    arms: the :class:`.Arm` objects, run in order.
    processes: each arm (or group) in its own process (:func:`.run_group_in_subprocess`).
    verbose: print one line per arm.
    root: the sweep's folder. When given and some arm trains, the host and its load while
      the sweep runs are recorded in ``root/host.json``
      (:class:`attnjax._src.train.host.HostMonitor`), and, in process, each arm's compiled step
      is then timed alone, interleaved across arms, into ``root/throughput.json``
      (:func:`attnjax._src.train.seeds.bare_step_rates`).

  Returns:
    The summaries in order, each with the arm's ``"arm"`` label added.
  """
  from attnjax._src.train import host, seeds

  arms = list(arms)
  todo = [a for a in arms if not rundir.RunDir(a.config.run_dir).is_done()]
  if root is None or not todo:
    return _run_all(arms, processes, verbose, None)
  keep: Optional[list] = None if processes else []
  with host.HostMonitor(root):
    results = _run_all(arms, processes, verbose, keep)
    if keep:
      rates = seeds.bare_step_rates(keep)
      rates["measured"] = time.strftime("%Y-%m-%d %H:%M:%S")
      rundir.write_json(os.path.join(root, "throughput.json"), rates)
  return results


def _run_all(arms: list[Arm], processes: bool, verbose: bool, keep: Optional[list]) -> list[dict]:
  results = []
  for group in groups(arms):
    done = [rundir.RunDir(a.config.run_dir).is_done() for a in group]
    if all(done):
      summaries = [rundir.RunDir(a.config.run_dir).read_summary() for a in group]
      if verbose:
        for a, summary in zip(group, summaries):
          print(f"[skip] {a.name}: already {summary['status']}", flush=True)
    else:
      if processes:
        summaries = run_group_in_subprocess(group)
      else:
        summaries = run_group_in_process(group, keep=keep)
      if verbose:
        for a, summary, skipped in zip(group, summaries, done):
          print(_line(a, summary, skipped), flush=True)
    results += [dict(summary, arm=a.name) for a, summary in zip(group, summaries)]
  return results


def _line(a: Arm, summary: dict, skipped: bool) -> str:
  if skipped:
    return f"[skip] {a.name}: already {summary['status']}"
  loss = summary.get("val_loss")
  return (
    f"[{summary.get('status')}] {a.name}: val loss {'-' if loss is None else f'{loss:.3f}'}"
    + (
      f", diverged at step {summary.get('diverged_step')}"
      if summary.get("status") == "diverged"
      else ""
    )
  )


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
