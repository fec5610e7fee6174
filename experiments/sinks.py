"""Sink statistics over training for each attention variant, on Shakespeare and bigram-backcopy.

    python experiments/sinks.py --config experiments/configs/sinks.py:preset=cpu

Writes ``runs/sinks/<dataset>/<variant>/`` and a report per dataset
(``runs/sinks/<dataset>/report.md``: final Sink_1^0.3, F-Attn, M-Act; plots
of the probes against step), joined in ``runs/sinks/report.md``.
"""

from __future__ import annotations

import os
import time

from attnjax.train import cli, report, sweep
from attnjax.train.config import validate
from attnjax.train.loop import init_distributed


def main(argv=None) -> str:
  cfg, args = cli.parse(__doc__, "experiments/configs/sinks.py:preset=cpu", argv,
                        default_out="runs/sinks")
  init_distributed()
  t0 = time.perf_counter()
  datasets = cli.csv(cfg.sweep.datasets)
  if not args.report_only:
    arms = []
    for d in datasets:
      for v in cli.csv(cfg.sweep.variants):
        a = sweep.arm(cfg, f"{d}/{v}", os.path.join(args.out, d, v), variant=v,
                      **{"data.name": d})
        validate(a.config)
        arms.append(a)
    sweep.run_sweep(arms, processes=args.processes)
  parts = [f"# sinks ({cfg.preset}, lr={cfg.opt.lr:g})\n"]
  for d in datasets:
    root = os.path.join(args.out, d)
    if os.path.isdir(root):
      md = report.write_report(root, title=f"sinks on {d}", order=cli.csv(cfg.sweep.variants))
      parts.append(md.replace("](plots/", f"]({d}/plots/").replace("\n# ", "\n## ", 1)
                   .replace("# sinks on", "## sinks on", 1))
  markdown = "\n".join(parts)
  return cli.finish(args.out, markdown, t0)


if __name__ == "__main__":
  main()
