"""Every registered op's engines against its reference, through :class:`op_base.OpTests`.

One subclass per family, each with the family's sample call; a registered op
(:data:`attnjax._op.OPS`) without one fails ``test_every_registered_op_is_tested``. The
engines of each op are read from the registry. The families' own test files check their
engines across options and structures; this is the one cross product of every op and engine
(``slow``).
"""

from __future__ import annotations

import functools
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src import op as _op, patterns
from op_base import OpTests

B, T, N, K, H = 1, 24, 4, 2, 8


@functools.cache
def _arrays() -> dict:
  rng = np.random.default_rng(0)
  draw = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  k = draw(B, T, K, H)
  arrays = dict(
    q=draw(B, T, N, H),
    k=k,
    v=draw(B, T, K, H),
    k_unit=k / np.linalg.norm(k, axis=-1, keepdims=True),
    beta=1.0 / (1.0 + np.exp(-draw(B, T, N))),
    log_decay=-np.logaddexp(0.0, draw(B, T, N)),
  )
  return {name: jnp.asarray(x) for name, x in arrays.items()}


def _qkv(*names):
  a = _arrays()
  return tuple(a[n] for n in ("q", "k", "v") + names)


class FamilyTests(OpTests):
  sample_marks = (pytest.mark.slow,)
  length = T * H


class TestDense(FamilyTests):
  op = "dense"

  def sample(self):
    return (
      lambda impl, q, k, v: attnjax.dot_product_attention(
        q, k, v, is_causal=True, window=(9, 0), implementation=impl
      ),
      _qkv(),
    )


class TestSparse(FamilyTests):
  op = "sparse"

  def sample(self):
    return (
      lambda impl, q, k, v: attnjax.sparse_attention(
        q, k, v, pattern=patterns.sliding_window(9), block_size=8, implementation=impl
      ),
      _qkv(),
    )


class TestCompressed(FamilyTests):
  op = "compressed"

  def sample(self):
    return (
      lambda impl, q, k, v: attnjax.compressed_attention(
        q, k, v, stride=4, is_causal=True, window=4, block_size=8, implementation=impl
      ),
      _qkv(),
    )


class TestBlockSelect(FamilyTests):
  op = "block_select"

  def sample(self):
    return (
      lambda impl, q, k, v: attnjax.block_select_attention(
        q, k, v, block_size=8, top_k=2, implementation=impl
      ),
      _qkv(),
    )


class TestNSA(FamilyTests):
  op = "nsa"

  def sample(self):
    gates = jnp.asarray(np.random.default_rng(1).uniform(0.1, 0.9, (B, T, N, 3)), jnp.float32)
    return (
      lambda impl, q, k, v, g: attnjax.nsa_attention(
        q,
        k,
        v,
        g,
        block_length=8,
        stride=4,
        selection_block=8,
        num_selected=2,
        num_local=1,
        window=5,
        implementation=impl,
      ),
      _qkv() + (gates,),
    )


class TestDSA(FamilyTests):
  op = "dsa"

  def sample(self):
    rng = np.random.default_rng(2)
    index = [
      jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, T, 2, 4), (B, T, 4), (B, T, 2))
    ]
    return (
      lambda impl, q, k, v: attnjax.dsa_attention(q, k, v, *index, top_k=6, implementation=impl),
      _qkv(),
    )


class TestLinear(FamilyTests):
  op = "linear"

  def sample(self):
    return (
      lambda impl, q, k, v: attnjax.linear_attention(
        q, k, v, is_causal=True, chunk_size=8, implementation=impl
      ),
      _qkv(),
    )


class TestGatedLinear(FamilyTests):
  op = "gated_linear"

  def sample(self):
    return (
      lambda impl, q, k, v, g: attnjax.gated_linear_attention(
        q, k, v, log_decay=g, chunk_size=8, implementation=impl
      ),
      _qkv("log_decay"),
    )


class TestDeltaRule(FamilyTests):
  op = "delta_rule"

  def sample(self):
    a = _arrays()
    return (
      lambda impl, q, k, v, b, g: attnjax.delta_rule_attention(
        q, k, v, b, log_decay=g, chunk_size=8, implementation=impl
      ),
      (a["q"], a["k_unit"], a["v"], a["beta"], a["log_decay"]),
    )


def test_every_registered_op_is_tested():
  module = sys.modules[__name__]
  tested = {
    c.op
    for c in vars(module).values()
    if isinstance(c, type) and issubclass(c, OpTests) and c.__name__.startswith("Test")
  }
  assert tested >= set(_op.OPS), f"give {sorted(set(_op.OPS) - tested)} an OpTests subclass"
