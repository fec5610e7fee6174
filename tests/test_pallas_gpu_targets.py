"""The Pallas GPU backward compiled for an A100 and an H100 (deviceless, ``-m targets``).

tests/test_targets.py compiles every normaliser's forward and backward; this module compiles
the backward's own variants for both GPU generations its block-size table serves: the dq
kernel that sums ``D_i`` from its tiles (softpick in bfloat16 / float16,
:func:`attnjax.kernels.pallas_gpu.backward.row_terms_from_tiles`), with a learned null column
and with allowed-key counts (forced on for softmax and sigmoid), at head dims 64 to 256; and
the A100's asymmetric backward tiles at head dims <= 64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from attnjax._src.ops.dense import attention as dense
from attnjax._src import normalizers, targets
from attnjax.kernels import pallas_gpu
from attnjax._src.kernels.pallas_gpu import backward as pallas_backward
from attnjax._src.kernels.pallas_gpu.plan import make_plan

pytestmark = [
  pytest.mark.targets("cuda"),
  pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]


@pytest.fixture(autouse=True, scope="module")
def compile_settings(target_compiles):
  """As tests/test_targets.py (conftest's ``target_compiles``)."""


def compile_backward(
  target: str,
  normalizer: str,
  dtype,
  head_dim: int,
  *,
  segments: bool,
  sinks: bool = False,
  T: int = 384,
):
  """The compiled text of ``grad`` (q, k, v) of one causal ``pallas_gpu`` call with the
  logsumexp statistic, GQA 4 / 2 heads, on one compile-only ``target`` GPU."""
  mesh = targets.mesh(targets.gpu_devices(target, 1))
  rep = NamedSharding(mesh, P())
  q = jax.ShapeDtypeStruct((2, T, 4, head_dim), dtype, sharding=rep)
  kv = jax.ShapeDtypeStruct((2, T, 2, head_dim), dtype, sharding=rep)
  seg = jax.ShapeDtypeStruct((2, T), jnp.int32, sharding=rep)

  def loss(q, k, v, seg):
    extra = dict(sink_logits=jnp.linspace(-1.0, 1.0, 4), softcap=30.0) if sinks else {}
    out, st = dense.dot_product_attention(
      q,
      k,
      v,
      is_causal=True,
      segment_ids=seg if segments else None,
      normalizer=normalizer,
      return_stats=True,
      implementation="pallas_gpu",
      **extra,
    )
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(st.logsumexp)

  with jax.set_mesh(mesh):
    return jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv, seg).compile().as_text()


def assert_kernels(text: str, normalizer: str):
  for kernel in ("fwd", "dq", "dkdv"):
    assert f"attnjax_{kernel}_{normalizer}" in text, kernel
  assert text.count(f'custom_call_target="{pallas_gpu.TRITON_CALL_TARGET}"') >= 3


# The default run compiles one Ampere and one Hopper case (both dtypes, head dims 128 and 256);
# the rest, each another compile of the same kernels, under -m slow.
CASES = [
  pytest.param(("a100", jnp.bfloat16, 64, True), marks=pytest.mark.slow),
  ("a100", jnp.float16, 128, False),
  pytest.param(("a100", jnp.bfloat16, 256, False), marks=pytest.mark.slow),
  pytest.param(("h100", jnp.bfloat16, 128, True), marks=pytest.mark.slow),
  ("h100", jnp.bfloat16, 256, False),
]


@pytest.mark.parametrize(
  "case",
  CASES,
  ids=lambda c: f"{c[0]}-{jnp.dtype(c[1]).name}-H{c[2]}" + ("-segments" if c[3] else ""),
)
def test_softpick_backward_with_row_terms_from_tiles_compiles(case):
  target, dtype, head_dim, segments = case
  assert pallas_backward.row_terms_from_tiles(
    make_plan(
      *dense.prepare(
        jnp.zeros((1, 8, 4, head_dim), dtype),
        jnp.zeros((1, 8, 2, head_dim), dtype),
        jnp.zeros((1, 8, 2, head_dim), dtype),
        normalizer="softpick",
      ),
      pallas_gpu.DEFAULT_BLOCK_SIZES,
      False,
    ),
    dtype,
  )
  assert_kernels(
    compile_backward(target, "softpick", dtype, head_dim, segments=segments), "softpick"
  )


@pytest.mark.parametrize("normalizer", ["softmax", "sigmoid"])
def test_row_terms_from_tiles_compiles_with_sinks_and_counts(normalizer, monkeypatch):
  monkeypatch.setattr(pallas_backward, "needs_row_terms", lambda c: True)
  monkeypatch.setattr(pallas_backward, "row_terms_from_tiles", lambda c, dtype: True)
  sinks = normalizers.REGISTRY[normalizer].accepts_sink_logits
  assert_kernels(
    compile_backward("a100", normalizer, jnp.bfloat16, 128, segments=True, sinks=sinks), normalizer
  )


@pytest.mark.parametrize(
  "normalizer,dtype,segments",
  [
    ("softmax", jnp.bfloat16, True),
    # Other normalisers' tiles: the same block sizes (slow; softpick's Ampere backward also
    # compiles in test_softpick_backward_with_row_terms_from_tiles_compiles by default).
    pytest.param("sigmoid", jnp.float16, False, marks=pytest.mark.slow),
    pytest.param("softpick", jnp.bfloat16, False, marks=pytest.mark.slow),
  ],
  ids=["softmax-bf16-segments", "sigmoid-fp16", "softpick-bf16"],
)
def test_ampere_asymmetric_backward_tiles_compile(normalizer, dtype, segments):
  # The sm_80 rows at head dims <= 64: dq programs of 128 rows over 32-key steps, dk/dv
  # programs of 128 keys over 32-row steps, 4 warps (D from the output, from the tiles, none).
  sizes = pallas_gpu.block_sizes_for(64, dtype, 8)
  assert (sizes.block_q_bwd, sizes.block_k_dkdv) == (128, 128)
  assert_kernels(compile_backward("a100", normalizer, dtype, 64, segments=segments), normalizer)
