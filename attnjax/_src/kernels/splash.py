"""Splash attention (jax's Pallas TPU kernel) as a dense engine: ``implementation="splash"``.

Implementation behind the public module :mod:`attnjax.kernels.splash`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from attnjax._src import lowering, op, normalizers, options
from attnjax._src.kernels import autodiff
from attnjax._src.kernels.blockwise import kernel as blockwise

Array = jnp.ndarray

# Block lengths tried for the splash kernel, largest first; T and S must each be a multiple of
# the smallest (the kernel computes key blocks of whole 128-lane vregs, and its fused backward
# puts query blocks in lanes too).
BLOCKS = (512, 256, 128)
DTYPES = (jnp.float32, jnp.bfloat16)


# jax's splash package, imported with this module and never inside a trace: on jax 0.12 its
# import adds a value to jax's tracing context, so a first import during a trace made every
# function traced before it (the one being traced included) miss its jit cache once
# (tests/test_traces.py). None where this jax cannot import it.
try:
  from jax.experimental.pallas.ops.tpu import splash_attention
except ImportError:  # pragma: no cover - a jax without the TPU Pallas ops
  splash_attention = None


def _library():
  """The ``splash_attention`` package of the installed jax, or None where it cannot be imported."""
  return splash_attention


def block_length(length: int) -> Optional[int]:
  """The largest of :data:`BLOCKS` that divides ``length``, or None."""
  for b in BLOCKS:
    if length % b == 0:
      return b
  return None


def make_mask(
  T: int, S: int, num_heads: int, *, is_causal: bool, window: Optional[tuple[int, int]]
):
  """The splash ``MultiHeadMask`` ``[N, T, S]`` allowing exactly :func:`attnjax.masks.structural_mask`.

  Splash's ``CausalMask`` (``q >= k``) and ``LocalMask`` (``q - left <= k <= q + right``) at
  ``offset=0`` are top-left aligned like ours. Causal AND window ``(left, right)`` is the
  one-sided window ``(left, 0)`` (``right >= 0`` adds nothing once ``k <= q``), so a masked
  call is one computable mask that the kernel evaluates in-register on partial blocks (and
  an unmasked one a ``FullMask``). One mask object serves every head, so the kernel keeps
  one copy of its block structure.
  """
  lib = _library()
  if window is not None:
    left, right = window
    head = lib.LocalMask((T, S), window_size=(left, 0 if is_causal else right), offset=0)
  elif is_causal:
    head = lib.CausalMask((T, S), offset=0)
  else:
    head = lib.FullMask((T, S))
  return lib.MultiHeadMask([head] * num_heads)


@functools.lru_cache(maxsize=32)
def _kernel(
  T: int,
  S: int,
  N: int,
  is_causal: bool,
  window: Optional[tuple[int, int]],
  softcap: Optional[float],
  interpret: bool,
):
  """Builds (once per static configuration) the splash kernel for ``[N, T, H]`` queries."""
  lib = _library()
  bq, bkv = block_length(T), block_length(S)
  block_sizes = lib.BlockSizes(
    block_q=bq,
    block_kv=bkv,
    block_kv_compute=bkv,
    block_q_dkv=bq,
    block_kv_dkv=bkv,
    block_kv_dkv_compute=bkv,
    use_fused_bwd_kernel=True,
  )
  # The kernel holds its block structure as arrays: make them concrete constants even when
  # first built inside a trace, so the cached kernel never holds a tracer (computed on this
  # host, also when the program is traced for a mesh of compile-only devices).
  with lowering.host_eval():
    return lib.make_splash_mha(
      make_mask(T, S, N, is_causal=is_causal, window=window),
      block_sizes=block_sizes,
      attn_logits_soft_cap=softcap,
      head_shards=1,
      q_seq_shards=1,
      interpret=interpret,
    )


def unsupported(
  inputs: options.DenseInputs, opts: options.DenseOptions, *, interpret: bool = False
) -> list[str]:
  """Reasons splash cannot run a call ([] = supported), on any host.

  The platform is not one of them: splash traces anywhere and lowers for
  ``tpu`` from any host (``jax.export(..., platforms=["tpu"])``); lowering it
  for another platform raises (:func:`attnjax._src.op.run_engine`).
  """
  reasons = []
  if _library() is None:
    reasons.append("this jax (jax.experimental.pallas.ops.tpu.splash_attention does not import)")
    return reasons
  if opts.normalizer not in normalizers.PLATFORM_KERNELS:  # the built-in softmax object only
    reasons.append(f"normalizer={opts.normalizer!r} (splash is a softmax kernel)")
  if opts.similarity != "dot":
    reasons.append(f"similarity={opts.similarity!r}")
  if inputs.bias is not None:
    reasons.append("bias (splash adds no bias to the logits)")
  if inputs.mask is not None:
    reasons.append(
      "an explicit mask array (splash masks are static; use is_causal, window and segment_ids)"
    )
  if opts.return_stats:
    reasons.append("return_stats=True (splash returns no weights)")
  T, S = inputs.q.shape[1], inputs.k.shape[1]
  if block_length(T) is None or block_length(S) is None:
    reasons.append(f"lengths T={T}, S={S} (splash needs multiples of {BLOCKS[-1]})")
  if inputs.q.dtype not in DTYPES:
    reasons.append(f"dtype {inputs.q.dtype} (splash takes float32 or bfloat16)")
  reasons += options.unknown_options(
    opts, inputs, options.KERNEL_OPTIONS, options.KERNEL_INPUTS, "splash"
  )
  del interpret  # the platform is checked when the program is lowered (see splash)
  return reasons


@jax.custom_vjp
def _f32_cotangent(x: Array) -> Array:
  """The identity on float32 ``x``, whose cotangent is cast to float32.

  The splash kernel returns its sinks' cotangent in the output dtype (bfloat16
  for bfloat16 calls) for float32 sinks; under ``platform_dependent`` the
  branches' cotangent types must agree, so it is cast back here.
  """
  return x


_f32_cotangent.defvjp(lambda x: (x, None), lambda _, g: (g.astype(jnp.float32),))


def compute(
  inputs: options.DenseInputs,
  opts: options.DenseOptions,
  *,
  interpret: bool = False,
  shard_offsets=None,
):
  """``jax.experimental.pallas.ops.tpu.splash_attention`` (TPU, softmax, static masks) on a
  call :func:`unsupported` accepts.

  Reverse mode is splash's own backward; forward mode (``jax.jvp``, second order), which
  splash does not have, comes from the block-wise engine
  (``attnjax._src.kernels.autodiff.custom_vjp_of``).

  The kernel takes one batch element ``q [N, T, H]``, ``k, v [K, S, H]`` (query head ``n``
  reads kv head ``n // (N // K)``, as ours) and is mapped over the batch. It does not scale
  the logits, so ``opts.scale`` is folded into ``q`` (in the input dtype); its soft cap is
  ``c * tanh(z / c)`` on those scaled logits, and its sinks are our ``sink_logits``.

  Args:
    inputs: canonical arrays (no bias, no explicit mask; see :func:`unsupported`).
    opts: static options.
    interpret: run the Pallas kernel in interpret mode (any backend; for tests on the CPU).
    shard_offsets: a shard's place in a call split by :func:`attnjax._src.sharding.per_shard`;
      unused (splash takes no modifiers).

  Returns:
    ``[B, T, N, Hv]`` in the input dtype; a query row with no allowed key is zero.
  """
  del shard_offsets
  lib = _library()
  q, k, v = inputs.q, inputs.k, inputs.v
  B, T, N, _ = q.shape
  S = k.shape[1]
  kernel = _kernel(T, S, N, opts.is_causal, opts.window, opts.softcap, interpret)
  # Scale in float32, then one rounding to the input dtype (a bf16 scale would be rounded too).
  qh = jnp.transpose((q.astype(jnp.float32) * opts.scale).astype(q.dtype), (0, 2, 1, 3))
  kh = jnp.transpose(k, (0, 2, 1, 3))  # [B, K, S, H]
  vh = jnp.transpose(v, (0, 2, 1, 3))
  sinks = None
  if inputs.sink_logits is not None:
    sinks = jnp.reshape(inputs.sink_logits, (N,)).astype(jnp.float32)
  seg = None
  if inputs.q_segment_ids is not None:
    seg = lib.SegmentIds(
      q=inputs.q_segment_ids.astype(jnp.int32), kv=inputs.kv_segment_ids.astype(jnp.int32)
    )

  def splash_call(x, seg):
    """The kernel on the heads-first arrays ``x = (qh, kh, vh, sinks)``: ``[B, N, T, Hv]``."""
    qh, kh, vh, sinks = x

    def one(q1, k1, v1, seg1):
      if sinks is None:
        return kernel(q1, k1, v1, segment_ids=seg1)
      return kernel(q1, k1, v1, segment_ids=seg1, sinks=_f32_cotangent(sinks))

    return jax.vmap(one)(qh, kh, vh, seg).astype(qh.dtype)

  def twin(x, seg):
    """The same on the block-wise engine (``q`` is scaled already)."""
    qh, kh, vh, sinks = x
    heads = lambda a: jnp.transpose(a, (0, 2, 1, 3))
    call = options.DenseInputs(
      q=heads(qh),
      k=heads(kh),
      v=heads(vh),
      sink_logits=None if sinks is None else jnp.reshape(sinks, (1, N, 1, 1)),
      q_segment_ids=None if seg is None else seg.q,
      kv_segment_ids=None if seg is None else seg.kv,
    )
    return heads(blockwise.run(call, dataclasses.replace(opts, scale=1.0))).astype(qh.dtype)

  # Splash's residuals are these heads-first arrays: the linear map keeps no copy of q, k, v.
  out = autodiff.custom_vjp_of(splash_call, (qh, kh, vh, sinks), seg, twin=twin, name="splash")
  out = jnp.transpose(out, (0, 2, 1, 3)).astype(q.dtype)  # [B, T, N, Hv]
  # Splash gives a row with no allowed key the mean of the values it visited (or NaN where it
  # visited no block); ours is zero.
  has_key = options.rows_with_keys(inputs, opts, T, S)
  if has_key is not None:
    keep = jnp.transpose(has_key, (0, 2, 1))[..., None]  # [B|1, T, N|1, 1]
    out = jnp.where(keep, out, jnp.zeros((), out.dtype))
  return out


# The engine as dispatch sees it (:class:`attnjax._src.op.Engine`): the dense op lists it.
ENGINE = op.platform_kernel(
  "splash",
  compute,
  unsupported,
  platform="tpu",
  where="runs on a TPU only (splash needs a TPU)",
  vouched_by="jax",
)
run = op.deprecated_run(ENGINE, "attnjax.kernels.splash")
attention = options.engine_entry(op.dense_runner(ENGINE), "splash", ("interpret",))
attention.__doc__ = """Splash attention called like :func:`attnjax.dot_product_attention`.

``attention(q, k, v, *, <dense options>, interpret=False)``: every keyword of
:func:`attnjax.dot_product_attention` but ``implementation`` (what splash
cannot honour is refused, see :func:`unsupported`); ``interpret=True`` runs the
kernel in Pallas interpret mode on any backend. Over several devices the kernel
runs on each device's batch rows and heads, as in :func:`attnjax.dot_product_attention`.
"""
