"""One API vocabulary: ``"reference"`` in every family, Literal types equal to the runtime names,
the recurrent families' ``implementation`` names, one ``window`` convention."""

from __future__ import annotations

import functools
import typing
import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src import validators, feature_maps, masks
from attnjax._src.ops import recurrence
from attnjax._src.ops.delta_rule import attention as delta_rule
from attnjax._src.ops.cosine import attention as cosine
from attnjax._src.ops.dense import attention as dense
from attnjax._src.ops.qk_norm import attention as qk_norm
from attnjax._src.ops.gated_linear import attention as gated_linear
from attnjax._src.ops.linear import attention as linear
from attnjax._src.ops.sparse import attention as sparse
from helpers import assert_close, rand_qkv

# Short calls of the sparse family run its block plans here, as auto-dispatch does from
# sparse.BLOCKWISE_MIN_LENGTH tokens on (the plans are what these tests check).
pytestmark = pytest.mark.usefixtures("sparse_block_plans")


def test_check_implementation_passes_current_names_and_maps_old_ones():
  allowed = ("reference", "fast")
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # current names and None never warn
    assert validators.check_implementation("implementation", None, allowed) is None
    assert validators.check_implementation("implementation", "fast", allowed) == "fast"
  with pytest.warns(
    DeprecationWarning, match="implementation='old' is deprecated; use implementation='reference'"
  ):
    assert (
      validators.check_implementation(
        "implementation", "old", allowed, deprecated={"old": "reference"}
      )
      == "reference"
    )
  with pytest.raises(
    ValueError, match="implementation='slow' is not one of: None, 'reference', 'fast'"
  ):
    validators.check_implementation("implementation", "slow", allowed)
  with pytest.raises(TypeError, match="implementation must be a str or None, got int 3"):
    validators.check_implementation("implementation", 3, allowed)


@pytest.mark.parametrize(
  "literal,names",
  [
    (dense.Similarity, dense.SIMILARITIES),
    (sparse.ImplementationName, sparse.IMPLEMENTATIONS),
    (linear.ImplementationName, linear.IMPLEMENTATIONS),
    (linear.Normalize, linear.NORMALIZE),
    (qk_norm.Norm, qk_norm.NORMS),
    (cosine.CosineConvention, cosine.COSINE_CONVENTIONS),
    (feature_maps.DeterministicKind, feature_maps.DETERMINISTIC),
  ],
  ids=["similarity", "sparse", "linear", "normalize", "norm", "convention", "kind"],
)
def test_literal_types_name_what_the_functions_accept(literal, names):
  assert typing.get_args(literal) == names


def test_every_family_calls_its_readable_form_reference():
  q, k, v = rand_qkv(B=1, T=8, N=2, K=1, H=4)
  kw = dict(implementation="reference")
  ref = attnjax.dot_product_attention(q, k, v, is_causal=True, **kw)
  assert_close(
    attnjax.sparse_attention(q, k, v, pattern=attnjax.patterns.causal(), block_size=4, **kw),
    ref,
    "sparse causal",
    atol=1e-6,
  )
  assert_close(
    attnjax.qk_norm_attention(q, k, v, norm="l2", scale=1.0, is_causal=True, **kw),
    attnjax.cosine_attention(
      q, k, v, temperature=jnp.ones(2), convention="scale", is_causal=True, **kw
    ),
    "l2 qk-norm vs cosine",
    atol=1e-5,
  )
  out = attnjax.linear_attention(q, k, v, is_causal=True, **kw)
  assert_close(out, attnjax.linear_attention(q, k, v, is_causal=True), "linear", atol=1e-5)


# ---------------------------------------------------------------------------
# The recurrent families: the same implementation names, each naming the same form.


def _scan_lengths(jaxpr) -> list[int]:
  """The ``length`` of every ``lax.scan`` in ``jaxpr`` and the jaxprs nested in it."""
  lengths = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      lengths.append(eqn.params["length"])
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          lengths += _scan_lengths(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          lengths += _scan_lengths(sub)
  return lengths


def _recurrent_case(T=4, seed=0):
  """One tiny causal case (B=1, N=2, K=1, H=Hv=3) and the three families' calls on it."""
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.standard_normal((1, T, n, 3)), jnp.float32) for n in (2, 1, 1))
  k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  g = jnp.asarray(-rng.uniform(0.1, 1.0, (1, T, 2)), jnp.float32)
  beta = jnp.asarray(rng.uniform(0.1, 0.9, (1, T, 2)), jnp.float32)
  calls = {
    "linear": lambda q, k, v, **kw: attnjax.linear_attention(q, k, v, is_causal=True, **kw),
    "gated_linear": lambda q, k, v, **kw: attnjax.gated_linear_attention(
      q, k, v, log_decay=g, **kw
    ),
    "delta_rule": lambda q, k, v, **kw: attnjax.delta_rule_attention(
      q, k, v, beta, log_decay=g, **kw
    ),
  }
  return (q, k, v, g, beta), calls


def _loops(q, k, v, g, beta):
  """Each family's definition written as a plain loop over tokens (numpy, float64)."""
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  T, N, H = q.shape[1:]
  phi = lambda x: np.where(x > 0, x + 1.0, np.exp(x))  # elu + 1
  out = {name: np.zeros((1, T, N, H)) for name in ("linear", "gated_linear", "delta_rule")}
  for n in range(N):
    s_lin, z, s_gla, s_delta = np.zeros((H, H)), np.zeros(H), np.zeros((H, H)), np.zeros((H, H))
    for t in range(T):
      kt, vt, qt = k[0, t, 0], v[0, t, 0], q[0, t, n]
      s_lin, z = s_lin + np.outer(phi(kt), vt), z + phi(kt)
      out["linear"][0, t, n] = phi(qt) @ s_lin / (phi(qt) @ z + linear.DEFAULT_EPS)
      s_gla = np.exp(g[0, t, n]) * s_gla + np.outer(kt, vt)
      out["gated_linear"][0, t, n] = H**-0.5 * s_gla.T @ qt
      b = beta[0, t, n]
      s_delta = np.exp(g[0, t, n]) * (np.eye(H) - b * np.outer(kt, kt)) @ s_delta
      s_delta = s_delta + b * np.outer(kt, vt)
      out["delta_rule"][0, t, n] = H**-0.5 * s_delta.T @ qt
  return out


def test_recurrent_families_give_each_engine_name_the_same_meaning():
  """``"recurrent"`` scans the T tokens, ``"chunked"`` the T / C chunks, ``"quadratic"`` scans
  nothing (the masked quadratic product); ``"reference"`` is the engine its family's
  ``REFERENCE_ENGINE`` names; every name equals the family's definition as a loop."""
  modules = {"linear": linear, "gated_linear": gated_linear, "delta_rule": delta_rule}
  names = ("reference",) + recurrence.ENGINE_NAMES
  assert {m.IMPLEMENTATIONS for m in modules.values()} == {names}
  assert set(names) == {"reference", "recurrent", "quadratic", "chunked"}
  # The readable definition of each family (see attnjax/_src/ops/recurrence.py for why these).
  assert {n: m.REFERENCE_ENGINE for n, m in modules.items()} == {
    "linear": "quadratic",
    "gated_linear": "recurrent",
    "delta_rule": "recurrent",
  }
  T, C = 4, 2
  arrays, calls = _recurrent_case(T)
  scans = {"recurrent": [T], "chunked": [T // C], "quadratic": []}
  for family, call in calls.items():
    for name in names:
      jaxpr = jax.make_jaxpr(functools.partial(call, implementation=name, chunk_size=C))(
        *arrays[:3]
      ).jaxpr
      engine = modules[family].REFERENCE_ENGINE if name == "reference" else name
      assert _scan_lengths(jaxpr) == scans[engine], (family, name)
    with pytest.raises(
      ValueError,
      match="implementation='blockwise' is not one of: None, "
      "'reference', 'recurrent', 'quadratic', 'chunked'",
    ):
      call(*arrays[:3], implementation="blockwise")

  @jax.jit
  def every_engine(q, k, v):
    return {
      (family, name): call(q, k, v, implementation=name, chunk_size=C)
      for family, call in calls.items()
      for name in names
    }

  want = _loops(*arrays)
  for (family, name), out in every_engine(*arrays[:3]).items():
    assert_close(out, want[family], f"{family} implementation={name!r}", rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# One window convention: (left, right); an int w is (w, 0), keys i - w .. i.


def _layer_weights(T, **options):
  """``[T, S]`` weights an ``nn.Attention`` layer used (sown), and the layer."""
  from flax import nnx
  from attnjax._src import nn

  @nnx.jit  # one program per layer: faster than the capture's ops one by one
  def sown(layer, x):
    _, inter = nnx.capture(lambda m, x: m(x, sow_weights=True), nnx.Intermediate)(layer, x)
    return inter["weights"][0]

  layer = nn.Attention(nn.AttentionConfig(num_heads=1, **options), 8, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(1).standard_normal((1, T, 8)), jnp.float32)
  return np.asarray(sown(layer, x))[0, 0], layer


def test_window_keeps_the_same_keys_in_every_family_layer_and_variant():
  """``window=w`` keeps keys ``i - w .. i`` (``w + 1``), what ``patterns.sliding_window(w)``
  keeps: in the dense functions, patterns (sinks and globals aside), compressed attention's
  raw keys, the nn layers and the experiment variants, read off the weights each used."""
  from attnjax._src.train import variants

  P = attnjax.patterns
  T, w = 8, 2
  want = np.asarray(P.sliding_window(w).mask(T))[0, 0]
  assert want.sum(-1).tolist() == [min(i, w) + 1 for i in range(T)]
  q, k, _ = rand_qkv(B=1, T=T, N=1, K=1, H=4)
  eye = jnp.eye(T)[None, :, None, :]  # one-hot values: output [i, j] = the weight on key j
  nothing = (jnp.zeros((1, 1, 1, 4)), jnp.zeros((1, 1, 1, T)))  # a compressed block adding 0

  @jax.jit
  def outputs(q, k):
    return {
      "dot_product_attention": attnjax.dot_product_attention(q, k, eye, window=w),
      "qk_norm_attention": attnjax.qk_norm_attention(q, k, eye, norm="rms", window=w),
      "sinks_window(1, w)": attnjax.sparse_attention(
        q, k, eye, pattern=P.sinks_window(1, w), block_size=4
      ),
      "global_window(1, w)": attnjax.sparse_attention(
        q, k, eye, pattern=P.global_window(1, w), block_size=4
      ),
      "compressed causal": attnjax.compressed_attention(
        q, k, eye, stride=T, pool=nothing, is_causal=True, window=w
      ),
      "compressed": attnjax.compressed_attention(q, k, eye, stride=T, pool=nothing, window=w),
    }

  kept = {name: np.asarray(out)[0, :, 0, :] > 0 for name, out in outputs(q, k).items()}
  kept["make_attention_mask"] = np.asarray(masks.make_attention_mask(T, T, window=w))[0, 0]
  # Layers and experiment variants (the "compressed" arm with blocks longer than T: only its
  # raw window reaches a query).
  layers = {}
  for name, options in (("window", {}), ("compressed", dict(stride=16))):
    arm = dict(variants.attention_kwargs(name), **options)
    assert arm["window"] == 16  # both arms: keys i - 16 .. i
    weights, layers[name] = _layer_weights(T, **dict(arm, window=w))
    kept[f"nn variant {name!r}"] = weights[:, -T:] > 0
  weights, layers["sinks"] = _layer_weights(T, window=w, num_sinks=1)
  kept["nn window + num_sinks"] = weights > 0
  # The decode cache holds the w keys before the query (its own comes with the call), and the
  # sinks: exactly the keys the window lets it see.
  assert (layers["window"].cache_capacity(100), layers["sinks"].cache_capacity(100)) == (w, 1 + w)
  for name, got in kept.items():
    if name in ("sinks_window(1, w)", "global_window(1, w)", "nn window + num_sinks"):
      got, expected = got[1:, 1:], want[1:, 1:]  # the sinks / globals aside
    else:
      expected = want
    np.testing.assert_array_equal(got, expected, err_msg=name)
