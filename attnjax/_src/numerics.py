"""Numerical helpers shared by families and kernels (shared vocabulary: imports only JAX).

:func:`einsum` is the one float32, full-precision contraction of the recurrent
families (:mod:`attnjax.linear`, :mod:`attnjax.gated_linear`,
:mod:`attnjax.delta_rule`) and their kernels (:mod:`attnjax._src.kernels.recurrent`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jnp.ndarray

# Contractions over features and states run at full float32 precision, whatever the
# global default (TPU and GPU would otherwise round operands to bfloat16 / tf32).
HIGHEST = jax.lax.Precision.HIGHEST


def einsum(spec: str, *operands: Array) -> Array:
  """``jnp.einsum`` at ``Precision.HIGHEST`` with a float32 result."""
  return jnp.einsum(spec, *operands, precision=HIGHEST, preferred_element_type=jnp.float32)
