"""The training steps of the ``gpu`` and ``tpu`` presets export for their platforms from a CPU host.

``jax.export(..., platforms=[...])`` lowers a program for a platform this host
does not have; auto-dispatch (``implementation=None``) is decided at lowering
time, so the exported module holds the platform's kernel: the Pallas Triton
call (:data:`attnjax.kernels.pallas_gpu.TRITON_CALL_TARGET`) for ``cuda``, splash or the
Pallas TPU kernel (``tpu_custom_call``) for ``tpu``. attnjax's own kernels are
taken for a device nobody checked them on only when the user opts in: these
tests do (``all_kernels``), except the one that checks the default. The model
is tiny (one layer, T=128, head dim 128) but keeps the presets' attention
options (bfloat16, auto dispatch, per-layer statistics in the step).
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

import attnjax
from attnjax._src.ops.dense import attention as dense
from attnjax.kernels import pallas_gpu
from attnjax._src.train.variants import COMPARE, attention_kwargs
from helpers import preset_train_step

MOSAIC_TARGET = "tpu_custom_call"  # splash and the Pallas TPU kernel
# jax 0.12 deprecates the Pallas Triton backend: lowering a Triton kernel warns (a
# DeprecationWarning raised in jax's lowering rule, jax/_src/pallas/triton/
# pallas_call_registration.py). jax has no non-deprecated way to lower a Pallas kernel through
# Triton (it points to the Mosaic GPU backend or to Triton kernels through jax_triton), so the
# tests that lower the Triton kernel on purpose expect the warning; no other test may raise it.
lowers_triton = pytest.mark.filterwarnings(
  "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"
)


def dense_kernel(variant: str) -> bool:
  """The variant's attention is a dense kernel call (every family but linear attention and
  NSA / DSA, whose block-wise engines gather their keys)."""
  return attention_kwargs(variant).get("family") not in ("linear", "nsa", "dsa")


def softmax(variant: str) -> bool:
  return (
    dense_kernel(variant) and attention_kwargs(variant).get("normalizer", "softmax") == "softmax"
  )


def call_targets(text: str) -> set[str]:
  return set(re.findall(r"custom_call @([^\s(]+)\(", text))


def export_step(preset: str, variant: str, platform: str, *, stats: bool = True) -> str:
  """The MLIR text of ``preset``'s training step (fwd + bwd + update) exported for ``platform``."""
  step, state, rest = preset_train_step(
    preset, variant, d_model=256, num_heads=2, seq_len=128, batch_size=2, stats=stats
  )
  tokens = jnp.zeros((2, 128), jnp.int32)
  exp = export.export(
    jax.jit(step),
    platforms=[platform],
    disabled_checks=[export.DisabledSafetyCheck.custom_call(pallas_gpu.TRITON_CALL_TARGET)],
  )(state, rest, tokens, tokens)
  assert exp.platforms == (platform,)
  return exp.mlir_module()


def _export_cases(default: tuple[str, ...]) -> list:
  """The compare variants, those not in ``default`` marked ``slow`` (an export compiles the
  preset's whole step: a few seconds each)."""
  return [pytest.param(v, marks=() if v in default else pytest.mark.slow) for v in COMPARE]


@lowers_triton
@pytest.mark.usefixtures("all_kernels")
@pytest.mark.parametrize("variant", _export_cases(("qk_layernorm", "nsa")))
def test_gpu_preset_step_exports_for_cuda(variant):
  text = export_step("gpu", variant, "cuda")
  targets = call_targets(text)
  # Every dense-kernel variant (softmax, its gated / sink / QK-norm / cosine forms, sigmoid)
  # runs the Pallas kernel: per-layer statistics rule cuDNN out, and a CPU host cannot trace
  # jax's cuDNN call anyway.
  assert (pallas_gpu.TRITON_CALL_TARGET in targets) == dense_kernel(variant), (variant, targets)
  if dense_kernel(variant):  # forward, dq and dk/dv: the step's backward runs the kernels too
    assert text.count("@" + pallas_gpu.TRITON_CALL_TARGET) >= 3
  assert MOSAIC_TARGET not in targets


@pytest.mark.usefixtures("all_kernels")
@pytest.mark.parametrize("variant", _export_cases(("dense", "dsa")))
def test_tpu_preset_step_exports_for_tpu(variant):
  # Without per-layer statistics: splash for the softmax variants (sinks where this jax's splash
  # takes them), our Pallas TPU kernel for the other dense-kernel variants (sigmoid, ...).
  targets = call_targets(export_step("tpu", variant, "tpu", stats=False))
  assert (MOSAIC_TARGET in targets) == dense_kernel(variant), (variant, targets)
  assert pallas_gpu.TRITON_CALL_TARGET not in targets


@pytest.mark.usefixtures("all_kernels")
def test_tpu_step_with_statistics_exports_through_the_pallas_tpu_kernel():
  # Statistics rule splash out; the Pallas TPU kernel computes them in the same pass: the count
  # pass, the forward, dq and dk/dv kernels, all Mosaic custom calls (no block-wise loop).
  text = export_step("tpu", "dense", "tpu", stats=True)
  assert text.count("@" + MOSAIC_TARGET) >= 4, call_targets(text)
  assert "attnjax_tpu_fwd_softmax" in text and "attnjax_tpu_dkdv_softmax" in text


@lowers_triton
def test_platform_kernels_refuse_to_lower_for_the_cpu():
  q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
  for name in ("pallas_gpu", "splash", "pallas_tpu"):
    fn = jax.jit(lambda q, name=name: dense.run(*dense.prepare(q, q, q), name))
    with pytest.raises(ValueError, match=rf"implementation='{name}' runs on .* lowered for 'cpu'"):
      fn(q)
    exported = export.export(
      fn,
      platforms=["cuda" if name == "pallas_gpu" else "tpu"],
      disabled_checks=[export.DisabledSafetyCheck.custom_call(pallas_gpu.TRITON_CALL_TARGET)],
    )(q)
    assert call_targets(exported.mlir_module())


def test_by_default_an_export_for_an_unknown_device_holds_no_unchecked_kernel(monkeypatch):
  # Exporting from a CPU host, no device of the target is known, so no check of attnjax's
  # kernels can have passed for it: without opting in, the sigmoid step's attention is the
  # block-wise engine (no Pallas call), while splash, which jax vouches for, stays.
  monkeypatch.setattr(attnjax.config, "auto_kernels", "checked")  # the default, whatever ran before
  assert call_targets(export_step("tpu", "sigmoid", "tpu", stats=False)) == set()
  assert MOSAIC_TARGET in call_targets(export_step("tpu", "dense", "tpu", stats=False))
