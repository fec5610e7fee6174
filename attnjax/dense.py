"""Dense scaled dot-product attention with every normaliser, and its dispatch.

``dot_product_attention`` validates its arguments once, puts the static choices
in a :class:`DenseOptions`, and hands the arrays to one implementation from
``IMPLEMENTATIONS`` (with ``implementation=None``, one per platform, chosen when
the program is lowered: :func:`run`). Every implementation takes the same canonical arguments,
so the fast paths (block-wise, platform kernels) plug in beside the readable
``reference`` below and are tested against it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Literal, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from attnjax import _checks, masks, normalizers, options, parallel, _platform
from attnjax.kernels import blockwise, jax_nn, mosaic_gpu, pallas_gpu, pallas_tpu, splash
from attnjax.attention_stats import stats_from_weights

Array = jnp.ndarray

Similarity = options.Similarity
# The names of IMPLEMENTATIONS below, for signatures (a test keeps the two equal).
ImplementationName = Literal["reference", "blockwise", "xla", "cudnn", "splash", "pallas_gpu",
                             "pallas_tpu", "mosaic_gpu"]
# The canonical call lives in attnjax.options so that kernels (blockwise) can take it without
# importing this module, which imports them for its registry.
SIMILARITIES = options.SIMILARITIES
DenseOptions = options.DenseOptions
DenseInputs = options.DenseInputs


# ---------------------------------------------------------------------------
# Pieces shared by every dense path.


def group_queries(q: Array, num_kv_heads: int) -> Array:
  """``[B, T, N, H] -> [B, T, K, G, H]``: query head ``n`` uses kv head ``n // G`` (as jax.nn)."""
  B, T, N, H = q.shape
  return jnp.reshape(q, (B, T, num_kv_heads, N // num_kv_heads, H))


def scores(q: Array, k: Array, *, scale: float, similarity: str = "dot",
           softcap: Optional[float] = None) -> Array:
  """Float32 logits ``[B, K, G, T, S]`` from grouped ``q`` ``[B, T, K, G, H]`` and ``k`` ``[B, S, K, H]``.

  ``similarity="dot"``: ``scale * <q_i, k_j>``; ``"neg_sq_euclidean"``:
  ``-scale * ||q_i - k_j||^2``. ``softcap`` then applies ``c * tanh(z / c)``
  (Gemma 2) to the similarity, before any bias is added.
  """
  q32 = q.astype(jnp.float32)
  k32 = k.astype(jnp.float32)
  dots = jnp.einsum("btkgh,bskh->bkgts", q32, k32, preferred_element_type=jnp.float32)
  if similarity == "dot":
    z = dots * scale
  else:
    q_sq = jnp.einsum("btkgh,btkgh->bkgt", q32, q32)[..., None]
    k_sq = jnp.einsum("bskh,bskh->bks", k32, k32)[:, :, None, None, :]
    z = -scale * (q_sq - 2.0 * dots + k_sq)
  if softcap is not None:
    z = softcap * jnp.tanh(z / softcap)
  return z


# ---------------------------------------------------------------------------
# Implementations.


def reference(inputs: DenseInputs, opts: DenseOptions, *, positions=None):
  """Materialises the ``[B, N, T, S]`` logits and weights; obviously correct.

  Order on the float32 logits: ``scale`` (and similarity), ``softcap``,
  ``bias``, then ``score_mod``; ``mask_mod`` joins every other mask; then the
  normaliser. ``positions``: None, or int ``(q_positions [T], k_positions [S])``,
  the positions the modifiers see (a subset of rows of a longer call).
  """
  q, k, v = inputs.q, inputs.k, inputs.v
  B, T, N, H = q.shape
  _, S, K, Hv = v.shape
  z = scores(group_queries(q, K), k, scale=opts.scale, similarity=opts.similarity,
             softcap=opts.softcap)
  z = jnp.reshape(z, (B, N, T, S))
  if inputs.bias is not None:
    z = z + inputs.bias.astype(jnp.float32)
  grid = options.index_grid(B, N, T, S)
  if positions is not None:
    grid = (grid[0], grid[1], jnp.reshape(positions[0].astype(jnp.int32), (1, 1, T, 1)),
            jnp.reshape(positions[1].astype(jnp.int32), (1, 1, 1, S)))
  z = options.apply_score_mod(opts, inputs.score_mod_args, z, *grid)
  allowed = masks.make_attention_mask(
      T, S, mask=inputs.mask, is_causal=opts.is_causal, window=opts.window,
      q_segment_ids=inputs.q_segment_ids, kv_segment_ids=inputs.kv_segment_ids)
  allowed = masks.combine_masks(allowed,
                                options.apply_mask_mod(opts, inputs.mask_mod_args, *grid))
  if allowed is None:
    allowed = jnp.ones((1, 1, 1, 1), bool)
  sink = None if inputs.sink_logits is None else inputs.sink_logits.astype(jnp.float32)
  w, log_norm = normalizers.normalize(z, allowed, normalizer=opts.normalizer, sink_logits=sink)
  w_grouped = jnp.reshape(w, (B, K, N // K, T, S))
  out = jnp.einsum("bkgts,bskh->btkgh", w_grouped, v.astype(jnp.float32))
  out = jnp.reshape(out, (B, T, N, Hv)).astype(q.dtype)
  if not opts.return_stats:
    return out
  return out, stats_from_weights(z, w, allowed, log_norm)


@dataclasses.dataclass(frozen=True)
class Implementation:
  fn: Callable[[DenseInputs, DenseOptions], Any]
  # Returns the reasons this path cannot honour the call ([] = supported).
  unsupported: Callable[[DenseInputs, DenseOptions], list[str]]


IMPLEMENTATIONS: dict[str, Implementation] = {
    "reference": Implementation(reference, lambda i, o: []),
    "blockwise": Implementation(blockwise.run, blockwise.unsupported),
    "xla": Implementation(jax_nn.xla, jax_nn.unsupported),
    "cudnn": Implementation(jax_nn.cudnn, jax_nn.cudnn_unsupported),
    "splash": Implementation(splash.run, splash.unsupported),
    "pallas_gpu": Implementation(pallas_gpu.run, pallas_gpu.unsupported),
    "pallas_tpu": Implementation(pallas_tpu.run, pallas_tpu.unsupported),
    # explicit choice only: auto-dispatch does not pick it (select_implementation)
    "mosaic_gpu": Implementation(mosaic_gpu.run, mosaic_gpu.unsupported),
}

# The function each platform branch runs for an implementation name: the platform kernels
# without their wrong-platform guard (the branch is the guard).
_BRANCH_FNS: dict[str, Callable[[DenseInputs, DenseOptions], Any]] = {
    "cudnn": lambda i, o: jax_nn.compute(i, o, implementation="cudnn"),
    "splash": lambda i, o: splash.compute(i, o),
    "pallas_gpu": lambda i, o: pallas_gpu.compute(i, o),
    "pallas_tpu": lambda i, o: pallas_tpu.compute(i, o),
}


# Auto-dispatch uses the block-wise path on the CPU from this sequence length on (the longer of
# T and S). Measured with `experiments/bench.py --suite dense --sizes 256,512,1024,2048` (causal
# forward, B=1, N=8, H=64, fp32): block-wise / reference = 0.53x at 256, 0.76x at 512, 0.21x at
# 1024, 0.12x at 2048. Shorter calls keep the reference (less to compile, nothing to skip).
BLOCKWISE_MIN_LENGTH_CPU = 256


def _by_length(inputs: DenseInputs, opts: DenseOptions) -> str:
  length = max(inputs.q.shape[1], inputs.k.shape[1])
  if length >= BLOCKWISE_MIN_LENGTH_CPU and not blockwise.unsupported(inputs, opts):
    return "blockwise"
  return "reference"


def select_implementation(inputs: DenseInputs, opts: DenseOptions,
                          platform: Optional[str] = None) -> str:
  """Auto-dispatch on one platform: the fastest path that honours every option asked for.

  ``platform`` is a ``jax.lax.platform_dependent`` key (``"cpu"``, ``"cuda"``,
  ``"tpu"``); None means the default backend's.

  cuda: ``"cudnn"`` when it supports every option and the dtype (bf16/fp16)
  and this host has the cuDNN library (jax's cuDNN wrapper reads its version
  while tracing: a GPU machine, or a CPU host with ``attnjax[aot]``); else, on
  a Hopper (compute capability 9: :func:`attnjax._platform.cuda_major`, the
  ambient mesh's device kind or this process's GPU), ``"mosaic_gpu"`` when it
  supports the call (bf16/fp16, head dims 64/128/256, no modifiers or
  bias/mask arrays); else ``"pallas_gpu"`` when it supports the call (no
  bias/mask arrays, dot similarity); else as the CPU. ``mosaic_gpu``'s
  warpgroup MMAs are sm_90 instructions, so other majors (Ampere, Blackwell)
  and an unknown GPU take ``pallas_gpu``.
  tpu: ``"splash"`` when it supports every option (softmax, no bias or mask
  array, T and S multiples of 128, fp32/bf16); else ``"pallas_tpu"`` when it
  supports the call (every normaliser, statistics, any lengths; no bias/mask
  arrays, argument-free modifiers); else as the CPU.
  Platform kernels run inside ``shard_map`` when the ambient mesh
  (``jax.set_mesh``) has several devices (:func:`attnjax._platform.per_shard`),
  so the choice never depends on the device count.
  cpu (and the fallbacks): ``"blockwise"`` once ``max(T, S) >=
  BLOCKWISE_MIN_LENGTH_CPU``, else ``"reference"``.
  """
  platform = _platform.current_platform() if platform is None else platform
  if platform == "cuda":
    if not jax_nn.cudnn_unsupported(inputs, opts):
      return "cudnn"
    if _platform.cuda_major() == 9 and not mosaic_gpu.unsupported(inputs, opts):
      return "mosaic_gpu"
    if not pallas_gpu.unsupported(inputs, opts):
      return "pallas_gpu"
  if platform == "tpu":
    if not splash.unsupported(inputs, opts):
      return "splash"
    if not pallas_tpu.unsupported(inputs, opts):
      return "pallas_tpu"
  return _by_length(inputs, opts)


def dispatch_table(inputs: DenseInputs, opts: DenseOptions) -> dict[str, str]:
  """``{platform: implementation}`` that ``implementation=None`` lowers for each of
  :data:`attnjax._platform.PLATFORMS` (other platforms take the ``"cpu"`` choice)."""
  return {p: select_implementation(inputs, opts, p) for p in _platform.PLATFORMS}


# Custom calls XLA cannot partition: under a multi-device mesh they run inside shard_map.
_PER_SHARD = ("cudnn", "splash", "pallas_gpu", "pallas_tpu", "mosaic_gpu")


def _run_named(name: str, inputs: DenseInputs, opts: DenseOptions, branch: bool = False):
  impl = IMPLEMENTATIONS[name]
  reasons = impl.unsupported(inputs, opts)
  if reasons:
    raise ValueError(
        f"implementation={name!r} does not support " + "; ".join(reasons)
        + ". Use implementation='reference' or None (auto).")
  fn = _BRANCH_FNS[name] if branch and name in _BRANCH_FNS else impl.fn
  if name in _PER_SHARD:
    return _platform.per_shard(lambda i: fn(i, opts), inputs)
  return fn(inputs, opts)


def run(inputs: DenseInputs, opts: DenseOptions, implementation: Optional[str]):
  """Runs a validated call on the named implementation, or on each platform's choice.

  ``implementation=None`` is decided when the program is lowered: the choices
  of :func:`dispatch_table` become the branches of one
  ``jax.lax.platform_dependent`` (a single branch when they agree), so a
  function exported for ``cuda`` or ``tpu`` from a CPU host carries the GPU or
  TPU kernel. With ``opts.context_axis`` the call is one device's shard of a sequence
  sharded over that ``shard_map`` axis: :func:`attnjax.parallel.attention` runs it (its
  strategies call back here for each device's own part).
  """
  if opts.context_axis is not None:
    return parallel.attention(inputs, opts, implementation, run_on_this_platform)
  if implementation is not None:
    return _run_named(implementation, inputs, opts)
  table = dispatch_table(inputs, opts)
  current = _platform.current_platform()
  if current not in table:
    table[current] = select_implementation(inputs, opts, current)
  if len(set(table.values())) == 1:
    return _run_named(table["cpu"], inputs, opts)
  branches = {p: functools.partial(_run_named, name, inputs, opts, True)
              for p, name in table.items()}
  return jax.lax.platform_dependent(
      **branches, default=functools.partial(_run_named, table["cpu"], inputs, opts, True))


def run_on_this_platform(inputs: DenseInputs, opts: DenseOptions, implementation: Optional[str]):
  """:func:`run`, with ``implementation=None`` chosen for the platform lowering now: inside a
  context-parallel ``shard_map`` only that platform's kernel is traced (another platform's
  ``pallas_call`` would have no manual-axis types there)."""
  if implementation is None:
    implementation = select_implementation(inputs, opts)
  return run(inputs, opts, implementation)


# ---------------------------------------------------------------------------
# Public function.


def prepare(q, k, v, *, implementation: Optional[ImplementationName] = None,
            **dense_keywords) -> tuple[DenseInputs, DenseOptions]:
  """Validates a dense call (``dense_keywords``: :data:`attnjax.options.KEYWORDS`) and returns
  its canonical inputs and options."""
  inputs, opts = options.validate(q, k, v, **dense_keywords)
  _checks.check_implementation("implementation", implementation, tuple(IMPLEMENTATIONS))
  return inputs, opts


# jax.nn.dot_product_attention's value for masked logits: the residual of a row with no key.
JAX_NN_MASKED_LOGIT = -0.7 * float(jnp.finfo(jnp.float32).max)


def _window_of(local_window_size: Any, window: Any) -> Any:
  """``window`` from jax.nn's ``local_window_size`` (an int ``w`` is ``(w, w)`` there)."""
  if local_window_size is None:
    return window
  if isinstance(local_window_size, (int, np.integer)) and not isinstance(local_window_size, bool):
    local = (int(local_window_size), int(local_window_size))
  elif isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2:
    local = tuple(local_window_size)
  else:
    raise TypeError(f"local_window_size must be an int or a pair (left, right) of ints, got "
                    f"{local_window_size!r}")
  local = _checks.check_window(local)
  if window is not None and _checks.check_window(window) != local:
    raise ValueError(f"local_window_size={local_window_size!r} (jax.nn's name, "
                     f"(left, right) = {local}) and window={window!r} differ; pass one")
  return local


def _lengths_ok(name: str, lengths: Any, B: int, L: int) -> Optional[Array]:
  """``[B, L]`` True at positions below ``lengths`` ``[B]``, or None."""
  if lengths is None:
    return None
  if _checks.shape_of(lengths) != (B,):
    raise ValueError(f"{name} must have shape [B] = ({B},), got {_checks.shape_of(lengths)}")
  if not jnp.issubdtype(jnp.result_type(lengths), jnp.integer):
    raise TypeError(f"{name} must be integer, got dtype {jnp.result_type(lengths)}")
  return jnp.arange(L)[None, :] < jnp.asarray(lengths)[:, None]


def _ragged(q, k, query_seq_lengths, key_value_seq_lengths, dense_keywords: dict) -> dict:
  """jax.nn's ragged lengths as segment ids (when none are given: every fast path takes
  them) or else as a mask intersected with the given one."""
  B, T, S = _checks.shape_of(q)[0], _checks.shape_of(q)[1], _checks.shape_of(k)[1]
  q_ok = _lengths_ok("query_seq_lengths", query_seq_lengths, B, T)
  kv_ok = _lengths_ok("key_value_seq_lengths", key_value_seq_lengths, B, S)
  if q_ok is None and kv_ok is None:
    return dense_keywords
  q_ok = jnp.ones((B, T), bool) if q_ok is None else q_ok
  kv_ok = jnp.ones((B, S), bool) if kv_ok is None else kv_ok
  if dense_keywords["segment_ids"] is None:
    # Queries past their length match no key id, keys past theirs no query id.
    segments = (jnp.where(q_ok, 0, 1).astype(jnp.int32), jnp.where(kv_ok, 0, 2).astype(jnp.int32))
    return {**dense_keywords, "segment_ids": segments}
  ok = jnp.logical_and(q_ok[:, None, :, None], kv_ok[:, None, None, :])
  return {**dense_keywords, "mask": masks.combine_masks(dense_keywords["mask"], ok)}


def _residual(inputs: DenseInputs, opts: DenseOptions, stats) -> Array:
  """jax.nn's residual ``[B, T, N]`` in the input dtype: the per-row log-normaliser (with a
  gradient), :data:`JAX_NN_MASKED_LOGIT` on a row with no allowed key."""
  q = inputs.q
  lse = stats.logsumexp
  has_key = options.rows_with_keys(inputs, opts, q.shape[1], inputs.k.shape[1])
  if has_key is not None:
    lse = jnp.where(has_key, lse, JAX_NN_MASKED_LOGIT)
  return jnp.swapaxes(lse, 1, 2).astype(q.dtype)


def _check_residual(inputs: DenseInputs, opts: DenseOptions, implementation: Optional[str]):
  if not normalizers.REGISTRY[opts.normalizer].softmax_like:
    raise ValueError(
        f"return_residual=True returns the softmax log-normaliser, which "
        f"normalizer={opts.normalizer!r} does not have (its weights are not exp(z - r)); "
        f"use return_stats=True for its statistics (stats.logsumexp is the plain logsumexp "
        f"of the logits)")
  if implementation is None:
    return
  impl = IMPLEMENTATIONS[implementation]
  if impl.unsupported(inputs, dataclasses.replace(opts, return_stats=False)) == [] and (
      impl.unsupported(inputs, opts)):
    raise ValueError(
        f"return_residual=True is computed by attnjax's own paths (the residual carries a "
        f"gradient there), which implementation={implementation!r} is not; use "
        f"implementation=None, 'reference' or 'blockwise'")


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
    context_strategy: options.ContextStrategy = "ring",
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
    implementation: None (auto, see :func:`select_implementation`),
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
      when the program is lowered (:func:`dispatch_table`).
    return_residual: also return jax.nn's residual ``[B, T, N]`` in the input
      dtype: the log-normaliser of each row, ``log sum_j exp(z_ij)`` (the null
      column of ``softmax_one`` / ``sink_logits`` included), so that the
      weights are ``exp(z - residual)``; on a row with no allowed key it is
      jax.nn's masked logit, ``-0.7 * float32 max``. Softmax-like
      normalisers only (others raise). Unlike jax.nn's it carries a
      gradient; it is not computed by the ``"xla"`` / ``"cudnn"`` paths.
    normalizer: a name in :data:`attnjax.normalizers.NORMALIZERS` (``"softmax"``,
      ``"softmax_one"``, ``"sigmoid"``, ``"softpick"``, ``"none"``, ...; see the
      table in :mod:`attnjax.normalizers`).
    sink_logits: ``[N]`` learned per-head logit of a null key that takes
      softmax mass and is dropped (gpt-oss); softmax only.
    softcap: ``c`` for ``c * tanh(z / c)`` logit capping (Gemma 2), applied to
      the scaled similarity before ``bias``.
    window: ``(left, right)``: query ``i`` sees keys ``i - left .. i + right``; an int
      ``w`` is ``(w, 0)`` (keys ``i - w .. i``, the convention of every family).
    segment_ids: ``[B, T]`` ids when ``T == S``, or a pair ``([B, T], [B, S])``;
      queries attend only within their segment (packed sequences).
    similarity: ``"dot"`` or ``"neg_sq_euclidean"`` (``-||q - k||^2``, for the
      seed claim that distance scores give near-uniform weights).
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
      ``N`` divisible by the axis size).
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
  if context_axis is not None and (return_residual or query_seq_lengths is not None
                                   or key_value_seq_lengths is not None):
    raise ValueError(f"context_axis={context_axis!r} takes no return_residual, "
                     f"query_seq_lengths or key_value_seq_lengths (they describe one device's "
                     f"whole sequence); pass segment ids, and return_stats for the logsumexp")
  dense_keywords["window"] = _window_of(local_window_size, window)
  dense_keywords = _ragged(query, key, query_seq_lengths, key_value_seq_lengths, dense_keywords)
  if return_residual:
    if return_stats:
      raise ValueError("return_residual=True and return_stats=True: pass one (the residual is "
                       "stats.logsumexp, transposed to [B, T, N])")
    dense_keywords["return_stats"] = True
  inputs, opts = prepare(query, key, value, implementation=implementation, **dense_keywords)
  if not return_residual:
    return run(inputs, opts, implementation)
  _check_residual(inputs, opts, implementation)
  out, stats = run(inputs, opts, implementation)
  return out, _residual(inputs, opts, stats)


DENSE_STATIC = options.STATIC_NAMES + ("implementation", "local_window_size", "return_residual")
dot_product_attention = jax.jit(_dot_product_attention, static_argnames=DENSE_STATIC)
dot_product_attention.__doc__ = _dot_product_attention.__doc__
