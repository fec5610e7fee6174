"""QK-normalised and cosine attention: normalise q and k over the head dim, then dense attention.

Implementation behind the public module :mod:`attnjax.qk_norm`.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping, Optional, Union, get_args

import jax
import jax.numpy as jnp

from attnjax._src import checks as _checks, deprecation as _deprecation, static as _static, options
from attnjax._src.ops.dense import attention as dense

Array = jnp.ndarray

Norm = Literal["l2", "rms", "layer"]
CosineConvention = Literal["swin", "scale", "ngpt"]
NORMS: tuple[str, ...] = get_args(Norm)
COSINE_CONVENTIONS: tuple[str, ...] = get_args(CosineConvention)
SWIN_MAX_LOG_SCALE = math.log(100.0)
# The dense keywords each function takes and forwards (attnjax.options.KEYWORDS): all but
# similarity (both are dot-product logits); cosine attention also sets its own scale.
QK_NORM_KEYWORDS = options.keywords(without=("similarity",))
COSINE_KEYWORDS = options.keywords(without=("similarity", "scale"))
#: The old names of :func:`attnjax.qk_norm_attention`'s gains, still accepted (each warns
#: once): ``{old: new}``. ``scale`` means only the logit scale.
RENAMED_KEYWORDS = {"q_scale": "q_gain", "k_scale": "k_gain"}


def normalize_head(x: Array, norm: Norm, eps: float) -> Array:
  """Normalises ``x`` over its last axis in float32.

  Args:
    x: ``[..., H]``.
    norm: ``"l2"`` (unit norm), ``"rms"`` (unit root mean square) or ``"layer"``
      (zero mean, unit variance; no gain or bias).
    eps: added to the sum (``"l2"``) or mean of squares before the square root.

  Returns:
    ``[..., H]`` float32.
  """
  x = x.astype(jnp.float32)
  if norm == "l2":
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
  if norm == "rms":
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  centred = x - jnp.mean(x, axis=-1, keepdims=True)
  return centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + eps)


def _gain(name: str, gain: Optional[Array], H: int) -> Optional[Array]:
  if gain is None:
    return None
  _checks.check_floating(name, gain)
  if jnp.shape(gain) != (H,):
    raise ValueError(f"{name} must have shape [H] = ({H},), got {tuple(jnp.shape(gain))}")
  return jnp.reshape(jnp.asarray(gain, jnp.float32), (1, 1, 1, H))


def _qk_norm_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  norm: Norm = "rms",
  q_gain: Optional[Array] = None,
  k_gain: Optional[Array] = None,
  eps: float = 1e-6,
  bias: Optional[Array] = None,
  mask: Optional[Array] = None,
  is_causal: bool = False,
  scale: Optional[float] = None,
  normalizer: str = "softmax",
  normalizer_params: Optional[Mapping[str, Array]] = None,
  sink_logits: Optional[Array] = None,
  softcap: Optional[float] = None,
  window: Optional[Union[int, tuple[int, int]]] = None,
  segment_ids: Any = None,
  implementation: Optional[str] = None,
  return_stats: bool = False,
  score_mod: Any = None,
  score_mod_args: Any = None,
  mask_mod: Any = None,
  mask_mod_args: Any = None,
  block_layout: Any = None,
  context_axis: Optional[str] = None,
  context_strategy: options.ContextStrategy = "ring",
  context_layout: Optional[options.ContextLayout] = None,
):
  """Attention on normalised queries and keys (QK-norm).

  ``q`` and ``k`` are normalised over the head dim (in float32, returned to the
  input dtype), multiplied by the optional learned gains, and passed to
  :func:`attnjax.dot_product_attention` with every other option: ``bias``,
  ``mask``, ``is_causal``, ``scale``, ``normalizer``, ``normalizer_params``, ``sink_logits``,
  ``softcap``, ``window``, ``segment_ids``, ``implementation``,
  ``return_stats``, ``score_mod``, ``score_mod_args``, ``mask_mod``,
  ``mask_mod_args``, ``block_layout``, ``context_axis``, ``context_strategy``
  and ``context_layout`` mean what they mean there (the modifiers see the
  logits of the normalised q and k).

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, S, K, H]``, ``N % K == 0``.
    v: values ``[B, S, K, H]``.
    norm: ``"rms"`` (RMSNorm, no centring), ``"layer"`` (LayerNorm without
      bias) or ``"l2"`` (unit L2 norm: logits become ``scale * cos``; with the
      default ``scale = H**-0.5`` they are tiny, so pass a scale or use
      :func:`attnjax.cosine_attention` for a learned temperature).
    q_gain: optional learned gain ``[H]`` of the normalised queries (formerly
      ``q_scale``, still accepted with a ``DeprecationWarning``).
    k_gain: optional learned gain ``[H]`` of the normalised keys (formerly ``k_scale``).
    eps: added to the mean square (or sum of squares) before the square root.

  Returns:
    The output ``[B, T, N, H]`` in the input dtype, or ``(out, AttentionStats)``
    with ``return_stats=True``.

  Raises:
    ValueError: ``q`` or ``k`` not of rank 4, an unknown ``norm``, a gain not of
      shape ``[H]``, a non-positive ``eps``, or any error of
      :func:`attnjax.dot_product_attention`.
    TypeError: a gain that is not floating point.
  """
  dense_keywords = options.forwarded(QK_NORM_KEYWORDS, locals())
  _checks.check_qkv(q, k, v)
  _checks.check_choice("norm", norm, NORMS)
  _checks.check_positive_float("eps", eps, allow_none=False)
  H = q.shape[-1]
  qn = normalize_head(q, norm, eps)
  kn = normalize_head(k, norm, eps)
  gq, gk = _gain("q_gain", q_gain, H), _gain("k_gain", k_gain, H)
  if gq is not None:
    qn = qn * gq
  if gk is not None:
    kn = kn * gk
  inputs, opts = dense.prepare(
    qn.astype(q.dtype), kn.astype(k.dtype), v, implementation=implementation, **dense_keywords
  )
  return dense.run(inputs, opts, implementation)


def _temperature_multiplier(
  temperature: Array, convention: CosineConvention, N: int, H: int
) -> Array:
  """The per-head factor that multiplies the unit query, ``[1, 1, N, 1]`` or ``[1, 1, N, H]``."""
  _checks.check_floating("temperature", temperature)
  t = jnp.asarray(temperature, jnp.float32)
  if convention == "ngpt":
    if t.shape not in ((), (H,), (N, H)):
      raise ValueError(
        f"temperature (nGPT s_qk) must have shape [], [H] = ({H},) or [N, H] = ({N}, {H}), "
        f"got {t.shape}"
      )
    # (s * q_hat) . (s * k_hat) = sum_h s_h^2 q_hat_h k_hat_h: apply s^2 on the query side,
    # which also works when several query heads share a key head (GQA).
    return jnp.reshape(jnp.broadcast_to(t * t, (N, H)), (1, 1, N, H))
  t = _checks.check_per_head("temperature", t, N)
  if convention == "swin":
    t = jnp.exp(jnp.minimum(t, SWIN_MAX_LOG_SCALE))
  return jnp.reshape(t, (1, 1, N, 1))


def _cosine_attention(
  q: Array,
  k: Array,
  v: Array,
  *,
  temperature: Array,
  convention: CosineConvention = "swin",
  eps: float = 1e-6,
  bias: Optional[Array] = None,
  mask: Optional[Array] = None,
  is_causal: bool = False,
  normalizer: str = "softmax",
  normalizer_params: Optional[Mapping[str, Array]] = None,
  sink_logits: Optional[Array] = None,
  softcap: Optional[float] = None,
  window: Optional[Union[int, tuple[int, int]]] = None,
  segment_ids: Any = None,
  implementation: Optional[str] = None,
  return_stats: bool = False,
  score_mod: Any = None,
  score_mod_args: Any = None,
  mask_mod: Any = None,
  mask_mod_args: Any = None,
  block_layout: Any = None,
  context_axis: Optional[str] = None,
  context_strategy: options.ContextStrategy = "ring",
  context_layout: Optional[options.ContextLayout] = None,
):
  """Cosine attention: logits are ``cos(q_i, k_j)`` times a learned per-head scale.

  Conventions for ``temperature``:

  - ``"swin"`` (Swin v2): ``temperature`` ``[N]`` is a log-scale; logits are
    ``cos * exp(min(temperature, log 100))``. Initialise it at ``log 10``.
  - ``"scale"``: ``temperature`` ``[N]`` multiplies the cosine directly.
  - ``"ngpt"`` (nGPT): ``temperature`` is ``s_qk`` (``[]``, ``[H]`` or ``[N, H]``);
    logits are ``sqrt(H) * sum_h (s_h q_hat_h)(s_h k_hat_h)``.

  The logits depend only on directions, so rescaling any ``q_i`` or ``k_j`` by a
  positive factor changes nothing (up to ``eps``); dot-product attention keeps
  the norms. Every other option (``bias``, ``mask``, ``is_causal``,
  ``normalizer``, ``normalizer_params``, ``sink_logits``, ``softcap``, ``window``, ``segment_ids``,
  ``implementation``, ``return_stats``, ``score_mod``, ``score_mod_args``,
  ``mask_mod``, ``mask_mod_args``, ``block_layout``, ``context_axis``,
  ``context_strategy``, ``context_layout``) is that of
  :func:`attnjax.dot_product_attention`; the modifiers see these logits.

  Args:
    q: queries ``[B, T, N, H]``.
    k: keys ``[B, S, K, H]``, ``N % K == 0``.
    v: values ``[B, S, K, H]``.
    temperature: the learned scale (an array argument; shapes as above).
    convention: ``"swin"``, ``"scale"`` or ``"ngpt"``.
    eps: added to the squared norm before the square root.

  Returns:
    The output ``[B, T, N, H]`` in the input dtype, or ``(out, AttentionStats)``
    with ``return_stats=True``.

  Raises:
    ValueError: ``q`` or ``k`` not of rank 4, an unknown ``convention``, a
      ``temperature`` of the wrong shape, a non-positive ``eps``, or any error of
      :func:`attnjax.dot_product_attention`.
    TypeError: a ``temperature`` that is not floating point.
  """
  dense_keywords = options.forwarded(COSINE_KEYWORDS, locals())
  _checks.check_qkv(q, k, v)
  _checks.check_choice("convention", convention, COSINE_CONVENTIONS)
  _checks.check_positive_float("eps", eps, allow_none=False)
  N, H = q.shape[2], q.shape[3]
  qn = normalize_head(q, "l2", eps) * _temperature_multiplier(temperature, convention, N, H)
  kn = normalize_head(k, "l2", eps)
  dense_keywords["scale"] = math.sqrt(H) if convention == "ngpt" else 1.0
  inputs, opts = dense.prepare(
    qn.astype(q.dtype), kn.astype(k.dtype), v, implementation=implementation, **dense_keywords
  )
  return dense.run(inputs, opts, implementation)


qk_norm_attention = _deprecation.renamed_keywords(
  _static.jit(
    _qk_norm_attention, ("norm", "eps", "implementation") + options.static(QK_NORM_KEYWORDS)
  ),
  "qk_norm_attention",
  RENAMED_KEYWORDS,
)
cosine_attention = _static.jit(
  _cosine_attention, ("convention", "eps", "implementation") + options.static(COSINE_KEYWORDS)
)
