"""Every registered op's engines against its reference, through :class:`op_base.OpTests`.

One test class per registered op (:data:`attnjax._src.op.OPS`), made from the op's first
sample call (:attr:`attnjax._src.op.Op.samples`): a new family is tested here with no entry
of its own. The families' own test files check their engines across options and
structures; this is the one cross product of every op and engine (``slow``).
"""

from __future__ import annotations

import functools
import inspect
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src import op as _op
from op_base import OpTests

B, T, N, K, H = 1, 24, 4, 2, 8


@functools.cache
def _qkv() -> tuple:
  rng = np.random.default_rng(0)
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape).astype(np.float32))
  return draw(B, T, N, H), draw(B, T, K, H), draw(B, T, K, H)


def _partial_qkv() -> tuple:
  """:func:`_qkv` cut to T = 23 tokens, not a multiple of 8 (a partial last block)."""
  return tuple(x[:, :23] for x in _qkv())


def sample_call(op: _op.Op, qkv: tuple = ()):
  """``(fn, args)`` of ``op``'s first sample on ``qkv`` (default :func:`_qkv`):
  ``fn(implementation, *args, **extra)``, every array argument (q, k, v and the sample's
  further arrays, float32) differentiable; ``extra`` keywords join the sample's options."""
  sample = op.samples()[0]
  q, k, v, arrays = sample.inputs(*(qkv or _qkv()))
  names = sorted(arrays)

  def fn(implementation, q, k, v, *rest, **extra):
    kw = {**sample.options, **dict(zip(names, rest)), **extra}
    return sample.function(q, k, v, **kw, implementation=implementation)

  return fn, (q, k, v, *(arrays[n] for n in names))


class FamilyTests(OpTests):
  sample_marks = (pytest.mark.slow,)
  length = T * H

  def sample(self):
    return sample_call(self.op_record())

  def partial_block_sample(self, normalizer):
    # The op's first sample at T = 23 tokens: a block-wise engine pads its last block (a
    # family's blocks of 8, or dense's one block of all 23).
    sample = self.op_record().samples()[0]
    if "normalizer" not in inspect.signature(sample.function).parameters:
      return None
    fn, args = sample_call(self.op_record(), _partial_qkv())
    return (lambda impl, *a: fn(impl, *a, normalizer=normalizer)), args

  def refusals(self, engine, normalizer):
    return "" if engine != "xla" or normalizer == "softmax" else "jax.nn computes softmax"


def op_tests(name: str) -> type:
  """The :class:`OpTests` of the registered op ``name``."""
  return type(f"Test_{name}", (FamilyTests,), {"op": name})


for _name in sorted(_op.OPS):
  globals()[f"Test_{_name}"] = op_tests(_name)


class TestDeltaRuleKDA(FamilyTests):
  """The delta rule with a decay per key channel (Kimi Delta Attention), value heads
  grouped over fewer query/key heads (Qwen3-Next's Hv = 2 Hk) and Dk != Dv."""

  op = "delta_rule"

  def sample(self):
    q, k, _ = _qkv()
    rng = np.random.default_rng(1)
    g = jnp.asarray(-rng.uniform(0.0, 1.0, (B, T, N, H)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, T, N, H // 2)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, N)), jnp.float32)
    return (
      lambda impl, q, k, v, b, g: attnjax.delta_rule_attention(
        q, k, v, b, log_decay=g, chunk_size=8, implementation=impl
      ),
      (q[:, :, :K], k / jnp.linalg.norm(k, axis=-1, keepdims=True), v, beta, g),
    )


def test_every_registered_op_is_tested():
  module = sys.modules[__name__]
  tested = {
    c.op
    for c in vars(module).values()
    if isinstance(c, type) and issubclass(c, OpTests) and c.__name__.startswith("Test")
  }
  assert tested >= set(_op.OPS), f"{sorted(set(_op.OPS) - tested)} registered after collection"
  assert all(_op.OPS[name].samples() for name in tested)
