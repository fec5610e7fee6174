"""``python -m attnjax.check`` plus the training step's speed: one command for a GPU or TPU host.

    python experiments/device_check.py                      # writes device_check.md (~5 min, 1 GPU)
    python experiments/device_check.py --out runs/h200.md --budget 240
    python experiments/device_check.py --platform tpu --peak-tflops 918   # a v6e host
    python experiments/device_check.py --kernel mosaic_gpu  # an H100 / H200: the Mosaic GPU kernel

Sections 1 to 5 and the kernel's verdict are :mod:`attnjax.check`'s (its
docstring lists them; the same flags). Then:

6. 50 steps (``--steps``) of the ``gpu`` (``tpu``) preset's training step
   (``dense`` and ``sigmoid`` variants, random tokens) and the model-FLOPs
   utilisation, computed as every run's ``summary.json`` computes it
   (:func:`attnjax.train.mfu.utilisation`: the device's dense bf16 peak by its
   kind, e.g. H100/H200 989 TFLOP/s, TPU v5e 197, v6e 918; ``--peak-tflops``
   overrides it; an unknown kind shows the TFLOP/s achieved and no MFU). Not
   with ``--kernel mosaic_gpu`` or ``--interpret``.

The exit status is 1 if a correctness check fails, 2 on a host without the
platform's device (``--help`` works anywhere).
"""

from __future__ import annotations

import sys
import time

from attnjax import check


def parse(argv=None):
  p = check.parser()
  p.prog = "device_check.py"
  p.description = __doc__
  p.add_argument("--steps", type=int, default=50, help="training steps per variant (section 6)")
  p.add_argument(
    "--peak-tflops",
    type=float,
    default=None,
    help="the device's dense bf16 peak for the MFU (default: by its device kind, "
    "attnjax.train.mfu.PEAK_BF16_FLOPS: H100/H200 SXM 989, TPU v5e 197, "
    "v6e 918)",
  )
  return p.parse_args(argv)


def training_mfu(r: check.Report, args) -> None:
  """Section 6: the preset's training step, steps per second and MFU."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from attnjax.train import make_optimizer, mfu
  from attnjax.train.config import apply_preset, base_config
  from attnjax.train import build_model, count_params, flops_per_token, make_train_step

  preset = {"cuda": "gpu", "tpu": "tpu"}[args.platform]  # the training preset of its device
  r.add("")
  r.add(f"## 6. {preset} preset: {args.steps} training steps, random tokens")
  r.add("")
  r.add("| variant | params | step ms | tokens/s | model TFLOP/s | MFU |")
  r.add("|---|---:|---:|---:|---:|---:|")
  peak = args.peak_tflops * 1e12 if args.peak_tflops else None
  for variant in ("dense", "sigmoid"):
    cfg = apply_preset(base_config(), preset)
    cfg.variant = variant
    model = build_model(cfg, 256, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = make_optimizer(cfg)
    state = {
      "params": params,
      "opt_state": opt.init(params),
      "step": jnp.zeros((), jnp.int32),
      "initial_loss": jnp.full((), jnp.nan, jnp.float32),
    }
    step = jax.jit(
      make_train_step(
        graphdef, opt, stats=cfg.train.step_stats, microbatches=cfg.train.microbatches
      ),
      donate_argnums=(0,),
    )
    B, T = cfg.data.batch_size, cfg.data.seq_len
    tokens = jax.random.randint(jax.random.key(0), (B, T), 0, 256)
    state, metrics = step(state, rest, tokens, tokens)  # compile
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(args.steps):
      state, metrics = step(state, rest, tokens, tokens)
    jax.block_until_ready(metrics)
    dt = (time.perf_counter() - t0) / args.steps
    n = count_params(state["params"])
    tps = B * T / dt
    u = mfu.utilisation(flops_per_token(cfg, n), tps, jax.devices()[:1], peak_flops_per_device=peak)
    used = "-" if u["mfu"] is None else f"{100 * u['mfu']:.1f}%"
    r.add(
      f"| {variant} | {n / 1e6:.1f}M | {dt * 1e3:.1f} | {tps:,.0f} | "
      f"{u['model_flops_per_s'] / 1e12:.1f} | {used} |"
    )


def main(argv=None) -> int:
  args = parse(argv)
  r = check.Report()
  status = check.run_checks(r, args)
  if status is not None:
    return status
  if args.kernel == "default" and not args.interpret:
    training_mfu(r, args)
  return check.write(r, args.out)


if __name__ == "__main__":
  sys.exit(main())
