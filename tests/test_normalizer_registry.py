"""Normalisers of one's own: public registration, and no silent wrong answer on any engine.

A normaliser built on a built-in class under another name inherits none of the claims that
send a call to a softmax-only kernel or merge it as softmax (``normalizers.CLAIMS``), and the
engines check the object themselves: so every built-in family re-registered as a subclass
gives its reference's values on every engine that accepts it, and a subclass that states
wrong claims still never reaches jax.nn, cuDNN or splash, nor a softmax merge.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src import normalizers, options
from attnjax._src.kernels import jax_nn, splash
from helpers import assert_close, outputs_and_grads, rand_qkv, reduction_tolerance

P = attnjax.patterns
TOL = reduction_tolerance(jnp.float32, 64, depth=8)


def _subclass(builtin: normalizers.Normalizer, name: str) -> normalizers.Normalizer:
  """``builtin``'s class subclassed and instantiated under ``name``, stating nothing."""
  cls = type(f"My{type(builtin).__name__}", (type(builtin),), {"__doc__": f"{name}"})
  if isinstance(builtin, normalizers.SoftmaxFamily):
    return cls(name, builtin.shift_floor, "a subclass")
  if isinstance(builtin, normalizers.ClippedSoftmax):
    return cls(name, zeta=builtin.zeta, gamma=builtin.gamma, alpha=builtin.alpha)
  nz = cls()
  nz.name = name
  return nz


# Defined once (registering the same object again never clears jax's caches).
SUBCLASSES = {
  name: _subclass(normalizers.REGISTRY[name], f"my_{name}") for name in normalizers.NORMALIZERS
}


class LyingSoftmaxOne(normalizers.SoftmaxFamily):
  """Softmax with a null column of logit 1.5 that states softmax's claims: the issue's trap
  (platform_kernel and a softmax merge sent it to jax.nn and merged it as plain softmax)."""

  platform_kernel = True
  mergeable = True
  merge_part = "softmax"
  softmax_like = True


LYING = LyingSoftmaxOne("lying_softmax_one", 1.5, "a test")


@pytest.fixture(scope="module", autouse=True)
def registered():
  for nz in [*SUBCLASSES.values(), LYING]:
    normalizers.register(nz)
  yield
  for nz in [*SUBCLASSES.values(), LYING]:
    normalizers.unregister(nz.name)


# ---------------------------------------------------------------------------
# The registry.


def test_register_refuses_taken_names_and_names_the_holder():
  with pytest.raises(ValueError, match="'softmax' is already registered.*SoftmaxFamily.*built-in"):
    normalizers.register(_subclass(normalizers.REGISTRY["softmax"], "softmax"))
  with pytest.raises(ValueError, match="'my_sigmoid' is already registered.*MySigmoid.*unregister"):
    normalizers.register(_subclass(normalizers.REGISTRY["sigmoid"], "my_sigmoid"))
  with pytest.raises(ValueError, match="built in and cannot be unregistered"):
    normalizers.unregister("softmax")
  with pytest.raises(ValueError, match="no normaliser named 'nope'"):
    normalizers.unregister("nope")
  with pytest.raises(TypeError, match="read-only.*register"):
    normalizers.REGISTRY["x"] = SUBCLASSES["softmax"]
  with pytest.raises(ValueError, match="non-empty str without spaces"):
    normalizers.register(_subclass(normalizers.REGISTRY["relu"], "two words"))


def test_validation_reads_the_live_registry_and_suggests_names():
  q, k, v = rand_qkv(1, 8, N=2, K=2, H=4)
  extra = _subclass(normalizers.REGISTRY["relu"], "scoped_relu")
  with pytest.raises(ValueError, match="normalizer='scoped_relu' is not one of.*register"):
    options.validate(q, k, v, normalizer="scoped_relu")
  with normalizers.registered(extra):
    assert "scoped_relu" in normalizers.names() and "scoped_relu" not in normalizers.NORMALIZERS
    options.validate(q, k, v, normalizer="scoped_relu")
  assert "scoped_relu" not in normalizers.REGISTRY
  with pytest.raises(ValueError, match=r"did you mean 'softpick'\?"):
    normalizers.get("sofpick")
  with pytest.raises(TypeError, match="must be a str naming a registered normaliser, got int"):
    attnjax.dot_product_attention(q, k, v, normalizer=3)


def test_a_name_registered_again_never_runs_a_stale_trace():
  """Jitted calls key their traces on the name: registering another object under a name that
  held one clears jax's caches, so the same call (an outer jit's too) runs the new one."""
  q, k, v = rand_qkv(1, 8, N=2, K=2, H=4)
  outer = jax.jit(lambda q, k, v: attnjax.dot_product_attention(q, k, v, normalizer="swapped"))
  for builtin in ("softmax", "relu"):
    with normalizers.registered(_subclass(normalizers.REGISTRY[builtin], "swapped")):
      want = attnjax.dot_product_attention(q, k, v, normalizer=builtin)
      np.testing.assert_allclose(outer(q, k, v), want, rtol=1e-5, atol=1e-6)


def test_a_subclass_states_its_claims_or_has_none():
  for name, nz in SUBCLASSES.items():
    for claim, value in normalizers.CLAIMS.items():
      assert getattr(nz, claim) == value, (name, claim)
  assert normalizers.REGISTRY["softmax"].platform_kernel
  assert normalizers.PLATFORM_KERNELS == {"softmax"}
  assert normalizers.merge_part("softmax_one") == "softmax"
  assert normalizers.merge_part("my_softmax_one") is None  # not mergeable: no claim
  assert normalizers.merge_part("lying_softmax_one") is None  # merges no parts but its own
  # The built-ins keep theirs, stated by each class.
  assert not normalizers.REGISTRY["sigmoid"].reads_row_dot


def test_register_refuses_half_overridden_interfaces():
  class ScaledSoftmax(normalizers.SoftmaxFamily):
    def weights(self, z, allowed, sink_logits=None):
      return super().weights(2.0 * z, allowed, sink_logits)

  with pytest.raises(
    TypeError, match=r"defines \['weights'\] but inherits.*SoftmaxFamily.*WeightsOnly"
  ):
    normalizers.register(ScaledSoftmax("scaled", None, "x"))

  class HalfSigmoid(normalizers.Sigmoid):
    def weight(self, z, row):
      return 0.5 * super().weight(z, row)

  half = HalfSigmoid()
  half.name = "half_sigmoid"
  with pytest.raises(TypeError, match="weight and weight_grad must be defined together"):
    normalizers.register(half)

  class NoWeights(normalizers.WeightsOnly):
    name = "no_weights"

  with pytest.raises(TypeError, match=r"must define weights\(z, allowed, row\)"):
    normalizers.register(NoWeights())

  class Unknown(normalizers.WeightsOnly):
    name = "unknown_quantity"
    row_quantities = ("mean",)

    def weights(self, z, allowed, row):
      return z

  with pytest.raises(ValueError, match=r"row_quantities \['mean'\] are not among"):
    normalizers.register(Unknown())
  with pytest.raises(TypeError, match="must be an attnjax.normalizers.Normalizer"):
    normalizers.register("softmax")


# ---------------------------------------------------------------------------
# Every engine that accepts a subclass gives the reference's values.


def _dense(name, impl):
  return lambda q, k, v: attnjax.dot_product_attention(
    q, k, v, is_causal=True, window=(9, 0), normalizer=name, implementation=impl
  )


def _sparse(name, impl):
  return lambda q, k, v: attnjax.sparse_attention(
    q, k, v, pattern=P.strided(4), block_size=8, normalizer=name, implementation=impl
  )


def _compressed(name, impl):
  return lambda q, k, v: attnjax.compressed_attention(
    q, k, v, stride=4, is_causal=True, window=4, block_size=8, normalizer=name, implementation=impl
  )


def _block_select(name, impl):
  return lambda q, k, v: attnjax.block_select_attention(
    q, k, v, block_size=8, top_k=1, normalizer=name, implementation=impl
  )


FAMILIES = {
  "dense": (_dense, ("blockwise", None)),
  "sparse": (_sparse, ("blockwise",)),  # strided: the merge path for the built-in softmaxes
  "compressed": (_compressed, ("blockwise",)),  # a window: the merge path likewise
  "block_select": (_block_select, ("gathered",)),
}


def _engines_equal_the_builtins_reference(family, builtin, grads):
  call, engines = FAMILIES[family]
  q, k, v = rand_qkv(1, 24, N=4, K=2, H=8)
  run = outputs_and_grads if grads else (lambda f, *a: f(*a))
  want = run(call(builtin, "reference"), q, k, v)
  for impl in engines:
    got = run(call(f"my_{builtin}", impl), q, k, v)
    assert_close(got, want, f"{family}[{impl}] my_{builtin}", rtol=TOL, atol=TOL, scaled=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_subclasses_equal_the_builtins_reference(family):
  # softmax_one's subclass on the merging paths: test_no_engine_takes_a_subclass_...
  _engines_equal_the_builtins_reference(family, "softpick", grads=family == "dense")


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("builtin", normalizers.NORMALIZERS)
def test_every_subclass_equals_the_builtins_reference_with_gradients(family, builtin):
  _engines_equal_the_builtins_reference(family, builtin, grads=True)


@pytest.mark.parametrize("builtin", [pytest.param("softmax", marks=pytest.mark.slow), "sigmoid"])
def test_interpret_mode_kernels_take_subclasses(builtin):
  """The Pallas kernels run the online interface: a subclass is theirs as a built-in is."""
  from attnjax.kernels import pallas_gpu

  q, k, v = rand_qkv(1, 32, N=2, K=2, H=16)
  want = attnjax.dot_product_attention(
    q, k, v, is_causal=True, normalizer=builtin, implementation="reference"
  )
  got = pallas_gpu.attention(q, k, v, is_causal=True, normalizer=f"my_{builtin}", interpret=True)
  np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)


def test_no_engine_takes_a_subclass_into_a_softmax_only_kernel(monkeypatch):
  from attnjax._src.ops.sparse import attention as sparse_lib

  q, k, v = rand_qkv(1, 128, N=2, K=2, H=16)
  for name in ("my_softmax", "lying_softmax_one"):
    inputs, opts = options.validate(q, k, v, is_causal=True, normalizer=name)
    assert jax_nn.unsupported(inputs, opts), name
    assert splash.unsupported(inputs, opts), name
    with pytest.raises(ValueError, match=f"normalizer='{name}'"):
      attnjax.dot_product_attention(q, k, v, normalizer=name, implementation="xla")
  # The merges: strided's factors (from any length here) and compressed's window part merge
  # the built-in softmax_one's softmax parts, never the lying subclass's. The numbers:
  # its claims gave softmax's values on xla, 2.18 off on a strided pattern, 2.43 off on
  # compressed with a window; now each engine gives its reference's.
  monkeypatch.setattr(sparse_lib, "STRIDED_TWO_PASS_MIN_LENGTH", 1)
  merged = []
  merge = normalizers.SoftmaxFamily.merge
  monkeypatch.setattr(
    normalizers.SoftmaxFamily,
    "merge",
    lambda self, parts, sink_logits=None: (
      merged.append(self.name) or merge(self, parts, sink_logits)
    ),
  )
  jax.clear_caches()  # the merges are decided while tracing
  for call in (_sparse, _compressed):
    for name in ("softmax_one", "lying_softmax_one"):
      got = call(name, "blockwise")(q, k, v)
      want = call(name, "reference")(q, k, v)
      np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL, err_msg=name)
    plain = call("softmax", "reference")(q, k, v)
    assert float(jnp.max(jnp.abs(want - plain))) > 0.1  # the null column matters here
  assert merged == ["softmax_one", "softmax_one"], merged
