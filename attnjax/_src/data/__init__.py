"""Data for the experiments: tokenisers, corpora, the bigram-backcopy task, deterministic batches.

Implementation behind the public module :mod:`attnjax.data`, which names what it offers
from the modules of this package.
"""
