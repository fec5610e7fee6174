"""``python -m attnjax._src.train.run_config run_dir/requested_config.json``: one run in its own process.

Used by sweeps with ``--processes``; the config is already resolved and validated.
"""

from __future__ import annotations

import sys


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 1:
    print(__doc__, file=sys.stderr)
    return 2
  from attnjax._src.train.loop import init_distributed, train
  from attnjax._src.train.sweep import config_from_json

  init_distributed()
  summary = train(config_from_json(argv[0]))
  return 0 if summary.get("status") in ("finished", "diverged", "stopped") else 1


if __name__ == "__main__":
  sys.exit(main())
