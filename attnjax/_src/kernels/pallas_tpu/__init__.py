"""A Pallas TPU (Mosaic) flash-attention kernel for every normaliser:
``implementation="pallas_tpu"``.

Implementation behind the public module :mod:`attnjax.kernels.pallas_tpu`, which names what it offers
from the modules of this package.
"""
