"""Benchmarks: attnjax paths against the built-ins, as ratios measured in one run.

    python experiments/bench.py                      # every suite
    python experiments/bench.py --suite dense        # one suite
    python experiments/bench.py --suite dense --sizes 256,1024 --repeats 3
    python experiments/bench.py --list
    python experiments/bench.py --memory --memory-filter compressed   # memory cases only
    python experiments/bench.py --suite pretrained   # sink statistics at 8k and 32k tokens
    python experiments/bench.py --suite mla          # MLA decode and cache bytes vs GQA at 32k
    python experiments/bench.py --suite hybrid --torch-python VENV/bin/python  # vs transformers

Each case is timed in this process after warm-up (compilation excluded), with
``block_until_ready``. The cases of one shape are timed in interleaved rounds
(one call of each, ``--repeats`` rounds) and reported as the best round, with
the median in brackets, so that load from elsewhere on a shared machine
cannot favour one row over the row it is compared with. The
machine's float32 matmul rate is measured in the same run, so every row shows
achieved GFLOP/s, percent of that rate, and its time over the baseline at the
same shape (``jax.nn.dot_product_attention`` unless the row says otherwise).

Memory cases (``--memory``) run each case in a fresh child process and report
its peak resident set size, so one case's allocations cannot hide another's.

Suites register themselves with :func:`suite`; a new path adds a function that
returns :class:`Case` rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable, Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np

import attnjax


@dataclasses.dataclass
class Case:
  """One timed row.

  Attributes:
    suite: table the row belongs to.
    method: what is timed (e.g. ``"attnjax reference"``).
    shape: label of the problem size; rows with equal ``(suite, shape)`` share a baseline.
    fn: a jitted callable; ``fn(*args)`` is timed.
    args: its arguments (created once, outside the timing).
    flops: useful floating-point operations of one call (for GFLOP/s).
    baseline: True for the row other rows at this shape are divided by.
  """

  suite: str
  method: str
  shape: str
  fn: Callable
  args: tuple
  flops: float
  baseline: bool = False
  tokens: int = 0  # training tokens per call: adds a tokens/s column to the suite's table


_SUITES: dict[str, Callable[[argparse.Namespace], Iterable[Case]]] = {}
_MEMORY: dict[str, Callable[[], tuple]] = {}


def suite(name: str):
  """Decorator registering a function ``(args) -> Iterable[Case]`` as a suite."""

  def register(fn):
    _SUITES[name] = fn
    return fn

  return register


def memory_case(name: str):
  """Decorator registering ``() -> (step, args)``: ``step`` (a ``jax.jit`` function) is
  compiled and run on ``args`` in a process of its own and measured there."""

  def register(fn):
    _MEMORY[name] = fn
    return fn

  return register


# ---------------------------------------------------------------------------
# Timing.


def block(x):
  return jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def matmul_rate(n: int = 2048, repeats: int = 5) -> float:
  """This machine's float32 matmul rate in GFLOP/s (n x n x n, jitted, best of ``repeats``)."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  case = Case("matmul", "jnp.matmul", f"{n}^3", jax.jit(jnp.matmul), (a, b), 2.0 * n**3)
  best, _ = time_group([case], repeats)[0]
  return case.flops / best / 1e9


# ---------------------------------------------------------------------------
# Shared helpers for suites.


def qkv(
  B: int,
  T: int,
  N: int,
  H: int,
  *,
  S: Optional[int] = None,
  K: Optional[int] = None,
  dtype=jnp.float32,
  seed: int = 0,
):
  S = T if S is None else S
  K = N if K is None else K
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (
    jax.random.normal(kq, (B, T, N, H), dtype),
    jax.random.normal(kk, (B, S, K, H), dtype),
    jax.random.normal(kv, (B, S, K, H), dtype),
  )


def allowed_pairs(
  T: int, S: int, *, is_causal: bool, window: Optional[tuple[int, int]] = None
) -> int:
  """Number of (query, key) pairs a causal/window mask allows (exact, top-left aligned)."""
  i = np.arange(T)[:, None]
  lo = np.zeros((T, 1), np.int64)
  hi = np.full((T, 1), S - 1, np.int64)
  if is_causal:
    hi = np.minimum(hi, i)
  if window is not None:
    lo = np.maximum(lo, i - window[0])
    hi = np.minimum(hi, i + window[1])
  return int(np.clip(hi - lo + 1, 0, None).sum())


def attention_flops(B: int, N: int, H: int, pairs: int, *, backward: bool = False) -> float:
  """QK^T and PV matmuls over the allowed pairs; forward+backward counts 3.5x (FlashAttention-2)."""
  fwd = 4.0 * B * N * H * pairs
  return fwd * 3.5 if backward else fwd


def fwd_bwd(attn: Callable) -> Callable:
  """Jitted ``(q, k, v) -> (out, grads)`` of ``sum(attn(q, k, v) * ct)``-style loss."""

  def loss(q, k, v):
    return jnp.sum(attn(q, k, v).astype(jnp.float32))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def parse_sizes(text: str) -> list[int]:
  return [int(s) for s in text.split(",") if s]


# ---------------------------------------------------------------------------
# Suites.


@suite("dense")
def dense_suite(args) -> Iterable[Case]:
  """Dense causal forward (B=1, N=8, H=64, fp32): reference and xla against jax.nn."""
  B, N, H = 1, 8, 64
  for T in parse_sizes(args.sizes or "256,1024,4096"):
    q, k, v = qkv(B, T, N, H)
    flops = attention_flops(B, N, H, allowed_pairs(T, T, is_causal=True))
    shape = f"T={T}"
    yield Case(
      "dense",
      "jax.nn.dot_product_attention",
      shape,
      jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)),
      (q, k, v),
      flops,
      baseline=True,
    )
    for impl in ("reference", "xla", "blockwise"):
      yield Case(
        "dense",
        f"attnjax {impl}",
        shape,
        jax.jit(
          lambda q, k, v, impl=impl: attnjax.dot_product_attention(
            q, k, v, is_causal=True, implementation=impl
          )
        ),
        (q, k, v),
        flops,
      )


@suite("pallas_tpu")
def pallas_tpu_suite(args) -> Iterable[Case]:
  """The Pallas TPU kernel (causal, fwd+bwd, bf16 on a TPU: B=1, N=8, H=128) against jax.nn
  and splash; every normaliser. Without a TPU the kernel runs in Pallas interpret mode on
  this backend, as a correctness smoke test only: each normaliser's output is checked against
  the reference before its row is timed, and the times measure the interpreter, not the
  kernel (``experiments/device_check.py --platform tpu`` measures it on a TPU)."""
  from attnjax.kernels import pallas_tpu

  on_tpu = jax.default_backend() == "tpu"
  B, N, H = 1, 8, 128 if on_tpu else 32
  dtype = jnp.bfloat16 if on_tpu else jnp.float32
  sizes = parse_sizes(args.sizes or ("1024,4096,16384" if on_tpu else "256"))
  for T in sizes:
    q, k, v = (x.astype(dtype) for x in qkv(B, T, N, H))
    flops = attention_flops(B, N, H, allowed_pairs(T, T, is_causal=True), backward=True)
    shape = f"T={T}" + ("" if on_tpu else " (interpret mode: not kernel speed)")
    yield Case(
      "pallas_tpu",
      "jax.nn.dot_product_attention",
      shape,
      fwd_bwd(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)),
      (q, k, v),
      flops,
      baseline=True,
    )
    if on_tpu:
      yield Case(
        "pallas_tpu",
        "attnjax splash softmax",
        shape,
        fwd_bwd(
          lambda q, k, v: attnjax.dot_product_attention(
            q, k, v, is_causal=True, implementation="splash"
          )
        ),
        (q, k, v),
        flops,
      )
    for n in attnjax.normalizers.NORMALIZERS:
      if on_tpu:
        attn = lambda q, k, v, n=n: attnjax.dot_product_attention(
          q, k, v, is_causal=True, normalizer=n, implementation="pallas_tpu"
        )
      else:
        attn = lambda q, k, v, n=n: pallas_tpu.attention(
          q,
          k,
          v,
          is_causal=True,
          normalizer=n,
          interpret=True,
          block_sizes=pallas_tpu.BlockSizes(128, 128, 128, 128),
        )
        ref = attnjax.dot_product_attention(
          q, k, v, is_causal=True, normalizer=n, implementation="reference"
        )
        err = float(jnp.max(jnp.abs(jax.jit(attn)(q, k, v) - ref)))
        if not err < 1e-4:
          raise AssertionError(f"pallas_tpu interpret {n}: max error {err:.2e} vs the reference")
        print(
          f"  pallas_tpu interpret {n}: max |error| vs reference {err:.1e} (ok)", file=sys.stderr
        )
      yield Case(
        "pallas_tpu",
        f"attnjax pallas_tpu {n}" + ("" if on_tpu else " (interpret)"),
        shape,
        fwd_bwd(attn),
        (q, k, v),
        flops,
      )


MESH_SHAPES = (
  "data=8",
  "fsdp=8",
  "data=2,fsdp=4",
  "fsdp=4,tensor=2",
  "data=2,context=4",
  "fsdp=2,tensor=2,context=2",
)


def _mesh_child() -> None:
  """In a process of 8 host devices: per-device bytes of parameters + optimizer state and the
  step time of the cpu preset's model (d_model 256, 4 layers) on each mesh of MESH_SHAPES."""
  import tempfile
  from attnjax.train import config as config_lib
  from attnjax.train import mesh as mesh_lib
  from attnjax.train import Trainer

  rows = []
  for shape in MESH_SHAPES:
    c = config_lib.apply_preset(config_lib.base_config(), "cpu")
    c.model.update(d_model=256, num_layers=4, num_heads=8)
    c.data.name = "bigram_backcopy"
    c.train.update(progress=False, plots=False)
    c.mesh.update(
      dict(dict(data=1), **{k: int(v) for k, v in (kv.split("=") for kv in shape.split(","))})
    )
    c.run_dir = tempfile.mkdtemp()
    t = Trainer(c)
    per_device = mesh_lib.bytes_per_device((t.state["params"], t.state["opt_state"]))
    with jax.set_mesh(t.dp.mesh):
      b = t.batches.batch("train", 0)
      args = t.dp.batch_args(b)
      step = t.train_step.lower(t.state, t.rest, *args).compile()
      state, m = step(t.state, t.rest, *args)
      block(m)
      t0 = time.perf_counter()
      for _ in range(3):
        state, m = step(state, t.rest, *args)
      block(m)
    rows.append(
      dict(
        mesh=shape,
        max_bytes=max(per_device.values()),
        step_ms=(time.perf_counter() - t0) / 3 * 1e3,
        params=t.num_params,
      )
    )
  print(json.dumps(rows))


@suite("mesh")
def mesh_suite(args) -> Iterable[Case]:
  """Training meshes (8 host devices in a child process): bytes of parameters + Adam state on
  the fullest device, against the replicated (data=8) run, and the cpu preset's step time at
  d_model 256, 4 layers (host devices share this CPU: the times show overheads, not scaling)."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  out = subprocess.run(
    [sys.executable, os.path.abspath(__file__), "--mesh-child"],
    capture_output=True,
    text=True,
    env=env,
    check=False,
  )
  if out.returncode != 0:
    print(f"## mesh\n\nfailed: {out.stderr.strip().splitlines()[-1:]}\n")
    return []
  rows = json.loads(out.stdout.strip().splitlines()[-1])
  base = rows[0]["max_bytes"]
  print(f"## mesh\n\n{mesh_suite.__doc__.strip()}\n")
  print(f"params: {rows[0]['params']:,}\n")
  print("| mesh | params + opt state, fullest device (MiB) | vs data=8 | step ms |")
  print("|---|---:|---:|---:|")
  for r in rows:
    print(
      f"| {r['mesh']} | {r['max_bytes'] / 2**20:.2f} | {r['max_bytes'] / base:.3f}x | "
      f"{r['step_ms']:.1f} |"
    )
  print()
  return []


def _pattern_pairs(pattern, T: int) -> int:
  """Allowed (query, key) pairs of a pattern, counted from its mask one row block at a time."""
  total = 0
  for lo in range(0, T, 1024):
    rows = jnp.arange(lo, min(lo + 1024, T))
    total += int(jnp.sum(pattern.allowed(rows, jnp.arange(T), (T, T))))
  return total


@suite("sparse")
def sparse_suite(args) -> Iterable[Case]:
  """Block-sparse patterns, causal forward (B=1, N=8, H=64, fp32), against dense jax.nn causal at T=4096; NSA and DSA fwd+bwd against our block-wise dense.

  Rows of the first shape are divided by the same baseline
  (jax.nn.dot_product_attention causal at T=4096); jax.nn is never run at
  T=16384 (its logits need ~16 GiB). The "T=16384/T=4096" rows divide the
  window's time by its own time at T=4096 (linear growth: 4x).

  "fwd+bwd T=..." rows (``--long-sizes``, default 32768,65536; shape ``--trained-shape``,
  default B=1, N=8, K=1, H=64): NSA in fla's configuration (block 64, 16 selected blocks,
  window 512) and the paper's (compression 32 at stride 16, selection 64), and DSA with
  top-k 2048 (at 32768 only; indexer of 4 heads of 64 and its top-k included), each
  forward + backward divided by the block-wise dense causal engine's. The targets on
  a CPU: NSA at most 0.35x at 32k and 0.2x at 64k, DSA at most 0.3x at 32k. The
  "crossover T=..." rows (``--crossover-sizes``, default 2048..16384) give the length from
  which each becomes faster than dense, printed below the table; ``--memory`` adds their
  peak temporary memory at 64k over 32k (target at most 2.2x).
  """
  B, N, H = 1, 8, 64
  shape = "B=1,N=8,H=64"
  q, k, v = qkv(B, 4096, N, H)
  yield Case(
    "sparse",
    "jax.nn.dot_product_attention causal T=4096",
    shape,
    jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)),
    (q, k, v),
    attention_flops(B, N, H, allowed_pairs(4096, 4096, is_causal=True)),
    baseline=True,
  )
  window = attnjax.patterns.sliding_window(256)
  pairs = lambda T: allowed_pairs(T, T, is_causal=True, window=(256, 0))

  def window_case(T, block, shape, baseline=False):
    qT, kT, vT = qkv(B, T, N, H)
    attend = jax.jit(
      lambda q, k, v: attnjax.sparse_attention(q, k, v, pattern=window, block_size=block)
    )
    return Case(
      "sparse",
      f"sliding_window(256) T={T} block={block}",
      shape,
      attend,
      (qT, kT, vT),
      attention_flops(B, N, H, pairs(T)),
      baseline=baseline,
    )

  # Block 64 computes 320 keys per query for the 257 it needs, block 128 384.
  runs = [(T, block) for T in parse_sizes(args.sizes or "4096,16384") for block in (64, 128)]
  for T, block in runs:
    yield window_case(T, block, shape)
  # Growth with length, each block size against its own T=4096 time (linear = 4x).
  sizes = parse_sizes(args.sizes or "4096,16384")
  for block in (64, 128) if len(sizes) > 1 else ():
    growth = f"sliding_window(256) block={block}: T={sizes[-1]}/T={sizes[0]}"
    for T in (sizes[0], sizes[-1]):
      yield window_case(T, block, growth, baseline=T == sizes[0])
  # strided runs as a window plus its transposed columns; fixed visits its own
  # block plus gathered summary keys.
  for pattern, block in ((attnjax.patterns.strided(64), 64), (attnjax.patterns.fixed(64, 8), 64)):
    yield Case(
      "sparse",
      f"{pattern} T=4096 block={block}",
      shape,
      jax.jit(
        lambda q, k, v, pattern=pattern, block=block: attnjax.sparse_attention(
          q, k, v, pattern=pattern, block_size=block
        )
      ),
      (q, k, v),
      attention_flops(B, N, H, _pattern_pairs(pattern, 4096)),
    )
  # NSA and DSA, forward + backward against the block-wise dense engine at the long lengths
  # (--long-sizes), and at the shorter ones of --crossover-sizes for the crossover lengths.
  B, N, K, H = trained_shape(args)
  trained = f"B={B},N={N},K={K},H={H}"
  for T in parse_sizes(getattr(args, "long_sizes", None) or "32768,65536"):
    yield from trained_cases(B, N, K, H, T, f"fwd+bwd T={T} ({trained})", dsa=T <= 32768)
  for T in parse_sizes(getattr(args, "crossover_sizes", None) or "2048,4096,8192,16384"):
    yield from trained_cases(B, N, K, H, T, f"crossover T={T}")


# ---------------------------------------------------------------------------
# Trainable sparse attention: NSA and DSA (in --suite sparse).

# fla's NSA configuration (one block size 64 for compression and selection, 16 selected
# blocks, window 512) and the paper's (compression 32 at stride 16, selection 64).
NSA_CONFIGS = {
  "fla": dict(block_length=64, stride=64, selection_block=64, num_selected=16, window=512),
  "paper": dict(block_length=32, stride=16, selection_block=64, num_selected=16, window=512),
}
DSA_TOP_K = 2048
DSA_INDEX = (4, 64)  # indexer heads NI, head dim HI


def trained_shape(args) -> tuple[int, int, int, int]:
  """``(B, N, K, H)`` of the NSA / DSA rows (``--trained-shape``; default 1,8,1,64: 8 query
  heads sharing one KV head, DeepSeek's MQA-style grouping, which the selected blocks' gather
  serves once per group)."""
  B, N, K, H = (int(x) for x in (getattr(args, "trained_shape", None) or "1,8,1,64").split(","))
  return B, N, K, H


def nsa_call(config: str):
  opts = NSA_CONFIGS[config]

  def call(q, k, v, gates):
    return attnjax.nsa_attention(q, k, v, gates, **opts)

  return call


def nsa_pairs(T: int, config: str) -> int:
  """Keys NSA attends summed over queries: ended compressed blocks, selected keys, window."""
  o = NSA_CONFIGS[config]
  t = np.arange(T)
  compressed = np.maximum(0, (t - o["block_length"] + 1) // o["stride"] + 1)
  selected = np.minimum(t + 1, o["num_selected"] * o["selection_block"])
  window = np.minimum(t + 1, o["window"] + 1)
  return int((compressed + selected + window).sum())


def dsa_inputs(B: int, T: int, seed: int = 3):
  NI, HI = DSA_INDEX
  keys = jax.random.split(jax.random.key(seed), 3)
  return (
    jax.random.normal(keys[0], (B, T, NI, HI)),
    jax.random.normal(keys[1], (B, T, HI)),
    jax.random.normal(keys[2], (B, T, NI)),
  )


def trained_cases(B: int, N: int, K: int, H: int, T: int, shape: str, *, dsa: bool = True):
  """Forward + backward rows at length ``T``: the block-wise dense causal baseline, NSA in
  both configurations, and DSA at top-k 2048 (its indexer and top-k included: the indexer
  gets no gradient from the attention, as in DeepSeek-V3.2)."""
  q, k, v = qkv(B, T, N, H, K=K)
  gates = jax.nn.sigmoid(jax.random.normal(jax.random.key(7), (B, T, N, 3)))
  dense_pairs = allowed_pairs(T, T, is_causal=True)
  yield Case(
    "sparse",
    "attnjax blockwise dense causal fwd+bwd",
    shape,
    fwd_bwd(
      lambda q, k, v: attnjax.dot_product_attention(
        q, k, v, is_causal=True, implementation="blockwise"
      )
    ),
    (q, k, v),
    attention_flops(B, N, H, dense_pairs, backward=True),
    baseline=True,
  )
  for config in NSA_CONFIGS:
    call = nsa_call(config)
    yield Case(
      "sparse",
      f"nsa {config} ({', '.join(f'{a}={b}' for a, b in NSA_CONFIGS[config].items())}) fwd+bwd",
      shape,
      fwd_bwd(lambda q, k, v, call=call: call(q, k, v, gates)),
      (q, k, v),
      attention_flops(B, N, H, nsa_pairs(T, config), backward=True),
    )
  if dsa:
    iq, ik, iw = dsa_inputs(B, T)
    yield Case(
      "sparse",
      f"dsa top_k={DSA_TOP_K} (indexer NI={DSA_INDEX[0]}, HI={DSA_INDEX[1]}) fwd+bwd",
      shape,
      fwd_bwd(lambda q, k, v: attnjax.dsa_attention(q, k, v, iq, ik, iw, top_k=DSA_TOP_K)),
      (q, k, v),
      attention_flops(B, N, H, T * min(T, DSA_TOP_K), backward=True),
    )


def crossover_report(rows: list[dict]) -> list[str]:
  """Lines naming, for each NSA / DSA row, the length from which it is faster than the dense
  baseline of its shape: interpolated in log length between the two measured lengths whose
  ratios straddle 1 ("below the shortest" / "above the longest" when they do not)."""
  by_method: dict[str, list] = {}
  for r in rows:
    if not r["shape"].startswith("crossover T=") or r["baseline"] or r["error"]:
      continue
    T = int(r["shape"].split("=")[1])
    by_method.setdefault(r["method"], []).append((T, r["ratio"]))
  lines = []
  for method, points in by_method.items():
    points.sort()
    found = None
    for (t0, r0), (t1, r1) in zip(points, points[1:]):
      if r0 >= 1.0 > r1:
        w = np.log(r0) / (np.log(r0) - np.log(r1))
        found = f"~{int(round(np.exp(np.log(t0) + w * (np.log(t1) - np.log(t0)))))} tokens"
        break
    if found is None:
      found = f"below T={points[0][0]}" if points[0][1] < 1.0 else f"above T={points[-1][0]}"
    ratios = ", ".join(f"T={t}: {r:.2f}x" for t, r in points)
    lines.append(f"- {method}: faster than dense from {found} ({ratios})")
  return lines


def _trained_memory(kind: str, T: int):
  def make():
    B, N, K, H = trained_shape(None)
    q, k, v = qkv(B, T, N, H, K=K)
    if kind == "dsa":
      iq, ik, iw = dsa_inputs(B, T)
      step = fwd_bwd(lambda q, k, v: attnjax.dsa_attention(q, k, v, iq, ik, iw, top_k=DSA_TOP_K))
    else:
      gates = jnp.full((B, T, N, 3), 0.5)
      call = nsa_call(kind.split()[1])
      step = fwd_bwd(lambda q, k, v: call(q, k, v, gates))
    return step, (q, k, v)

  return make


for _kind in ("nsa fla", "nsa paper", "dsa"):
  for _T in (32768, 65536):
    memory_case(f"{_kind} fwd+bwd T={_T} (B=1, N=8, K=1, H=64, fp32)")(_trained_memory(_kind, _T))


def memory_growth(memory: list[dict]) -> list[str]:
  """Lines dividing each NSA / DSA case's XLA temporaries at T=65536 by those at T=32768."""
  temp = {m["case"]: m.get("xla_temp_mib") for m in memory if "error" not in m}
  lines = []
  for name, value in temp.items():
    if "T=65536" not in name or value is None:
      continue
    base = temp.get(name.replace("T=65536", "T=32768"))
    if base:
      lines.append(
        f"- {name.split(' fwd')[0]}: temporaries {value:.0f} MiB at T=65536 over "
        f"{base:.0f} MiB at T=32768 = {value / base:.2f}x"
      )
  return ([""] + lines + [""]) if lines else []


@dataclasses.dataclass(frozen=True)
class CheckerPattern(attnjax.patterns.Pattern):
  """A pattern as a user writes one (the compile-time suite's custom rule): causal, query
  block ``i // period`` keeps key blocks of the same parity, and every diagonal key."""

  period: int = 16

  def allowed(self, q_positions, k_positions, shape):
    qp, kp = jnp.asarray(q_positions)[:, None], jnp.asarray(k_positions)[None, :]
    same = ((qp // self.period) + (kp // self.period)) % 2 == 0
    return (kp <= qp) & (same | (kp == qp))

  @property
  def is_causal(self) -> bool:
    return True


def _compile_patterns(block: int) -> dict:
  P = attnjax.patterns
  return {
    "custom (CheckerPattern)": CheckerPattern(block),
    f"strided({block})": P.strided(block),
    f"fixed({block}, {block // 4})": P.fixed(block, block // 4),
    f"bigbird({block}, 1, 1, 2)": P.bigbird(block, 1, 1, 2, seed=0),
    f"union(sliding_window({2 * block}), causal & strided({block}))": P.sliding_window(2 * block)
    | (P.causal() & P.strided(block)),
    f"global_window(2, {block})": P.global_window(2, block),
  }


def compile_seconds(fn: Callable, *args) -> float:
  """Seconds to trace, lower and compile ``jax.jit(fn)`` on ``args`` from empty caches."""
  jax.clear_caches()
  t0 = time.perf_counter()
  jax.jit(fn).lower(*args).compile()
  return time.perf_counter() - t0


# The target: a block-sparse call compiles in at most this many times the time of dense
# attention with the pattern's mask, forward and gradient, at T <= 1024.
PATTERN_COMPILE_TARGET = 3.0


@suite("pattern_compile")
def pattern_compile_suite(args) -> Iterable[Case]:
  """Compile time of block-sparse patterns against dense attention with the pattern's mask.

  Trace + lower + XLA compile from empty caches (the persistent compilation cache off), best
  of two alternating measurements, forward and gradient (B=1, N=4, K=2, H=16, fp32). "auto" is
  sparse_attention as called (the reference below sparse.BLOCKWISE_MIN_LENGTH tokens),
  "blockwise" names the block plan; the dense row is dot_product_attention(mask=...) as called.
  Ratios over the dense row of the same T and mode; the target is <= 3x at T <= 1024.
  """
  sizes = parse_sizes(args.sizes or "128,512,1024")
  cache = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  grad = lambda f: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))
  rows = []
  try:
    for T in sizes:
      block = max(16, T // 8)
      q, k, v = qkv(1, T, 4, 16, K=2)
      for name, pattern in _compile_patterns(block).items():
        mask = pattern.mask(T)
        dense = lambda q, k, v, mask=mask: attnjax.dot_product_attention(q, k, v, mask=mask)
        row = dict(pattern=name, T=T, block=block)
        for impl in (None, "blockwise"):
          sp = lambda q, k, v, impl=impl, pattern=pattern, block=block: attnjax.sparse_attention(
            q, k, v, pattern=pattern, block_size=block, implementation=impl
          )
          for mode, wrap in (("fwd", lambda f: f), ("grad", grad)):
            pairs = [
              (compile_seconds(wrap(sp), q, k, v), compile_seconds(wrap(dense), q, k, v))
              for _ in range(2)
            ]
            ours, base = min(p[0] for p in pairs), min(p[1] for p in pairs)
            row[f"{impl or 'auto'} {mode}"] = (ours, base)
            print(
              f"  pattern_compile T={T} {name} {impl or 'auto'} {mode}: {ours:.2f} s / "
              f"{base:.2f} s dense",
              file=sys.stderr,
              flush=True,
            )
        rows.append(row)
  finally:
    jax.config.update("jax_enable_compilation_cache", cache)
  print(f"## pattern_compile\n\n{pattern_compile_suite.__doc__.strip()}\n")
  print(f"attnjax.sparse.BLOCKWISE_MIN_LENGTH = {attnjax.sparse.BLOCKWISE_MIN_LENGTH}\n")
  keys = ("auto fwd", "auto grad", "blockwise fwd", "blockwise grad")
  print("| pattern | T | block | " + " | ".join(f"{key} (s, over dense)" for key in keys) + " |")
  print("|---|---:|---:|" + "---:|" * len(keys))
  worst = {key: 0.0 for key in keys}
  for r in rows:
    cells = []
    for key in keys:
      ours, base = r[key]
      worst[key] = max(worst[key], ours / base)
      cells.append(f"{ours:.2f} ({ours / base:.1f}x)")
    print(f"| {r['pattern']} | {r['T']} | {r['block']} | " + " | ".join(cells) + " |")
  print()
  met = all(worst[key] <= PATTERN_COMPILE_TARGET for key in ("auto fwd", "auto grad"))
  print(
    "worst ratio: "
    + ", ".join(f"{key} {value:.1f}x" for key, value in worst.items())
    + f"; target <= {PATTERN_COMPILE_TARGET:g}x (auto) {'met' if met else 'NOT met'}\n"
  )
  return []


@memory_case("sparse_window256_fwd_bwd_T16384")
def sparse_window_memory():
  """Forward + backward of sliding_window(256) at T=16384 (B=1, N=8, H=64, fp32)."""
  q, k, v = qkv(1, 16384, 8, 64)
  pattern = attnjax.patterns.sliding_window(256)
  step = fwd_bwd(lambda q, k, v: attnjax.sparse_attention(q, k, v, pattern=pattern, block_size=128))
  return step, (q, k, v)


@suite("train")
def train_suite(args) -> Iterable[Case]:
  """One AdamW training step of the cpu-preset decoder LM (experiments/configs/compare.py:preset=cpu).

  FLOPs are the model FLOPs of training, ``6 N`` per token plus causal attention
  ``6 L T D`` (Kaplan et al. 2020; PaLM app. B), so "% matmul" is the model-FLOPs
  utilisation (MFU) against this run's measured matmul rate. "with per-step
  stats" is the step the loop runs (layers report max logit, entropy, F-Attn);
  "plain" skips them. ``--sizes`` sets the batch sizes (default: the preset's).
  """
  from attnjax.train.config import load_config
  from attnjax.train import Trainer
  from attnjax.train import make_train_step

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  preset = load_config(os.path.join(root, "experiments/configs/compare.py:preset=cpu"))
  for variant in ("dense", "qk_layernorm"):
    for batch in parse_sizes(args.sizes or str(preset.data.batch_size)):
      cfg = load_config(
        os.path.join(root, "experiments/configs/compare.py:preset=cpu"),
        [f"variant={variant}", f"data.batch_size={batch}", "train.num_devices=1"],
      )
      cfg.run_dir = os.path.join("/tmp", "attnjax_bench_train")
      trainer = Trainer(cfg)
      b = trainer.batches.batch("train", 0)
      inputs, targets = trainer.dp.put_batch(b.inputs), trainer.dp.put_batch(b.targets)
      tokens = cfg.data.batch_size * cfg.data.seq_len
      shape = (
        f"{variant} B={batch} ({cfg.train.microbatches} microbatches) "
        f"T={cfg.data.seq_len} D={cfg.model.d_model} L={cfg.model.num_layers} "
        f"({trainer.num_params / 1e3:.0f}k params)"
      )
      for label, with_stats in (("plain", False), ("with per-step stats", True)):
        step = jax.jit(
          make_train_step(
            trainer.graphdef,
            trainer.optimizer,
            stats=with_stats,
            microbatches=cfg.train.microbatches,
          )
        )
        yield Case(
          "train",
          f"train_step {label}",
          shape,
          step,
          (trainer.state, trainer.rest, inputs, targets),
          trainer.flops_per_token * tokens,
          baseline=not with_stats,
          tokens=tokens,
        )


@suite("seeds")
def seeds_suite(args) -> Iterable[Case]:
  """The seeds of one arm of the main job (experiments/configs/compare.py:preset=cpu, dense
  and qk_layernorm): S training steps of one seed each, called one after another (how S
  separate runs step), against one step of the S seeds stacked on a leading axis of their
  parameters, optimiser states and batches, as ``attnjax.train.train_seeds`` trains them:
  ``jax.lax.map`` (the step's kernels once per seed, in one program; its default on a CPU)
  and ``jax.vmap`` (batched kernels; its default on accelerators). Each call runs 5 steps
  of each; a ratio below 1 is what stacking saves per step (separate runs also compile
  their step S times, a group once). ``--sizes`` sets S (default 3)."""
  from attnjax.train import Trainer, make_train_step, stacked_step
  from attnjax.train.config import load_config

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  calls = 5
  for variant in ("dense", "qk_layernorm"):
    for S in parse_sizes(args.sizes or "3"):
      trainers = []
      for seed in range(S):
        cfg = load_config(
          os.path.join(root, "experiments/configs/compare.py:preset=cpu"),
          [f"variant={variant}", f"seed={seed}", "train.num_devices=1"],
        )
        cfg.run_dir = os.path.join("/tmp", f"attnjax_bench_seeds_{seed}")
        trainers.append(Trainer(cfg))
      first = trainers[0]
      fn = make_train_step(
        first.graphdef,
        first.optimizer,
        stats=cfg.train.step_stats,
        microbatches=cfg.train.microbatches,
      )
      one = jax.jit(fn)
      stacked = {k: stacked_step(fn, k, donate=False) for k in ("map", "vmap")}
      batches = [t.dp.batch_args(t.batches.batch("train", 0)) for t in trainers]
      stack = lambda trees: jax.tree.map(lambda *xs: jnp.stack(xs), *trees)

      # The suite's cases are all built before any is timed: bind this variant's steps now.
      def separate(states, rests, batches, one=one):
        out = []
        for _ in range(calls):
          out = [one(st, r, *b) for st, r, b in zip(states, rests, batches)]
        return out

      def together(state, rest, *batch, step=None):
        for _ in range(calls):
          out = step(state, rest, *batch)
        return out

      tokens = calls * S * cfg.data.batch_size * cfg.data.seq_len
      flops = first.flops_per_token * tokens
      shape = (
        f"{variant} x{S} seeds, B={cfg.data.batch_size} T={cfg.data.seq_len} "
        f"D={cfg.model.d_model} L={cfg.model.num_layers}, {calls} steps per call"
      )
      yield Case(
        "seeds",
        f"{S} separate steps",
        shape,
        separate,
        ([t.state for t in trainers], [t.rest for t in trainers], batches),
        flops,
        baseline=True,
        tokens=tokens,
      )
      for kind, step in stacked.items():
        state = stack([t.state for t in trainers])
        yield Case(
          "seeds",
          f"one stacked step ({'lax.map' if kind == 'map' else 'vmap'} over {S})",
          shape,
          lambda *args, step=step: together(*args, step=step),
          (state, stack([t.rest for t in trainers]), *stack(batches)),
          flops,
          tokens=tokens,
        )


# The trainer suite: the Trainer's tokens/s over its own compiled step's.
TRAINER_DEFAULTS = {
  "gpu": dict(preset="gpu", steps=300),
  "tpu": dict(preset="tpu", steps=300),
  "cpu": dict(preset="cpu", steps=60),
}


def trainer_vs_step(
  preset: str,
  variant: str,
  steps: int,
  *,
  data: str = "shakespeare",
  overrides: tuple = (),
  trace: str = "",
) -> dict:
  """Tokens/s of ``Trainer.run`` for ``steps`` steps and of its compiled step alone.

  The run is ``experiments/configs/compare.py:preset=<preset>`` with ``variant``, ``data``,
  ``train.steps=<steps>``, no checkpoints or plots, and ``overrides`` (``"key=value"``),
  in a temporary run directory; its rate is its summary's (the median over its reads of the
  metrics, every ``log_every`` steps, but the first). The bare step is the executable the
  run stepped with, called back to back on one batch already on the device (as
  ``experiments/device_check.py`` times it), ``steps`` times in windows of ``log_every``
  steps; its rate is the median window's but the first. ``trace``: a folder for a
  ``jax.profiler`` trace of the run.
  """
  import shutil
  import tempfile
  from attnjax.train.config import load_config
  from attnjax.train import Trainer

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cfg = load_config(
    os.path.join(root, f"experiments/configs/compare.py:preset={preset}"),
    [
      f"variant={variant}",
      f"data.name={data}",
      f"train.steps={steps}",
      "train.checkpoint_every=0",
      "train.plots=false",
      *overrides,
    ],
  )
  cfg.run_dir = tempfile.mkdtemp(prefix="attnjax_bench_trainer_")
  try:
    trainer = Trainer(cfg)
    if trace:
      with jax.profiler.trace(trace):
        summary = trainer.run()
    else:
      summary = trainer.run()
    with jax.set_mesh(trainer.dp.mesh):
      b = trainer.batches.batch("train", 0)
      bare_s, state = _time_step(trainer, trainer.state, trainer.dp.batch_args(b), steps)
      # The same step on random tokens (device_check's input): is the step's time the data's?
      rng = np.random.default_rng(0)
      noise = trainer.dp.put_batch(
        rng.integers(0, trainer.batches.model_vocab_size, b.inputs.shape).astype(np.int32)
      )
      random_s, _ = _time_step(trainer, state, (noise, noise), steps)
  finally:
    shutil.rmtree(cfg.run_dir, ignore_errors=True)
  tokens = cfg.data.batch_size * cfg.data.seq_len
  run_tps = summary["steps_done"] * tokens / summary["train_time_s"]
  return dict(
    variant=variant,
    preset=preset,
    params=trainer.num_params,
    tokens_per_step=tokens,
    trainer_tokens_per_s=summary["tokens_per_s"],
    trainer_all_tokens_per_s=run_tps,
    step_tokens_per_s=tokens / bare_s,
    random_tokens_per_s=tokens / random_s,
    ratio=summary["tokens_per_s"] * bare_s / tokens,
    mfu=summary["mfu"],
    loop_time_s=summary["loop_time_s"],
    steps=summary["steps_done"],
    log_every=cfg.train.log_every,
  )


def _time_step(trainer, state, args: tuple, steps: int) -> tuple:
  """``(seconds per step, state)`` of the trainer's compiled step on ``args``, the median of
  windows of ``log_every`` steps (as the run reads its metrics) but the first."""
  step, chunk, times = trainer.compiled_step, trainer.cfg.train.log_every, []
  state, m = step(state, trainer.rest, *args)
  block(m)
  for _ in range(max(steps // chunk, 1)):
    t0 = time.perf_counter()
    for _ in range(chunk):
      state, m = step(state, trainer.rest, *args)
    block((state, m))
    times.append((time.perf_counter() - t0) / chunk)
  return statistics.median(times[1:] or times), state


def _trainer_settings() -> dict:
  """The suite's settings: the defaults of this process's devices, then ``ATTNJAX_BENCH_TRAINER``."""
  backend = jax.default_backend()
  out = dict(
    TRAINER_DEFAULTS.get(backend, TRAINER_DEFAULTS["cpu"]),
    variants="dense,sigmoid",
    data="shakespeare",
    trace="",
  )
  for item in os.environ.get("ATTNJAX_BENCH_TRAINER", "").split():
    key, _, value = item.partition("=")
    if key not in out:
      raise ValueError(f"ATTNJAX_BENCH_TRAINER: {key!r} is not one of {sorted(out)}")
    out[key] = int(value) if key == "steps" else value
  return out


@suite("trainer")
def trainer_suite(args) -> Iterable[Case]:
  """The training loop against its own step: ``Trainer.run`` (batches built and copied ahead,
  metrics read every ``log_every`` steps, the progress bar, validation and probes at the first
  and last step) over the same compiled step called back to back on one device batch, as
  tokens/s. "Trainer" is the run's summary (median over its metric reads but the first;
  boundaries excluded), "all steps" its steps over its training time. The ratio should be
  >= 0.9. "bare, random tokens" is the step on device_check's input (uniform random ids):
  a difference from the bare step is the data's, not the loop's. The host seconds are the
  summary's loop_time_s (metrics wait: mostly waiting for the device). Preset by backend (gpu: 300 steps, tpu: 300, cpu: the cpu preset, 60 steps);
  ``ATTNJAX_BENCH_TRAINER="preset=gpu steps=400 variants=dense,sigmoid data=shakespeare
  trace=DIR"`` changes them (trace: a jax.profiler trace of each run under DIR/variant)."""
  from attnjax.train.config import as_list

  cfg = _trainer_settings()
  print(f"## trainer\n\n{trainer_suite.__doc__.strip()}\n")
  rows = []
  for variant in as_list(cfg["variants"]):
    trace = os.path.join(cfg["trace"], variant) if cfg["trace"] else ""
    rows.append(
      trainer_vs_step(cfg["preset"], variant, cfg["steps"], data=cfg["data"], trace=trace)
    )
  print(
    f"preset {cfg['preset']}, {rows[0]['tokens_per_step']} tokens per step, "
    f"{cfg['steps']} steps, metrics read every {rows[0]['log_every']}\n"
  )
  print(
    "| variant | params | Trainer tokens/s | all steps | bare step tokens/s | ratio | "
    "bare, random tokens | MFU | host s: batch wait / dispatch / metrics wait / record |"
  )
  print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
  for r in rows:
    t = r["loop_time_s"]
    mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    print(
      f"| {r['variant']} | {r['params'] / 1e6:.2f}M | {r['trainer_tokens_per_s']:,.0f} | "
      f"{r['trainer_all_tokens_per_s']:,.0f} | {r['step_tokens_per_s']:,.0f} | "
      f"{r['ratio']:.3f} | {r['random_tokens_per_s']:,.0f} | {mfu} | "
      f"{t['batch_wait']:.2f} / {t['dispatch']:.2f} / "
      f"{t['metrics_wait']:.2f} / {t['record']:.2f} |"
    )
  print()
  print(json.dumps(rows))
  print()
  return []


def _torch_sdpa(T: int, *, backward: bool, window: Optional[tuple[int, int]] = None):
  """A jax-free callable timing torch's CPU scaled_dot_product_attention, or None without torch."""
  try:
    import torch  # optional bench extra, never a test dependency
  except ImportError:
    return None
  g = torch.Generator().manual_seed(0)
  q, k, v = (torch.randn(1, 8, T, 64, generator=g, requires_grad=backward) for _ in range(3))
  attn_mask = None
  if window is not None:
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    attn_mask = (j <= i) & (j >= i - window[0])

  def run(*_):
    if backward:
      out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
      out.sum().backward()
      return None
    with torch.no_grad():
      if attn_mask is not None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
      return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

  return run


@suite("blockwise")
def blockwise_suite(args) -> Iterable[Case]:
  """Block-wise dense attention (B=1, N=8, H=64, fp32, causal): the issue-3 targets.

  Rows: forward at T=4096 and forward+backward at T=2048 against
  jax.nn.dot_product_attention (and torch's CPU SDPA when torch is installed);
  window=(256, 0) at T=16384 against the same call at T=4096 (linear growth
  means <= 4.6x for 4x the length; jax.nn is not run there, it would need
  ~16 GiB).
  """
  B, N, H = 1, 8, 64
  T = 4096
  q, k, v = qkv(B, T, N, H)
  flops = attention_flops(B, N, H, allowed_pairs(T, T, is_causal=True))
  shape = f"fwd T={T}"
  yield Case(
    "blockwise",
    "jax.nn.dot_product_attention",
    shape,
    jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)),
    (q, k, v),
    flops,
    baseline=True,
  )
  yield Case(
    "blockwise",
    "attnjax blockwise",
    shape,
    jax.jit(
      lambda q, k, v: attnjax.dot_product_attention(
        q, k, v, is_causal=True, implementation="blockwise"
      )
    ),
    (q, k, v),
    flops,
  )
  torch_fwd = _torch_sdpa(T, backward=False)
  if torch_fwd is not None:
    yield Case("blockwise", "torch sdpa (cpu)", shape, torch_fwd, (), flops)

  T = 2048
  q, k, v = qkv(B, T, N, H)
  flops = attention_flops(B, N, H, allowed_pairs(T, T, is_causal=True), backward=True)
  shape = f"fwd+bwd T={T}"
  yield Case(
    "blockwise",
    "jax.nn.dot_product_attention",
    shape,
    fwd_bwd(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)),
    (q, k, v),
    flops,
    baseline=True,
  )
  yield Case(
    "blockwise",
    "attnjax blockwise",
    shape,
    fwd_bwd(
      lambda q, k, v: attnjax.dot_product_attention(
        q, k, v, is_causal=True, implementation="blockwise"
      )
    ),
    (q, k, v),
    flops,
  )
  torch_bwd = _torch_sdpa(T, backward=True)
  if torch_bwd is not None:
    yield Case("blockwise", "torch sdpa (cpu)", shape, torch_bwd, (), flops)

  window = (256, 0)
  shape = f"fwd window={window} T=16384 vs T=4096"
  for T in (4096, 16384):
    q, k, v = qkv(B, T, N, H)
    flops = attention_flops(B, N, H, allowed_pairs(T, T, is_causal=True, window=window))
    yield Case(
      "blockwise",
      f"attnjax blockwise T={T}",
      shape,
      jax.jit(
        lambda q, k, v: attnjax.dot_product_attention(
          q, k, v, is_causal=True, window=window, implementation="blockwise"
        )
      ),
      (q, k, v),
      flops,
      baseline=T == 4096,
    )


@memory_case("blockwise fwd+bwd T=16384 causal (B=1, N=8, H=64, fp32)")
def blockwise_memory():
  q, k, v = qkv(1, 16384, 8, 64)
  step = fwd_bwd(
    lambda q, k, v: attnjax.dot_product_attention(
      q, k, v, is_causal=True, implementation="blockwise"
    )
  )
  return step, (q, k, v)


@suite("residual")
def residual_suite(args) -> Iterable[Case]:
  """jax.nn's residual with ragged lengths (B=1, N=8, H=64, fp32, causal, block-wise): the
  compiled program's temporaries (``compiled.memory_analysis()``, compiled only) of
  ``return_residual=True`` with ``key_value_seq_lengths`` against the same call without them,
  at T = S = 8192 (``--sizes`` for others). The residual comes from the kernel's own count of
  each row's keys: no ``[B, 1, T, S]`` mask is built (target: at most 1.2x)."""
  B, N, H = 1, 8, 64
  print(f"## residual\n\n{residual_suite.__doc__.strip()}\n")
  print("| T | program | temporaries without lengths (MiB) | with lengths (MiB) | ratio |")
  print("|---:|---|---:|---:|---:|")
  for T in parse_sizes(args.sizes) if args.sizes else (8192,):
    x = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    lengths = jax.ShapeDtypeStruct((B,), jnp.int32)

    def call(q, k, v, kv_len, ragged):
      return attnjax.dot_product_attention(
        q,
        k,
        v,
        is_causal=True,
        return_residual=True,
        implementation="blockwise",
        key_value_seq_lengths=kv_len if ragged else None,
      )

    def loss(q, k, v, kv_len, ragged):
      out, res = call(q, k, v, kv_len, ragged)
      return jnp.sum(out) + jnp.sum(res)

    for program, fn in (("forward", call), ("fwd+bwd", jax.grad(loss, (0, 1, 2)))):
      temp = [
        jax.jit(fn, static_argnums=4)
        .lower(x, x, x, lengths, ragged)
        .compile()
        .memory_analysis()
        .temp_size_in_bytes
        / 2.0**20
        for ragged in (False, True)
      ]
      print(f"| {T} | {program} | {temp[0]:.1f} | {temp[1]:.1f} | {temp[1] / temp[0]:.2f}x |")
  print()
  return []


def linear_flops(
  B: int, N: int, T: int, H: int, chunk_size: int, *, backward: bool = False
) -> float:
  """Matmul flops of the chunked linear form as computed (full C x C intra-chunk blocks).

  Per token and head: ``2 C F + 2 C Hv`` (intra-chunk scores and their product
  with V) plus ``4 F Hv`` (reading and updating the state), with F = Hv = H;
  forward+backward counts 3x.
  """
  fwd = B * N * T * (4.0 * chunk_size * H + 4.0 * H * H)
  return fwd * 3.0 if backward else fwd


@suite("linear")
def linear_suite(args) -> Iterable[Case]:
  """Causal linear attention (B=1, N=8, H=64, fp32, elu+1, normalised): chunked form vs dense jax.nn.

  Rows at the first size compare the chunked form (several chunk sizes C) with
  causal ``jax.nn.dot_product_attention``, forward and forward+backward. The
  "T_big/T_base" rows compare the chunked form with itself: the baseline is
  the first size, so "vs baseline" is the time growth (linear in T means 4x
  for 4096 -> 16384). jax.nn never runs above T=4096 (its T x T logits need
  ~16 GiB at 16384). GFLOP/s of linear rows count the chunked form's own
  matmuls (see ``linear_flops``), not dense-attention flops.
  """
  B, N, H = 1, 8, 64
  sizes = parse_sizes(args.sizes or "4096,16384")
  base_T = sizes[0]

  def chunked(C):
    return jax.jit(
      lambda q, k, v: attnjax.linear_attention(
        q, k, v, is_causal=True, implementation="chunked", chunk_size=C
      )
    )

  q, k, v = qkv(B, base_T, N, H)
  shape = f"T={base_T}"
  dense_flops = attention_flops(B, N, H, allowed_pairs(base_T, base_T, is_causal=True))
  if base_T <= 4096:
    yield Case(
      "linear",
      "jax.nn.dot_product_attention causal",
      shape,
      jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)),
      (q, k, v),
      dense_flops,
      baseline=True,
    )
  for C in (32, 64, 128):
    yield Case(
      "linear",
      f"attnjax linear chunked C={C}",
      shape,
      chunked(C),
      (q, k, v),
      linear_flops(B, N, base_T, H, C),
    )
  shape_bwd = f"T={base_T} fwd+bwd"
  if base_T <= 4096:
    yield Case(
      "linear",
      "jax.nn.dot_product_attention causal",
      shape_bwd,
      fwd_bwd(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)),
      (q, k, v),
      attention_flops(B, N, H, allowed_pairs(base_T, base_T, is_causal=True), backward=True),
      baseline=True,
    )
  for C in (32, 64):
    yield Case(
      "linear",
      f"attnjax linear chunked C={C}",
      shape_bwd,
      fwd_bwd(
        lambda q, k, v, C=C: attnjax.linear_attention(
          q, k, v, is_causal=True, implementation="chunked", chunk_size=C
        )
      ),
      (q, k, v),
      linear_flops(B, N, base_T, H, C, backward=True),
    )
  for T in sizes[1:]:
    big = qkv(B, T, N, H)
    for C in (32, 64):
      scaling = f"T={T}/T={base_T} C={C}"
      yield Case(
        "linear",
        f"attnjax linear chunked T={base_T}",
        scaling,
        chunked(C),
        (q, k, v),
        linear_flops(B, N, base_T, H, C),
        baseline=True,
      )
      yield Case(
        "linear",
        f"attnjax linear chunked T={T}",
        scaling,
        chunked(C),
        big,
        linear_flops(B, N, T, H, C),
      )


@suite("flex")
def flex_suite(args) -> Iterable[Case]:
  """Score and mask modifiers against the built-in options (B=1, N=8, H=64, fp32, block-wise).

  ``mask_mod`` rows: a sliding window and a document mask written as
  modifiers, against ``window=`` and ``segment_ids=`` at T=8192 (issue target:
  within 1.3x). The window rows use 128 x 128 blocks on both sides (``window=``
  would pick narrower ones by itself; a ``mask_mod`` cannot state its width).
  ``score_mod`` rows: ALiBi as a modifier against plain causal attention,
  forward+backward at T=4096 (target: within 1.5x).
  """
  from attnjax import mods
  from attnjax.kernels import blockwise

  B, N, H = 1, 8, 64
  T = 8192
  q, k, v = qkv(B, T, N, H)
  window = (256, 0)
  flops = attention_flops(B, N, H, allowed_pairs(T, T, is_causal=True, window=window))
  shape = f"fwd window={window} T={T}"
  yield Case(
    "flex",
    "window=",
    shape,
    jax.jit(
      lambda q, k, v: blockwise.attention(
        q, k, v, is_causal=True, window=window, block_q=128, block_k=128
      )
    ),
    (q, k, v),
    flops,
    baseline=True,
  )
  yield Case(
    "flex",
    "mask_mod=mods.sliding_window_mask",
    shape,
    jax.jit(
      lambda q, k, v: blockwise.attention(
        q, k, v, mask_mod=mods.sliding_window_mask(*window), block_q=128, block_k=128
      )
    ),
    (q, k, v),
    flops,
  )
  docs = 8
  ids = jnp.repeat(jnp.arange(docs, dtype=jnp.int32), T // docs)[None]  # packed, sorted
  flops = attention_flops(B, N, H, docs * (T // docs) ** 2)
  shape = f"fwd {docs} documents T={T}"
  yield Case(
    "flex",
    "segment_ids=",
    shape,
    jax.jit(
      lambda q, k, v, ids: attnjax.dot_product_attention(
        q, k, v, segment_ids=ids, implementation="blockwise"
      )
    ),
    (q, k, v, ids),
    flops,
    baseline=True,
  )
  yield Case(
    "flex",
    "mask_mod=mods.document_mask",
    shape,
    jax.jit(
      lambda q, k, v, ids: attnjax.dot_product_attention(
        q, k, v, mask_mod=mods.document_mask, mask_mod_args=(ids,), implementation="blockwise"
      )
    ),
    (q, k, v, ids),
    flops,
  )
  T = 4096
  q, k, v = qkv(B, T, N, H)
  slopes = jnp.asarray(mods.alibi_slopes(N))
  flops = attention_flops(B, N, H, allowed_pairs(T, T, is_causal=True), backward=True)
  shape = f"fwd+bwd causal T={T}"
  yield Case(
    "flex",
    "plain blockwise",
    shape,
    fwd_bwd(
      lambda q, k, v: attnjax.dot_product_attention(
        q, k, v, is_causal=True, implementation="blockwise"
      )
    ),
    (q, k, v),
    flops,
    baseline=True,
  )
  yield Case(
    "flex",
    "score_mod=mods.alibi",
    shape,
    fwd_bwd(
      lambda q, k, v: attnjax.dot_product_attention(
        q,
        k,
        v,
        is_causal=True,
        score_mod=mods.alibi,
        score_mod_args=(slopes,),
        implementation="blockwise",
      )
    ),
    (q, k, v),
    flops,
  )


@memory_case("flex: blockwise fwd+bwd T=16384 causal + alibi score_mod (B=1, N=8, H=64, fp32)")
def flex_alibi_memory():
  from attnjax import mods

  q, k, v = qkv(1, 16384, 8, 64)
  slopes = jnp.asarray(mods.alibi_slopes(8))
  step = fwd_bwd(
    lambda q, k, v: attnjax.dot_product_attention(
      q,
      k,
      v,
      is_causal=True,
      score_mod=mods.alibi,
      score_mod_args=(slopes,),
      implementation="blockwise",
    )
  )
  return step, (q, k, v)


def _gated_calls(C: int = 64) -> dict[str, Callable]:
  """The gated/delta-rule rows' attention calls ``(q, k, v) -> out``, chunked, C=64.

  Decays, gates and betas are fixed functions of the inputs' shape (made
  inside the call, so only q, k, v are differentiated in fwd+bwd rows):
  RetNet-style constant scalar decay, a per-channel GLA gate, and betas of
  0.5 with a scalar decay for Gated DeltaNet.
  """

  def scalar(q, k, v):
    g = jnp.full(q.shape[:3], -0.05, jnp.float32)
    return attnjax.gated_linear_attention(q, k, v, log_decay=g, chunk_size=C)

  def per_channel(q, k, v):
    g = jax.nn.log_sigmoid(jnp.linspace(2.0, 6.0, q.shape[-1]))[None, None, None, :]
    g = jnp.broadcast_to(g / 16.0, q.shape)  # GLA's tau = 16
    return attnjax.gated_linear_attention(q, k, v, log_decay=g, chunk_size=C)

  def l2(x):
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + 1e-6)

  def delta(q, k, v):
    beta = jnp.full(q.shape[:3], 0.5, jnp.float32)
    return attnjax.delta_rule_attention(l2(q), l2(k), v, beta, chunk_size=C)

  def gated_delta(q, k, v):
    beta = jnp.full(q.shape[:3], 0.5, jnp.float32)
    g = jnp.full(q.shape[:3], -0.05, jnp.float32)
    return attnjax.delta_rule_attention(l2(q), l2(k), v, beta, log_decay=g, chunk_size=C)

  def elu1(q, k, v):
    return attnjax.linear_attention(q, k, v, is_causal=True, implementation="chunked", chunk_size=C)

  return {
    "linear_attention elu+1 chunked": elu1,
    "gated_linear_attention scalar decay (RetNet/Mamba-2)": scalar,
    "gated_linear_attention per-channel gate (GLA)": per_channel,
    "delta_rule_attention (DeltaNet)": delta,
    "delta_rule_attention gated (Gated DeltaNet)": gated_delta,
  }


@suite("gated")
def gated_suite(args) -> Iterable[Case]:
  """Gated and delta-rule linear attention, chunked C=64, forward+backward (B=1, N=8, H=64, fp32).

  At the first size every row is divided by our elu+1 chunked
  ``linear_attention`` forward+backward (issue target: at most 2x). The
  "T_big/T_base" rows divide each form's time by its own time at the first
  size (linear growth: 4x for 4096 -> 16384; target at most 4.6x). Peak memory
  of forward+backward at T=16384 is in the memory cases (``--memory``).
  """
  B, N, H = 1, 8, 64
  sizes = parse_sizes(args.sizes or "4096,16384")
  base_T = sizes[0]
  calls = _gated_calls()
  q, k, v = qkv(B, base_T, N, H)
  flops = linear_flops(B, N, base_T, H, 64, backward=True)
  for name, fn in calls.items():
    yield Case(
      "gated",
      name,
      f"T={base_T} fwd+bwd",
      fwd_bwd(fn),
      (q, k, v),
      flops,
      baseline=name.startswith("linear_attention"),
    )
  for T in sizes[1:]:
    big = qkv(B, T, N, H)
    for name, fn in calls.items():
      if name.startswith("linear_attention"):
        continue
      step = fwd_bwd(fn)
      shape = f"T={T}/T={base_T} fwd+bwd {name}"
      yield Case("gated", f"T={base_T}", shape, step, (q, k, v), flops, baseline=True)
      yield Case("gated", f"T={T}", shape, step, big, linear_flops(B, N, T, H, 64, backward=True))


def _gated_memory(name: str):
  def make():
    q, k, v = qkv(1, 16384, 8, 64)
    step = fwd_bwd(_gated_calls()[name])
    return step, (q, k, v)

  return make


for _name in _gated_calls():
  memory_case(f"gated: {_name} fwd+bwd T=16384 (B=1, N=8, H=64, fp32)")(_gated_memory(_name))


def _block_select(q, k, v):
  return attnjax.block_select_attention(q, k, v, block_size=64, top_k=8, is_causal=True)


@suite("block_select")
def block_select_suite(args) -> Iterable[Case]:
  """Content-selected block-sparse attention (MoBA), block 64, top_k 8, causal forward (B=1, N=8, H=64, fp32).

  Shape "T=8192": ``block_select_attention`` divided by our blockwise dense
  causal attention at T=8192 (issue target: at most 0.25x). The "T_big/T_base"
  rows divide its time by its own time at the first size (cost follows top_k,
  so linear growth: 4x for 4096 -> 16384; target at most 5x). Peak memory of
  forward + backward at T=16384 is a memory case (``--memory``).
  """
  B, N, H = 1, 8, 64
  keys = lambda T: min(T, 9 * 64)  # own block + 8 selected, per query (upper bound)
  q, k, v = qkv(B, 8192, N, H)
  shape = "T=8192"
  yield Case(
    "block_select",
    "attnjax blockwise dense causal",
    shape,
    jax.jit(
      lambda q, k, v: attnjax.dot_product_attention(
        q, k, v, is_causal=True, implementation="blockwise"
      )
    ),
    (q, k, v),
    attention_flops(B, N, H, allowed_pairs(8192, 8192, is_causal=True)),
    baseline=True,
  )
  yield Case(
    "block_select",
    "block_select_attention block=64 top_k=8",
    shape,
    jax.jit(_block_select),
    (q, k, v),
    attention_flops(B, N, H, 8192 * keys(8192)),
  )
  sizes = parse_sizes(args.sizes or "4096,16384")
  shape = f"T={sizes[-1]}/T={sizes[0]}"
  for T in (sizes[0], sizes[-1]) if len(sizes) > 1 else ():
    yield Case(
      "block_select",
      f"block_select_attention T={T}",
      shape,
      jax.jit(_block_select),
      qkv(B, T, N, H),
      attention_flops(B, N, H, T * keys(T)),
      baseline=T == sizes[0],
    )


@memory_case("block_select fwd+bwd T=16384 block=64 top_k=8 (B=1, N=8, H=64, fp32)")
def block_select_memory():
  q, k, v = qkv(1, 16384, 8, 64)
  step = fwd_bwd(_block_select)
  return step, (q, k, v)


# DeepSeek V2-Lite's attention: 16 heads, a latent of 512, rope key 64, keys 128 + 64, values 128.
MLA_SHAPE = dict(N=16, R=512, d_n=128, d_r=64, d_v=128)


def mla_cache_table(S: int, itemsize: int = 2) -> str:
  """Bytes per token and layer of the MLA latent cache beside GQA caches of the same heads
  (keys and values only; ``itemsize`` 2: bfloat16), as a markdown table with ratios."""
  N, R, d_n, d_r, d_v = (MLA_SHAPE[k] for k in ("N", "R", "d_n", "d_r", "d_v"))
  latent = (R + d_r) * itemsize
  rows = [
    ("MLA latent cache (c, k_rope)", R + d_r),
    (f"expanded heads (K={N}: keys {d_n + d_r}, values {d_v})", N * (d_n + d_r + d_v)),
    ("GQA K=8, H=128", 2 * 8 * 128),
    ("GQA K=4, H=128", 2 * 4 * 128),
    ("GQA K=2, H=128", 2 * 2 * 128),
  ]
  lines = [
    f"Cache per token and layer at S={S} (bytes of {itemsize}-byte numbers, keys and values):\n",
    "| cache | numbers | bytes | MiB at S | latent / this |",
    "|---|---:|---:|---:|---:|",
  ]
  for name, numbers in rows:
    b = numbers * itemsize
    lines.append(f"| {name} | {numbers} | {b} | {b * S / 2**20:.1f} | {latent / b:.3f} |")
  ratio = (R + d_r) / (N * (d_n + d_r + d_v))
  lines.append(
    f"\nlatent / expanded heads' cache: {ratio:.3f} (target <= 0.25: "
    f"{'met' if ratio <= 0.25 else 'not met'})\n"
  )
  return "\n".join(lines)


@suite("mla")
def mla_suite(args) -> Iterable[Case]:
  """One decode step at 32k context: MLA over its latent cache against GQA (B=1, fp32).

  DeepSeek V2-Lite's attention shape (N=16 heads, latent R=512, d_n=128, d_r=64,
  d_v=128); one new query token over S cached tokens (``--sizes``, default 32768).
  Rows: GQA decode with K=4 KV heads of H=128 (the baseline); the expanded heads as
  a plain cache (K=16, keys 192, values 128); ``mla_attention`` over the latent
  cache in the expanded form (rebuilding every key and value from the latent each
  step) and in the absorbed form (MQA over ``[c | k_rope]``). Target: absorbed no
  slower than expanded. The cache table before it prints bytes per token and layer
  (target: the latent at most 1/4 of the expanded heads' cache).
  """
  N, R, d_n, d_r, d_v = (MLA_SHAPE[k] for k in ("N", "R", "d_n", "d_r", "d_v"))
  B = 1
  for S in parse_sizes(args.sizes or "32768"):
    print(mla_cache_table(S))
    shape = f"decode S={S}"
    ks = jax.random.split(jax.random.key(S), 8)
    draw = lambda i, *sh, s=1.0: s * jax.random.normal(ks[i], sh, jnp.float32)
    q = draw(0, B, 1, N, d_n + d_r)
    k_rope, latent = draw(1, B, S, 1, d_r), draw(2, B, S, 1, R)
    w_uk, w_uv = draw(3, R, N, d_n, s=R**-0.5), draw(4, R, N, d_v, s=R**-0.5)
    gqa = (draw(5, B, 1, N, 128), draw(6, B, S, 4, 128), draw(7, B, S, 4, 128))
    heads = (q, draw(6, B, S, N, d_n + d_r), draw(7, B, S, N, d_v))
    dense = jax.jit(lambda q, k, v: attnjax.dot_product_attention(q, k, v))
    yield Case(
      "mla",
      "GQA K=4, H=128: dot_product_attention",
      shape,
      dense,
      gqa,
      4.0 * B * N * 128 * S,
      baseline=True,
      tokens=B,
    )
    yield Case(
      "mla",
      f"expanded heads as the cache (K={N}): dot_product_attention",
      shape,
      dense,
      heads,
      2.0 * B * N * S * (d_n + d_r + d_v),
      tokens=B,
    )
    for absorb in (False, True):
      rebuild = 0 if absorb else 2.0 * B * S * R * N * (d_n + d_v)
      attend = 2.0 * B * N * S * ((2 * R + d_r) if absorb else (d_n + d_r + d_v))
      fold = 2.0 * B * N * R * (d_n + d_v) if absorb else 0
      yield Case(
        "mla",
        f"mla_attention over the latent, {'absorbed' if absorb else 'expanded'}",
        shape,
        jax.jit(lambda *a, absorb=absorb: attnjax.mla_attention(*a, absorb=absorb)),
        (q, k_rope, latent, w_uk, w_uv),
        rebuild + attend + fold,
        tokens=B,
      )


# ---------------------------------------------------------------------------
# The hybrid suite: a tiny Qwen3-Next, attnjax against transformers' torch fallback.

HYBRID_FIXTURE = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  "tests",
  "fixtures",
  "pretrained",
  "qwen3_next",
)

# Run by the Python that has torch and transformers (no jax there): argv = checkpoint, T,
# repeats. Prints one JSON line: the best and median seconds of a prefill of T tokens (the
# cache built, as generate does) and of one decode step after it.
_HYBRID_TORCH = """
import json, statistics, sys, time
import numpy as np
import torch, transformers
from importlib.util import find_spec
path, T, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
vocab = model.config.vocab_size
tokens = torch.from_numpy(np.random.default_rng(0).integers(0, vocab, (1, T)))
nxt = torch.from_numpy(np.random.default_rng(1).integers(0, vocab, (1, 1)))
def prefill():
  return model(tokens, use_cache=True)
pre, dec = [], []
with torch.no_grad():
  prefill()
  for _ in range(repeats):
    t0 = time.perf_counter(); out = prefill(); pre.append(time.perf_counter() - t0)
  past = out.past_key_values
  model(nxt, past_key_values=past, use_cache=True)
  for _ in range(repeats):
    t0 = time.perf_counter(); model(nxt, past_key_values=past, use_cache=True)
    dec.append(time.perf_counter() - t0)
print(json.dumps(dict(
  prefill=[min(pre), statistics.median(pre)], decode=[min(dec), statistics.median(dec)],
  fast_path=find_spec("fla") is not None, threads=torch.get_num_threads(),
  torch=torch.__version__, transformers=transformers.__version__)))
"""


def _torch_side(python: str, T: int, repeats: int):
  """transformers' times from ``python`` (a dict), or the line saying why there are none."""
  try:
    out = subprocess.run(
      [python, "-c", _HYBRID_TORCH, HYBRID_FIXTURE, str(T), str(repeats)],
      capture_output=True,
      text=True,
      check=False,
    )
  except OSError as e:
    return f"transformers side not run: {python}: {e}"
  if out.returncode != 0:
    last = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    if "ModuleNotFoundError" in last or "ImportError" in last:
      return (
        f"transformers side not run: {python} has no torch / transformers ({last}); "
        f"pass --torch-python or set ATTNJAX_BENCH_TORCH_PYTHON"
      )
    return f"transformers side failed: {last}"
  return json.loads(out.stdout.strip().splitlines()[-1])


def _best_and_median(fn, repeats: int) -> tuple[float, float]:
  block(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    block(fn())
    times.append(time.perf_counter() - t0)
  return min(times), statistics.median(times)


@suite("hybrid")
def hybrid_suite(args) -> Iterable[Case]:
  """A tiny hybrid (the Qwen3-Next test checkpoint: 3 gated DeltaNet layers with Hv = 2 Hk
  and Dk != Dv, 1 gated full-attention layer, MoE; float32, B = 1) at T tokens (``--sizes``,
  default 8192): prefill (the forward that fills the caches, as generation starts) and one
  decode step after it, attnjax (``nn.decode_step``: chunked delta rule, block-wise
  attention) beside transformers' eager model on its torch fallback (no fla /
  causal-conv1d kernels: torch_chunk_gated_delta_rule), run by ``--torch-python`` in a
  subprocess. Target: prefill at most 1.0x transformers' time."""
  from attnjax import models, nn

  print(f"## hybrid\n\n{hybrid_suite.__doc__.strip()}\n")
  python = args.torch_python or os.environ.get("ATTNJAX_BENCH_TORCH_PYTHON") or sys.executable
  model = models.from_pretrained(HYBRID_FIXTURE, dtype="float32")
  V = model.config.vocab_size
  print(
    "| T | phase | attnjax s (median) | attnjax tokens/s | transformers s (median) | "
    "transformers tokens/s | attnjax / transformers time |"
  )
  print("|---:|---|---:|---:|---:|---:|---:|")
  notes = []
  for T in parse_sizes(args.sizes or "8192"):
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V, (1, T)), jnp.int32)
    nxt = jnp.asarray(rng.integers(0, V, (1, 1)), jnp.int32)
    empty = model.init_cache(1, T + 1)
    pre = _best_and_median(lambda: nn.decode_step(model, tokens, empty)[0], args.repeats)
    _, cache = nn.decode_step(model, tokens, empty)
    dec = _best_and_median(lambda: nn.decode_step(model, nxt, cache)[0], args.repeats)
    torch_side = _torch_side(python, T, args.repeats)
    if isinstance(torch_side, str):
      notes.append(torch_side)
    else:
      notes.append(
        f"transformers {torch_side['transformers']}, torch {torch_side['torch']} "
        f"({torch_side['threads']} threads), fast path (fla kernels) "
        f"{'on' if torch_side['fast_path'] else 'off: the torch fallback'}"
      )
    for phase, ours, n in (("prefill", pre, T), ("decode", dec, 1)):
      theirs = None if isinstance(torch_side, str) else torch_side[phase]
      t_cols = (
        "- | - | -"
        if theirs is None
        else (
          f"{theirs[0]:.4f} ({theirs[1]:.4f}) | {n / theirs[0]:,.0f} | {ours[0] / theirs[0]:.2f}x"
        )
      )
      print(f"| {T} | {phase} | {ours[0]:.4f} ({ours[1]:.4f}) | {n / ours[0]:,.0f} | {t_cols} |")
  print("\n" + "\n".join(sorted(set(notes))) + "\n")
  return []


# ---------------------------------------------------------------------------
# Memory measurement in a child process.


@suite("context_parallel")
def context_parallel_suite(args) -> Iterable[Case]:
  """Context parallelism on 8 forced host devices: per-device XLA buffers, tiles, bytes per step.

  Runs ``experiments/context_parallel.py`` in a process of its own (the forced
  device count must be set before jax starts) and prints its table; nothing
  is timed. ``--sizes`` picks T (default 65536).
  """
  sizes = parse_sizes(args.sizes) if args.sizes else [65536]
  here = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ, PYTHONPATH=os.path.dirname(here))
  for T in sizes:
    subprocess.run(
      [sys.executable, os.path.join(here, "context_parallel.py"), "--T", str(T)],
      check=True,
      env=env,
    )
  return []


@suite("compressed")
def compressed_suite(args) -> Iterable[Case]:
  """Memory-compressed attention and the dilated window, causal forward (B=1, N=8, H=64, fp32).

  compressed_attention (stride 4, mean pooling, raw window 64) at T=4096 against
  our block-wise dense causal attention at T=4096 (target <= 0.3x);
  sparse_attention with dilated_window(128, 4) at T=16384 against itself at
  T=4096 (its cost follows the kept keys: target <= 4.6x for 4x the length).
  """
  B, N, H = 1, 8, 64
  T = 4096
  q, k, v = qkv(B, T, N, H)
  shape = f"fwd T={T}"
  yield Case(
    "compressed",
    "attnjax blockwise dense causal",
    shape,
    jax.jit(
      lambda q, k, v: attnjax.dot_product_attention(
        q, k, v, is_causal=True, implementation="blockwise"
      )
    ),
    (q, k, v),
    attention_flops(B, N, H, allowed_pairs(T, T, is_causal=True)),
    baseline=True,
  )
  # Compressed keys seen (T * T / (2 * 4) roughly) plus the window's raw keys i-64..i per query.
  pairs = T * (T // 4 + 1) // 2 + allowed_pairs(T, T, is_causal=True, window=(64, 0))
  yield Case(
    "compressed",
    "compressed_attention stride=4 window=64",
    shape,
    jax.jit(
      lambda q, k, v: attnjax.compressed_attention(q, k, v, stride=4, is_causal=True, window=64)
    ),
    (q, k, v),
    attention_flops(B, N, H, pairs),
  )
  yield Case(
    "compressed",
    "compressed_attention stride=4 (no window)",
    shape,
    jax.jit(lambda q, k, v: attnjax.compressed_attention(q, k, v, stride=4, is_causal=True)),
    (q, k, v),
    attention_flops(B, N, H, T * (T // 4 + 1) // 2),
  )
  pattern = attnjax.patterns.dilated_window(128, 4)
  growth = "fwd dilated_window(128, 4): T=16384/T=4096"
  for T in (4096, 16384):
    qT, kT, vT = qkv(B, T, N, H)
    yield Case(
      "compressed",
      f"dilated_window(128, 4) T={T}",
      growth,
      jax.jit(lambda q, k, v: attnjax.sparse_attention(q, k, v, pattern=pattern, block_size=128)),
      (qT, kT, vT),
      attention_flops(B, N, H, T * 128),
      baseline=T == 4096,
    )


@memory_case("compressed stride=4 window=64 fwd+bwd T=16384 causal (B=1, N=8, H=64, fp32)")
def compressed_memory():
  q, k, v = qkv(1, 16384, 8, 64)
  step = fwd_bwd(
    lambda q, k, v: attnjax.compressed_attention(
      q, k, v, stride=4, is_causal=True, window=64, block_size=128
    )
  )
  return step, (q, k, v)


@memory_case("compressed dilated_window(128, 4) fwd+bwd T=16384 (B=1, N=8, H=64, fp32)")
def dilated_memory():
  q, k, v = qkv(1, 16384, 8, 64)
  pattern = attnjax.patterns.dilated_window(128, 4)
  step = fwd_bwd(lambda q, k, v: attnjax.sparse_attention(q, k, v, pattern=pattern, block_size=128))
  return step, (q, k, v)


# ---------------------------------------------------------------------------
# GPU: every path at the shapes of the cuDNN comparison (16k tokens, 16 heads of 128), compiled in threads, timed back to back.

GPU_ONLY = ("cudnn", "mosaic_gpu", "pallas_gpu")  # paths that need a CUDA GPU
GPU_PASSES = ("fwd", "fwd+bwd")


def _add_gpu_options(p: argparse.ArgumentParser) -> None:
  """The options of ``--suite gpu``."""
  g = p.add_argument_group("--suite gpu")
  g.add_argument(
    "--seq", default=None, help="sequence lengths of --suite gpu (default 4096,16384; else --sizes)"
  )
  g.add_argument("--tokens", type=int, default=16384, help="tokens per batch: B = tokens // T")
  g.add_argument("--heads", type=int, default=16)
  g.add_argument("--head-dim", type=int, default=128)
  g.add_argument(
    "--normalizers",
    default="all",
    help="comma-separated normalisers of the kernel rows (default every one)",
  )
  g.add_argument("--calls", type=int, default=10, help="calls timed back to back per round")
  g.add_argument(
    "--cell-seconds",
    type=float,
    default=3.0,
    help="at most about this long timing one cell (fewer calls and rounds if slow)",
  )
  g.add_argument(
    "--compile-seconds",
    type=float,
    default=300.0,
    help="time every program not compiled after this long as failed",
  )
  g.add_argument(
    "--jsonl",
    default=None,
    help="write every compile and timing of --suite gpu to this file as it comes",
  )
  g.add_argument(
    "--gpu-table",
    default=None,
    metavar="JSONL",
    help="print --suite gpu's table from a JSON lines file it wrote, and exit",
  )


def _gpu_paths(normalizers: list[str]) -> list[tuple[str, Optional[str], Callable]]:
  """``(row label, what it needs, attention (q, k, v) -> out)`` of every row, table order."""

  def nn(impl):
    return lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation=impl
    )

  def ours(impl, n):
    return lambda q, k, v: attnjax.dot_product_attention(
      q, k, v, is_causal=True, normalizer=n, implementation=impl
    )

  paths = [("jax.nn cudnn", "cudnn", nn("cudnn")), ("jax.nn xla", None, nn("xla"))]
  for n in ("softmax", "sigmoid"):
    paths.append((f"attnjax auto {n}", None, ours(None, n)))
  for n in ("softmax", "sigmoid"):
    paths.append((f"attnjax blockwise {n}", None, ours("blockwise", n)))
  for impl in ("mosaic_gpu", "pallas_gpu"):
    paths += [(f"attnjax {impl} {n}", impl, ours(impl, n)) for n in normalizers]
  return paths


def _gpu_error(e: BaseException) -> str:
  """One short line for a table cell: the exception's type and first line."""
  line = (str(e).strip().splitlines() or [""])[0].replace("|", "/")
  if "RESOURCE_EXHAUSTED" in line or "out of memory" in line.lower():
    return "out of memory: " + line[:60]
  return f"{type(e).__name__}: {line[:70]}"


class _Log:
  """Records of one run: written to ``path`` (JSON lines, flushed) as they come, kept here."""

  def __init__(self, path: Optional[str]):
    self.records: list[dict] = []
    self.file = open(path, "w") if path else None

  def add(self, **record) -> dict:
    self.records.append(record)
    if self.file is not None:
      self.file.write(json.dumps(record) + "\n")
      self.file.flush()
    return record


def _gpu_compile_all(programs: list[dict], log: _Log, seconds: float) -> None:
  """Compiles every program in threads (``program["compiled"]`` or ``["error"]``); one not
  compiled after ``seconds`` is reported as such and the run goes on without it."""
  from concurrent.futures import ThreadPoolExecutor, as_completed

  def one(pr):
    t0 = time.perf_counter()
    try:
      pr["compiled"] = pr["fn"].lower(*pr["args"]).compile()
    except Exception as e:  # one path that cannot compile reports it; the run goes on
      pr["error"] = _gpu_error(e)
    pr["compile_s"] = time.perf_counter() - t0
    return pr

  def report(pr):
    log.add(
      kind="compile",
      path=pr["path"],
      T=pr["T"],
      **{"pass": pr["pass"]},
      seconds=round(pr.get("compile_s", seconds), 2),
      error=pr.get("error"),
    )
    print(
      f"  compiled {pr['path']} T={pr['T']} {pr['pass']}: "
      f"{pr.get('error') or '%.1f s' % pr['compile_s']}",
      file=sys.stderr,
      flush=True,
    )

  pool = ThreadPoolExecutor(max_workers=max(1, min(32, os.cpu_count() or 1)))
  todo = sorted((pr for pr in programs if "error" not in pr), key=lambda pr: pr["priority"])
  futures = {pool.submit(one, pr): pr for pr in todo}
  try:
    for f in as_completed(futures, timeout=seconds):
      report(f.result())
  except TimeoutError:
    for f, pr in futures.items():
      if not f.done():
        pr["error"] = f"not compiled within {seconds:.0f} s"
        report(pr)
  pool.shutdown(wait=False, cancel_futures=True)


def _gpu_time(compiled, call_args: tuple, calls: int, rounds: int, seconds: float):
  """``(best, median, calls, rounds)``: seconds per call of ``calls`` calls back to back with
  one block at the end, over ``rounds`` rounds (fewer of both where one call is slow)."""
  block(compiled(*call_args))  # warm-up: the first call allocates
  t0 = time.perf_counter()
  block(compiled(*call_args))
  allowed = max(1, int(seconds / max(time.perf_counter() - t0, 1e-9)))
  calls = max(1, min(calls, allowed))
  rounds = max(1, min(rounds, allowed // calls))
  per_call = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for _ in range(calls):
      out = compiled(*call_args)
    block(out)
    per_call.append((time.perf_counter() - t0) / calls)
  return min(per_call), statistics.median(per_call), calls, rounds


def _gpu_programs(args, paths) -> tuple[list[dict], dict]:
  """One program per (T, pass, path), with its inputs; a GPU-only path off a GPU is an error."""
  sizes = parse_sizes(args.seq or args.sizes or "4096,16384")
  N, H = args.heads, args.head_dim
  on_gpu = jax.default_backend() == "gpu"
  programs, inputs = [], {}
  for T in sizes:
    B = max(1, args.tokens // T)
    inputs[T] = qkv(B, T, N, H, dtype=jnp.bfloat16)
    for pass_ in GPU_PASSES:
      flops = 2.0 * B * N * T * T * H * (3.5 if pass_ == "fwd+bwd" else 1.0)
      for label, needs, attn in paths:
        fn = jax.jit(attn) if pass_ == "fwd" else fwd_bwd(attn)
        # The comparisons the issues ask for first (a run cut short keeps them): the built-ins,
        # auto, blockwise and the kernels' softmax and sigmoid; then the other normalisers.
        first = needs not in ("mosaic_gpu", "pallas_gpu") or label.endswith(("softmax", "sigmoid"))
        pr = dict(
          path=label,
          T=T,
          B=B,
          flops=flops,
          fn=fn,
          args=inputs[T],
          priority=int(not first),
          **{"pass": pass_},
        )
        if needs in GPU_ONLY and not on_gpu:
          pr["error"] = "needs a CUDA GPU"
        programs.append(pr)
  return programs, inputs


def _auto_choices(inputs: dict) -> dict:
  """What auto dispatch runs for each auto row (softmax, sigmoid) at each T."""
  from attnjax import dense, options

  out = {}
  for T, (q, k, v) in inputs.items():
    for n in ("softmax", "sigmoid"):
      try:
        out[f"T={T} {n}"] = dense.select_implementation(
          *options.validate(q, k, v, is_causal=True, normalizer=n)
        )
      except Exception as e:  # the choice itself failed: say so
        out[f"T={T} {n}"] = _gpu_error(e)
  return out


@suite("gpu")
def gpu_suite(args) -> Iterable[Case]:
  """Every attention path on one GPU (16k tokens, 16 heads of 128 by default): causal, bf16, ``--tokens`` tokens
  per batch (B = tokens / T), ``--heads`` heads of dim ``--head-dim``, forward and
  forward+backward. Each cell is TFLOP/s (causal forward counted as 2·B·N·T²·H, fwd+bwd
  as 3.5x that) and, in brackets, its speed over cuDNN's at the same column (over jax.nn
  xla's where cuDNN has no time). Programs are compiled in threads first; each is warmed
  up, then timed as ``--calls`` calls back to back with one block at the end, best of
  ``--repeats`` rounds. A path that cannot run says why in its cell."""
  normalizers = (
    list(attnjax.normalizers.NORMALIZERS)
    if args.normalizers == "all"
    else [n for n in args.normalizers.split(",") if n]
  )
  log = _Log(args.jsonl)
  paths = _gpu_paths(normalizers)
  programs, inputs = _gpu_programs(args, paths)
  log.add(
    kind="meta",
    platform={"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend()),
    device=jax.devices()[0].device_kind,
    jax=jax.__version__,
    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    heads=args.heads,
    head_dim=args.head_dim,
    tokens=args.tokens,
    paths=[label for label, _, _ in paths],
    columns=list(dict.fromkeys((pr["T"], pr["pass"]) for pr in programs)),
  )
  log.add(kind="auto", choices=_auto_choices(inputs))
  t0 = time.perf_counter()
  _gpu_compile_all(programs, log, args.compile_seconds)
  print(
    f"  compiled {len(programs)} programs in {time.perf_counter() - t0:.0f} s",
    file=sys.stderr,
    flush=True,
  )
  for pr in sorted(programs, key=lambda pr: pr["priority"]):
    rec = dict(
      kind="time", path=pr["path"], T=pr["T"], B=pr["B"], flops=pr["flops"], **{"pass": pr["pass"]}
    )
    if "error" not in pr:
      try:
        best, med, calls, rounds = _gpu_time(
          pr.pop("compiled"), pr["args"], args.calls, args.repeats, args.cell_seconds
        )
        rec.update(
          ms=best * 1e3,
          median_ms=med * 1e3,
          calls=calls,
          rounds=rounds,
          tflops=pr["flops"] / best / 1e12,
        )
      except Exception as e:  # e.g. out of memory when it runs: the cell says so
        pr["error"] = _gpu_error(e)
    log.add(**rec, error=pr.get("error"))
    print(
      f"  {pr['path']} T={pr['T']} {pr['pass']}: {pr.get('error') or '%.3f ms' % rec['ms']}",
      file=sys.stderr,
      flush=True,
    )
  import inspect

  print(f"## gpu\n\n{inspect.cleandoc(gpu_suite.__doc__)}\n")
  print(gpu_table(log.records))
  return []


def _gpu_cell(r: Optional[dict], base: Optional[dict]) -> str:
  if r is None:
    return "not run"
  if r.get("error"):
    return r["error"]
  ratio = f" ({r['tflops'] / base['tflops']:.2f}x)" if base else ""
  return f"{r['tflops']:.3g}{ratio}"


def gpu_table(records: list[dict]) -> str:
  """The markdown table of ``--suite gpu``'s records (this run's, or read back from its
  JSON lines file): one row per path, one column per (T, pass)."""
  times = [r for r in records if r.get("kind") == "time"]
  meta = next((r for r in records if r.get("kind") == "meta"), {})
  auto = next((r["choices"] for r in records if r.get("kind") == "auto"), {})
  # The run's rows and columns (a run cut short shows its cells not timed as "not run").
  columns = list(
    dict.fromkeys(
      [tuple(c) for c in meta.get("columns", ())] + [(r["T"], r["pass"]) for r in times]
    )
  )
  rows = list(dict.fromkeys(meta.get("paths", []) + [r["path"] for r in times]))
  cell = {(r["path"], r["T"], r["pass"]): r for r in times}
  base, names = {}, []
  for col in columns:
    for path in ("jax.nn cudnn", "jax.nn xla"):
      r = cell.get((path,) + col)
      if r is not None and not r.get("error"):
        base[col] = r
        names.append(f"T={col[0]} {col[1]}: {path}")
        break
  setup = (
    f"{meta.get('device', '?')}, jax {meta.get('jax', '?')}, {meta.get('date', '?')}; "
    f"{meta.get('tokens', '?')} tokens, {meta.get('heads', '?')} heads of dim "
    f"{meta.get('head_dim', '?')}, bf16, causal. TFLOP/s (speed over the column's "
    f"baseline)."
  )
  lines = [
    setup,
    "",
    "Baselines: " + ("; ".join(names) or "none ran") + ".",
    "",
    "| path | " + " | ".join(f"T={T} {p}" for T, p in columns) + " |",
    "|---|" + "---:|" * len(columns),
  ]
  for path in rows:
    lines.append(
      f"| {path} | "
      + " | ".join(_gpu_cell(cell.get((path,) + col), base.get(col)) for col in columns)
      + " |"
    )
  if auto:
    lines += ["", "auto dispatch ran: " + ", ".join(f"{k} -> {v}" for k, v in auto.items())]
  fallback = []  # the block-wise fallback against jax.nn's xla path
  for col in columns:
    ours, xla = cell.get(("attnjax blockwise softmax",) + col), cell.get(("jax.nn xla",) + col)
    if ours and xla and not ours.get("error") and not xla.get("error"):
      fallback.append(f"T={col[0]} {col[1]} {ours['tflops'] / xla['tflops']:.2f}x")
  if fallback:
    lines += ["", "blockwise softmax over jax.nn xla: " + ", ".join(fallback)]
  return "\n".join(lines) + "\n"


def read_jsonl(path: str) -> list[dict]:
  """The records of a JSON lines file (a last line cut short by a kill is dropped)."""
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        pass
  return out


# ---------------------------------------------------------------------------
# Pretrained models: sink statistics of a long sequence in O(T) memory.

PRETRAINED_LENGTHS = (8192, 32768)


def _pretrained_config():
  """A Llama-shaped model small enough for a CPU at 32k tokens: GQA, RoPE with llama3
  scaling, SwiGLU, RMSNorm, untied head; block-wise attention (statistics in the fused pass)."""
  from attnjax import nn

  attention = nn.AttentionConfig(
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=500000.0,
    implementation="blockwise",
    rope_scaling={
      "type": "llama3",
      "factor": 8.0,
      "low_freq_factor": 1.0,
      "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192,
    },
  )
  return nn.ModelConfig(
    vocab_size=2048,
    d_model=128,
    num_layers=2,
    attention=attention,
    mlp="swiglu",
    mlp_dim=344,
    norm_eps=1e-5,
    tie_embeddings=False,
  )


def _pretrained_child(T: int) -> None:
  """In a fresh process: compile and run the probe of experiments/pretrained.py (features,
  every layer's fused-pass statistics, value drain, |hidden|, chunked perplexity) at length T;
  print XLA's buffer sizes, the peak resident set and the run time."""
  from flax import nnx

  from attnjax import nn
  from attnjax.models import token_nll

  model = nn.TransformerLM(_pretrained_config(), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(0), (1, T + 1), 0, model.config.vocab_size)

  def run(state, tokens):
    m = nnx.merge(graphdef, state)
    out = nn.layer_stats(m, tokens[:, :-1], view="streaming")
    features, layers = out["features"], out["layers"]
    nll = token_nll(m, features, tokens[:, 1:], chunk=512)
    return [layer["sink_mass"] for layer in layers], jnp.mean(nll)

  before = _peak_rss_mib()
  compiled = jax.jit(run).lower(state, tokens).compile()
  m = compiled.memory_analysis()
  xla = (
    None
    if m is None
    else dict(
      args=m.argument_size_in_bytes,
      out=m.output_size_in_bytes,
      temp=m.temp_size_in_bytes,
      alias=m.alias_size_in_bytes,
    )
  )
  block(compiled(state, tokens))
  t0 = time.perf_counter()
  sink, loss = compiled(state, tokens)
  block((sink, loss))
  seconds = time.perf_counter() - t0
  print(
    json.dumps(
      {
        "T": T,
        "xla": xla,
        "peak_rss_mib": _peak_rss_mib(),
        "before_mib": before,
        "seconds": seconds,
        "loss": float(loss),
        "params": int(sum(x.size for x in jax.tree.leaves(state))),
      }
    )
  )


@suite("pretrained")
def pretrained_suite(args) -> Iterable[Case]:
  """Sink statistics of a Llama-shaped random model (built in memory) at long T on this
  backend, each length in a fresh process: the forward with every layer's fused-pass
  AttentionStats, value drain and |hidden| (attnjax.nn.layer_stats(view="streaming"), as
  experiments/pretrained.py runs it) and the chunked perplexity. Memory must grow at most 4.6x
  from 8k to 32k tokens (O(T)); TransformerLens's run_with_cache would store every layer's [B, N, T, T] pattern."""
  lengths = parse_sizes(args.sizes) if args.sizes else list(PRETRAINED_LENGTHS)
  print(f"## pretrained\n\n{pretrained_suite.__doc__.strip()}\n")
  rows = []
  for T in lengths:
    out = subprocess.run(
      [sys.executable, os.path.abspath(__file__), "--pretrained-child", str(T)],
      capture_output=True,
      text=True,
      check=False,
    )
    if out.returncode != 0:
      print(f"T={T}: failed: {out.stderr.strip().splitlines()[-1:]}\n")
      return []
    rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
  cfg = _pretrained_config()
  N, L = cfg.attention.num_heads, cfg.num_layers
  print(
    f"model: d_model {cfg.d_model}, {L} layers, {N} heads ({cfg.attention.kv_heads} kv), "
    f"head dim {cfg.attention.head_dim}, vocab {cfg.vocab_size}, {rows[0]['params']:,} "
    f"params; batch 1\n"
  )
  print(
    "| T | XLA buffers (MiB) | of which temporaries | peak RSS (MiB) | run s | "
    "T x T pattern, one layer, this model (MiB) | all layers, Llama-3-8B (GiB) |"
  )
  print("|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    x = r["xla"] or {}
    total = (x.get("args", 0) + x.get("out", 0) + x.get("temp", 0) - x.get("alias", 0)) / 2**20
    pattern = N * r["T"] ** 2 * 4 / 2**20  # float32 [1, N, T, T]
    llama8b = 32 * 32 * r["T"] ** 2 * 2 / 2**30  # bf16 [1, 32, T, T] x 32 layers
    r["xla_mib"] = total
    print(
      f"| {r['T']} | {total:.1f} | {x.get('temp', 0) / 2**20:.1f} | "
      f"{r['peak_rss_mib']:.0f} | {r['seconds']:.1f} | {pattern:,.0f} | {llama8b:,.0f} |"
    )
  if len(rows) >= 2:
    a, b = rows[0], rows[-1]
    grow = b["T"] / a["T"]
    xla_ratio = b["xla_mib"] / a["xla_mib"] if a["xla_mib"] else float("nan")
    rss_ratio = b["peak_rss_mib"] / a["peak_rss_mib"]
    verdict = "pass" if max(xla_ratio, rss_ratio) <= 4.6 * grow / 4 else "FAIL"
    print(
      f"\nT x{grow:g}: XLA buffers x{xla_ratio:.2f}, peak RSS x{rss_ratio:.2f} "
      f"(O(T): at most 4.6x for 4x the tokens: {verdict}); the T x T patterns grow "
      f"x{grow**2:g}.\n"
    )
  return []


def _peak_rss_mib() -> float:
  """Peak resident set of this process. ``VmHWM`` is reset by exec, unlike ``ru_maxrss``,
  which a child started from a large bench process inherits from it."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 1024.0
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _memory_child(name: str) -> None:
  step, args = _MEMORY[name]()
  base = _peak_rss_mib()
  compiled = step.lower(*args).compile()
  after_compile = _peak_rss_mib()
  m = compiled.memory_analysis()
  xla = None
  if m is not None:  # XLA's own accounting: the call's buffers, without the process around it
    xla = (
      m.argument_size_in_bytes
      + m.output_size_in_bytes
      + m.temp_size_in_bytes
      - m.alias_size_in_bytes
    ) / 2.0**20
  block(compiled(*args))
  print(
    json.dumps(
      {
        "case": name,
        "peak_rss_mib": _peak_rss_mib(),
        "before_run_mib": base,
        "after_compile_mib": after_compile,
        "xla_buffers_mib": xla,
        "xla_temp_mib": None if m is None else m.temp_size_in_bytes / 2.0**20,
      }
    )
  )


def measure_memory(name: str) -> dict:
  out = subprocess.run(
    [sys.executable, os.path.abspath(__file__), "--memory-child", name],
    capture_output=True,
    text=True,
    check=False,
  )
  if out.returncode != 0:
    return {"case": name, "error": out.stderr.strip().splitlines()[-1:] or ["failed"]}
  return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------
# Reporting.


def time_group(cases: list, repeats: int) -> list:
  """Times the cases of one shape in interleaved rounds; per case ``(best, median)`` seconds.

  Each case is warmed up (compiled) first, then every round times each case
  once, in turn (rotating the order). A slow spell on a shared machine hits every row of
  the shape alike instead of one row, so the ratios are robust; the best of
  the rounds is the reported time (as ``timeit`` advises: slower runs are
  interference, not the code), the median is kept for reference. A case that
  fails reports its exception instead of a time.
  """
  results: list = [None] * len(cases)
  live = []
  for n, case in enumerate(cases):
    try:
      block(case.fn(*case.args))
      live.append(n)
    except Exception as e:  # a path that cannot run a case reports it instead of aborting
      results[n] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
  samples = {n: [] for n in live}
  for round_ in range(max(repeats, 1)):
    # The order rotates each round, so no row always runs first (or right after the baseline).
    order = live[round_ % len(live) :] + live[: round_ % len(live)] if live else []
    for n in order:
      if n not in samples:
        continue
      try:
        t0 = time.perf_counter()
        block(cases[n].fn(*cases[n].args))
        samples[n].append(time.perf_counter() - t0)
      except Exception as e:  # e.g. out of memory on a later call: report it, keep the run
        results[n] = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
        del samples[n]
  for n, times in samples.items():
    results[n] = (min(times), statistics.median(times))
  return results


def _tokens_per_s(value: Optional[float]) -> str:
  """A tokens/s cell: whole tokens from 100 up, two decimals below (a decode step at 32k)."""
  if not value:
    return ""
  return f"{value:.0f}" if value >= 100 else f"{value:.2f}"


def run_suites(names: list[str], args) -> list[dict]:
  rate = matmul_rate()
  print(
    f"# attnjax benchmarks ({jax.default_backend()}, {jax.device_count()} device(s), "
    f"jax {jax.__version__})\n"
  )
  print(f"measured float32 matmul rate: {rate:.1f} GFLOP/s (2048^3, best of 5)\n")
  print(
    f"Times are the best of {args.repeats} interleaved rounds per shape "
    f"(median in brackets); ratios use the best times.\n"
  )
  results = []
  for name in names:
    rows = []
    groups: dict[str, list] = {}
    for case in _SUITES[name](args):
      groups.setdefault(case.shape, []).append(case)
    for shape, cases in groups.items():
      for case, timed in zip(cases, time_group(cases, args.repeats)):
        err = timed if isinstance(timed, str) else None
        t, t_med = (float("nan"), float("nan")) if err else timed
        gflops = case.flops / t / 1e9 if t == t else float("nan")
        rows.append(
          dict(
            suite=case.suite,
            method=case.method,
            shape=case.shape,
            time_ms=t * 1e3,
            median_ms=t_med * 1e3,
            gflops=gflops,
            pct_matmul=100 * gflops / rate,
            baseline=case.baseline,
            error=err,
            tokens_per_s=case.tokens / t if case.tokens else None,
          )
        )
        print(
          f"  {case.suite} {case.shape} {case.method}: "
          f"{'%.2f ms' % (t * 1e3) if err is None else err}",
          file=sys.stderr,
          flush=True,
        )
    if not rows:  # a suite that printed its own table (mesh)
      continue
    base = {r["shape"]: r["time_ms"] for r in rows if r["baseline"]}
    for r in rows:
      r["ratio"] = r["time_ms"] / base[r["shape"]] if r["shape"] in base else float("nan")
    print(f"## {name}\n\n{_SUITES[name].__doc__.strip()}\n")
    tok = any(r["tokens_per_s"] for r in rows)
    print(
      "| shape | method | best (median) ms | GFLOP/s | % matmul | vs baseline |"
      + (" tokens/s |" if tok else "")
    )
    print("|---|---|---:|---:|---:|---:|" + ("---:|" if tok else ""))
    for r in rows:
      if r["error"]:
        print(f"| {r['shape']} | {r['method']} | {r['error']} | | | |" + (" |" if tok else ""))
        continue
      print(
        f"| {r['shape']} | {r['method']} | {r['time_ms']:.2f} ({r['median_ms']:.2f}) | "
        f"{r['gflops']:.1f} | "
        f"{r['pct_matmul']:.1f} | {r['ratio']:.3f}x |"
        + (f" {_tokens_per_s(r['tokens_per_s'])} |" if tok else "")
      )
    print()
    results.extend(rows)
  return results


def main(argv=None) -> None:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument(
    "--suite",
    default=None,
    help="comma-separated suite names, or 'all' (the default, except that --memory "
    "alone runs only the memory cases)",
  )
  p.add_argument(
    "--sizes", default=None, help="comma-separated sequence lengths (suite default if unset)"
  )
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument(
    "--long-sizes", default=None, help="--suite sparse: NSA / DSA lengths (default 32768,65536)"
  )
  p.add_argument(
    "--crossover-sizes",
    default=None,
    help="--suite sparse: lengths of the crossover rows (default 2048,4096,8192,16384)",
  )
  p.add_argument(
    "--trained-shape", default=None, help="--suite sparse: B,N,K,H of the NSA / DSA rows"
  )
  p.add_argument("--memory", action="store_true", help="also run the memory cases")
  p.add_argument(
    "--memory-filter", default="", help="run only memory cases whose name contains this"
  )
  p.add_argument("--json", default=None, help="write all rows to this JSON file")
  p.add_argument("--list", action="store_true")
  p.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
  p.add_argument("--mesh-child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--pretrained-child", type=int, default=None, help=argparse.SUPPRESS)
  p.add_argument(
    "--torch-python",
    default=None,
    help="--suite hybrid: a Python with torch and transformers, for their side (default "
    "$ATTNJAX_BENCH_TORCH_PYTHON, else this Python)",
  )
  _add_gpu_options(p)
  args = p.parse_args(argv)
  if args.gpu_table:
    print(gpu_table(read_jsonl(args.gpu_table)))
    return
  if args.memory_child:
    _memory_child(args.memory_child)
    return
  if args.mesh_child:
    _mesh_child()
    return
  if args.pretrained_child:
    _pretrained_child(args.pretrained_child)
    return
  if args.list:
    for name, fn in _SUITES.items():
      print(f"{name}: {fn.__doc__.strip().splitlines()[0]}")
    for name in _MEMORY:
      print(f"memory {name}")
    return
  suite = args.suite if args.suite is not None else ("" if args.memory else "all")
  names = list(_SUITES) if suite == "all" else [n for n in suite.split(",") if n]
  for n in names:
    if n not in _SUITES:
      p.error(f"--suite {n!r} is not one of {sorted(_SUITES)}")
  results = run_suites(names, args) if names else []
  crossovers = crossover_report(results)
  if crossovers:
    print("Crossover lengths (forward + backward against block-wise dense causal):\n")
    print("\n".join(crossovers) + "\n")
  memory = []
  if args.memory and _MEMORY:
    print("## memory (peak resident set of a fresh process)\n")
    print(
      "Peak RSS is the whole process: Python and JAX (~250 MiB), the inputs, what the\n"
      "compiler leaves allocated, and the call. XLA buffers is XLA's own account of the\n"
      "call: arguments + outputs + temporaries.\n"
    )
    print("| case | peak RSS (MiB) | after compile (MiB) | XLA buffers (MiB) |")
    print("|---|---:|---:|---:|")
    for name in _MEMORY:
      if args.memory_filter not in name:
        continue
      m = measure_memory(name)
      memory.append(m)
      nan = float("nan")
      print(
        f"| {name} | {m.get('peak_rss_mib', nan):.0f} | {m.get('after_compile_mib', nan):.0f} "
        f"| {m.get('xla_buffers_mib') or nan:.0f} |"
        if "error" not in m
        else f"| {name} | error: {m['error']} | | |"
      )
    print()
    for line in memory_growth(memory):
      print(line)
  if args.json:
    tmp = args.json + ".tmp"
    with open(tmp, "w") as f:
      json.dump({"rows": results, "memory": memory}, f, indent=1)
    os.replace(tmp, args.json)


if __name__ == "__main__":
  main()
