"""Compiles (not only lowers) the kernels and the presets' training steps for real targets.

Deviceless ahead-of-time compiles from this CPU host (:mod:`attnjax.targets`):
an A100, H100 and H200 through jax's CUDA plugin (Triton kernels through
ptxas, cuDNN's call), TPU v5e / v6e slices through libtpu (Mosaic kernels).
Lowering validates nothing about a kernel (an oversized tile lowers fine);
these compiles catch what a user's run on the device would hit first.

Every test traces with ``jax.ShapeDtypeStruct`` inputs sharded on a mesh of
the target's devices, under ``jax.set_mesh`` (as the train loop runs), so
auto-dispatch sees the target's platform, device kind and mesh. The default
run compiles a representative subset; ``-m slow`` the cross products. The
module skips, naming the missing extra, where ``attnjax[aot]`` is not
installed; ``.ci/run`` installs it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import attnjax
from attnjax._src import target as _target, trust as _trust, check, normalizers, targets
from attnjax._src.ops.dense import attention as dense
from attnjax.kernels import blockwise, mosaic_gpu, pallas_gpu, pallas_tpu
from attnjax._src.kernels.pallas_tpu import kernel as pallas_tpu_kernel
from helpers import preset_train_step

needs_cuda = pytest.mark.targets("cuda")
needs_tpu = pytest.mark.targets("tpu")

# jax 0.12 deprecates the Pallas Triton backend (the replacement is a Mosaic GPU kernel): every
# compile of our Triton kernels warns; this module compiles them on purpose (see test_export).
pytestmark = [
  pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
  # Auto-dispatch takes our kernels for these targets: no check can have run on them here.
  pytest.mark.usefixtures("all_kernels"),
]

TRITON = pallas_gpu.TRITON_CALL_TARGET
MOSAIC_GPU = mosaic_gpu.MOSAIC_GPU_CALL_TARGET
CUDNN_PREFIX = "__cudnn$fmha"
MOSAIC = "tpu_custom_call"


@pytest.fixture(autouse=True, scope="module")
def compile_settings(target_compiles):
  """Every test here compiles for a real target (conftest's ``target_compiles``)."""


def call_targets(compiled) -> set[str]:
  """The custom-call targets of a compiled program (its optimised HLO)."""
  return set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text()))


def abstract(tree, sharding):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def compile_on(mesh, fn, *args):
  """``jax.jit(fn)`` compiled for ``mesh``'s devices with ``args`` (ShapeDtypeStructs)."""
  with jax.set_mesh(mesh):
    return jax.jit(fn).lower(*args).compile()


# ---------------------------------------------------------------------------
# GPU kernels: pallas_gpu (every normaliser), cuDNN.

STRUCTURES = {
  "causal": dict(is_causal=True),
  "window": dict(window=(96, 0)),
  "segments": dict(is_causal=True, segments=True),
  "bidirectional": dict(),
}


def kernel_loss(impl: str, normalizer: str, structure: str, stats: bool):
  """A scalar of one dense call's output (and logsumexp statistic) for fwd + bwd compiles."""
  kw = dict(STRUCTURES[structure])
  segments = kw.pop("segments", False)

  def loss(q, k, v, sink, seg):
    extra = dict(kw, normalizer=normalizer, return_stats=stats, implementation=impl)
    if sink is not None:
      extra.update(sink_logits=sink, softcap=30.0)
    res = dense.dot_product_attention(q, k, v, segment_ids=seg if segments else None, **extra)
    out, st = res if stats else (res, None)
    total = jnp.sum(out.astype(jnp.float32) ** 2)
    return total + (jnp.sum(st.logsumexp) if stats else 0.0)

  return loss


def target_devices(target: str, count: int = 1) -> tuple:
  """``count`` compile-only devices of a GPU (``"h200"``, ...) or a TPU (``"v5e"``, ``"v6e"``)."""
  if target in targets.TPU_TARGETS:
    return targets.tpu_devices(target, "2x2")[:count]
  return targets.gpu_devices(target, count)


def compile_kernel(
  target: str,
  impl: str,
  normalizer: str,
  structure: str,
  heads: str,
  dtype,
  head_dim: int,
  *,
  T: int = 384,
  stats: bool = True,
  B: int = 2,
  sink_logits: bool = True,
):
  """Compiles ``value_and_grad`` (q, k, v, sink logits) of one call for ``target``."""
  mesh = targets.mesh(target_devices(target))
  rep = NamedSharding(mesh, P())
  N, K = (4, 4) if heads == "MHA" else (4, 2)
  q = jax.ShapeDtypeStruct((B, T, N, head_dim), dtype, sharding=rep)
  kv = jax.ShapeDtypeStruct((B, T, K, head_dim), dtype, sharding=rep)
  sink = None
  if sink_logits and normalizers.REGISTRY[normalizer].accepts_sink_logits:
    sink = jax.ShapeDtypeStruct((N,), jnp.float32, sharding=rep)
  seg = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=rep)
  fn = jax.value_and_grad(
    kernel_loss(impl, normalizer, structure, stats),
    argnums=(0, 1, 2) if sink is None else (0, 1, 2, 3),
  )
  return compile_on(mesh, fn, q, kv, kv, sink, seg)


def assert_pallas_gpu(compiled):
  text = compiled.as_text()
  # forward, dq and dk/dv kernels all compiled (each a Triton custom call in the program)
  assert text.count(f'custom_call_target="{TRITON}"') >= 3, call_targets(compiled)


NORMS = normalizers.NORMALIZERS
# The default subset: every normaliser once, every structure, MHA and GQA, both dtypes, the three
# head dims and the three GPUs appear (the presets' steps below add every normaliser again).
KERNEL_CASES = [
  ("h200", "softmax", "causal", "GQA", jnp.bfloat16, 128),
  ("h200", "sigmoid", "segments", "GQA", jnp.bfloat16, 256),
  ("h200", "softpick", "bidirectional", "MHA", jnp.float32, 64),
  ("h200", "relu", "window", "MHA", jnp.bfloat16, 64),
  ("h100", "softmax_one", "window", "GQA", jnp.bfloat16, 256),
  ("a100", "none", "causal", "GQA", jnp.bfloat16, 256),
]
SLOW_KERNEL_CASES = [
  c
  for c in itertools.product(
    ("h200", "a100"), NORMS, STRUCTURES, ("MHA", "GQA"), (jnp.bfloat16, jnp.float32), (64, 128, 256)
  )
  if c not in KERNEL_CASES
]


def kernel_id(case) -> str:
  target, norm, structure, heads, dtype, H = case
  return f"{target}-{norm}-{structure}-{heads}-{jnp.dtype(dtype).name}-H{H}"


@needs_cuda
@pytest.mark.parametrize("case", KERNEL_CASES, ids=kernel_id)
def test_pallas_gpu_compiles(case):
  assert_pallas_gpu(compile_kernel(case[0], "pallas_gpu", *case[1:]))


@needs_cuda
@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_KERNEL_CASES, ids=kernel_id)
def test_pallas_gpu_compiles_cross_product(case):
  assert_pallas_gpu(compile_kernel(case[0], "pallas_gpu", *case[1:]))


# ---------------------------------------------------------------------------
# The Pallas TPU kernel: every normaliser forward + backward on v5e and v6e.

# The default subset: every structure, head dim, dtype and both chips once (the presets' steps
# below compile every normaliser's kernel on v5e by default); T=1200 is ragged against every
# block size of the table (the fwd, count, dq and dk/dv kernels at the table's real tiles,
# several blocks per row).
TPU_KERNEL_CASES = [
  ("v5e", "softmax", "causal", "GQA", jnp.bfloat16, 128),
  ("v6e", "sigmoid", "segments", "GQA", jnp.bfloat16, 128),
  ("v5e", "softpick", "window", "MHA", jnp.float32, 64),
  ("v6e", "relu", "bidirectional", "GQA", jnp.bfloat16, 256),
]
SLOW_TPU_KERNEL_CASES = [
  c
  for c in itertools.product(
    ("v5e", "v6e"), NORMS, STRUCTURES, ("MHA", "GQA"), (jnp.bfloat16, jnp.float32), (64, 128, 256)
  )
  if c not in TPU_KERNEL_CASES
]


def assert_pallas_tpu(compiled, normalizer: str):
  text = compiled.as_text()
  # forward, dq and dk/dv kernels (and the count pass: statistics are asked for) compiled
  for kernel in ("counts", f"fwd_{normalizer}", f"dq_{normalizer}", f"dkdv_{normalizer}"):
    assert f"attnjax_tpu_{kernel}" in text, (kernel, call_targets(compiled))
  assert TRITON not in call_targets(compiled)


@needs_tpu
@pytest.mark.parametrize("case", TPU_KERNEL_CASES, ids=kernel_id)
def test_pallas_tpu_compiles(case):
  assert_pallas_tpu(compile_kernel(case[0], "pallas_tpu", *case[1:], T=1200), case[1])


@needs_tpu
@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_TPU_KERNEL_CASES, ids=kernel_id)
def test_pallas_tpu_compiles_cross_product(case):
  assert_pallas_tpu(compile_kernel(case[0], "pallas_tpu", *case[1:], T=1200), case[1])


@needs_cuda
@needs_tpu
def test_clipped_softmax_kernels_compile_with_their_row_passes():
  # clipped softmax (needs_lse, its row term from the tiles): the Triton kernels (the pre-pass
  # inside the forward and dq kernels) for an H100, and the Pallas TPU kernels with their two
  # pass kernels for a v5e, forward and backward, several blocks per row.
  case = ("h100", "clipped_softmax", "causal", "GQA", jnp.bfloat16, 128)
  assert_pallas_gpu(compile_kernel(case[0], "pallas_gpu", *case[1:]))
  compiled = compile_kernel(
    "v5e", "pallas_tpu", "clipped_softmax", "window", "MHA", jnp.float32, 64, T=1200
  )
  assert_pallas_tpu(compiled, "clipped_softmax")
  for kernel in ("softmax_terms", "row_dot_clipped_softmax"):
    assert f"attnjax_tpu_{kernel}" in compiled.as_text(), kernel


@needs_tpu
def test_pallas_tpu_block_sizes_by_generation_and_an_oversized_one_fails():
  # The v6e rows take longer key tiles (its MXU is 256 wide); the ambient mesh picks the row.
  seen = {}
  for gen in ("v5e", "v6e"):
    with jax.set_mesh(targets.mesh(target_devices(gen))):
      seen[gen] = pallas_tpu.block_sizes_for(128, pallas_tpu_kernel.generation())
  assert seen == {
    "v5e": pallas_tpu.block_sizes_for(128, "v5e"),
    "v6e": pallas_tpu.block_sizes_for(128, "v6e"),
  }
  assert seen["v6e"].block_k > seen["v5e"].block_k
  # What the compile checks: 1024 x 1024 float32 tiles at head dim 256 overflow v5e's VMEM
  # (one block per call: 2048-tiles fail the same way after a 5x longer compile).
  mesh = targets.mesh(target_devices("v5e"))
  q = jax.ShapeDtypeStruct((1, 1024, 2, 256), jnp.float32, sharding=NamedSharding(mesh, P()))

  def fn(q):
    return pallas_tpu.compute(
      *dense.prepare(q, q, q, is_causal=True),
      block_sizes=pallas_tpu.BlockSizes(1024, 1024, 1024, 1024),
    )

  with jax.set_mesh(mesh):
    lowered = jax.jit(fn).lower(q)
    with pytest.raises(Exception, match="[Vv]mem"):
      lowered.compile()


@needs_cuda
def test_block_sizes_are_chosen_for_the_target():
  # The sm_90 and sm_80 rows differ where shared memory does (head dim 256, bf16); the kind of
  # the ambient mesh's devices picks the row while tracing.
  seen = {}
  for target in ("h200", "a100"):
    mesh = targets.mesh(targets.gpu_devices(target, 1))
    with jax.set_mesh(mesh):
      seen[target] = pallas_gpu.block_sizes_for(256, jnp.bfloat16, _target.cuda_major())
  assert seen["h200"] == pallas_gpu.block_sizes_for(256, jnp.bfloat16, 9)
  assert seen["a100"] == pallas_gpu.block_sizes_for(256, jnp.bfloat16, 8)
  assert seen["h200"].block_q > seen["a100"].block_q
  with pytest.raises(ValueError, match="head dim 512"):
    pallas_gpu.block_sizes_for(512, jnp.bfloat16, 9)


@needs_cuda
def test_an_oversized_kernel_configuration_fails_to_compile():
  # What these checks exist for: the sm_90 tiles for head dim 128 at head dim 256 overflow an
  # H200's 227 KiB of shared memory, which only the compile (not lowering) reports.
  mesh = targets.mesh(targets.gpu_devices("h200", 1))
  q = jax.ShapeDtypeStruct((1, 256, 2, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

  def fn(q):
    return pallas_gpu.compute(
      *dense.prepare(q, q, q, is_causal=True), block_sizes=pallas_gpu.DEFAULT_BLOCK_SIZES
    )

  with jax.set_mesh(mesh):
    lowered = jax.jit(fn).lower(q)
    with pytest.raises(Exception, match="[Ss]hared memory"):
      lowered.compile()


@needs_cuda
@pytest.mark.skipif(
  _target.cudnn_version() is None,
  reason="jax's cuDNN wrapper needs the cuDNN library on the tracing host",
)
def test_cudnn_compiles_and_auto_dispatch_takes_it():
  compiled = compile_kernel(
    "h200",
    "cudnn",
    "softmax",
    "causal",
    "GQA",
    jnp.bfloat16,
    128,
    stats=False,
    T=512,
    sink_logits=False,
  )
  assert any(t.startswith(CUDNN_PREFIX) for t in call_targets(compiled)), call_targets(compiled)
  # implementation=None: a bf16 softmax call without statistics is cuDNN's on a GPU target
  compiled = compile_kernel(
    "h200",
    None,
    "softmax",
    "window",
    "MHA",
    jnp.bfloat16,
    64,
    stats=False,
    T=512,
    sink_logits=False,
  )
  assert any(t.startswith(CUDNN_PREFIX) for t in call_targets(compiled)), call_targets(compiled)


# ---------------------------------------------------------------------------
# The shapes of python -m attnjax.check (attnjax/_src/check.py).


def speed_cases():
  sizes = check.SPEED_SIZES
  cases = []
  for impl in ("pallas_gpu", "cudnn"):
    for i, (H, T) in enumerate(sizes):
      # cuDNN's compiles take a second; the Triton kernels' ~10 s: one per head dim by default
      slow = impl == "pallas_gpu" and (H, T) not in ((64, 16384), (128, 4096))
      cases.append(
        pytest.param(impl, H, T, marks=[pytest.mark.slow] if slow else [], id=f"{impl}-H{H}-T{T}")
      )
  return cases


@needs_cuda
@pytest.mark.parametrize("impl,H,T", speed_cases())
def test_device_check_speed_shapes_compile(impl, H, T):
  if impl == "cudnn" and _target.cudnn_version() is None:
    pytest.skip("jax's cuDNN wrapper needs the cuDNN library on the tracing host")
  mesh = targets.mesh(targets.gpu_devices("h200", 1))
  B, T, N, H = check.speed_shape(H, T)
  x = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

  def loss(q, k, v):
    return jnp.sum(
      dense.dot_product_attention(q, k, v, is_causal=True, implementation=impl).astype(jnp.float32)
    )

  compiled = compile_on(mesh, jax.grad(loss, (0, 1, 2)), x, x, x)
  if impl == "pallas_gpu":
    assert_pallas_gpu(compiled)
  else:
    assert any(t.startswith(CUDNN_PREFIX) for t in call_targets(compiled))


@needs_cuda
def test_device_check_correctness_shape_compiles():
  B, T, N, K, H = check.CHECK_SHAPE
  assert (T, N, K, H) == (300, 8, 2, 64)  # GQA with a ragged T, as compiled below
  assert_pallas_gpu(
    compile_kernel("h200", "pallas_gpu", "softpick", "segments", "GQA", jnp.bfloat16, H, T=T, B=B)
  )


@needs_cuda
def test_device_check_case_program_compiles_for_an_h200():
  # python -m attnjax.check --kernel mosaic_gpu, section 2: one case's program (the kernel's
  # and the fp32 reference's values and gradients; segment ids and sink logits as arguments)
  # compiles for an H200 with the Mosaic GPU kernel in it. Measured here under a load of ~10
  # on 2 cores: 5 s to lower, 16 s to compile.
  mesh = targets.mesh(targets.gpu_devices("h200", 1))
  shape, window, args = check._case_args("mosaic_gpu", interpret=False)
  assert shape == (2, 300, 8, 2, 64)
  rep = NamedSharding(mesh, P())
  program = check.case_program(
    check._kernel_run("mosaic_gpu", False), "softpick", "segments", window
  )
  compiled = compile_on(mesh, program, *abstract(args["bfloat16"], rep))
  assert MOSAIC_GPU in call_targets(compiled)


@needs_tpu
@pytest.mark.parametrize(
  "H,T",
  [
    pytest.param(H, T, marks=[] if (H, T) == (128, 16384) else [pytest.mark.slow], id=f"H{H}-T{T}")
    for H, T in (
      (64, 1024),
      (64, 4096),
      (64, 16384),
      (128, 1024),
      (128, 4096),
      (128, 8192),
      (128, 16384),
    )
  ],
)
def test_device_check_tpu_shapes_compile(H, T):
  # python -m attnjax.check --platform tpu: pallas_tpu (every normaliser in -m slow: sigmoid
  # here) and splash at the speed table's shapes on one v5e chip, forward + backward.
  mesh = targets.mesh(target_devices("v5e"))
  B, T, N, H = check.speed_shape(H, T)
  x = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  for impl, normalizer in (("pallas_tpu", "sigmoid"), ("splash", "softmax")):

    def loss(q, k, v):
      return jnp.sum(
        dense.dot_product_attention(
          q, k, v, is_causal=True, normalizer=normalizer, implementation=impl
        ).astype(jnp.float32)
      )

    compiled = compile_on(mesh, jax.grad(loss, (0, 1, 2)), x, x, x)
    assert MOSAIC in call_targets(compiled)
    assert ("attnjax_tpu_dkdv_sigmoid" in compiled.as_text()) == (impl == "pallas_tpu")


# ---------------------------------------------------------------------------
# The presets' training steps.


def variants():
  from attnjax._src.train.variants import VARIANTS

  return tuple(VARIANTS)


def uses_dense_kernel(variant: str) -> bool:
  from attnjax._src.train.variants import attention_kwargs

  return attention_kwargs(variant).get("family", "dense") in ("dense", "qk_norm", "cosine")


def compile_train_step(preset: str, variant: str, devices) -> object:
  """The preset's real ``train_step`` (optimizer included) compiled data parallel on
  ``devices`` (batch sharded over all of them; parameters replicated, as the loop runs)."""
  # A small model with the preset's options (bfloat16, statistics as the preset sets them,
  # auto dispatch): one layer, head dim 64, T=256 (splash takes multiples of 128).
  B, T = 8, 256
  step, state, rest = preset_train_step(
    preset, variant, d_model=128, num_heads=2, seq_len=T, batch_size=B
  )
  mesh = targets.mesh(devices)
  rep, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  tokens = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=batch)
  return compile_on(mesh, step, abstract(state, rep), abstract(rest, rep), tokens, tokens)


def check_gpu_step(variant: str, compiled, gpu: str) -> None:
  from attnjax._src.train.variants import attention_kwargs

  text = compiled.as_text()
  # Statistics in every step rule cuDNN out: our kernel (fwd, dq, dk/dv) runs, the Mosaic GPU
  # kernel on a Hopper and the Triton kernel on an A100, except for ALiBi, whose bias neither
  # kernel takes (it trains on the block-wise loop).
  ours, other = (MOSAIC_GPU, TRITON) if gpu in ("h100", "h200") else (TRITON, MOSAIC_GPU)
  if uses_dense_kernel(variant) and not attention_kwargs(variant).get("alibi"):
    assert text.count(f'custom_call_target="{ours}"') >= 3, (variant, call_targets(compiled))
  found = call_targets(compiled)
  assert other not in found and MOSAIC not in found, (variant, found)


def splash_step(variant: str) -> bool:
  """The variant's TPU step runs splash: softmax (with or without sinks), no bias (ALiBi adds
  one); the tpu preset's step asks for no statistics."""
  from attnjax._src.train.variants import attention_kwargs

  kw = attention_kwargs(variant)
  return (
    uses_dense_kernel(variant)
    and kw.get("normalizer", "softmax") == "softmax"
    and not kw.get("alibi")
  )


def check_tpu_step(variant: str, compiled) -> None:
  found = call_targets(compiled)
  # Every dense-kernel variant runs a Mosaic kernel, forward and backward: splash where it
  # covers the call, the Pallas TPU kernel for the rest (ALiBi too: its score_mod reads its
  # slopes by head index, which the kernel evaluates from SMEM).
  ours = "attnjax_tpu_dkdv_" in compiled.as_text()
  if uses_dense_kernel(variant):
    assert MOSAIC in found, (variant, found)
    assert ours != splash_step(variant), (variant, ours)
  else:
    assert not ours, variant
  assert TRITON not in found


# Meshes: (devices, variants compiled by default, None: all; every variant in -m slow). By
# default one variant per path a step takes to the target compiles: on an H200 the Mosaic GPU
# kernel (dense; its other normalisers, windows and sinks are the kernel compiles of
# test_mosaic_gpu.py) and the dense loop without it (alibi); the Triton kernel data
# parallel on 4 A100s (sigmoid; data parallel on 8 H200s is another mesh of the same step).
# The recurrent families' XLA programs (linear, the gated delta rule with its short
# convolution; test_linear_attention_takes_the_targets_engine compiles linear attention for an
# H200 and a v5e by default), the QK-norm projections, gla, block_select, compressed and
# dilated sparse steps compile in -m slow. On
# TPUs: splash (dense, and sink logits data parallel on a 4-chip v5e; its QK-norm and window
# forms in -m slow) and the Pallas TPU kernel (ALiBi's score_mod with its slopes on the 4-chip
# v5e, a non-softmax normaliser on 8 chips: sigmoid; every normaliser's kernel is compiled
# above). The other families
# run no TPU kernel: their XLA programs are compiled for TPUs in -m slow, as is every other
# (mesh, variant) pair (same kernels, other options; tests/test_export.py exports the compared
# variants' steps for both platforms by default).
GPU_STEP_MESHES = {
  "1": (("h200", 1), ("dense", "alibi")),
  "a100-dp4": (("a100", 4), ("sigmoid",)),
  "dp8": (("h200", 8), ()),
}
DENSE_KERNEL_VARIANTS = (
  "dense",
  "qk_layernorm",
  "qk_rmsnorm",
  "cosine",
  "sigmoid",
  "softmax_one",
  "softpick",
  "relu",
  "clipped_softmax",
  "sink_logits",
  "gated",
  "window",
  "alibi",
)
TPU_STEP_MESHES = {
  "v5e-1": (("v5e", "2x2", 1), ("dense",)),
  "v5e-dp4": (("v5e", "2x2", 4), ("sink_logits", "alibi")),
  "v5e-dp8": (("v5e", "2x4", 8), ("sigmoid",)),
  "v6e-dp4": (("v6e", "2x2", 4), ("dense",)),
}


def step_cases(meshes):
  cases = []
  for mesh, (_, default) in meshes.items():
    for variant in variants():
      slow = default is not None and variant not in default
      cases.append(
        pytest.param(
          mesh, variant, marks=[pytest.mark.slow] if slow else [], id=f"{mesh}-{variant}"
        )
      )
  return cases


@needs_cuda
@pytest.mark.parametrize("mesh,variant", step_cases(GPU_STEP_MESHES))
def test_gpu_preset_train_step_compiles(mesh, variant):
  gpu, n = GPU_STEP_MESHES[mesh][0]
  check_gpu_step(variant, compile_train_step("gpu", variant, targets.gpu_devices(gpu, n)), gpu)


def test_dense_kernel_variants_are_listed():
  assert set(DENSE_KERNEL_VARIANTS) == {v for v in variants() if uses_dense_kernel(v)}


@needs_tpu
@pytest.mark.parametrize("mesh,variant", step_cases(TPU_STEP_MESHES))
def test_tpu_preset_train_step_compiles(mesh, variant):
  name, shape, n = TPU_STEP_MESHES[mesh][0]
  devices = targets.tpu_devices(name, shape)[:n]
  check_tpu_step(variant, compile_train_step("tpu", variant, devices))


@needs_tpu
@pytest.mark.parametrize(
  "normalizer",
  [pytest.param(n, marks=[] if n in ("softmax", "sigmoid") else [pytest.mark.slow]) for n in NORMS],
)
def test_tpu_kernels_compile_data_parallel(normalizer):
  # fwd + bwd of every normaliser on a 4-chip slice, batch sharded: splash inside shard_map for
  # softmax, the Pallas TPU kernel for the others (with statistics: for every normaliser).
  mesh = targets.mesh(targets.tpu_devices("v5e", "2x2"))
  batch = NamedSharding(mesh, P("data"))
  q = jax.ShapeDtypeStruct((8, 256, 4, 128), jnp.bfloat16, sharding=batch)

  def loss(q, k, v, stats):
    out = dense.dot_product_attention(
      q, k, v, is_causal=True, normalizer=normalizer, return_stats=stats
    )
    if stats:
      out, st = out
      return jnp.sum(out.astype(jnp.float32)) + jnp.sum(st.logsumexp)
    return jnp.sum(out.astype(jnp.float32))

  for stats in (False, True):
    compiled = compile_on(mesh, jax.grad(functools.partial(loss, stats=stats), (0, 1, 2)), q, q, q)
    assert MOSAIC in call_targets(compiled)
    ours = f"attnjax_tpu_dkdv_{normalizer}" in compiled.as_text()
    assert ours == (stats or normalizer != "softmax"), (normalizer, stats)
    assert "all-gather" not in compiled.as_text()


@needs_cuda
def test_auto_dispatch_takes_our_kernel_for_a_target_once_checked_on_its_kind(
  monkeypatch, tmp_path
):
  # The kernel-trust rule reads the device kind of the target being traced for (the ambient
  # mesh's): by default an A100 target gets the block-wise engine for a sigmoid call, and
  # pallas_gpu once `python -m attnjax.check` has passed on that kind of device.
  monkeypatch.setenv("ATTNJAX_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(attnjax.config, "auto_kernels", "checked")
  mesh = targets.mesh(targets.gpu_devices("a100", 1))
  x = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

  def lowered():
    fn = lambda q: dense.dot_product_attention(q, q, q, normalizer="sigmoid")  # a new trace
    with jax.set_mesh(mesh):
      return jax.jit(fn).lower(x).as_text()

  assert f"@{TRITON}" not in lowered()
  _trust.write_verdict(mesh.devices.flat[0].device_kind, {"pallas_gpu": {"passed": True}})
  assert f"@{TRITON}" in lowered()


@needs_cuda
def test_a_shipped_verdict_makes_mosaic_gpu_the_default_for_an_h200(monkeypatch, tmp_path, caplog):
  # With a verdict shipped for the H200 (here a TEST verdict written by the check's own writer
  # into a folder standing in for attnjax/verdicts/, never the package's), auto-dispatch takes
  # mosaic_gpu for a bf16 sigmoid causal call compiled deviceless for an H200: no setting, no
  # local cache. With the kernel's sources changed since (its digest), it falls back to the
  # block-wise engine and one log line says the verdict is stale and names the check to run.
  caplog.set_level(logging.WARNING, logger="attnjax")
  monkeypatch.setenv("ATTNJAX_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(_trust, "SHIPPED_DIR", tmp_path / "shipped")
  monkeypatch.setattr(_trust, "_logged", [])
  monkeypatch.setattr(attnjax.config, "auto_kernels", "checked")
  monkeypatch.delenv("ATTNJAX_AUTO_KERNELS", raising=False)
  monkeypatch.delenv("ATTNJAX_KERNELS", raising=False)
  mesh = targets.mesh(targets.gpu_devices("h200", 1))
  kind = mesh.devices.flat[0].device_kind
  x = jax.ShapeDtypeStruct((2, 512, 4, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

  def compiled():
    fn = lambda q: dense.dot_product_attention(q, q, q, normalizer="sigmoid", is_causal=True)
    return call_targets(compile_on(mesh, fn, x))

  _trust.write_verdict(
    kind,
    {
      "mosaic_gpu": {
        "passed": True,
        "checks": 1,
        "failed": [],
        "cases": {"sigmoid causal bfloat16": True},
        "interpret": False,
        "test": "TEST verdict, never shipped",
      }
    },
    shipped=True,
  )
  assert attnjax.config.auto_kernels == "checked" and not (tmp_path / "cache").exists()
  assert MOSAIC_GPU in compiled()
  assert not [r for r in caplog.records if r.name == "attnjax"]
  monkeypatch.setattr(_trust, "source_digest", lambda kernel: "edited" + kernel)
  jax.clear_caches()  # dispatch reads the verdicts when tracing (a new process would anyway)
  assert not {MOSAIC_GPU, TRITON} & compiled()  # the block-wise engine: XLA's own ops
  (line,) = [r.getMessage() for r in caplog.records if r.name == "attnjax"]
  assert f"mosaic_gpu is not used on {kind} for sigmoid causal bfloat16 calls: stale" in line
  assert "run `python -m attnjax.check --platform cuda --kernel mosaic_gpu`" in line
  assert "auto-dispatch runs 'blockwise' instead" in line


@needs_cuda
def test_gpu_kernel_inside_shard_map_over_batch_and_heads():
  # A ("data", "tensor") mesh of A100s: the Triton kernel runs per (batch rows, kv heads)
  # shard; nothing is gathered (no all-gather of q, k or v in the compiled program). (On
  # Hopper the same call takes mosaic_gpu: test_mosaic_gpu.py.)
  mesh = targets.mesh(targets.gpu_devices("a100", 8), ("data", "tensor"), (4, 2))
  spec = NamedSharding(mesh, P("data", None, "tensor", None))
  q = jax.ShapeDtypeStruct((8, 256, 4, 64), jnp.bfloat16, sharding=spec)
  kv = jax.ShapeDtypeStruct((8, 256, 2, 64), jnp.bfloat16, sharding=spec)

  def loss(q, k, v):
    out, st = dense.dot_product_attention(
      q, k, v, is_causal=True, normalizer="sigmoid", return_stats=True
    )
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(st.logsumexp)

  compiled = compile_on(mesh, jax.grad(loss, (0, 1, 2)), q, kv, kv)
  assert_pallas_gpu(compiled)
  assert "all-gather" not in compiled.as_text()


# Context parallelism on real targets: the preset's training step with the sequence sharded
# over a `context` axis (the layers' attention inside shard_map: the ring's collective-permutes
# over NVLink / ICI), compiled for 8 H200s (data=2 x context=4) and a 4-chip v5e (context=4).
CONTEXT_STEP_TARGETS = {
  "h200-data2-context4": ("gpu", lambda: targets.gpu_devices("h200", 8), (2, 4)),
  "v5e-context4": ("tpu", lambda: targets.tpu_devices("v5e", "2x2"), (1, 4)),
}


@pytest.mark.parametrize(
  "target,variant",
  [
    pytest.param(
      t,
      v,
      marks=[needs_cuda if t.startswith("h200") else needs_tpu]
      + ([] if v == "dense" else [pytest.mark.slow]),
    )
    for t in CONTEXT_STEP_TARGETS
    for v in ("dense", "sink_logits", "gla")
  ],
)
def test_context_parallel_train_step_compiles(target, variant):
  preset, devices, shape = CONTEXT_STEP_TARGETS[target]
  B, T = 4, 512
  step, state, rest = preset_train_step(
    preset, variant, d_model=128, num_heads=2, seq_len=T, batch_size=B
  )
  mesh = targets.mesh(devices(), ("data", "context"), shape)
  rep = NamedSharding(mesh, P())
  tokens = jax.ShapeDtypeStruct(
    (B, T), jnp.int32, sharding=NamedSharding(mesh, P("data", "context"))
  )
  args = (abstract(state, rep), abstract(rest, rep), tokens, tokens)
  with jax.set_mesh(mesh):
    jaxpr = str(jax.make_jaxpr(step)(*args))
  assert "shard_map" in jaxpr  # the layer's sequence-sharded call
  compiled = compile_on(mesh, step, *args)
  if uses_dense_kernel(variant):
    assert "collective-permute" in compiled.as_text()  # the ring, over the context axis


# ---------------------------------------------------------------------------
# The block-wise fallback on a GPU (where no kernel may run).


def blockwise_program(mesh, T: int, B: int = 1, N: int = 16, H: int = 128):
  """Forward + backward of causal bf16 block-wise attention, compiled for ``mesh``'s device."""
  x = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

  def loss(q, k, v):
    out = dense.dot_product_attention(q, k, v, is_causal=True, implementation="blockwise")
    return jnp.sum(out.astype(jnp.float32))

  return compile_on(mesh, jax.grad(loss, (0, 1, 2)), x, x, x)


@needs_cuda
def test_blockwise_gpu_tiles_are_large_and_memory_stays_linear():
  # Chosen from the target's memory: 2048 x 2048 on an H200 at 16 heads (the shape),
  # 128 x 128 before (8,256 visits: ~1 TFLOP/s). Speed is the device's to measure
  # (experiments/bench.py --suite gpu); the compile shows the tiles and the memory.
  mesh = targets.mesh(targets.gpu_devices("h200", 1))
  T = 16384
  with jax.set_mesh(mesh):
    assert blockwise.default_block_sizes(T, T, rows=16, is_causal=True) == (2048, 2048)
  compiled = blockwise_program(mesh, T)
  text = compiled.as_text()
  sizes = {
    shape: np.prod([int(d) for d in shape.split(",")])
    for shape in re.findall(r"f32\[([0-9,]+)\]", text)
  }
  assert max(sizes.values()) == 16 * 2048 * 2048, max(sizes, key=sizes.get)  # one score tile
  trips = [int(n) for n in re.findall(r'known_trip_count":\{"n":"(\d+)"', text)]
  assert trips and max(trips) <= T // 2048, trips  # the key-block loops of 8 query blocks
  # O(T) memory: the temporaries are the tile budget plus rows, far below the T x T scores,
  # and do not grow with T (a quadratic program would take 4x at 2T).
  scores = 16 * T * T * 4
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < scores / 4, (temp, scores)
  temp_2t = blockwise_program(mesh, 2 * T).memory_analysis().temp_size_in_bytes
  assert temp_2t < 2 * temp, (temp, temp_2t)


# ---------------------------------------------------------------------------
# Every family's auto-dispatch is decided when the program is lowered.


def _largest_f32(text: str) -> tuple[int, ...]:
  """The largest float32 array of a compiled program's HLO, by element count."""
  shapes = [tuple(int(d) for d in s.split(",")) for s in re.findall(r"f32\[([0-9,]+)\]", text)]
  return max(shapes, key=lambda s: int(np.prod(s)))


@needs_cuda
@needs_tpu
@pytest.mark.parametrize("target", ["v5e", "h200"])
def test_linear_attention_takes_the_targets_engine(target):
  """``linear_attention`` with no implementation carries a ``platform_dependent`` choice: a
  CPU runs a call of this length on the quadratic engine (its ``[T, T]`` weights), a GPU or a
  TPU on the chunked one (no ``[T, T]`` array), whichever host compiles it."""
  T, C = 128, 8
  fn = lambda q, k, v: attnjax.linear_attention(q, k, v, is_causal=True, chunk_size=C)
  x = jnp.zeros((1, T, 2, 16), jnp.float32)
  assert "branches_platforms" in str(jax.make_jaxpr(fn)(x, x, x))
  here = jax.jit(fn).lower(x, x, x).compile().as_text()
  assert _largest_f32(here)[-2:] == (T, T)  # the CPU's choice: quadratic
  mesh = targets.mesh(target_devices(target))
  arg = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))
  there = compile_on(mesh, fn, arg, arg, arg).as_text()
  assert _largest_f32(there)[-2:] != (T, T), _largest_f32(there)  # the target's: chunked
