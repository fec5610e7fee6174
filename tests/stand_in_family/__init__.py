"""A stand-in attention family, for tests/test_stand_in_family.py: one folder and one registry
entry (its fixture registers :data:`OP` in :data:`attnjax._src.op.OPS` and removes it after).

:func:`attention` is causal linear attention without a feature map, ``out[t] = scale *
sum_{s <= t} (q[t] . k[s]) v[s]``, over ``q [B, T, N, H]`` and ``k, v [B, T, K, H]`` (GQA:
``N % K == 0``). Its readable reference materialises the masked ``[T, T]`` scores; its one
engine, ``"cumulative"``, takes the running sum of the outer products ``k[s] v[s]^T``
instead.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from attnjax._src import op as _op, validators

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


def no_queries(q, k, v):
  """The answer to a call with no queries (or no keys): the empty or zero output."""
  del k
  return jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype)


ENGINES = {
  e.name: e
  for e in (
    _op.Engine("reference", reference, _op.supports_everything),
    _op.Engine("cumulative", cumulative, _op.supports_everything),
  )
}
PREFERENCES: dict[str, tuple[str, ...]] = {}
FALLBACK = ("cumulative", "reference")


def _samples():
  # How the suites over every family call it: q, k, v and nothing more.
  return (_op.Sample(attention, label="stand_in_attention", self_only=True),)


OP = _op.Op(
  NAME,
  ENGINES,
  PREFERENCES,
  FALLBACK,
  empty=no_queries,
  is_empty=lambda q, k, v: q.shape[1] == 0,
  samples=_samples,
)


def attention(q, k, v, *, implementation: Optional[str] = None):
  """The stand-in family's public function; dispatched through the registered op.

  Raises:
    ValueError: q, k, v not ``[B, T, N, H]``, ``[B, T, K, H]`` with ``N % K == 0`` and
      ``H > 0``, or an unknown implementation.
    TypeError: implementation not a str or None, or q, k, v not of one floating dtype.
  """
  op = _op.OPS[NAME]
  implementation = _op.check_implementation(op, implementation, where="stand_in.attention")
  _, T, S, N, K, _, _ = validators.check_qkv(q, k, v)  # the shared checks, their messages
  if S != T:
    raise ValueError(
      f"stand_in attention is causal over one sequence; got q {q.shape}, k {k.shape}"
    )
  # Query head n reads key/value head n // (N // K) (GQA).
  k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
  return _op.run(op, (q, k, v), implementation)
