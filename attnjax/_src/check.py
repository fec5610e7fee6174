"""``python -m attnjax.check``: attnjax's Pallas kernels checked on this device, and their verdict.

Each run checks pallas_gpu, mosaic_gpu or pallas_tpu (--kernel, --platform cuda or tpu)
against the fp32 reference in value and gradient, times them, and writes the verdict that
lets auto-dispatch take them on this kind of device (--ship: into the package, to commit);
--out also writes a markdown report. Without the platform's device it exits with status 2;
--interpret checks on the CPU instead. Implementation of :mod:`attnjax.check`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import os
import statistics
import time
from typing import Callable, Optional

from attnjax._src import lowering
from attnjax._src.ops.dense import attention as dense
from attnjax._src.ops.nsa import attention as nsa

#: The speed table's ``(H, T)``, each run as ``B = 16384 // T`` sequences of ``N = 2048 // H``
#: heads (16k tokens per batch, model width 2048). tests/test_targets.py compiles these shapes
#: for an H200.
SPEED_SIZES = tuple((H, T) for H in (64, 128) for T in (1024, 4096, 16384)) + ((128, 8192),)
#: The Mosaic GPU kernel's speed shapes ``(H, T)`` (bf16, H=128).
MOSAIC_SIZES = ((128, 4096), (128, 16384))
#: Section 2's call shape on a device, ``(B, T, N, K, H)`` with ``S = T``.
CHECK_SHAPE = (2, 300, 8, 2, 64)
#: Section 2's call shape in interpret mode (``--interpret``), ``(B, T, N, K, H)`` with ``S = T``.
INTERPRET_SHAPE = (2, 40, 4, 2, 16)
#: Section 2's mask structures, each checked with every normaliser.
STRUCTURES = ("causal", "window", "segments")
#: The platforms ``--platform`` names (``gpu`` is accepted as an alias of ``cuda``).
PLATFORMS = ("cuda", "tpu")
PLATFORM_ALIASES = {"gpu": "cuda"}
#: The device each platform runs on, as messages name it.
DEVICES = {"cuda": "CUDA GPU", "tpu": "TPU"}
#: Every kernel this command checks, per platform (``--kernel all``; mosaic_gpu only on a Hopper
#: or in interpret mode): the dense engines vouched for by the device check, in the op's order.
PLATFORM_KERNELS = {
  p: tuple(
    e.name for e in dense.ENGINES.values() if e.vouched_by == "device-check" and e.platform == p
  )
  for p in PLATFORMS
}
#: The kernel checked by default per ``--platform``: the platform's first.
KERNEL = {p: names[0] for p, names in PLATFORM_KERNELS.items()}
#: The platform's built-in softmax kernel per ``--platform`` (the speed targets' baseline): the
#: first engine of its auto-dispatch list that jax vouches for.
BUILTIN = {
  p: next(n for n in dense.PREFERENCES[p] if dense.ENGINES[n].vouched_by == "jax")
  for p in PLATFORMS
}
#: The selected-block attention kernels per platform (NSA's selected branch,
#: ``attnjax/_src/kernels/selected``; the names of their verdicts, which NSA's engines of the
#: platform read), checked when named (``--kernel selected_pallas_tpu``).
SELECTED_KERNELS = {
  p: tuple(
    e.verdict_name
    for e in nsa.ENGINES.values()
    if e.vouched_by == "device-check" and e.platform == p
  )
  for p in PLATFORMS
}
#: The engine each kernel name of this command vouches for (its platform and where it runs).
CHECKED_ENGINES = {
  e.verdict_name: e
  for engines in (dense.ENGINES, nsa.ENGINES)
  for e in engines.values()
  if e.vouched_by == "device-check"
}
#: ``--kernel``'s names besides "default".
KERNELS = ("all",) + tuple(CHECKED_ENGINES)
#: Section 2's limit on a row's error (:func:`row_error`) per input dtype. The kernels round
#: the weights and the score gradients to the input dtype once before their products (the fp32
#: reference does not): 8 units of roundoff of bf16 (2^-8) and fp16 (2^-11) leave room for the
#: sums of those roundings over a row; fp32 kernels multiply in full fp32, where exp and the
#: sums' order differ from the reference's by far less than 2e-3.
TOLERANCE = {"bfloat16": 3e-2, "float16": 4e-3, "float32": 2e-3}
#: A row whose largest reference value is below this fraction of the tensor's median row scale
#: is measured against that floor (a row of near-cancelling terms has no scale of its own).
ROW_FLOOR = 0.1


def _platform(value: str) -> str:
  """``--platform``'s value: a platform, or an old spelling of one."""
  return PLATFORM_ALIASES.get(value, value)


def parser() -> argparse.ArgumentParser:
  """The command line of ``python -m attnjax.check`` (``--help`` prints the module docstring)."""
  p = argparse.ArgumentParser(
    prog="python -m attnjax.check",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--out", default="device_check.md", help="markdown report path")
  p.add_argument(
    "--budget",
    type=float,
    default=150.0,
    help="seconds for the speed tables (section 4, shared evenly between the "
    "kernels' tables) before they stop",
  )
  p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median)")
  p.add_argument(
    "--calls",
    type=int,
    default=10,
    help="back-to-back calls per timed run (the device is waited on once)",
  )
  p.add_argument(
    "--platform",
    type=_platform,
    choices=PLATFORMS,
    default=None,
    help="which platform's kernels to check: cuda or tpu (gpu: an alias of cuda; default: "
    "this host's GPU or TPU, cuda elsewhere)",
  )
  p.add_argument(
    "--kernel",
    choices=("default",) + KERNELS,
    default="default",
    help="the kernel to check: default: "
    + ", ".join(f"{k} on {p}" for p, k in KERNEL.items())
    + "; all: every kernel of the platform (on cuda, mosaic_gpu too where it is a Hopper)",
  )
  p.add_argument(
    "--ship",
    action="store_true",
    help="also write the verdict into the imported package's attnjax/verdicts/ "
    "(run from a source checkout, then commit the file)",
  )
  p.add_argument(
    "--workers",
    type=int,
    default=min(32, os.cpu_count() or 1),
    help="threads compiling section 2's programs",
  )
  p.add_argument(
    "--interpret",
    action="store_true",
    help="sections 1 and 2 on the CPU, the kernel in interpret mode at a small "
    "shape (tests this command; the verdict is for the device kind 'cpu')",
  )
  return p


class Report:
  """Markdown lines, and the failed correctness checks."""

  def __init__(self):
    self.lines: list[str] = []
    self.failed: list[str] = []

  def add(self, line: str = "") -> None:
    """Prints ``line`` and appends it to the report."""
    print(line, flush=True)
    self.lines.append(line)

  def expect(self, ok: bool, what: str) -> None:
    """Adds ``what`` as a passed or failed check; a failed one is also kept in ``failed``."""
    self.add(f"- [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
      self.failed.append(what)


def _timed(fn: Callable, args, repeats: int, calls: int = 10) -> float:
  """Median seconds per call of ``fn(*args)`` after one warm-up (compilation) call: each timed
  run makes ``calls`` calls back to back and waits on the device once, so the time between
  calls is the device's, not the host's."""
  import jax

  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / calls)
  return statistics.median(times)


def speed_shape(H: int, T: int) -> tuple[int, int, int, int]:
  """``(B, T, N, H)`` of a speed-table row."""
  return max(1, 16384 // T), T, 2048 // H, H


def qkv(B: int, T: int, N: int, K: int, H: int, dtype, seed: int = 0):
  """Standard-normal ``q [B, T, N, H]``, ``k, v [B, T, K, H]`` in ``dtype`` (drawn by numpy:
  no program to compile per shape)."""
  import jax.numpy as jnp
  import numpy as np

  rng = np.random.default_rng(seed)
  return tuple(
    jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    for shape in ((B, T, N, H), (B, T, K, H), (B, T, K, H))
  )


def row_error(got, want) -> float:
  """The largest error of one row (the last axis) relative to that row's scale.

  A row's scale is its largest reference magnitude, floored at :data:`ROW_FLOOR` times the
  median row scale of the tensor: one wrong row shows whatever the rest of the tensor holds
  (dividing by the tensor's largest value would hide it among larger rows). A scalar is
  relative to itself.
  """
  import numpy as np

  a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
  a, b = a.reshape(-1, a.shape[-1] if a.ndim else 1), b.reshape(-1, b.shape[-1] if b.ndim else 1)
  scale = np.max(np.abs(b), axis=1)
  floor = max(ROW_FLOOR * float(np.median(scale)), np.finfo(np.float32).tiny)
  return float(np.max(np.max(np.abs(a - b), axis=1) / np.maximum(scale, floor)))


def _rel_err(a, b) -> float:
  """Section 3's error: :func:`row_error` (cuDNN and the block-wise kernel)."""
  return row_error(a, b)


def check_dispatch(r: Report, platform: str) -> None:
  """Section 1: the platform's list in order, every kernel allowed (the trust rule apart)."""
  import jax.numpy as jnp
  from attnjax._src import target
  from attnjax._src.config import config

  platform = PLATFORM_ALIASES.get(platform, platform)
  r.add(f"## 1. Dispatch ({platform} branch of implementation=None)")
  pick = lambda *a, **kw: dense.select_implementation(*dense.prepare(*a, **kw), platform)
  before, config.auto_kernels = config.auto_kernels, "all"
  try:
    q, k, v = qkv(1, 256, 4, 2, 64, jnp.bfloat16)
    if platform == "tpu":
      r.expect(pick(q, k, v, is_causal=True) == "splash", "bf16 causal softmax -> splash")
      for what, kw in (
        ("sigmoid", dict(normalizer="sigmoid")),
        ("with statistics", dict(return_stats=True)),
      ):
        r.expect(pick(q, k, v, **kw) == "pallas_tpu", f"bf16 {what} -> pallas_tpu")
      q, k, v = qkv(1, 200, 4, 2, 64, jnp.bfloat16)
      r.expect(
        pick(q, k, v, is_causal=True) == "pallas_tpu", "T=200 (not a multiple of 128) -> pallas_tpu"
      )
      return
    # A Hopper (compute capability 9) takes our Mosaic GPU kernel where cuDNN does not cover a
    # bf16 call; where this host has no cuDNN library, cuDNN is not a choice.
    ours = "mosaic_gpu" if target.cuda_major() == 9 else "pallas_gpu"
    softmax = "cudnn" if target.cudnn_version() is not None else ours
    r.expect(pick(q, k, v, is_causal=True) == softmax, f"bf16 causal softmax -> {softmax}")
    r.expect(pick(q, k, v, normalizer="sigmoid") == ours, f"bf16 sigmoid -> {ours}")
    r.expect(pick(q, k, v, return_stats=True) == ours, f"bf16 with statistics -> {ours}")
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    r.expect(pick(q32, k32, v32, is_causal=True) == "pallas_gpu", "fp32 causal -> pallas_gpu")
  finally:
    config.auto_kernels = before


def check_cases(impl: str) -> list[tuple[str, str, str]]:
  """Section 2's ``(normalizer, structure, dtype name)``: every normaliser x structure in bf16,
  then causal in fp32 (fp16 for the Mosaic GPU kernel, which takes no fp32)."""
  from attnjax._src import normalizers

  second = "float16" if impl == "mosaic_gpu" else "float32"
  return [(n, s, "bfloat16") for n, s in itertools.product(normalizers.NORMALIZERS, STRUCTURES)] + [
    (n, "causal", second) for n in normalizers.NORMALIZERS
  ]


def _kernel_run(impl: str, interpret: bool) -> Callable:
  """``(inputs, opts) -> out`` of ``impl``: by name through dispatch on a device, the kernel's
  own engine in interpret mode."""
  from attnjax._src import op

  if not interpret:
    return lambda inputs, opts: dense.run(inputs, opts, impl)
  engine = dense.ENGINES[impl]
  return lambda inputs, opts: op.run_engine(engine, (inputs, opts), interpret=True)


def case_program(kernel: Callable, normalizer: str, structure: str, window) -> Callable:
  """One case of section 2 as one program ``(q, k, v, segment_ids, sink) -> (got, want)``:
  the kernel's and the reference's ``((loss, (out, logsumexp)), (dq, dk, dv))``.

  The reference runs on the inputs cast to fp32 under the highest matmul precision (on a GPU
  the default would be TF32). The segment ids and sink logits are arguments, not constants
  XLA would fold while compiling.
  """
  import jax
  import jax.numpy as jnp
  from attnjax._src.ops.dense import attention as dense
  from attnjax._src import normalizers

  kw = {
    "causal": dict(is_causal=True),
    "window": dict(window=window),
    "segments": dict(is_causal=True),
  }[structure]
  kw.update(normalizer=normalizer, return_stats=True)
  sinks = normalizers.get(normalizer).accepts_sink_logits

  def loss(fn, q, k, v, seg, sink):
    extra = dict(segment_ids=seg if structure == "segments" else None)
    if sinks:
      extra.update(sink_logits=sink, softcap=20.0)
    out, st = fn(*dense.prepare(q, k, v, **kw, **extra))
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(st.logsumexp), (out, st.logsumexp)

  def program(q, k, v, seg, sink):
    got = jax.value_and_grad(functools.partial(loss, kernel), (0, 1, 2), has_aux=True)(
      q, k, v, seg, sink
    )
    with jax.default_matmul_precision("highest"):
      want = jax.value_and_grad(functools.partial(loss, dense.reference), (0, 1, 2), has_aux=True)(
        *(x.astype(jnp.float32) for x in (q, k, v)), seg, sink
      )
    return got, want

  return program


def compile_all(programs: list, workers: int) -> list:
  """``jax.jit(f).lower(*args).compile()`` of each ``(f, args)``, by ``workers`` threads at once
  (one thread traces while others compile: XLA releases the GIL), in the order given."""
  import jax

  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    return list(pool.map(lambda p: jax.jit(p[0]).lower(*p[1]).compile(), programs))


def _case_args(impl: str, interpret: bool):
  """Section 2's shape ``(B, T, N, K, H)``, its window, and its arguments per dtype name:
  ``(q, k, v, segment_ids, sink_logits)``."""
  import jax.numpy as jnp

  B, T, N, K, H = INTERPRET_SHAPE if interpret else CHECK_SHAPE
  if impl == "mosaic_gpu":
    H = max(H, 64)  # its head dims: 64, 128, 256
  seg = jnp.asarray(
    [[0] * (T // 3) + [1] * (T - T // 3), [0] * (5 * T // 6) + [1] * (T - 5 * T // 6)], jnp.int32
  )[:B]
  sink = jnp.linspace(-1.0, 1.0, N, dtype=jnp.float32)
  window = (64 * T // 300, 16 * T // 300)  # (64, 16) at T=300
  dtypes = sorted({dtype for _, _, dtype in check_cases(impl)})
  args = {d: qkv(B, T, N, K, H, jnp.dtype(d)) + (seg, sink) for d in dtypes}
  return (B, T, N, K, H), window, args


def check_kernel(r: Report, impl: str, interpret: bool = False, workers: int = 1) -> dict:
  """Section 2: ``impl`` against the fp32 reference; returns its verdict entry (``cases``:
  each case class's result, :func:`attnjax._src.trust.case_class`)."""
  import jax
  from attnjax._src import trust

  shape, window, args = _case_args(impl, interpret)
  B, T, N, K, H = shape
  r.add("")
  r.add(
    f"## 2. {impl} vs fp32 reference (B={B}, T={T}, S={T}, N={N}, K={K}, H={H}"
    + (", interpret mode" if interpret else "")
    + ")"
  )
  kernel, cases = _kernel_run(impl, interpret), check_cases(impl)
  start = time.perf_counter()
  compiled = compile_all(
    [(case_program(kernel, n, s, window), args[d]) for n, s, d in cases], workers
  )
  r.add(
    f"({len(cases)} programs compiled in {time.perf_counter() - start:.0f} s, {workers} threads)"
  )
  failed, results, errors = [], {}, {}
  for (name, structure, dtype), program in zip(cases, compiled):
    got, want = program(*args[dtype])
    err = max(row_error(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    klass = trust.case_class(name, structure, dtype)
    ok = err < TOLERANCE[dtype]
    what = f"{klass}: max row err {err:.1e} (limit {TOLERANCE[dtype]:.0e}; out, dq, dk, dv)"
    r.expect(ok, what)
    results[klass], errors[klass] = ok, float(f"{err:.3g}")
    failed += [] if ok else [what]
  return {
    "passed": not failed,
    "checks": len(cases),
    "failed": failed,
    "cases": results,
    "errors": errors,
    "shape": [B, T, N, K, H],
    "interpret": interpret,
  }


def selected_cases(impl: str) -> list[tuple[str, str, str]]:
  """The selected-block kernels' ``(normalizer, loop order, dtype name)``: every normaliser in
  the query-token-major order and the mergeable ones key-block-major, in bf16; softmax in
  both orders in fp32 (the Mosaic GPU kernels: fp16)."""
  from attnjax._src import normalizers

  second = "float16" if impl == "selected_mosaic_gpu" else "float32"
  mergeable = [n for n in normalizers.NORMALIZERS if normalizers.REGISTRY[n].mergeable]
  return (
    [(n, "query", "bfloat16") for n in normalizers.NORMALIZERS]
    + [(n, "kv", "bfloat16") for n in mergeable]
    + [("softmax", order, second) for order in ("query", "kv")]
  )


def _selected_shape(impl: str, order: str, interpret: bool) -> tuple[int, ...]:
  """``(B, T, N, K, H, block_size, n)`` of a selected-block case (``S = T``): 16 query heads
  per group query-major, 2 key-block-major; one wgmma tile of keys (64) on a GPU."""
  gpu = impl == "selected_mosaic_gpu"
  if not interpret:
    N, K = (16, 1) if order == "query" else (4, 2)
    return (2, 300, N, K, 64, 64, 4)
  if gpu:  # jax's Mosaic GPU interpreter: a program per (token, head) query-major
    return (1, 12, 8, 1, 64, 64, 2) if order == "query" else (1, 12, 4, 2, 64, 64, 2)
  return (2, 40, 4, 1, 16, 16, 3) if order == "query" else (2, 40, 4, 2, 16, 16, 3)


def check_selected(r: Report, impl: str, interpret: bool = False, workers: int = 1) -> dict:
  """Section 2 of a selected-block kernel: values, the log-normaliser and the gradients of q,
  k, v against its gathered plain-JAX twin in fp32 (``kernels/selected/twin.py``), per
  case class ``"<normalizer> selected_<order> <dtype>"``; returns its verdict entry."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from attnjax._src import trust
  from attnjax._src.kernels.selected import attention as selected, twin

  kernel = selected.mosaic_gpu if impl == "selected_mosaic_gpu" else selected.pallas_tpu
  platform = "cuda" if impl == "selected_mosaic_gpu" else "tpu"
  cases = selected_cases(impl)
  r.add("")
  r.add(f"## 2. {impl} vs its fp32 gathered twin" + (" (interpret mode)" if interpret else ""))

  def program(normalizer, order, shape):
    bs = shape[5]
    kw = dict(block_size=bs, scale=shape[4] ** -0.5, normalizer=normalizer, return_lse=True)

    def loss(fn, q, k, v, ids):
      out, lse = fn(q, k, v, ids)
      return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(lse), (out, lse)

    def fast(q, k, v, ids):
      return kernel(q, k, v, ids, interpret=interpret, order=order, **kw)

    def slow(q, k, v, ids):
      p = selected.plan_call(platform, q, k, v, ids, interpret=interpret, order=order, **kw)
      return twin.gathered(p, q, k, v, ids)

    def both(q, k, v, ids):
      got = jax.value_and_grad(lambda *a: loss(fast, *a, ids), (0, 1, 2), has_aux=True)(q, k, v)
      with jax.default_matmul_precision("highest"):
        up = [x.astype(jnp.float32) for x in (q, k, v)]
        want = jax.value_and_grad(lambda *a: loss(slow, *a, ids), (0, 1, 2), has_aux=True)(*up)
      return got, want

    return both

  def args(order, dtype):
    B, T, N, K, H, bs, n = _selected_shape(impl, order, interpret)
    q, k, v = qkv(B, T, N, K, H, jnp.dtype(dtype), seed=1)
    nb = -(-T // bs)
    ids = np.random.default_rng(2).integers(-1, nb + 1, (B, T, K, n)).astype(np.int32)
    return q, k, v, jnp.asarray(ids)

  start = time.perf_counter()
  programs = [(program(n, o, _selected_shape(impl, o, interpret)), args(o, d)) for n, o, d in cases]
  compiled = compile_all(programs, workers)
  r.add(f"({len(cases)} programs compiled in {time.perf_counter() - start:.0f} s)")
  failed, results, errors = [], {}, {}
  for (name, order, dtype), program_, (_, a) in zip(cases, compiled, programs):
    got, want = program_(*a)
    err = max(row_error(x, y) for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    klass = trust.case_class(name, f"selected_{order}", dtype)
    ok = err < TOLERANCE[dtype]
    what = f"{klass}: max row err {err:.1e} (limit {TOLERANCE[dtype]:.0e}; out, lse, dq, dk, dv)"
    r.expect(ok, what)
    results[klass], errors[klass] = ok, float(f"{err:.3g}")
    failed += [] if ok else [what]
  return {
    "passed": not failed,
    "checks": len(cases),
    "failed": failed,
    "cases": results,
    "errors": errors,
    "interpret": interpret,
  }


def check_cudnn_and_blockwise(
  r: Report, B: int = 2, T: int = 2048, impls: tuple = (None, "cudnn")
) -> None:
  """Section 3: jax's cuDNN attention (``impls``: auto and by name) and our block-wise kernel
  on the GPU, ``B`` sequences of ``T`` tokens."""
  import jax
  import jax.numpy as jnp
  from attnjax._src import masks

  r.add("")
  r.add("## 3. cuDNN (auto) and block-wise vs reference")
  q, k, v = qkv(B, T, 16, 4, 128, jnp.bfloat16)
  lengths = jnp.asarray([T, T // 2 + 3])
  # The padding mask is built inside each program from `lengths`, an argument (a mask of
  # constants is folded by XLA while compiling).
  calls = {
    "causal": lambda n: dict(is_causal=True),
    "window": lambda n: dict(is_causal=True, window=(256, 0)),
    "padding mask": lambda n: dict(mask=masks.padding_mask(n, n, T, T)),
  }
  for name, kw in calls.items():

    def out(q, k, v, n, impl, kw=kw):
      return dense.dot_product_attention(q, k, v, implementation=impl, **kw(n))

    def loss(q, k, v, n, impl):
      o = out(q, k, v, n, impl).astype(jnp.float32)
      return jnp.sum(o * jnp.cos(o))

    with jax.default_matmul_precision("highest"):  # the reference's fp32 products, not TF32
      ref = jax.jit(functools.partial(out, impl="reference"))(q, k, v, lengths)
      ref_grads = jax.jit(jax.grad(functools.partial(loss, impl="reference"), (0, 1, 2)))(
        q, k, v, lengths
      )
    for impl in impls:
      err = _rel_err(jax.jit(functools.partial(out, impl=impl))(q, k, v, lengths), ref)
      r.expect(err < 2e-2, f"{name} impl={impl}: value row err {err:.1e}")
    grads = jax.jit(jax.grad(functools.partial(loss, impl=None), (0, 1, 2)))(q, k, v, lengths)
    err = max(_rel_err(a, b) for a, b in zip(grads, ref_grads))
    r.expect(err < 2e-2, f"{name} auto: dq, dk, dv row err {err:.1e}")
  qs, ks, vs = (x[:, :512].astype(jnp.float32) for x in (q, k, v))
  with jax.default_matmul_precision("highest"):  # both in full fp32 (the default: TF32)
    for kw in (dict(is_causal=True), dict(window=(64, 0), normalizer="softpick")):
      ref, got = (
        jax.jit(
          lambda q, k, v, impl=impl, kw=kw: dense.dot_product_attention(
            q, k, v, implementation=impl, **kw
          )
        )(qs, ks, vs)
        for impl in ("reference", "blockwise")
      )
      err = _rel_err(got, ref)
      r.expect(err < 2e-3, f"blockwise fp32 {kw}: value row err {err:.1e}")


def _time_pair(fwd_kw: Callable, args, repeats: int, calls: int = 10, backward_only: bool = False):
  """``(fwd s, fwd+bwd s)`` (or bwd s) of ``dot_product_attention(q, k, v, **fwd_kw)``, each
  per call of ``calls`` back-to-back calls."""
  import jax
  import jax.numpy as jnp

  fwd = jax.jit(lambda q, k, v: dense.dot_product_attention(q, k, v, **fwd_kw))
  both = jax.jit(
    jax.grad(
      lambda q, k, v: jnp.sum(dense.dot_product_attention(q, k, v, **fwd_kw).astype(jnp.float32)),
      (0, 1, 2),
    )
  )
  tf = _timed(fwd, args, repeats, calls)
  tb = _timed(both, args, repeats, calls)
  return tf, (max(tb - tf, 1e-9) if backward_only else tb)


def speed_table(r: Report, args) -> dict:
  """Section 4: ``{(path, H, T): (fwd s, fwd+bwd s)}``."""
  import jax.numpy as jnp
  from attnjax._src import normalizers

  r.add("")
  r.add("## 4. TFLOP/s, bf16, causal (16k tokens per batch, N x H = 2048)")
  r.add("")
  r.add("| path | H | T | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |")
  r.add("|---|---:|---:|---:|---:|---:|---:|")
  ours = KERNEL[args.platform]
  paths = {f"{ours} {n}": dict(implementation=ours, normalizer=n) for n in normalizers.NORMALIZERS}
  paths.update(
    {
      f"{BUILTIN[args.platform]} softmax": dict(implementation=BUILTIN[args.platform]),
      "jax.nn xla": dict(implementation="xla"),
      "blockwise softmax": dict(implementation="blockwise"),
    }
  )
  times, start = {}, time.perf_counter()
  for H, T in SPEED_SIZES:
    B, _, N, _ = speed_shape(H, T)
    q, k, v = qkv(B, T, N, N, H, jnp.bfloat16)
    flops = 4.0 * B * N * T * T * H / 2  # causal forward
    chosen = dict(paths)
    if T == 8192:
      chosen = {
        f"{ours} softmax": paths[f"{ours} softmax"],
        "reference softmax": dict(implementation="reference"),
      }
    for name, kw in chosen.items():
      if T >= 16384 and name in ("jax.nn xla", "blockwise softmax"):
        r.add(f"| {name} | {H} | {T} | skipped (T x T / compile time) | | | |")
        continue
      if time.perf_counter() - start > args.table_budget:
        r.add(f"| {name} | {H} | {T} | not run (budget) | | | |")
        continue
      try:
        tf, tb = _time_pair(dict(kw, is_causal=True), (q, k, v), args.repeats, args.calls)
      except Exception as e:  # a path failing to compile at a size is a result, not a crash
        r.add(f"| {name} | {H} | {T} | error: {type(e).__name__}: {str(e)[:80]} | | | |")
        continue
      times[(name, H, T)] = (tf, tb)
      r.add(
        f"| {name} | {H} | {T} | {tf * 1e3:.2f} | {flops / tf / 1e12:.1f} | {tb * 1e3:.2f} "
        f"| {3.5 * flops / tb / 1e12:.1f} |"
      )
  return times


def mosaic_table(r: Report, args) -> dict:
  """Section 4 of ``--kernel mosaic_gpu``: ``{(path, T, causal): (fwd s, bwd s, flops)}``."""
  import jax.numpy as jnp
  from attnjax._src import normalizers

  r.add("")
  r.add("## 4. mosaic_gpu TFLOP/s, bf16, H=128 (16k tokens per batch, N x H = 2048)")
  r.add("")
  r.add("| path | T | causal | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s |")
  r.add("|---|---:|---|---:|---:|---:|---:|")
  paths = {
    f"mosaic_gpu {n}": dict(implementation="mosaic_gpu", normalizer=n)
    for n in normalizers.NORMALIZERS
  }
  paths["cudnn softmax"] = dict(implementation="cudnn")
  times, start = {}, time.perf_counter()
  for H, T in MOSAIC_SIZES:
    B, _, N, _ = speed_shape(H, T)
    q, k, v = qkv(B, T, N, N, H, jnp.bfloat16)
    for causal in (False, True):
      flops = 4.0 * B * N * T * T * H / (2 if causal else 1)
      for name, kw in paths.items():
        if time.perf_counter() - start > args.table_budget:
          r.add(f"| {name} | {T} | {causal} | not run (budget) | | | |")
          continue
        try:
          tf, tb = _time_pair(
            dict(kw, is_causal=causal), (q, k, v), args.repeats, args.calls, backward_only=True
          )
        except Exception as e:  # a path failing at a size is a result, not a crash
          r.add(f"| {name} | {T} | {causal} | error: {type(e).__name__}: {str(e)[:80]} | | | |")
          continue
        times[(name, T, causal)] = (tf, tb, flops)
        r.add(
          f"| {name} | {T} | {causal} | {tf * 1e3:.2f} | {flops / tf / 1e12:.1f} | "
          f"{tb * 1e3:.2f} | {2.5 * flops / tb / 1e12:.1f} |"
        )
  return times


def _say(r: Report, value, limit, what, lower_is_better=True):
  if value is None:
    r.add(f"- [not measured] {what}")
    return
  met = value <= limit if lower_is_better else value >= limit
  r.add(
    f"- [{'met' if met else 'MISSED'}] {what}: {value:.2f}x (target "
    f"{'<=' if lower_is_better else '>='} {limit}x)"
  )


def _ratio(times: dict, a, b, col: int) -> Optional[float]:
  return times[a][col] / times[b][col] if a in times and b in times else None


def targets(r: Report, times: dict, platform: str = "cuda") -> None:
  """Section 5 of the default kernel (reported, not failed)."""
  from attnjax._src import normalizers

  platform = PLATFORM_ALIASES.get(platform, platform)
  r.add("")
  r.add("## 5. Targets (reported, not failed)")
  ours, builtin = KERNEL[platform], BUILTIN[platform]
  for col, mode in ((0, "fwd"), (1, "fwd+bwd")):
    _say(
      r,
      _ratio(times, (f"{ours} softmax", 128, 4096), (f"{builtin} softmax", 128, 4096), col),
      1.5 if platform == "cuda" else 1.25,
      f"{ours} softmax / {builtin} time, T=4096 H=128 {mode}",
    )
    for n in normalizers.NORMALIZERS:
      if n != "softmax":
        _say(
          r,
          _ratio(times, (f"{ours} {n}", 128, 4096), (f"{ours} softmax", 128, 4096), col),
          1.25,
          f"{ours} {n} / {ours} softmax time, T=4096 H=128 {mode}",
        )
    if platform == "cuda":
      _say(
        r,
        _ratio(times, ("reference softmax", 128, 8192), ("pallas_gpu softmax", 128, 8192), col),
        10.0,
        f"reference / pallas_gpu softmax time, T=8192 H=128 {mode}",
        lower_is_better=False,
      )


def mosaic_targets(r: Report, times: dict) -> None:
  """Section 5 of ``--kernel mosaic_gpu`` (reported, not failed)."""
  from attnjax._src import normalizers

  r.add("")
  r.add("## 5. Targets (reported, not failed)")
  soft = ("mosaic_gpu softmax", 16384, False)
  if soft in times:
    tf, tb, flops = times[soft]
    _say(
      r,
      flops / tf / 1e12,
      550.0,
      "mosaic_gpu softmax forward TFLOP/s, T=16k non-causal",
      lower_is_better=False,
    )
    _say(
      r,
      2.5 * flops / tb / 1e12,
      400.0,
      "mosaic_gpu softmax backward TFLOP/s, T=16k non-causal",
      lower_is_better=False,
    )
  else:
    _say(r, None, 550.0, "mosaic_gpu softmax forward TFLOP/s, T=16k non-causal")
  for T in (4096, 16384):
    for causal in (False, True):
      where = f"T={T} {'causal' if causal else 'non-causal'}"
      base = ("mosaic_gpu softmax", T, causal)
      _say(
        r,
        _ratio(times, base, ("cudnn softmax", T, causal), 0),
        1.15,
        f"mosaic_gpu softmax / cuDNN forward time, {where}",
      )
      for n in normalizers.NORMALIZERS:
        if n != "softmax":
          for col, mode in ((0, "forward"), (1, "backward")):
            _say(
              r,
              _ratio(times, (f"mosaic_gpu {n}", T, causal), base, col),
              1.15,
              f"mosaic_gpu {n} / mosaic_gpu softmax {mode} time, {where}",
            )


def _host_platform() -> str:
  """This host's platform if it is one of :data:`PLATFORMS`, else ``"cuda"``."""
  platform = lowering.current_platform()
  return platform if platform in PLATFORMS else "cuda"


def kernels_to_check(platform: str, kernel: str, interpret: bool) -> tuple[str, ...]:
  """The kernels ``--kernel`` names on ``platform`` (``"gpu"``: ``"cuda"``): "default": its
  own (:data:`KERNEL`); "all": every one of :data:`PLATFORM_KERNELS` (on cuda, mosaic_gpu
  only where it is a Hopper, or in interpret mode); else the one named (a ``ValueError`` if
  it is another platform's)."""
  from attnjax._src import target

  platform = PLATFORM_ALIASES.get(platform, platform)
  if kernel == "default":
    return (KERNEL[platform],)
  if kernel == "all":
    return tuple(
      k
      for k in PLATFORM_KERNELS[platform]
      if k != "mosaic_gpu" or interpret or target.cuda_major() == 9
    )
  if kernel not in PLATFORM_KERNELS[platform] + SELECTED_KERNELS[platform]:
    raise ValueError(
      f"--kernel {kernel} is not a kernel of --platform {platform} (its kernels: "
      + ", ".join(PLATFORM_KERNELS[platform] + SELECTED_KERNELS[platform])
      + ")"
    )
  return (kernel,)


def _refusal(args) -> Optional[str]:
  """Why the command cannot run here (nothing is run), or None."""
  from attnjax._src import lowering

  want = "cpu" if args.interpret else args.platform
  here = lowering.current_platform()
  if here != want:
    needs = "the CPU (JAX_PLATFORMS=cpu)" if args.interpret else f"a {DEVICES[args.platform]}"
    return (
      f"python -m attnjax.check --platform {args.platform}"
      + (" --interpret" if args.interpret else "")
      + f" needs {needs} (this host's platform is {here!r}); nothing was run."
    )
  if args.ship and args.interpret:
    return (
      "--ship writes a device's verdict into the package; --interpret runs none (its "
      "verdict is the CPU's)"
    )
  known = PLATFORM_KERNELS[args.platform] + SELECTED_KERNELS[args.platform]
  if args.kernel not in ("default", "all") and args.kernel not in known:
    engine = CHECKED_ENGINES[args.kernel]
    return f"--kernel {args.kernel} needs --platform {engine.platform} (it {engine.where})"
  return None


def run_checks(r: Report, args) -> Optional[int]:
  """Sections 1 to 5 and the verdicts; None when they ran, else the exit status (2: this host
  has no such device, or the options do not go together)."""
  import jax
  from attnjax._src import trust
  from attnjax._version import __version__

  args.platform = PLATFORM_ALIASES.get(args.platform, args.platform) or _host_platform()
  refusal = _refusal(args)
  if refusal:
    print(refusal)
    return 2
  kind = jax.devices()[0].device_kind
  r.add("# attnjax device check")
  r.add("")
  r.add(f"devices: {jax.devices()}; jax {jax.__version__}; attnjax {__version__}")
  r.add("")
  kernels = kernels_to_check(args.platform, args.kernel, args.interpret)
  check_dispatch(r, args.platform)
  verdicts = {
    impl: (check_selected if impl.startswith("selected_") else check_kernel)(
      r, impl, args.interpret, args.workers
    )
    for impl in kernels
  }
  r.add("")
  paths = [trust.write_verdict(kind, verdicts)]
  if args.ship:
    paths.append(trust.write_verdict(kind, verdicts, shipped=True))
  for impl, verdict in verdicts.items():
    r.add(
      f"verdict: {impl} {'passed' if verdict['passed'] else 'FAILED'} on {kind!r} "
      f"(written to {' and '.join(str(p) for p in paths)})"
    )
  if args.interpret:
    return None
  if args.platform == "cuda":
    check_cudnn_and_blockwise(r)
  tables = [
    (table, report)
    for kernel, table, report in (
      (KERNEL[args.platform], speed_table, lambda t: targets(r, t, args.platform)),
      ("mosaic_gpu", mosaic_table, lambda t: mosaic_targets(r, t)),
    )
    if kernel in kernels
  ]
  args.table_budget = args.budget / max(1, len(tables))
  for table, report in tables:
    report(table(r, args))
  return None


def write(r: Report, out: str) -> int:
  """Writes the report; the exit status: 1 if a correctness check failed, else 0."""
  r.add("")
  r.add("FAILED: " + "; ".join(r.failed) if r.failed else "all correctness checks passed")
  with open(out, "w") as f:
    f.write("\n".join(r.lines) + "\n")
  print(f"wrote {out}")
  return 1 if r.failed else 0


def command(
  argv: Optional[list[str]] = None,
  *,
  prog: Optional[str] = None,
  description: Optional[str] = None,
  arguments: Optional[Callable[[argparse.ArgumentParser], None]] = None,
  then: Optional[Callable[[Report, argparse.Namespace], None]] = None,
) -> int:
  """Runs ``python -m attnjax.check`` on ``argv``, or a command that extends it.

  Sections 1 to 5 and the verdicts are written to ``--out`` (markdown) as they run; a
  command of its own (``experiments/device_check.py``) adds flags and sections.

  Args:
    argv: the command line (default: ``sys.argv[1:]``).
    prog: the command's name in ``--help`` (default: ``python -m attnjax.check``).
    description: its ``--help`` text (default: this module's docstring).
    arguments: called with the ``argparse.ArgumentParser`` to add the command's own flags.
    then: called as ``then(report, args)`` after sections 1 to 5 ran, to add sections of its
      own to the :class:`Report` before it is written.

  Returns:
    The exit status: 0 when every correctness check passed, 1 when one failed, 2 when
    nothing was run (this host has no device of the platform asked for, or ``--kernel
    mosaic_gpu`` without ``--platform cuda``; see ``run_checks``).
  """
  p = parser()
  p.prog = prog or p.prog
  p.description = description or p.description
  if arguments is not None:
    arguments(p)
  args = p.parse_args(argv)
  r = Report()
  status = run_checks(r, args)
  if status is not None:
    return status
  if then is not None:
    then(r, args)
  return write(r, args.out)


def main(argv: Optional[list[str]] = None) -> int:
  """``python -m attnjax.check`` on ``argv``: :func:`command`."""
  return command(argv)
