"""Shared command line of the experiment entry points: ``--config FILE.py:ARG --config.k=v``.

    python experiments/compare.py --config experiments/configs/compare.py:preset=cpu \\
        --config.opt.lr=3e-3 --out runs/compare --processes
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional, Sequence

from attnjax.train import rundir
from attnjax.train.config import load_config, split_argv


def parse(description: str, default_config: str, argv: Optional[Sequence[str]] = None,
          default_out: str = "runs/experiment", check: bool = True, sweep: bool = True):
  """Returns ``(config, args)``; the config is loaded, overridden and validated."""
  argv = list(sys.argv[1:] if argv is None else argv)
  spec, overrides, rest = split_argv(argv)
  p = argparse.ArgumentParser(description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default=default_out, help="root folder of the run directories")
  if sweep:
    p.add_argument("--processes", action="store_true",
                   help="run each arm in its own process (default: sequentially in this one)")
    p.add_argument("--report-only", action="store_true", help="only rebuild the report")
  args = p.parse_args(rest)
  try:
    cfg = load_config(spec or default_config, overrides, check=check)
  except (ValueError, KeyError, FileNotFoundError) as e:
    p.error(str(e).strip("'\""))
  return cfg, args


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
