"""A platform engine named on the wrong platform raises its named error in every mode of autodiff.

``implementation="pallas_gpu"`` (or ``mosaic_gpu``, ``pallas_tpu``, ``cudnn``) lowered for this
CPU raises "runs on a CUDA GPU only" / "runs on a TPU only" (:func:`attnjax._lowering.on_platform`).
A program may keep only a derivative: under ``jax.jit``, the gradient of a loss linear in the
output needs no forward value, and XLA drops the forward that raised. The derivatives fail too,
so such a program raises instead of returning zeros (it returned all-zero gradients before).
"""

import jax
import jax.numpy as jnp
import pytest

import attnjax
from attnjax._src import target as _target
from helpers import rand_qkv

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks CPU refusals")

# engine -> (its message, q/k/v dtype, head dim); mosaic_gpu is traced for a Hopper (on a host
# with none it is refused while traced, before any lowering).
ENGINES = {
  "pallas_gpu": ("pallas_gpu' runs on a CUDA GPU only", jnp.float32, 16),
  "mosaic_gpu": ("mosaic_gpu' runs on a CUDA GPU", jnp.bfloat16, 64),
  "pallas_tpu": ("pallas_tpu' runs on a TPU only", jnp.float32, 16),
}
LOSSES = {"linear": jnp.sum, "nonlinear": lambda o: jnp.sum(jnp.sin(o.astype(jnp.float32)))}


def modes(f):
  """Every way of asking for ``f``'s value or a derivative, each a function of (q, k, v)."""
  jvp = lambda q, k, v: jax.jvp(f, (q, k, v), (q, k, v))[1]
  return {
    "value": f,
    "grad": jax.grad(f, argnums=(0, 1, 2)),
    "grad_q": jax.grad(f),
    "jvp": jvp,
    "linearize": lambda q, k, v: jax.linearize(f, q, k, v)[1](q, k, v),
    "vmap_grad": lambda q, k, v: jax.vmap(jax.grad(f))(q[None], k[None], v[None]),
    "second_order": jax.grad(lambda q, k, v: jnp.sum(jax.grad(f)(q, k, v))),
  }


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_platform_engine_on_the_cpu_raises_in_every_mode(engine, loss, jit, monkeypatch):
  message, dtype, head = ENGINES[engine]
  if engine == "mosaic_gpu":
    monkeypatch.setattr(_target, "cuda_major", lambda: 9)
  q, k, v = rand_qkv(B=1, T=64, N=2, K=1, H=head, dtype=dtype)
  f = lambda q, k, v: LOSSES[loss](
    attnjax.dot_product_attention(q, k, v, is_causal=True, implementation=engine)
  )
  for mode, g in modes(f).items():
    with pytest.raises(ValueError, match=message):
      out = (jax.jit(g) if jit else g)(q, k, v)
      pytest.fail(f"{mode}: no error, returned {jax.tree.map(jnp.shape, out)}")


def test_cudnn_on_the_cpu_raises_in_every_mode():
  q, k, v = rand_qkv(B=1, T=8, N=2, K=1, H=16, dtype=jnp.bfloat16)
  # jax without the cuDNN library cannot even trace the call ("cuDNN library").
  match = "cuDNN library" if _target.cudnn_version() is None else "cudnn' runs on a CUDA GPU"
  f = lambda q, k, v: jnp.sum(attnjax.dot_product_attention(q, k, v, implementation="cudnn"))
  for mode, g in modes(f).items():
    with pytest.raises(ValueError, match=match):
      jax.jit(g)(q, k, v)
      pytest.fail(f"{mode}: no error")


def test_the_kernel_still_runs_and_exports_where_it_belongs():
  # The failing branch is never lowered for the kernel's own platform: export of the gradient
  # for cuda holds the Triton kernels (the derivative of the failure adds nothing there).
  q = jax.ShapeDtypeStruct((1, 64, 2, 16), jnp.float32)
  f = lambda q: jnp.sum(
    attnjax.dot_product_attention(q, q, q, is_causal=True, implementation="pallas_gpu")
  )
  exported = jax.export.export(
    jax.jit(jax.grad(f)),
    platforms=["cuda"],
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
  )(q)
  text = exported.mlir_module()
  assert "__gpu$xla.gpu.triton" in text and "attnjax_wrong_platform" not in text
