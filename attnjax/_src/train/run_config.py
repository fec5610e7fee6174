"""``python -m attnjax.train.run_config run_dir/requested_config.json ...``: runs in a process.

Used by sweeps with ``--processes``; the configs are already resolved and validated. Several
configs are the seeds of one arm, trained together (:func:`attnjax.train.train_seeds`).
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if not argv:
    print(__doc__, file=sys.stderr)
    return 2
  from attnjax._src.train.loop import init_distributed, train
  from attnjax._src.train.seeds import train_seeds
  from attnjax._src.train.sweep import config_from_json

  init_distributed()
  configs = [config_from_json(path) for path in argv]
  summaries = train_seeds(configs) if len(configs) > 1 else [train(configs[0])]
  ok = ("finished", "diverged", "stopped")
  return 0 if all(s.get("status") in ok for s in summaries) else 1


if __name__ == "__main__":
  sys.exit(main())
