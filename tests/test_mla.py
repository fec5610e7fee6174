"""Multi-head latent attention: the two forms equal the definition, and bad input is named.

The definition is written out here with numpy-style einsums (keys ``[c W_UK | k_rope]``,
values ``c W_UV`` per head, softmax over the scaled logits); the expanded and absorbed
forms of :func:`attnjax.mla_attention`, each engine, equal it in value and gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax import mla
from helpers import assert_close, outputs_and_grads, reduction_tolerance

B, T, N, R, D_N, D_R, D_V = 2, 12, 3, 16, 6, 4, 5


def _arrays(T=T, S=None, d_v=D_V, seed=0, dtype=jnp.float32):
  S = T if S is None else S
  rng = np.random.default_rng(seed)
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  return (
    draw(B, T, N, D_N + D_R),
    draw(B, S, 1, D_R),
    draw(B, S, 1, R),
    (0.4 * draw(R, N, D_N)).astype(dtype),
    (0.4 * draw(R, N, d_v)).astype(dtype),
  )


def _definition(q, k_rope, latent, w_uk, w_uv, *, is_causal=True, scale=None):
  """Softmax attention of each head over its rebuilt keys and values (float32)."""
  k_nope = jnp.einsum("bsr,rnd->bsnd", latent[:, :, 0], w_uk)
  k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:3] + (D_R,))], -1)
  v = jnp.einsum("bsr,rnv->bsnv", latent[:, :, 0], w_uv)
  scale = (D_N + D_R) ** -0.5 if scale is None else scale
  z = scale * jnp.einsum("btnh,bsnh->bnts", q, k)
  if is_causal:
    Tq, S = z.shape[2:]
    z = jnp.where(jnp.tril(jnp.ones((Tq, S), bool), S - Tq), z, -jnp.inf)
  return jnp.einsum("bnts,bsnv->btnv", jax.nn.softmax(z, -1), v)


@pytest.mark.parametrize("absorb", [False, True])
@pytest.mark.parametrize("implementation", ["reference", "blockwise", None])
def test_each_form_equals_the_definition(absorb, implementation):
  args = _arrays()
  fn = lambda *a: attnjax.mla_attention(
    *a, is_causal=True, absorb=absorb, implementation=implementation
  )
  tol = reduction_tolerance(jnp.float32, R + D_R, depth=6)
  assert_close(
    outputs_and_grads(fn, *args),
    outputs_and_grads(_definition, *args),
    f"mla absorb={absorb} {implementation}",
    rtol=tol,
    atol=tol,
    scaled=True,
  )


def test_xla_runs_an_expanded_call_whose_value_dim_matches():
  args = _arrays(d_v=D_N + D_R)
  got = attnjax.mla_attention(*args, is_causal=True, absorb=False, implementation="xla")
  np.testing.assert_allclose(got, _definition(*args), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="implementation='xla' does not support a value head dim"):
    attnjax.mla_attention(*args, is_causal=True, absorb=True, implementation="xla")


def test_absorbed_decode_step_equals_the_expanded_forward():
  """One new query over a long latent: at most 1e-5 apart in float32 (the acceptance bound)."""
  q, k_rope, latent, w_uk, w_uv = _arrays(T=1, S=300, seed=3)
  kw = dict(scale=0.3, normalizer="softmax", return_stats=True)
  out_a, st_a = attnjax.mla_attention(q, k_rope, latent, w_uk, w_uv, absorb=True, **kw)
  out_e, st_e = attnjax.mla_attention(q, k_rope, latent, w_uk, w_uv, absorb=False, **kw)
  assert float(jnp.max(jnp.abs(out_a - out_e))) <= 1e-5
  for a, e in zip(st_a, st_e):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


def test_every_dense_option_reaches_both_forms():
  q, k_rope, latent, w_uk, w_uv = _arrays(seed=4)
  rng = np.random.default_rng(5)
  kw = dict(
    bias=jnp.asarray(rng.standard_normal((1, N, T, T)), jnp.float32),
    mask=jnp.asarray(rng.random((B, 1, T, T)) < 0.8),
    softcap=4.0,
    window=(5, 1),
    segment_ids=jnp.asarray(np.repeat([[0, 1]], [5, 7], axis=1).repeat(B, 0), jnp.int32),
    normalizer="softpick",
    return_stats=True,
  )
  want = attnjax.mla_attention(
    q, k_rope, latent, w_uk, w_uv, absorb=False, implementation="reference", **kw
  )
  for absorb in (False, True):
    got = attnjax.mla_attention(q, k_rope, latent, w_uk, w_uv, absorb=absorb, **kw)
    assert_close(got, want, f"absorb={absorb}", rtol=2e-5, atol=2e-5, scaled=True)
  sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
  want = attnjax.mla_attention(q, k_rope, latent, w_uk, w_uv, sink_logits=sinks, absorb=False)
  got = attnjax.mla_attention(q, k_rope, latent, w_uk, w_uv, sink_logits=sinks, absorb=True)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_auto_form_absorbs_decode_and_expands_training():
  assert mla.absorbed_is_cheaper(1, 32768, 512, 128, 64, 128)
  assert not mla.absorbed_is_cheaper(4096, 4096, 512, 128, 64, 128)
  seen = []
  original = mla.LatentCall.dense_call

  def spy(self, inputs, opts):
    seen.append(self.absorb)
    return original(self, inputs, opts)

  args = _arrays(T=1, S=64)
  with pytest.MonkeyPatch.context() as m:
    m.setattr(mla.LatentCall, "dense_call", spy)
    attnjax.mla_attention(*args)
    attnjax.mla_attention(*_arrays())
  assert seen[0] is True and seen[-1] is False


def test_bfloat16_forms_agree_to_bfloat16_rounding():
  args = _arrays(dtype=jnp.bfloat16, seed=6)
  a = attnjax.mla_attention(*args, is_causal=True, absorb=True)
  e = attnjax.mla_attention(*args, is_causal=True, absorb=False)
  assert a.dtype == jnp.bfloat16
  assert_close(a, e, "bf16", rtol=3e-2, atol=3e-2, scaled=True)


@pytest.mark.parametrize(
  "change,match",
  [
    (lambda a: (a[0][0],) + a[1:], r"q must have rank 4"),
    (lambda a: (a[0], a[1][..., :0]) + a[2:], r"head dims must be positive.*d_r=0"),
    (lambda a: a[:2] + (a[2][..., :0],) + a[3:], r"head dims must be positive.*R=0"),
    (lambda a: a[:3] + (a[3][..., :0], a[4]), r"head dims must be positive.*d_n=0"),
    (lambda a: (a[0], jnp.concatenate([a[1]] * 2, 2)) + a[2:], r"one head.*k_rope \(2, 12, 2"),
    (lambda a: a[:3] + (a[3][:-1], a[4]), r"w_uk and w_uv must be \[R, N, .\] with R=16"),
    (lambda a: (a[0][..., :-1],) + a[1:], r"d_n \+ d_r = 6 \+ 4 = 10"),
    (lambda a: (a[0], a[1].astype(jnp.bfloat16)) + a[2:], r"share a dtype"),
    (lambda a: (a[0], a[1][:, :-1]) + a[2:], r"k_rope, latent on S"),
  ],
)
def test_bad_input_names_the_argument_and_shapes(change, match):
  with pytest.raises((ValueError, TypeError), match=match):
    attnjax.mla_attention(*change(_arrays()))


def test_absorb_takes_a_bool_or_none():
  with pytest.raises(TypeError, match="absorb must be True, False or None"):
    attnjax.mla_attention(*_arrays(), absorb=1)
  with pytest.raises(TypeError, match="similarity"):
    attnjax.mla_attention(*_arrays(), similarity="dot")
