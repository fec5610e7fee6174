"""``jax.nn.dot_product_attention`` as a dense engine: ``implementation="xla"`` and ``"cudnn"``.

Implementation behind the public module :mod:`attnjax.kernels.jax_nn`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from attnjax._src import target, masks, normalizers, options
from attnjax._src.kernels import autodiff
from attnjax._src.kernels.blockwise import kernel as blockwise


def unsupported(inputs: options.DenseInputs, opts: options.DenseOptions) -> list[str]:
  reasons = []
  if opts.normalizer not in normalizers.PLATFORM_KERNELS:  # the built-in softmax object only
    reasons.append(f"normalizer={opts.normalizer!r} (jax.nn computes the built-in softmax)")
  if inputs.sink_logits is not None:
    reasons.append("sink_logits")
  if opts.softcap is not None:
    reasons.append("softcap")
  if opts.similarity != "dot":
    reasons.append(f"similarity={opts.similarity!r}")
  if opts.return_stats:
    reasons.append("return_stats=True (its logsumexp residual has no gradient)")
  if opts.score_mod is not None:
    reasons.append("score_mod")
  if opts.mask_mod is not None:
    reasons.append("mask_mod")
  if inputs.v.shape[-1] != inputs.q.shape[-1]:
    reasons.append(
      f"a value head dim ({inputs.v.shape[-1]}) unlike the query's ({inputs.q.shape[-1]})"
    )
  return reasons


def compute(
  inputs: options.DenseInputs,
  opts: options.DenseOptions,
  *,
  implementation: str,
  shard_offsets=None,
):
  """``jax.nn.dot_product_attention`` (``implementation`` ``"xla"`` or ``"cudnn"``) on a
  validated call it supports, without a platform guard (``"cudnn"`` lowers for ``cuda``
  only: dispatch puts it in that platform's branch).

  ``"cudnn"`` has reverse mode only (jax's ``custom_vjp``): its forward mode (``jax.jvp``,
  second order) comes from the block-wise engine
  (``attnjax._src.kernels.autodiff.custom_vjp_of``); ``"xla"`` is plain JAX.
  ``shard_offsets`` (a shard's place in a call split by :func:`attnjax._src.sharding.per_shard`)
  changes nothing: no modifier runs here.
  """
  del shard_offsets
  if implementation != "cudnn":
    return _compute(inputs, opts, implementation)
  x, nondiff = blockwise.split_inputs(inputs)
  return autodiff.custom_vjp_of(
    lambda x, nondiff: _compute(blockwise.join_inputs(x, nondiff), opts, implementation),
    x,
    nondiff,
    twin=blockwise.twin(opts),
    name="cudnn",
  )


def _compute(inputs: options.DenseInputs, opts: options.DenseOptions, implementation: str):
  q, k, v = inputs.q, inputs.k, inputs.v
  T, S = q.shape[1], k.shape[1]
  mask = masks.combine_masks(
    inputs.mask,
    None
    if inputs.q_segment_ids is None
    else masks.segment_mask(inputs.q_segment_ids, inputs.kv_segment_ids),
  )
  bias = None if inputs.bias is None else inputs.bias.astype(q.dtype)
  out = jax.nn.dot_product_attention(
    q,
    k,
    v,
    bias=bias,
    mask=mask,
    scale=opts.scale,
    is_causal=opts.is_causal,
    local_window_size=opts.window,
    implementation=implementation,
  )
  # jax.nn gives a row with no allowed key the mean of all values; ours is zero.
  has_key = options.rows_with_keys(inputs, opts, T, S)
  if has_key is not None:
    keep = jnp.transpose(has_key, (0, 2, 1))[..., None]  # [B|1, T, N|1, 1]
    out = jnp.where(keep, out, jnp.zeros((), out.dtype))
  return out


def cudnn_unsupported(inputs: options.DenseInputs, opts: options.DenseOptions) -> list[str]:
  """Reasons jax's cuDNN attention cannot run a call ([] = supported), on any host.

  The platform is not one of them (the call is a ``cuda`` branch chosen when
  the program is lowered), but the host is: jax's wrapper reads the local
  cuDNN library's version while it traces, so the program can hold the cuDNN
  call wherever that library is installed (a GPU machine, or a CPU host with
  ``attnjax[aot]`` compiling for a GPU), and nowhere else.
  """
  reasons = unsupported(inputs, opts)
  for reason in options.unknown_options(
    opts, inputs, options.KERNEL_OPTIONS, options.KERNEL_INPUTS, "cudnn"
  ):
    if reason not in reasons:
      reasons.append(reason)
  if target.cudnn_version() is None:
    reasons.append(
      "this host (jax's cuDNN wrapper reads the local cuDNN library while tracing, "
      "and none is installed: pip install 'attnjax[aot]' or use a GPU machine)"
    )
  if inputs.q.dtype not in (jnp.bfloat16, jnp.float16):
    reasons.append(f"dtype {inputs.q.dtype} (cuDNN takes bfloat16 or float16)")
  H = inputs.q.shape[-1]
  # jax's wrapper allows head dims above 128 only when the tracing host's GPU is a Hopper (asked
  # only for such a head dim).
  h_max = 256 if H > 128 and (target.local_gpu_major() or 0) >= 9 else 128
  if H % 8 or H > h_max:
    reasons.append(
      f"head dim {H} (jax's cuDNN wrapper takes multiples of 8 up to {h_max} on this host)"
    )
  return reasons
