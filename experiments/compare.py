"""Attention variants side by side: sinks and stability, every arm at several seeds.

    python experiments/compare.py --config experiments/configs/compare.py:preset=cpu

Arms: ``sweep.variants`` at ``opt.lr`` and ``sweep.high_lr_variants`` at each of
``sweep.high_lrs``, every arm at each seed of ``sweep.seeds`` (trained stacked). Writes
``runs/compare/<variant>/lr=<lr>/seed=<s>/`` (config, metrics, probes, summary, checkpoints,
plots), ``host.json`` (the machine and its load), ``throughput.json`` (bare steps, timed
interleaved) and ``runs/compare/report.md``: the design, mean ± spread over seeds,
uniform-attention baselines, the learning-rate axis and the sink and stability targets.
Resumable: run it again and finished arms are skipped, interrupted ones resume.
"""

from __future__ import annotations

import time

from attnjax.train import cli, report, sweep
from attnjax.train import init_distributed
from attnjax.train.variants import check_variants


def build_arms(cfg, out: str) -> list[sweep.Arm]:
  """Every arm of the comparison (checked before any trains): variants x LRs x seeds."""
  seeds = sweep.parse_seeds(cfg.sweep.seeds)
  variants = check_variants(cfg.sweep.variants)
  high = check_variants(cfg.sweep.high_lr_variants, key="sweep.high_lr_variants", empty_ok=True)
  pairs = [(v, cfg.opt.lr) for v in variants]
  pairs += [
    (v, lr) for lr in sweep.parse_lrs(cfg.sweep.high_lrs, key="sweep.high_lrs") for v in high
  ]
  return sweep.variant_lr_arms(cfg, out, pairs, seeds)


def targets(cfg) -> dict:
  """The report's sink and stability targets, from ``cfg.sweep``."""
  return dict(
    reference=cfg.sweep.reference,
    stable=cfg.sweep.stable,
    sink_free=check_variants(cfg.sweep.sink_free, key="sweep.sink_free", empty_ok=True),
    lr=cfg.opt.lr,
  )


def main(argv=None) -> str:
  cfg, args = cli.parse(
    __doc__,
    "experiments/configs/compare.py:preset=cpu",
    argv,
    default_out="runs/compare",
    arms=lambda cfg, args: build_arms(cfg, args.out),
  )
  init_distributed()
  t0 = time.perf_counter()
  if not args.report_only:
    sweep.run_sweep(args.arms, processes=args.processes, root=args.out)
  markdown = report.write_report(
    args.out,
    title=f"compare ({cfg.preset})",
    order=sweep.folders(args.arms, args.out),
    targets=targets(cfg),
  )
  return cli.finish(args.out, markdown, t0, write=False)


if __name__ == "__main__":
  main()
