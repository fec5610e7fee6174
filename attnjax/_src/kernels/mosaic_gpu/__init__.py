"""A Pallas Mosaic GPU flash-attention kernel for Hopper: ``implementation="mosaic_gpu"``.

Implementation behind the public module :mod:`attnjax.kernels.mosaic_gpu`, which names what it offers
from the modules of this package.
"""
