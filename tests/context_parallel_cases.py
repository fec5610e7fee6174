"""Context-parallel cases, run in a process of their own on forced host devices.

``python tests/context_parallel_cases.py '<json list of cases>'`` runs each case
(a dict, see :func:`run_case`) inside ``jax.shard_map`` over a mesh axis of
``P`` host devices and prints one JSON line per case: the largest error of the
output, every statistic and every gradient against the unsharded
``attnjax`` call, each relative to the reference's largest magnitude
(``{"case": ..., "errors": {name: error}}``, or ``{"case": ..., "error": message}``
when the call raised). ``tests/test_context_parallel.py`` starts it with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (set before jax is imported).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import attnjax
from attnjax._src import op as _op, mods, parallel

AXIS = "ctx"


def _alibi(z, b, n, i, j, slopes):
  return mods.alibi(z, b, n, i, j, slopes)


def _documents(b, n, i, j, doc):
  return doc[i] == doc[j]


def arrays(case: dict) -> dict:
  """The case's inputs (natural token order), seeded by the case."""
  rng = np.random.default_rng(case.get("seed", 0))
  B, T, N, H = 1, case["T"], 4, 8
  K = {"mha": N, "gqa": 2, "mqa": 1}[case.get("heads", "mha")]
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  out = {"q": f(B, T, N, H), "k": f(B, T, K, H), "v": f(B, T, K, H)}
  if case.get("sinks"):
    out["sink_logits"] = f(N)
  if case.get("score_mod"):
    out["score_mod_args"] = (jnp.asarray(rng.uniform(0.1, 1.0, N), jnp.float32),)
  if case.get("mask") == "segments":
    cuts = np.sort(rng.choice(np.arange(1, T), 3, replace=False))
    out["segment_ids"] = jnp.asarray(
      np.searchsorted(cuts, np.arange(T), side="right")[None], jnp.int32
    )
  if case.get("mask") == "mask_mod":
    out["mask_mod_args"] = (jnp.asarray(np.arange(T) // (T // 3 + 1), jnp.int32),)
  return out


def sparse_pattern(name: str, T: int):
  """A :mod:`attnjax.patterns` pattern for a case's whole length ``T``."""
  patterns = attnjax.patterns
  return {
    "sliding_window": lambda: patterns.sliding_window(T // 8 + 3),
    "strided": lambda: patterns.strided(T // 8),
    "fixed": lambda: patterns.fixed(T // 4, 3),
    "global_window": lambda: patterns.global_window(3, (T // 16, T // 16)),
    "bigbird": lambda: patterns.bigbird(T // 16, 1, 1, 2, seed=3),
    "sinks_window": lambda: patterns.sinks_window(4, T // 8),
    "dilated_window": lambda: patterns.dilated_window(5, 3),
    "causal_global": lambda: patterns.global_window(2, T // 8) & patterns.causal(),
  }[name]()


def keywords(case: dict) -> dict:
  mask = case.get("mask", "causal")
  kw = dict(normalizer=case.get("normalizer", "softmax"), return_stats=case.get("stats", True))
  if mask in ("causal", "segments", "mask_mod"):
    kw["is_causal"] = True
  if mask == "window":
    kw["window"] = (case["T"] // 8 + 3, 0)
  if mask == "mask_mod":
    kw["mask_mod"] = _documents
  if case.get("score_mod"):
    kw["score_mod"] = _alibi
  if case.get("pattern"):  # sparse_attention: the pattern stands for is_causal and window
    kw.pop("is_causal", None)
    kw.pop("window", None)
    kw["pattern"] = sparse_pattern(case["pattern"], case["T"])
  return kw


def _values_and_grads(mesh, loss, sharded_call, reference, *args):
  """``(got, g_got, want, g_want)``: ``loss(call, *args)``'s aux result and gradients (with
  respect to ``args[0]``) of the sharded call under ``mesh``, and of the reference."""
  with jax.set_mesh(mesh):
    (_, got), g_got = jax.jit(
      jax.value_and_grad(functools.partial(loss, sharded_call), has_aux=True)
    )(*args)
  (_, want), g_want = jax.jit(jax.value_and_grad(functools.partial(loss, reference), has_aux=True))(
    *args
  )
  return got, g_got, want, g_want


def run_recurrent_case(case: dict) -> dict:
  """Errors of a recurrent-family case: ``family`` (gated_linear / delta_rule), ``P``, ``T``,
  ``gla`` (per-channel gates), ``segments``, ``initial_state``, ``chunk_size``."""
  Pn, T = case["P"], case["T"]
  mesh = jax.make_mesh(
    (Pn,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:Pn]
  )
  rng = np.random.default_rng(case.get("seed", 0))
  B, N, K, H = 1, 4, 2, 8
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  k = f(B, T, K, H)
  if case["family"] == "delta_rule":
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
  gate_shape = (B, T, N, H) if case.get("gla") else (B, T, N)
  diff = {
    "q": f(B, T, N, H),
    "k": k,
    "v": f(B, T, K, H),
    "log_decay": jnp.asarray(-rng.uniform(0.01, 0.5, gate_shape), jnp.float32),
  }
  if case["family"] == "delta_rule":
    diff["beta"] = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, N)), jnp.float32)
  if case.get("initial_state"):
    diff["initial_state"] = f(B, N, H, H)
  rest = {}
  if case.get("segments"):
    cuts = np.sort(rng.choice(np.arange(1, T), 3, replace=False))
    cuts[0] = T // Pn  # one reset exactly at a shard boundary
    rest["segment_ids"] = jnp.asarray(
      np.searchsorted(np.sort(cuts), np.arange(T), side="right")[None], jnp.int32
    )
  fn = {"gated_linear": attnjax.gated_linear_attention, "delta_rule": attnjax.delta_rule_attention}[
    case["family"]
  ]
  kw = dict(chunk_size=case.get("chunk_size", 8), return_state=True)
  sharded = {"q", "k", "v", "log_decay", "beta", "segment_ids"}

  def reference(**a):
    q, k, v = a.pop("q"), a.pop("k"), a.pop("v")
    beta = (a.pop("beta"),) if "beta" in a else ()
    return fn(q, k, v, *beta, **a, **kw)

  def sharded_call(**a):
    names = sorted(a)
    specs = tuple(P(None, AXIS) if n in sharded else P() for n in names)

    def local(*xs):
      return reference(**dict(zip(names, xs)), context_axis=AXIS)

    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P(None, AXIS), P()))(
      *(a[n] for n in names)
    )

  def loss(call, diff, rest):
    out, state = call(**diff, **rest)
    return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.sin(state)), (out, state)

  got, g_got, want, g_want = _values_and_grads(mesh, loss, sharded_call, reference, diff, rest)
  errors = {"out": _rel(got[0], want[0]), "state": _rel(got[1], want[1])}
  errors.update({f"d{n}": _rel(g_got[n], g_want[n]) for n in diff})
  return errors


def run_linear_case(case: dict) -> dict:
  """Errors of a ``linear_attention`` case: ``P``, ``T``, ``causal``, ``implementation``,
  ``normalize``, ``feature_map`` (elu_plus_one / favor: FAVOR+ without stabilising, its
  projection differentiated), ``initial_state``, ``heads`` (mha / gqa), ``chunk_size``,
  ``stats``."""
  Pn, T = case["P"], case["T"]
  mesh = jax.make_mesh(
    (Pn,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:Pn]
  )
  rng = np.random.default_rng(case.get("seed", 0))
  B, N, H = 1, 4, 8
  K = {"mha": N, "gqa": 2}[case.get("heads", "gqa")]
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  diff = {"q": f(B, T, N, H), "k": f(B, T, K, H), "v": f(B, T, K, H)}
  if case.get("feature_map") == "favor":
    fmap = attnjax.feature_maps.favor_plus(
      jax.random.key(case.get("seed", 0)), 16, head_dim=H, stabilize=False
    )
    diff["projection"] = fmap.projection
  else:
    fmap = attnjax.feature_maps.elu_plus_one
  F = fmap.num_features(H)
  if case.get("initial_state"):
    diff["initial_state"] = attnjax.linear.LinearState(
      f(B, K, F, H), jnp.asarray(rng.uniform(0.5, 2.0, (B, K, F)), jnp.float32)
    )
  kw = dict(
    is_causal=case.get("causal", True),
    normalize=case.get("normalize", "denominator"),
    implementation=case.get("implementation"),
    chunk_size=case.get("chunk_size", 8),
    return_state=True,
  )
  stats = bool(case.get("stats"))
  if stats:
    kw["return_stats"] = True  # sink mass, entropy and row sum over the whole sequence's rows
  sharded = {"q", "k", "v"}

  def reference(**a):
    q, k, v = a.pop("q"), a.pop("k"), a.pop("v")
    # The projection as an argument (a traced array): its gradient is checked.
    fm = (
      fmap if "projection" not in a else dataclasses.replace(fmap, projection=a.pop("projection"))
    )
    return attnjax.linear_attention(q, k, v, feature_map=fm, **a, **kw)

  def sharded_call(**a):
    names = sorted(a)
    specs = tuple(P(None, AXIS) if n in sharded else P() for n in names)

    def local(*xs):
      return reference(**dict(zip(names, xs)), context_axis=AXIS)

    out_specs = (P(None, AXIS), P())
    if stats:
      out_specs = (out_specs, P())
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs)(
      *(a[n] for n in names)
    )

  # normalize="none" sums O(T) unnormalised terms per row: the loss sees them divided by T,
  # else float32 summation order alone (sharded or not) moves its gradients by ~|out| ulps.
  out_scale = 1.0 / T if kw["normalize"] in ("none", False) else 1.0

  def loss(call, diff):
    result = call(**diff)
    (out, state), st = result if stats else (result, None)
    out = out * out_scale
    total = jnp.sum(out * jnp.cos(out))
    total = total + sum(jnp.sum(jnp.sin(s)) for s in state)
    if stats:  # the statistics carry gradients (through the feature maps)
      total = total + sum(jnp.sum(jnp.sin(x)) for x in (st.sink_mass, st.entropy, st.row_sum))
    return total, (out, state, st)

  got, g_got, want, g_want = _values_and_grads(mesh, loss, sharded_call, reference, diff)
  errors = {
    "out": _rel(got[0], want[0]),
    "kv_sum": _rel(got[1].kv_sum, want[1].kv_sum),
    "k_sum": _rel(got[1].k_sum, want[1].k_sum),
  }
  if stats:
    for field in ("sink_mass", "entropy", "row_sum"):
      errors[field] = _rel(getattr(got[2], field), getattr(want[2], field))
  for n in diff:
    for i, (a, b) in enumerate(zip(jax.tree.leaves(g_got[n]), jax.tree.leaves(g_want[n]))):
      errors[f"d{n}{'' if i == 0 else i}"] = _rel(a, b)
  return errors


def run_mla_case(case: dict) -> dict:
  """Errors of an ``mla_attention`` case: ``strategy``, ``P``, ``T``, ``absorb``, ``sinks``,
  ``stats``, ``layout``: causal, ``q``, ``k_rope`` and ``latent`` sharded along time, the
  up-projections whole (and differentiated)."""
  Pn, T, layout = case["P"], case["T"], case.get("layout", "contiguous")
  mesh = jax.make_mesh(
    (Pn,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:Pn]
  )
  rng = np.random.default_rng(case.get("seed", 0))
  B, N, R, d_n, d_r, d_v = 1, 4, 16, 6, 2, 8
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  diff = {
    "q": f(B, T, N, d_n + d_r),
    "k_rope": f(B, T, 1, d_r),
    "latent": f(B, T, 1, R),
    "w_uk": 0.3 * f(R, N, d_n),
    "w_uv": 0.3 * f(R, N, d_v),
  }
  if case.get("sinks"):
    diff["sink_logits"] = f(N)
  stats = case.get("stats", True)
  kw = dict(is_causal=True, absorb=case.get("absorb"), return_stats=stats)
  sharded = {"q", "k_rope", "latent"}
  order = (lambda x: parallel.zigzag(x, Pn, 1)) if layout == "zigzag" else (lambda x: x)
  natural = (
    (lambda x, axis=1: parallel.unzigzag(x, Pn, axis))
    if layout == "zigzag"
    else (lambda x, axis=1: x)
  )

  def reference(**a):
    return attnjax.mla_attention(
      a.pop("q"), a.pop("k_rope"), a.pop("latent"), a.pop("w_uk"), a.pop("w_uv"), **a, **kw
    )

  def sharded_call(**a):
    names = sorted(a)
    specs = tuple(P(None, AXIS) if n in sharded else P() for n in names)
    stat_specs = attnjax.AttentionStats(P(), P(), P(), P(None, None, AXIS), P())

    def local(*xs):
      return reference(
        **dict(zip(names, xs)),
        context_axis=AXIS,
        context_strategy=case["strategy"],
        context_layout=layout,
      )

    out_specs = (P(None, AXIS), stat_specs) if stats else P(None, AXIS)
    result = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs)(
      *(order(a[n]) if n in sharded else a[n] for n in names)
    )
    if not stats:
      return natural(result)
    out, st = result
    return natural(out), st._replace(logsumexp=natural(st.logsumexp, 2))

  def loss(call, diff):
    result = call(**diff)
    out, st = result if stats else (result, None)
    total = jnp.sum(out * jnp.cos(out))
    if st is not None:
      total = total + jnp.sum(jnp.sin(st.logsumexp))
    return total, result

  with jax.set_mesh(mesh):
    (_, got), g_got = jax.jit(
      jax.value_and_grad(functools.partial(loss, sharded_call), has_aux=True)
    )(diff)
  (_, want), g_want = jax.jit(jax.value_and_grad(functools.partial(loss, reference), has_aux=True))(
    diff
  )
  errors = {}
  if stats:
    errors["out"] = _rel(got[0], want[0])
    for field in want[1]._fields:
      errors[field] = _rel(getattr(got[1], field), getattr(want[1], field))
  else:
    errors["out"] = _rel(got, want)
  errors.update({f"d{n}": _rel(g_got[n], g_want[n]) for n in diff})
  return errors


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / (1.0 + np.max(np.abs(b))))


def run_case(case: dict) -> dict:
  """Errors of one case: ``strategy``, ``P``, ``T``, ``layout``, ``normalizer``, ``mask``
  (causal / window / segments / bidirectional / mask_mod), ``heads`` (mha / gqa / mqa),
  ``sinks``, ``score_mod``, ``stats``; ``pattern`` (a :func:`sparse_pattern` name) makes it
  a ``sparse_attention`` call (``mask`` then adds only segments or a mask_mod), against the
  unsharded ``sparse_attention`` (its default, block-sparse path); ``implementation`` of
  the sharded call."""
  Pn, layout = case["P"], case.get("layout", "contiguous")
  mesh = jax.make_mesh(
    (Pn,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:Pn]
  )
  data = arrays(case)
  kw = keywords(case)
  stats = kw["return_stats"]
  diff_names = [n for n in ("q", "k", "v", "sink_logits", "score_mod_args") if n in data]
  sharded = {"q", "k", "v", "segment_ids"}
  order = (
    (lambda x, axis=1: parallel.zigzag(x, Pn, axis))
    if layout == "zigzag"
    else (lambda x, axis=1: x)
  )
  natural = (
    (lambda x, axis=1: parallel.unzigzag(x, Pn, axis))
    if layout == "zigzag"
    else (lambda x, axis=1: x)
  )

  def call(fn, diff, rest):
    return fn(**diff, **rest)

  family = attnjax.sparse_attention if case.get("pattern") else attnjax.dot_product_attention
  if case.get("implementation"):
    kw["implementation"] = case["implementation"]

  def reference(**a):
    return family(
      a.pop("q"),
      a.pop("k"),
      a.pop("v"),
      **a,
      **{n: x for n, x in kw.items() if n != "implementation"},
    )

  def sharded_call(**a):
    names = sorted(a)
    specs = tuple(P(None, AXIS) if n in sharded else P() for n in names)
    stat_specs = attnjax.AttentionStats(P(), P(), P(), P(None, None, AXIS), P())

    def local(*xs):
      b = dict(zip(names, xs))
      return family(
        b.pop("q"),
        b.pop("k"),
        b.pop("v"),
        **b,
        **kw,
        context_axis=AXIS,
        context_strategy=case["strategy"],
        context_layout=layout,
      )

    fn = jax.shard_map(
      local,
      mesh=mesh,
      in_specs=specs,
      out_specs=(P(None, AXIS), stat_specs) if stats else P(None, AXIS),
      check_vma=case.get("check_vma", True),
    )
    ins = [order(a[n]) if n in sharded else a[n] for n in names]
    result = fn(*ins)
    if not stats:
      return natural(result)
    out, st = result
    return natural(out), st._replace(logsumexp=natural(st.logsumexp, 2))

  def loss(fn, diff, rest):
    result = fn(**diff, **rest)
    out, st = result if stats else (result, None)
    total = jnp.sum(out * jnp.cos(out))
    if st is not None:
      total = total + jnp.sum(jnp.sin(st.logsumexp))
    return total, result

  diff = {n: data[n] for n in diff_names}
  rest = {n: x for n, x in data.items() if n not in diff}
  with jax.set_mesh(mesh):
    grad_cp = jax.jit(jax.value_and_grad(functools.partial(loss, sharded_call), has_aux=True))
    (_, got), g_got = grad_cp(diff, rest)
  grad_ref = jax.jit(jax.value_and_grad(functools.partial(loss, reference), has_aux=True))
  (_, want), g_want = grad_ref(diff, rest)

  def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / (1.0 + np.max(np.abs(b))))

  errors = {}
  if stats:
    errors["out"] = rel(got[0], want[0])
    for field in want[1]._fields:
      errors[field] = rel(getattr(got[1], field), getattr(want[1], field))
  else:
    errors["out"] = rel(got, want)
  for name in diff_names:
    for i, (a, b) in enumerate(zip(jax.tree.leaves(g_got[name]), jax.tree.leaves(g_want[name]))):
      errors[f"d{name}{'' if i == 0 else i}"] = rel(a, b)
  return errors


def run_sample_case(case: dict) -> dict:
  """Errors of an op's sample call (:attr:`attnjax._src.op.Op.samples`) sharded over ``P``
  devices: ``op``, ``P``, ``T``, ``sample`` (its index, default 0). Arrays ``[B, T, ...]`` are
  sharded along time, the others whole; the output, the final state (where the sample
  returns one) and the gradient of every array argument against the unsharded call."""
  Pn, T = case["P"], case["T"]
  mesh = jax.make_mesh(
    (Pn,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:Pn]
  )
  sample = _op.OPS[case["op"]].samples()[case.get("sample", 0)]
  rng = np.random.default_rng(case.get("seed", 0))
  B, N, K, H = 1, 4, 2, 8
  f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q, k, v, arrays = sample.inputs(f(B, T, N, H), f(B, T, K, H), f(B, T, K, H))
  diff = {"q": q, "k": k, "v": v, **arrays}
  kw = dict(sample.options, **({"return_state": True} if sample.state else {}))
  along_time = lambda x: jnp.ndim(x) >= 2 and jnp.shape(x)[:2] == (B, T)

  def reference(**a):
    return sample.function(a.pop("q"), a.pop("k"), a.pop("v"), **a, **kw)

  def sharded_call(**a):
    names = sorted(a)
    specs = tuple(P(None, AXIS) if along_time(a[n]) else P() for n in names)
    whole = jax.eval_shape(lambda: reference(**a))
    out_specs = jax.tree.map(lambda x: P(None, AXIS) if along_time(x) else P(), whole)

    def local(*xs):
      return reference(**dict(zip(names, xs)), context_axis=AXIS)

    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out_specs)(
      *(a[n] for n in names)
    )

  def loss(call, diff):
    result = call(**diff)
    total = sum(jnp.sum(x * jnp.cos(x)) for x in jax.tree.leaves(result))
    return total, result

  got, g_got, want, g_want = _values_and_grads(mesh, loss, sharded_call, reference, diff)
  errors = {
    f"result{i}": _rel(a, b)
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  }
  errors.update({f"d{n}": _rel(g_got[n], g_want[n]) for n in diff})
  return errors


def runner(case: dict):
  """The function that runs ``case``: an op's sample call (``op``), a recurrent family's
  (``family``: linear, gated_linear, delta_rule), an mla one (``family="mla"``) or a dense /
  sparse one (the default)."""
  if "op" in case:
    return run_sample_case
  return {
    "linear": run_linear_case,
    "gated_linear": run_recurrent_case,
    "delta_rule": run_recurrent_case,
    "mla": run_mla_case,
  }.get(case.get("family"), run_case)


def main(argv: list[str]) -> None:
  jax.config.update("jax_default_matmul_precision", "highest")
  jax.config.update("jax_numpy_rank_promotion", "raise")
  jax.config.update(
    "jax_disable_most_optimizations", os.environ.get("ATTNJAX_CP_OPTIMIZE", "") in ("", "0")
  )
  cache = os.environ.get("ATTNJAX_CP_CACHE")
  if cache:
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  for case in json.loads(argv[1]):
    try:
      print(json.dumps({"case": case, "errors": runner(case)(case)}), flush=True)
    except Exception as e:  # reported to the test, which fails on it
      if os.environ.get("ATTNJAX_CP_TRACEBACK"):
        import traceback

        traceback.print_exc()
      print(json.dumps({"case": case, "error": f"{type(e).__name__}: {e}"}), flush=True)


if __name__ == "__main__":
  main(sys.argv)
