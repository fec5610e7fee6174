"""``python -m attnjax.check``: attnjax's Pallas kernels checked on this device, and the verdict
that lets auto-dispatch take them here. For example::

    python -m attnjax.check                          # a GPU: pallas_gpu (about 4 min, 1 GPU)
    python -m attnjax.check --kernel mosaic_gpu      # an H100 / H200: the Mosaic GPU kernel
    python -m attnjax.check --platform tpu           # a TPU host (v5e, v6e): pallas_tpu
    python -m attnjax.check --out runs/h200.md --budget 120

Auto-dispatch takes attnjax's own Pallas kernels (``pallas_gpu``, ``mosaic_gpu``,
``pallas_tpu``) on a kind of device only once this command has passed there
(or with ``ATTNJAX_KERNELS=all``, :mod:`attnjax._trust`): a kernel passes when
every comparison of section 2 does, and the verdict (attnjax and jax versions,
device kind, per kernel: passed, the number of checks, the failed ones) is
written to ``$ATTNJAX_CACHE_DIR`` (default ``$XDG_CACHE_HOME/attnjax`` or
``~/.cache/attnjax``), ``verdicts/<device kind>.json``. A failing kernel is
recorded as failed: dispatch does not take it.

Sections of the markdown report (``--out``; the exit status is 1 if a
correctness check fails):

1. Dispatch: the order of the platform's list (with every kernel allowed): for
   a bf16 causal call the ``cuda`` branch of ``implementation=None`` picks
   ``"cudnn"``; for options cuDNN lacks (``normalizer="sigmoid"``,
   ``return_stats``) ``"mosaic_gpu"`` on a Hopper, else ``"pallas_gpu"``; fp32
   inputs go to ``"pallas_gpu"``. On a TPU: splash for plain softmax,
   ``"pallas_tpu"`` for every other call it covers.
2. The kernel against ``reference``, values and gradients (q, k, v, and the
   logsumexp statistic's), every normaliser x causal / window / segments in bf16
   (sink logits and softcap where the normaliser takes them) and causal in
   fp32 (the Mosaic GPU kernel: fp16), GQA, lengths not multiples of the blocks.
3. (GPU) auto (cuDNN) and ``"cudnn"`` against the reference for causal, window
   and padding-mask calls in bf16, values and gradients; the block-wise kernel
   on the GPU in fp32.
4. TFLOP/s, forward and forward+backward, bf16, causal, T = 1k, 4k, 16k and
   H = 64, 128 (16k tokens per batch, 2048 model width): the kernel for each
   normaliser, cuDNN (splash) softmax, ``jax.nn`` XLA and the block-wise
   kernel, plus the reference at T=8192. Causal FLOPs are counted as half the
   dense ``4 T^2 H`` per head forward and 2.5x that backward. Paths that would
   materialise ``T x T`` at 16k are skipped, and the table stops at
   ``--budget`` seconds (the rest is marked "not run"). With ``--kernel
   mosaic_gpu``: T = 4k and 16k, H = 128, causal and not, backward = fwd+bwd
   time minus forward time (counted as 2.5x the forward FLOPs).
5. Speed targets (reported, not failed): ``pallas_gpu`` softmax within 1.5x of
   cuDNN's time at T=4096 bf16 H=128, every other normaliser within 1.25x of
   our softmax kernel, at least 10x faster than the reference at T=8192;
   ``pallas_tpu`` softmax within 1.25x of splash, every other normaliser within
   1.25x of our softmax; ``mosaic_gpu`` softmax forward >= 550 TFLOP/s at T=16k
   non-causal and within 1.15x of cuDNN's time, every other normaliser within
   1.15x of our softmax, backward >= 400 TFLOP/s.

On a host without the platform's device it prints that it needs one and exits
with status 2 at once (``--help`` works anywhere). ``--interpret`` runs
sections 1 and 2 on the CPU instead, the kernel in Pallas interpret mode at a
small shape (a test of this command, not of a device: its verdict is for the
device kind ``"cpu"``, which no GPU or TPU target has).
``experiments/device_check.py`` runs this command and adds a section 6 (the
training step's model-FLOPs utilisation).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from typing import Callable, Optional

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
#: Our kernel per ``--platform``.
KERNEL = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}
#: The platform's built-in softmax kernel per ``--platform`` (the speed targets' baseline).
BUILTIN = {"gpu": "cudnn", "tpu": "splash"}


def parser() -> argparse.ArgumentParser:
  """The command line of ``python -m attnjax.check`` (``--help`` prints the module docstring)."""
  p = argparse.ArgumentParser(prog="python -m attnjax.check", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default="device_check.md", help="markdown report path")
  p.add_argument("--budget", type=float, default=150.0,
                 help="seconds for the speed table (section 4) before it stops")
  p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median)")
  p.add_argument("--platform", choices=("gpu", "tpu"), default=None,
                 help="which device's kernels to check (default: this host's GPU or TPU; gpu "
                      "elsewhere)")
  p.add_argument("--kernel", choices=("default", "mosaic_gpu"), default="default",
                 help="mosaic_gpu: the Mosaic GPU kernel's checks and speed (Hopper GPUs)")
  p.add_argument("--interpret", action="store_true",
                 help="sections 1 and 2 on the CPU, the kernel in interpret mode at a small "
                      "shape (tests this command; the verdict is for the device kind 'cpu')")
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


def _timed(fn: Callable, args, repeats: int) -> float:
  """Median seconds of ``fn(*args)`` after one warm-up (compilation) call."""
  import jax
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def speed_shape(H: int, T: int) -> tuple[int, int, int, int]:
  """``(B, T, N, H)`` of a speed-table row."""
  return max(1, 16384 // T), T, 2048 // H, H


def qkv(B: int, T: int, N: int, K: int, H: int, dtype, seed: int = 0):
  """Standard-normal ``q [B, T, N, H]``, ``k, v [B, T, K, H]`` in ``dtype``."""
  import jax
  keys = jax.random.split(jax.random.key(seed), 3)
  return tuple(jax.random.normal(key, shape, dtype) for key, shape in
               zip(keys, ((B, T, N, H), (B, T, K, H), (B, T, K, H))))


def _rel_err(a, b) -> float:
  import numpy as np
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))


def check_dispatch(r: Report, platform: str) -> None:
  """Section 1: the platform's list in order, every kernel allowed (the trust rule apart)."""
  import jax.numpy as jnp
  from attnjax import _target, config, dense
  r.add(f"## 1. Dispatch ({'cuda' if platform == 'gpu' else 'tpu'} branch of "
        "implementation=None)")
  branch = "cuda" if platform == "gpu" else "tpu"
  pick = lambda *a, **kw: dense.select_implementation(*dense.prepare(*a, **kw), branch)
  before, config.kernels = config.kernels, "all"
  try:
    q, k, v = qkv(1, 256, 4, 2, 64, jnp.bfloat16)
    if platform == "tpu":
      r.expect(pick(q, k, v, is_causal=True) == "splash", "bf16 causal softmax -> splash")
      for what, kw in (("sigmoid", dict(normalizer="sigmoid")),
                       ("with statistics", dict(return_stats=True))):
        r.expect(pick(q, k, v, **kw) == "pallas_tpu", f"bf16 {what} -> pallas_tpu")
      q, k, v = qkv(1, 200, 4, 2, 64, jnp.bfloat16)
      r.expect(pick(q, k, v, is_causal=True) == "pallas_tpu",
               "T=200 (not a multiple of 128) -> pallas_tpu")
      return
    # A Hopper (compute capability 9) takes our Mosaic GPU kernel where cuDNN does not cover a
    # bf16 call; where this host has no cuDNN library, cuDNN is not a choice.
    ours = "mosaic_gpu" if _target.cuda_major() == 9 else "pallas_gpu"
    softmax = "cudnn" if _target.cudnn_version() is not None else ours
    r.expect(pick(q, k, v, is_causal=True) == softmax, f"bf16 causal softmax -> {softmax}")
    r.expect(pick(q, k, v, normalizer="sigmoid") == ours, f"bf16 sigmoid -> {ours}")
    r.expect(pick(q, k, v, return_stats=True) == ours, f"bf16 with statistics -> {ours}")
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    r.expect(pick(q32, k32, v32, is_causal=True) == "pallas_gpu", "fp32 causal -> pallas_gpu")
  finally:
    config.kernels = before


def check_cases(impl: str) -> list[tuple[str, str, str]]:
  """Section 2's ``(normalizer, structure, dtype name)``: every normaliser x structure in bf16,
  then causal in fp32 (fp16 for the Mosaic GPU kernel, which takes no fp32)."""
  from attnjax import normalizers
  second = "float16" if impl == "mosaic_gpu" else "float32"
  return ([(n, s, "bfloat16") for n, s in itertools.product(normalizers.NORMALIZERS, STRUCTURES)]
          + [(n, "causal", second) for n in normalizers.NORMALIZERS])


def _kernel_run(impl: str, interpret: bool) -> Callable:
  """``(inputs, opts) -> out`` of ``impl``: by name through dispatch on a device, the kernel's
  own engine in interpret mode."""
  from attnjax import dense
  from attnjax.kernels import mosaic_gpu, pallas_gpu, pallas_tpu
  if not interpret:
    return lambda inputs, opts: dense.run(inputs, opts, impl)
  engine = {"pallas_gpu": pallas_gpu, "mosaic_gpu": mosaic_gpu, "pallas_tpu": pallas_tpu}[impl]
  return lambda inputs, opts: engine.run(inputs, opts, interpret=True)


def check_kernel(r: Report, impl: str, interpret: bool = False) -> dict:
  """Section 2: ``impl`` against the reference; returns its verdict entry."""
  import jax
  import jax.numpy as jnp
  from attnjax import dense, normalizers
  r.add("")
  B, T, N, K, H = INTERPRET_SHAPE if interpret else CHECK_SHAPE
  if impl == "mosaic_gpu":
    H = max(H, 64)  # its head dims: 64, 128, 256
  r.add(f"## 2. {impl} vs reference (B={B}, T={T}, S={T}, N={N}, K={K}, H={H}"
        + (", interpret mode" if interpret else "") + ")")
  seg = jnp.asarray([[0] * (T // 3) + [1] * (T - T // 3),
                     [0] * (5 * T // 6) + [1] * (T - 5 * T // 6)])[:B]
  window = (64 * T // 300, 16 * T // 300)  # (64, 16) at T=300
  structures = {"causal": dict(is_causal=True), "window": dict(window=window),
                "segments": dict(is_causal=True, segment_ids=seg)}
  kernel = _kernel_run(impl, interpret)
  failed, cases = [], check_cases(impl)
  for name, structure, dtype in cases:
    q, k, v = qkv(B, T, N, K, H, jnp.dtype(dtype))
    kw = dict(structures[structure], normalizer=name, return_stats=True)
    if normalizers.REGISTRY[name].accepts_sink_logits:
      kw.update(sink_logits=jnp.linspace(-1.0, 1.0, N), softcap=20.0)

    def loss(q, k, v, fn, kw=kw):
      out, st = fn(*dense.prepare(q, k, v, **kw))
      return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(st.logsumexp), out

    got = jax.jit(jax.value_and_grad(lambda *a: loss(*a, kernel), (0, 1, 2), has_aux=True))(
        q, k, v)
    want = jax.jit(jax.value_and_grad(lambda *a: loss(*a, dense.reference), (0, 1, 2),
                                      has_aux=True))(q, k, v)
    tol = 2e-3 if dtype == "float32" else 3e-2  # fp32 dots may run as TF32 / bf16 passes
    err = max(_rel_err(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    what = f"{name} {structure} {dtype}: max rel err {err:.1e} (out, dq, dk, dv)"
    r.expect(err < tol, what)
    if not err < tol:
      failed.append(what)
  return {"passed": not failed, "checks": len(cases), "failed": failed,
          "shape": [B, T, N, K, H], "interpret": interpret}


def check_cudnn_and_blockwise(r: Report) -> None:
  """Section 3: jax's cuDNN attention and our block-wise kernel on the GPU."""
  import jax
  import jax.numpy as jnp
  import attnjax
  r.add("")
  r.add("## 3. cuDNN (auto) and block-wise vs reference")
  B, T = 2, 2048
  q, k, v = qkv(B, T, 16, 4, 128, jnp.bfloat16)
  lengths = jnp.asarray([T, T // 2 + 3])
  calls = {"causal": dict(is_causal=True), "window": dict(is_causal=True, window=(256, 0)),
           "padding mask": dict(mask=attnjax.masks.padding_mask(lengths, lengths, T, T))}
  for name, kw in calls.items():
    ref = attnjax.dot_product_attention(q, k, v, implementation="reference", **kw)
    for impl in (None, "cudnn"):
      out = attnjax.dot_product_attention(q, k, v, implementation=impl, **kw)
      r.expect(_rel_err(out, ref) < 2e-2, f"{name} impl={impl}: value rel err "
               f"{_rel_err(out, ref):.1e}")

    def loss(q, k, v, impl, kw=kw):
      out = attnjax.dot_product_attention(q, k, v, implementation=impl, **kw).astype(jnp.float32)
      return jnp.sum(out * jnp.cos(out))

    g_ref = jax.jit(jax.grad(lambda *a: loss(*a, "reference"), (0, 1, 2)))(q, k, v)
    g_auto = jax.jit(jax.grad(lambda *a: loss(*a, None), (0, 1, 2)))(q, k, v)
    errs = [_rel_err(a, b) for a, b in zip(g_auto, g_ref)]
    r.expect(max(errs) < 2e-2, f"{name} auto: dq, dk, dv rel err {max(errs):.1e}")
  qs, ks, vs = (x[:, :512].astype(jnp.float32) for x in (q, k, v))
  for kw in (dict(is_causal=True), dict(window=(64, 0), normalizer="softpick")):
    ref = attnjax.dot_product_attention(qs, ks, vs, implementation="reference", **kw)
    out = attnjax.dot_product_attention(qs, ks, vs, implementation="blockwise", **kw)
    r.expect(_rel_err(out, ref) < 2e-3, f"blockwise fp32 {kw}: value")


def _time_pair(fwd_kw: Callable, args, repeats: int, backward_only: bool = False):
  """``(fwd s, fwd+bwd s)`` (or bwd s) of ``dot_product_attention(q, k, v, **fwd_kw)``."""
  import jax
  import jax.numpy as jnp
  import attnjax
  fwd = jax.jit(lambda q, k, v: attnjax.dot_product_attention(q, k, v, **fwd_kw))
  both = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attnjax.dot_product_attention(
      q, k, v, **fwd_kw).astype(jnp.float32)), (0, 1, 2)))
  tf = _timed(fwd, args, repeats)
  tb = _timed(both, args, repeats)
  return tf, (max(tb - tf, 1e-9) if backward_only else tb)


def speed_table(r: Report, args) -> dict:
  """Section 4: ``{(path, H, T): (fwd s, fwd+bwd s)}``."""
  import jax.numpy as jnp
  from attnjax import normalizers
  r.add("")
  r.add("## 4. TFLOP/s, bf16, causal (16k tokens per batch, N x H = 2048)")
  r.add("")
  r.add("| path | H | T | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |")
  r.add("|---|---:|---:|---:|---:|---:|---:|")
  ours = KERNEL[args.platform]
  paths = {f"{ours} {n}": dict(implementation=ours, normalizer=n)
           for n in normalizers.NORMALIZERS}
  paths.update({f"{BUILTIN[args.platform]} softmax": dict(implementation=BUILTIN[args.platform]),
                "jax.nn xla": dict(implementation="xla"),
                "blockwise softmax": dict(implementation="blockwise")})
  times, start = {}, time.perf_counter()
  for H, T in SPEED_SIZES:
    B, _, N, _ = speed_shape(H, T)
    q, k, v = qkv(B, T, N, N, H, jnp.bfloat16)
    flops = 4.0 * B * N * T * T * H / 2  # causal forward
    chosen = dict(paths)
    if T == 8192:
      chosen = {f"{ours} softmax": paths[f"{ours} softmax"],
                "reference softmax": dict(implementation="reference")}
    for name, kw in chosen.items():
      if T >= 16384 and name in ("jax.nn xla", "blockwise softmax"):
        r.add(f"| {name} | {H} | {T} | skipped (T x T / compile time) | | | |")
        continue
      if time.perf_counter() - start > args.budget:
        r.add(f"| {name} | {H} | {T} | not run (budget) | | | |")
        continue
      try:
        tf, tb = _time_pair(dict(kw, is_causal=True), (q, k, v), args.repeats)
      except Exception as e:  # a path failing to compile at a size is a result, not a crash
        r.add(f"| {name} | {H} | {T} | error: {type(e).__name__}: {str(e)[:80]} | | | |")
        continue
      times[(name, H, T)] = (tf, tb)
      r.add(f"| {name} | {H} | {T} | {tf * 1e3:.2f} | {flops / tf / 1e12:.1f} | {tb * 1e3:.2f} "
            f"| {3.5 * flops / tb / 1e12:.1f} |")
  return times


def mosaic_table(r: Report, args) -> dict:
  """Section 4 of ``--kernel mosaic_gpu``: ``{(path, T, causal): (fwd s, bwd s, flops)}``."""
  import jax.numpy as jnp
  from attnjax import normalizers
  r.add("")
  r.add("## 4. mosaic_gpu TFLOP/s, bf16, H=128 (16k tokens per batch, N x H = 2048)")
  r.add("")
  r.add("| path | T | causal | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s |")
  r.add("|---|---:|---|---:|---:|---:|---:|")
  paths = {f"mosaic_gpu {n}": dict(implementation="mosaic_gpu", normalizer=n)
           for n in normalizers.NORMALIZERS}
  paths["cudnn softmax"] = dict(implementation="cudnn")
  times, start = {}, time.perf_counter()
  for H, T in MOSAIC_SIZES:
    B, _, N, _ = speed_shape(H, T)
    q, k, v = qkv(B, T, N, N, H, jnp.bfloat16)
    for causal in (False, True):
      flops = 4.0 * B * N * T * T * H / (2 if causal else 1)
      for name, kw in paths.items():
        if time.perf_counter() - start > args.budget:
          r.add(f"| {name} | {T} | {causal} | not run (budget) | | | |")
          continue
        try:
          tf, tb = _time_pair(dict(kw, is_causal=causal), (q, k, v), args.repeats,
                              backward_only=True)
        except Exception as e:  # a path failing at a size is a result, not a crash
          r.add(f"| {name} | {T} | {causal} | error: {type(e).__name__}: {str(e)[:80]} | | | |")
          continue
        times[(name, T, causal)] = (tf, tb, flops)
        r.add(f"| {name} | {T} | {causal} | {tf * 1e3:.2f} | {flops / tf / 1e12:.1f} | "
              f"{tb * 1e3:.2f} | {2.5 * flops / tb / 1e12:.1f} |")
  return times


def _say(r: Report, value, limit, what, lower_is_better=True):
  if value is None:
    r.add(f"- [not measured] {what}")
    return
  met = value <= limit if lower_is_better else value >= limit
  r.add(f"- [{'met' if met else 'MISSED'}] {what}: {value:.2f}x (target "
        f"{'<=' if lower_is_better else '>='} {limit}x)")


def _ratio(times: dict, a, b, col: int) -> Optional[float]:
  return times[a][col] / times[b][col] if a in times and b in times else None


def targets(r: Report, times: dict, platform: str = "gpu") -> None:
  """Section 5 of the default kernel (reported, not failed)."""
  from attnjax import normalizers
  r.add("")
  r.add("## 5. Targets (reported, not failed)")
  ours, builtin = KERNEL[platform], BUILTIN[platform]
  for col, mode in ((0, "fwd"), (1, "fwd+bwd")):
    _say(r, _ratio(times, (f"{ours} softmax", 128, 4096), (f"{builtin} softmax", 128, 4096),
                   col), 1.5 if platform == "gpu" else 1.25,
         f"{ours} softmax / {builtin} time, T=4096 H=128 {mode}")
    for n in normalizers.NORMALIZERS:
      if n != "softmax":
        _say(r, _ratio(times, (f"{ours} {n}", 128, 4096), (f"{ours} softmax", 128, 4096), col),
             1.25, f"{ours} {n} / {ours} softmax time, T=4096 H=128 {mode}")
    if platform == "gpu":
      _say(r, _ratio(times, ("reference softmax", 128, 8192), ("pallas_gpu softmax", 128, 8192),
                     col), 10.0, f"reference / pallas_gpu softmax time, T=8192 H=128 {mode}",
           lower_is_better=False)


def mosaic_targets(r: Report, times: dict) -> None:
  """Section 5 of ``--kernel mosaic_gpu`` (reported, not failed)."""
  from attnjax import normalizers
  r.add("")
  r.add("## 5. Targets (reported, not failed)")
  soft = ("mosaic_gpu softmax", 16384, False)
  if soft in times:
    tf, tb, flops = times[soft]
    _say(r, flops / tf / 1e12, 550.0, "mosaic_gpu softmax forward TFLOP/s, T=16k non-causal",
         lower_is_better=False)
    _say(r, 2.5 * flops / tb / 1e12, 400.0, "mosaic_gpu softmax backward TFLOP/s, T=16k "
         "non-causal", lower_is_better=False)
  else:
    _say(r, None, 550.0, "mosaic_gpu softmax forward TFLOP/s, T=16k non-causal")
  for T in (4096, 16384):
    for causal in (False, True):
      where = f"T={T} {'causal' if causal else 'non-causal'}"
      base = ("mosaic_gpu softmax", T, causal)
      _say(r, _ratio(times, base, ("cudnn softmax", T, causal), 0), 1.15,
           f"mosaic_gpu softmax / cuDNN forward time, {where}")
      for n in normalizers.NORMALIZERS:
        if n != "softmax":
          for col, mode in ((0, "forward"), (1, "backward")):
            _say(r, _ratio(times, (f"mosaic_gpu {n}", T, causal), base, col), 1.15,
                 f"mosaic_gpu {n} / mosaic_gpu softmax {mode} time, {where}")


def _host_platform() -> str:
  import jax
  backend = jax.default_backend()
  return backend if backend in ("gpu", "tpu") else "gpu"


def run_checks(r: Report, args) -> Optional[int]:
  """Sections 1 to 5 and the verdict; None when they ran, else the exit status (2: this host
  has no such device)."""
  import jax
  from attnjax import _trust
  from attnjax._version import __version__
  args.platform = args.platform or _host_platform()
  want = "cpu" if args.interpret else args.platform
  if jax.default_backend() != want:
    needs = ("the CPU backend (JAX_PLATFORMS=cpu)" if args.interpret
             else f"a {args.platform.upper()}")
    print(f"python -m attnjax.check --platform {args.platform}"
          + (" --interpret" if args.interpret else "")
          + f" needs {needs} (this host's backend is {jax.default_backend()!r}); nothing was run.")
    return 2
  if args.kernel == "mosaic_gpu" and args.platform != "gpu":
    print("--kernel mosaic_gpu needs --platform gpu (a Hopper GPU)")
    return 2
  kind = jax.devices()[0].device_kind
  r.add("# attnjax device check")
  r.add("")
  r.add(f"devices: {jax.devices()}; jax {jax.__version__}; attnjax {__version__}")
  r.add("")
  impl = "mosaic_gpu" if args.kernel == "mosaic_gpu" else KERNEL[args.platform]
  check_dispatch(r, args.platform)
  verdict = check_kernel(r, impl, interpret=args.interpret)
  path = _trust.write_verdict(kind, {impl: verdict})
  r.add("")
  r.add(f"verdict: {impl} {'passed' if verdict['passed'] else 'FAILED'} on {kind!r} "
        f"(written to {path})")
  if args.interpret:
    return None
  if args.kernel == "mosaic_gpu":
    mosaic_targets(r, mosaic_table(r, args))
    return None
  if args.platform == "gpu":
    check_cudnn_and_blockwise(r)
  targets(r, speed_table(r, args), args.platform)
  return None


def write(r: Report, out: str) -> int:
  """Writes the report; the exit status: 1 if a correctness check failed, else 0."""
  r.add("")
  r.add("FAILED: " + "; ".join(r.failed) if r.failed else "all correctness checks passed")
  with open(out, "w") as f:
    f.write("\n".join(r.lines) + "\n")
  print(f"wrote {out}")
  return 1 if r.failed else 0


def main(argv=None) -> int:
  """Runs the command on ``argv`` (default: ``sys.argv[1:]``).

  Returns:
    The exit status: 0 when every correctness check passed, 1 when one failed, 2 when
    nothing was run (this host has no device of the platform asked for, or ``--kernel
    mosaic_gpu`` without ``--platform gpu``; see :func:`run_checks`).
  """
  args = parser().parse_args(argv)
  r = Report()
  status = run_checks(r, args)
  return status if status is not None else write(r, args.out)


if __name__ == "__main__":
  sys.exit(main())
