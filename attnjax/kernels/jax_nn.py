"""``jax.nn.dot_product_attention`` as a dense engine: ``implementation="xla"`` and ``"cudnn"``.

:func:`compute` runs a validated dense call (:class:`attnjax.options.DenseInputs`,
:class:`~attnjax.options.DenseOptions`) through jax's own attention; :func:`unsupported`
and :func:`cudnn_unsupported` name what each cannot honour, so dispatch never drops an
option. Rows with no allowed key come back as zeros (jax gives them the mean of the values).
"""

from attnjax._src.kernels.jax_nn import compute, cudnn_unsupported, unsupported

__all__ = ["compute", "cudnn_unsupported", "unsupported"]
