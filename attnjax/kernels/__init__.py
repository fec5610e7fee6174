"""Engines: each kernel with its tiles, backward and autodiff rules, one package or module each.

- :mod:`attnjax.kernels.blockwise`: the block-wise (FlashAttention-2 style) XLA kernel for
  every dense option; O(T) memory, skipped blocks; the sparse families run on it too.
- :mod:`attnjax.kernels.pallas_gpu`: a Pallas Triton kernel for every normaliser.
- :mod:`attnjax.kernels.pallas_tpu`: a Pallas Mosaic TPU kernel for every normaliser.
- :mod:`attnjax.kernels.mosaic_gpu`: a Pallas Mosaic GPU kernel for Hopper, every normaliser.
- :mod:`attnjax.kernels.splash`: jax's Pallas TPU splash kernel (softmax).
- :mod:`attnjax.kernels.jax_nn`: ``jax.nn.dot_product_attention`` (XLA, cuDNN).
- ``attnjax.kernels.recurrent``: the chunk scan and the GLA chunk of the recurrent
  families (linear, gated linear, delta rule).
- ``attnjax.kernels.autodiff`` / ``attnjax.kernels.linear_map``: every mode of
  autodiff for the custom-VJP kernels (a custom JVP whose tangent is a linear map transposed
  by the backward); kernels JAX cannot differentiate (Pallas, splash, cuDNN) take their
  tangent from the block-wise engine.

Every dense engine takes a validated call (:class:`attnjax.options.DenseInputs`,
:class:`~attnjax.options.DenseOptions`) and names what it cannot honour with
``unsupported(inputs, opts)``; ``compute(inputs, opts, ...)`` is its computation without
a platform guard, ``run(inputs, opts, ...)`` the engine called by name (the one check, then
``compute`` lowering for its platform only). :data:`attnjax.dense.ENGINES` holds one record
per engine and :data:`attnjax.dense.PREFERENCES` auto-dispatch's order per platform. The
Pallas engines also expose ``attention(q, k, v, *, <dense options>, block_sizes=None,
interpret=False)``. Families
(:mod:`attnjax.dense`, :mod:`attnjax.sparse`, ...) import kernels; kernels never import
families. Nothing is imported here, so ``import attnjax`` loads only the engines its families
use.
"""



__all__ = []
