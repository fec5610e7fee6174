"""A stand-in attention family, for tests/test_stand_in_family.py: one folder and one registry
entry (its fixture registers :data:`OP` in :data:`attnjax._op.OPS` and removes it after).

:func:`attention` is causal linear attention without a feature map, ``out[t] = scale *
sum_{s <= t} (q[t] . k[s]) v[s]``, over ``q, k, v [B, T, N, H]``. Its readable reference
materialises the masked ``[T, T]`` scores; its one engine, ``"cumulative"``, takes the running
sum of the outer products ``k[s] v[s]^T`` instead.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from attnjax._src import op as _op

NAME = "stand_in"


def reference(q, k, v):
  """The readable definition: causal scores, then their weighted sum of values."""
  T = q.shape[1]
  scores = jnp.einsum("btnh,bsnh->bnts", q, k) * q.shape[-1] ** -0.5
  scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, 0.0)
  return jnp.einsum("bnts,bsnh->btnh", scores, v)


def cumulative(q, k, v):
  """The engine: the state ``sum_{s <= t} k[s] v[s]^T`` as a cumulative sum."""
  state = jnp.cumsum(jnp.einsum("btnh,btnd->btnhd", k, v), axis=1)
  return jnp.einsum("btnh,btnhd->btnd", q, state) * q.shape[-1] ** -0.5


ENGINES = {
  e.name: e
  for e in (
    _op.Engine("reference", reference, _op.supports_everything),
    _op.Engine("cumulative", cumulative, _op.supports_everything),
  )
}
OP = _op.Op(NAME, ENGINES, preferences={}, fallback=("cumulative", "reference"))


def attention(q, k, v, *, implementation: Optional[str] = None):
  """The stand-in family's public function; dispatched through the registered op.

  Raises:
    ValueError: q, k, v not of one shape ``[B, T, N, H]``, or an unknown implementation.
    TypeError: implementation not a str or None.
  """
  op = _op.OPS[NAME]
  implementation = _op.check_implementation(op, implementation, where="stand_in.attention")
  if q.ndim != 4 or q.shape != k.shape or q.shape != v.shape:
    raise ValueError(
      f"q, k and v must share one shape [B, T, N, H]; got q {q.shape}, k {k.shape}, v {v.shape}"
    )
  return _op.run(op, (q, k, v), implementation)
