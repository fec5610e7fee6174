"""The Pallas GPU kernel (``implementation="pallas_gpu"``) in interpret mode against the reference.

Interpret mode runs the Triton kernel bodies as jax operations on the CPU, so
these checks cover the kernel's logic (block bounds, skipping, the online
normalisers, the FA2 backward), not Triton's compilation or speed. The lengths
(T=40, S=72) are not multiples of the blocks (forward 32 x 16, backward
16 x 32), and most calls use GQA (4 query heads on 2 key/value heads). The
value / gradient cases come from the engine test base (``tests/engine_base.py``):
softmax and sigmoid on every structure by default, the cross product of every
normaliser, structure, GQA / MHA and dtype under ``slow``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax import dense
from attnjax.kernels import pallas_gpu
from engine_base import DenseEngineTests
from helpers import rand_qkv


BLOCKS = pallas_gpu.BlockSizes(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=32)
T, S = 40, 72


def _run(impl, q, k, v, sink, kw):
  extra = {} if sink is None else dict(sink_logits=sink)
  inputs, opts = dense.prepare(q, k, v, **kw, **extra)
  if impl == "pallas_gpu":
    return pallas_gpu.run(inputs, opts, interpret=True, block_sizes=BLOCKS)
  return dense.reference(inputs, opts)


class TestPallasGpu(DenseEngineTests):
  """Causal, window and packed segments; GQA and MHA; float32 and bfloat16."""

  name = "pallas_gpu"
  T, S = T, S
  structures = ("causal", "segments", "window")
  segment_cuts = (13, 30)

  def run(self, inputs, opts):
    return pallas_gpu.run(inputs, opts, interpret=True, block_sizes=BLOCKS)


def test_pallas_gpu_float16_and_no_structure():
  TestPallasGpu().check(("softmax", "causal", True, jnp.float16, False, False, None))
  q, k, v = rand_qkv(B=1, T=T, S=S, N=2, K=1, H=16)
  out = pallas_gpu.run(*dense.prepare(q, k, v, normalizer="sigmoid"),
                                   interpret=True, block_sizes=BLOCKS)
  ref = attnjax.dot_product_attention(q, k, v, normalizer="sigmoid", implementation="reference")
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)


def test_pallas_gpu_lists_what_it_cannot_do():
  q, k, v = rand_qkv(T=8)
  assert pallas_gpu.unsupported(*dense.prepare(q, k, v, is_causal=True)) == []
  reasons = pallas_gpu.unsupported(*dense.prepare(
      q, k, v, bias=jnp.zeros((1, 1, 8, 8)), mask=jnp.ones((1, 1, 8, 8), bool),
      similarity="neg_sq_euclidean"))
  assert len(reasons) == 3 and "bias" in reasons[0] and "mask" in reasons[1], reasons
  inputs, opts = dense.prepare(q, k, v)
  mixed = dataclasses.replace(inputs, v=v.astype(jnp.bfloat16))
  assert any("dtypes" in r for r in pallas_gpu.unsupported(mixed, opts))
  with pytest.raises(ValueError, match="pallas_gpu' does not support bias"):
    attnjax.dot_product_attention(q, k, v, bias=jnp.zeros((1, 1, 8, 8)),
                                  implementation="pallas_gpu")
  with pytest.raises(ValueError, match="power of two"):
    pallas_gpu.BlockSizes(block_q=24)


@pytest.mark.parametrize("T_,S_,kw", [
    (70, 20, dict(is_causal=True, window=(5, 0), normalizer="sigmoid")),  # rows 25.. see no key
    (5, 5, dict(window=(1, 1), normalizer="softmax_one")),  # shorter than the smallest block
], ids=["rows_without_keys", "tiny"])
def test_pallas_gpu_rows_without_keys_and_short_calls(T_, S_, kw):
  q, k, v = rand_qkv(B=1, T=T_, S=S_, N=2, K=1, H=8)

  def loss(q, k, v, impl):
    out = _run(impl, q, k, v, None, kw)
    return jnp.sum(out * jnp.cos(out)), out

  # dq and the dk/dv kernel (padded rows, rows with no key) against the reference.
  grad = lambda impl: jax.value_and_grad(lambda q, k, v: loss(q, k, v, impl), argnums=(0, 1, 2),
                                         has_aux=True)(q, k, v)
  (_, got), g_got = grad("pallas_gpu")
  (_, want), g_want = grad("reference")
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  for name, a, b in zip("qkv", g_got, g_want):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5, err_msg=f"d{name}")
  if T_ > 25:
    assert not np.any(np.asarray(got[:, 25:]))  # a row with no allowed key is zero
