"""Output-logit drift at high LR: z-loss and independent weight decay arms.

    python experiments/logit_drift.py --config experiments/configs/logit_drift.py:preset=cpu

Writes ``runs/logit_drift/<arm>/`` and ``runs/logit_drift/report.md`` with the
final mean log Z per arm and ``plots/log_z.png`` (mean log Z against step).
"""

from __future__ import annotations

import os
import time

from attnjax.train import cli, report, sweep
from attnjax.train.config import as_list, validate
from attnjax.train import init_distributed


def parse_arms(text: str) -> list[tuple[str, float, float]]:
  """``"name:z_loss:weight_decay,..."`` -> ``[(name, z_loss, weight_decay)]``."""
  arms = []
  for item in as_list(text):
    parts = item.split(":")
    if len(parts) != 3:
      raise ValueError(f"sweep.arms item {item!r} must be name:z_loss:weight_decay")
    arms.append((parts[0], float(parts[1]), float(parts[2])))
  return arms


def main(argv=None) -> str:
  cfg, args = cli.parse(
    __doc__, "experiments/configs/logit_drift.py:preset=cpu", argv, default_out="runs/logit_drift"
  )
  init_distributed()
  t0 = time.perf_counter()
  if not args.report_only:
    arms = []
    for name, z, wd in parse_arms(cfg.sweep.arms):
      a = sweep.arm(
        cfg, name, os.path.join(args.out, name), **{"opt.z_loss": z, "opt.weight_decay": wd}
      )
      validate(a.config)
      arms.append(a)
    sweep.run_sweep(arms, processes=args.processes)
  columns = report.COLUMNS[:5] + (("log_z", "mean log Z (last step)"),) + report.COLUMNS[5:]
  rows = [report.row_of(r, args.out) for r in report.find_runs(args.out)]
  extra = (
    "## Drift\n\nMean log Z of the output logits at the last step, per arm "
    "(z-loss pulls it to 0; see plots/log_z.png for the trajectory):\n\n"
    + report.markdown_table(rows, columns=columns)
  )
  markdown = report.write_report(
    args.out, title=f"logit_drift ({cfg.preset}, lr={cfg.opt.lr:g})", extra=extra
  )
  path = os.path.join(args.out, "report.md")
  print(markdown)
  print(f"wall time {time.perf_counter() - t0:.0f} s; report: {path}")
  return markdown


if __name__ == "__main__":
  main()
