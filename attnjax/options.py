"""The canonical form of a dense attention call, shared by every dense path.

:class:`DenseKeywords` defines the keywords of a dense call once (names,
defaults, which are static); :func:`validate` checks them once and returns a
:class:`DenseInputs` (arrays) and a :class:`DenseOptions` (static choices),
the record every engine takes.
:mod:`attnjax.dense` (reference and dispatch), :mod:`attnjax.kernels.blockwise` and
:mod:`attnjax.sparse` all take this form, so it lives below them: kernels import
it, and nothing here imports a kernel (no import cycles).
"""

from attnjax._src.options import (
  CONTEXT_LAYOUTS,
  CONTEXT_STRATEGIES,
  DEFAULTS,
  FLAGS,
  INTERNAL_OPTIONS,
  KERNEL_INPUTS,
  KERNEL_OPTIONS,
  KEYWORDS,
  SIMILARITIES,
  STATIC_NAMES,
  DenseInputs,
  DenseKeywords,
  DenseOptions,
  apply_mask_mod,
  apply_score_mod,
  array_refusals,
  check_context,
  keywords,
  rows_with_keys,
  static,
  validate,
)

__all__ = [
  "CONTEXT_LAYOUTS",
  "CONTEXT_STRATEGIES",
  "DEFAULTS",
  "FLAGS",
  "INTERNAL_OPTIONS",
  "KERNEL_INPUTS",
  "KERNEL_OPTIONS",
  "KEYWORDS",
  "SIMILARITIES",
  "STATIC_NAMES",
  "DenseInputs",
  "DenseKeywords",
  "DenseOptions",
  "apply_mask_mod",
  "apply_score_mod",
  "array_refusals",
  "check_context",
  "keywords",
  "rows_with_keys",
  "static",
  "validate",
]
