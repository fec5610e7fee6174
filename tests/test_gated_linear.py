"""Gated linear attention: the three forms agree (value, final state, every gradient)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src import feature_maps, masks
from attnjax._src.ops.gated_linear import attention as gated_linear
from attnjax._src.kernels.recurrent import gla_chunk
from attnjax._src.ops.gated_linear.attention import gated_linear_attention
from helpers import assert_close, rand_qkv

FORMS = ("reference", "quadratic", "chunked")


def _inputs(
  B=2, T=13, N=4, K=2, H=8, Hv=6, *, per_channel=False, lo=0.05, hi=1.0, seed=0, dtype=jnp.float32
):
  q, k, v = rand_qkv(B=B, T=T, N=N, K=K, H=H, Hv=Hv, seed=seed, dtype=dtype)
  rng = np.random.default_rng(seed + 1)
  shape = (B, T, N, H) if per_channel else (B, T, N)
  g = jnp.asarray(-rng.uniform(lo, hi, shape), jnp.float32)
  s0 = jnp.asarray(rng.standard_normal((B, N, H, Hv)), jnp.float32)
  return q, k, v, g, s0


@functools.partial(jax.jit, static_argnames=("forms", "chunk_size"))
def _forms_and_grads(q, k, v, g, s0, seg, *, forms=FORMS, chunk_size=4):
  """Per form: (out, final state) and gradients wrt (q, k, v, log_decay, initial_state)."""
  rng = np.random.default_rng(11)
  B, T, N, _ = q.shape
  ct_out = jnp.asarray(rng.standard_normal((B, T, N, v.shape[-1])), jnp.float32)
  ct_state = jnp.asarray(rng.standard_normal(s0.shape), jnp.float32)
  results = {}
  for form in forms:

    def loss(q, k, v, g, s0, form=form):
      out, state = gated_linear_attention(
        q,
        k,
        v,
        log_decay=g,
        initial_state=s0,
        return_state=True,
        segment_ids=seg,
        implementation=form,
        chunk_size=chunk_size,
      )
      return (jnp.sum(out.astype(jnp.float32) * ct_out) + jnp.sum(state * ct_state), (out, state))

    grads, value = jax.grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(q, k, v, g, s0)
    results[form] = (value, grads)
  return results


def _check_forms(results, rtol=2e-5, atol=2e-5):
  ref_value, ref_grads = results["reference"]
  for form, (value, grads) in results.items():
    for x in jax.tree.leaves((value, grads)):
      assert np.all(np.isfinite(np.asarray(x, np.float32))), form
    assert_close(value, ref_value, f"{form} value/state", rtol=rtol, atol=atol, scaled=True)
    assert_close(
      grads,
      ref_grads,
      f"{form} grads (q, k, v, log_decay, initial_state)",
      rtol=rtol,
      atol=atol,
      scaled=True,
    )
    # Each gradient also on its own scale: under a strong gate the decays' gradient is
    # ~1e-8, far below atol, and float32 cancellation could otherwise hide there.
    for name, x, y in zip(("q", "k", "v", "log_decay", "initial_state"), grads, ref_grads):
      y = np.asarray(y)
      err = np.max(np.abs(np.asarray(x) - y)) / max(np.max(np.abs(y)), 1e-30)
      assert err < 10 * rtol, f"{form} grad {name}: max error {err:.2e} of its max |grad|"


@pytest.mark.parametrize("chunk_size", [4, 64])
@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per_channel"])
def test_forms_agree_gqa_ragged_length(per_channel, chunk_size):
  # N=4, K=2 (GQA), T=13: not a multiple of chunk_size=4, and shorter than one chunk.
  q, k, v, g, s0 = _inputs(per_channel=per_channel)
  _check_forms(_forms_and_grads(q, k, v, g, s0, None, chunk_size=chunk_size))


@pytest.mark.parametrize("per_channel", [False, True], ids=["scalar", "per_channel"])
def test_forms_agree_with_segments(per_channel):
  q, k, v, g, s0 = _inputs(per_channel=per_channel, seed=3)
  # Resets inside a chunk, at a chunk boundary (8) and an id that comes back (0).
  seg = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 0, 0, 0], [5] * 13], jnp.int32)
  _check_forms(_forms_and_grads(q, k, v, g, s0, seg))


def test_forms_agree_secondary_chunking():
  # chunk_size=64 is four sub-blocks of SUB_BLOCK=16 (per-channel decay), so keys two and three
  # sub-blocks back go through the factor between sub-blocks; T=72: a ragged chunk.
  assert gated_linear.SUB_BLOCK == 16
  q, k, v, g, s0 = _inputs(T=72, H=16, per_channel=True, seed=1)
  # Row 0: resets inside sub-blocks; row 1: none (one document).
  seg = jnp.asarray([[0] * 7 + [1] * 33 + [2] * 30 + [3] * 2, [3] * 72], jnp.int32)
  _check_forms(_forms_and_grads(q, k, v, g, s0, seg, chunk_size=64))
  # One chunk through the sub-blocks and the hand-written backward equals autodiff of the
  # fully materialised block, resets included.
  gc = jnp.reshape(g[:, :64], (2, 64, 2, 2, 16))
  qg = jnp.reshape(q[:, :64], (2, 64, 2, 2, 16))
  s0g = jnp.reshape(s0, (2, 2, 2, 16, 6))
  reset = masks.segment_resets(seg[:, :64], 2, 64).astype(jnp.float32)

  def materialised(q, k, v, g, s):
    return gated_linear._block_state(gated_linear._block_terms(q, k, g, reset) + (v,), s)

  def sub_blocked(q, k, v, g, s):
    return gla_chunk.sub_blocked_chunk(q, k, v, g, reset, s, 16)

  def direct(q, k, v, g, s):
    return gla_chunk.direct_chunk(q, k, v, g, reset, s)

  # The chunk decays by more than the direct path takes: gla_chunk runs the sub-blocks.
  assert float(jnp.max(-jnp.sum(gc, axis=1))) > gla_chunk.DIRECT_MAX_DECAY
  _check_chunk_vjps(materialised, sub_blocked, (qg, k[:, :64], v[:, :64], gc, s0g), "sub-blocked")
  # The direct path on the same chunk with its decays scaled into its range (total <= 16).
  weak = gc * (0.9 * gla_chunk.DIRECT_MAX_DECAY / float(jnp.max(-jnp.sum(gc, axis=1))))
  _check_chunk_vjps(materialised, direct, (qg, k[:, :64], v[:, :64], weak, s0g), "direct")


def _check_chunk_vjps(materialised, fast, args, name):
  """``fast`` equals autodiff of ``materialised`` in value and vjp (same random cotangents)."""
  results = []
  for fn in (materialised, fast):
    rng = np.random.default_rng(2)
    value, pull = jax.vjp(jax.jit(fn), *args)  # jitted: one compile, not op by op
    cts = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), value)
    results.append((value, pull(cts)))
  # Scaled: outputs reach ~12 here, and a sum's float32 rounding follows its largest term.
  assert_close(
    results[1], results[0], f"{name} chunk: value and vjp", rtol=2e-5, atol=2e-5, scaled=True
  )
  # The decays' gradient on its own scale, as in _check_forms.
  ref, got = results[0][1][3], results[1][1][3]
  err = np.max(np.abs(np.asarray(got) - np.asarray(ref))) / np.max(np.abs(np.asarray(ref)))
  assert err < 2e-4, f"{name} chunk: log_decay grad max error {err:.2e} of its max"


def test_forms_agree_direct_and_sub_blocked_chunks_mixed():
  # chunk_size=16, T=40: chunk 0 decays weakly (direct path), chunk 1 strongly (total 16 * 2 = 32
  # > DIRECT_MAX_DECAY: sub-blocks of 16 = the whole chunk), chunk 2 (ragged) weakly again,
  # so the state passes between the two paths both ways, in value and gradient.
  q, k, v, _, s0 = _inputs(T=40, per_channel=True, seed=4)
  rng = np.random.default_rng(9)
  g = -rng.uniform(0.05, 0.5, (2, 40, 4, 8))
  g[:, 16:32] = -rng.uniform(1.5, 2.5, (2, 16, 4, 8))
  g = jnp.asarray(g, jnp.float32)
  assert gla_chunk.DIRECT_MAX_DECAY < float(jnp.min(-jnp.sum(g[:, 16:32], axis=1)))
  assert float(jnp.max(-jnp.sum(g[:, :16], axis=1))) < gla_chunk.DIRECT_MAX_DECAY
  _check_forms(_forms_and_grads(q, k, v, g, s0, None, chunk_size=16))


@pytest.mark.parametrize("form", FORMS)
def test_segments_equal_separate_documents(form):
  q, k, v, g, s0 = _inputs(B=1, T=12, per_channel=True, seed=5)
  seg = jnp.asarray([[0] * 5 + [1] * 7], jnp.int32)
  kw = dict(implementation=form, chunk_size=4, return_state=True)
  packed, final = gated_linear_attention(
    q, k, v, log_decay=g, initial_state=s0, segment_ids=seg, **kw
  )
  first, _ = gated_linear_attention(
    q[:, :5], k[:, :5], v[:, :5], log_decay=g[:, :5], initial_state=s0, **kw
  )
  second, final2 = gated_linear_attention(
    q[:, 5:], k[:, 5:], v[:, 5:], log_decay=g[:, 5:], **kw
  )  # a new document: zero state
  assert_close(packed, jnp.concatenate([first, second], axis=1), f"{form} outputs")
  assert_close(final, final2, f"{form} final state")


@pytest.mark.parametrize("shape", [(2, 72, 4), (2, 72, 4, 8)], ids=["scalar", "per_channel"])
@pytest.mark.parametrize("log_decay", [-20.0, -1e-4], ids=["strong", "weak"])
def test_extreme_decays_finite_and_equal(log_decay, shape):
  # chunk_size=64: per channel, four sub-blocks (keys up to three sub-blocks back); T=72 ragged.
  q, k, v, _, s0 = _inputs(T=72, seed=7)
  g = jnp.full(shape, log_decay, jnp.float32)
  results = _forms_and_grads(q, k, v, g, s0, None, chunk_size=64)
  _check_forms(results, rtol=1e-4, atol=1e-4)


def test_bf16_inputs():
  q, k, v, g, s0 = _inputs(per_channel=True, dtype=jnp.bfloat16)
  outs = {}
  for form in FORMS:
    out, state = gated_linear_attention(
      q, k, v, log_decay=g, initial_state=s0, return_state=True, implementation=form, chunk_size=4
    )
    assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    outs[form] = (out.astype(jnp.float32), state)
  f32 = gated_linear_attention(
    q.astype(jnp.float32),
    k.astype(jnp.float32),
    v.astype(jnp.float32),
    log_decay=g,
    initial_state=s0,
    return_state=True,
    implementation="reference",
  )
  for form in FORMS:
    assert_close(outs[form], f32, f"bf16 {form}", rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("form", FORMS)
def test_state_chaining(form):
  q, k, v, g, s0 = _inputs(T=11, per_channel=True, seed=9)
  kw = dict(implementation=form, chunk_size=4, return_state=True)
  whole, final = gated_linear_attention(q, k, v, log_decay=g, initial_state=s0, **kw)
  a, mid = gated_linear_attention(
    q[:, :6], k[:, :6], v[:, :6], log_decay=g[:, :6], initial_state=s0, **kw
  )
  b, end = gated_linear_attention(
    q[:, 6:], k[:, 6:], v[:, 6:], log_decay=g[:, 6:], initial_state=mid, **kw
  )
  assert_close(jnp.concatenate([a, b], axis=1), whole, f"{form} chained outputs")
  assert_close(end, final, f"{form} chained final state")


def test_return_rule_and_broadcast_decay():
  q, k, v, _, _ = _inputs()
  out = gated_linear_attention(q, k, v, log_decay=jnp.float32(-0.5))
  # S_t = e^-0.5 S_{t-1} + k_t v_t^T, o_t = S_t^T q_t / sqrt(H), written out in numpy.
  qn, kn, vn = (
    np.repeat(np.asarray(x, np.float64), 2, axis=2) if x is not q else np.asarray(x, np.float64)
    for x in (q, k, v)
  )
  state_np = np.zeros((2, 4, 8, 6))
  want = np.zeros((2, 13, 4, 6))
  for t in range(13):
    state_np = np.exp(-0.5) * state_np + np.einsum("bnh,bnv->bnhv", kn[:, t], vn[:, t])
    want[:, t] = np.einsum("bnhv,bnh->bnv", state_np, qn[:, t]) / np.sqrt(8.0)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  per_head = gated_linear_attention(q, k, v, log_decay=jnp.full((1, 1, 4), -0.5))
  assert_close(out, per_head, "scalar vs [1, 1, N] decay")
  out2, state = gated_linear_attention(q, k, v, log_decay=-0.5, return_state=True)
  assert state.dtype == jnp.float32
  np.testing.assert_allclose(state, state_np, rtol=1e-5, atol=1e-5)
  assert_close(out2, out, "return_state keeps out")


@pytest.mark.parametrize("form", FORMS)
def test_zero_decay_equals_linear_attention(form):
  # linear_attention(identity, normalize="none", causal) is sum_{j<=i} (q_i.k_j) v_j with no
  # scale; gated_linear_attention with g = 0 is the same times `scale`.
  q, k, v, _, _ = _inputs(T=10, seed=13)
  lin = attnjax.linear_attention(
    q,
    k,
    v,
    feature_map=feature_maps.identity,
    normalize="none",
    is_causal=True,
    implementation="reference",
  )
  gla = gated_linear_attention(
    q, k, v, log_decay=jnp.zeros((2, 10, 4)), scale=0.5, implementation=form, chunk_size=4
  )
  assert_close(gla, 0.5 * lin, form, rtol=1e-5, atol=1e-5)
  default = gated_linear_attention(q, k, v, log_decay=0.0, implementation=form, chunk_size=4)
  assert_close(default, lin * 8**-0.5, f"{form} default scale H**-0.5", rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(log_decay=jnp.zeros((2, 13, 3))), ValueError, r"log_decay of shape \(2, 13, 3\)"),
    (dict(log_decay=jnp.zeros((2, 13, 4, 5))), ValueError, r"log_decay .*\[B, T, N, H\]"),
    (dict(log_decay=jnp.zeros((1, 2, 13, 4, 8))), ValueError, "log_decay must broadcast"),
    (
      dict(log_decay=jnp.zeros((2, 13, 4), jnp.int32)),
      TypeError,
      "log_decay must be a floating-point",
    ),
    (dict(log_decay=None), TypeError, "log_decay is required"),
    (
      dict(log_decay=0.0, initial_state=jnp.zeros((2, 2, 8, 6))),
      ValueError,
      r"initial_state must have shape \[B, N, H, Hv\] = \(2, 4, 8, 6\)",
    ),
    (
      dict(log_decay=0.0, segment_ids=jnp.zeros((2, 12), jnp.int32)),
      ValueError,
      "segment_ids must have shape",
    ),
    (dict(log_decay=0.0, segment_ids=jnp.zeros((2, 13))), TypeError, "segment_ids must be integer"),
    (dict(log_decay=0.0, implementation="blockwise"), ValueError, "implementation='blockwise'"),
    (
      dict(log_decay=0.0, chunk_size=0),
      ValueError,
      "chunk_size must be a positive int, got chunk_size=0",
    ),
    (dict(log_decay=0.0, scale=-1.0), ValueError, "scale must be positive"),
  ],
)
def test_validation_errors(kwargs, error, match):
  q, k, v, _, _ = _inputs()
  with pytest.raises(error, match=match):
    gated_linear_attention(q, k, v, **kwargs)


def test_validation_kv_heads_and_lengths():
  q, k, v, _, _ = _inputs()
  with pytest.raises(ValueError, match="multiple of key/value heads"):
    gated_linear_attention(q[:, :, :3], k, v, log_decay=0.0)
  with pytest.raises(ValueError, match="as many keys as queries"):
    gated_linear_attention(q[:, :10], k, v, log_decay=0.0)


def test_chunk_size_32_runs_forward_and_backward():
  # With the chunk terms computed for many chunks at once, this shape (per-channel gates,
  # chunk_size=32, N=8, H=64) segfaulted jaxlib 0.10.2's CPU backend (its "ynn" fusion).
  q, k, v = rand_qkv(B=1, T=256, N=8, K=8, H=64, seed=5)
  g = jnp.broadcast_to(jax.nn.log_sigmoid(jnp.linspace(2.0, 6.0, 64)) / 16.0, q.shape)

  def loss(q, impl):
    return jnp.sum(
      gated_linear_attention(q, k, v, log_decay=g, chunk_size=32, implementation=impl) ** 2
    )

  got = jax.jit(jax.grad(lambda q: loss(q, "chunked")))(q)
  want = jax.jit(jax.grad(lambda q: loss(q, "reference")))(q)
  # float32 sums over 256 steps of 64 channels: within 1e-3 of the largest entry (about 12).
  assert_close(got, want, "chunk_size=32 dq", rtol=1e-3, atol=1e-2)
