"""Forward mode (``jax.jvp``, ``jax.linearize``) and Hessian-vector products everywhere.

``_cases()`` is one walk over every public attention function (each implementation) and
every fast path (the kernels' entries): ``(name, fast, reference, args)``; ``jax.jvp`` of
``fast`` must equal ``jax.jvp`` of ``reference`` (the family's readable reference) at
``args``, with random tangents for every argument. A new function or implementation is
covered by adding an entry (``test_the_walk_covers_every_function`` fails until then).
``SECOND_ORDER`` names the custom-VJP engines (:mod:`attnjax.kernels.autodiff`):
``jax.linearize`` and both orders of Hessian-vector products equal the reference's there,
and reverse mode still runs each engine's hand-written backward.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core

import attnjax
from attnjax._src import op as _op, options
from attnjax._src.ops.dense import attention as dense
from attnjax._src.kernels import blockwise, pallas_gpu, pallas_tpu, splash
from attnjax._src.kernels.blockwise import kernel as blockwise_kernel
from attnjax._src.kernels.pallas_gpu import backward as pallas_backward
from attnjax._src.kernels.pallas_gpu import kernel as pallas_kernel
from tests.helpers import assert_close

B, T, N, K, H = 1, 32, 4, 2, 8
TOL = dict(rtol=1e-4, atol=1e-4)


class Case(NamedTuple):
  name: str  # "<function>[<implementation or options>]"
  fast: Callable
  reference: Callable  # one object per family and options: its jvp is computed once
  args: tuple  # the differentiable arguments; every one gets a random tangent


@functools.cache
def _arrays(T: int = T, N: int = N, K: int = K) -> dict[str, Any]:
  """Arguments drawn and shaped with numpy (no XLA program per array)."""
  rng = np.random.default_rng(0)
  draw = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  k = draw(B, T, K, H)
  # Per-channel gates: weak (the GLA direct chunk) up to token 32, strong after it (the
  # sub-blocked chunk: the chunk decays by more than DIRECT_MAX_DECAY).
  per_step = np.where(np.arange(T) < 32, -0.05, -3.0)[None, :, None, None]
  arrays = dict(
    q=draw(B, T, N, H),
    k=k,
    v=draw(B, T, K, H),
    sink=draw(N),
    k_unit=k / np.linalg.norm(k, axis=-1, keepdims=True),
    gains=1.0 + 0.1 * draw(H),
    temperature=1.5 + 0.1 * draw(N),
    beta=1.0 / (1.0 + np.exp(-draw(B, T, N))),
    g_scalar=-np.logaddexp(0.0, draw(B, T, N)),
    g_channel=per_step * rng.uniform(0.5, 1.5, (B, T, N, H)),
  )
  return {key: jnp.asarray(x, jnp.float32) for key, x in arrays.items()}


def _impl(fn: Callable, implementation) -> Callable:
  return lambda *args: fn(*args, implementation=implementation)


def _dense_reference(**kw) -> Callable:
  """The dense reference with ``kw``, sink logits as an optional argument."""
  return lambda q, k, v, *s: attnjax.dot_product_attention(
    q, k, v, sink_logits=s[0] if s else None, implementation="reference", **kw
  )


def family_cases(a: dict, ops=None) -> list[Case]:
  """Every registered op's sample calls (:attr:`attnjax._src.op.Op.samples`) on each engine of
  attnjax's own that runs on every platform, every array argument differentiable: a new
  family is walked with no entry here."""
  cases = []
  for op in (_op.OPS if ops is None else ops).values():
    impls = tuple(
      n
      for n, e in op.engines.items()
      if n != "reference" and e.platform is None and e.vouched_by == "attnjax"
    )
    for sample in op.samples():
      q, k, v, arrays = sample.inputs(a["q"], a["k"], a["v"])
      names = sorted(arrays)

      def fn(q, k, v, *rest, sample=sample, names=names, **kw):
        return sample.function(q, k, v, **dict(zip(names, rest)), **{**sample.options, **kw})

      args = (q, k, v, *(arrays[n] for n in names))
      reference = _impl(fn, "reference")
      cases += [Case(f"{sample.name}[{impl}]", _impl(fn, impl), reference, args) for impl in impls]
  return cases


def _extra_calls(a: dict, long: dict) -> list[tuple[str, Callable, tuple, tuple]]:
  """Calls beyond the samples: dense attention's learned sink logits (auto-dispatch and the
  block-wise engine) and its jax.nn engine, and the per-channel GLA over a direct chunk then a
  sub-blocked one: ``(name, fn(*args, implementation=...), args, implementations)``."""
  qkv = (a["q"], a["k"], a["v"])
  sinks = lambda q, k, v, s, **kw: attnjax.dot_product_attention(
    q, k, v, is_causal=True, sink_logits=s, **kw
  )
  plain = functools.partial(attnjax.dot_product_attention, is_causal=True)
  gla = lambda q, k, v, g, **kw: attnjax.gated_linear_attention(
    q, k, v, log_decay=g, chunk_size=32, **kw
  )
  return [
    ("dot_product_attention/sinks", sinks, qkv + (a["sink"],), (None, "blockwise")),
    ("dot_product_attention", plain, qkv, ("xla",)),
    # T=40, chunks of 32 (two sub-blocks): a direct chunk, then a sub-blocked one.
    (
      "gated_linear_attention/per_channel",
      gla,
      (long["q"], long["k"], long["v"], long["g_channel"]),
      ("recurrent", "quadratic", "chunked"),
    ),
  ]


@functools.cache
def _cases() -> tuple[Case, ...]:
  # N=2, K=1 at T=40: the per-channel GLA's grad of jvp at N=4, K=2 (chunks of 32) segfaults
  # jaxlib 0.10.2's CPU backend (its "ynn" fusion, as gated_linear.chunked's docstring says).
  a, long, wide = _arrays(), _arrays(40, 2, 1), _arrays(128)
  qkv = (a["q"], a["k"], a["v"])
  cases = family_cases(a)
  for name, fn, args, impls in _extra_calls(a, long):
    reference = _impl(fn, "reference")
    cases += [Case(f"{name}[{impl}]", _impl(fn, impl), reference, args) for impl in impls]
  # The fast paths called directly (Pallas in interpret mode).
  stats = dict(is_causal=True, return_stats=True)
  stats_reference = _dense_reference(**stats)  # one object: one reference jvp for both
  sizes = pallas_gpu.BlockSizes(16, 16, 16, 16)
  splash_kw = dict(
    is_causal=True,
    softcap=2.0,
    scale=0.5,
    segment_ids=jnp.asarray(np.repeat([[0, 1]], [50, 78], axis=1)),
  )
  cases += [
    Case(
      "kernels.blockwise.attention[softmax, stats]",
      lambda q, k, v, s: blockwise.attention(q, k, v, sink_logits=s, block_q=8, block_k=8, **stats),
      stats_reference,
      qkv + (a["sink"],),
    ),
    Case(
      "kernels.pallas_gpu.attention[softmax, stats]",
      lambda q, k, v, s: pallas_gpu.attention(
        q, k, v, sink_logits=s, block_sizes=sizes, interpret=True, **stats
      ),
      stats_reference,
      qkv + (a["sink"],),
    ),
    Case(
      "kernels.pallas_gpu.attention[sigmoid]",
      lambda q, k, v: pallas_gpu.attention(
        q, k, v, is_causal=True, normalizer="sigmoid", block_sizes=sizes, interpret=True
      ),
      _dense_reference(is_causal=True, normalizer="sigmoid"),
      qkv,
    ),
    Case(
      "kernels.pallas_tpu.attention[softmax, stats]",
      lambda q, k, v, s: pallas_tpu.attention(
        q,
        k,
        v,
        sink_logits=s,
        block_sizes=pallas_tpu.BlockSizes(128, 128, 128, 128),
        interpret=True,
        **stats,
      ),
      stats_reference,
      qkv + (a["sink"],),
    ),
    # Splash (jax's TPU kernel, reverse mode only) with the block-wise engine's tangent;
    # interpret mode takes blocks of 128.
    Case(
      "kernels.splash.attention[softmax, sinks, segments]",
      lambda q, k, v, s: splash.attention(q, k, v, sink_logits=s, interpret=True, **splash_kw),
      _dense_reference(**splash_kw),
      (wide["q"], wide["k"], wide["v"], wide["sink"]),
    ),
  ]
  return tuple(cases)


def _case(name: str) -> Case:
  return next(c for c in _cases() if c.name == name)


def _tangents(args: tuple) -> tuple:
  rng = np.random.default_rng(1)
  return tuple(jnp.asarray(0.5 * rng.standard_normal(np.shape(x)).astype(np.float32)) for x in args)


_REFERENCE_JVPS: dict = {}


def _reference_jvp(case: Case):
  """``jax.jvp`` of the case's reference, computed once per reference and arguments."""
  key = (id(case.reference), id(case.args[0]), len(case.args))
  if key not in _REFERENCE_JVPS:
    _REFERENCE_JVPS[key] = jax.jit(lambda p, t: jax.jvp(case.reference, p, t))(
      case.args, _tangents(case.args)
    )
  return _REFERENCE_JVPS[key]


@pytest.mark.parametrize("name", [c.name for c in _cases()])
def test_jvp_equals_the_reference(name):
  case = _case(name)
  got = jax.jit(lambda p, t: jax.jvp(case.fast, p, t))(case.args, _tangents(case.args))
  assert_close(got, _reference_jvp(case), f"{name} jvp", **TOL)


def test_every_registered_family_has_its_calls():
  walked = {c.name.split("[")[0] for c in family_cases(_arrays())}
  for op in _op.OPS.values():
    assert op.samples(), f"{op.name} supplies no sample call (Op.samples)"
    assert {s.name for s in op.samples()} <= walked, op.name


def test_the_walk_covers_every_function():
  walked = {c.name.split("[")[0].split("/")[0] for c in _cases()}
  public = {name for name in attnjax.__all__ if name.endswith("_attention")}
  assert public <= walked, sorted(public - walked)
  # Every dense engine: through dot_product_attention, its kernel entry, or (cuDNN, which
  # needs a GPU) in test_forward_mode_lowers_for_gpus_and_tpus; mosaic_gpu takes bf16/fp16 only
  # (beyond this walk's float32 tolerance): its jvp is checked in tests/test_mosaic_gpu.py.
  engines = {
    c.name.split("[")[1].rstrip("]") for c in _cases() if c.name.startswith("dot_product_attention")
  }
  engines |= {c.name.split(".")[1] for c in _cases() if c.name.startswith("kernels.")}
  assert set(dense.IMPLEMENTATIONS) - {"reference", "cudnn", "mosaic_gpu"} <= engines, engines


# jax 0.12 deprecates the Pallas Triton backend: lowering its kernels warns (tests/test_export.py).
@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
@pytest.mark.usefixtures("all_kernels")
@pytest.mark.parametrize("normalizer", ["softmax", "sigmoid"])
def test_forward_mode_lowers_for_gpus_and_tpus(normalizer):
  # Auto-dispatch's GPU and TPU kernels (cuDNN where this host has its library, Pallas
  # Triton, splash) with jax.jvp and both orders of Hessian-vector products lower from here.
  q = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
  kw = dict(is_causal=True, normalizer=normalizer)
  f = lambda q, k, v: attnjax.dot_product_attention(q, k, v, **kw)
  loss = lambda *p: jnp.sum(jnp.sin(f(*p).astype(jnp.float32)))
  grad = jax.grad(loss, argnums=(0, 1, 2))
  program = jax.jit(
    lambda p, t: (
      jax.jvp(f, p, t),
      jax.jvp(grad, p, t),
      jax.grad(lambda *x: jax.jvp(loss, x, t)[1], argnums=(0, 1, 2))(*p),
    )
  )
  targets = {
    "cudnn": "__cudnn$fmha",
    "pallas_gpu": pallas_gpu.TRITON_CALL_TARGET,
    "splash": "tpu_custom_call",
    "pallas_tpu": pallas_tpu.MOSAIC_CALL_TARGET,
  }
  chosen = dense.dispatch_table(*dense.prepare(q, q, q, **kw))
  for platform in ("cuda", "tpu"):
    text = program.trace((q, q, q), (q, q, q)).lower(lowering_platforms=(platform,)).as_text()
    if chosen[platform] in targets:
      assert f"custom_call @{targets[chosen[platform]]}" in text, (platform, chosen)


# ---------------------------------------------------------------------------
# The custom-VJP engines: linearize, Hessian-vector products, and reverse mode unchanged.

# By default: the chunk scan with custom-VJP pieces inside (the delta rule's solve) and a kernel
# with a twin (Pallas). With the slow tests: the GLA chunks (the costliest to compile, ~10 s),
# the scalar-decay scan, and the block-wise kernel (tests/test_flex.py and
# tests/test_blockwise.py check its second order by default).
# The Pallas kernel by default; the recurrent engines' second order (10-16 s of compiles each)
# and the block-wise one (also in test_flex / test_blockwise) with -m slow.
SECOND_ORDER = (
  "kernels.pallas_gpu.attention[softmax, stats]",
  *(
    pytest.param(name, marks=pytest.mark.slow)
    for name in (
      "delta_rule_attention[chunked]",
      "gated_linear_attention/per_channel[chunked]",
      "gated_linear_attention[chunked]",
      "kernels.blockwise.attention[softmax, stats]",
    )
  ),
)
ENGINES = tuple(getattr(name, "values", (name,))[0] for name in SECOND_ORDER)


def _differentiated(y):
  """The outputs reverse mode differentiates: the output, and the logsumexp of statistics."""
  return (y[0], y[1].logsumexp) if isinstance(y, tuple) else y


def _second_order(f: Callable, args: tuple, t: tuple):
  """``jax.linearize`` of ``f`` applied to ``t``, and the jvp of the grad and the grad of the
  jvp of ``sum(sin(f))`` at ``args`` along ``t`` (both orders of Hessian-vector products)."""
  loss = lambda *p: sum(jnp.sum(jnp.sin(y)) for y in jax.tree.leaves(_differentiated(f(*p))))
  every = tuple(range(len(args)))
  fwd_over_rev = jax.jvp(jax.grad(loss, argnums=every), args, t)[1]
  rev_over_fwd = jax.grad(lambda *p: jax.jvp(loss, p, t)[1], argnums=every)(*args)
  return jax.linearize(f, *args)[1](*t), fwd_over_rev, rev_over_fwd


_REFERENCE_SECOND_ORDER: dict = {}


@pytest.mark.parametrize("name", SECOND_ORDER)
def test_linearize_and_hessian_vector_products(name):
  case = _case(name)
  t = _tangents(case.args)
  key = (id(case.reference), id(case.args[0]), len(case.args))
  if key not in _REFERENCE_SECOND_ORDER:
    _REFERENCE_SECOND_ORDER[key] = jax.jit(lambda p, t: _second_order(case.reference, p, t))(
      case.args, t
    )
  want = _REFERENCE_SECOND_ORDER[key]
  got = jax.jit(lambda p, t: _second_order(case.fast, p, t))(case.args, t)
  for what, x, y in zip(("linearize", "jvp of grad", "grad of jvp"), got, want):
    assert_close(x, y, f"{name} {what}", **TOL)


def _linear_maps(jaxpr) -> list[str]:
  """Names of the linear-map primitives in a jaxpr and its sub-jaxprs (``<kernel>.<direction>``)."""
  names = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "attnjax_linear_map":
      names.append(eqn.params["m"].name)
    for sub in jax_core.jaxprs_in_params(eqn.params):
      names += _linear_maps(sub)
  return names


@pytest.mark.parametrize("name", ENGINES)
def test_reverse_mode_runs_the_hand_written_backward(name):
  # jax.grad transposes the tangent map into the engine's backward (it never evaluates the
  # tangent or transposes the forward); jax.jvp evaluates the tangent and runs no backward.
  case = _case(name)
  loss = lambda *p: sum(jnp.sum(y) for y in jax.tree.leaves(_differentiated(case.fast(*p))))
  grad = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*case.args).jaxpr
  jvp = jax.make_jaxpr(lambda p, t: jax.jvp(case.fast, p, t))(case.args, case.args).jaxpr
  assert [n for n in _linear_maps(grad) if n.endswith(".backward")], _linear_maps(grad)
  assert not [n for n in _linear_maps(grad) if n.endswith(".tangent")], _linear_maps(grad)
  assert [n for n in _linear_maps(jvp) if n.endswith(".tangent")], _linear_maps(jvp)
  assert not [n for n in _linear_maps(jvp) if n.endswith(".backward")], _linear_maps(jvp)


def test_pallas_forward_mode_runs_the_kernel_and_reverse_mode_never_the_twin(monkeypatch):
  # The Pallas kernel's twin (the block-wise engine) gives the tangent and second order only:
  # lowering jax.grad never traces it; lowering jax.jvp runs the Pallas forward and the twin.
  args = _case("kernels.pallas_gpu.attention[softmax, stats]").args
  sizes = pallas_gpu.BlockSizes(16, 16, 16, 16)
  fast = lambda q, k, v, s: pallas_gpu.compute(  # not the jitted entry: traced anew here
    *options.validate(q, k, v, sink_logits=s, is_causal=True, return_stats=True),
    block_sizes=sizes,
    interpret=True,
  )
  calls = []
  for module, fn in (
    (blockwise_kernel, "run"),
    (pallas_kernel, "forward"),
    (pallas_backward, "backward"),
  ):
    real = getattr(module, fn)
    monkeypatch.setattr(
      module,
      fn,
      functools.partial(lambda real, name, *a, **k: calls.append(name) or real(*a, **k), real, fn),
    )
  loss = lambda *p: sum(jnp.sum(y) for y in jax.tree.leaves(_differentiated(fast(*p))))
  jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(*args)
  assert "forward" in calls and "backward" in calls and "run" not in calls, calls
  calls.clear()
  jax.jit(lambda p, t: jax.jvp(fast, p, t)).lower(args, args)
  assert "forward" in calls and "run" in calls and "backward" not in calls, calls
