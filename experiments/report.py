"""Rebuild the markdown table and PNG plots of any folder of run directories.

    python experiments/report.py runs/compare
    python experiments/report.py runs/lr_sweep --lr-sweep

Writes ``<folder>/report.md`` and ``<folder>/plots/*.png`` and prints the markdown.
"""

from __future__ import annotations

import argparse
import os

from attnjax.train import report


def main(argv=None) -> str:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("root", help="folder holding run directories (any depth)")
  p.add_argument("--title", default=None)
  p.add_argument(
    "--lr-sweep",
    action="store_true",
    help="also the LR-sensitivity table and loss-vs-LR / max-logit plots",
  )
  args = p.parse_args(argv)
  if not os.path.isdir(args.root):
    p.error(f"{args.root!r} is not a folder")
  if args.lr_sweep:
    markdown = report.write_lr_sweep_report(args.root, title=args.title)
  else:
    markdown = report.write_report(args.root, title=args.title)
  print(markdown)
  return markdown


if __name__ == "__main__":
  main()
