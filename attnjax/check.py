"""``python -m attnjax.check``: attnjax's Pallas kernels checked on this device, and the verdict
that lets auto-dispatch take them here. For example::

    python -m attnjax.check --kernel all             # a GPU: pallas_gpu (+ mosaic_gpu: Hopper)
    python -m attnjax.check --kernel mosaic_gpu      # an H100 / H200: the Mosaic GPU kernel
    python -m attnjax.check --platform tpu           # a TPU host (v5e, v6e): pallas_tpu
    python -m attnjax.check --kernel all --ship      # also write the verdict to ship (below)
    python -m attnjax.check --out runs/h200.md --budget 120

Auto-dispatch takes attnjax's own Pallas kernels (``pallas_gpu``, ``mosaic_gpu``,
``pallas_tpu``) on a kind of device only where a verdict of this command says
they passed there, per case class (normaliser x structure x dtype), or with
``ATTNJAX_KERNELS=all`` (:mod:`attnjax._trust`). Each run writes its verdict
(per kernel: the device kind, the jax and attnjax versions, the digest of the
kernel's sources, each case class's result, the failed cases) to
``$ATTNJAX_CACHE_DIR`` (default ``$XDG_CACHE_HOME/attnjax`` or
``~/.cache/attnjax``), ``verdicts/<device kind>.json``. ``--ship`` also writes
it into the imported package's ``attnjax/verdicts/`` (run it from a source
checkout on the device kind, then commit the file): a shipped verdict counts on
every host with the same sources, multi-process runs included. A verdict is
this command's output, never written by hand.

Section 2 compiles its cases (one program each: the kernel and the reference,
values and gradients) in ``--workers`` threads at once, then runs them.

Sections of the markdown report (``--out``; the exit status is 1 if a
correctness check fails):

1. Dispatch: the order of the platform's list (with every kernel allowed): for
   a bf16 causal call the ``cuda`` branch of ``implementation=None`` picks
   ``"cudnn"``; for options cuDNN lacks (``normalizer="sigmoid"``,
   ``return_stats``) ``"mosaic_gpu"`` on a Hopper, else ``"pallas_gpu"``; fp32
   inputs go to ``"pallas_gpu"``. On a TPU: splash for plain softmax,
   ``"pallas_tpu"`` for every other call it covers.
2. Each kernel against ``reference`` run in fp32 on the same inputs under the
   highest matmul precision: values and gradients (q, k, v, and the logsumexp
   statistic's), every normaliser x causal / window / segments in bf16 (sink
   logits and softcap where the normaliser takes them) and causal in fp32 (the
   Mosaic GPU kernel: fp16), GQA, lengths not multiples of the blocks. The error
   is a row's (:func:`row_error`): one wrong row fails its case.
3. (GPU) auto (cuDNN) and ``"cudnn"`` against the reference for causal, window
   and padding-mask calls in bf16, values and gradients; the block-wise kernel
   on the GPU in fp32.
4. TFLOP/s, forward and forward+backward, bf16, causal, T = 1k, 4k, 16k and
   H = 64, 128 (16k tokens per batch, 2048 model width): the kernel for each
   normaliser, cuDNN (splash) softmax, ``jax.nn`` XLA and the block-wise
   kernel, plus the reference at T=8192. Causal FLOPs are counted as half the
   dense ``4 T^2 H`` per head forward and 2.5x that backward. Each time is per
   call of ``--calls`` back-to-back calls (the device waited on once). Paths that would
   materialise ``T x T`` at 16k are skipped, and the table stops at
   ``--budget`` seconds, shared evenly between the kernels checked (the rest is
   marked "not run"). With ``--kernel
   mosaic_gpu``: T = 4k and 16k, H = 128, causal and not, backward = fwd+bwd
   time minus forward time (counted as 2.5x the forward FLOPs).
5. Speed targets (reported, not failed): ``pallas_gpu`` softmax within 1.5x of
   cuDNN's time at T=4096 bf16 H=128, every other normaliser within 1.25x of
   our softmax kernel, at least 10x faster than the reference at T=8192;
   ``pallas_tpu`` softmax within 1.25x of splash, every other normaliser within
   1.25x of our softmax; ``mosaic_gpu`` softmax forward >= 550 TFLOP/s at T=16k
   non-causal and within 1.15x of cuDNN's time, every other normaliser within
   1.15x of our softmax, backward >= 400 TFLOP/s. (``--kernel all`` prints the
   tables of each kernel it checked.)

On a host without the platform's device it prints that it needs one and exits
with status 2 at once (``--help`` works anywhere). ``--interpret`` runs
sections 1 and 2 on the CPU instead, the kernel in Pallas interpret mode at a
small shape (a test of this command, not of a device: its verdict is for the
device kind ``"cpu"``, which no GPU or TPU target has; ``--ship`` refuses it).
It checks ``pallas_gpu`` (``--platform tpu``: ``pallas_tpu``) in 1 to 2 minutes
on two CPU cores, and CI runs it as shipped; ``--kernel all`` adds
``mosaic_gpu`` in jax's Mosaic GPU interpreter, which takes minutes per case.
``experiments/device_check.py`` runs this command and adds a section 6 (the
training step's model-FLOPs utilisation).
"""

from attnjax._src.check import (BUILTIN, CHECK_SHAPE, INTERPRET_SHAPE, KERNEL, KERNELS,
                                MOSAIC_SIZES, PLATFORM_KERNELS, ROW_FLOOR, SPEED_SIZES, STRUCTURES,
                                TOLERANCE, Report, case_program, check_cases,
                                check_cudnn_and_blockwise, check_dispatch, check_kernel,
                                compile_all, kernels_to_check, main, mosaic_table, mosaic_targets,
                                parser, qkv, row_error, run_checks, speed_shape, speed_table,
                                targets, write)

__all__ = ["BUILTIN", "CHECK_SHAPE", "INTERPRET_SHAPE", "KERNEL", "KERNELS", "MOSAIC_SIZES",
    "PLATFORM_KERNELS", "ROW_FLOOR", "SPEED_SIZES", "STRUCTURES", "TOLERANCE", "Report",
    "case_program", "check_cases", "check_cudnn_and_blockwise", "check_dispatch", "check_kernel",
    "compile_all", "kernels_to_check", "main", "mosaic_table", "mosaic_targets", "parser", "qkv",
    "row_error", "run_checks", "speed_shape", "speed_table", "targets", "write"]

if __name__ == "__main__":
  import sys

  from attnjax._src.check import main

  sys.exit(main())
