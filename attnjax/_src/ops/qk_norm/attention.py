"""QK-normalised attention: normalise q and k over the head dim, then dense attention.

A front end of the dense op: its op, ``"qk_norm"``, takes the dense call of the normalised
q and k and has dense's engines, in dense's order. Implementation behind the public module
:mod:`attnjax.qk_norm`.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Optional, Union, get_args

import jax
import jax.numpy as jnp

from attnjax._src import validators, deprecation, op, static, options
from attnjax._src.ops.dense import attention as dense

Array = jnp.ndarray

Norm = Literal["l2", "rms", "layer"]
NORMS: tuple[str, ...] = get_args(Norm)
# The dense keywords qk_norm_attention takes and forwards (attnjax._src.options.KEYWORDS): all but
# similarity (its logits are dot products).
QK_NORM_KEYWORDS = options.keywords(without=("similarity",))
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
  validators.check_floating(name, gain)
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
  implementation: Optional[dense.ImplementationName] = None,
  return_stats: bool = False,
  score_mod: Any = None,
  score_mod_args: Any = None,
  mask_mod: Any = None,
  mask_mod_args: Any = None,
  block_layout: Any = None,
  context_axis: Optional[str] = None,
  context_strategy: Optional[options.ContextStrategy] = "ring",
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
  validators.check_qkv(q, k, v)
  validators.check_choice("norm", norm, NORMS)
  validators.check_positive_float("eps", eps, allow_none=False)
  H = q.shape[-1]
  qn = normalize_head(q, norm, eps)
  kn = normalize_head(k, norm, eps)
  gq, gk = _gain("q_gain", q_gain, H), _gain("k_gain", k_gain, H)
  if gq is not None:
    qn = qn * gq
  if gk is not None:
    kn = kn * gk
  implementation = op.check_implementation(OP, implementation, where="qk_norm_attention")
  inputs, opts = options.validate(qn.astype(q.dtype), kn.astype(k.dtype), v, **dense_keywords)
  return op.run(OP, (inputs, opts), implementation)


# The engines are dense's, in dense's order (a dense call of the normalised q and k).
ENGINES, PREFERENCES, FALLBACK = dense.ENGINES, dense.PREFERENCES, dense.FALLBACK
IMPLEMENTATIONS, ImplementationName = dense.IMPLEMENTATIONS, dense.ImplementationName


def _samples() -> tuple[op.Sample, ...]:
  def gains(q, k, v):
    H = q.shape[-1]
    gain = 1.0 + 0.1 * jnp.cos(jnp.arange(H, dtype=jnp.float32))
    return q, k, v, dict(q_gain=gain, k_gain=gain[::-1])

  return (
    op.Sample(
      qk_norm_attention,
      options=dict(is_causal=True),
      arrays=gains,
      stats=True,
      flags=("is_causal", "return_stats"),
      static=(("scale", 0.5), ("softcap", 3.0), ("window", (2, 0)), ("eps", 1e-6)),
      choices=(("norm", NORMS),),
      defects=(("norm", ("l3",)), ("eps", (0.0, -1.0))),
      dense_keywords=QK_NORM_KEYWORDS,
      context=True,
      extreme_values=True,
    ),
  )


OP = op.register(dense.front_end("qk_norm", _samples))

qk_norm_attention = deprecation.renamed_keywords(
  static.jit(
    _qk_norm_attention, ("norm", "eps", "implementation") + options.static(QK_NORM_KEYWORDS)
  ),
  "qk_norm_attention",
  RENAMED_KEYWORDS,
)
