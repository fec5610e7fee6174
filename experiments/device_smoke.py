"""A small mosaic_gpu forward + backward against the reference on the local GPU (the first device
call: catches hangs and barrier races before the long runs).

  python experiments/device_smoke.py [--seq 1024] [--head-dims 64,128]

Causal, bf16, GQA (4 query heads on 2), every normaliser's softmax and sigmoid: the output and
dq, dk, dv of ``sum(out * cot)`` against the reference in float32, each error over its array's
scale; prints one line per case and exits 1 if any is above 2e-2 (bf16 rounding, a few units).
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp

import attnjax


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seq", type=int, default=1024)
  p.add_argument("--head-dims", default="64,128")
  p.add_argument("--normalizers", default="softmax,sigmoid")
  args = p.parse_args()
  print(jax.__version__, jax.devices(), flush=True)
  failed = False
  for H in (int(h) for h in args.head_dims.split(",")):
    for nz in args.normalizers.split(","):
      keys = jax.random.split(jax.random.key(H), 4)
      q = jax.random.normal(keys[0], (2, args.seq, 4, H), jnp.bfloat16)
      k, v = (jax.random.normal(x, (2, args.seq, 2, H), jnp.bfloat16) for x in keys[1:3])
      cot = jax.random.normal(keys[3], q.shape, jnp.float32)

      def loss(q, k, v, impl):
        out = attnjax.dot_product_attention(
          q, k, v, is_causal=True, normalizer=nz, implementation=impl
        )
        return jnp.sum(out.astype(jnp.float32) * cot), out

      def both(impl, *xs):
        return jax.jit(jax.value_and_grad(lambda *a: loss(*a, impl), (0, 1, 2), has_aux=True))(*xs)

      t0 = time.time()
      (_, out), grads = jax.block_until_ready(both("mosaic_gpu", q, k, v))
      seconds = time.time() - t0
      up = [x.astype(jnp.float32) for x in (q, k, v)]
      with jax.default_matmul_precision("highest"):
        (_, want), want_grads = both("reference", *up)
      errs = []
      for a, b in zip((out, *grads), (want, *want_grads)):
        a, b = a.astype(jnp.float32), b.astype(jnp.float32)
        errs.append(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30)))
      bad = not all(e < 2e-2 for e in errs)  # NaN fails too
      failed |= bad
      print(
        f"{'FAIL' if bad else 'ok'} H={H} {nz}: out/dq/dk/dv errors "
        + " ".join(f"{e:.1e}" for e in errs)
        + f" ({seconds:.1f} s with compiles)",
        flush=True,
      )
  return int(failed)


if __name__ == "__main__":
  sys.exit(main())
