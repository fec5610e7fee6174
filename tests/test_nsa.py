"""nsa_attention: a per-token float64 loop written from the paper against both engines, the
dense limit, gradients at a fixed selection, the selection's lack of gradient, statistics,
O(T) memory and bad input."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import attnjax
from attnjax._src.kernels import selected_reference
from attnjax._src.kernels.blockwise import selected
from attnjax._src.ops.nsa import reference as nsa_reference
from attnjax._src.ops.nsa import rules
from attnjax.nsa import Compressor, nsa_attention
from helpers import assert_close, reduction_tolerance

B, T, N, K, H = 1, 32, 4, 2, 8
# l=8 at stride 4 (overlapping blocks), selection blocks of 8, 3 of the 4 selected (block 0
# and the own block forced, one chosen), window 5.
NORMALIZERS = ["softmax", "softmax_one", "sigmoid", "softpick", "none", "relu"]
CFG = dict(block_length=8, stride=4, selection_block=8, num_selected=3, window=5)


def _draw(seed, *shape, dtype=np.float32):
  return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _compressor(seed, l, X, M=6, dtype=np.float32):
  s = functools.partial(_draw, dtype=dtype)
  return Compressor(
    jnp.asarray(0.3 * s(seed, l, X)),
    jnp.asarray(s(seed + 1, l * X, M) / math.sqrt(l * X)),
    jnp.asarray(0.1 * s(seed + 2, M)),
    jnp.asarray(s(seed + 3, M, X) / math.sqrt(M)),
    jnp.asarray(0.1 * s(seed + 4, X)),
  )


@functools.cache
def _inputs(dtype=np.float32, separate=False):
  q = jnp.asarray(_draw(0, B, T, N, H, dtype=dtype))
  ks = [jnp.asarray(_draw(10 + b, B, T, K, H, dtype=dtype)) for b in range(3)]
  vs = [jnp.asarray(_draw(20 + b, B, T, K, H, dtype=dtype)) for b in range(3)]
  gates = jnp.asarray(np.random.default_rng(3).uniform(0.1, 0.9, (B, T, N, 3)).astype(dtype))
  comp = (_compressor(30, 8, H, dtype=dtype), _compressor(40, 8, H, dtype=dtype))
  if not separate:
    ks, vs = ks[0], vs[0]
  else:
    ks, vs = tuple(ks), tuple(vs)
  return q, ks, vs, gates, comp


# ---------------------------------------------------------------------------
# The paper, one query token at a time (float64): the selection in numpy, then the output in
# jax (differentiable, at that selection: the paper's selection carries no gradient).


def _phi(block, c):
  """The compressor MLP on one block [l, X] (exact GELU written out); numpy or jax."""
  xp = np if isinstance(block, np.ndarray) else jnp
  erf = np.vectorize(math.erf) if xp is np else jax.scipy.special.erf
  h = xp.reshape(block + c.position, (-1,)) @ c.w1 + c.b1
  h = 0.5 * h * (1.0 + erf(h / math.sqrt(2.0)))
  return h @ c.w2 + c.b2


def _attend(qv, keys, values, scale):
  """Softmax attention of one query [H] over keys [m, H] (zeros when m = 0): (out, probs)."""
  xp = np if isinstance(qv, np.ndarray) else jnp
  if keys.shape[0] == 0:
    return xp.zeros(values.shape[-1:], qv.dtype), xp.zeros((0,), qv.dtype)
  z = keys @ qv * scale
  p = xp.exp(z - xp.max(z))
  p = p / xp.sum(p)
  return p @ values, p


def _branches(x):
  return x if isinstance(x, tuple) else (x, x, x)


def _compressed(x, c, l, d, C):
  """Compressed keys or values [C, X] of one sequence and head: phi of each block."""
  xp = np if isinstance(x, np.ndarray) else jnp
  if C == 0:
    return xp.zeros((0, x.shape[-1]), x.dtype)
  return xp.stack([_phi(x[i * d : i * d + l], c) for i in range(C)])


def naive_selection(
  q, k, comp, *, block_length, stride, selection_block, num_selected, num_initial, num_local, **_
):
  """Eqs. (8)-(11): per (batch, token, kv head) the list of selected blocks."""
  q = np.asarray(q, np.float64)
  k0 = np.asarray(_branches(k)[0], np.float64)
  ck = Compressor(*(np.asarray(a, np.float64) for a in comp[0]))
  l, d, ls = block_length, stride, selection_block
  Bq, Tq, Nq, Hq = q.shape
  Kq = k0.shape[2]
  G = Nq // Kq
  nsel = -(-Tq // ls)
  chosen = {}
  for b in range(Bq):
    for kh in range(Kq):
      kc_all = _compressed(k0[b, :, kh], ck, l, d, (Tq - l) // d + 1 if Tq >= l else 0)
      for t in range(Tq):
        C_t = (t - l + 1) // d + 1 if t >= l - 1 else 0
        kc = kc_all[:C_t]
        probs = [_attend(q[b, t, kh * G + g], kc, kc, Hq**-0.5)[1] for g in range(G)]
        score = np.zeros(nsel)
        for j in range(nsel):
          for i in range(C_t):
            shared = max(0, min(i * d + l, (j + 1) * ls) - max(i * d, j * ls))
            score[j] += sum(p[i] for p in probs) * shared / d
        own = t // ls
        forced = [j for j in range(nsel) if j <= own and (j < num_initial or j > own - num_local)]
        others = [j for j in range(own + 1) if j not in forced]
        others.sort(key=lambda j: (-score[j], j))  # ties: the lower block first
        chosen[b, t, kh] = sorted(forced + others[: num_selected - len(forced)])
  return chosen


def naive_output(
  q, k, v, gates, comp, chosen, *, block_length, stride, selection_block, window, **_
):
  """Eqs. (5)-(7) at a given selection, token by token (jax, differentiable).

  Each branch of token ``t`` is softmax attention of its query heads over the keys the paper's
  rule lists for it (written as a mask over the ``S`` keys, so every token's arrays have one
  shape), mixed by the token's gates.
  """
  ks, vs = _branches(k), _branches(v)
  l, d, ls, w = block_length, stride, selection_block, window
  Bq, Tq, Nq, Hq = q.shape
  Kq = ks[0].shape[2]
  G = Nq // Kq
  scale = Hq**-0.5
  C = (Tq - l) // d + 1 if Tq >= l else 0
  by_head = lambda x: jnp.repeat(x, G, axis=1)  # [S, K, X] -> [S, N, X]

  def attend(qt, keys, values, allowed):  # [N, H], [S, N, H], [S, N, X], bool [N, S]
    z = jnp.einsum("nh,snh->ns", qt, keys) * scale
    z = jnp.where(allowed, z, -jnp.inf)
    m = jnp.max(jnp.where(allowed, z, 0.0), axis=-1, keepdims=True)
    p = jnp.where(allowed, jnp.exp(z - m), 0.0)
    total = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(total > 0, total, 1.0)
    return jnp.einsum("ns,snx->nx", p, values)

  rows = []
  for b in range(Bq):
    kc = jnp.stack([_compressed(ks[0][b, :, kh], comp[0], l, d, C) for kh in range(Kq)], 1)
    vc = jnp.stack([_compressed(vs[0][b, :, kh], comp[1], l, d, C) for kh in range(Kq)], 1)
    # Each token's keys, by the paper's rules, as masks [T, N, C] and [T, N, S].
    ended = np.asarray([[[i * d + l - 1 <= t for i in range(C)]] * Nq for t in range(Tq)])
    sel = np.asarray(
      [
        [[s <= t and s // ls in chosen[b, t, n // G] for s in range(Tq)] for n in range(Nq)]
        for t in range(Tq)
      ]
    )
    near = np.asarray([[[t - w <= s <= t for s in range(Tq)]] * Nq for t in range(Tq)])

    def token(xs, b=b, kc=kc, vc=vc):
      qt, g, m_c, m_s, m_w = xs
      o_c = attend(qt, by_head(kc), by_head(vc), m_c)
      o_s = attend(qt, by_head(ks[1][b]), by_head(vs[1][b]), m_s)
      o_w = attend(qt, by_head(ks[2][b]), by_head(vs[2][b]), m_w)
      return g[:, 0:1] * o_c + g[:, 1:2] * o_s + g[:, 2:3] * o_w

    rows.append(jax.lax.map(token, (q[b], gates[b], ended, sel, near)))  # one token a step
  return jnp.stack(rows)


# ---------------------------------------------------------------------------
# The acceptance tests.

FULL = dict(CFG, num_initial=1, num_local=1)


def _fresh(dtype, separate=False):
  """The inputs as new arrays of ``dtype`` (float64 ones inside ``jax.enable_x64``)."""
  q, k, v, gates, comp = _inputs(np.float32, separate)
  cast = lambda x: jnp.asarray(np.asarray(x), dtype)
  return jax.tree.map(cast, (q, k, v, gates, comp))


@pytest.mark.parametrize(
  "separate",
  [False, pytest.param(True, marks=pytest.mark.slow)],  # per-branch K/V: the same code paths
  ids=["shared_kv", "kv_per_branch"],
)
def test_paper_loop_equals_reference_and_blockwise(separate):
  with jax.enable_x64(True):
    q, k, v, gates, comp = _fresh(jnp.float64, separate)
    chosen = naive_selection(q, k, comp, **FULL)
    idx = nsa_reference.selection(
      q,
      jnp.arange(T),
      rules.compress(_branches(k)[0], comp[0], block_length=8, stride=4),
      rules.NSAOptions(8, 4, 8, 3, 1, 1, 5, H**-0.5, ("softmax",) * 3),
      T,
    )
    got_sel = {
      (0, t, kh): sorted(int(j) for j in np.asarray(idx[0, t, kh]) if j >= 0)
      for t in range(T)
      for kh in range(K)
    }
    assert got_sel == chosen
    # Some queries chose a block other than the forced ones, so the choice is exercised.
    assert any(len(c) == 3 for c in chosen.values())

    def loss_of(fn):
      def loss(q, k, v, gates, comp):
        out = fn(q, k, v, gates, comp)
        ct = jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape)
        return jnp.sum(out * ct), out

      return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))

    args = (q, k, v, gates, comp)
    (_, want), want_grads = loss_of(lambda *a: naive_output(*a, chosen, **FULL))(*args)
    for impl in ("reference", "blockwise"):
      fn = lambda q, k, v, g, c, impl=impl: nsa_attention(
        q, k, v, g, compressor=c, implementation=impl, **FULL
      )
      (_, got), grads = loss_of(fn)(*args)
      assert got.dtype == jnp.float64
      # The reference computes in float64; the block-wise kernel's logits are float32 for
      # every input dtype (the dense engines' convention).
      tol = 1e-9 if impl == "reference" else reduction_tolerance(jnp.float32, T * H, depth=8)
      assert_close((got, grads), (want, want_grads), impl, rtol=tol, atol=tol, scaled=True)


def _dense_limit_call(impl, gates):
  q, k, v, _, comp = _inputs()
  return nsa_attention(
    q,
    k,
    v,
    gates,
    compressor=comp,
    block_length=8,
    stride=4,
    selection_block=8,
    num_selected=4,
    window=T,
    implementation=impl,
  )


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_every_block_and_a_full_window_are_dense_causal_attention(impl):
  q, k, v, _, _ = _inputs()
  dense = attnjax.dot_product_attention(q, k, v, is_causal=True, implementation="reference")
  tol = reduction_tolerance(jnp.float32, T, depth=2)
  for gates in ((0.0, 1.0, 0.0), (0.0, 0.0, 1.0)):
    g = jnp.broadcast_to(jnp.asarray(gates, jnp.float32), (B, T, N, 3))
    assert_close(_dense_limit_call(impl, g), dense, f"{impl} gates={gates}", rtol=tol, atol=tol)


def _outputs_and_grads(fn, *args):
  """The result of an NSA call with statistics and the gradients of a loss on its output plus
  ``sin`` of each branch's logsumexp (the statistic that carries a gradient)."""

  def loss(*a):
    out, stats = fn(*a)
    ct = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    lse = [b.logsumexp for b in (stats.compressed, stats.selected, stats.window)]
    return jnp.sum(out * ct) + sum(jnp.sum(jnp.sin(x)) for x in lse), (out, stats)

  (_, res), grads = jax.jit(
    jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True)
  )(*args)
  return res, grads


@pytest.mark.parametrize(
  "normalizer",
  [pytest.param(n, marks=() if n == "softmax" else pytest.mark.slow) for n in NORMALIZERS],
)
def test_blockwise_equals_reference_for_every_normalizer(normalizer):
  q, k, v, gates, comp = _inputs(separate=True)
  norms = (normalizer, "softmax", normalizer) if normalizer != "softmax" else normalizer

  def fn(impl, q, k, v, gates):
    return nsa_attention(
      q,
      k,
      v,
      gates,
      compressor=comp,
      normalizer=norms,
      implementation=impl,
      return_stats=True,
      **CFG,
    )

  want = _outputs_and_grads(functools.partial(fn, "reference"), q, k, v, gates)
  got = _outputs_and_grads(functools.partial(fn, "blockwise"), q, k, v, gates)
  tol = reduction_tolerance(jnp.float32, T * H, depth=8)
  assert_close(got, want, normalizer, rtol=tol, atol=tol, scaled=True)
  out, stats = got[0]
  assert stats.gate_mean.shape == (B, N, 3)
  np.testing.assert_allclose(
    stats.gate_mean, np.mean(np.asarray(gates), axis=1).transpose(0, 1, 2), rtol=1e-6
  )


def test_a_normaliser_with_row_passes_in_every_branch():
  """Clipped softmax (its log-normaliser before the first key, its backward row term over
  every key) in all three branches: the selected branch runs it row-major, where a tile holds
  each row's every selected key."""
  q, k, v, gates, comp = _inputs()

  def fn(impl, q, k, v, gates):
    kw = dict(compressor=comp, normalizer="clipped_softmax", implementation=impl, **CFG)
    return nsa_attention(q, k, v, gates, return_stats=True, **kw)

  want = _outputs_and_grads(functools.partial(fn, "reference"), q, k, v, gates)
  got = _outputs_and_grads(functools.partial(fn, "blockwise"), q, k, v, gates)
  tol = reduction_tolerance(jnp.float32, T * H, depth=8)
  assert_close(got, want, "clipped_softmax", rtol=tol, atol=tol, scaled=True)
  plain = dict(compressor=comp, normalizer="clipped_softmax", **CFG)  # no statistics
  got = nsa_attention(q, k, v, gates, implementation="blockwise", **plain)
  assert_close(got, want[0][0], "clipped_softmax, no statistics", rtol=tol, atol=tol, scaled=True)


def test_gradients_at_a_fixed_selection():
  # Every block selected: the selection cannot move under the finite differences. The
  # reference computes in float64 (the block-wise engine's dense kernel in float32: its
  # gradients are held equal to the reference's above); the gathered kernel's hand-written
  # backward computes in float64 and is checked on its own.
  with jax.enable_x64(True):
    q, k, v, gates, comp = _fresh(jnp.float64, separate=True)
    q, gates = q[:, :16], gates[:, :16]
    k, v = tuple(x[:, :16] for x in k), tuple(x[:, :16] for x in v)

    def f(q, k0, k1, k2, v0, v1, v2, gates, comp):
      return nsa_attention(
        q,
        (k0, k1, k2),
        (v0, v1, v2),
        gates,
        compressor=comp,
        block_length=8,
        stride=4,
        selection_block=8,
        num_selected=2,
        num_local=1,
        window=3,
        implementation="reference",
      )

    check_grads(
      f, (q, *k, *v, gates, comp), order=1, modes=("rev",), eps=1e-4, atol=1e-6, rtol=1e-6
    )
    idx = jnp.asarray(np.random.default_rng(0).integers(-1, 4, (1, 16, K, 2)), jnp.int32)
    kernel = jax.jit(
      lambda q, k, v: selected.selected_attention(q, k, v, idx, block_size=4, scale=0.3)
    )
    check_grads(
      kernel, (q, k[1], v[1]), order=2, modes=("rev", "fwd"), eps=1e-4, atol=1e-6, rtol=1e-6
    )


def test_the_selection_carries_no_gradient():
  # Only the selected branch (gates (0, 1, 0)) with a real choice: the compressor and the
  # compressed branch's keys reach the output through the selection alone.
  q, k, v, _, comp = _inputs(separate=True)
  gates = jnp.broadcast_to(jnp.asarray([0.0, 1.0, 0.0]), (B, T, N, 3))
  for impl in ("reference", "blockwise"):
    loss = lambda k0, comp: jnp.sum(
      nsa_attention(q, (k0, k[1], k[2]), v, gates, compressor=comp, implementation=impl, **CFG)
    )
    dk0, dcomp = jax.grad(loss, argnums=(0, 1))(k[0], comp)
    assert not np.any(np.asarray(dk0)), impl
    assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(dcomp)), impl


def test_selection_scores():
  p = jnp.asarray(np.random.default_rng(0).uniform(size=(3, 7)), jnp.float32)
  # l = l' = d: the compressed weights themselves.
  same = attnjax.nsa.selection_scores(p, block_length=4, stride=4, selection_block=4, num_keys=28)
  np.testing.assert_allclose(same, p)
  # l = 8, d = 4, l' = 8: block j shares one run of 4 keys with blocks 2j - 1 and 2j + 1 and two
  # with block 2j.
  got = attnjax.nsa.selection_scores(p, block_length=8, stride=4, selection_block=8, num_keys=32)
  pp = np.pad(np.asarray(p), [(0, 0), (1, 2)])
  want = np.stack([pp[:, 2 * j] + 2 * pp[:, 2 * j + 1] + pp[:, 2 * j + 2] for j in range(4)], -1)
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_mean_pooling_compression():
  x = jnp.arange(2 * 12 * 1 * 2, dtype=jnp.float32).reshape(2, 12, 1, 2)
  got = attnjax.nsa.compress(x, None, block_length=4, stride=2)
  assert got.shape == (2, 5, 1, 2)
  want = np.stack([np.asarray(x)[:, c * 2 : c * 2 + 4].mean(1) for c in range(5)], 1)
  np.testing.assert_allclose(got, want)


def _sizes(jaxpr, out):
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      out.append((int(np.prod(var.aval.shape)), eqn.primitive.name, var.aval.shape))
    for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
      _sizes(sub, out)
    for param in eqn.params.values():
      inner = getattr(param, "jaxpr", None)
      if inner is not None:
        _sizes(getattr(inner, "jaxpr", inner), out)
  return out


def test_blockwise_never_forms_a_T_by_S_array():
  Tl = 1024
  q = jnp.zeros((1, Tl, 1, 4))
  k = jnp.zeros((1, Tl, 1, 4))
  gates = jnp.zeros((1, Tl, 1, 3))

  def loss(q, k, v, gates):
    return jnp.sum(
      nsa_attention(
        q,
        k,
        v,
        gates,
        block_length=16,
        stride=8,
        selection_block=16,
        num_selected=4,
        window=32,
        implementation="blockwise",
      )
    )

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, k, gates)
  largest = max(_sizes(jaxpr.jaxpr, []))
  assert largest[0] < Tl * Tl // 4, largest


def test_bad_input():
  q, k, v, gates, _ = _inputs()
  call = lambda **kw: nsa_attention(q, k, v, gates, **{**CFG, **kw})
  cases = [
    (dict(block_length=8, stride=3), "stride=3"),
    (dict(block_length=4, stride=8), "stride=8 > block_length=4"),
    (dict(selection_block=6), "selection_block=6"),
    (dict(num_selected=5), "num_selected=5"),
    (dict(window=0), "window=0"),
    (dict(num_selected=2, num_initial=2, num_local=1), "num_initial=2"),
    (dict(normalizer="softmaxx"), "softmaxx"),
  ]
  for kw, needle in cases:
    with pytest.raises((ValueError, TypeError), match=needle.replace("(", r"\(")):
      call(**kw)
  with pytest.raises(ValueError, match=r"gates must have shape \[B, T, N, 3\]"):
    nsa_attention(q, k, v, gates[..., :2], **CFG)
  with pytest.raises(ValueError, match="compressor"):
    comp = (_compressor(0, 4, H), _compressor(1, 8, H))
    nsa_attention(q, k, v, gates, compressor=comp, **CFG)
  with pytest.raises(ValueError, match="same length"):
    nsa_attention(q[:, :16], k, v, gates[:, :16], **CFG)


# ---------------------------------------------------------------------------
# The selected branch's kernel interface (kernels/selected_reference.py).


@pytest.mark.parametrize(
  "normalizer",
  [pytest.param(n, marks=() if n == "softmax" else pytest.mark.slow) for n in NORMALIZERS],
)
def test_gathered_kernel_equals_the_interface_reference(normalizer):
  # T=13 keys in blocks of 3 (a partial last block); slots hold -1, duplicates and blocks
  # past the end, all of which select nothing more.
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((2, 13, 4, 8)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, 13, 2, 8)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((2, 13, 2, 6)), jnp.float32)
  idx = jnp.asarray(rng.integers(-1, 6, (2, 13, 2, 3)), jnp.int32)

  def loss_of(fn):
    def loss(q, k, v):
      out, lse = fn(q, k, v, idx, block_size=3, scale=0.3, normalizer=normalizer, return_lse=True)
      ct = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
      return jnp.sum(out * ct) + jnp.sum(jnp.sin(lse)), (out, lse)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

  (_, want), want_g = loss_of(selected_reference.selected_attention)(q, k, v)
  (_, got), got_g = loss_of(selected.selected_attention)(q, k, v)
  tol = reduction_tolerance(jnp.float32, 13 * 8, depth=6)
  assert_close((got, got_g), (want, want_g), normalizer, rtol=tol, atol=tol, scaled=True)
  t = jax.random.normal(jax.random.key(1), q.shape)
  fwd = lambda impl: jax.jvp(
    lambda q: impl.selected_attention(q, k, v, idx, block_size=3, scale=0.3, normalizer=normalizer),
    (q,),
    (t,),
  )
  assert_close(fwd(selected), fwd(selected_reference), "jvp", rtol=tol, atol=tol, scaled=True)


def test_interface_reference_rows():
  # Query t attends the keys s <= t of its selected blocks only; no key: zero and lse 0.
  q = jnp.ones((1, 6, 2, 4))
  k = jnp.ones((1, 6, 1, 4))
  v = jnp.arange(6, dtype=jnp.float32)[None, :, None, None] * jnp.ones((1, 6, 1, 2))
  idx = jnp.asarray([[[[2]], [[2]], [[2]], [[1]], [[0]], [[-1]]]], jnp.int32)  # blocks of 2
  out, lse = selected_reference.selected_attention(
    q, k, v, idx, block_size=2, scale=1.0, return_lse=True
  )
  # rows 0-2 chose block 2 (keys 4, 5): nothing at or before them; row 3 block 1 (keys 2, 3);
  # row 4 block 0 (keys 0, 1); row 5 nothing. Every logit is <1, 1> * 4 = 4.
  np.testing.assert_allclose(out[0, :, 0, 0], [0, 0, 0, 2.5, 0.5, 0])
  np.testing.assert_allclose(lse[0, :, 0], [0, 0, 0, 4 + np.log(2), 4 + np.log(2), 0], rtol=1e-6)


def test_block_major_forward_equals_the_interface_reference(monkeypatch):
  # Softmax, blocks of 8, no statistics: the forward runs one key block at a time. T=21 rows
  # in steps of 8 (a ragged last step) over keys in blocks of 8 (a partial last block); row 2
  # names only blocks after it and block 5 (past the end): no key, zero output, lse 0.
  calls = []
  by_block = selected._forward_by_block
  monkeypatch.setattr(selected, "_forward_by_block", lambda *a: calls.append(1) or by_block(*a))
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((2, 21, 4, 8)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((2, 21, 2, 8)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((2, 21, 2, 6)), jnp.float32)
  idx = rng.integers(-1, 4, (2, 21, 2, 3))
  idx[0, 2, 0] = (1, 5, 2)
  idx = jnp.asarray(idx, jnp.int32)
  kw = dict(block_size=8, scale=0.3)

  def loss_of(fn):
    def loss(q, k, v):
      out, lse = fn(q, k, v)
      ct = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
      return jnp.sum(out * ct) + jnp.sum(jnp.sin(lse)), (out, lse)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

  got_fn = lambda q, k, v: selected.run(q, k, v, idx, **kw, block_q=8)[:2]
  want_fn = lambda q, k, v: selected_reference.selected_attention(
    q, k, v, idx, **kw, return_lse=True
  )
  (_, want), want_g = loss_of(want_fn)(q, k, v)
  (_, got), got_g = loss_of(got_fn)(q, k, v)
  assert calls
  np.testing.assert_array_equal(got[0][0, 2, :2], 0.0)
  np.testing.assert_array_equal(got[1][0, 2, :2], 0.0)
  tol = reduction_tolerance(jnp.float32, 21 * 8, depth=6)
  assert_close((got, got_g), (want, want_g), "block-major", rtol=tol, atol=tol, scaled=True)
  t = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  fwd = lambda fn: jax.jit(lambda q, t: jax.jvp(lambda q: fn(q, k, v), (q,), (t,)))(q, t)
  assert_close(fwd(got_fn), fwd(want_fn), "jvp", rtol=tol, atol=tol, scaled=True)


def test_kernel_engines_read_the_selected_verdicts(monkeypatch):
  """NSA's Pallas engines are the selected-block kernels' (attnjax._src.kernels.selected):
  auto-dispatch asks the kernel-trust rule about selected_pallas_tpu / selected_mosaic_gpu
  for the selected branch's case class, not about the dense kernels of the same engine name."""
  from attnjax._src import op, trust
  from attnjax._src.kernels import selected as kernels
  from attnjax._src.ops.nsa import attention as nsa_op

  q, k, v, gates, comp = _inputs()
  kw = dict(FULL, scale=None, normalizer="softmax", return_stats=False)
  call = nsa_op.validate(q, k, v, gates, compressor=comp, **kw)
  for name, platform in (("pallas_tpu", "tpu"), ("mosaic_gpu", "cuda")):
    engine = nsa_op.ENGINES[name]
    assert engine.vouched_by == "device-check" and engine.platform == platform
    assert engine.verdict_name == kernels.TRUST_NAMES[platform] == f"selected_{name}"
    assert nsa_op.PREFERENCES[platform] == (name,) and name not in nsa_op.FALLBACK
  klass = "softmax selected_kv float32"  # two query heads per group: key-block-major
  assert nsa_op.OP.trust_class(*call) == klass
  asked = []

  def allows(kernel, platform, klass=None):
    asked.append((kernel, platform, klass() if callable(klass) else klass))
    return trust.Decision(False)

  monkeypatch.setattr(trust, "allows", allows)
  assert set(op.choose(nsa_op.OP, call, ("tpu", "cuda", "cpu")).values()) == {"blockwise"}
  assert asked == [("selected_pallas_tpu", "tpu", klass), ("selected_mosaic_gpu", "cuda", klass)]
  stats_call = nsa_op.validate(q, k, v, gates, compressor=comp, **dict(kw, return_stats=True))
  assert "return_stats" in nsa_op.ENGINES["pallas_tpu"].unsupported(*stats_call)[0]


def test_pallas_tpu_engine_in_interpret_mode_equals_blockwise():
  """The pallas_tpu engine (the selected branch on the interpreted TPU kernel) equals the
  block-wise engine in value and in the gradients of q, k, v, the gates and the compressor."""
  from attnjax._src import op
  from attnjax._src.ops.nsa import attention as nsa_op
  from helpers import outputs_and_grads

  kw = dict(FULL, scale=None, normalizer="softmax", return_stats=False)

  def run(name, interpret):
    def fn(q, k, v, gates, comp):
      call = nsa_op.validate(q, k, v, gates, compressor=comp, **kw)
      return op.run_engine(nsa_op.ENGINES[name], call, interpret=interpret)

    return fn

  args = _inputs()
  want = outputs_and_grads(run("blockwise", False), *args)
  got = outputs_and_grads(run("pallas_tpu", True), *args)
  tol = reduction_tolerance(jnp.float32, T * H, depth=8)
  assert_close(got, want, "pallas_tpu (interpret)", rtol=tol, atol=tol, scaled=True)


@pytest.mark.targets("tpu")
@pytest.mark.usefixtures("target_compiles", "all_kernels")
def test_auto_dispatch_compiles_the_selected_kernel_for_a_tpu():
  """Compiled for a TPU v5e from this host with ``kernels="all"``: auto-dispatch takes NSA's
  ``pallas_tpu`` engine (its selected_pallas_tpu kernel: verdicts opted out), forward and
  backward, inside the block-wise compressed and window branches."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  from attnjax._src import targets

  mesh = targets.mesh(targets.tpu_devices("v5e", "2x2")[:1])
  rep = NamedSharding(mesh, P())
  T, N_, K_, H_ = 512, 4, 2, 128
  q = jax.ShapeDtypeStruct((1, T, N_, H_), jnp.bfloat16, sharding=rep)
  kv = jax.ShapeDtypeStruct((1, T, K_, H_), jnp.bfloat16, sharding=rep)
  g = jax.ShapeDtypeStruct((1, T, N_, 3), jnp.bfloat16, sharding=rep)
  cfg = dict(block_length=32, stride=16, selection_block=64, num_selected=4, window=128)

  def loss(q, k, v, g):
    out = nsa_attention(q, k, v, g, **cfg)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  with jax.set_mesh(mesh):
    text = jax.jit(jax.grad(loss, (0, 1, 2, 3))).lower(q, kv, kv, g).compile().as_text()
  assert "attnjax_selected_tpu_fwd_parts" in text and "attnjax_selected_tpu_dkdv" in text
