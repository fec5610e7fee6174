"""A short tour of the attention functions, with worked numbers.

    python experiments/demo.py

Prints (1) a worked two-key example (weights 0.330 / 0.670),
(2) each normaliser's statistics on the same causal input, (3) the variance of
q.k growing with the head dim and the 1/sqrt(d) scale undoing it, and
(4) agreement with ``jax.nn.dot_product_attention``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import attnjax


def worked_example() -> None:
  q = jnp.array([[[[1.0, 2.0]]]])  # [B=1, T=1, N=1, H=2]
  k = jnp.array([[[[1.0, 0.0]], [[0.0, 1.0]]]])  # [B=1, S=2, K=1, H=2]
  v = jnp.eye(2)[None, :, None, :]  # values = one-hot, so out = weights
  out, stats = attnjax.dot_product_attention(q, k, v, return_stats=True)
  logits = (q[0, 0, 0] @ k[0, :, 0].T) / jnp.sqrt(2.0)
  print("1. worked example q=(1,2), k1=(1,0), k2=(0,1), d_k=2")
  print(f"   logits  {logits[0]:.3f} {logits[1]:.3f}   (by hand: 0.707 1.414)")
  print(f"   weights {out[0, 0, 0, 0]:.3f} {out[0, 0, 0, 1]:.3f}   (by hand: 0.330 0.670)")
  print(f"   logsumexp {stats.logsumexp[0, 0, 0]:.3f}, entropy {stats.entropy[0, 0]:.3f} nats\n")


def normalizer_table() -> None:
  B, T, N, H = 4, 64, 8, 64
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (B, T, N, H))
  k = jax.random.normal(kk, (B, T, N, H))
  v = jax.random.normal(kv, (B, T, N, H))
  print(f"2. normalisers on one causal input (B={B}, T={T}, N={N}, H={H}, unit-variance q, k)")
  print(f"   {'variant':<22}{'sink_mass':>10}{'entropy':>9}{'max_logit':>10}{'row_sum':>9}")
  variants = [(n, {"normalizer": n}) for n in attnjax.normalizers.NORMALIZERS]
  variants.append(("softmax + sink -1.0", {"sink_logits": jnp.full((N,), -1.0)}))
  for name, kw in variants:
    _, s = attnjax.dot_product_attention(q, k, v, is_causal=True, return_stats=True, **kw)
    print(
      f"   {name:<22}{float(s.sink_mass.mean()):>10.3f}{float(s.entropy.mean()):>9.3f}"
      f"{float(s.max_logit.max()):>10.2f}{float(s.row_sum.mean()):>9.3f}"
    )
  _, s = attnjax.cosine_attention(
    q, k, v, temperature=jnp.full((N,), jnp.log(10.0)), is_causal=True, return_stats=True
  )
  print(
    f"   {'cosine (swin, tau=10)':<22}{float(s.sink_mass.mean()):>10.3f}"
    f"{float(s.entropy.mean()):>9.3f}{float(s.max_logit.max()):>10.2f}"
    f"{float(s.row_sum.mean()):>9.3f}"
  )
  print(
    f"   uniform causal attention has entropy {float(jnp.mean(jnp.log(jnp.arange(1, T + 1)))):.3f}\n"
  )


def scaling_table() -> None:
  print("3. q.k for unit-variance vectors: variance grows as d; 1/sqrt(d) keeps it O(1)")
  print(f"   {'d':>6}{'var(q.k)':>12}{'max |q.k|':>12}{'max |q.k|/sqrt(d)':>20}")
  for i, d in enumerate((64, 256, 1024)):
    kq, kk = jax.random.split(jax.random.key(i))
    q = jax.random.normal(kq, (256, d))
    k = jax.random.normal(kk, (256, d))
    dots = q @ k.T
    print(
      f"   {d:>6}{float(jnp.var(dots)):>12.1f}{float(jnp.abs(dots).max()):>12.1f}"
      f"{float(jnp.abs(dots).max() / jnp.sqrt(d)):>20.2f}"
    )
  print()


def parity() -> None:
  q, k, v = (
    jax.random.normal(key, (2, 128, 8, 64)) for key in jax.random.split(jax.random.key(1), 3)
  )
  ours = attnjax.dot_product_attention(q, k[:, :, :2], v[:, :, :2], is_causal=True)
  ref = jax.nn.dot_product_attention(q, k[:, :, :2], v[:, :, :2], is_causal=True)
  print(
    f"4. max |attnjax - jax.nn| (causal, GQA 8/2, fp32): {float(jnp.abs(ours - ref).max()):.2e}"
  )


if __name__ == "__main__":
  worked_example()
  normalizer_table()
  scaling_table()
  parity()
