"""Delta-rule attention: the chunked (WY / UT) and quadratic (one chunk) forms equal the scan
reference in value, final state and every gradient; segment resets, state chaining, bf16,
validation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src.ops.delta_rule import attention as delta_rule
from attnjax._src.ops.delta_rule.attention import delta_rule_attention
from helpers import assert_close


def _inputs(
  B=2,
  T=37,
  N=4,
  K=2,
  H=8,
  Hv=None,
  *,
  seed=0,
  beta=(0.1, 0.9),
  decay=(-1.0, 0.0),
  gated=True,
  dtype=jnp.float32,
):
  """numpy draws (no XLA program per shape); k L2-normalised as the papers' layers do."""
  Hv = H if Hv is None else Hv
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, N, H), np.float32)
  k = rng.standard_normal((B, T, K, H), np.float32)
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  v = rng.standard_normal((B, T, K, Hv), np.float32)
  b = rng.uniform(*beta, (B, T, N)).astype(np.float32)
  g = rng.uniform(*decay, (B, T, N)).astype(np.float32) if gated else None
  s0 = 0.5 * rng.standard_normal((B, N, H, Hv)).astype(np.float32)
  cast = lambda x: None if x is None else jnp.asarray(x, dtype)
  return cast(q), cast(k), cast(v), cast(b), cast(g), jnp.asarray(s0)


def _cotangents(B, T, N, H, Hv, seed=11):
  rng = np.random.default_rng(seed)
  return (
    jnp.asarray(rng.standard_normal((B, T, N, Hv), np.float32)),
    jnp.asarray(rng.standard_normal((B, N, H, Hv), np.float32)),
  )


@functools.partial(jax.jit, static_argnames=("chunk_size", "gated", "forms"))
def _both_forms(q, k, v, beta, g, s0, seg, ct_out, ct_state, *, chunk_size, gated, forms):
  """(out, state, grads) per form; grads of <out, ct_out> + <state, ct_state>
  with respect to q, k, v, beta, log_decay (if gated) and initial_state."""
  results = []
  for impl in forms:

    def loss(q, k, v, beta, g, s0):
      out, state = delta_rule_attention(
        q,
        k,
        v,
        beta,
        log_decay=g if gated else None,
        initial_state=s0,
        return_state=True,
        segment_ids=seg,
        implementation=impl,
        chunk_size=chunk_size,
      )
      l = jnp.sum(out.astype(jnp.float32) * ct_out) + jnp.sum(state * ct_state)
      return l, (out, state)

    argnums = (0, 1, 2, 3, 4, 5) if gated else (0, 1, 2, 3, 5)
    grads, (out, state) = jax.grad(loss, argnums=argnums, has_aux=True)(q, k, v, beta, g, s0)
    results.append((out, state, grads))
  return results


def _check_forms(
  q,
  k,
  v,
  beta,
  g,
  s0,
  seg=None,
  *,
  chunk_size=16,
  rtol=2e-5,
  atol=2e-5,
  grad_tol=1e-4,
  forms=("reference", "chunked"),
):
  B, T, _, H = q.shape
  N = beta.shape[2]  # the call's heads (the values' with value-head grouping)
  Hv = v.shape[-1]
  ct_out, ct_state = _cotangents(B, T, N, H, Hv)
  gated = g is not None
  if g is None:
    g = jnp.zeros_like(beta)
  (ro, rs, rg), (co, cs, cg) = _both_forms(
    q, k, v, beta, g, s0, seg, ct_out, ct_state, chunk_size=chunk_size, gated=gated, forms=forms
  )
  assert co.dtype == q.dtype and cs.dtype == jnp.float32
  assert co.shape == (B, T, N, Hv) and cs.shape == (B, N, H, Hv)
  assert np.all(np.isfinite(np.asarray(co, np.float32)))
  assert_close(co.astype(jnp.float32), ro.astype(jnp.float32), "out", rtol=rtol, atol=atol)
  assert_close(cs, rs, "state", rtol=rtol, atol=atol)
  names = (
    ("q", "k", "v", "beta", "log_decay", "initial_state")
    if gated
    else ("q", "k", "v", "beta", "initial_state")
  )
  for name, a, b in zip(names, cg, rg):
    assert np.all(np.isfinite(np.asarray(a, np.float32))), name
    assert_close(
      a.astype(jnp.float32), b.astype(jnp.float32), f"grad {name}", rtol=grad_tol, atol=grad_tol
    )
  return ro, rs


def test_exported():
  assert attnjax.delta_rule_attention is delta_rule_attention
  assert "delta_rule_attention" in attnjax.__all__


@pytest.mark.parametrize(
  "gated,T,chunk_size",
  [(False, 37, 16), (True, 37, 16), (True, 32, 8), (False, 20, 64)],
  ids=["plain-ragged", "gated-ragged", "gated-exact", "plain-one_chunk"],
)
def test_chunked_equals_reference(gated, T, chunk_size):
  q, k, v, b, g, s0 = _inputs(T=T, gated=gated)
  _check_forms(q, k, v, b, g, s0, chunk_size=chunk_size)


def test_quadratic_equals_reference_with_segments():
  # The chunk form over the whole sequence as one chunk (no scan); a reset inside it.
  q, k, v, b, g, s0 = _inputs(T=13, seed=6)
  seg = jnp.asarray(np.repeat([[0] * 5 + [1] * 8], 2, axis=0), jnp.int32)
  _check_forms(q, k, v, b, g, s0, seg, forms=("reference", "quadratic"))


def test_gqa_heads_differ_and_mqa():
  # N=4, K=2 above; here MQA (K=1) with Hv != H.
  q, k, v, b, g, s0 = _inputs(T=19, N=4, K=1, H=8, Hv=4, seed=3)
  _check_forms(q, k, v, b, g, s0, chunk_size=8)


def test_gqa_equals_repeated_kv():
  """GQA reads kv head n // (N // K): equal to repeating k, v to N heads."""
  q, k, v, b, g, s0 = _inputs(T=21, N=4, K=2, seed=5)
  out = delta_rule_attention(q, k, v, b, log_decay=g, initial_state=s0, chunk_size=8)
  rep = delta_rule_attention(
    q,
    jnp.repeat(k, 2, axis=2),
    jnp.repeat(v, 2, axis=2),
    b,
    log_decay=g,
    initial_state=s0,
    chunk_size=8,
  )
  assert_close(out, rep, "gqa")


@pytest.mark.parametrize("beta", [(1e-3, 1e-3), (0.999, 0.999)], ids=["beta_small", "beta_one"])
def test_beta_extremes(beta):
  q, k, v, b, g, s0 = _inputs(T=29, beta=beta, seed=1)
  _check_forms(q, k, v, b, g, s0, chunk_size=8)


@pytest.mark.parametrize("decay", [(-20.0, -20.0), (-1e-4, -1e-4)], ids=["strong", "weak"])
def test_decay_extremes(decay):
  # chunk_size=32: cumulative gates reach -640 inside a chunk; nothing may overflow.
  q, k, v, b, g, s0 = _inputs(T=45, decay=decay, seed=2)
  ro, _ = _check_forms(q, k, v, b, g, s0, chunk_size=32)
  if decay[0] == -20.0:
    # exp(-20) ~ 2e-9: each output is (almost) only its own write beta_t k_t v_t^T.
    B, T, N, H = q.shape
    qg = np.asarray(q).reshape(B, T, 2, 2, H) * H**-0.5
    own = (
      np.einsum("btkgh,btkh->btkg", qg, np.asarray(k))[..., None]
      * np.asarray(b).reshape(B, T, 2, 2)[..., None]
      * np.asarray(v)[:, :, :, None]
    )
    np.testing.assert_allclose(np.asarray(ro)[:, 1:], own.reshape(B, T, N, H)[:, 1:], atol=1e-6)


def test_segments_equal_documents_run_separately():
  lengths = (10, 17, 6)
  T = sum(lengths)
  q, k, v, b, g, s0 = _inputs(B=1, T=T, seed=4)
  seg = jnp.asarray(np.repeat(np.arange(3), lengths)[None])
  ro, rs = _check_forms(q, k, v, b, g, s0, seg, chunk_size=8)
  start = 0
  for i, L in enumerate(lengths):
    sl = slice(start, start + L)
    out, state = delta_rule_attention(
      q[:, sl],
      k[:, sl],
      v[:, sl],
      b[:, sl],
      log_decay=g[:, sl],
      initial_state=s0 if i == 0 else None,
      return_state=True,
      implementation="reference",
    )
    assert_close(ro[:, sl], out, f"document {i}")
    start += L
  assert_close(rs, state, "final state is the last document's")


def test_segments_reset_inside_and_at_chunk_edges():
  # Resets at a chunk boundary (8), mid-chunk, and ids that repeat non-contiguously.
  ids = np.array([0] * 8 + [1] * 3 + [0] * 5 + [2] * 1 + [1] * 7)
  q, k, v, b, g, s0 = _inputs(B=2, T=len(ids), seed=6)
  seg = jnp.asarray(np.stack([ids, np.zeros_like(ids)]))
  _check_forms(q, k, v, b, g, s0, seg, chunk_size=8)


def test_bf16_inputs():
  q, k, v, b, g, s0 = _inputs(T=33, seed=8, dtype=jnp.bfloat16)
  _check_forms(q, k, v, b, g, s0, chunk_size=16, rtol=2e-2, atol=2e-2, grad_tol=5e-2)
  # And close to the float32 computation on the same (rounded) inputs.
  f32 = lambda x: x.astype(jnp.float32)
  out16 = delta_rule_attention(q, k, v, b, log_decay=g, initial_state=s0)
  out32 = delta_rule_attention(f32(q), f32(k), f32(v), f32(b), log_decay=f32(g), initial_state=s0)
  assert out16.dtype == jnp.bfloat16
  assert_close(f32(out16), out32, "bf16 vs f32", rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_state_chaining(impl):
  q, k, v, b, g, s0 = _inputs(T=40, seed=9)
  seg = jnp.asarray(np.repeat([[0] * 12 + [1] * 28], 2, axis=0))
  kw = dict(implementation=impl, chunk_size=8, return_state=True)
  out, state = delta_rule_attention(
    q, k, v, b, log_decay=g, initial_state=s0, segment_ids=seg, **kw
  )
  cut = 19
  o1, s1 = delta_rule_attention(
    q[:, :cut],
    k[:, :cut],
    v[:, :cut],
    b[:, :cut],
    log_decay=g[:, :cut],
    initial_state=s0,
    segment_ids=seg[:, :cut],
    **kw,
  )
  o2, s2 = delta_rule_attention(
    q[:, cut:],
    k[:, cut:],
    v[:, cut:],
    b[:, cut:],
    log_decay=g[:, cut:],
    initial_state=s1,
    segment_ids=seg[:, cut:],
    **kw,
  )
  assert_close(jnp.concatenate([o1, o2], axis=1), out, "chained out")
  assert_close(s2, state, "chained state")


def test_hand_checked_tiny_case():
  """T=2, H=2, one head: the recurrence written out by hand in numpy."""
  q = np.array([[1.0, 0.0], [0.5, -1.0]])
  k = np.array([[0.6, 0.8], [1.0, 0.0]])
  v = np.array([[2.0, -1.0], [0.0, 3.0]])
  beta = np.array([0.5, 0.25])
  g = np.array([-0.1, -0.7])
  scale = 0.5
  s = np.zeros((2, 2))
  s = np.exp(g[0]) * (np.eye(2) - beta[0] * np.outer(k[0], k[0])) @ s + beta[0] * np.outer(
    k[0], v[0]
  )
  # S_1 = 0.5 * [0.6, 0.8]^T [2, -1] = [[0.6, -0.3], [0.8, -0.4]]
  np.testing.assert_allclose(s, [[0.6, -0.3], [0.8, -0.4]])
  o0 = scale * s.T @ q[0]  # 0.5 * [0.6, -0.3]
  s = np.exp(g[1]) * (np.eye(2) - beta[1] * np.outer(k[1], k[1])) @ s + beta[1] * np.outer(
    k[1], v[1]
  )
  o1 = scale * s.T @ q[1]
  e = np.exp(-0.7)
  np.testing.assert_allclose(s, [[0.75 * 0.6 * e, -0.75 * 0.3 * e + 0.75], [0.8 * e, -0.4 * e]])
  arr = lambda x: jnp.asarray(x, jnp.float32)[None, :, None]
  for impl in ("reference", "chunked"):
    out, state = delta_rule_attention(
      arr(q),
      arr(k),
      arr(v),
      arr(beta),
      log_decay=arr(g),
      scale=scale,
      return_state=True,
      implementation=impl,
    )
    np.testing.assert_allclose(np.asarray(out)[0, :, 0], np.stack([o0, o1]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state)[0, 0], s, rtol=1e-6, atol=1e-6)


def test_default_scale_and_no_decay_is_zero_decay():
  q, k, v, b, g, s0 = _inputs(T=12, seed=10)
  H = q.shape[-1]
  out = delta_rule_attention(q, k, v, b)
  assert_close(out, delta_rule_attention(q, k, v, b, scale=H**-0.5), "default scale")
  assert_close(out, delta_rule_attention(q, k, v, b, log_decay=jnp.zeros_like(b)), "g=0")


@pytest.mark.parametrize(
  "kwargs,args_fn,exc,match",
  [
    ({}, lambda q, k, v, b: (q[0], k, v, b), ValueError, r"q must have rank 4"),
    ({}, lambda q, k, v, b: (q, k[:, :5], v[:, :5], b), ValueError, r"S == T"),
    ({}, lambda q, k, v, b: (q[:, :, :3], k, v, b), ValueError, r"N=3.*K=2"),
    ({}, lambda q, k, v, b: (q, k, v, b[:, :, :2]), ValueError, r"beta must have shape"),
    ({}, lambda q, k, v, b: (q, k, v, b.astype(jnp.int32)), TypeError, r"beta must be a floating"),
    ({"log_decay": jnp.zeros((2, 12))}, None, ValueError, r"log_decay must have shape"),
    ({"initial_state": jnp.zeros((2, 2, 8, 8))}, None, ValueError, r"initial_state must have"),
    ({"implementation": "blockwise"}, None, ValueError, r"implementation='blockwise'"),
    ({"chunk_size": 0}, None, ValueError, r"chunk_size must be a positive int, got chunk_size=0"),
    ({"chunk_size": 2.5}, None, TypeError, r"a positive int, got chunk_size=2.5"),
    ({"scale": -1.0}, None, ValueError, r"scale must be positive"),
    ({"segment_ids": jnp.zeros((2, 11), jnp.int32)}, None, ValueError, r"segment_ids"),
    (
      {"segment_ids": (jnp.zeros((2, 12), jnp.int32),) * 2},
      None,
      TypeError,
      r"segment_ids must be one",
    ),
  ],
)
def test_validation(kwargs, args_fn, exc, match):
  q, k, v, b, _, _ = _inputs(T=12)
  args = (q, k, v, b) if args_fn is None else args_fn(q, k, v, b)
  with pytest.raises(exc, match=match):
    delta_rule_attention(*args, **kwargs)


@pytest.mark.parametrize("C", [1, 2, 5, 16, 64])
def test_unit_lower_inverse(C):
  a = np.tril(np.random.default_rng(C).standard_normal((3, C, C)) * 0.3, -1).astype(np.float32)
  got = delta_rule.unit_lower_inverse(jnp.asarray(a))
  want = np.linalg.inv(np.eye(C) + a.astype(np.float64))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_unit_lower_solve_vjp_is_the_solves():
  # The hand-written VJP equals autodiff of the inverse-times-rhs it replaces (value, d a on the
  # strictly lower triangle, d rhs).
  rng = np.random.default_rng(4)
  a = jnp.asarray(np.tril(rng.standard_normal((2, 8, 8)) * 0.3, -1), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((2, 8, 5)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((2, 8, 5)), jnp.float32)
  strict = jnp.tril(jnp.ones((8, 8), bool), -1)

  def plain(a, rhs):
    a = jnp.where(strict, a, 0.0)
    return jnp.einsum(
      "bcd,bde->bce", delta_rule.unit_lower_inverse(a), rhs, precision=jax.lax.Precision.HIGHEST
    )

  def ours(a, rhs):
    return delta_rule.unit_lower_solve(jnp.where(strict, a, 0.0), rhs)

  (x1, pull1), (x2, pull2) = jax.vjp(plain, a, rhs), jax.vjp(ours, a, rhs)
  np.testing.assert_allclose(np.asarray(x2), np.asarray(x1), rtol=1e-5, atol=1e-5)
  for got, want in zip(pull2(ct), pull1(ct)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# KDA (a decay per key channel) and value-head grouping (Hv > Hk).


def _channel_decay(B, T, N, H, *, low=-1.0, high=0.0, seed=3):
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.uniform(low, high, (B, T, N, H)), jnp.float32)


def test_kda_forms_equal_the_reference_in_value_state_and_gradient():
  q, k, v, b, _, s0 = _inputs(T=45, Hv=6)
  g = _channel_decay(2, 45, 4, 8)
  _check_forms(q, k, v, b, g, s0, chunk_size=16, forms=("reference", "chunked"))
  _check_forms(q, k, v, b, g, s0, forms=("reference", "quadratic"), rtol=1e-4, atol=1e-4)


def test_kda_with_equal_channels_is_the_gated_delta_rule():
  q, k, v, b, g, s0 = _inputs(T=21)
  per_channel = jnp.broadcast_to(g[..., None], g.shape + (8,))
  for impl in ("reference", "chunked"):
    run = functools.partial(delta_rule_attention, initial_state=s0, implementation=impl)
    assert_close(run(q, k, v, b, log_decay=per_channel), run(q, k, v, b, log_decay=g), impl)


def test_kda_by_hand_one_step():
  # One token, zero initial state decayed per channel then written: o = scale (S^T q).
  H, Hv = 2, 1
  q = jnp.asarray([[[[1.0, 2.0]]]])
  k = jnp.asarray([[[[0.6, 0.8]]]])
  v = jnp.asarray([[[[3.0]]]])
  s0 = jnp.asarray([[[[1.0], [2.0]]]])  # [B, N, H, Hv]
  g = jnp.log(jnp.asarray([[[[0.5, 0.25]]]]))
  out, state = delta_rule_attention(
    q,
    k,
    v,
    jnp.asarray([[[0.5]]]),
    log_decay=g,
    initial_state=s0,
    scale=1.0,
    return_state=True,
    implementation="reference",
  )
  decayed = np.array([[0.5], [0.5]])  # diag(0.5, 0.25) @ [[1], [2]]
  delta = 0.5 * (3.0 - (0.6 * 0.5 + 0.8 * 0.5))
  want = decayed + np.array([[0.6], [0.8]]) * delta
  np.testing.assert_allclose(np.asarray(state[0, 0]), want, rtol=1e-6)
  np.testing.assert_allclose(float(out[0, 0, 0, 0]), float(want[0, 0] + 2 * want[1, 0]), rtol=1e-6)
  del H, Hv


@pytest.mark.parametrize("decay", [(-20.0, -20.0), (-30.0, -1e-4)], ids=["strong", "mixed"])
def test_kda_strong_decays_stay_finite_and_exact(decay):
  q, k, v, b, _, s0 = _inputs(T=40)
  g = _channel_decay(2, 40, 4, 8, low=decay[0], high=decay[1])
  _check_forms(q, k, v, b, g, s0, chunk_size=16)


def _grouped(B=2, T=41, K=2, G=2, H=8, Hv=6, seed=5, shared_q=True):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q = f(B, T, K if shared_q else K * G, H)
  k = f(B, T, K, H)
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  v = f(B, T, K * G, Hv)
  b = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, K * G)), jnp.float32)
  g = jnp.asarray(rng.uniform(-1.0, 0.0, (B, T, K * G)), jnp.float32)
  s0 = 0.5 * f(B, K * G, H, Hv)
  return q, k, v, b, g, s0


@pytest.mark.parametrize("channel", [False, True], ids=["gated", "kda"])
def test_value_grouped_heads_equal_repeated_queries_and_keys(channel):
  # Qwen3-Next: Hv = 2 Hk value heads, Dk != Dv; value head m reads q/k head m // 2.
  q, k, v, b, g, s0 = _grouped()
  if channel:
    g = _channel_decay(2, 41, 4, 8)
  rep = lambda x: jnp.repeat(x, 2, axis=2)
  for impl in ("reference", "chunked", "quadratic"):
    run = functools.partial(
      delta_rule_attention, initial_state=s0, return_state=True, implementation=impl, chunk_size=16
    )
    out, state = run(q, k, v, b, log_decay=g)
    want, want_state = run(rep(q), rep(k), v, b, log_decay=g)
    assert out.shape == (2, 41, 4, 6) and state.shape == (2, 4, 8, 6)
    assert_close(out, want, impl, rtol=1e-5, atol=1e-5)
    assert_close(state, want_state, impl, rtol=1e-5, atol=1e-5)
  _check_forms(q, k, v, b, g, s0, chunk_size=16)  # gradients of the grouped call


def test_value_grouped_heads_with_a_query_per_value_head():
  q, k, v, b, g, s0 = _grouped(shared_q=False)
  _check_forms(q, k, v, b, g, s0, chunk_size=16)


@pytest.mark.parametrize(
  "shapes, match",
  [
    (dict(M=3), "not a multiple of k's 2 heads"),
    (dict(N=3, M=4), "q must have the key heads"),
    (dict(g=(2, 9, 4, 5)), r"\[B, T, N, H\]"),
  ],
)
def test_grouped_and_channel_validation(shapes, match):
  K, N, M = 2, shapes.get("N", 2), shapes.get("M", 4)
  z = lambda *s: jnp.zeros(s, jnp.float32)
  heads = max(N, M) if M % K == 0 else N
  g = z(*shapes.get("g", (2, 9, heads)))
  with pytest.raises(ValueError, match=match):
    delta_rule_attention(z(2, 9, N, 8), z(2, 9, K, 8), z(2, 9, M, 8), z(2, 9, heads), log_decay=g)


# ---------------------------------------------------------------------------
# Precision of the chunk form's triangular solve.


def _bf16_rounded_inverse(a):
  """``(I + a)^{-1}`` by the same block doubling with every matmul operand rounded to
  bfloat16: what a 16-bit matmul (TPU's default precision for float32, or bf16 inputs kept
  in bf16) would compute."""
  r = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
  C = a.shape[-1]
  inv = np.ones(a.shape[:-2] + (C, 1, 1))
  m = np.eye(C) + a
  s = 1
  while s < C:
    n = C // (2 * s)
    blocks = np.stack(
      [m[..., i * 2 * s : (i + 1) * 2 * s, i * 2 * s : (i + 1) * 2 * s] for i in range(n)], -3
    )
    low = blocks[..., s:, :s]
    inv = inv.reshape(a.shape[:-2] + (n, 2, s, s))
    x11, x22 = inv[..., 0, :, :], inv[..., 1, :, :]
    x21 = -(r(r(x22) @ r(low)) @ r(x11))
    top = np.concatenate([x11, np.zeros_like(x11)], -1)
    inv = np.concatenate([top, np.concatenate([x21, x22], -1)], -2)
    s *= 2
  return inv.reshape(a.shape)


def test_chunk_solve_runs_at_highest_precision_and_avoids_the_bf16_error():
  # A chunk's strictly lower A_tj = beta_t exp(G_t - G_j) k_t.k_j from bf16 inputs (C = 64).
  rng = np.random.default_rng(0)
  C = 64
  k = rng.standard_normal((C, 16))
  k = np.asarray(
    jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), jnp.bfloat16), np.float64
  )
  beta = rng.uniform(0.5, 1.0, C)
  g = np.cumsum(rng.uniform(-0.05, 0.0, C))
  a = np.tril(beta[:, None] * np.exp(g[:, None] - g[None, :]) * (k @ k.T), -1)
  exact = np.linalg.inv(np.eye(C) + a)
  ours = np.asarray(delta_rule.unit_lower_inverse(jnp.asarray(a, jnp.float32)), np.float64)
  bf16 = _bf16_rounded_inverse(a)
  scale = np.abs(exact).max()
  err_ours, err_bf16 = np.abs(ours - exact).max() / scale, np.abs(bf16 - exact).max() / scale
  assert err_ours < 1e-5, err_ours
  assert err_bf16 > 100 * err_ours and err_bf16 > 1e-3, (err_bf16, err_ours)
  # Every contraction of the chunk form (bf16 inputs, global default bf16) asks for HIGHEST.
  q, k, v, b, g, s0 = _inputs(T=64, dtype=jnp.bfloat16)
  with jax.default_matmul_precision("bfloat16"):
    hlo = (
      jax.jit(lambda *x: delta_rule_attention(*x, implementation="chunked", chunk_size=32))
      .lower(q, k, v, b)
      .as_text()
    )
  dots = [line for line in hlo.splitlines() if "dot_general" in line]
  assert dots and all("HIGHEST" in line for line in dots), [l for l in dots if "HIGHEST" not in l][
    :3
  ]
