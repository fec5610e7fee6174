"""The canonical form of a dense attention call, shared by every dense path.

:func:`validate` checks the keywords of a dense call once and returns a
:class:`DenseInputs` (arrays) and a :class:`DenseOptions` (static choices), the record
every dense engine takes: :func:`attnjax.dense.reference`, :func:`attnjax.dense.dispatch_table`
and the engines' entry points (:func:`attnjax.kernels.blockwise.run_layout`, ...) are called
on it.

Guide: :doc:`/guides/kernels`.
"""

from attnjax._src.options import DenseInputs, DenseOptions, validate

__all__ = ["DenseInputs", "DenseOptions", "validate"]
