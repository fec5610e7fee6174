"""Every attention variant at one learning rate: training stability and sinks side by side.

    python experiments/compare.py --config experiments/configs/compare.py:preset=cpu

Writes ``runs/compare/<variant>/`` (config, metrics, probes, summary,
checkpoints, plots) and ``runs/compare/report.md`` with the table and PNGs.
Resumable: run it again and finished arms are skipped, interrupted ones resume.
"""

from __future__ import annotations

import os
import time

from attnjax.train import cli, report, sweep
from attnjax.train.config import as_list, validate
from attnjax.train import init_distributed


def main(argv=None) -> str:
  cfg, args = cli.parse(
    __doc__, "experiments/configs/compare.py:preset=cpu", argv, default_out="runs/compare"
  )
  init_distributed()
  t0 = time.perf_counter()
  if not args.report_only:
    arms = [
      sweep.arm(cfg, v, os.path.join(args.out, v), variant=v) for v in as_list(cfg.sweep.variants)
    ]
    for a in arms:  # every arm's config is checked before any arm trains
      validate(a.config)
    sweep.run_sweep(arms, processes=args.processes)
  markdown = report.write_report(
    args.out, title=f"compare ({cfg.preset}, lr={cfg.opt.lr:g})", order=as_list(cfg.sweep.variants)
  )
  path = os.path.join(args.out, "report.md")
  print(markdown)
  print(f"wall time {time.perf_counter() - t0:.0f} s; report: {path}")
  return markdown


if __name__ == "__main__":
  main()
