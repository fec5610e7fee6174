"""Flax NNX modules: one attention layer for every attnjax variant, and a decoder LM.

Implementation behind the public module :mod:`attnjax.nn`, which names what it offers
from the modules of this package.
"""
