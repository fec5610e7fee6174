"""Helpers shared by the test files: random attention inputs and tree-wise closeness (chex)."""

from __future__ import annotations

from typing import Any, Literal

import chex
import jax
import jax.numpy as jnp
import numpy as np


def rand_qkv(
  B: int = 2,
  T: int = 12,
  S: int | None = None,
  N: int = 8,
  K: int = 2,
  H: int = 16,
  Hv: int | None = None,
  *,
  seed: int = 0,
  dtype: Any = jnp.float32,
  scales: tuple[float, float, float] = (1.0, 1.0, 1.0),
  source: Literal["jax", "numpy"] = "numpy",
):
  """Standard-normal ``q [B, T, N, H]``, ``k [B, S, K, H]``, ``v [B, S, K, Hv]``.

  Args:
    B, T, S, N, K, H, Hv: the shape letters of docs/guides/dense.md; ``S`` defaults
      to ``T`` and ``Hv`` to ``H``.
    seed: the draw.
    dtype: the arrays' dtype.
    scales: factors multiplying ``q``, ``k`` and ``v`` after the draw.
    source: ``"numpy"`` (the default) draws q, k, v in that order from
      ``np.random.default_rng(seed)`` in float32, scales them there and casts
      them to ``dtype``: no XLA program is compiled per shape (a
      ``jax.random.normal`` of a new shape costs a ~70 ms compile, and the suite
      draws hundreds of shapes); ``"jax"`` draws ``jax.random.normal`` in
      ``dtype`` from the three keys of ``jax.random.split(jax.random.key(seed), 3)``.

  Returns:
    ``(q, k, v)``.
  """
  S = T if S is None else S
  Hv = H if Hv is None else Hv
  shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, Hv))
  if source == "jax":
    keys = jax.random.split(jax.random.key(seed), 3)
    arrays = [jax.random.normal(key, shape, dtype) for key, shape in zip(keys, shapes)]
    return tuple(x if c == 1.0 else x * c for x, c in zip(arrays, scales))
  if source != "numpy":
    raise ValueError(f"source={source!r} is not one of: 'jax', 'numpy'")
  rng = np.random.default_rng(seed)
  return tuple(
    jnp.asarray(rng.standard_normal(shape, np.float32) * np.float32(c), dtype)
    for shape, c in zip(shapes, scales)
  )


def reduction_tolerance(dtype: Any, length: int, *, depth: int = 1, scale: float = 1.0) -> float:
  """An absolute tolerance for two results whose reductions ran in different orders.

  Rounding ``length`` terms in another order changes a sum by about
  ``eps * sqrt(length)`` of its scale (the rounding errors add as a random walk; the
  worst case is ``eps * length``); ``depth`` reductions in sequence (layers, matmuls, a
  softmax's sums) add theirs. Sharded against unsharded, jit against op by op, packed
  against separate rows, another CPU's vector width: each reorders the same sums. The
  result scales with ``scale``, the largest magnitude compared, and never depends on the
  machine it was first tried on.

  Args:
    dtype: the dtype the reductions accumulate in.
    length: the longest reduction (a contraction's length, a row of keys).
    depth: how many reductions the compared values pass through in sequence.
    scale: the size of the compared values (e.g. the largest ``|expected|``).

  Returns:
    The tolerance: ``eps(dtype) * sqrt(length) * depth * scale``.
  """
  return float(jnp.finfo(dtype).eps) * float(np.sqrt(length)) * depth * float(scale)


def assert_close(
  actual: Any,
  expected: Any,
  what: str = "",
  *,
  rtol: float = 2e-5,
  atol: float = 2e-5,
  scaled: bool = False,
) -> None:
  """``chex.assert_trees_all_close`` on two pytrees with the same leaves.

  One call compares outputs, states and every gradient: each leaf pair must
  satisfy ``|actual - expected| <= atol + rtol * |expected|`` (numpy's
  ``assert_allclose``). Leaves pair up in flattening order, so the containers
  may differ (a tuple against a list, a NamedTuple against a tuple) as long as
  the leaves do. The failure message names the leaf's path in ``actual`` and
  ends with ``[what]``.

  With ``scaled=True`` each leaf's ``atol`` is relative to its scale,
  ``max(1, max |expected|)``: float32 reordering errors follow the largest term of a
  sum, not each entry, so entries near zero of a large array get the array's share.
  """
  named = jax.tree_util.tree_leaves_with_path(actual)
  leaves = jax.tree.leaves(expected)
  if len(named) != len(leaves):
    raise AssertionError(
      f"{what}: {len(named)} leaves in actual, {len(leaves)} in expected: "
      f"{[jax.tree_util.keystr(path) for path, _ in named]}"
    )
  if scaled:
    for (path, a), b in zip(named, leaves):
      a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
      where = f"{jax.tree_util.keystr(path)} [{what}]"
      assert a.shape == b.shape, f"{where}: shapes {a.shape} and {b.shape}"
      scale = max(1.0, float(np.max(np.abs(b), initial=0.0, where=np.isfinite(b))))
      np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * scale, err_msg=where)
    return
  treedef = jax.tree.structure(actual)
  if jax.tree.structure(expected) != treedef:
    expected = jax.tree.unflatten(treedef, leaves)
  chex.assert_trees_all_close(actual, expected, rtol=rtol, atol=atol, custom_message=what or None)


def outputs_and_grads(fn, *args):
  """One compiled call: ``fn(*args)``'s result and the gradients, with respect to every
  argument, of a loss on it.

  The loss weights the output (``fn``'s result, or its first element when ``fn`` returns
  ``(out, stats)``) by a fixed cotangent and, with statistics, adds ``sin`` of the
  logsumexp (the one statistic that carries a gradient).
  """

  def loss(*args):
    res = fn(*args)
    out, stats = res if isinstance(res, tuple) else (res, None)
    ct = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    total = jnp.sum(out.astype(jnp.float32) * ct)
    if stats is not None:
      total = total + jnp.sum(jnp.sin(stats.logsumexp))
    return total, res

  (_, res), grads = jax.jit(
    jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True)
  )(*args)
  return res, grads


def preset_train_step(
  preset: str,
  variant: str,
  *,
  d_model: int,
  num_heads: int,
  seq_len: int,
  batch_size: int,
  stats: bool | None = None,
  implementation: str | None = None,
):
  """``(step, state, rest)``: ``preset``'s real training step (optimizer included) for a
  one-layer model of the given size, keeping the preset's other options (dtype, dispatch,
  per-step statistics unless ``stats`` overrides them; ``implementation`` sets the attention
  implementation, default the preset's automatic one). Not jitted."""
  from flax import nnx

  from attnjax._src.train import optim
  from attnjax._src.train.config import apply_preset, base_config
  from attnjax._src.train.model import build_model
  from attnjax._src.train.step import make_train_step

  cfg = apply_preset(base_config(), preset)
  cfg.variant = variant
  cfg.model.update(d_model=d_model, num_layers=1, num_heads=num_heads, mlp_ratio=1)
  cfg.data.update(seq_len=seq_len, batch_size=batch_size)
  cfg.train.microbatches = 1
  if implementation is not None:
    cfg.model.implementation = implementation
  model = build_model(cfg, 64, seed=0)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  opt = optim.make_optimizer(cfg)
  state = {
    "params": params,
    "opt_state": opt.init(params),
    "step": jnp.zeros((), jnp.int32),
    "initial_loss": jnp.zeros((), jnp.float32),
  }
  step = make_train_step(graphdef, opt, stats=cfg.train.step_stats if stats is None else stats)
  return step, state, rest


def check_dense_kernel(
  kernel,
  structure: dict,
  *,
  normalizer: str,
  T: int,
  S: int,
  gqa: bool = True,
  dtype: Any = jnp.float32,
  stats: bool = False,
  sink: bool = False,
  softcap: float | None = None,
  seed: int = 0,
  score_args: Any = None,
  name: str = "kernel",
  grad: bool = True,
  tol: float | None = None,
  stats_tol: float | None = None,
  H: int = 16,
) -> None:
  """Values, statistics and gradients (q, k, v, sink logits, ``score_mod`` arguments) of a
  dense kernel against :func:`attnjax.dense.reference` (in float32 on the same, rounded,
  inputs).

  ``kernel(inputs, opts)`` runs the kernel on :func:`attnjax.dense.prepare`'s output;
  ``structure`` holds the mask options (``is_causal``, ``window``, ``segment_ids``,
  ``mask_mod``, ...). Inputs are ``B=2``, head dim ``H``, ``(N, K) = (4, 2)`` with ``gqa``
  else ``(2, 2)``; the loss weights the output by a random cotangent and adds ``sin`` of the
  logsumexp statistic (which carries a gradient). Each leaf must agree within ``tol``
  (default 2e-5 for float32, 3e-2 for 16-bit inputs) of its largest reference entry (at
  least 1); the statistics' values within ``stats_tol`` when given (an engine that computes
  them from float32 logits of 16-bit inputs). ``grad=False`` compares values and statistics
  only.
  """
  from attnjax._src.ops.dense import attention as dense

  N, K = (4, 2) if gqa else (2, 2)
  q, k, v = rand_qkv(B=2, T=T, S=S, N=N, K=K, H=H, dtype=dtype, seed=seed)
  sink_logits = jnp.linspace(-1.0, 1.0, N) if sink else None
  kw = dict(structure, normalizer=normalizer, softcap=softcap, return_stats=stats)
  cot = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((2, T, N, H), np.float32))

  def run(impl, q, k, v, sink_logits, score_args):
    extra = {} if sink_logits is None else dict(sink_logits=sink_logits)
    if score_args is not None:
      extra["score_mod_args"] = score_args
    if impl == name:
      return kernel(*dense.prepare(q, k, v, **kw, **extra))
    up = lambda x: x.astype(jnp.float32)
    return dense.reference(*dense.prepare(up(q), up(k), up(v), **kw, **extra))

  def loss(impl, *args):
    r = run(impl, *args)
    out, st = r if stats else (r, None)
    total = jnp.sum(out.astype(jnp.float32) * cot)
    if stats:
      total = total + jnp.sum(jnp.sin(st.logsumexp))
    return total, r

  argnums = (0, 1, 2) + ((3,) if sink else ()) + ((4,) if score_args is not None else ())
  results = {}
  for impl in (name, "reference"):
    if grad:
      fn = jax.jit(
        jax.value_and_grad(lambda *a, impl=impl: loss(impl, *a), argnums=argnums, has_aux=True)
      )
      (_, r), grads = fn(q, k, v, sink_logits, score_args)
      results[impl] = (r, grads)
    else:
      results[impl] = (
        jax.jit(lambda *a, impl=impl: run(impl, *a))(q, k, v, sink_logits, score_args),
      )
  if tol is None:
    tol = 2e-5 if dtype == jnp.float32 else 3e-2
  what = f"{name} {normalizer} {structure} gqa={gqa} {jnp.dtype(dtype).name} stats={stats}"
  got, want = jax.tree.leaves(results[name]), jax.tree.leaves(results["reference"])
  assert len(got) == len(want), what
  names = jax.tree_util.tree_leaves_with_path(results["reference"])
  for (path, _), a, b in zip(names, got, want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape, (what, path)
    scale = max(1.0, float(np.max(np.abs(b))))
    err = float(np.max(np.abs(a - b))) / scale
    # results: (value, ...) with value = out or (out, stats): path[1] == 1 is a statistic
    is_stat = stats and len(path) > 2 and getattr(path[1], "idx", None) == 1
    limit = stats_tol if is_stat and stats_tol is not None else tol
    assert err < limit, f"{what} {jax.tree_util.keystr(path)}: error {err:.2e} (scale {scale:.2g})"


def softpick_f64(q, k, v, segment_ids):
  """Causal softpick over packed segments written out in float64 (``e^z - 1`` by ``expm1``,
  nothing rounded to float32: ``dense.reference`` takes its logits in float32), for the
  kernels' per-row gradient checks. Returns ``(out [B, T, N, H], logits [B, N, T, T],
  allowed [B, 1, T, T])``; ``k`` and ``v`` may have fewer heads (GQA)."""
  T, N, H = q.shape[1], q.shape[2], q.shape[-1]
  rep = N // k.shape[2]
  kk, vv = jnp.repeat(k, rep, 2), jnp.repeat(v, rep, 2)
  z = jnp.einsum("btnh,bsnh->bnts", q, kk) * H**-0.5
  seg = np.asarray(segment_ids)
  allowed = (np.tril(np.ones((T, T), bool))[None] & (seg[:, :, None] == seg[:, None, :]))[:, None]
  c = jnp.where(allowed, jnp.expm1(jnp.where(allowed, z, 0.0)), 0.0)
  w = jnp.maximum(c, 0.0) / (jnp.sum(jnp.abs(c), -1, keepdims=True) + 1e-6)
  return jnp.einsum("bnts,bsnh->btnh", w, vv), z, allowed


def run_kernel(module, inputs, opts, **options):
  """A kernel module's engine (the dense op's engine named as the module, e.g.
  ``attnjax.kernels.pallas_gpu``) on a validated dense call, through the one engine runner
  (``interpret=True`` runs a Pallas kernel on any backend)."""
  from attnjax._src import op

  name = module.__name__.rsplit(".", 1)[-1]
  return op.run_engine(op.OPS["dense"].engines[name], (inputs, opts), **options)
