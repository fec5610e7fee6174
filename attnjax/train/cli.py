"""Shared command line of the experiment entry points: ``--config FILE.py:ARG --config.k=v``.

    python experiments/compare.py --config experiments/configs/compare.py:preset=cpu         --config.opt.lr=3e-3 --out runs/compare --processes

The entry points run from any directory with the package installed from the
repository (``pip install -e .``): a default config that is not found from the
working directory is read from the repository; ``--help`` lists both config
options and the entry point's own flags.
"""

from attnjax._src.train.cli import build_parser, in_repository, parse

__all__ = ["build_parser", "in_repository", "parse"]
