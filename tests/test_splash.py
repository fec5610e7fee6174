"""The splash-attention path: its mask against ours, interpret-mode parity, refusals, dispatch.

The Pallas kernel only compiles for a TPU; on other backends it runs in Pallas interpret
mode (``run_kernel(splash, ..., interpret=True)``), which is slow, so the parity cases use the
smallest lengths the kernel tiles (multiples of 128) and few heads.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src.ops.dense import attention as dense
from attnjax._src import masks
from attnjax._src.kernels import splash
from helpers import rand_qkv as _rand_qkv, run_kernel


def rand_qkv(B=1, T=128, S=None, N=2, K=1, H=64, dtype=jnp.float32, seed=0):
  """:func:`helpers.rand_qkv` with this file's kernel-sized defaults."""
  return _rand_qkv(B=B, T=T, S=S, N=N, K=K, H=H, dtype=dtype, seed=seed)


# ---------------------------------------------------------------------------
# The static mask, element for element.


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_splash_mask_is_our_mask_rule(is_causal):
  windows = [None, (0, 0), (2, 1), (0, 3), (3, 0), (1, 20), (20, 20)]
  for (T, S), window in itertools.product([(7, 7), (5, 9), (9, 4), (16, 16)], windows):
    ours = masks.structural_mask(jnp.arange(T), jnp.arange(S), is_causal=is_causal, window=window)
    ours = np.ones((T, S), bool) if ours is None else np.asarray(ours[0, 0])
    theirs = splash.make_mask(T, S, 3, is_causal=is_causal, window=window)
    assert theirs.shape == (3, T, S)
    got = np.asarray(theirs[slice(None), slice(None), slice(None)])
    for h in range(3):
      np.testing.assert_array_equal(got[h], ours, err_msg=f"T={T} S={S} window={window}")


# ---------------------------------------------------------------------------
# Values and gradients against the reference, in interpret mode.

SEG_B2 = jnp.array([[0] * 100 + [1] * 156, [3] * 256])  # two segments, then one

PARITY_CASES = {
  # name: (B, T, S, N, K, options)
  "causal_mqa": (1, 256, 256, 2, 1, dict(is_causal=True)),
  "window_gqa": (1, 256, 256, 4, 2, dict(window=(40, 7))),
  "causal_window_segments": (
    2,
    256,
    256,
    2,
    1,
    dict(is_causal=True, window=(60, 3), segment_ids=SEG_B2),
  ),
  "softcap_sinks_scale_t_lt_s": (
    2,
    128,
    256,
    2,
    2,
    dict(is_causal=True, softcap=2.0, scale=0.5, sink_logits=jnp.array([0.5, -1.0])),
  ),
  # T > S: query blocks 1 and 2 have no allowed key at all (splash visits no block there).
  "window_rows_without_keys": (1, 384, 128, 2, 1, dict(window=(5, 0))),
}


def _splash_and_reference(q, k, v, kw):
  """(loss, out) and gradients for q, k, v (and sink_logits if given) on both paths."""
  kw = dict(kw)
  args = (q, k, v) + ((kw.pop("sink_logits"),) if "sink_logits" in kw else ())

  def loss(impl):
    def f(q, k, v, *sink):
      inputs, opts = dense.prepare(q, k, v, **kw, **({"sink_logits": sink[0]} if sink else {}))
      out = (
        run_kernel(splash, inputs, opts, interpret=True)
        if impl == "splash"
        else dense.reference(inputs, opts)
      )
      ct = jax.random.normal(jax.random.key(42), out.shape, jnp.float32)
      return jnp.sum(out * ct), out

    return jax.jit(jax.value_and_grad(f, argnums=tuple(range(len(args))), has_aux=True))

  return loss("splash")(*args), loss("reference")(*args)


@pytest.mark.parametrize("case", list(PARITY_CASES), ids=str)
def test_splash_interpret_matches_reference(case):
  B, T, S, N, K, kw = PARITY_CASES[case]
  q, k, v = rand_qkv(B=B, T=T, S=S, N=N, K=K, seed=1)
  ((_, out), grads), ((_, ref), ref_grads) = _splash_and_reference(q, k, v, kw)
  assert out.shape == (B, T, N, 64) and out.dtype == jnp.float32
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)
  assert len(grads) == (4 if "sink_logits" in kw else 3)
  for name, g, r in zip(["q", "k", "v", "sink_logits"], grads, ref_grads):
    assert bool(jnp.isfinite(g).all()), name
    np.testing.assert_allclose(g, r, atol=2e-5, rtol=2e-5, err_msg=f"d{name}")
  if case == "window_rows_without_keys":
    assert float(jnp.abs(out[:, S + 5 :]).max()) == 0.0


def test_splash_interpret_bf16_matches_float32_reference():
  # bf16 inputs (H=128, whose scale 1/sqrt(128) is not a power of two): the output comes
  # back in bf16, within bf16 rounding of the float32 reference on the same inputs.
  q, k, v = rand_qkv(T=128, N=2, K=1, H=128, dtype=jnp.bfloat16, seed=3)
  inputs, opts = dense.prepare(q, k, v, is_causal=True)
  out = run_kernel(splash, inputs, opts, interpret=True)
  assert out.dtype == jnp.bfloat16
  ref = dense.reference(*dense.prepare(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True))
  np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=3e-2, rtol=3e-2)


# ---------------------------------------------------------------------------
# What splash refuses, and the auto-dispatch.


@pytest.mark.parametrize(
  "kw,word",
  [
    (dict(normalizer="sigmoid"), "normalizer='sigmoid'"),
    (dict(similarity="neg_sq_euclidean"), "similarity='neg_sq_euclidean'"),
    (dict(bias="random"), "bias"),
    (dict(mask="random"), "explicit mask array"),
    (dict(return_stats=True), "return_stats"),
    (dict(T=100), "T=100, S=100"),
    (dict(S=200, segment_ids="pair"), "T=128, S=200"),
    (dict(dtype=jnp.float16), "dtype float16"),
  ],
  ids=["sigmoid", "euclid", "bias", "mask", "stats", "length", "kv_length", "fp16"],
)
def test_splash_reasons_name_the_option(kw, word):
  kw = dict(kw)
  q, k, v = rand_qkv(T=kw.pop("T", 128), S=kw.pop("S", None), dtype=kw.pop("dtype", jnp.float32))
  B, T, N = q.shape[:3]
  S = k.shape[1]
  if kw.get("bias") == "random":
    kw["bias"] = jnp.zeros((1, N, T, S))
  if kw.get("mask") == "random":
    kw["mask"] = jnp.ones((1, 1, T, S), bool)
  if kw.get("segment_ids") == "pair":
    kw["segment_ids"] = (jnp.zeros((B, T), int), jnp.zeros((B, S), int))
  reasons = splash.unsupported(*dense.prepare(q, k, v, **kw), interpret=True)
  assert len(reasons) == 1 and word in reasons[0], reasons


def test_splash_supports_its_options_in_interpret_mode():
  q, k, v = rand_qkv(T=128, S=256, N=4, K=2)
  seg = (jnp.zeros((1, 128), int), jnp.zeros((1, 256), int))
  call = dense.prepare(
    q,
    k,
    v,
    is_causal=True,
    window=(8, 0),
    softcap=3.0,
    scale=0.2,
    sink_logits=jnp.zeros(4),
    segment_ids=seg,
  )
  assert splash.unsupported(*call, interpret=True) == []
  bf16 = dense.prepare(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
  assert splash.unsupported(*bf16, interpret=True) == []


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="checks the non-TPU refusal")
def test_splash_refuses_without_tpu():
  q, k, v = rand_qkv(T=128)
  with pytest.raises(ValueError, match=r"implementation='splash'.*splash needs a TPU"):
    attnjax.dot_product_attention(q, k, v, implementation="splash")
  with pytest.raises(ValueError, match="splash needs a TPU"):
    run_kernel(splash, *dense.prepare(q, k, v))


@pytest.mark.usefixtures("all_kernels")
def test_auto_dispatch_picks_splash_on_tpu(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  q, k, v = rand_qkv(T=256)
  seg = jnp.zeros((1, 256), int)
  for kw in (
    dict(),
    dict(is_causal=True),
    dict(window=(16, 0), segment_ids=seg),
    dict(softcap=5.0, sink_logits=jnp.zeros(2)),
  ):
    call = dense.prepare(q, k, v, **kw)
    assert splash.unsupported(*call) == []
    assert dense.select_implementation(*call) == "splash", kw
  # What splash cannot honour goes to the Pallas TPU kernel where it covers the call (another
  # normaliser, lengths that are not multiples of 128); what neither covers falls back as on the
  # CPU: block-wise from BLOCKWISE_MIN_LENGTH_CPU on (a bias array).
  assert dense.select_implementation(*dense.prepare(q, k, v, normalizer="softpick")) == "pallas_tpu"
  assert dense.select_implementation(*dense.prepare(*rand_qkv(T=100))) == "pallas_tpu"
  assert (
    dense.select_implementation(*dense.prepare(q, k, v, bias=jnp.zeros((1, 2, 256, 256))))
    == "blockwise"
  )
