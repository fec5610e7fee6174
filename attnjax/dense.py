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
import inspect
from typing import Any, Callable, Literal, Optional

import jax
import jax.numpy as jnp

from attnjax import _call, _checks, _platform, blockwise, masks, normalizers, pallas_gpu
from attnjax.attention_stats import stats_from_weights

Array = jnp.ndarray

Similarity = _call.Similarity
# The names of IMPLEMENTATIONS below, for signatures (a test keeps the two equal).
ImplementationName = Literal["reference", "blockwise", "xla", "cudnn", "splash", "pallas_gpu"]
# The canonical call lives in attnjax._call so that kernels (blockwise) can take it without
# importing this module, which imports them for its registry.
SIMILARITIES = _call.SIMILARITIES
DenseOptions = _call.DenseOptions
DenseInputs = _call.DenseInputs


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


def rows_with_keys(inputs: DenseInputs, opts: DenseOptions, T: int, S: int) -> Optional[Array]:
  """``[B|1, N|1, T]`` True where a query row has at least one allowed key; None if all do."""
  structure_can_empty = (inputs.mask is not None or inputs.q_segment_ids is not None
                         or (opts.window is not None and T > S))
  if not structure_can_empty:
    return None
  full = masks.make_attention_mask(
      T, S, mask=inputs.mask, is_causal=opts.is_causal, window=opts.window,
      q_segment_ids=inputs.q_segment_ids, kv_segment_ids=inputs.kv_segment_ids)
  return jnp.any(full, axis=-1)


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
  grid = _call.index_grid(B, N, T, S)
  if positions is not None:
    grid = (grid[0], grid[1], jnp.reshape(positions[0].astype(jnp.int32), (1, 1, T, 1)),
            jnp.reshape(positions[1].astype(jnp.int32), (1, 1, 1, S)))
  z = _call.apply_score_mod(opts, inputs.score_mod_args, z, *grid)
  allowed = masks.make_attention_mask(
      T, S, mask=inputs.mask, is_causal=opts.is_causal, window=opts.window,
      q_segment_ids=inputs.q_segment_ids, kv_segment_ids=inputs.kv_segment_ids)
  allowed = masks.combine_masks(allowed,
                                _call.apply_mask_mod(opts, inputs.mask_mod_args, *grid))
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


def _platform_unsupported(inputs: DenseInputs, opts: DenseOptions) -> list[str]:
  reasons = []
  if not normalizers.REGISTRY[opts.normalizer].platform_kernel:
    reasons.append(f"normalizer={opts.normalizer!r}")
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
    reasons.append(f"a value head dim ({inputs.v.shape[-1]}) unlike the query's ({inputs.q.shape[-1]})")
  return reasons


def _jax_nn(inputs: DenseInputs, opts: DenseOptions, *, implementation: str):
  q, k, v = inputs.q, inputs.k, inputs.v
  T, S = q.shape[1], k.shape[1]
  mask = masks.combine_masks(
      inputs.mask,
      None if inputs.q_segment_ids is None else
      masks.segment_mask(inputs.q_segment_ids, inputs.kv_segment_ids))
  bias = None if inputs.bias is None else inputs.bias.astype(q.dtype)
  out = jax.nn.dot_product_attention(
      q, k, v, bias=bias, mask=mask, scale=opts.scale, is_causal=opts.is_causal,
      local_window_size=opts.window, implementation=implementation)
  # jax.nn gives a row with no allowed key the mean of all values; ours is zero.
  has_key = rows_with_keys(inputs, opts, T, S)
  if has_key is not None:
    keep = jnp.transpose(has_key, (0, 2, 1))[..., None]  # [B|1, T, N|1, 1]
    out = jnp.where(keep, out, jnp.zeros((), out.dtype))
  return out


def xla(inputs: DenseInputs, opts: DenseOptions):
  """``jax.nn.dot_product_attention(implementation="xla")`` for the options it supports."""
  return _jax_nn(inputs, opts, implementation="xla")


def cudnn(inputs: DenseInputs, opts: DenseOptions):
  """``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU, fp16/bf16).

  Lowers for ``cuda`` only; lowering for another platform raises ``ValueError``.
  """
  return _platform.on_platform(
      "cuda", lambda: _jax_nn(inputs, opts, implementation="cudnn"),
      "implementation='cudnn' runs on a CUDA GPU only (jax's cuDNN call); use "
      "implementation=None to pick per platform")


@dataclasses.dataclass(frozen=True)
class Implementation:
  fn: Callable[[DenseInputs, DenseOptions], Any]
  # Returns the reasons this path cannot honour the call ([] = supported).
  unsupported: Callable[[DenseInputs, DenseOptions], list[str]]


# The DenseOptions / DenseInputs fields the platform kernels (cuDNN, splash) are written for;
# any other field set away from its default is reported (see _platform.unknown_options).
PLATFORM_KNOWN_OPTIONS = _platform.KERNEL_OPTIONS
PLATFORM_KNOWN_INPUTS = ("q", "k", "v", "bias", "mask", "sink_logits", "q_segment_ids",
                         "kv_segment_ids")


def _cudnn_unsupported(inputs: DenseInputs, opts: DenseOptions) -> list[str]:
  """Reasons jax's cuDNN attention cannot run a call ([] = supported), on any host.

  The platform is not one of them (the call is a ``cuda`` branch chosen when
  the program is lowered), but the host is: jax's wrapper reads the local
  cuDNN library's version while it traces, so the program can hold the cuDNN
  call wherever that library is installed (a GPU machine, or a CPU host with
  ``attnjax[aot]`` compiling for a GPU), and nowhere else.
  """
  reasons = _platform_unsupported(inputs, opts)
  reasons += [r for r in _platform.unknown_options(
      opts, inputs, PLATFORM_KNOWN_OPTIONS, PLATFORM_KNOWN_INPUTS, "cudnn") if r not in reasons]
  if _platform.cudnn_version() is None:
    reasons.append("this host (jax's cuDNN wrapper reads the local cuDNN library while tracing, "
                   "and none is installed: pip install 'attnjax[aot]' or use a GPU machine)")
  if inputs.q.dtype not in (jnp.bfloat16, jnp.float16):
    reasons.append(f"dtype {inputs.q.dtype} (cuDNN takes bfloat16 or float16)")
  H = inputs.q.shape[-1]
  # jax's wrapper allows head dims above 128 only when the tracing host's GPU is a Hopper.
  h_max = 256 if (_platform.local_gpu_major() or 0) >= 9 else 128
  if H % 8 or H > h_max:
    reasons.append(f"head dim {H} (jax's cuDNN wrapper takes multiples of 8 up to {h_max} "
                   "on this host)")
  return reasons


# ---------------------------------------------------------------------------
# Splash attention (Pallas, TPU).

# Block lengths tried for the splash kernel, largest first; T and S must each be a multiple of
# the smallest (the kernel computes key blocks of whole 128-lane vregs, and its fused backward
# puts query blocks in lanes too).
SPLASH_BLOCKS = (512, 256, 128)
SPLASH_DTYPES = (jnp.float32, jnp.bfloat16)


def _splash_lib():
  """The ``splash_attention`` package of the installed jax, or None where it cannot be imported."""
  try:
    from jax.experimental.pallas.ops.tpu import splash_attention
  except ImportError:
    return None
  return splash_attention


def _splash_takes_sinks() -> bool:
  """Whether the installed splash kernel takes per-head sink logits (newer jax)."""
  try:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  except ImportError:
    return False
  fn = getattr(sk, "_splash_attention", None)
  return fn is not None and "sinks" in inspect.signature(fn).parameters


def splash_block(length: int) -> Optional[int]:
  """The largest of :data:`SPLASH_BLOCKS` that divides ``length``, or None."""
  for b in SPLASH_BLOCKS:
    if length % b == 0:
      return b
  return None


def splash_mask(T: int, S: int, num_heads: int, *, is_causal: bool,
                window: Optional[tuple[int, int]]):
  """The splash ``MultiHeadMask`` ``[N, T, S]`` allowing exactly :func:`masks.structural_mask`.

  Splash's ``CausalMask`` (``q >= k``) and ``LocalMask`` (``q - left <= k <= q + right``) at
  ``offset=0`` are top-left aligned like ours. Causal AND window ``(left, right)`` is the
  one-sided window ``(left, 0)`` (``right >= 0`` adds nothing once ``k <= q``), so a masked
  call is one computable mask that the kernel evaluates in-register on partial blocks (and
  an unmasked one a ``FullMask``). One mask object serves every head, so the kernel keeps
  one copy of its block structure.
  """
  lib = _splash_lib()
  if window is not None:
    left, right = window
    head = lib.LocalMask((T, S), window_size=(left, 0 if is_causal else right), offset=0)
  elif is_causal:
    head = lib.CausalMask((T, S), offset=0)
  else:
    head = lib.FullMask((T, S))
  return lib.MultiHeadMask([head] * num_heads)


@functools.lru_cache(maxsize=32)
def _splash_kernel(T: int, S: int, N: int, is_causal: bool, window: Optional[tuple[int, int]],
                   softcap: Optional[float], interpret: bool):
  """Builds (once per static configuration) the splash kernel for ``[N, T, H]`` queries."""
  lib = _splash_lib()
  bq, bkv = splash_block(T), splash_block(S)
  block_sizes = lib.BlockSizes(
      block_q=bq, block_kv=bkv, block_kv_compute=bkv,
      block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
      use_fused_bwd_kernel=True)
  # The kernel holds its block structure as arrays: make them concrete constants even when
  # first built inside a trace, so the cached kernel never holds a tracer (computed on this
  # host, also when the program is traced for a mesh of compile-only devices).
  with _platform.host_eval():
    return lib.make_splash_mha(
        splash_mask(T, S, N, is_causal=is_causal, window=window), block_sizes=block_sizes,
        attn_logits_soft_cap=softcap, head_shards=1, q_seq_shards=1, interpret=interpret)


def _splash_unsupported(inputs: DenseInputs, opts: DenseOptions, *,
                        interpret: bool = False) -> list[str]:
  """Reasons splash cannot run a call ([] = supported), on any host.

  The platform is not one of them: splash traces anywhere and lowers for
  ``tpu`` from any host (``jax.export(..., platforms=["tpu"])``); lowering it
  for another platform raises (see :func:`splash`).
  """
  reasons = []
  if _splash_lib() is None:
    reasons.append("this jax (jax.experimental.pallas.ops.tpu.splash_attention does not import)")
    return reasons
  if not normalizers.REGISTRY[opts.normalizer].platform_kernel:
    reasons.append(f"normalizer={opts.normalizer!r} (splash is a softmax kernel)")
  if inputs.sink_logits is not None and not _splash_takes_sinks():
    reasons.append("sink_logits (this jax's splash kernel has no sinks argument)")
  if opts.similarity != "dot":
    reasons.append(f"similarity={opts.similarity!r}")
  if inputs.bias is not None:
    reasons.append("bias (splash adds no bias to the logits)")
  if inputs.mask is not None:
    reasons.append("an explicit mask array (splash masks are static; use is_causal, window "
                   "and segment_ids)")
  if opts.return_stats:
    reasons.append("return_stats=True (splash returns no weights)")
  T, S = inputs.q.shape[1], inputs.k.shape[1]
  if splash_block(T) is None or splash_block(S) is None:
    reasons.append(f"lengths T={T}, S={S} (splash needs multiples of {SPLASH_BLOCKS[-1]})")
  if inputs.q.dtype not in SPLASH_DTYPES:
    reasons.append(f"dtype {inputs.q.dtype} (splash takes float32 or bfloat16)")
  reasons += _platform.unknown_options(opts, inputs, PLATFORM_KNOWN_OPTIONS,
                                       PLATFORM_KNOWN_INPUTS, "splash")
  del interpret  # the platform is checked when the program is lowered (see splash)
  return reasons


def splash(inputs: DenseInputs, opts: DenseOptions, *, interpret: bool = False):
  """Splash attention (see :func:`_splash`); outside interpret mode it lowers for ``tpu`` only.

  Lowering for another platform raises ``ValueError`` ("splash needs a TPU").
  """
  reasons = _splash_unsupported(inputs, opts, interpret=interpret)
  if reasons:
    raise ValueError("implementation='splash' does not support " + "; ".join(reasons))
  if interpret:
    return _splash(inputs, opts, interpret=True)
  return _platform.on_platform(
      "tpu", lambda: _splash(inputs, opts),
      "implementation='splash' runs on a TPU only (splash needs a TPU); use implementation=None "
      "to pick per platform")


@jax.custom_vjp
def _f32_cotangent(x: Array) -> Array:
  """The identity on float32 ``x``, whose cotangent is cast to float32.

  The splash kernel returns its sinks' cotangent in the output dtype (bfloat16
  for bfloat16 calls) for float32 sinks; under ``platform_dependent`` the
  branches' cotangent types must agree, so it is cast back here.
  """
  return x


_f32_cotangent.defvjp(lambda x: (x, None), lambda _, g: (g.astype(jnp.float32),))


def _splash(inputs: DenseInputs, opts: DenseOptions, *, interpret: bool = False):
  """``jax.experimental.pallas.ops.tpu.splash_attention`` (TPU, softmax, static masks).

  The kernel takes one batch element ``q [N, T, H]``, ``k, v [K, S, H]`` (query head ``n``
  reads kv head ``n // (N // K)``, as ours) and is mapped over the batch. It does not scale
  the logits, so ``opts.scale`` is folded into ``q`` (in the input dtype); its soft cap is
  ``c * tanh(z / c)`` on those scaled logits, and its sinks are our ``sink_logits``.

  Args:
    inputs: canonical arrays (no bias, no explicit mask; see :func:`_splash_unsupported`).
    opts: static options.
    interpret: run the Pallas kernel in interpret mode (any backend; for tests on the CPU).

  Returns:
    ``[B, T, N, Hv]`` in the input dtype; a query row with no allowed key is zero.
  """
  lib = _splash_lib()
  q, k, v = inputs.q, inputs.k, inputs.v
  B, T, N, _ = q.shape
  S = k.shape[1]
  kernel = _splash_kernel(T, S, N, opts.is_causal, opts.window, opts.softcap, interpret)
  # Scale in float32, then one rounding to the input dtype (a bf16 scale would be rounded too).
  qh = jnp.transpose((q.astype(jnp.float32) * opts.scale).astype(q.dtype), (0, 2, 1, 3))
  kh = jnp.transpose(k, (0, 2, 1, 3))  # [B, K, S, H]
  vh = jnp.transpose(v, (0, 2, 1, 3))
  sinks = None if inputs.sink_logits is None else jnp.reshape(inputs.sink_logits, (N,))
  seg = None
  if inputs.q_segment_ids is not None:
    seg = lib.SegmentIds(q=inputs.q_segment_ids.astype(jnp.int32),
                         kv=inputs.kv_segment_ids.astype(jnp.int32))

  def one(q1, k1, v1, seg1):
    if sinks is None:
      return kernel(q1, k1, v1, segment_ids=seg1)
    return kernel(q1, k1, v1, segment_ids=seg1, sinks=_f32_cotangent(sinks.astype(jnp.float32)))

  out = jax.vmap(one)(qh, kh, vh, seg)  # [B, N, T, Hv]
  out = jnp.transpose(out, (0, 2, 1, 3)).astype(q.dtype)
  # Splash gives a row with no allowed key the mean of the values it visited (or NaN where it
  # visited no block); ours is zero.
  has_key = rows_with_keys(inputs, opts, T, S)
  if has_key is not None:
    keep = jnp.transpose(has_key, (0, 2, 1))[..., None]  # [B|1, T, N|1, 1]
    out = jnp.where(keep, out, jnp.zeros((), out.dtype))
  return out


def pallas_gpu_attention(inputs: DenseInputs, opts: DenseOptions, *, interpret: bool = False,
                         block_sizes: Optional[pallas_gpu.BlockSizes] = None):
  """:mod:`attnjax.pallas_gpu` (Triton); outside interpret mode it lowers for ``cuda`` only.

  Args:
    inputs: canonical arrays (no bias or mask array; see :func:`pallas_gpu.unsupported`).
    opts: static options.
    interpret: run the kernels in Pallas interpret mode (any backend; for tests on the CPU).
    block_sizes: tiles and launch parameters (None: :func:`pallas_gpu.block_sizes_for` the
      target).
  """
  reasons = pallas_gpu.unsupported(inputs, opts)
  if reasons:
    raise ValueError("implementation='pallas_gpu' does not support " + "; ".join(reasons))
  if interpret:
    return pallas_gpu.attention(inputs, opts, block_sizes=block_sizes, interpret=True)
  return _platform.on_platform(
      "cuda", lambda: pallas_gpu.attention(inputs, opts, block_sizes=block_sizes),
      "implementation='pallas_gpu' runs on a CUDA GPU only (a Triton kernel); use "
      "implementation=None to pick per platform")


IMPLEMENTATIONS: dict[str, Implementation] = {
    "reference": Implementation(reference, lambda i, o: []),
    "blockwise": Implementation(blockwise.blockwise, blockwise.unsupported),
    "xla": Implementation(xla, _platform_unsupported),
    "cudnn": Implementation(cudnn, _cudnn_unsupported),
    "splash": Implementation(splash, _splash_unsupported),
    "pallas_gpu": Implementation(pallas_gpu_attention, pallas_gpu.unsupported),
}

# The function each platform branch runs for an implementation name: the platform kernels
# without their wrong-platform guard (the branch is the guard).
_BRANCH_FNS: dict[str, Callable[[DenseInputs, DenseOptions], Any]] = {
    "cudnn": lambda i, o: _jax_nn(i, o, implementation="cudnn"),
    "splash": lambda i, o: _splash(i, o),
    "pallas_gpu": lambda i, o: pallas_gpu.attention(i, o),
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
  while tracing: a GPU machine, or a CPU host with ``attnjax[aot]``); else ``"pallas_gpu"`` when it supports the call (no bias/mask arrays, dot
  similarity); else as the CPU.
  tpu: ``"splash"`` when it supports every option (softmax, no bias or mask
  array, T and S multiples of 128, fp32/bf16); else as the CPU.
  Platform kernels run inside ``shard_map`` when the ambient mesh
  (``jax.set_mesh``) has several devices (:func:`attnjax._platform.per_shard`),
  so the choice never depends on the device count.
  cpu (and the fallbacks): ``"blockwise"`` once ``max(T, S) >=
  BLOCKWISE_MIN_LENGTH_CPU``, else ``"reference"``.
  """
  platform = _platform.current_platform() if platform is None else platform
  if platform == "cuda":
    if not _cudnn_unsupported(inputs, opts):
      return "cudnn"
    if not pallas_gpu.unsupported(inputs, opts):
      return "pallas_gpu"
  if platform == "tpu" and not _splash_unsupported(inputs, opts):
    return "splash"
  return _by_length(inputs, opts)


def dispatch_table(inputs: DenseInputs, opts: DenseOptions) -> dict[str, str]:
  """``{platform: implementation}`` that ``implementation=None`` lowers for each of
  :data:`attnjax._platform.PLATFORMS` (other platforms take the ``"cpu"`` choice)."""
  return {p: select_implementation(inputs, opts, p) for p in _platform.PLATFORMS}


# Custom calls XLA cannot partition: under a multi-device mesh they run inside shard_map.
_PER_SHARD = ("cudnn", "splash", "pallas_gpu")


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
  TPU kernel.
  """
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


# ---------------------------------------------------------------------------
# Public function.


def prepare(q, k, v, *, bias=None, mask=None, is_causal=False, scale=None,
            normalizer="softmax", sink_logits=None, softcap=None, window=None,
            segment_ids=None, similarity: Similarity = "dot",
            implementation: Optional[ImplementationName] = None,
            return_stats=False, score_mod=None, score_mod_args=None, mask_mod=None,
            mask_mod_args=None, block_layout=None) -> tuple[DenseInputs, DenseOptions]:
  """Validates a dense call and returns its canonical inputs and options."""
  inputs, opts = _call.validate(
      q, k, v, bias=bias, mask=mask, is_causal=is_causal, scale=scale, normalizer=normalizer,
      sink_logits=sink_logits, softcap=softcap, window=window, segment_ids=segment_ids,
      similarity=similarity, return_stats=return_stats, score_mod=score_mod,
      score_mod_args=score_mod_args, mask_mod=mask_mod, mask_mod_args=mask_mod_args,
      block_layout=block_layout)
  _checks.check_implementation("implementation", implementation, tuple(IMPLEMENTATIONS))
  return inputs, opts


def _dot_product_attention(
    q: Array,
    k: Array,
    v: Array,
    *,
    bias: Optional[Array] = None,
    mask: Optional[Array] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    normalizer: str = "softmax",
    sink_logits: Optional[Array] = None,
    softcap: Optional[float] = None,
    window: Optional[tuple[int, int]] = None,
    segment_ids: Any = None,
    similarity: Similarity = "dot",
    implementation: Optional[ImplementationName] = None,
    return_stats: bool = False,
    score_mod: Optional[Callable[..., Any]] = None,
    score_mod_args: Any = None,
    mask_mod: Optional[Callable[..., Any]] = None,
    mask_mod_args: Any = None,
    block_layout: Any = None,
):
  """Scaled dot-product attention with a choice of normaliser.

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, S, K, H]``; ``N % K == 0`` (GQA/MQA: query head ``n`` reads
      key/value head ``n // (N // K)``).
    v: values ``[B, S, K, Hv]``.
    bias: float, added to the logits; broadcastable to ``[B, N, T, S]``.
    mask: bool, True = may attend; broadcastable to ``[B, N, T, S]``.
    is_causal: query ``i`` sees keys ``j <= i`` (top-left aligned, as jax.nn).
    scale: logit scale; None means ``H ** -0.5``.
    normalizer: a name in :data:`attnjax.normalizers.NORMALIZERS` (``"softmax"``,
      ``"softmax_one"``, ``"sigmoid"``, ``"softpick"``, ``"none"``, ...; see the
      table in :mod:`attnjax.normalizers`).
    sink_logits: ``[N]`` learned per-head logit of a null key that takes
      softmax mass and is dropped (gpt-oss); softmax only.
    softcap: ``c`` for ``c * tanh(z / c)`` logit capping (Gemma 2), applied to
      the scaled similarity before ``bias``.
    window: ``(left, right)``: query ``i`` sees keys ``i - left .. i + right``.
    segment_ids: ``[B, T]`` ids when ``T == S``, or a pair ``([B, T], [B, S])``;
      queries attend only within their segment (packed sequences).
    similarity: ``"dot"`` or ``"neg_sq_euclidean"`` (``-||q - k||^2``, for the
      seed claim that distance scores give near-uniform weights).
    implementation: None (auto, see :func:`select_implementation`),
      ``"reference"``, ``"blockwise"`` (:mod:`attnjax.blockwise`: online
      normaliser over key blocks, O(T) memory, masked blocks skipped), or
      ``"xla"`` / ``"cudnn"`` (``jax.nn.dot_product_attention``), or
      ``"splash"`` (the Pallas TPU splash-attention kernel: softmax with
      causal/window/segment masks, softcap, sink logits, GQA; T and S
      multiples of 128), or ``"pallas_gpu"`` (:mod:`attnjax.pallas_gpu`, a
      Pallas Triton kernel for every normaliser, no bias/mask arrays). Named
      paths raise if an option is unsupported; None is chosen per platform
      when the program is lowered (:func:`dispatch_table`).
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

  Returns:
    ``[B, T, N, Hv]`` in the input dtype, or ``(out, AttentionStats)``.
    Logits and normaliser are float32; a query row with no allowed key is zero.
  """
  inputs, opts = prepare(
      q, k, v, bias=bias, mask=mask, is_causal=is_causal, scale=scale,
      normalizer=normalizer, sink_logits=sink_logits, softcap=softcap, window=window,
      segment_ids=segment_ids, similarity=similarity, implementation=implementation,
      return_stats=return_stats, score_mod=score_mod, score_mod_args=score_mod_args,
      mask_mod=mask_mod, mask_mod_args=mask_mod_args, block_layout=block_layout)
  return run(inputs, opts, implementation)


DENSE_STATIC = ("is_causal", "scale", "normalizer", "softcap", "window", "similarity",
                "implementation", "return_stats", "score_mod", "mask_mod", "block_layout")

dot_product_attention = jax.jit(_dot_product_attention, static_argnames=DENSE_STATIC)
dot_product_attention.__doc__ = _dot_product_attention.__doc__
