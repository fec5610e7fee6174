"""The ``mla`` family's layer: DeepSeek's latent projections, RoPE on the rope part, a latent cache.

Implementation behind :class:`attnjax.nn.specs.MLASpec`; guide: docs/guides/mla.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, ClassVar, Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnjax._src import options, validators
from attnjax._src.nn import _layers
from attnjax._src.nn.rope import apply_rope
from attnjax._src.nn.softmax_specs import DotProductSpec
from attnjax._src.nn.spec_base import check_int, check_type, register_family, run_and_sow
from attnjax._src.ops.dense import attention as dense
from attnjax._src.ops.mla import attention as mla

Array = jnp.ndarray


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  """DeepSeek's ``yarn_get_mscale``: ``0.1 mscale ln(scale) + 1`` for ``scale > 1``, else 1."""
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def interleave_permutation(d: int) -> np.ndarray:
  """Columns ``[0, 2, 4, .., 1, 3, ..]`` of a rope part of width ``d``: RoPE on adjacent
  pairs (DeepSeek V3's interleaved RoPE, V2's complex form) is the half-split RoPE of the
  columns taken in this order."""
  return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


@dataclasses.dataclass(frozen=True)
class MLASpec(DotProductSpec):
  """Multi-head latent attention (:func:`attnjax.mla_attention`; DeepSeek V2/V3, Kimi).

  The layer's parameters: ``q_proj`` ``[D, N (d_n + d_r)]``, or with ``q_lora_rank``
  ``q_a_proj`` ``[D, q_lora_rank]``, ``q_a_norm`` (RMSNorm) and ``q_b_proj``;
  ``kv_a_proj`` ``[D, R + d_r]`` (the latent and the shared rope key), ``kv_a_norm``
  (RMSNorm of the latent) and ``kv_b_proj`` ``[R, N (d_n + d_v)]`` (``W_UK`` and ``W_UV``
  per head); ``o_proj`` ``[N d_v, D]``. ``qkv_bias`` puts biases on ``q_a_proj`` and
  ``kv_a_proj`` (as DeepSeek's ``attention_bias``), ``out_bias`` on ``o_proj``. The training forward runs the
  expanded form, a decode step the absorbed one over a :class:`~attnjax.nn.KVCache` holding
  only the latent: ``k`` the rope keys ``[B, C, 1, d_r]`` (before RoPE), ``v`` the latents
  ``[B, C, 1, R]``. ``rope_theta=None`` rotates nothing (Kimi Linear's MLA).

  Attributes:
    q_lora_rank: rank of the query's low-rank projection, or None: one ``q_proj``.
    kv_lora_rank: ``R``, the latent's width.
    qk_nope_head_dim: ``d_n``, each head's key part without RoPE.
    qk_rope_head_dim: ``d_r``, the RoPE part (one key shared by every head).
    v_head_dim: ``d_v``.
    rope_interleaved: RoPE on adjacent pairs of the rope part (DeepSeek's own layout), not on
      its halves; the logits are the same up to a fixed permutation of its columns.
    scale: logit scale; None = ``(d_n + d_r) ** -0.5``, times ``mscale(factor,
      mscale_all_dim) ** 2`` under YaRN ``rope_scaling`` with ``mscale_all_dim`` (DeepSeek;
      apart from YaRN's factor on cos and sin).
    latent_norm_eps: epsilon of the two RMSNorms.
  """

  family: ClassVar[str] = "mla"
  op: ClassVar[str] = "mla"
  optional_params: ClassVar[tuple[str, ...]] = (
    "sink_logits",
    "relative_bias_table",
    "normalizer_params",
  )
  takes_cross: ClassVar[bool] = False
  plain_values: ClassVar[bool] = False

  q_lora_rank: Optional[int] = None
  kv_lora_rank: int = 32
  qk_nope_head_dim: int = 16
  qk_rope_head_dim: int = 8
  v_head_dim: int = 16
  rope_interleaved: bool = False
  scale: Optional[float] = None
  latent_norm_eps: float = 1e-6

  def validate(self) -> None:
    super().validate()
    check_int("q_lora_rank", self.q_lora_rank, allow_none=True)
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
      check_int(name, getattr(self, name))
    check_type("rope_interleaved", self.rope_interleaved, bool, "a bool")
    validators.check_positive_float("scale", self.scale)
    validators.check_positive_float("latent_norm_eps", self.latent_norm_eps, allow_none=False)
    if self.kv_bias:
      raise ValueError(
        "kv_bias=True: family='mla' rebuilds keys and values from one latent per token; a "
        "learned k/v slot has no latent (use sink_logits for a null column)"
      )

  def check(self, config) -> None:
    super().check(config)
    d_qk = self.qk_nope_head_dim + self.qk_rope_head_dim
    if config.head_dim is not None and config.head_dim != d_qk:
      raise ValueError(
        f"head_dim={config.head_dim}: family='mla' has query head dim qk_nope_head_dim + "
        f"qk_rope_head_dim = {d_qk} (leave head_dim None)"
      )
    if config.num_kv_heads is not None and config.num_kv_heads != config.num_heads:
      raise ValueError(
        f"num_kv_heads={config.num_kv_heads}: family='mla' has one latent per token, shared "
        f"by its num_heads={config.num_heads} heads (leave num_kv_heads None)"
      )
    if config.rope_theta is not None and self.qk_rope_head_dim % 2:
      raise ValueError(
        f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE (rope_theta set; "
        f"rope_theta=None leaves the rope part unrotated)"
      )

  def fixed_head_dim(self) -> int:
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  def value_head_dim(self, head_dim: int) -> int:
    return self.v_head_dim

  def softmax_scale(self, config) -> float:
    """The logit scale the layer uses (see ``scale``)."""
    if self.scale is not None:
      return float(self.scale)
    out = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
    s = dict(config.rope_scaling or ())
    if s.get("type") == "yarn" and s.get("mscale_all_dim"):
      m = yarn_mscale(s["factor"], s["mscale_all_dim"])
      out *= m * m
    return out

  # Parameters and projections.

  def init_projections(self, layer, d_model: int, lin: dict) -> None:
    N, c = layer.num_heads, layer.config
    R, d_r = self.kv_lora_rank, self.qk_rope_head_dim
    d_qk = self.qk_nope_head_dim + d_r
    bias = c.qkv_bias
    norm = dict(epsilon=self.latent_norm_eps, dtype=lin["dtype"], param_dtype=lin["param_dtype"])
    ones = _layers.with_names(nnx.initializers.ones, (None,))
    if self.q_lora_rank is None:
      layer.q_proj = _layers.linear(d_model, N * d_qk, ("embed", "heads"), **lin)
    else:
      r = self.q_lora_rank
      layer.q_a_proj = _layers.linear(d_model, r, ("embed", None), use_bias=bias, **lin)
      layer.q_a_norm = nnx.RMSNorm(r, scale_init=ones, rngs=lin["rngs"], **norm)
      layer.q_b_proj = _layers.linear(r, N * d_qk, (None, "heads"), **lin)
    layer.kv_a_proj = _layers.linear(d_model, R + d_r, ("embed", None), use_bias=bias, **lin)
    layer.kv_a_norm = nnx.RMSNorm(R, scale_init=ones, rngs=lin["rngs"], **norm)
    layer.kv_b_proj = _layers.linear(
      R, N * (self.qk_nope_head_dim + self.v_head_dim), (None, "heads"), **lin
    )
    layer.o_proj = _layers.linear(
      N * self.v_head_dim, d_model, ("heads", "embed"), use_bias=c.out_bias, **lin
    )

  def project(self, layer, x: Array):
    """``(q [B, T, N, d_n + d_r], k_rope [B, T, 1, d_r], latent [B, T, 1, R])``: the
    queries, the shared rope key (before RoPE) and the normalised latent."""
    B, T, _ = x.shape
    if self.q_lora_rank is None:
      q = layer.q_proj(x)
    else:
      q = layer.q_b_proj(layer.q_a_norm(layer.q_a_proj(x)))
    q = jnp.reshape(q, (B, T, layer.num_heads, -1))
    kv = layer.kv_a_proj(x)
    R = self.kv_lora_rank
    latent = layer.kv_a_norm(kv[..., :R])
    return q, kv[..., R:][:, :, None], latent[:, :, None]

  def up_projections(self, layer) -> tuple[Array, Array]:
    """``(w_uk [R, N, d_n], w_uv [R, N, d_v])``, the two halves of ``kv_b_proj`` per head."""
    w = jnp.reshape(layer.kv_b_proj.kernel[...], (self.kv_lora_rank, layer.num_heads, -1))
    return w[..., : self.qk_nope_head_dim], w[..., self.qk_nope_head_dim :]

  # The call.

  def rotate(self, layer, x: Array, positions: Array) -> Array:
    """RoPE on ``x``'s last ``d_r`` dims (a query's rope part, or the whole rope key)."""
    c = layer.config
    if c.rope_theta is None:
      return x
    d_r = self.qk_rope_head_dim
    part = x[..., -d_r:]
    if self.rope_interleaved:
      order = interleave_permutation(d_r)
      part = apply_rope(part[..., order], positions, c.rope_theta, scaling=c.rope_scaling)
      part = part[..., np.argsort(order)]
    else:
      part = apply_rope(part, positions, c.rope_theta, scaling=c.rope_scaling)
    return jnp.concatenate([x[..., :-d_r], part], axis=-1)

  def default_function(self, layer) -> Callable:
    return mla.mla_attention

  def kwargs(self, layer):
    w_uk, w_uv = self.up_projections(layer)
    return dict(super().kwargs(layer), scale=self.softmax_scale(layer.config), w_uk=w_uk, w_uv=w_uv)

  def attend(self, layer, q, k, v, call):
    if call.capture and call.cache is None and not call.cross:
      self._sow_compared(layer, q, k, v, call)
    return super().attend(layer, q, k, v, call)

  def _sow_compared(self, layer, q, k_rope, latent, call) -> None:
    """Sows what the heads compare (``compared_q``, ``compared_k``: rotated, keys rebuilt per
    head) and their values (``compared_v``), for ``attnjax.nn.layer_stats``' geometry."""
    T = q.shape[1]
    positions = jnp.arange(T, dtype=jnp.int32) if call.positions is None else call.positions
    q, k_rope = self.rotate(layer, q, positions), self.rotate(layer, k_rope, positions)
    w_uk, w_uv = self.up_projections(layer)
    x = mla.expanded_inputs(options.DenseInputs(q, k_rope, latent), w_uk, w_uv)
    for name, value in (("compared_q", q), ("compared_k", x.k), ("compared_v", x.v)):
      _layers.sow(layer, name, value)

  def weights_of(self, run: Callable, q: Array, k: Array, v: Array) -> Array:
    """``[B, T, N, S]``: the weights of the MLA call ``run(q, k_rope, latent)`` (a
    ``functools.partial`` of :func:`attnjax.mla_attention`), as the absorbed form's MQA over
    the latent applied to identity values."""
    kw = {n: x for n, x in run.keywords.items() if n not in ("w_uk", "w_uv", "absorb")}
    kw.update(implementation="reference", return_stats=False)
    x = mla.absorbed_inputs(options.DenseInputs(q, k, v), run.keywords["w_uk"], None)
    B, S = k.shape[:2]
    eye = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float32)[None, :, None, :], (B, S, 1, S))
    return dense.dot_product_attention(x.q.astype(jnp.float32), x.k.astype(jnp.float32), eye, **kw)

  def sown_weights(self, layer, run, q, k, v):
    return lambda: jnp.transpose(self.weights_of(run, q, k, v), (0, 2, 1, 3))

  def attend_with_weights(self, layer, run, q, k, v, call):
    w = self.weights_of(run, q, k, v)
    out = run_and_sow(layer, run, q, k, v, call, weights=lambda: jnp.transpose(w, (0, 2, 1, 3)))
    return out, w

  def cache_shape(self, config, d_model: int) -> tuple[int, int, int]:
    return 1, self.qk_rope_head_dim, self.kv_lora_rank


register_family(MLASpec)
