"""The Mosaic GPU kernel (``implementation="mosaic_gpu"``): interpret mode, block bounds, compiles.

Interpret mode runs the kernel in jax's Mosaic GPU interpreter on the CPU: TMA copies into the
shared-memory ring, barriers, the wgmmas, the normaliser state through the row lowering,
block bounds and masks. Under jax 0.12 (the py3.13 run) it is the compiled path's code,
transposed-operand wgmmas and layouts included, except for register-lhs wgmmas, which no
interpreter runs: their lhs is staged through shared memory
(``test_interpreter_runs_the_compiled_products``). jax 0.10.2's interpreter also lacks
transposed wgmma operands and layout annotations: there ``Q K^T`` and the backward's
transposed products are register dots of the shared-memory tiles and layouts are dropped,
and only one forward case runs (``compiled_interpreter``).
The compiled path is also validated by the deviceless compiles for an H100 and an H200 below
(``needs_cuda``: the 'aot' extra).

Lengths (T=100, S=130) are not multiples of the 64-blocks; most calls use GQA (4 query heads
on 2 key/value heads). The cross products are ``slow``.
"""

import dataclasses
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import attnjax
from attnjax._src import target as _target, check, normalizers, targets
from attnjax._src.ops.dense import attention as dense
from attnjax.kernels import mosaic_gpu
from attnjax._src.kernels.mosaic_gpu import (
  backward as mbackward,
  kernel as mkernel,
  plan as mplan,
  specialised as mspecialised,
)
from engine_base import DenseEngineTests
from helpers import assert_close, rand_qkv, softpick_f64, run_kernel

needs_cuda = pytest.mark.targets("cuda")
# Of each array's scale: two units of bfloat16 rounding (eps 7.8e-3), the inputs' dtype.
TOL = 1.5e-2

BLOCKS = mosaic_gpu.BlockSizes(block_q=64, block_k=64, num_stages=2)
T, S = 100, 130
STRUCTURES = {
  "causal": dict(is_causal=True),
  "window": dict(window=(70, 10)),
  "bidirectional": dict(),
  # two packed sequences per row, boundaries inside blocks; causal within each. Row 1's key
  # block 0 (keys 0..63, segment 0) cannot meet query block 1 (rows 64.., segment 1): skipped.
  "segments": dict(
    is_causal=True,
    segment_ids=(
      np.asarray([[0] * 13 + [1] * 87, [0] * 64 + [1] * 36]),
      np.asarray([[0] * 13 + [1] * 117, [0] * 64 + [1] * 66]),
    ),
  ),
}
# The normalisers mosaic_gpu runs: not those that need the rows' pre-passes (clipped softmax:
# the kernel refuses it by name, see tests/test_clipped_softmax.py).
NORMS = tuple(n for n in normalizers.NORMALIZERS if not normalizers.REGISTRY[n].needs_lse)
# jax 0.10.2's interpreter runs another program than the compiled one (register dots for the
# transposed wgmmas, no layouts: Plan.plain) and runs the forward's three warpgroups about 7x
# slower than jax 0.12's (107 s against 15 s for one three-program call): there the value
# tests run one forward case; the py3.13 run (jax 0.12: the compiled path's code) runs all.
compiled_interpreter = pytest.mark.skipif(
  not mplan.INTERPRETER_RUNS_LAYOUTS,
  reason="jax < 0.12: the interpreter runs another program than the compiled one, slowly; "
  "the jax 0.12 run checks these values",
)


def _inputs(
  structure,
  normalizer,
  *,
  gqa=True,
  dtype=jnp.bfloat16,
  sink=False,
  softcap=None,
  scale=None,
  stats=False,
  H=64,
  seed=0,
  lengths=(T, S),
):
  # Two query heads (a group of two per key head under GQA): the interpreter's time grows
  # with the heads, and the kernels' grids treat every head alike.
  N, K = (2, 1) if gqa else (2, 2)
  q, k, v = rand_qkv(B=2, T=lengths[0], S=lengths[1], N=N, K=K, H=H, seed=seed)
  q, k, v = (x.astype(dtype) for x in (q, k, v))
  kw = dict(
    STRUCTURES[structure], normalizer=normalizer, softcap=softcap, scale=scale, return_stats=stats
  )
  if "segment_ids" in kw:
    kw["segment_ids"] = tuple(jnp.asarray(x) for x in kw["segment_ids"])
  if sink:
    kw["sink_logits"] = jnp.linspace(-1.0, 1.0, N)
  return q, k, v, kw


def _reference(q, k, v, kw):
  """The reference on the same (rounded) inputs in float32."""
  up = lambda x: x.astype(jnp.float32)
  return dense.reference(*dense.prepare(up(q), up(k), up(v), **kw))


class TestMosaicGpu(DenseEngineTests):
  """Forward values and statistics in interpret mode (the backward kernels are tested
  directly below: in interpret mode the custom VJP takes the block-wise backward); causal,
  window, packed segments and bidirectional; GQA and MHA; bfloat16 and float16; head dim 64.
  Under jax 0.10.2 one case runs (``compiled_interpreter``)."""

  name = "mosaic_gpu"
  T, S, H = T, S, 64
  structures = ("causal", "segments", "window", "bidirectional")
  segment_cuts = (13, 64)
  dtypes = (jnp.bfloat16, jnp.float16)
  supports_grad = False
  tolerance = {jnp.bfloat16: 1.5e-2, jnp.float16: 1.5e-2}
  stats_tolerance = 1e-5  # from float32 logits

  def run(self, inputs, opts):
    return run_kernel(mosaic_gpu, inputs, opts, interpret=True, block_sizes=BLOCKS)

  def case_marks(self, case):
    if case == self.default_cases()[-1]:
      return []
    # A soft cap elsewhere than on the last case is -m slow: the last one (it runs under every
    # jax) takes the soft cap, the others float16, MHA and both normalisers on each structure.
    return [compiled_interpreter] + [pytest.mark.slow] * (case[-1] is not None)


@compiled_interpreter
@pytest.mark.slow
@pytest.mark.parametrize("H", [128, 256])
def test_mosaic_gpu_interpret_large_head_dims(H):
  engine = TestMosaicGpu()
  engine.H = H
  engine.check(("softmax", "causal", True, jnp.bfloat16, True, True, None))


@compiled_interpreter
def test_mosaic_gpu_gradients_and_jvp():
  """Reverse mode (in interpret mode the block-wise engine's backward: the interpreter's
  kernels cannot sit in the custom VJP; the backward kernels are tested directly below) and
  forward mode through attnjax.kernels.autodiff, against the reference on the same inputs."""
  q, k, v, kw = _inputs("segments", "softmax", sink=True, softcap=5.0, stats=True)
  sink = kw.pop("sink_logits")
  cot = jax.random.normal(jax.random.key(3), q.shape[:3] + (64,), jnp.float32)

  def loss(fn, q, k, v, sink):  # the logsumexp statistic carries a gradient too
    out, st = fn(q, k, v, sink)
    return jnp.sum(out.astype(jnp.float32) * cot) + jnp.sum(jnp.sin(st.logsumexp))

  fast = lambda q, k, v, s: mosaic_gpu.attention(
    q, k, v, sink_logits=s, block_sizes=BLOCKS, interpret=True, **kw
  )
  ref = lambda q, k, v, s: dense.reference(
    *dense.prepare(
      q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), sink_logits=s, **kw
    )
  )
  g_fast = jax.jit(jax.grad(lambda *a: loss(fast, *a), argnums=(0, 1, 2, 3)))(q, k, v, sink)
  g_ref = jax.jit(jax.grad(lambda *a: loss(ref, *a), argnums=(0, 1, 2, 3)))(q, k, v, sink)
  for name, a, b in zip(("dq", "dk", "dv", "dsink"), g_fast, g_ref):
    assert_close(a, b, name, rtol=0, atol=TOL, scaled=True)
  t = tuple(0.5 * x for x in (q, k, v))
  of, jf = jax.jit(lambda t: jax.jvp(lambda q, k, v: fast(q, k, v, sink)[0], (q, k, v), t))(t)
  up = lambda xs: tuple(x.astype(jnp.float32) for x in xs)
  orf, jr = jax.jit(lambda t: jax.jvp(lambda q, k, v: ref(q, k, v, sink)[0], up((q, k, v)), up(t)))(
    t
  )
  assert_close(of, orf, "values (segments, sink logits)", rtol=0, atol=TOL, scaled=True)
  assert_close(jf, jr, "jvp", rtol=0, atol=TOL, scaled=True)


def check_backward_kernels(
  normalizer, structure, *, block_sizes=None, specialised=mspecialised.run, **kw
):
  """The dq and dk/dv kernels in interpret mode, called directly (forward with residuals, then
  the backward; in interpret mode the custom-VJP path takes the block-wise backward, see
  attnjax.kernels.mosaic_gpu.kernel.compute), against the reference's VJP of the output and
  (with statistics) of the logsumexp. ``specialised=None``: the one-warpgroup kernels."""
  q, k, v, opts_kw = _inputs(structure, normalizer, **kw)
  stats = opts_kw["return_stats"]
  sink = opts_kw.pop("sink_logits", None)
  inputs, opts = dense.prepare(q, k, v, sink_logits=sink, **opts_kw)
  c = mkernel.make_plan(inputs, opts, block_sizes or BLOCKS, interpret=True)
  rng = np.random.default_rng(5)
  cot = jnp.asarray(rng.standard_normal(q.shape[:3] + (v.shape[-1],)), jnp.float32)
  d_lse = (
    jnp.asarray(rng.standard_normal((q.shape[0], q.shape[2], T)), jnp.float32) if stats else None
  )

  def kernels(q, k, v, sink):
    segs = inputs.q_segment_ids, inputs.kv_segment_ids
    out, rows = mkernel.forward(c, q, k, v, sink, *segs, residuals=True)
    res = {key[4:]: x[..., 0] for key, x in rows.items() if key.startswith("res:")}
    has_key = rows["has_key"][..., 0] if stats else None
    return out, mbackward.backward(
      c, q, k, v, sink, out, res, cot.astype(q.dtype), d_lse, has_key, *segs, specialised
    )

  out, grads = jax.jit(kernels)(q, k, v, sink)

  def ref(q, k, v, sink):
    return dense.reference(*dense.prepare(q, k, v, sink_logits=sink, **opts_kw))

  up = lambda x: x.astype(jnp.float32)

  @jax.jit  # one program: run eagerly, every op of the reference would compile its own
  def expected(q, k, v, sink):
    want, vjp = jax.vjp(ref, up(q), up(k), up(v), sink)
    if stats:
      want, st = want
      return want, vjp((cot, jax.tree.map(jnp.zeros_like, st)._replace(logsumexp=d_lse)))
    return want, vjp(cot)

  want, want_grads = expected(q, k, v, sink)
  what = f"{normalizer} {structure} {kw}"
  assert_close(out, want, what + " out", rtol=0, atol=TOL, scaled=True)
  for name, a, b in zip(("dq", "dk", "dv", "dsink"), grads, want_grads):
    if b is not None:
      assert_close(a, b, f"{what} {name}", rtol=0, atol=TOL, scaled=True)


@pytest.mark.skipif(
  not mplan.INTERPRETER_RUNS_LAYOUTS,
  reason="jax < 0.12: the interpreter lacks transposed wgmma and layouts",
)
def test_interpreter_runs_the_compiled_products():
  """Under jax 0.12 the interpret-mode kernels' products are all wgmmas (no register dot),
  with the compiled path's layout annotations: the values tested here are the compiled
  path's, bar the staging of register lhs operands."""
  q, k, v, kw = _inputs("causal", "softmax", stats=True)
  inputs, opts = dense.prepare(q, k, v, **kw)
  c = mkernel.make_plan(inputs, opts, BLOCKS, interpret=True)
  assert not c.plain
  segs = (None, None)

  def both(q, k, v):
    out, rows = mkernel.forward(c, q, k, v, None, *segs, residuals=True)
    res = {key[4:]: x[..., 0] for key, x in rows.items() if key.startswith("res:")}
    return mbackward.backward(c, q, k, v, None, out, res, out, None, None, *segs, mspecialised.run)

  for fn in (lambda q, k, v: mkernel.forward(c, q, k, v, None, *segs), both):
    text = str(jax.make_jaxpr(fn)(q, k, v))
    assert "dot_general" not in text
    assert "wgmma" in text and "layout_cast" in text


@compiled_interpreter
@pytest.mark.parametrize(
  "normalizer,structure",
  [("softmax", "window"), pytest.param("sigmoid", "causal", marks=pytest.mark.slow)],
)
def test_the_two_consumers_of_a_program_visit_their_own_blocks(normalizer, structure):
  # T = S = 300 in 64-row blocks: three programs of two consumer warpgroups (128 rows), the
  # last one ragged. Causal: the second consumer visits one block more than the first (the
  # first waits for it and releases it); window (70, 10): in the second program the first
  # consumer starts a block earlier. Every tile is released by both, or the producer hangs.
  q, k, v, kw = _inputs(
    structure, normalizer, stats=True, sink=normalizer == "softmax", lengths=(300, 300)
  )
  inputs, opts = dense.prepare(q, k, v, **kw)
  c = mkernel.make_plan(inputs, opts, BLOCKS, interpret=True)
  assert (c.Tp, c.Tp // (mplan.CONSUMERS * c.bq)) == (384, 3)
  fn = lambda q, k, v: run_kernel(
    mosaic_gpu, *dense.prepare(q, k, v, **kw), interpret=True, block_sizes=BLOCKS
  )
  text = str(jax.make_jaxpr(fn)(q, k, v))
  # a producer and two consumers, registers moved between them
  assert "num_threads=3" in text and text.count("set_max_registers") == 2
  (got, got_stats), (want, want_stats) = jax.jit(fn)(q, k, v), _reference(q, k, v, kw)
  assert_close(got, want, f"{normalizer} {structure} T=300", rtol=0, atol=TOL, scaled=True)
  for field in ("sink_mass", "entropy", "logsumexp"):
    assert_close(
      getattr(got_stats, field), getattr(want_stats, field), field, rtol=0, atol=1e-5, scaled=True
    )


BACKWARD_CASES = [
  # 64 x 128 tiles (dk/dv tiles [64 keys, 64 queries]): the transposed row lowering
  (
    "softmax",
    "causal",
    dict(sink=True, softcap=5.0, stats=True, block_sizes=mosaic_gpu.BlockSizes(64, 128, 2)),
  ),
  # segment ids: blocks skipped at run time in both kernels; sigmoid's counts pre-pass
  ("sigmoid", "segments", dict(gqa=True, stats=True)),
  # no row input at all (no D_i: reads_row_dot is False; no residual, no statistics)
  ("none", "window", dict(gqa=False)),
  # 128-key tiles in the forward and dq, 64-key dk/dv programs (DKDV_BLOCK_K), whose key
  # blocks' segment ranges are their own
  ("softpick", "segments", dict(block_sizes=mosaic_gpu.BlockSizes(64, 128, 2))),
]


# The default run (the py3.13 run: these run only under jax 0.12) takes the first three; the
# last is -m slow (each interpreted backward costs ~15 s of the CPU): softpick's backward
# kernels on packed segments run in test_mosaic_gpu_softpick_backward_keeps_each_rows_precision.
DEFAULT_BACKWARD_CASES = 3


@compiled_interpreter
@pytest.mark.parametrize(
  "normalizer,structure,kw",
  [
    pytest.param(*c, id=f"{c[0]}-{c[1]}", marks=[pytest.mark.slow] * (i >= DEFAULT_BACKWARD_CASES))
    for i, c in enumerate(BACKWARD_CASES)
  ],
)
def test_mosaic_gpu_backward_kernels_interpret(normalizer, structure, kw):
  check_backward_kernels(normalizer, structure, **kw)


@compiled_interpreter
@pytest.mark.parametrize(
  "normalizer,structure,kw",
  [
    pytest.param(
      "softmax", "causal", dict(sink=True, softcap=5.0, stats=True), id="softmax-causal"
    ),
    # segment ids in the one-warpgroup kernels: -m slow (the warp-specialised ones take them
    # in the default run)
    pytest.param(
      "sigmoid", "segments", dict(stats=True), id="sigmoid-segments", marks=pytest.mark.slow
    ),
  ],
)
def test_one_warpgroup_backward_kernels_interpret(normalizer, structure, kw):
  """The one-warpgroup dq and dk/dv kernels (backward.py), which run where the warp-specialised
  kernels' tiles do not fit shared memory (head dim 256, test_the_backward_kernels_by_head_dim):
  called directly at head dim 64 (their code does not depend on it; the interpreter's time
  does), segment ids, statistics, sink logits and soft cap included."""
  check_backward_kernels(normalizer, structure, specialised=None, **kw)


@compiled_interpreter
@pytest.mark.slow
def test_one_warpgroup_backward_kernels_at_head_dim_256():
  # the route the dispatch takes at head dim 256: specialised.run declines, backward.py runs
  check_backward_kernels(
    "softmax", "causal", H=256, stats=True, block_sizes=mosaic_gpu.block_sizes_for(256)
  )


def test_the_backward_kernels_by_head_dim(monkeypatch):
  """Which backward runs: the warp-specialised kernels at head dims 64 and 128, whatever the
  lengths (the dk/dv kernel pads the keys to whole programs of two 64-key blocks: here S = 130
  in 64-key blocks, 3 of them), the one-warpgroup kernels at 256 (their tiles for two compute
  warpgroups pass shared memory). Traced for the compiled kernels (no interpreter runs)."""
  calls = []

  def refuse(name):
    def kernel(*args, **kwargs):
      calls.append(name)
      raise RuntimeError(f"{name} traced")

    return kernel

  for name in ("_dq_kernel", "_dkdv_kernel"):
    monkeypatch.setattr(mbackward, name, refuse(name))
  for H in (64, 128, 256):
    q, k, v, kw = _inputs("segments", "softmax", H=H)
    inputs, opts = dense.prepare(q, k, v, **kw)
    c = mkernel.make_plan(inputs, opts, BLOCKS, interpret=False)
    fits = mspecialised.fits(c, 1)
    assert fits == (H < 256), H
    segs = inputs.q_segment_ids, inputs.kv_segment_ids
    rows = {"log_norm": jnp.zeros((2, 2, c.Tp), jnp.float32)}
    grads = lambda q, k, v: mbackward.backward(
      c, q, k, v, None, q, rows, q, None, None, *segs, mspecialised.run
    )
    if fits:
      jax.make_jaxpr(grads)(q, k, v)  # the one-warpgroup kernels are never traced
    else:
      with pytest.raises(RuntimeError, match="_dq_kernel traced"):
        jax.make_jaxpr(grads)(q, k, v)
  assert calls == ["_dq_kernel"]


def _single_key_softpick(T_=100, H=64):
  """bfloat16 ``(q, k, v, seg)``: causal packed segments starting at rows 13 and 30, which see
  their own key only, with logit 0.001 (head 0) and 0.01 (head 1) there."""
  q, k, v = rand_qkv(B=2, T=T_, S=T_, N=2, K=1, H=H, seed=3)
  q, k = np.array(q), np.array(k)
  for r in (13, 30):
    for n, z in enumerate((0.001, 0.01)):
      kr = k[:, r, 0]
      q[:, r, n] = kr * (z * H**0.5 / np.sum(kr * kr, axis=-1, keepdims=True))
  seg = jnp.asarray(np.repeat(np.cumsum(np.isin(np.arange(T_), (13, 30)))[None], 2, 0))
  return (*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), seg)


def _softpick_f64(q, k, v, seg, cot):
  """``sum(out * cot)`` of causal, segmented softpick, all in float64 (``expm1``)."""
  return jnp.sum(softpick_f64(q, k, v, seg)[0] * cot)


@compiled_interpreter
def test_mosaic_gpu_softpick_backward_keeps_each_rows_precision():
  # Softpick's dz = e^z (dp [z > 0] - D sign z) / (sum |e^z - 1| + eps) on a row that sees one
  # key with a small positive logit multiplies D's error by ~1/z. D = <dO, O> from the
  # bfloat16 O (its P V product took the weights rounded to bfloat16) had such rows' dq off
  # by most of their scale; D is now summed from the tiles in float32
  # (Normalizer.row_dot_from_tiles, as pallas_gpu). Each row against float64, on its scale.
  from test_pallas_gpu import row_errors

  q, k, v, seg = _single_key_softpick()
  inputs, opts = dense.prepare(q, k, v, is_causal=True, segment_ids=seg, normalizer="softpick")
  c = mkernel.make_plan(inputs, opts, BLOCKS, interpret=True)
  assert c.nz.row_dot_from_tiles(q.dtype)
  cot = jnp.asarray(np.random.default_rng(5).standard_normal(q.shape), jnp.bfloat16)
  segs = inputs.q_segment_ids, inputs.kv_segment_ids

  def kernels(q, k, v):
    out, rows = mkernel.forward(c, q, k, v, None, *segs, residuals=True)
    res = {key[4:]: x[..., 0] for key, x in rows.items() if key.startswith("res:")}
    return mbackward.backward(c, q, k, v, None, out, res, cot, None, None, *segs, mspecialised.run)[
      :3
    ]

  got = jax.jit(kernels)(q, k, v)
  with jax.enable_x64(True):
    f64 = lambda x: np.asarray(x, np.float64)
    loss = lambda q, k, v, cot: _softpick_f64(q, k, v, seg, cot)  # seg: numpy, not traced
    exact = jax.jit(jax.grad(loss, (0, 1, 2)))(f64(q), f64(k), f64(v), f64(cot))
    exact = [np.asarray(x) for x in exact]
  tol = 16 * 2.0**-8  # bfloat16 dO, weights, dS and result (2^-9 each); a row's sums
  for name, a, b in zip(("dq", "dk", "dv"), got, exact):
    err = row_errors(a, b)
    worst = np.unravel_index(np.argmax(err), err.shape)
    assert err[worst] < tol, f"{name} row {worst}: error {err[worst]:.2e} of its scale"


@compiled_interpreter
@pytest.mark.slow
@pytest.mark.parametrize(
  "normalizer,structure,gqa", list(itertools.product(NORMS, STRUCTURES, (True, False)))
)
def test_mosaic_gpu_backward_kernels_interpret_everywhere(normalizer, structure, gqa):
  check_backward_kernels(
    normalizer,
    structure,
    gqa=gqa,
    stats=True,
    sink=normalizers.REGISTRY[normalizer].accepts_sink_logits,
  )


@pytest.mark.parametrize("normalizer", NORMS)
def test_row_lowering_equals_the_normaliser(normalizer):
  """The [R] row lowering of visit / finish (with statistics) equals the [R, 1] originals."""
  nz = normalizers.REGISTRY[normalizer]
  R, tk, Hv = 8, 16, 4
  rng = np.random.default_rng(0)
  z = jnp.asarray(rng.standard_normal((R, tk)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((tk, Hv)), jnp.float32)
  allowed = jnp.asarray(rng.random((R, tk)) > 0.3).at[0].set(False)  # row 0: no key
  counts = jnp.sum(allowed, axis=1, keepdims=True).astype(jnp.float32)
  sink = jnp.full((R, 1), 0.3, jnp.float32) if nz.accepts_sink_logits else None
  pv = lambda w: w @ v
  row = nz.row_inputs(sink, counts)
  st = nz.visit(nz.init((R, 1), (R, Hv), True), z, allowed, pv, row, True, True)
  want = nz.finish(st, row, True)

  flat = lambda x: None if x is None else x[:, 0]
  row_r = mplan.lower_rows(nz.row_inputs, R)(flat(sink), flat(counts))
  init = {
    k: (x[:, 0] if x.shape[-1] == 1 else x) for k, x in nz.init((R, 1), (R, Hv), True).items()
  }
  st_r = mplan.lower_rows(
    lambda st, z, a, row, pv_: nz.visit(st, z, a, pv_, row, True, True), R, pv=pv, hv=Hv
  )(init, z, allowed, row_r)
  got = mplan.lower_rows(lambda st, row: nz.finish(st, row, True), R)(st_r, row_r)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
    a = np.asarray(a)
    np.testing.assert_allclose(
      np.reshape(np.asarray(b), a.shape),
      a,
      rtol=1e-6,
      atol=1e-6,
      err_msg=f"{normalizer} {jax.tree_util.keystr(path)}",
    )


@pytest.mark.parametrize("normalizer", ["softmax", "sigmoid"])
def test_the_forward_visit_names_its_rescale_rows(normalizer):
  """The fused visit hands pv the rows that rescale the accumulator (softmax's exp(m_old -
  m_new); none for sigmoid), which the compiled forward makes its turn's bar.sync wait on
  (named_barrier's ``after``): ptxas otherwise computes them after the sync."""
  nz = normalizers.REGISTRY[normalizer]
  R, tk, Hv = 8, 16, 4
  rng = np.random.default_rng(2)
  z = jnp.asarray(rng.standard_normal((R, tk)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((tk, Hv)), jnp.float32)
  counts = jnp.full((R,), float(tk))
  row = mplan.lower_rows(nz.row_inputs, R)(None, counts)
  st = {k: (x[:, 0] if x.shape[-1] == 1 else x) for k, x in nz.init((R, 1), (R, Hv), False).items()}
  st["acc"] = jnp.asarray(rng.standard_normal((R, Hv)), jnp.float32)
  if "m" in st:
    st["m"] = jnp.max(z, axis=1) - 0.5  # the tile raises every row's maximum
  seen = []

  def pv(w, acc=None, rows=()):
    seen.append(rows)
    return w @ v if acc is None else acc + w @ v

  visit = lambda st, z, row, pv_: nz.visit(st, z, None, pv_, row, False, False)
  got = mplan.lower_rows(visit, R, pv=pv, hv=Hv, fuse=True)(st, z, row)
  want = mplan.lower_rows(visit, R, pv=lambda w: w @ v, hv=Hv)(st, z, row)
  np.testing.assert_allclose(got["acc"], want["acc"], rtol=1e-5, atol=1e-6)
  ((rows,),) = [seen]
  if normalizer == "softmax":
    (alpha,) = rows
    np.testing.assert_allclose(alpha, np.exp(-0.5), rtol=1e-5)
  else:
    assert rows == ()


@pytest.mark.parametrize("normalizer", NORMS)
@pytest.mark.parametrize("transposed", [False, True], ids=["dq", "dkdv"])
def test_backward_tile_rule_lowering_equals_the_normaliser(normalizer, transposed):
  """The backward kernels' tile rule (the row lowering of tile_backward on the raw tile, with
  the scale folded into the exponent, fuse=True; tiles held transposed in dk/dv) equals
  tile_backward on the scaled logits, masked and not (unmasked, the fold applies)."""
  nz = normalizers.REGISTRY[normalizer]
  R, X = 8, 16
  rng = np.random.default_rng(1)
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  raw, dp = 4 * draw(R, X), draw(R, X)
  res = {key: draw(R, 1) for key in mplan.res_row_keys(nz, True, False, True)}
  row_dot, d_lse = draw(R, 1), draw(R, 1)
  opts = dense.prepare(*rand_qkv(T=8, S=8, H=16))[1]
  c = type("Plan", (), {"opts": dataclasses.replace(opts, scale=0.3)})()
  rule = mbackward._lowered_rule(c, nz.tile_backward, R, transposed=transposed)
  hold = (lambda x: x.T) if transposed else (lambda x: x)
  for allowed in (None, jnp.asarray(rng.random((R, X)) > 0.3)):
    want = nz.tile_backward(0.3 * raw, allowed, dp, res, row_dot, d_lse)
    got = rule(
      hold(raw),
      None if allowed is None else hold(allowed),
      hold(dp),
      {k: x[:, 0] for k, x in res.items()},
      row_dot[:, 0],
      d_lse[:, 0],
    )
    for name, a, b in zip(("w", "dz"), got, want):
      np.testing.assert_allclose(
        hold(a), b, rtol=1e-5, atol=1e-6, err_msg=f"{normalizer} {name} mask={allowed is not None}"
      )
  if normalizer == "softmax":  # unmasked, exp(0.3 raw - lse) is one exp2 of an FFMA
    args = (hold(raw), None, hold(dp), {k: x[:, 0] for k, x in res.items()}, row_dot[:, 0], None)
    text = str(jax.make_jaxpr(rule)(*args))
    assert "exp2" in text and " exp " not in text


@pytest.mark.parametrize("normalizer", ["softmax", "sigmoid"])
def test_residual_rows_only_when_differentiated(monkeypatch, normalizer):
  """The compiled path (traced, not run) writes the backward's residual rows (softmax's
  log-normaliser, sigmoid's bias) only when the call is differentiated."""
  seen = []
  real = mkernel.forward

  def spy(*args, residuals=False):
    seen.append(residuals)
    return real(*args, residuals=residuals)

  monkeypatch.setattr(mkernel, "forward", spy)
  q, k, v, kw = _inputs("causal", normalizer)
  out = lambda q, k, v: mosaic_gpu.compute(*dense.prepare(q, k, v, **kw), block_sizes=BLOCKS)
  loss = lambda q, k, v: jnp.sum(out(q, k, v).astype(jnp.float32))
  jax.make_jaxpr(out)(q, k, v)
  assert seen == [False]
  jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v)
  assert seen == [False, True]


@pytest.mark.parametrize("normalizer", NORMS)
def test_reads_row_dot_is_honest(normalizer):
  """A normaliser that declares ``reads_row_dot=False`` (the backward kernels then skip
  ``D_i = <dO_i, O_i>`` and pass None) gives the same tile rule with any row_dot or None;
  one that declares True depends on it."""
  nz = normalizers.REGISTRY[normalizer]
  R, tk = 8, 16
  rng = np.random.default_rng(1)
  z, dp = (jnp.asarray(rng.standard_normal((R, tk)), jnp.float32) for _ in range(2))
  allowed = jnp.asarray(rng.random((R, tk)) > 0.3)
  counts = jnp.sum(allowed, axis=1, keepdims=True).astype(jnp.float32)
  row = nz.row_inputs(None, counts)
  st = nz.visit(
    nz.init((R, 1), (R, 4), True), z, allowed, lambda w: w @ jnp.ones((tk, 4)), row, True, True
  )
  _, res, _ = nz.finish(st, row, True)
  d_lse = jnp.asarray(rng.standard_normal((R, 1)), jnp.float32)
  rule = lambda row_dot: nz.tile_backward(z, allowed, dp, res, row_dot, d_lse)[1]
  dot = jnp.asarray(rng.standard_normal((R, 1)), jnp.float32)
  if nz.reads_row_dot:
    assert float(jnp.max(jnp.abs(rule(dot) - rule(2.0 * dot)))) > 1e-3
  else:
    np.testing.assert_array_equal(rule(None), rule(dot))


@pytest.mark.parametrize(
  "structure",
  [
    dict(is_causal=True),
    dict(window=(70, 10)),
    dict(window=(0, 200)),
    dict(is_causal=True, window=(5, 0)),
    dict(),
  ],
)
def test_block_bounds_skip_exactly_the_blocks_without_an_allowed_pair(structure):
  """Visited blocks are those with an allowed pair; unmasked ones those every row attends."""
  inputs, opts = dense.prepare(
    *rand_qkv(B=1, T=T, S=S, N=1, K=1, H=64, dtype=jnp.bfloat16), **structure
  )
  c = mkernel.make_plan(inputs, opts, BLOCKS, interpret=True)
  qpos, kpos = np.arange(c.Tp)[:, None], np.arange(c.Sp)[None, :]
  allowed = (kpos < S) & (qpos < T)
  if opts.is_causal:
    allowed &= kpos <= qpos
  if opts.window is not None:
    allowed &= (kpos >= qpos - opts.window[0]) & (kpos <= qpos + opts.window[1])
  for i in range(c.Tp // c.bq):
    q0, q_last = i * c.bq, min(i * c.bq + c.bq, T) - 1
    lo, hi, flo, fhi = (int(x) for x in mkernel.kv_bounds(c, q0, q_last))
    rows = allowed[q0 : q_last + 1]
    for j in range(c.Sp // c.bk):
      tile = rows[:, j * c.bk : (j + 1) * c.bk]
      assert (lo <= j < hi) == bool(tile.any()), (structure, i, j, lo, hi)
      if flo <= j < fhi:
        assert tile.all(), (structure, i, j, flo, fhi)
      elif lo <= j < hi:  # masked: an edge block, or a ragged last key block
        assert not tile.all() or j == c.Sp // c.bk - 1 and S % c.bk, (structure, i, j)


def test_mosaic_gpu_names_what_it_cannot_do(monkeypatch):
  q, k, v = rand_qkv(B=1, T=64, N=2, K=1, H=64, dtype=jnp.bfloat16)
  assert mosaic_gpu.unsupported(*dense.prepare(q, k, v, is_causal=True), interpret=True) == []
  reasons = mosaic_gpu.unsupported(
    *dense.prepare(
      q,
      k,
      v,
      bias=jnp.zeros((1, 1, 64, 64)),
      mask=jnp.ones((1, 1, 64, 64), bool),
      similarity="neg_sq_euclidean",
    ),
    interpret=True,
  )
  assert len(reasons) == 3 and "bias" in reasons[0] and "mask" in reasons[1], reasons
  inputs, opts = dense.prepare(*rand_qkv(B=1, T=64, N=2, K=1, H=96), is_causal=True)
  reasons = mosaic_gpu.unsupported(inputs, opts)
  assert any("head dims q 96" in r for r in reasons) and any("float32" in r for r in reasons)
  mixed = dataclasses.replace(*dense.prepare(q, k, v)[:1], v=v.astype(jnp.float16))
  assert any("dtypes" in r for r in mosaic_gpu.unsupported(mixed, dense.prepare(q, k, v)[1]))
  with pytest.raises(ValueError, match="mosaic_gpu' does not support bias"):
    attnjax.dot_product_attention(
      q, k, v, bias=jnp.zeros((1, 1, 64, 64)), implementation="mosaic_gpu"
    )
  # named on a host that knows no Hopper target: refused (its wgmmas are sm_90 instructions)
  with pytest.raises(ValueError, match="mosaic_gpu' does not support a GPU of unknown generation"):
    attnjax.dot_product_attention(q, k, v, implementation="mosaic_gpu")
  # ... and, traced for a Hopper, refused when lowered for this CPU
  monkeypatch.setattr(_target, "cuda_major", lambda: 9)
  with pytest.raises(ValueError, match="mosaic_gpu' runs on a CUDA GPU"):
    attnjax.dot_product_attention(q, k[:, :63], v[:, :63], implementation="mosaic_gpu")
  with pytest.raises(ValueError, match="multiple of 64"):
    mosaic_gpu.BlockSizes(block_q=32)
  with pytest.raises(ValueError, match="num_stages"):
    mosaic_gpu.BlockSizes(num_stages=1)
  # auto-dispatch picks it only for a Hopper (tests/test_dispatch.py); this host has no GPU
  assert "mosaic_gpu" not in dense.dispatch_table(*dense.prepare(q, k, v)).values()


def test_block_size_table_fits_shared_memory():
  for head_dim, sizes in mosaic_gpu.BLOCK_SIZE_TABLE:
    for kernel in ("forward", "dq", "dkdv"):
      used = mosaic_gpu.smem_bytes(sizes, head_dim, head_dim, kernel=kernel)
      assert used <= mosaic_gpu.SMEM_LIMIT_BYTES - 4096, (head_dim, sizes, kernel, used)
  assert mosaic_gpu.block_sizes_for(100) == mosaic_gpu.BLOCK_SIZE_TABLE[1][1]
  with pytest.raises(ValueError, match="head dim 512"):
    mosaic_gpu.block_sizes_for(512)


# ---------------------------------------------------------------------------
# Deviceless compiles for an H100 and an H200 (jax's CUDA plugin).


def compile_for(
  target,
  normalizer,
  structure,
  head_dim,
  *,
  gqa=True,
  dtype=jnp.bfloat16,
  grad=True,
  block_sizes=None,
  T_=512,
  softcap=30.0,
):
  mesh = targets.mesh(targets.gpu_devices(target, 1))
  rep = NamedSharding(mesh, P())
  N, K = (4, 2) if gqa else (4, 4)
  q = jax.ShapeDtypeStruct((2, T_, N, head_dim), dtype, sharding=rep)
  kv = jax.ShapeDtypeStruct((2, T_, K, head_dim), dtype, sharding=rep)
  sink = None
  if normalizers.REGISTRY[normalizer].accepts_sink_logits:
    sink = jax.ShapeDtypeStruct((N,), jnp.float32, sharding=rep)
  kw = dict(STRUCTURES[structure], normalizer=normalizer, softcap=softcap, return_stats=True)
  seg = None
  if kw.pop("segment_ids", None) is not None:
    seg = jax.ShapeDtypeStruct((2, T_), jnp.int32, sharding=rep)

  def out(q, k, v, s, seg):
    return mosaic_gpu.compute(
      *dense.prepare(q, k, v, sink_logits=s, segment_ids=seg, **kw), block_sizes=block_sizes
    )

  def loss(*a):
    o, st = out(*a)
    return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(st.logsumexp)

  fn = out
  if grad:
    fn = jax.value_and_grad(loss, argnums=(0, 1, 2) if sink is None else (0, 1, 2, 3))
  with jax.set_mesh(mesh):
    return jax.jit(fn).lower(q, kv, kv, sink, seg).compile()


def assert_mosaic(compiled, kernels: int = 1):
  """``kernels`` Mosaic GPU kernels compiled (forward, and the dq and dk/dv kernels)."""
  text = compiled.as_text()
  count = text.count(f'custom_call_target="{mosaic_gpu.MOSAIC_GPU_CALL_TARGET}"')
  assert count >= kernels, set(re.findall(r'custom_call_target="([^"]+)"', text))


# The default subset (each ~10-20 s on two CPU cores): fwd + dq + dk/dv on an H100 and, with
# segment ids and for an elementwise normaliser, on an H200; every normaliser x head dim x
# structure with -m slow.
COMPILE_CASES = [
  ("h100", "softmax", "causal", 128, True, jnp.bfloat16),
  ("h200", "softpick", "segments", 64, True, jnp.bfloat16),
  ("h200", "sigmoid", "causal", 128, True, jnp.bfloat16),  # no D_i (reads_row_dot False)
]
SLOW_COMPILE_CASES = [
  c
  for c in itertools.product(
    ("h100", "h200"), NORMS, STRUCTURES, (64, 128, 256), (True,), (jnp.bfloat16,)
  )
  if c not in COMPILE_CASES
]


def _cid(case):
  return "-".join(getattr(x, "__name__", str(x)) for x in case)


@needs_cuda
@pytest.mark.parametrize("case", COMPILE_CASES, ids=_cid)
def test_mosaic_gpu_compiles_for_hopper(case):
  # the H100 case with a soft cap (accurate maths, Plan.approx_math off), the H200 ones
  # without (approximate exponentials)
  target, normalizer, structure, H, gqa, dtype = case
  softcap = 30.0 if target == "h100" else None
  assert_mosaic(
    compile_for(target, normalizer, structure, H, gqa=gqa, dtype=dtype, softcap=softcap), 3
  )


@needs_cuda
@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_COMPILE_CASES, ids=_cid)
def test_mosaic_gpu_compiles_for_hopper_cross_product(case):
  target, normalizer, structure, H, gqa, dtype = case
  assert_mosaic(compile_for(target, normalizer, structure, H, gqa=gqa, dtype=dtype), 3)


@needs_cuda
def test_an_oversized_configuration_is_rejected():
  # 64 x 256 K and V tiles, 4 stages, head dim 256: ~1.1 MB of shared memory (limit 227 KiB).
  sizes = mosaic_gpu.BlockSizes(block_q=64, block_k=256, num_stages=4)
  assert mosaic_gpu.smem_bytes(sizes, 256, 256) > mosaic_gpu.SMEM_LIMIT_BYTES
  with pytest.raises(Exception, match="exceeds available shared memory"):
    compile_for("h200", "softmax", "causal", 256, grad=False, block_sizes=sizes)


@needs_cuda
@pytest.mark.slow  # ~20 s of compiles
@pytest.mark.usefixtures("all_kernels")
def test_mosaic_gpu_inside_shard_map_over_batch_and_heads():
  # A ("data", "tensor") mesh of H200s: auto-dispatch takes mosaic_gpu (a Hopper; statistics
  # rule cuDNN out) and runs the kernels per (batch rows, kv heads) shard
  # (attnjax._sharding.per_shard); nothing is gathered.
  mesh = targets.mesh(targets.gpu_devices("h200", 8), ("data", "tensor"), (4, 2))
  spec = NamedSharding(mesh, P("data", None, "tensor", None))
  q = jax.ShapeDtypeStruct((8, 256, 4, 64), jnp.bfloat16, sharding=spec)
  kv = jax.ShapeDtypeStruct((8, 256, 2, 64), jnp.bfloat16, sharding=spec)

  def loss(q, k, v):
    out, st = dense.dot_product_attention(
      q, k, v, is_causal=True, normalizer="sigmoid", return_stats=True
    )
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(st.logsumexp)

  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv).compile()
  assert_mosaic(compiled, 3)
  assert "all-gather" not in compiled.as_text()


# The gpu preset's training step with mosaic_gpu inside (auto-dispatch on an H200) for every
# dense-kernel variant: tests/test_targets.py::test_gpu_preset_train_step_compiles.


# python -m attnjax.check --kernel mosaic_gpu: its speed shapes compile for an H200.
@needs_cuda
@pytest.mark.parametrize(
  "T,causal",
  [
    pytest.param(
      T,
      c,
      marks=[] if (T, c) == (16384, False) else [pytest.mark.slow],
      id=f"T{T}-{'causal' if c else 'full'}",
    )
    for T in (4096, 16384)
    for c in (False, True)
  ],
)
def test_device_check_mosaic_shapes_compile(T, causal):
  assert (128, T) in check.MOSAIC_SIZES
  B, T, N, H = check.speed_shape(128, T)
  mesh = targets.mesh(targets.gpu_devices("h200", 1))
  x = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

  def loss(q, k, v):
    return jnp.sum(
      attnjax.dot_product_attention(q, k, v, is_causal=causal, implementation="mosaic_gpu").astype(
        jnp.float32
      )
    )

  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, x, x).compile()
  assert_mosaic(compiled, 3)
