"""Engines of the recurrent families (linear, gated linear, delta rule).

:mod:`~attnjax._src.kernels.recurrent.chunks`: the chunked scan over time with a backward that
recomputes each chunk (O(T) memory); :mod:`~attnjax._src.kernels.recurrent.gla_chunk`: the
gated-linear chunk (intra-chunk quadratic form with per-channel decay, sub-blocked).
"""
