"""Checks the GPU branches of dense attention on a real GPU: values, gradients, bf16 speed.

    python experiments/gpu_check.py                 # defaults: B=2, T=2048, N=16, K=4, H=128
    python experiments/gpu_check.py --T 4096 --repeats 20

What it does (exits non-zero if a check fails):

1. Auto-dispatch: for a bf16 causal call ``attnjax.dense.select_implementation``
   must pick ``"cudnn"``, and for an option cuDNN lacks (``normalizer="sigmoid"``)
   something else; fp32 inputs must not go to cuDNN.
2. Values: ``implementation=None`` (auto, i.e. cuDNN) and ``"cudnn"`` against
   ``"reference"`` for causal, window, GQA and padding-mask calls, in bf16
   (tolerance 2e-2 relative to the output's scale).
3. Gradients: d/dq, d/dk, d/dv of a scalar loss through the auto path against the
   reference (same tolerance).
4. The block-wise path (``implementation="blockwise"``, GPU block sizes) against
   the reference in value and gradient, in float32, at a short length.
5. Speed: forward and forward+backward in bf16 of auto (cuDNN), ``jax.nn``
   ``implementation="xla"`` and the attnjax reference; prints ms and the ratio
   to the reference.

It cannot run without a GPU; on a CPU it says so and exits 0, unless given
``--cpu-smoke`` (tiny sizes, ``"xla"`` in place of ``"cudnn"``, no dispatch or
speed expectations), which only proves the script itself runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import attnjax
from attnjax import dense


def _arrays(B, T, N, K, H, dtype, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, N, H), np.float32)
  k = rng.standard_normal((B, T, K, H), np.float32)
  v = rng.standard_normal((B, T, K, H), np.float32)
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _max_rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / max(1e-6, float(np.max(np.abs(b)))))


def _time(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3


class Checks:
  def __init__(self):
    self.failed = []

  def expect(self, ok: bool, what: str):
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
      self.failed.append(what)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--B", type=int, default=2)
  p.add_argument("--T", type=int, default=2048)
  p.add_argument("--N", type=int, default=16)
  p.add_argument("--K", type=int, default=4)
  p.add_argument("--H", type=int, default=128)
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--tol", type=float, default=2e-2)
  p.add_argument("--cpu-smoke", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  smoke = args.cpu_smoke and jax.default_backend() != "gpu"
  if smoke:
    args.B, args.T, args.N, args.K, args.H, args.repeats = 2, 640, 4, 2, 16, 1
  elif jax.default_backend() != "gpu":
    print(f"no GPU (backend {jax.default_backend()!r}): nothing to check")
    return 0
  kernel = "xla" if smoke else "cudnn"
  print(f"devices: {jax.devices()}")
  B, T, N, K, H = args.B, args.T, args.N, args.K, args.H
  q, k, v = _arrays(B, T, N, K, H, jnp.bfloat16)
  check = Checks()

  print("1. auto-dispatch")
  choice = dense.select_implementation(*dense.prepare(q, k, v, is_causal=True))
  check.expect(choice == kernel or smoke, f"bf16 causal -> {choice!r} (want 'cudnn')")
  choice = dense.select_implementation(*dense.prepare(q, k, v, normalizer="sigmoid"))
  check.expect(choice != "cudnn", f"bf16 sigmoid -> {choice!r} (cuDNN has no sigmoid)")
  q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
  choice = dense.select_implementation(*dense.prepare(q32, k32, v32, is_causal=True))
  check.expect(choice != "cudnn", f"fp32 causal -> {choice!r} (cuDNN takes bf16/fp16)")

  lengths = jnp.asarray([T, T // 2 + 3] + [T] * (B - 2))[:B]
  calls = {
      "causal": dict(is_causal=True),
      "window": dict(is_causal=True, window=(256, 0)),
      "padding mask": dict(mask=attnjax.masks.padding_mask(lengths, lengths, T, T)),
  }
  print("2./3. values and gradients, bf16, auto and cudnn vs reference")
  for name, kw in calls.items():
    ref = attnjax.dot_product_attention(q, k, v, implementation="reference", **kw)
    for impl in (None, kernel):
      out = attnjax.dot_product_attention(q, k, v, implementation=impl, **kw)
      err = _max_rel_err(out, ref)
      check.expect(err < args.tol, f"{name} impl={impl}: value rel err {err:.2e}")

    def loss(q, k, v, impl, kw=kw):
      out = attnjax.dot_product_attention(q, k, v, implementation=impl, **kw)
      return jnp.sum(out.astype(jnp.float32) * jnp.cos(out.astype(jnp.float32)))

    g_ref = jax.jit(jax.grad(lambda *a: loss(*a, "reference"), argnums=(0, 1, 2)))(q, k, v)
    g_auto = jax.jit(jax.grad(lambda *a: loss(*a, None), argnums=(0, 1, 2)))(q, k, v)
    for gname, a, b in zip(("dq", "dk", "dv"), g_auto, g_ref):
      err = _max_rel_err(a, b)
      check.expect(err < args.tol, f"{name} auto: {gname} rel err {err:.2e}")

  print("4. blockwise on the GPU, fp32, T=512")
  qs, ks, vs = (x[:, :512].astype(jnp.float32) for x in (q, k, v))
  for kw in (dict(is_causal=True), dict(window=(64, 0), normalizer="softpick")):
    ref = attnjax.dot_product_attention(qs, ks, vs, implementation="reference", **kw)
    out = attnjax.dot_product_attention(qs, ks, vs, implementation="blockwise", **kw)
    check.expect(_max_rel_err(out, ref) < 1e-4, f"blockwise {kw}: value")
    g = [jax.jit(jax.grad(lambda q, impl=impl: jnp.sum(attnjax.dot_product_attention(
        q, ks, vs, implementation=impl, **kw) ** 2)))(qs) for impl in ("reference", "blockwise")]
    check.expect(_max_rel_err(g[1], g[0]) < 1e-4, f"blockwise {kw}: dq")

  print(f"5. speed, bf16, B={B} T={T} N={N} K={K} H={H}, causal (median of {args.repeats})")
  paths = {
      "auto (cudnn)": lambda q, k, v: attnjax.dot_product_attention(q, k, v, is_causal=True),
      "jax.nn xla": lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation="xla"),
      "attnjax reference": lambda q, k, v: attnjax.dot_product_attention(
          q, k, v, is_causal=True, implementation="reference"),
  }
  print("| path | fwd ms | fwd+bwd ms | fwd vs reference | fwd+bwd vs reference |")
  print("|---|---:|---:|---:|---:|")
  rows = {}
  for name, fn in paths.items():
    fwd = jax.jit(fn)
    bwd = jax.jit(jax.grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32)),
                           argnums=(0, 1, 2)))
    rows[name] = (_time(fwd, q, k, v, repeats=args.repeats),
                  _time(bwd, q, k, v, repeats=args.repeats))
  base = rows["attnjax reference"]
  for name, (f, b) in rows.items():
    print(f"| {name} | {f:.2f} | {b:.2f} | {f / base[0]:.3f}x | {b / base[1]:.3f}x |")
  check.expect(smoke or rows["auto (cudnn)"][0] <= base[0],
               "auto forward is not slower than reference")

  print("FAILED: " + "; ".join(check.failed) if check.failed else "all checks passed")
  return 1 if check.failed else 0


if __name__ == "__main__":
  sys.exit(main())
