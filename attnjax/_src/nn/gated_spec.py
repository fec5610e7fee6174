"""Gated and delta-rule linear-attention family specs: RetNet, Mamba-2 decay, GLA, DeltaNet, KDA.

Six families of :class:`attnjax.nn.Attention` (``retnet``, ``mamba2_decay``, ``gla``,
``deltanet``, ``gated_deltanet``, ``kda``), each with the projections, short convolution, norm
and swish gate of its paper around :func:`attnjax.gated_linear_attention` or
:func:`attnjax.delta_rule_attention`. Causal self-attention only; ``segment_ids`` reset
the state and the convolution; decoding keeps a :class:`attnjax.nn.GatedCache`; under
``nnx.capture`` they sow their implied attention matrix.

Guide: docs/guides/layers.md, the families table and "The gated and delta-rule
families". Implementation behind the public module :mod:`attnjax.nn`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp

from attnjax._src import validators
from attnjax._src.ops.delta_rule import attention as delta_lib
from attnjax._src.ops.gated_linear import attention as gated_lib
from attnjax._src.attention_stats import AttentionStats, stats_from_weights
from attnjax._src.ops.qk_norm.attention import normalize_head
from attnjax._src.nn import _context, _layers
from attnjax._src.nn.caches import GatedCache
from attnjax._src.nn.spec_base import (
  AttentionSpec,
  Call,
  _rope,
  check_int,
  check_type,
  register_family,
)

Array = jnp.ndarray

OUTPUT_NORMS = ("rms", "layer")
GATE_ACTIVATIONS = {"silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}
_NORM_EPS = 1e-6
# Mamba-2's initial ranges: A in [1, 16], dt log-uniform in [1e-3, 1e-1].
_A_INIT = (1.0, 16.0)
_DT_INIT = (1e-3, 1e-1)


def short_conv(x: Array, weight: Array, tail: Array, segment_ids: Array, tail_segment_ids: Array):
  """Causal depthwise convolution that never mixes two segments.

  ``out_t = sum_{l < W} weight[l] * x_{t - l}`` over earlier inputs of the same
  segment as ``t``; inputs before ``x`` come from ``tail``.

  Args:
    x: ``[B, T, C]``.
    weight: ``[W, C]``, lag 0 first.
    tail: ``[B, W - 1, C]`` the inputs before ``x`` (zeros at the start).
    segment_ids: ``[B, T]`` int segments of ``x``.
    tail_segment_ids: ``[B, W - 1]`` segments of ``tail``.

  Returns:
    ``(out [B, T, C], new tail [B, W - 1, C], its segments [B, W - 1])``.
  """
  W, T = weight.shape[0], x.shape[1]
  xs = jnp.concatenate([tail.astype(x.dtype), x], axis=1)
  ss = jnp.concatenate([tail_segment_ids, segment_ids], axis=1)
  out = jnp.zeros(x.shape, jnp.float32)
  for lag in range(W):
    start = W - 1 - lag
    same = (ss[:, start : start + T] == segment_ids)[..., None]
    tap = jnp.reshape(weight[lag].astype(jnp.float32), (1, 1, -1))
    out = out + jnp.where(same, xs[:, start : start + T], 0) * tap
  return out.astype(x.dtype), xs[:, T:], ss[:, T:]


def _l2_normalize(x: Array) -> Array:
  return normalize_head(x, "l2", 1e-6).astype(x.dtype)


def _head_norm(out: Array, gain: Array, kind: str, eps: float = _NORM_EPS) -> Array:
  """RMS or layer norm of each head's output over its channels (a group norm of the heads)."""
  out = out.astype(jnp.float32)
  if kind == "layer":
    out = out - jnp.mean(out, axis=-1, keepdims=True)
  out = out * jax.lax.rsqrt(jnp.mean(out * out, axis=-1, keepdims=True) + eps)
  return out * jnp.reshape(gain.astype(jnp.float32), (1,) * (out.ndim - 1) + (-1,))


@dataclasses.dataclass(frozen=True)
class GatedSpec(AttentionSpec):
  """Base of the gated and delta-rule families (see the module docstring).

  Attributes:
    chunk_size: chunk length of the ``"chunked"`` engine.
    short_conv: kernel width W of the causal depthwise convolution on the q, k
      and v projections (followed by SiLU), or None for none (papers: 4).
    output_norm: ``"rms"`` or ``"layer"``: the per-head norm of the output.
    output_norm_eps: that norm's epsilon.
    output_gate_activation: the output gate's activation, ``"silu"`` (the swish gate of
      the papers, Qwen3-Next) or ``"sigmoid"`` (Kimi Linear).
    output_gate_rank: None (``g_proj [D, N Hv]``), or the rank of a low-rank gate
      projection ``g_down [D, r]`` then ``g_up [r, N Hv]`` (Kimi Linear: the head dim).
  """

  optional_params: ClassVar[tuple[str, ...]] = (
    "g_proj",
    "g_down",
    "g_up",
    "out_norm_gain",
    "q_conv",
    "k_conv",
    "v_conv",
  )
  op: ClassVar[str] = "gated_linear"
  takes_segment_ids: ClassVar[bool] = True
  # Mamba-2's gated norm multiplies by the gate before normalising.
  gate_before_norm: ClassVar[bool] = False
  # The delta rule's layers apply SiLU and an L2 norm to q and k.
  normalize_qk: ClassVar[bool] = False

  chunk_size: int = 64
  short_conv: Optional[int] = None
  output_norm: str = "rms"
  output_norm_eps: float = _NORM_EPS
  output_gate_activation: str = "silu"
  output_gate_rank: Optional[int] = None

  def validate(self) -> None:
    check_int("chunk_size", self.chunk_size)
    check_int("short_conv", self.short_conv, allow_none=True, minimum=2)
    validators.check_choice("output_norm", self.output_norm, OUTPUT_NORMS)
    validators.check_positive_float("output_norm_eps", self.output_norm_eps, allow_none=False)
    validators.check_choice(
      "output_gate_activation", self.output_gate_activation, tuple(GATE_ACTIVATIONS)
    )
    check_int("output_gate_rank", self.output_gate_rank, allow_none=True)

  # Head layout (the delta rule's value-head grouping overrides these).

  def query_heads(self, layer) -> int:
    """Heads of the query projection."""
    return layer.num_heads

  def value_heads(self, layer) -> int:
    """Heads of the value projection."""
    return layer.num_kv_heads

  def check(self, config) -> None:
    if not config.is_causal:
      raise ValueError(
        f"is_causal=False: family={self.family!r} is a causal recurrence and has no encoder form"
      )

  # -------------------------------------------------------------------------
  # Parameters.

  def conv_widths(self, layer) -> tuple[int, int, int]:
    """Channels of the q, k and v convolutions."""
    H, Hv = layer.head_dim, self.value_head_dim(layer.head_dim)
    return (self.query_heads(layer) * H, layer.num_kv_heads * H, self.value_heads(layer) * Hv)

  def init_params(self, layer, rngs, param_dtype) -> None:
    D, N, H = layer.d_model, layer.num_heads, layer.head_dim
    Hv = self.value_head_dim(H)
    lin = dict(rngs=rngs, dtype=layer.dtype, param_dtype=param_dtype)
    if self.output_gate_rank is None:
      layer.g_proj = _layers.linear(D, N * Hv, ("embed", "heads"), **lin)
    else:
      layer.g_down = _layers.linear(D, self.output_gate_rank, ("embed", None), **lin)
      layer.g_up = _layers.linear(self.output_gate_rank, N * Hv, (None, "heads"), **lin)
    layer.out_norm_gain = _layers.param(jnp.ones((Hv,), param_dtype), (None,))
    if self.short_conv is not None:
      W = self.short_conv
      bound = 1.0 / math.sqrt(W)
      for name, width in zip(("q_conv", "k_conv", "v_conv"), self.conv_widths(layer)):
        drawn = jax.random.uniform(rngs.params(), (W, width), param_dtype, -bound, bound)
        setattr(layer, name, _layers.param(drawn, (None, "heads")))
    self.init_gate_params(layer, rngs, param_dtype)

  def init_gate_params(self, layer, rngs, param_dtype) -> None:
    """The family's decay and beta projections."""

  def default_function(self, layer):
    return gated_lib.gated_linear_attention

  def gates(self, layer, x: Array) -> dict[str, Array]:
    """Keyword arrays of the family's function computed from ``x`` ``[B, T, D]``."""
    raise NotImplementedError

  def call_function(self, fn, q, k, v, gates: dict[str, Array], **kwargs):
    return fn(q, k, v, **gates, **kwargs)

  # -------------------------------------------------------------------------
  # q, k, v before the recurrence.

  def _mix(self, layer, q, k, v, seg, cache):
    """Short convolution + SiLU (if any), then the L2 norm of the delta rule; new conv tail.

    ``v`` None (the probe's ``prepare_qk``) convolves a zero ``v`` and drops it.
    """
    tails = None
    if self.short_conv is not None:
      v = jnp.zeros_like(k) if v is None else v
      B, T = q.shape[:2]
      W = self.short_conv
      if cache is None:
        old = [jnp.zeros((B, W - 1, a.shape[2] * a.shape[3]), a.dtype) for a in (q, k, v)]
        old_seg = jnp.broadcast_to(seg[:, :1], (B, W - 1))
      else:
        old, old_seg = cache.conv, cache.conv_segment_ids
      mixed, new = [], []
      for a, tail, weight in zip((q, k, v), old, (layer.q_conv, layer.k_conv, layer.v_conv)):
        out, new_tail, new_seg = short_conv(
          jnp.reshape(a, (B, T, -1)), weight[...], tail, seg, old_seg
        )
        mixed.append(jnp.reshape(jax.nn.silu(out), a.shape))
        new.append(new_tail.astype(tail.dtype))
      q, k, v = mixed
      tails = (tuple(new), new_seg)
    if self.normalize_qk:
      if self.short_conv is None:
        q, k = jax.nn.silu(q), jax.nn.silu(k)
      q, k = _l2_normalize(q), _l2_normalize(k)
    return q, k, v, tails

  def prepare_qk(self, layer, q, k):
    B, T = q.shape[:2]
    seg = jnp.zeros((B, T), jnp.int32)
    q, k, _, _ = self._mix(layer, q, k, None, seg, None)
    return q, k

  # -------------------------------------------------------------------------
  # The call.

  def attend(self, layer, q, k, v, call: Call):
    c = layer.config
    family = self.family
    if call.cross:
      raise ValueError(
        f"inputs_kv: family={family!r} is causal self-attention (a recurrent "
        f"state); it has no cross-attention"
      )
    if call.mask is not None:
      raise ValueError(
        f"mask: family={family!r} cannot take a mask (it never forms the "
        f"weights); use segment_ids for packed documents"
      )
    x = call.inputs
    if x is None:
      raise ValueError(
        f"family={family!r} projects its gates from the layer input: Call.inputs "
        f"must be the layer's x [B, T, D]"
      )
    B, T = q.shape[:2]
    cache = call.cache
    idx = jnp.arange(T, dtype=jnp.int32)
    seg = call.segment_ids
    if cache is not None:
      self.check_decode_cache(layer, cache, GatedCache)
      idx = idx + cache.index
      if seg is None:
        seg = jnp.broadcast_to(cache.segment_id[:, None], (B, T))
    seg_conv = jnp.zeros((B, T), jnp.int32) if seg is None else seg.astype(jnp.int32)
    q, k, v, tails = self._mix(layer, q, k, v, seg_conv, cache)
    positions = idx if call.positions is None else call.positions
    q, k = _rope(layer, q, positions), _rope(layer, k, positions)
    gates = self.gates(layer, x)
    fn = self.function(layer)
    kwargs = dict(segment_ids=seg, implementation=c.implementation, chunk_size=self.chunk_size)
    if cache is None:  # sequence-sharded under a mesh with a context axis
      out = self.call_function(_context.sharded(fn), q, k, v, gates, **kwargs)
      if call.capture:
        self._sow(layer, fn, q, k, gates, kwargs, call)
        self._sow_state(layer, fn, q, k, v, gates, seg_conv)
      return self._finish(layer, x, out), None
    # A call starting another segment than the cache's last token starts from zero.
    reset = jnp.logical_and(seg_conv[:, 0] != cache.segment_id, cache.index > 0)
    state = jnp.where(reset[:, None, None, None], 0.0, cache.state)
    out, state = self.call_function(
      fn, q, k, v, gates, initial_state=state, return_state=True, **kwargs
    )
    new_cache = GatedCache(
      state=state,
      index=cache.index + T,
      segment_id=seg_conv[:, -1],
      conv=None if tails is None else tails[0],
      conv_segment_ids=None if tails is None else tails[1],
    )
    return self._finish(layer, x, out), new_cache

  def implied_weights(self, fn, q, k, gates, kwargs) -> Array:
    """``[B, N, T, S]``: the layer's output for one-hot values (its implied attention matrix)."""
    B, S = k.shape[:2]
    M = self.value_heads_of(k, gates)
    eye = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32)[None, :, None, :], (B, S, M, S))
    w = self.call_function(fn, q.astype(jnp.float32), k.astype(jnp.float32), eye, gates, **kwargs)
    return jnp.transpose(w, (0, 2, 1, 3))

  def value_heads_of(self, k: Array, gates: dict[str, Array]) -> int:
    """Value heads of a call with keys ``k`` and ``gates`` (the keys' heads here)."""
    return k.shape[2]

  def _sow(self, layer, fn, q, k, gates, kwargs, call) -> None:
    w = self.implied_weights(fn, q, k, gates, kwargs)
    T = w.shape[-1]
    zeros = jnp.zeros(w.shape, jnp.float32)
    full = stats_from_weights(zeros, w, self.allowed_mask(layer, T), zeros[..., :1])
    _layers.sow(
      layer,
      "attention_stats",
      AttentionStats(sink_mass=full.sink_mass, entropy=full.entropy, row_sum=full.row_sum),
    )
    if call.sow_weights:
      _layers.sow(layer, "weights", w)

  def _sow_state(self, layer, fn, q, k, v, gates, seg) -> None:
    """The recurrence's own statistics, per head of the call: ``decay_mean`` (the mean
    decay factor ``exp(g)`` over tokens, and key channels where the decay has them),
    ``beta_mean`` (the mean write strength, delta rule) ``[B, N]``, and ``state_norm``
    ``[B, N, T]``: the Frobenius norm of the state ``S_t`` after each token, from the
    family's function run one token at a time (its recurrent engine), the state reset
    where ``seg`` changes document."""
    B, T = q.shape[:2]
    heads = layer.num_heads
    H, Hv = k.shape[-1], v.shape[-1]
    # A gate of rank <= 3 broadcasts to [B, T, N] (RetNet's constant decay is [N]), of
    # rank 4 to [B, T, N, H] (a decay per key channel).
    gates = {
      n: jnp.broadcast_to(g, (B, T, heads) if jnp.ndim(g) <= 3 else (B, T, heads, H))
      for n, g in gates.items()
    }
    if "log_decay" in gates:
      decay = jnp.exp(gates["log_decay"].astype(jnp.float32))
      _layers.sow(layer, "decay_mean", jnp.mean(decay, axis=(1,) + tuple(range(3, decay.ndim))))
    if "beta" in gates:
      _layers.sow(layer, "beta_mean", jnp.mean(gates["beta"].astype(jnp.float32), axis=1))
    f32 = jnp.float32
    step_gates = {n: jnp.moveaxis(g, 1, 0)[:, :, None] for n, g in gates.items()}
    xs = (
      tuple(jnp.moveaxis(a.astype(f32), 1, 0)[:, :, None] for a in (q, k, v)),
      step_gates,
      jnp.moveaxis(seg, 1, 0),
    )

    def step(carry, x):
      state, last = carry
      (q_t, k_t, v_t), g_t, seg_t = x
      state = jnp.where((seg_t != last)[:, None, None, None], 0.0, state)
      _, state = self.call_function(
        fn, q_t, k_t, v_t, g_t, initial_state=state, return_state=True, implementation="recurrent"
      )
      return (state, seg_t), jnp.sqrt(jnp.sum(state * state, axis=(2, 3)))

    start = (jnp.zeros((B, heads, H, Hv), f32), seg[:, 0])
    _, norms = jax.lax.scan(step, start, xs)  # [T, B, N]
    _layers.sow(layer, "state_norm", jnp.transpose(norms, (1, 2, 0)))

  def _finish(self, layer, x: Array, out: Array) -> Array:
    """Per-head norm and the output gate ``act(x W_g)`` (before the norm for Mamba-2)."""
    B, T, N, Hv = out.shape
    if self.output_gate_rank is None:
      z = layer.g_proj(x)
    else:
      z = layer.g_up(layer.g_down(x))
    act = GATE_ACTIVATIONS[self.output_gate_activation]
    gate = act(jnp.reshape(z, (B, T, N, Hv)).astype(jnp.float32))
    gain = layer.out_norm_gain[...]
    eps = self.output_norm_eps
    if self.gate_before_norm:
      y = _head_norm(out.astype(jnp.float32) * gate, gain, self.output_norm, eps)
    else:
      y = _head_norm(out, gain, self.output_norm, eps) * gate
    return y.astype(out.dtype)

  def init_cache(self, layer, batch_size, max_len):
    B, N, H = batch_size, layer.num_heads, layer.head_dim
    conv = conv_seg = None
    if self.short_conv is not None:
      W = self.short_conv
      conv = tuple(jnp.zeros((B, W - 1, width), layer.dtype) for width in self.conv_widths(layer))
      conv_seg = jnp.zeros((B, W - 1), jnp.int32)
    return GatedCache(
      state=jnp.zeros((B, N, H, self.value_head_dim(H)), jnp.float32),
      index=jnp.zeros((), jnp.int32),
      segment_id=jnp.zeros((B,), jnp.int32),
      conv=conv,
      conv_segment_ids=conv_seg,
    )

  def allowed_mask(self, layer, length):
    return jnp.tril(jnp.ones((length, length), bool))[None, None]


# ---------------------------------------------------------------------------
# Decay parametrisations.


def retnet_log_decay(num_heads: int) -> Array:
  """RetNet's fixed per-head log decays ``log(gamma_h)``, ``gamma_h = 1 - 2^(-5-h)`` (Sun et al.
  2023).

  Args:
    num_heads: ``N``.

  Returns:
    float32 ``[N]``.
  """
  h = jnp.arange(num_heads, dtype=jnp.float32)
  return jnp.log1p(-jnp.exp2(-5.0 - h))


def _init_mamba2_decay(layer, rngs, param_dtype) -> None:
  D, N = layer.d_model, layer.num_heads
  layer.dt_proj = _layers.linear(
    D, N, ("embed", "heads"), rngs=rngs, dtype=layer.dtype, param_dtype=param_dtype
  )
  lo, hi = _DT_INIT
  dt = jnp.exp(jax.random.uniform(rngs.params(), (N,), jnp.float32, math.log(lo), math.log(hi)))
  # softplus(dt_bias) = dt at init. dt_bias and A_log stay float32 whatever param_dtype is
  # (exp(A_log) in bf16 is off by up to 0.4%; Kimi Linear and NeMo keep them float32).
  layer.dt_bias = _layers.param(dt + jnp.log(-jnp.expm1(-dt)), ("heads",))
  a = jax.random.uniform(rngs.params(), (N,), jnp.float32, *_A_INIT)
  layer.A_log = _layers.param(jnp.log(a), ("heads",))


def _mamba2_log_decay(layer, x: Array) -> Array:
  """``[B, T, N]`` ``-softplus(x W_dt + dt_bias) * exp(A_log)`` (Mamba-2)."""
  as_row = lambda p: jnp.reshape(p[...].astype(jnp.float32), (1, 1, -1))
  dt = jax.nn.softplus(layer.dt_proj(x).astype(jnp.float32) + as_row(layer.dt_bias))
  return -dt * jnp.exp(as_row(layer.A_log))


# ---------------------------------------------------------------------------
# The families.


@dataclasses.dataclass(frozen=True)
class RetNetSpec(GatedSpec):
  """RetNet retention: a fixed decay ``gamma_h = 1 - 2^(-5-h)`` per head (Sun et al. 2023).

  Group norm (``output_norm="layer"``, per head) and a swish output gate.
  """

  family: ClassVar[str] = "retnet"

  output_norm: str = "layer"

  def gates(self, layer, x):
    return {"log_decay": retnet_log_decay(layer.num_heads)}


@dataclasses.dataclass(frozen=True)
class Mamba2DecaySpec(GatedSpec):
  """Mamba-2's data-dependent scalar decay per head (Dao & Gu 2024), gated RMS norm.

  ``log_decay = -softplus(x W_dt + dt_bias) * exp(A_log)``; the output is
  ``rmsnorm(o * silu(x W_g))``. The input's ``dt`` scaling of the SSM is not
  applied to the keys (the decay alone is this family's subject).
  """

  family: ClassVar[str] = "mamba2_decay"
  optional_params: ClassVar[tuple[str, ...]] = GatedSpec.optional_params + (
    "dt_proj",
    "dt_bias",
    "A_log",
  )
  gate_before_norm: ClassVar[bool] = True

  def init_gate_params(self, layer, rngs, param_dtype):
    _init_mamba2_decay(layer, rngs, param_dtype)

  def gates(self, layer, x):
    return {"log_decay": _mamba2_log_decay(layer, x)}


@dataclasses.dataclass(frozen=True)
class GLASpec(GatedSpec):
  """Gated linear attention: a gate per key channel (Yang et al. 2024).

  ``log_decay = logsigmoid(x W1 W2 + b) / gate_normalizer`` ``[B, T, N, H]``.

  Attributes:
    gate_rank: rank of the gate projection ``W1 [D, r] W2 [r, N H]``.
    gate_normalizer: ``tau``; 16 in the paper (decays near 1 at init).
  """

  family: ClassVar[str] = "gla"
  optional_params: ClassVar[tuple[str, ...]] = GatedSpec.optional_params + ("gk_down", "gk_up")

  gate_rank: int = 16
  gate_normalizer: float = 16.0

  def validate(self) -> None:
    super().validate()
    check_int("gate_rank", self.gate_rank)
    check_type("gate_normalizer", self.gate_normalizer, (int, float), "a positive number")
    if not self.gate_normalizer > 0:
      raise ValueError(f"gate_normalizer must be > 0, got {self.gate_normalizer}")

  def init_gate_params(self, layer, rngs, param_dtype):
    D, N, H, r = layer.d_model, layer.num_heads, layer.head_dim, self.gate_rank
    lin = dict(rngs=rngs, dtype=layer.dtype, param_dtype=param_dtype)
    layer.gk_down = _layers.linear(D, r, ("embed", None), **lin)
    layer.gk_up = _layers.linear(r, N * H, (None, "heads"), use_bias=True, **lin)

  def gates(self, layer, x):
    B, T, _ = x.shape
    z = layer.gk_up(layer.gk_down(x)).astype(jnp.float32)
    g = jax.nn.log_sigmoid(z) / float(self.gate_normalizer)
    return {"log_decay": jnp.reshape(g, (B, T, layer.num_heads, layer.head_dim))}


@dataclasses.dataclass(frozen=True)
class DeltaNetSpec(GatedSpec):
  """DeltaNet: the delta rule with SiLU + L2-normalised q, k and ``beta = sigmoid(x W_beta)``.

  (Schlag et al. 2021; Yang et al. 2024.) RMS norm and swish output gate; set
  ``short_conv=4`` for the paper's short convolution. The family function is
  called as ``fn(q, k, v, beta, log_decay=..., ...)``.

  Attributes:
    value_grouping: False: ``num_heads`` query heads over ``num_kv_heads`` key/value heads
      (GQA). True: ``num_heads`` value heads over ``num_kv_heads`` query/key heads
      (Qwen3-Next's ``linear_num_value_heads`` over ``linear_num_key_heads``): the q and k
      projections, convolutions and L2 norms run once per key head, each state (one per
      value head) reads its key head's query and key.
    value_dim: ``Hv``, each value head's (and state's columns') width; None = ``head_dim``.
  """

  family: ClassVar[str] = "deltanet"
  optional_params: ClassVar[tuple[str, ...]] = GatedSpec.optional_params + ("beta_proj",)
  op: ClassVar[str] = "delta_rule"
  normalize_qk: ClassVar[bool] = True

  value_grouping: bool = False
  value_dim: Optional[int] = None

  def validate(self) -> None:
    super().validate()
    check_type("value_grouping", self.value_grouping, bool, "a bool")
    check_int("value_dim", self.value_dim, allow_none=True)

  def value_head_dim(self, head_dim: int) -> int:
    return head_dim if self.value_dim is None else self.value_dim

  def query_heads(self, layer) -> int:
    return layer.num_kv_heads if self.value_grouping else layer.num_heads

  def value_heads(self, layer) -> int:
    return layer.num_heads if self.value_grouping else layer.num_kv_heads

  def value_heads_of(self, k, gates):
    return gates["beta"].shape[2] if self.value_grouping else k.shape[2]

  def init_projections(self, layer, d_model: int, lin: dict) -> None:
    H, Hv, c = layer.head_dim, self.value_head_dim(layer.head_dim), layer.config
    bias = c.qkv_bias
    heads = (self.query_heads(layer), layer.num_kv_heads, self.value_heads(layer))
    for name, n, width in zip(("q_proj", "k_proj", "v_proj"), heads, (H, H, Hv)):
      setattr(
        layer, name, _layers.linear(d_model, n * width, ("embed", "heads"), use_bias=bias, **lin)
      )
    layer.o_proj = _layers.linear(
      layer.num_heads * Hv, d_model, ("heads", "embed"), use_bias=c.out_bias, **lin
    )

  def project(self, layer, x: Array):
    B, T, _ = x.shape
    H, Hv = layer.head_dim, self.value_head_dim(layer.head_dim)
    return (
      jnp.reshape(layer.q_proj(x), (B, T, self.query_heads(layer), H)),
      jnp.reshape(layer.k_proj(x), (B, T, layer.num_kv_heads, H)),
      jnp.reshape(layer.v_proj(x), (B, T, self.value_heads(layer), Hv)),
    )

  def init_gate_params(self, layer, rngs, param_dtype):
    layer.beta_proj = _layers.linear(
      layer.d_model,
      layer.num_heads,
      ("embed", "heads"),
      rngs=rngs,
      dtype=layer.dtype,
      param_dtype=param_dtype,
    )

  def default_function(self, layer):
    return delta_lib.delta_rule_attention

  def call_function(self, fn, q, k, v, gates, **kwargs):
    gates = dict(gates)
    beta = gates.pop("beta")
    return fn(q, k, v, beta, **gates, **kwargs)

  def gates(self, layer, x):
    return {"beta": jax.nn.sigmoid(layer.beta_proj(x).astype(jnp.float32))}


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetSpec(DeltaNetSpec):
  """Gated DeltaNet: DeltaNet plus Mamba-2's scalar decay per head (Yang et al. 2025)."""

  family: ClassVar[str] = "gated_deltanet"
  optional_params: ClassVar[tuple[str, ...]] = DeltaNetSpec.optional_params + (
    "dt_proj",
    "dt_bias",
    "A_log",
  )

  def init_gate_params(self, layer, rngs, param_dtype):
    super().init_gate_params(layer, rngs, param_dtype)
    _init_mamba2_decay(layer, rngs, param_dtype)

  def gates(self, layer, x):
    return dict(super().gates(layer, x), log_decay=_mamba2_log_decay(layer, x))


@dataclasses.dataclass(frozen=True)
class KDASpec(DeltaNetSpec):
  """Kimi Delta Attention (Kimi Linear, Kimi Team 2025): the delta rule with a decay per key
  channel, ``log_decay [B, T, N, H] = -exp(A_log) softplus(x W_down W_up + dt_bias)``.

  Parameters besides DeltaNet's: ``f_down [D, r]`` and ``f_up [r, N H]`` (the decay's low-rank
  projection, ``r = decay_rank``), ``dt_bias [N H]`` and ``A_log [N]`` (float32). Kimi Linear
  also gates the output by a low-rank sigmoid inside the RMS norm
  (``output_gate_activation="sigmoid"``, ``output_gate_rank``) and convolves q, k and v
  (``short_conv=4``).

  Attributes:
    decay_rank: ``r``; None = ``head_dim`` (Kimi Linear's).
  """

  family: ClassVar[str] = "kda"
  optional_params: ClassVar[tuple[str, ...]] = DeltaNetSpec.optional_params + (
    "f_down",
    "f_up",
    "dt_bias",
    "A_log",
  )

  decay_rank: Optional[int] = None

  def validate(self) -> None:
    super().validate()
    check_int("decay_rank", self.decay_rank, allow_none=True)

  def init_gate_params(self, layer, rngs, param_dtype):
    super().init_gate_params(layer, rngs, param_dtype)
    D, N, H = layer.d_model, layer.num_heads, layer.head_dim
    r = H if self.decay_rank is None else self.decay_rank
    lin = dict(rngs=rngs, dtype=layer.dtype, param_dtype=param_dtype)
    layer.f_down = _layers.linear(D, r, ("embed", None), **lin)
    layer.f_up = _layers.linear(r, N * H, (None, "heads"), **lin)
    lo, hi = _DT_INIT
    dt = jnp.exp(
      jax.random.uniform(rngs.params(), (N * H,), jnp.float32, math.log(lo), math.log(hi))
    )
    layer.dt_bias = _layers.param(dt + jnp.log(-jnp.expm1(-dt)), ("heads",))
    a = jax.random.uniform(rngs.params(), (N,), jnp.float32, *_A_INIT)
    layer.A_log = _layers.param(jnp.log(a), ("heads",))

  def gates(self, layer, x):
    B, T, _ = x.shape
    N, H = layer.num_heads, layer.head_dim
    pre = layer.f_up(layer.f_down(x)).astype(jnp.float32) + layer.dt_bias[...][None, None]
    dt = jnp.reshape(jax.nn.softplus(pre), (B, T, N, H))
    decay = -jnp.exp(jnp.reshape(layer.A_log[...].astype(jnp.float32), (1, 1, N, 1))) * dt
    return dict(super().gates(layer, x), log_decay=decay)


GATED_SPECS: tuple[type[GatedSpec], ...] = (
  RetNetSpec,
  Mamba2DecaySpec,
  GLASpec,
  DeltaNetSpec,
  GatedDeltaNetSpec,
  KDASpec,
)
GATED_FAMILIES: tuple[str, ...] = tuple(s.family for s in GATED_SPECS)

for _spec in GATED_SPECS:
  register_family(_spec)
