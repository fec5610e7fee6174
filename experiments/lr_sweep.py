"""Variants x learning rates: LR sensitivity, max stable LR, loss vs LR, max logit vs step.

    python experiments/lr_sweep.py --config experiments/configs/lr_sweep.py:preset=cpu

Writes ``runs/lr_sweep/<variant>/lr=<lr>/`` and ``runs/lr_sweep/report.md``
(per-run table, LR-sensitivity table, plots). Resumable; a diverged arm is
recorded and the sweep goes on.
"""

from __future__ import annotations

import os
import time

from attnjax.train import cli, report, sweep
from attnjax.train.config import as_list, validate
from attnjax.train import init_distributed


def main(argv=None) -> str:
  cfg, args = cli.parse(
    __doc__, "experiments/configs/lr_sweep.py:preset=cpu", argv, default_out="runs/lr_sweep"
  )
  init_distributed()
  t0 = time.perf_counter()
  if not args.report_only:
    arms = []
    for v in as_list(cfg.sweep.variants):
      for lr in as_list(cfg.sweep.lrs):
        a = sweep.arm(
          cfg,
          f"{v} lr={float(lr):g}",
          os.path.join(args.out, v, f"lr={float(lr):g}"),
          variant=v,
          **{"opt.lr": float(lr)},
        )
        validate(a.config)
        arms.append(a)
    sweep.run_sweep(arms, processes=args.processes)
  markdown = report.write_lr_sweep_report(args.out, title=f"lr_sweep ({cfg.preset})")
  path = os.path.join(args.out, "report.md")
  print(markdown)
  print(f"wall time {time.perf_counter() - t0:.0f} s; report: {path}")
  return markdown


if __name__ == "__main__":
  main()
