"""The reusable training loop: config, optimizer, pure steps, run directories, sweeps.

Implementation behind the public module :mod:`attnjax.train`, which names what it offers
from the modules of this package.
"""
