"""Shared command line of the experiment entry points: ``--config FILE.py:ARG --config.k=v``.

Implementation behind the public module :mod:`attnjax.train.cli`.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from typing import Any, Callable, Optional, Sequence

from attnjax._src.train import rundir
from attnjax._src.train.config import load_config, split_argv


def build_parser(
  description: str, default_config: str, default_out: str = "runs/experiment", sweep: bool = True
) -> argparse.ArgumentParser:
  """The argument parser of a config-driven entry point.

  ``--config`` and ``--config.key=value`` are taken out of the command line by
  :func:`.split_argv` before this parser sees the rest;
  they are declared here so that ``--help`` documents them.
  """
  p = argparse.ArgumentParser(
    description=description, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  group = p.add_argument_group(
    "config", "a Python config file and overrides of its keys (big_vision style)"
  )
  group.add_argument(
    "--config",
    metavar="FILE.py:ARG",
    default=default_config,
    help=f"config file whose get_config(ARG) builds the config; ARG is 'k=v,k2=v2' "
    f"(default: {default_config})",
  )
  group.add_argument(
    "--config.KEY",
    metavar="VALUE",
    dest="config_overrides",
    action="append",
    help="--config.key=value (or --config.key value): override one key, e.g. "
    "--config.opt.lr=3e-3; repeatable; an unknown key is an error naming it",
  )
  p.add_argument("--out", default=default_out, help="root folder of the run directories")
  if sweep:
    p.add_argument(
      "--processes",
      action="store_true",
      help="run each arm in its own process (default: sequentially in this one)",
    )
    p.add_argument("--report-only", action="store_true", help="only rebuild the report")
  return p


def parse(
  description: str,
  default_config: str,
  argv: Optional[Sequence[str]] = None,
  default_out: str = "runs/experiment",
  check: bool = True,
  sweep: bool = True,
  arms: Optional[Callable[[Any, argparse.Namespace], list]] = None,
):
  """Returns ``(config, args)``; the config is loaded, overridden and validated.

  ``arms(config, args)``, when given, builds the sweep's arms into ``args.arms``; like a bad
  key, a ``ValueError`` it raises (an unknown variant, seeds that are not ints, no arms)
  is a usage error naming the problem, before anything trains.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  p = build_parser(description, default_config, default_out, sweep)
  try:
    spec, overrides, rest = split_argv(argv)
  except ValueError as e:
    p.error(str(e))
  args = p.parse_args(rest)
  args.config = spec or in_repository(default_config)
  args.config_overrides = overrides
  try:
    cfg = load_config(args.config, overrides, check=check)
    if arms is not None:
      args.arms = arms(cfg, args)
      if not args.arms:
        raise ValueError("the sweep has no arms: name at least one in sweep.variants")
  except (ValueError, KeyError, FileNotFoundError) as e:
    p.error(str(e).strip("'\""))
  return cfg, args


def in_repository(spec: str) -> str:
  """``spec`` (``path.py[:arg]``) with a relative path that does not exist from the working
  directory taken from the repository root instead (the folder above the ``attnjax`` package,
  where ``experiments/`` lives), so that an entry point's default config is found from any
  directory. Other specs are returned as they are."""
  path, sep, arg = spec.partition(":")
  if os.path.isabs(path) or os.path.isfile(path):
    return spec
  root = str(pathlib.Path(__file__).resolve().parents[3])
  candidate = os.path.join(root, path)
  return candidate + sep + arg if os.path.isfile(candidate) else spec


def csv(text: str) -> list[str]:
  return [s.strip() for s in str(text).split(",") if s.strip()]


def finish(out: str, markdown: str, t0: float, *, write: bool = True) -> str:
  """Ends an experiment: writes ``out/report.md`` atomically (unless the report code
  already did, ``write=False``), prints the report and the wall time since ``t0``."""
  path = os.path.join(out, "report.md")
  if write:
    rundir.write_atomic(path, markdown)
  print(markdown)
  print(f"wall time {time.perf_counter() - t0:.0f} s; report: {path}")
  return markdown
