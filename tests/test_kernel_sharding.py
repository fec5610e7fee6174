"""Platform kernels under every way a program shards them: plain ``jax.jit`` of arrays with a
``NamedSharding``, the legacy ``with mesh:`` context, and ``jax.set_mesh``.

XLA cannot partition a Mosaic (or Triton) custom call: each way must reach the fused kernel on
each device's batch rows and key/value heads (:func:`attnjax._sharding.per_shard` over the
mesh of the operands when no mesh is set), without gathering q, k or v, and with the kernel's
tiles and Mosaic's lowering chosen for the chip compiled for
(:mod:`attnjax.kernels.on_target`).

Values: the Pallas TPU kernel and splash in interpret mode on the suite's 8 CPU host devices,
against the reference (values, gradients, forward mode), with modifiers that read the batch and
head indices (each shard must see the whole call's). Targets (``-m targets``): deviceless compiles of
forward + backward for a 4-chip TPU v5e / v6e and 4 H200s, each program holding the kernel's
custom call and no all-gather; the normaliser x way x target product is ``slow``.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import NamedSharding, PartitionSpec as P

import attnjax
from attnjax._src import sharding as _sharding, mods, normalizers, targets
from attnjax._src.ops.dense import attention as dense
from attnjax._src.kernels import splash
from attnjax.kernels import mosaic_gpu, pallas_gpu, pallas_tpu
from attnjax._src.kernels.pallas_tpu import kernel as tpu_kernel
from helpers import assert_close, rand_qkv

# jax 0.12 deprecates the Pallas Triton backend: compiling our Triton kernel warns (as in
# tests/test_targets.py). Auto-dispatch takes the kernels unchecked here (all_kernels): these
# tests are about where they run, on a host where none was checked on a device.
pytestmark = [
  pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
  pytest.mark.usefixtures("all_kernels"),
]

MOSAIC = "tpu_custom_call"
WAYS = ("plain", "legacy", "set_mesh")
BLOCKS = pallas_tpu.BlockSizes(block_q=128, block_k=128, block_q_bwd=128, block_k_bwd=128)
AUTO = (jax.sharding.AxisType.Auto,) * 2  # interpret-mode Pallas refuses explicitly sharded refs


def under(way: str, mesh, fn, *args):
  """``fn(*args)`` jitted the way ``way`` names (the arrays already placed on ``mesh``)."""
  if way == "set_mesh":
    with jax.set_mesh(mesh):
      return fn(*args)
  if way == "legacy":
    with pytest.warns(DeprecationWarning, match="with mesh"):
      with mesh:
        return fn(*args)
  return fn(*args)


def alibi_per_row_and_head(z, b, n, i, j, slopes, offsets):
  """ALiBi plus a per-(batch row, head) bonus on key 0: reads ``b`` and ``n``."""
  return (
    z
    - slopes[n] * jnp.abs(i - j).astype(jnp.float32)
    + offsets[b, n] * (j == 0).astype(jnp.float32)
  )


def needs_devices(n: int):
  if len(jax.devices()) < n:
    pytest.skip(f"needs {n} devices (the suite's CPU backend has 8)")


# ---------------------------------------------------------------------------
# Values on the CPU host devices (Pallas interpret mode).


def modifier_case():
  """A call whose modifiers read the batch row and the head: a score_mod with per-(b, n)
  tables and a prefix-LM mask_mod whose prefix lengths differ per row, so that the key blocks
  the later rows need are ones the earlier rows skip (T = 256: 2 x 2 blocks of 128)."""
  q, k, v = rand_qkv(B=4, T=256, S=256, N=4, K=2, H=16)
  score_args = (
    jnp.asarray(mods.alibi_slopes(4)),
    jnp.asarray(np.random.default_rng(5).standard_normal((4, 4)), jnp.float32),
  )
  kw = dict(
    score_mod=alibi_per_row_and_head,
    mask_mod=mods.prefix_lm_mask,
    mask_mod_args=(jnp.asarray([10, 30, 200, 250], jnp.int32),),
    return_stats=True,
  )
  return (q, k, v, score_args), kw


def modifier_loss(attention, kw):
  cot = jax.random.normal(jax.random.key(1), (4, 256, 4, 16), jnp.float32)

  def loss(q, k, v, score_args):
    out, st = attention(q, k, v, score_mod_args=score_args, **kw)
    return jnp.sum(out * cot) + jnp.sum(jnp.sin(st.logsumexp)), out

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


@pytest.mark.parametrize(
  "way", [pytest.param(w, marks=[] if w == "plain" else [pytest.mark.slow]) for w in WAYS]
)
def test_pallas_tpu_per_shard_sees_the_whole_calls_rows_and_heads(way):
  # Batch over "data", key/value heads over "tensor": values, statistics and gradients (q, k,
  # v and the score_mod tables) equal the unsharded reference, also in the backward (which is
  # traced when lowered) and in the blocks a mask_mod with per-row arguments skips.
  needs_devices(4)
  (q, k, v, score_args), kw = modifier_case()
  want = modifier_loss(
    functools.partial(attnjax.dot_product_attention, implementation="reference"), kw
  )(q, k, v, score_args)
  mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=AUTO)
  spec = NamedSharding(mesh, P("data", None, "tensor"))
  q, k, v = (jax.device_put(x, spec) for x in (q, k, v))
  kernel = functools.partial(pallas_tpu.attention, interpret=True, block_sizes=BLOCKS)
  got = under(way, mesh, modifier_loss(kernel, kw), q, k, v, score_args)
  assert_close(got, want, "sharded", rtol=0, atol=2e-5, scaled=True)  # of each scale
  assert got[0][1].sharding.spec == spec.spec  # the output stays where the rows and heads are


@pytest.mark.parametrize("order", ["jvp", pytest.param("hvp", marks=pytest.mark.slow)])
def test_pallas_tpu_forward_mode_per_shard_sees_the_whole_calls_rows_and_heads(order):
  # Forward mode takes its tangent from the kernel's twin (the block-wise engine on the same
  # shard): its modifiers must read the whole call's batch rows and heads too (they read the
  # shard's before: tangents off by 95% of their scale). The tangents of the output and of
  # the statistics; a Hessian-vector product (forward over reverse: the twin's VJP).
  needs_devices(4)
  (q, k, v, score_args), kw = modifier_case()
  rng = np.random.default_rng(3)
  tangents = jax.tree.map(
    lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), (q, k, v, score_args)
  )

  def forward_mode(attention):
    def f(q, k, v, score_args):
      out, st = attention(q, k, v, score_mod_args=score_args, **kw)
      return out, st.logsumexp

    if order == "hvp":
      grad = modifier_loss(attention, kw)
      f = lambda *a: grad(*a)[1]
    return jax.jit(lambda *a: jax.jvp(f, a, tangents))

  reference = functools.partial(attnjax.dot_product_attention, implementation="reference")
  want = forward_mode(reference)(q, k, v, score_args)
  mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=AUTO)
  spec = NamedSharding(mesh, P("data", None, "tensor"))
  placed = [jax.device_put(x, spec) for x in (q, k, v)]
  kernel = functools.partial(pallas_tpu.attention, interpret=True, block_sizes=BLOCKS)
  assert_close(
    forward_mode(kernel)(*placed, score_args), want, "forward mode", rtol=0, atol=1e-4, scaled=True
  )  # of each scale


@pytest.mark.slow
@pytest.mark.parametrize("way", WAYS)
def test_splash_per_shard_matches_the_reference(way):
  needs_devices(4)
  q, k, v = rand_qkv(B=4, T=256, S=256, N=4, K=2, H=16)
  sink = jnp.linspace(-1.0, 1.0, 4)
  mesh = jax.make_mesh((4,), ("data",), axis_types=AUTO[:1])

  def loss(attention, q, k, v, sink):
    out = attention(q, k, v, is_causal=True, sink_logits=sink, softcap=20.0)
    return jnp.sum(jnp.sin(out))

  reference = functools.partial(attnjax.dot_product_attention, implementation="reference")
  grads = lambda attention: jax.jit(
    jax.value_and_grad(functools.partial(loss, attention), argnums=(0, 1, 2, 3))
  )
  want = grads(reference)(q, k, v, sink)
  if not splash.unsupported(*dense.prepare(q, k, v, is_causal=True, sink_logits=sink)):
    placed = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, k, v)]
    got = under(
      way, mesh, grads(functools.partial(splash.attention, interpret=True)), *placed, sink
    )
  else:  # a jax whose splash kernel takes no sinks
    pytest.skip("this jax's splash kernel has no sinks")
  assert_close(got, want, "sharded", rtol=0, atol=2e-5, scaled=True)  # of each scale


def test_per_shard_takes_the_operands_mesh_and_nothing_else():
  # Without jax.set_mesh the operands' types carry their mesh; one device, or arrays not on a
  # mesh, run the kernel as is.
  needs_devices(4)
  mesh = jax.make_mesh((4,), ("data",), axis_types=AUTO[:1])
  q = jax.device_put(jnp.ones((4, 8, 2, 16)), NamedSharding(mesh, P("data")))
  seen = {}

  def record(inputs, offsets):
    seen["mesh"] = jax.sharding.get_abstract_mesh()
    seen["shape"] = inputs.q.shape
    return inputs.q

  def fn(q):
    return _sharding.per_shard(record, dense.prepare(q, q, q)[0])

  jax.jit(fn)(q)
  assert seen["mesh"].axis_names == ("data",) and seen["shape"] == (1, 8, 2, 16)
  assert _sharding.operand_mesh(dense.prepare(q, q, q)[0]).axis_names == ("data",)
  jax.jit(fn)(jnp.ones((4, 8, 2, 16)))
  assert seen["mesh"].empty and seen["shape"] == (4, 8, 2, 16)


# ---------------------------------------------------------------------------
# Deviceless compiles for real targets.


def call_targets(text: str) -> set[str]:
  return set(re.findall(r'custom_call_target="([^"]+)"', text))


def gathers(text: str) -> list[str]:
  """The all-gather instructions of a compiled program (none may gather q, k or v: attention
  alone has nothing else to gather)."""
  return [
    line.strip()[:160] for line in text.splitlines() if re.search(r"\sall-gather(-start)?\(", line)
  ]


def target_mesh(target: str, heads: bool):
  """4 compile-only devices of ``target`` as ``("data",)``, or ``("data", "tensor")`` 2 x 2."""
  devices = (
    targets.gpu_devices("h200", 4) if target == "h200" else targets.tpu_devices(target, "2x2")
  )
  if heads:
    return targets.mesh(devices, ("data", "tensor"), (2, 2))
  return targets.mesh(devices, ("data",))


def compile_step(
  target: str,
  normalizer: str,
  way: str,
  *,
  heads: bool = False,
  stats: bool = False,
  sinks: bool = False,
):
  """Compiled ``grad`` (q, k, v) of a causal bf16 call, batch-sharded (and kv-head-sharded
  with ``heads``), for 4 devices of ``target``: the program's text."""
  mesh = target_mesh(target, heads)
  spec = NamedSharding(mesh, P("data", None, "tensor") if heads else P("data"))
  q = jax.ShapeDtypeStruct((8, 512, 4, 128), jnp.bfloat16, sharding=spec)
  kv = jax.ShapeDtypeStruct((8, 512, 2, 128), jnp.bfloat16, sharding=spec)
  extra = dict(sink_logits=jnp.linspace(-1.0, 1.0, 4)) if sinks else {}

  def loss(q, k, v):
    out = dense.dot_product_attention(
      q, k, v, is_causal=True, normalizer=normalizer, return_stats=stats, **extra
    )
    if stats:
      out, st = out
      return jnp.sum(out.astype(jnp.float32)) + jnp.sum(st.logsumexp)
    return jnp.sum(out.astype(jnp.float32))

  fn = jax.jit(jax.grad(loss, (0, 1, 2)))
  if way == "set_mesh":
    with jax.set_mesh(mesh):
      return fn.lower(q, kv, kv).compile().as_text()
  if way == "legacy":
    with pytest.warns(DeprecationWarning, match="with mesh"):
      with mesh:
        return fn.lower(q, kv, kv).compile().as_text()
  return fn.lower(q, kv, kv).compile().as_text()


def check_tpu(text: str, normalizer: str, stats: bool = False):
  assert MOSAIC in call_targets(text), call_targets(text)
  if normalizer != "softmax" or stats:  # ours: its forward and backward kernels by name
    for kernel in (f"fwd_{normalizer}", f"dq_{normalizer}", f"dkdv_{normalizer}"):
      assert f"attnjax_tpu_{kernel}" in text, kernel
  else:  # splash: its forward and its fused backward
    assert len(re.findall(r'custom_call_target="tpu_custom_call"', text)) >= 2
  assert not gathers(text), gathers(text)


# The default run: one compile per way and target generation, softmax (splash) and ours, a
# head-sharded one; the product is slow.
TPU_CASES = [
  ("v5e", "softmax", "plain", False),
  ("v5e", "softpick", "plain", False),
  ("v5e", "sigmoid", "legacy", False),
  ("v6e", "relu", "plain", True),
  ("v6e", "softmax", "set_mesh", True),
]
SLOW_TPU_CASES = [
  (t, n, w, h)
  for t in ("v5e", "v6e")
  for n in normalizers.NORMALIZERS
  for w in WAYS
  for h in (False, True)
  if (t, n, w, h) not in TPU_CASES
]


def case_id(case) -> str:
  return "-".join(str(c) if not isinstance(c, bool) else ("heads" if c else "batch") for c in case)


@pytest.mark.targets("tpu")
@pytest.mark.parametrize("case", TPU_CASES, ids=case_id)
def test_tpu_kernels_compile_under_every_way_of_sharding(case, target_compiles):
  target, normalizer, way, heads = case
  check_tpu(compile_step(target, normalizer, way, heads=heads), normalizer)


@pytest.mark.targets("tpu")
@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_TPU_CASES, ids=case_id)
def test_tpu_kernels_compile_under_every_way_of_sharding_everywhere(case, target_compiles):
  target, normalizer, way, heads = case
  check_tpu(compile_step(target, normalizer, way, heads=heads), normalizer)


@pytest.mark.targets("tpu")
def test_pallas_tpu_is_lowered_for_the_chip_compiled_for(target_compiles, monkeypatch):
  # One chip, no mesh anywhere: the tiles are the target's rows (v6e takes longer key tiles)
  # and Mosaic lowers for that chip (softpick's kernels hold a sign, which Mosaic lowers per
  # generation: for this host's CPU it raised "Unsupported TPU device kind").
  seen = []
  original = tpu_kernel.block_sizes_for
  monkeypatch.setattr(tpu_kernel, "block_sizes_for", lambda *a: seen.append(a[1]) or original(*a))
  for gen, other in (("v5e", "v6e"), ("v6e", "v5e")):
    device = targets.tpu_devices(gen, "2x2")[0]
    q = jax.ShapeDtypeStruct(
      (2, 512, 4, 128), jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(device)
    )
    loss = lambda q: jnp.sum(
      dense.dot_product_attention(q, q, q, is_causal=True, normalizer="softpick").astype(
        jnp.float32
      )
    )
    seen.clear()
    text = jax.jit(jax.grad(loss)).lower(q).compile().as_text()
    assert "attnjax_tpu_dkdv_softpick" in text
    # Lowered for the chip (the trace for the result types alone knows no chip: None).
    assert gen in seen and other not in seen, (gen, seen)


def test_pallas_tpu_exports_for_tpu_from_this_host():
  # No TPU and no mesh: the kernels lower for a v5e (before, Mosaic lowered for this host's
  # CPU: "Unsupported TPU device kind: cpu" for softpick's sign).
  q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
  loss = lambda q: jnp.sum(
    dense.dot_product_attention(q, q, q, is_causal=True, normalizer="softpick").astype(jnp.float32)
  )
  text = export.export(jax.jit(jax.grad(loss)), platforms=["tpu"])(q).mlir_module()
  assert "attnjax_tpu_dkdv_softpick" in text and "@tpu_custom_call" in text


@pytest.mark.targets("tpu")
def test_a_sharded_call_exports_for_a_tpu_slice(target_compiles):
  # jax.export of a program sharded on 4 v6e chips, without jax.set_mesh: each kernel inside
  # shard_map over the operands' mesh (nothing for XLA to partition).
  mesh = target_mesh("v6e", heads=True)
  q = jax.ShapeDtypeStruct(
    (8, 256, 4, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", None, "tensor"))
  )
  for normalizer in ("softmax", "softpick"):
    loss = lambda q: jnp.sum(
      dense.dot_product_attention(q, q, q, is_causal=True, normalizer=normalizer).astype(
        jnp.float32
      )
    )
    exported = export.export(jax.jit(jax.grad(loss)), platforms=["tpu"])(q)
    assert exported.nr_devices == 4 and "@tpu_custom_call" in exported.mlir_module()


@pytest.mark.targets("cuda")
@pytest.mark.parametrize(
  "way", [pytest.param(w, marks=[] if w == "plain" else [pytest.mark.slow]) for w in WAYS]
)
def test_gpu_kernels_compile_per_shard_on_four_h200s(way, target_compiles):
  # The H200 x 4 twin: sigmoid (ours: mosaic_gpu or pallas_gpu, as dispatch chooses) runs per
  # device, as does cuDNN's softmax; nothing is gathered.
  text = compile_step("h200", "sigmoid", way)
  kernels = call_targets(text) & {pallas_gpu.TRITON_CALL_TARGET, mosaic_gpu.MOSAIC_GPU_CALL_TARGET}
  assert kernels, call_targets(text)
  assert not gathers(text), gathers(text)
