"""Train one model: one config, one run directory (resumable).

    python experiments/train.py --config experiments/configs/shakespeare.py:preset=cpu,attn=cosine \
        --config.opt.lr=3e-3 --out runs/train/cosine

Run it again with the same ``--out`` to resume from the last checkpoint (or
to do nothing if the run already ended).
"""

from __future__ import annotations

import json
import os

from attnjax.train import cli
from attnjax.train import init_distributed, train


def main(argv=None) -> dict:
  cfg, args = cli.parse(
    __doc__, "experiments/configs/shakespeare.py:preset=cpu", argv, default_out="", sweep=False
  )
  cfg.run_dir = args.out or os.path.join("runs", "train", cfg.variant)
  init_distributed()
  summary = train(cfg)
  print(json.dumps({k: v for k, v in summary.items() if k != "probe"}, indent=1))
  return summary


if __name__ == "__main__":
  main()
