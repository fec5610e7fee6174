"""The normaliser seam: every registered normaliser agrees with itself across paths.

Parametrised over ``normalizers.REGISTRY``, so a new normaliser is tested here
as soon as it is registered: its online accumulation over any split of the key
axis equals its materialised weights (output, statistics rows, gradient through
the per-tile backward rule, learned null logits), and mergeable normalisers
merge partial results exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnjax._src import validators, normalizers

NAMES = tuple(normalizers.REGISTRY)
R, S, HV = 6, 23, 3  # rows, keys, value dim; rows live in [1, 2, R, 1] as in the kernel


def _problem(seed, *, empty_row=True):
  rng = np.random.default_rng(seed)
  z = jnp.asarray(2.0 * rng.standard_normal((1, 2, R, S)), jnp.float32)
  allowed = rng.random((1, 2, R, S)) < 0.7
  allowed[..., 0, 0] = True
  if empty_row:
    allowed[0, 1, 2] = False  # a row with no allowed key
  v = jnp.asarray(rng.standard_normal((1, 2, S, HV)), jnp.float32)
  d_out = jnp.asarray(rng.standard_normal((1, 2, R, HV)), jnp.float32)
  g = jnp.asarray(rng.standard_normal((1, 2, R, 1)), jnp.float32)
  sink = jnp.asarray(rng.standard_normal((1, 2, 1, 1)), jnp.float32)
  return z, jnp.asarray(allowed), v, d_out, g, sink


def _splits(seed):
  """Random cut points of the key axis (including single-key tiles)."""
  rng = np.random.default_rng(seed + 100)
  cuts = sorted(set(rng.choice(np.arange(1, S), size=4, replace=False).tolist()) | {S - 1})
  return list(zip([0] + cuts, cuts + [S]))


def _online(nz, z, allowed, v, sink, splits, *, stats=True, full_tiles=()):
  counts = jnp.sum(allowed, axis=-1, keepdims=True, dtype=jnp.float32)
  # A needs_lse normaliser reads each row's log-normaliser, which an engine's pre-pass gives.
  terms = normalizers.row_softmax_terms(z, allowed) if nz.needs_lse else None
  row = nz.row_inputs(sink, counts if (nz.needs_counts or stats) else None, terms)
  st = nz.init((1, 2, R, 1), (1, 2, R, HV), stats)
  for k0, k1 in splits:
    vb = v[:, :, k0:k1]
    tile_allowed = None if (k0, k1) in full_tiles else allowed[..., k0:k1]

    def pv(w, vb=vb):
      return jnp.einsum("bkrs,bksh->bkrh", w, vb)

    st = nz.visit(st, z[..., k0:k1], tile_allowed, pv, row, stats, k0 == 0)
  return nz.finish(st, row, stats)


def _materialised(nz, z, allowed, v, sink):
  w, log_norm = nz.weights(z, allowed, sink)
  return w, log_norm, jnp.einsum("bkrs,bksh->bkrh", w, v)


def _sinks(name):
  return (None, "sink") if normalizers.REGISTRY[name].accepts_sink_logits else (None,)


CASES = [(n, s) for n in NAMES for s in _sinks(n)]
IDS = [n + ("_sink" if s else "") for n, s in CASES]


@pytest.mark.parametrize("name,sink", CASES, ids=IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_online_equals_materialised(name, sink, seed):
  nz = normalizers.REGISTRY[name]
  z, allowed, v, _, _, sink_rows = _problem(seed)
  sink_rows = sink_rows if sink else None
  w, log_norm, want = _materialised(nz, z, allowed, v, sink_rows)
  out, _, rows = _online(nz, z, allowed, v, sink_rows, _splits(seed))
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-6)
  assert np.all(np.asarray(out)[0, 1, 2] == 0.0)  # the empty row
  # Statistics rows, from the materialised weights.
  has_key = np.asarray(jnp.any(allowed, axis=-1, keepdims=True))
  mag = np.abs(np.asarray(w))
  total = mag.sum(-1, keepdims=True)
  p = mag / np.where(total > 0, total, 1.0)
  entropy = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), -1, keepdims=True)
  ok = has_key & (total > 0)
  np.testing.assert_array_equal(rows["has_key"], has_key)
  np.testing.assert_array_equal(rows["normalisable"], ok)
  np.testing.assert_allclose(
    np.where(ok, rows["entropy"], 0), np.where(ok, entropy, 0), rtol=1e-4, atol=1e-5
  )
  np.testing.assert_allclose(
    np.where(ok, rows["p0"], 0), np.where(ok, p[..., :1], 0), rtol=1e-4, atol=1e-6
  )
  np.testing.assert_allclose(
    np.where(has_key, rows["row_sum"], 0),
    np.where(has_key, np.asarray(w).sum(-1, keepdims=True), 0),
    rtol=1e-4,
    atol=1e-5,
  )
  np.testing.assert_allclose(rows["lse"], np.where(has_key, log_norm, 0.0), rtol=1e-5, atol=1e-5)
  zmax = np.max(np.where(np.asarray(allowed), np.asarray(z), -np.inf), -1, keepdims=True)
  np.testing.assert_array_equal(np.where(has_key, rows["row_max"], 0), np.where(has_key, zmax, 0))
  for key, x in rows.items():  # row_max is -inf on an empty row; the kernel's max skips it
    assert key == "row_max" or np.all(np.isfinite(np.asarray(x, np.float32))), key


@pytest.mark.parametrize("name", NAMES)
def test_online_without_stats_and_with_full_tiles(name):
  """Tiles visited with ``allowed=None`` (a full block) count as all allowed."""
  nz = normalizers.REGISTRY[name]
  z, allowed, v, _, _, _ = _problem(3, empty_row=False)
  allowed = allowed.at[..., 5:12].set(True)
  _, _, want = _materialised(nz, z, allowed, v, None)
  out, _, rows = _online(
    nz, z, allowed, v, None, [(0, 5), (5, 12), (12, S)], stats=False, full_tiles=((5, 12),)
  )
  assert rows is None
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name,sink", CASES, ids=IDS)
def test_tile_backward_equals_autodiff(name, sink):
  """Per-tile ``dz`` (output and logsumexp cotangents) and the null-logit cotangent."""
  nz = normalizers.REGISTRY[name]
  z, allowed, v, d_out, g, sink_rows = _problem(4)
  sink_rows = sink_rows if sink else None
  has_key = jnp.any(allowed, axis=-1, keepdims=True)

  def loss(z, sink_rows):
    w, log_norm, out = _materialised(nz, z, allowed, v, sink_rows)
    lse = jnp.where(has_key, log_norm, 0.0)
    return jnp.sum(out * d_out) + jnp.sum(lse * g), w

  (dz_want, dsink_want), w_want = jax.grad(loss, argnums=(0, 1), has_aux=True)(z, sink_rows)
  out, res, _ = _online(nz, z, allowed, v, sink_rows, _splits(4))
  row_dot = jnp.sum(d_out * out, axis=-1, keepdims=True)
  if not nz.row_dot_of_output:  # the backward pre-pass: the row term summed over the tiles
    row_dot = sum(
      nz.row_dot_tile(
        z[..., k0:k1],
        allowed[..., k0:k1],
        jnp.einsum("bkrh,bksh->bkrs", d_out, v[:, :, k0:k1]),
        res,
      )
      for k0, k1 in _splits(4)
    )
  d_lse = jnp.where(has_key, g, 0.0)
  for k0, k1 in _splits(4):
    dp = jnp.einsum("bkrh,bksh->bkrs", d_out, v[:, :, k0:k1])
    w, dz = nz.tile_backward(z[..., k0:k1], allowed[..., k0:k1], dp, res, row_dot, d_lse)
    np.testing.assert_allclose(w, w_want[..., k0:k1], rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(dz, dz_want[..., k0:k1], rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(dz)[0, 1, 2] == 0.0)
  if sink:
    dsink = jnp.sum(nz.null_grad(sink_rows, res, row_dot, d_lse), axis=2, keepdims=True)
    np.testing.assert_allclose(dsink, dsink_want, rtol=1e-4, atol=1e-5)


MERGEABLE = [(n, s) for n, s in CASES if normalizers.REGISTRY[n].mergeable]


@pytest.mark.parametrize(
  "name,sink", MERGEABLE, ids=[n + ("_sink" if s else "") for n, s in MERGEABLE]
)
def test_merge_of_parts_equals_whole(name, sink):
  nz = normalizers.REGISTRY[name]
  part_nz = normalizers.REGISTRY[nz.merge_part]
  z, allowed, v, _, _, sink_rows = _problem(5)
  sink_rows = sink_rows if sink else None
  allowed = allowed.at[0, 0, 3, 12:].set(False)  # a row with keys in one part only
  _, _, want = _materialised(nz, z, allowed, v, sink_rows)

  def loss(z, cut):
    parts = []
    for sl in (slice(0, cut), slice(cut, S)):
      part_allowed = allowed[..., sl]
      _, log_norm, out = _materialised(part_nz, z[..., sl], part_allowed, v[:, :, sl], None)
      lse = jnp.where(jnp.any(part_allowed, axis=-1, keepdims=True), log_norm, -jnp.inf)
      parts.append((out, lse))
    merged = nz.merge(parts, sink_rows)
    return jnp.sum(jnp.sin(merged)), merged

  def loss_whole(z):
    return jnp.sum(jnp.sin(_materialised(nz, z, allowed, v, sink_rows)[2]))

  for cut in (1, 12, S - 1):
    grad, merged = jax.grad(loss, has_aux=True)(z, cut)
    np.testing.assert_allclose(merged, want, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(grad, jax.grad(loss_whole)(z), rtol=1e-4, atol=1e-5)
    assert np.all(np.asarray(merged)[0, 1, 2] == 0.0)


@pytest.mark.parametrize("name", [n for n in NAMES if not normalizers.REGISTRY[n].mergeable])
def test_unmergeable_normalizers_say_so(name):
  with pytest.raises(ValueError, match="cannot merge"):
    normalizers.REGISTRY[name].merge([])


def _numpy_weights(name, z, allowed, sink=None):
  """Each normaliser's weights and log-normaliser written out in float64 numpy (rows with an
  allowed key; the log-normaliser includes the null column of softmax_one and sink logits)."""
  z, a = np.asarray(z, np.float64), np.asarray(allowed)
  n = np.maximum(a.sum(-1, keepdims=True), 1)
  m = np.max(np.where(a, z, -np.inf), -1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  e = np.where(a, np.exp(z - m), 0.0)
  lse = m + np.log(np.maximum(e.sum(-1, keepdims=True), 1e-300))
  if name in ("softmax", "softmax_one"):
    null = 0.0 if name == "softmax_one" else (None if sink is None else np.asarray(sink))
    shift = m if null is None else np.maximum(m, null)
    e = np.where(a, np.exp(z - shift), 0.0)
    denom = e.sum(-1, keepdims=True) + (0.0 if null is None else np.exp(null - shift))
    denom = np.where(denom > 0, denom, 1.0)  # a row with no key and no null column
    return e / denom, shift + np.log(denom)
  if name == "sigmoid":
    return np.where(a, 1.0 / (1.0 + n * np.exp(np.minimum(-z, 700.0))), 0.0), lse
  if name == "softpick":  # relu(e^z - 1) / (sum |e^z - 1| + eps), scaled through by e^-s
    s = np.maximum(m, 0.0)
    c = np.where(a, np.exp(z - s) - np.exp(-s), 0.0)
    return np.maximum(c, 0.0) / (np.abs(c).sum(-1, keepdims=True) + 1e-6 * np.exp(-s)), lse
  if name == "none":
    return np.where(a, z, 0.0), lse
  if name == "relu":
    return np.where(a, np.maximum(z, 0.0), 0.0) / n, lse
  if name == "clipped_softmax":  # clip((zeta - gamma) softmax + gamma, 0, 1), 1 and -0.025
    p = e / np.maximum(e.sum(-1, keepdims=True), 1e-300)
    return np.where(a, np.clip(1.025 * p - 0.025, 0.0, 1.0), 0.0), lse
  raise KeyError(f"no numpy formula for normalizer {name!r}: add one here")


@pytest.mark.parametrize("name,sink", CASES, ids=IDS)
def test_weights_equal_the_numpy_formula(name, sink):
  nz = normalizers.REGISTRY[name]
  z, allowed, _, _, _, sink_rows = _problem(7)
  sink_rows = sink_rows if sink else None
  w, log_norm = nz.weights(z, allowed, sink_rows)
  want_w, want_ln = _numpy_weights(name, z, allowed, sink_rows)
  has_key = np.asarray(jnp.any(allowed, axis=-1, keepdims=True))
  np.testing.assert_allclose(w, want_w, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    np.where(has_key, log_norm, 0), np.where(has_key, want_ln, 0), rtol=1e-5, atol=1e-5
  )
  if nz.sums_to_one and sink_rows is None:
    np.testing.assert_allclose(np.asarray(w).sum(-1)[has_key[..., 0]], 1.0, rtol=1e-5)


def test_capabilities():
  assert NAMES[:5] == ("softmax", "softmax_one", "sigmoid", "softpick", "none")
  for nz in normalizers.REGISTRY.values():
    if nz.platform_kernel:  # what jax.nn / cuDNN / splash compute: plain softmax
      assert nz.softmax_like and nz.sums_to_one and not nz.null_column
    if nz.mergeable:
      assert nz.merge_part in normalizers.REGISTRY
    if nz.accepts_sink_logits:
      assert nz.softmax_like
  assert normalizers.SUMS_TO_ONE == ("softmax",)
  assert [n for n in NAMES if normalizers.REGISTRY[n].needs_counts] == ["sigmoid", "relu"]
  with pytest.raises(ValueError, match="normalizer='nope' is not one of"):
    normalizers.get("nope")
  validators.check_choice("normalizer", NAMES[-1], normalizers.NORMALIZERS)


@pytest.mark.parametrize("name", NAMES)
def test_extreme_logits_and_empty_rows_are_never_nan(name):
  """All-masked input and extreme logits: the numpy formula's weights, zero rows, finite
  gradients."""
  nz = normalizers.REGISTRY[name]
  z = jnp.asarray([[[[80.0, -80.0, 0.0], [1e4, 1e4, -1e4]]]], jnp.float32)
  allowed = jnp.asarray([[[[False, False, False], [True, True, False]]]])
  w, _ = nz.weights(z, allowed)
  assert np.all(np.asarray(w)[0, 0, 0] == 0.0)
  np.testing.assert_allclose(w, _numpy_weights(name, z, allowed)[0], rtol=1e-6)
  grad = jax.grad(lambda z: jnp.sum(nz.weights(z, allowed)[0] * 0.5))(z)
  assert np.all(np.isfinite(np.asarray(grad)))


# ---------------------------------------------------------------------------
# ReLU attention (Wortsman et al. 2023), added by its definition alone.


def test_relu_layer_and_variant_gradients_match_finite_differences():
  from flax import nnx
  from jax.test_util import check_grads

  from attnjax._src import nn
  from attnjax._src.train import variants

  cfg = nn.AttentionConfig(**variants.attention_kwargs("relu"))
  assert cfg.normalizer == "relu"
  layer = nn.Attention(cfg, 16, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 7, 16))
  check_grads(
    lambda x: jnp.sum(jnp.sin(layer(x))), (x,), order=1, modes=("rev",), atol=1e-2, rtol=1e-2
  )


def test_one_minus_exp_neg_has_no_cancellation():
  # softpick's e^z - 1 near its kink: the plain 1 - e^-x loses log2(1/x) bits at small x
  from attnjax._src.normalizers import _one_minus_exp_neg

  x = np.concatenate([[0.0, 1e-30, 1e-8], np.geomspace(1e-6, 100.0, 200), [np.inf]])
  got = np.asarray(_one_minus_exp_neg(jnp.asarray(x, jnp.float32)), np.float64)
  want = -np.expm1(-x.astype(np.float32).astype(np.float64))
  np.testing.assert_allclose(got, want, rtol=4 * np.finfo(np.float32).eps, atol=0)
