"""Variants x learning rates: LR sensitivity, max stable LR, loss vs LR, max logit vs step.

    python experiments/lr_sweep.py --config experiments/configs/lr_sweep.py:preset=cpu

Arms: ``sweep.variants`` x ``sweep.lrs``, each at every seed of ``sweep.seeds`` (trained
stacked). Writes ``runs/lr_sweep/<variant>/lr=<lr>/seed=<s>/`` and
``runs/lr_sweep/report.md`` (the design, mean ± spread over seeds, the LR-sensitivity table,
plots with error bars). Resumable; a diverged arm is recorded and the sweep goes on.
"""

from __future__ import annotations

import time

from attnjax.train import cli, report, sweep
from attnjax.train import init_distributed
from attnjax.train.variants import check_variants


def build_arms(cfg, out: str) -> list[sweep.Arm]:
  """Every arm of the sweep (checked before any trains): variants x LRs x seeds."""
  seeds = sweep.parse_seeds(cfg.sweep.seeds)
  variants = check_variants(cfg.sweep.variants)
  lrs = sweep.parse_lrs(cfg.sweep.lrs, key="sweep.lrs")
  if not lrs:
    raise ValueError("sweep.lrs is empty: give the learning rates, e.g. sweep.lrs=1e-3,1e-2")
  return sweep.variant_lr_arms(cfg, out, [(v, lr) for v in variants for lr in lrs], seeds)


def main(argv=None) -> str:
  cfg, args = cli.parse(
    __doc__,
    "experiments/configs/lr_sweep.py:preset=cpu",
    argv,
    default_out="runs/lr_sweep",
    arms=lambda cfg, args: build_arms(cfg, args.out),
  )
  init_distributed()
  t0 = time.perf_counter()
  if not args.report_only:
    sweep.run_sweep(args.arms, processes=args.processes, root=args.out)
  markdown = report.write_lr_sweep_report(
    args.out, title=f"lr_sweep ({cfg.preset})", order=sweep.folders(args.arms, args.out)
  )
  return cli.finish(args.out, markdown, t0, write=False)


if __name__ == "__main__":
  main()
