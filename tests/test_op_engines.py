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


class TestMla(FamilyTests):
  op = "mla"
  # "xla" (jax.nn) needs d_v = d_qk, which the absorbed form never has (R + d_r against R):
  # tests/test_mla.py runs it on an expanded call with d_v = d_n + d_r.
  engines = ("blockwise", None)

  def sample(self):
    rng = np.random.default_rng(1)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    R, d_n, d_r, d_v = 12, 6, 2, 4
    args = (
      draw(B, T, N, d_n + d_r),
      draw(B, T, 1, d_r),
      draw(B, T, 1, R),
      0.3 * draw(R, N, d_n),
      0.3 * draw(R, N, d_v),
    )
    # Each engine on the absorbed form (MQA over the latent) against the reference on the
    # expanded one, the definition.
    return (
      lambda impl, *a: attnjax.mla_attention(
        *a, is_causal=True, window=(9, 0), absorb=impl != "reference", implementation=impl
      ),
      args,
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


class TestDeltaRuleKDA(FamilyTests):
  """The delta rule with a decay per key channel (Kimi Delta Attention), value heads
  grouped over fewer query/key heads (Qwen3-Next's Hv = 2 Hk) and Dk != Dv."""

  op = "delta_rule"

  def sample(self):
    a = _arrays()
    rng = np.random.default_rng(1)
    g = jnp.asarray(-rng.uniform(0.0, 1.0, (B, T, N, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, T, N, H // 2)), jnp.float32)
    return (
      lambda impl, q, k, v, b, g: attnjax.delta_rule_attention(
        q, k, v, b, log_decay=g, chunk_size=8, implementation=impl
      ),
      (a["q"][:, :, :K], a["k_unit"], v, a["beta"], g),
    )


def test_every_registered_op_is_tested():
  module = sys.modules[__name__]
  tested = {
    c.op
    for c in vars(module).values()
    if isinstance(c, type) and issubclass(c, OpTests) and c.__name__.startswith("Test")
  }
  assert tested >= set(_op.OPS), f"give {sorted(set(_op.OPS) - tested)} an OpTests subclass"
