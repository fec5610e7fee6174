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
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src.ops.dense import attention as dense
from attnjax.kernels import pallas_gpu
from attnjax._src.kernels.pallas_gpu import backward as pallas_backward
from engine_base import DenseEngineTests
from helpers import rand_qkv, softpick_f64, run_kernel


BLOCKS = pallas_gpu.BlockSizes(block_q=32, block_k=16, block_q_bwd=16, block_k_bwd=32)
T, S = 40, 72


def _run(impl, q, k, v, sink, kw):
  extra = {} if sink is None else dict(sink_logits=sink)
  inputs, opts = dense.prepare(q, k, v, **kw, **extra)
  if impl == "pallas_gpu":
    return run_kernel(pallas_gpu, inputs, opts, interpret=True, block_sizes=BLOCKS)
  return dense.reference(inputs, opts)


class TestPallasGpu(DenseEngineTests):
  """Causal, window and packed segments; GQA and MHA; float32 and bfloat16."""

  name = "pallas_gpu"
  T, S = T, S
  structures = ("causal", "segments", "window")
  segment_cuts = (13, 30)

  def run(self, inputs, opts):
    return run_kernel(pallas_gpu, inputs, opts, interpret=True, block_sizes=BLOCKS)


def test_pallas_gpu_float16_and_no_structure():
  TestPallasGpu().check(("softmax", "causal", True, jnp.float16, False, False, None))
  q, k, v = rand_qkv(B=1, T=T, S=S, N=2, K=1, H=16)
  out = run_kernel(
    pallas_gpu, *dense.prepare(q, k, v, normalizer="sigmoid"), interpret=True, block_sizes=BLOCKS
  )
  ref = attnjax.dot_product_attention(q, k, v, normalizer="sigmoid", implementation="reference")
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)


def test_pallas_gpu_lists_what_it_cannot_do():
  q, k, v = rand_qkv(T=8)
  assert pallas_gpu.unsupported(*dense.prepare(q, k, v, is_causal=True)) == []
  reasons = pallas_gpu.unsupported(
    *dense.prepare(
      q,
      k,
      v,
      bias=jnp.zeros((1, 1, 8, 8)),
      mask=jnp.ones((1, 1, 8, 8), bool),
      similarity="neg_sq_euclidean",
    )
  )
  assert len(reasons) == 3 and "bias" in reasons[0] and "mask" in reasons[1], reasons
  inputs, opts = dense.prepare(q, k, v)
  mixed = dataclasses.replace(inputs, v=v.astype(jnp.bfloat16))
  assert any("dtypes" in r for r in pallas_gpu.unsupported(mixed, opts))
  with pytest.raises(ValueError, match="pallas_gpu' does not support bias"):
    attnjax.dot_product_attention(
      q, k, v, bias=jnp.zeros((1, 1, 8, 8)), implementation="pallas_gpu"
    )
  with pytest.raises(ValueError, match="power of two"):
    pallas_gpu.BlockSizes(block_q=24)


@pytest.mark.parametrize(
  "T_,S_,kw",
  [
    (70, 20, dict(is_causal=True, window=(5, 0), normalizer="sigmoid")),  # rows 25.. see no key
    (5, 5, dict(window=(1, 1), normalizer="softmax_one")),  # shorter than the smallest block
  ],
  ids=["rows_without_keys", "tiny"],
)
def test_pallas_gpu_rows_without_keys_and_short_calls(T_, S_, kw):
  q, k, v = rand_qkv(B=1, T=T_, S=S_, N=2, K=1, H=8)

  def loss(q, k, v, impl):
    out = _run(impl, q, k, v, None, kw)
    return jnp.sum(out * jnp.cos(out)), out

  # dq and the dk/dv kernel (padded rows, rows with no key) against the reference.
  grad = lambda impl: jax.value_and_grad(
    lambda q, k, v: loss(q, k, v, impl), argnums=(0, 1, 2), has_aux=True
  )(q, k, v)
  (_, got), g_got = grad("pallas_gpu")
  (_, want), g_want = grad("reference")
  np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
  for name, a, b in zip("qkv", g_got, g_want):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5, err_msg=f"d{name}")
  if T_ > 25:
    assert not np.any(np.asarray(got[:, 25:]))  # a row with no allowed key is zero


def row_errors(got, want) -> np.ndarray:
  """Each row's largest error over the head dim, relative to that row's largest true entry
  (at least 1e-3 of the whole tensor's: a row whose gradient is that much smaller than the
  others' holds only their rounding)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  scale = np.maximum(np.max(np.abs(want), axis=-1), 1e-3 * np.max(np.abs(want)))
  return np.max(np.abs(got - want), axis=-1) / scale


def single_key_rows(dtype):
  """Packed segments starting at rows 13 and 30 (causal: rows 13 and 30 see their own key
  only); at those rows each head's logit is small and positive (0.001 to 0.1) or negative."""
  q, k, v = rand_qkv(B=2, T=T, S=T, N=4, K=2, H=16, seed=3)
  q, k = np.array(q), np.array(k)
  scale = 16**-0.5
  for r in (13, 30):
    for n, z in enumerate((0.001, 0.01, 0.1, -0.05)):
      kr = k[:, r, n // 2]
      q[:, r, n] = kr * (z / scale / np.sum(kr * kr, axis=-1, keepdims=True))
  seg = jnp.asarray(np.repeat(np.cumsum(np.isin(np.arange(T), (13, 30)))[None], 2, 0))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v)), seg


@pytest.mark.parametrize(
  "normalizer",
  [
    "softpick",
    "softmax",
    *(pytest.param(n, marks=pytest.mark.slow) for n in ("softmax_one", "sigmoid", "relu", "none")),
  ],
)
def test_pallas_gpu_backward_keeps_each_rows_precision(normalizer):
  # bfloat16, causal packed segments, the logsumexp statistic in the loss: every row of dq,
  # dk and dv against float64, each relative to its own scale. A row that sees one key with a
  # small positive logit has a softpick gradient of e^z (dp - D) / (e^z - 1 + eps), and D was
  # <dO, O>, whose O came from weights rounded to bfloat16 for the P V product (and was
  # stored in bfloat16): such rows were off by up to 98% (the global metric of
  # `python -m attnjax.check --interpret` diluted one to 4.6e-2). Now D is summed from the
  # tiles in float32: softpick's rows are within 1.3e-2 (the reference's 5.7e-3), softmax's
  # 2.3e-2, "none"'s 2.1e-2.
  (q, k, v), seg = single_key_rows(jnp.bfloat16)
  kw = dict(is_causal=True, segment_ids=seg, normalizer=normalizer, return_stats=True)

  def loss(q, k, v, fn, dtype=jnp.float32):
    out, st = fn(*dense.prepare(q, k, v, **kw))
    return jnp.sum(out.astype(dtype) ** 2) + jnp.sum(st.logsumexp)

  kernel = lambda inputs, opts: run_kernel(
    pallas_gpu, inputs, opts, interpret=True, block_sizes=BLOCKS
  )
  got = jax.jit(jax.grad(functools.partial(loss, fn=kernel), (0, 1, 2)))(q, k, v)
  with jax.enable_x64(True):
    exact = jax.jit(
      jax.grad(functools.partial(loss, fn=dense.reference, dtype=jnp.float64), (0, 1, 2))
    )(*(np.asarray(x, np.float64) for x in (q, k, v)))
    exact = [np.asarray(x) for x in exact]
  # bfloat16 rounds dO, the weights and dS for the tensor-core products and the result (2^-9
  # each), and a row's sum over its keys may cancel: a few times 2^-8 per row.
  tol = 16 * 2.0**-8
  for name, a, b in zip(("dq", "dk", "dv"), got, exact):
    err = row_errors(a, b)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err[worst] < tol, f"{name} row {worst}: error {err[worst]:.2e} of its scale"


@pytest.mark.parametrize(
  "case",
  [
    ("softmax", "causal", True, jnp.bfloat16, True, True, 20.0),  # sinks: the null column
    ("sigmoid", "segments", True, jnp.bfloat16, True, False, None),  # counts before tiles
    pytest.param(
      ("softmax_one", "window", False, jnp.float16, True, False, None), marks=pytest.mark.slow
    ),
  ],
  ids=["softmax-sinks", "sigmoid-counts", "softmax_one-fp16"],
)
def test_pallas_gpu_row_terms_from_tiles_for_every_normaliser(case, monkeypatch):
  # The dq kernel's float32 D (taken for softpick only) runs the forward's online pass of any
  # normaliser: with a learned null column and with the allowed-key counts too.
  monkeypatch.setattr(pallas_backward, "needs_row_terms", lambda c: True)
  monkeypatch.setattr(pallas_backward, "row_terms_from_tiles", lambda c, dtype: True)
  TestPallasGpu().check(case)


class TestPallasGpuAsymmetricBackward(TestPallasGpu):
  """The dk/dv kernel's tiles apart from the dq kernel's (as the sm_80 rows at head dims <= 64
  have them: long programs, short loop steps): dq programs of 32 rows stepping over 16 keys,
  dk/dv programs of 32 keys stepping over 16 rows; T = 40, S = 72 pad both."""

  def run(self, inputs, opts):
    return run_kernel(pallas_gpu, inputs, opts, interpret=True, block_sizes=ASYMMETRIC)

  def default_cases(self):
    return [
      ("softmax", "causal", True, jnp.bfloat16, True, True, 20.0),
      ("softpick", "segments", True, jnp.bfloat16, True, False, None),
      ("sigmoid", "window", False, jnp.float32, True, False, None),
    ]

  def normaliser_cases(self):
    return []

  def slow_cases(self):
    return []


ASYMMETRIC = pallas_gpu.BlockSizes(
  block_q=32, block_k=16, block_q_bwd=32, block_k_bwd=16, block_q_dkdv=16, block_k_dkdv=32
)


def test_pallas_gpu_block_sizes_by_kernel():
  # A100 rows at head dims <= 64 in bf16 / fp16: the tutorial's asymmetric backward tiles.
  sizes = pallas_gpu.block_sizes_for(64, jnp.bfloat16, 8)
  assert (sizes.block_q_bwd, sizes.block_k_bwd, sizes.block_q_dkdv, sizes.block_k_dkdv) == (
    128,
    32,
    32,
    128,
  )
  assert pallas_gpu.block_sizes_for(64, jnp.bfloat16, 9) == pallas_gpu.DEFAULT_BLOCK_SIZES
  with pytest.raises(ValueError, match="block_k_dkdv"):
    pallas_gpu.BlockSizes(block_k_dkdv=48)


def _softpick_loss_f64(q, k, v, seg):
  """The softpick loss of the single-key-row cases (causal, packed segments, ``sum out^2`` and
  the logsumexp) written out in float64 from the float32 inputs: ``e^z - 1`` by ``expm1``,
  nothing rounded to float32 (``dense.reference`` takes its logits in float32)."""
  out, z, allowed = softpick_f64(q, k, v, seg)
  lse = jax.nn.logsumexp(jnp.where(allowed, z, -jnp.inf), -1)
  return jnp.sum(out**2) + jnp.sum(lse)


@pytest.mark.parametrize("engine", ["blockwise", "pallas_gpu"])
def test_softpick_float32_weights_keep_single_key_rows_precise(engine):
  # float32, rows 13 and 30 see one key with logit 0.001 .. 0.1. The tile backward took the
  # weight as e^(z - ln) - e^-ln, a difference of two terms ~1/(e^z - 1), and the online pass
  # its e^(z - s) - e^-s: dv on those rows was off by 3.0e-5 of its scale (the reference
  # 5.3e-7). Both now take e^z - 1 without cancellation: 5.8e-7 (blockwise), 1.8e-6.
  # dq is left out: its single-key rows move by ~1/z times the float32 logit's rounding in
  # every engine (the reference's own 2.5e-4).
  from attnjax._src.kernels.blockwise import kernel as blockwise

  (q, k, v), seg = single_key_rows(jnp.float32)
  kw = dict(is_causal=True, segment_ids=seg, normalizer="softpick", return_stats=True)
  run = {
    "blockwise": lambda i, o: blockwise.run(i, o, block_q=16, block_k=16),
    "pallas_gpu": lambda i, o: run_kernel(pallas_gpu, i, o, interpret=True, block_sizes=BLOCKS),
  }

  def loss(q, k, v):
    out, st = run[engine](*dense.prepare(q, k, v, **kw))
    return jnp.sum(out**2) + jnp.sum(st.logsumexp)

  got = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
  with jax.enable_x64(True):
    exact = jax.grad(functools.partial(_softpick_loss_f64, seg=seg), (0, 1, 2))(
      *(np.asarray(x, np.float64) for x in (q, k, v))
    )
    exact = [np.asarray(x) for x in exact]
  # a row's sums over its T keys (and the head dim) in float32: a few eps per term
  tol = 4 * np.finfo(np.float32).eps * T
  for name, a, b in zip(("dk", "dv"), got[1:], exact[1:]):
    err = row_errors(a, b)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err[worst] < tol, f"{name} row {worst}: error {err[worst]:.2e} of its scale"
