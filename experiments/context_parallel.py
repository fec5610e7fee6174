"""Context parallelism on forced host devices: per-device memory, tiles, bytes per ring step.

    python experiments/context_parallel.py                 # T=65536, 8 devices (compiles only)
    python experiments/context_parallel.py --T 16384 --devices 4
    python experiments/bench.py --suite context_parallel   # the same, from the bench

Nothing is run: each program (forward + backward of a causal call, B=1, N=8,
H=64, fp32) is compiled for ``--devices`` forced host devices and XLA's own
account of one device's buffers is read (``compiled.memory_analysis()``:
arguments + outputs + temporaries). The single-device block-wise call at the
same ``T`` is the baseline. Tiles per device come from the ring's static plan
(:func:`attnjax.parallel.ring_plan`); bytes sent per ring step from the
compiled program's ``collective-permute`` operations, against the ideal (this
device's key and value shards).
"""

from __future__ import annotations

import argparse
import os
import re
import sys


def main(argv=None) -> None:
  p = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  p.add_argument("--T", type=int, default=65536)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--strategies", default="ring,all_gather,all_to_all")
  args = p.parse_args(argv)
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
  )
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax  # after the device count is set
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  import attnjax
  from attnjax.parallel import ring_plan

  B, T, N, H, Pn = 1, args.T, 8, 64, args.devices
  mesh = jax.make_mesh((Pn,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
  x = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)

  def fwd_bwd(attn):
    def loss(q, k, v):
      return jnp.sum(attn(q, k, v).astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

  def account(compiled) -> dict:
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return {"mib": total / 2**20, "temp_mib": m.temp_size_in_bytes / 2**20}

  def sharded(strategy, layout):
    def local(q, k, v):
      return attnjax.dot_product_attention(
        q,
        k,
        v,
        is_causal=True,
        context_axis="context",
        context_strategy=strategy,
        context_layout=layout,
      )

    spec = P(None, "context")
    return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

  single = fwd_bwd(
    lambda q, k, v: attnjax.dot_product_attention(
      q, k, v, is_causal=True, implementation="blockwise"
    )
  )
  with jax.default_device(jax.devices()[0]):
    base = account(single.lower(x, x, x).compile())
  print(
    f"## context parallelism: causal fwd+bwd, B={B}, T={T}, N={N}, H={H}, fp32, {Pn} host devices\n"
  )
  print(
    "XLA buffers: one device's arguments + outputs + temporaries "
    "(compiled.memory_analysis()); ratio: over the single-device block-wise call.\n"
  )
  print(
    "| strategy | layout | XLA buffers / device (MiB) | temporaries (MiB) | ratio | "
    "tiles per device (min..max) | bytes sent per ring step (fwd) | ideal |"
  )
  print("|---|---|---:|---:|---:|---|---:|---:|")
  print(
    f"| single device blockwise | - | {base['mib']:.0f} | {base['temp_mib']:.0f} | 1.00 | "
    f"- | - | - |"
  )
  T_l = T // Pn
  ideal = 2 * B * T_l * N * H * 4  # this device's k and v shards (K = N here)
  for strategy in args.strategies.split(","):
    for layout in ("contiguous", "zigzag"):
      with jax.set_mesh(mesh):
        compiled = fwd_bwd(sharded(strategy, layout)).lower(x, x, x).compile()
      acc = account(compiled)
      tiles = sent = "-"
      if strategy == "ring":
        plan = ring_plan(T_l, T_l, Pn, layout, is_causal=True, window=None, with_stats=False)
        per = [plan.tiles(p) for p in range(Pn)]
        tiles = f"{min(per)}..{max(per)}"
        text = compiled.as_text()
        fwd = [
          line
          for line in text.splitlines()
          if " collective-permute(" in line and "transpose(" not in line
        ]
        sent_bytes = 0
        for line in fwd:
          shape = re.search(r"= (\w+)\[([\d,]*)\]", line)
          size = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2}.get(shape.group(1), 4)
          for d in filter(None, shape.group(2).split(",")):
            size *= int(d)
          sent_bytes += size
        sent = f"{sent_bytes / 2**20:.1f} MiB"
      print(
        f"| {strategy} | {layout} | {acc['mib']:.0f} | {acc['temp_mib']:.0f} | "
        f"{acc['mib'] / base['mib']:.3f} | {tiles} | {sent} | "
        f"{ideal / 2**20:.1f} MiB |",
        flush=True,
      )
  print()


if __name__ == "__main__":
  main(sys.argv[1:])
