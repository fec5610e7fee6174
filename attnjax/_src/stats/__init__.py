"""Diagnostics for attention sinks and training stability, with the papers' definitions.

Implementation behind the public module :mod:`attnjax.stats`, which names what it offers
from the modules of this package.
"""
