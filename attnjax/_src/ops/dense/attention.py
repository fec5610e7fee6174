"""Dense scaled dot-product attention with every normaliser, and its dispatch.

Implementation behind the public module :mod:`attnjax.dense`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Literal, Mapping, Optional, Union

import jax.numpy as jnp

from attnjax._src import empty, jax_nn_compat, lowering, op, static, trust, options
from attnjax._src.kernels import jax_nn, splash
from attnjax._src.kernels.blockwise import kernel as blockwise
from attnjax._src.kernels.mosaic_gpu import kernel as mosaic_gpu
from attnjax._src.kernels.pallas_gpu import kernel as pallas_gpu
from attnjax._src.kernels.pallas_tpu import kernel as pallas_tpu
from attnjax._src.parallel import strategies
from attnjax._src.ops.dense import reference as reference_lib

Array = jnp.ndarray

Similarity = options.Similarity
# The canonical call lives in attnjax.options so that kernels (blockwise) can take it without
# importing this module, which imports them for its registry.
SIMILARITIES = options.SIMILARITIES
DenseOptions = options.DenseOptions
DenseInputs = options.DenseInputs
JAX_NN_MASKED_LOGIT = jax_nn_compat.JAX_NN_MASKED_LOGIT


# ---------------------------------------------------------------------------
# Engines.


# The readable engine, defined in ops/dense/reference.py.
reference = reference_lib.reference


# One dense implementation, as dispatch sees it (:class:`attnjax._src.op.Engine`): its ``compute``
# and ``unsupported`` take the call ``(inputs, opts)``.
Engine = op.Engine


# Auto-dispatch uses the block-wise path from this sequence length on (the longer of T and S).
# Measured with `experiments/bench.py --suite dense --sizes 256,512,1024,2048` (causal
# forward, B=1, N=8, H=64, fp32, CPU): block-wise / reference = 0.53x at 256, 0.76x at 512,
# 0.21x at 1024, 0.12x at 2048. Shorter calls keep the reference (less to compile, nothing to
# skip).
BLOCKWISE_MIN_LENGTH_CPU = 256

# The engines, by implementation= name. The platform kernels' records (their platform, where
# they run and who vouches for them) are their kernel modules' ENGINE.
ENGINES: dict[str, Engine] = {
  e.name: e
  for e in (
    Engine("reference", reference, op.supports_everything),
    Engine("blockwise", blockwise.run, blockwise.unsupported, min_length=BLOCKWISE_MIN_LENGTH_CPU),
    Engine(
      "xla",
      functools.partial(jax_nn.compute, implementation="xla"),
      jax_nn.unsupported,
      vouched_by="jax",
    ),
    op.platform_kernel(
      "cudnn",
      functools.partial(jax_nn.compute, implementation="cudnn"),
      jax_nn.cudnn_unsupported,
      platform="cuda",
      where="runs on a CUDA GPU only (jax's cuDNN call)",
      vouched_by="jax",
    ),
    splash.ENGINE,
    pallas_gpu.ENGINE,
    pallas_tpu.ENGINE,
    mosaic_gpu.ENGINE,
  )
}
# The valid implementation= names, and their type.
IMPLEMENTATIONS: tuple[str, ...] = tuple(ENGINES)
ImplementationName = Literal[IMPLEMENTATIONS]

# Auto-dispatch's order per platform (a platform_dependent key): the first engine that
# supports the call (and, for attnjax's Pallas kernels, that the kernel-trust rule allows),
# then FALLBACK. Another platform takes FALLBACK alone.
PREFERENCES: dict[str, tuple[str, ...]] = {
  "cuda": ("cudnn", "mosaic_gpu", "pallas_gpu"),
  "tpu": ("splash", "pallas_tpu"),
}
FALLBACK: tuple[str, ...] = ("blockwise", "reference")


# ---------------------------------------------------------------------------
# The op's questions about a call ``(inputs, opts)``.


def is_empty(inputs: DenseInputs, opts: DenseOptions) -> bool:
  """No queries or no keys: :func:`attnjax._src.empty.dense` answers."""
  del opts
  return inputs.q.shape[1] == 0 or inputs.k.shape[1] == 0


def context_axis(inputs: DenseInputs, opts: DenseOptions) -> Optional[str]:
  """The ``shard_map`` axis the call's sequence is sharded over, or None."""
  del inputs
  return opts.context_axis


def length(inputs: DenseInputs, opts: DenseOptions) -> int:
  """The longer of ``T`` and ``S`` (engines' ``min_length`` compares with it)."""
  del opts
  return max(inputs.q.shape[1], inputs.k.shape[1])


def context(call: tuple[DenseInputs, DenseOptions], implementation: Optional[str], local):
  """The context-parallel strategy (:func:`attnjax._src.parallel.strategies.attention`: ring, all-gather or
  all-to-all, the op choosing one for ``context_strategy=None``), each device's part run on
  ``local``, the op's per-device computation."""
  inputs, opts = call
  return strategies.attention(
    inputs,
    opts,
    implementation,
    lambda inputs, opts, implementation: local((inputs, opts), implementation),
  )


def _samples() -> tuple[op.Sample, ...]:
  return (
    op.Sample(
      dot_product_attention,
      options=dict(is_causal=True),
      stats=True,
      flags=("is_causal", "return_stats"),
      static=(("scale", 0.5), ("softcap", 3.0), ("window", (2, 0))),
      dense_keywords=options.KEYWORDS,
      context=True,
      extreme_values=True,
    ),
  )


OP = op.register(
  op.Op(
    "dense",
    ENGINES,
    PREFERENCES,
    FALLBACK,
    empty=empty.dense,
    is_empty=is_empty,
    context=context,
    context_axis=context_axis,
    length=length,
    trust_class=trust.call_class,
    samples=_samples,
  )
)


def front_end(name: str, samples) -> op.Op:
  """The op of a front end of dense attention (``qk_norm``, ``cosine``, ``mla``): a dense call
  of the inputs it prepares, with dense's engines and order, empty answer and context
  strategy."""
  return dataclasses.replace(OP, name=name, samples=samples)


def select_implementation(
  inputs: DenseInputs, opts: DenseOptions, platform: Optional[str] = None
) -> str:
  """Auto-dispatch on one platform: the first engine of ``PREFERENCES`` (then
  ``FALLBACK``) that honours every option asked for.

  ``platform`` is a ``jax.lax.platform_dependent`` key (``"cpu"``, ``"cuda"``,
  ``"tpu"``); None means the default backend's.

  cuda: ``"cudnn"`` (jax's, where it supports every option and the dtype and
  this host has the cuDNN library: jax's wrapper reads its version while
  tracing), else ``"mosaic_gpu"`` (a Hopper target, bf16/fp16, head dims
  64/128/256, no modifiers or bias/mask arrays), else ``"pallas_gpu"`` (no
  bias/mask arrays, dot similarity). tpu: ``"splash"`` (softmax, no bias or
  mask array, T and S multiples of 128, fp32/bf16), else ``"pallas_tpu"``
  (every normaliser, statistics, any lengths; no bias/mask arrays,
  argument-free modifiers). Every platform then: ``"blockwise"`` once ``max(T,
  S) >= BLOCKWISE_MIN_LENGTH_CPU``, else ``"reference"``. Each engine's
  ``unsupported`` decides whether it covers the call; attnjax's own Pallas
  kernels (``vouched_by="device-check"``) are taken only on a kind of device
  where ``python -m attnjax.check`` passed, or with ``attnjax.config.auto_kernels =
  "all"`` (:mod:`attnjax._src.trust`). Platform kernels run inside ``shard_map``
  when the ambient mesh (``jax.set_mesh``) has several devices
  (:func:`attnjax._src.sharding.per_shard`), so the choice never depends on the
  device count.
  """
  return op.select(OP, (inputs, opts), platform)


def dispatch_table(inputs: DenseInputs, opts: DenseOptions) -> dict[str, str]:
  """``{platform: implementation}`` that ``implementation=None`` lowers for each of
  :data:`attnjax._src.lowering.PLATFORMS` (other platforms take the ``"cpu"`` choice)."""
  return op.choose(OP, (inputs, opts), lowering.PLATFORMS)


def run(inputs: DenseInputs, opts: DenseOptions, implementation: Optional[str]):
  """:func:`attnjax._src.op.run` of the dense op: a validated call on the named engine, or on
  each platform's choice, decided when the program is lowered (a function exported for
  ``cuda`` or ``tpu`` from a CPU host carries the GPU or TPU kernel)."""
  return op.run(OP, (inputs, opts), implementation)


def run_on_this_platform(inputs: DenseInputs, opts: DenseOptions, implementation: Optional[str]):
  """:func:`attnjax._src.op.run_on_this_platform` of the dense op: ``implementation=None``
  chosen for the platform lowering now."""
  return op.run_on_this_platform(OP, (inputs, opts), implementation)


# ---------------------------------------------------------------------------
# Public function.


def prepare(
  q, k, v, *, implementation: Optional[str] = None, **dense_keywords
) -> tuple[DenseInputs, DenseOptions]:
  """Validates a dense call (``dense_keywords``: :data:`attnjax._src.options.KEYWORDS`) and returns
  its canonical inputs and options; ``implementation`` is None or a name of :data:`ENGINES`."""
  inputs, opts = options.validate(q, k, v, **dense_keywords)
  if implementation is not None:
    op.check_implementation(OP, implementation)
  return inputs, opts


def _dot_product_attention(
  query: Array,
  key: Array,
  value: Array,
  bias: Optional[Array] = None,
  mask: Optional[Array] = None,
  *,
  scale: Optional[float] = None,
  is_causal: bool = False,
  query_seq_lengths: Optional[Array] = None,
  key_value_seq_lengths: Optional[Array] = None,
  local_window_size: Optional[Union[int, tuple[int, int]]] = None,
  implementation: Optional[ImplementationName] = None,
  return_residual: bool = False,
  normalizer: str = "softmax",
  normalizer_params: Optional[Mapping[str, Array]] = None,
  sink_logits: Optional[Array] = None,
  softcap: Optional[float] = None,
  window: Optional[Union[int, tuple[int, int]]] = None,
  segment_ids: Any = None,
  similarity: Similarity = "dot",
  return_stats: bool = False,
  score_mod: Optional[Callable[..., Any]] = None,
  score_mod_args: Any = None,
  mask_mod: Optional[Callable[..., Any]] = None,
  mask_mod_args: Any = None,
  block_layout: Any = None,
  context_axis: Optional[str] = None,
  context_strategy: Optional[options.ContextStrategy] = "ring",
  context_layout: Optional[options.ContextLayout] = None,
):
  """Scaled dot-product attention with a choice of normaliser.

  A drop-in for :func:`jax.nn.dot_product_attention`: its arguments come
  first, with its names, positions and meanings (``query``, ``key``,
  ``value``, ``bias``, ``mask``, ``scale``, ``is_causal``,
  ``query_seq_lengths``, ``key_value_seq_lengths``, ``local_window_size``,
  ``implementation``, ``return_residual``), then attnjax's own.

  Args:
    query: queries ``[B, T, N, H]`` (``q``).
    key: keys ``[B, S, K, H]`` (``k``); ``N % K == 0`` (GQA/MQA: query head
      ``n`` reads key/value head ``n // (N // K)``).
    value: values ``[B, S, K, Hv]`` (``v``).
    bias: float, added to the logits; broadcastable to ``[B, N, T, S]``.
    mask: bool, True = may attend; broadcastable to ``[B, N, T, S]``.
    scale: logit scale; None means ``H ** -0.5``.
    is_causal: query ``i`` sees keys ``j <= i`` (top-left aligned, as jax.nn).
    query_seq_lengths: int ``[B]``: queries ``i >= query_seq_lengths[b]`` are
      padding; their rows are zero (as jax.nn).
    key_value_seq_lengths: int ``[B]``: keys ``j >= key_value_seq_lengths[b]``
      are masked. Both become segment ids (or, with ``segment_ids`` given, a
      mask), so every path that takes segment ids takes them.
    local_window_size: jax.nn's window: ``(left, right)``, or an int ``w``
      meaning ``(w, w)``; the same as ``window`` (give one, or equal ones).
    implementation: None (auto, see :func:`attnjax.dense.select_implementation`),
      ``"reference"``, ``"blockwise"`` (:mod:`attnjax.kernels.blockwise`: online
      normaliser over key blocks, O(T) memory, masked blocks skipped), or
      ``"xla"`` / ``"cudnn"`` (``jax.nn.dot_product_attention``), or
      ``"splash"`` (the Pallas TPU splash-attention kernel: softmax with
      causal/window/segment masks, softcap, sink logits, GQA; T and S
      multiples of 128), or ``"pallas_gpu"`` (:mod:`attnjax.kernels.pallas_gpu`, a
      Pallas Triton kernel for every normaliser, no bias/mask arrays), or
      ``"pallas_tpu"`` (:mod:`attnjax.kernels.pallas_tpu`, a Pallas Mosaic TPU
      kernel for every normaliser, no bias/mask arrays), or ``"mosaic_gpu"``
      (:mod:`attnjax.kernels.mosaic_gpu`, a Pallas Mosaic GPU kernel for Hopper,
      every normaliser, bf16/fp16; see its ``unsupported``). Named
      paths raise if an option is unsupported; None is chosen per platform
      when the program is lowered (:func:`attnjax.dense.dispatch_table`).
    return_residual: also return jax.nn's residual ``[B, T, N]`` in the input
      dtype: the log-normaliser of each row, ``log sum_j exp(z_ij)`` (the null
      column of ``softmax_one`` / ``sink_logits`` included), so that the
      weights are ``exp(z - residual)``; on a row with no allowed key it is
      jax.nn's masked logit, ``-0.7 * float32 max``. Softmax-like
      normalisers only (others raise). Unlike jax.nn's it carries a
      gradient; it is not computed by the ``"xla"`` / ``"cudnn"`` paths.
    normalizer: the name of a registered normaliser (:func:`attnjax.normalizers.names`):
      a built-in of :data:`attnjax.normalizers.NORMALIZERS` (``"softmax"``,
      ``"softmax_one"``, ``"sigmoid"``, ``"softpick"``, ``"none"``, ``"relu"``; see the
      table in :mod:`attnjax.normalizers`) or one of :func:`attnjax.normalizers.register`.
    normalizer_params: the learned parameters of a weights-only normaliser that declares
      some (:class:`attnjax.normalizers.Param`), by name: ``[N]`` arrays (per head) or
      scalars (per layer), with gradients; one left out takes its ``init``.
    sink_logits: ``[N]`` learned per-head logit of a null key that takes
      softmax mass and is dropped (gpt-oss); softmax only.
    softcap: ``c`` for ``c * tanh(z / c)`` logit capping (Gemma 2), applied to
      the scaled similarity before ``bias``.
    window: ``(left, right)``: query ``i`` sees keys ``i - left .. i + right``; an int
      ``w`` is ``(w, 0)`` (keys ``i - w .. i``, the convention of every family).
    segment_ids: ``[B, T]`` ids when ``T == S``, or a pair ``([B, T], [B, S])``;
      queries attend only within their segment (packed sequences).
    similarity: ``"dot"`` or ``"neg_sq_euclidean"`` (``-||q - k||^2``, to test
      whether distance scores give near-uniform weights).
    return_stats: also return :class:`AttentionStats`.
    score_mod: ``fn(z, b, n, i, j, *score_mod_args) -> z'`` (static, hashable):
      rewrites the float32 logits after ``scale``, ``softcap`` and ``bias``,
      just before the normaliser. ``b, n, i, j`` are int32 index arrays
      (batch, query head, query position, key position) broadcastable against
      ``z``; write ``fn`` with elementwise ``jnp`` operations. Ready ones:
      :mod:`attnjax.mods`.
    score_mod_args: arrays ``fn`` reads (tables, slopes); they receive
      gradients. ``fn`` must not close over traced arrays (ValueError).
    mask_mod: ``fn(b, n, i, j, *mask_mod_args) -> bool`` (static, hashable;
      True = may attend), intersected with every other mask. The block-wise
      and sparse paths skip blocks it masks entirely and evaluate it only on
      partly masked blocks.
    mask_mod_args: arrays ``mask_mod`` reads (e.g. document ids).
    block_layout: a layout from :func:`attnjax.layout.from_mask_mod` for this
      ``mask_mod`` (static), built once and reused across calls and layers.
    context_axis: None, or the ``jax.shard_map`` mesh axis the sequence is sharded
      over (context parallelism, :mod:`attnjax.parallel`): called inside ``shard_map``
      with q, k, v and segment ids sharded along time over that axis (sink logits and
      modifier arguments whole), the call returns this device's shard of the output
      (statistics: ``logsumexp`` of the local rows, the other fields over the whole
      sequence), equal to the unsharded call. Causal, window, ``score_mod`` and
      ``mask_mod`` act on global positions; no ``bias`` / ``mask`` arrays,
      ``return_residual`` or ragged lengths.
    context_strategy: ``"ring"`` (keys/values travel around the devices, the
      normaliser's online state stays; O(T / P) memory; block-wise kernel),
      ``"all_gather"`` (keys/values gathered; with ``return_stats`` the block-wise
      kernel, statistics over every device's rows) or
      ``"all_to_all"`` (Ulysses: heads <-> sequence, any ``implementation``; needs
      ``N`` divisible by the axis size), or None: the op chooses (the ring for None or
      ``"blockwise"``, else all-to-all where the axis divides the heads, else all-gather).
    context_layout: ``"contiguous"`` (None; shard ``p`` holds tokens ``p * T / P ..``)
      or ``"zigzag"`` (shard ``p`` holds chunks ``p`` and ``2P - 1 - p`` of ``2P``:
      equal causal work per device; :func:`attnjax.parallel.zigzag` orders tokens so).

  Returns:
    ``[B, T, N, Hv]`` in the input dtype, ``(out, AttentionStats)`` or
    ``(out, residual)``. Logits and normaliser are float32; a query row with
    no allowed key is zero (jax.nn gives such a row the mean of all values,
    except past ``query_seq_lengths``, where it is zero too).
  """
  dense_keywords = options.forwarded(options.KEYWORDS, locals())
  if context_axis is not None and (
    return_residual or query_seq_lengths is not None or key_value_seq_lengths is not None
  ):
    raise ValueError(
      f"context_axis={context_axis!r} takes no return_residual, "
      f"query_seq_lengths or key_value_seq_lengths (they describe one device's "
      f"whole sequence); pass segment ids, and return_stats for the logsumexp"
    )
  if local_window_size is not None:  # jax.nn's arguments, where given
    dense_keywords["window"] = jax_nn_compat.window_of(local_window_size, window)
  if query_seq_lengths is not None or key_value_seq_lengths is not None:
    dense_keywords = jax_nn_compat.ragged(
      query, key, query_seq_lengths, key_value_seq_lengths, dense_keywords
    )
  if return_residual and return_stats:
    raise ValueError(
      "return_residual=True and return_stats=True: pass one (the residual is "
      "stats.logsumexp, transposed to [B, T, N])"
    )
  inputs, opts = prepare(query, key, value, implementation=implementation, **dense_keywords)
  if not return_residual:
    return op.run(OP, (inputs, opts), implementation)
  jax_nn_compat.check_residual(
    inputs,
    opts,
    implementation,
    None if implementation is None else ENGINES[implementation].unsupported,
  )
  out, stats = run(inputs, jax_nn_compat.residual_options(opts), implementation)
  return out, jax_nn_compat.residual(inputs, stats)


DENSE_STATIC = options.STATIC_NAMES + ("implementation", "local_window_size", "return_residual")
dot_product_attention = static.jit(_dot_product_attention, DENSE_STATIC)
