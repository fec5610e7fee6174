"""Cosine attention: logits are ``cos(q_i, k_j)`` times a learned per-head scale.

A front end of the dense op: its op, ``"cosine"``, takes the dense call of the unit q (times
the temperature) and unit k and has dense's engines, in dense's order. Implementation behind
the public module :mod:`attnjax.qk_norm`.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping, Optional, Union, get_args

import jax.numpy as jnp

from attnjax._src import validators, op, static, options
from attnjax._src.ops.dense import attention as dense
from attnjax._src.ops.qk_norm.attention import normalize_head

Array = jnp.ndarray

CosineConvention = Literal["swin", "scale", "ngpt"]
COSINE_CONVENTIONS: tuple[str, ...] = get_args(CosineConvention)
SWIN_MAX_LOG_SCALE = math.log(100.0)
# The dense keywords cosine_attention takes and forwards (attnjax.options.KEYWORDS): all but
# similarity (its logits are dot products) and scale (it sets its own).
COSINE_KEYWORDS = options.keywords(without=("similarity", "scale"))


def _temperature_multiplier(
  temperature: Array, convention: CosineConvention, N: int, H: int
) -> Array:
  """The per-head factor that multiplies the unit query, ``[1, 1, N, 1]`` or ``[1, 1, N, H]``."""
  validators.check_floating("temperature", temperature)
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
  t = validators.check_per_head("temperature", t, N)
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
  validators.check_qkv(q, k, v)
  validators.check_choice("convention", convention, COSINE_CONVENTIONS)
  validators.check_positive_float("eps", eps, allow_none=False)
  N, H = q.shape[2], q.shape[3]
  qn = normalize_head(q, "l2", eps) * _temperature_multiplier(temperature, convention, N, H)
  kn = normalize_head(k, "l2", eps)
  dense_keywords["scale"] = math.sqrt(H) if convention == "ngpt" else 1.0
  implementation = op.check_implementation(OP, implementation, where="cosine_attention")
  inputs, opts = options.validate(qn.astype(q.dtype), kn.astype(k.dtype), v, **dense_keywords)
  return op.run(OP, (inputs, opts), implementation)


# The engines are dense's, in dense's order (a dense call of the unit q and k).
ENGINES, PREFERENCES, FALLBACK = dense.ENGINES, dense.PREFERENCES, dense.FALLBACK
IMPLEMENTATIONS, ImplementationName = dense.IMPLEMENTATIONS, dense.ImplementationName


def _samples() -> tuple[op.Sample, ...]:
  def temperature(q, k, v):
    N = q.shape[2]
    return q, k, v, dict(temperature=1.5 + 0.1 * jnp.cos(jnp.arange(N, dtype=jnp.float32)))

  return (
    op.Sample(
      cosine_attention,
      options=dict(is_causal=True),
      arrays=temperature,
      stats=True,
      flags=("is_causal", "return_stats"),
      static=(("softcap", 3.0), ("window", (2, 0)), ("eps", 1e-6)),
      choices=(("convention", ("swin", "scale")),),
      defects=(("convention", ("cos",)), ("eps", (0.0,))),
      dense_keywords=COSINE_KEYWORDS,
      context=True,
    ),
  )


OP = op.register(dense.front_end("cosine", _samples))

cosine_attention = static.jit(
  _cosine_attention, ("convention", "eps", "implementation") + options.static(COSINE_KEYWORDS)
)
