"""The block-wise dense kernel (online normaliser over key blocks, skipped blocks, O(T) memory).

Implementation behind the public module :mod:`attnjax.kernels.blockwise`, which names what it offers
from the modules of this package.
"""
