"""A Pallas GPU (Triton) flash-attention kernel for every normaliser:
``implementation="pallas_gpu"``.

Implementation behind the public module :mod:`attnjax.kernels.pallas_gpu`, which names what it offers
from the modules of this package.
"""
