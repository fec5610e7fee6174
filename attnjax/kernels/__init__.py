"""Engines: each kernel with its tiles, backward and autodiff rules, one package or module each.

:mod:`attnjax.kernels.blockwise` (the block-wise XLA kernel of every dense option, O(T)
memory; the sparse families run on it), :mod:`attnjax.kernels.pallas_gpu` (Triton),
:mod:`attnjax.kernels.pallas_tpu`, :mod:`attnjax.kernels.mosaic_gpu` (Hopper): Pallas
kernels for every normaliser; :mod:`attnjax.kernels.splash` and
:mod:`attnjax.kernels.jax_nn` wrap jax's own. Each dense engine takes a validated call
(:func:`attnjax.options.validate`) and names what it cannot honour; auto-dispatch's order
per platform is :func:`attnjax.dense.dispatch_table`'s. Kernels never import families;
nothing is imported here.

Guide: :doc:`/guides/kernels`.
"""

__all__ = []
