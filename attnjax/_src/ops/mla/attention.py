"""Multi-head latent attention (DeepSeek V2/V3): keys and values rebuilt from one latent per token.

A front end of the dense op: its op, ``"mla"``, takes the dense call of the form chosen
(expanded or absorbed) and has dense's engines, in dense's order. Implementation behind the
public module :mod:`attnjax.mla`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import op, options, static, validators
from attnjax._src.ops.dense import attention as dense

Array = jnp.ndarray

# The dense keywords mla_attention forwards (attnjax.options.KEYWORDS): all but the similarity
# (the absorbed form keeps dot products, not distances).
DENSE_KEYWORDS = options.keywords(without=("similarity",))


def absorbed_is_cheaper(T: int, S: int, R: int, d_n: int, d_r: int, d_v: int) -> bool:
  """Whether the absorbed form costs fewer multiply-adds than the expanded one, per head.

  Expanded: ``S R (d_n + d_v)`` to rebuild keys and values, ``T S (d_n + d_r + d_v)`` to
  attend. Absorbed: ``T R (d_n + d_v)`` to fold ``W_UK`` into the queries and ``W_UV`` into
  the output, ``T S (2 R + d_r)`` to attend over the latent. Decode (``T`` small, ``S``
  long) is absorbed; a prefill or a training step (``T = S``) is expanded.

  Args:
    T: queries.
    S: keys.
    R: ``kv_lora_rank``.
    d_n: the per-head key part without RoPE.
    d_r: the shared RoPE part.
    d_v: the value head dim.

  Returns:
    True where :func:`attnjax.mla_attention` with ``absorb=None`` absorbs.
  """
  expanded = S * R * (d_n + d_v) + T * S * (d_n + d_r + d_v)
  absorbed = T * R * (d_n + d_v) + T * S * (2 * R + d_r)
  return absorbed < expanded


class LatentCall:
  """The up-projections of an MLA call and its form: the dense call the op runs, and the step
  that makes its result the MLA call's.

  The op runs dense's engines on one of two dense calls, built once per call
  (:meth:`dense_call`) from the call's inputs (``q``, ``k`` = ``k_rope``, ``v`` =
  ``latent``, and the dense call's masks, bias and modifiers):

  - expanded: keys ``[c W_UK | k_rope]`` and values ``c W_UV``, ``N`` heads each: attention
    with ``d_qk = d_n + d_r`` and ``d_v`` (the definition);
  - absorbed: MQA with one key/value head over ``[c | k_rope]``: queries
    ``[q_nope W_UK^T | q_rope]``, values ``c``, and :meth:`finish` applies ``W_UV`` to the
    ``[B, T, N, R]`` output. The logits are the same numbers.

  Attributes:
    w_uk: ``[R, N, d_n]``.
    w_uv: ``[R, N, d_v]``.
    absorb: the form, decided when the call was validated.
  """

  def __init__(self, w_uk: Array, w_uv: Array, absorb: bool):
    self.w_uk, self.w_uv, self.absorb = w_uk, w_uv, absorb
    self._dense: Optional[tuple] = None

  def dense_call(
    self, inputs: options.DenseInputs, opts: options.DenseOptions
  ) -> tuple[options.DenseInputs, options.DenseOptions]:
    """The dense call this MLA call runs as (its form's), built on the first request."""
    if self._dense is None:
      build = absorbed_inputs if self.absorb else expanded_inputs
      self._dense = (build(inputs, self.w_uk, self.w_uv), opts)
    return self._dense

  def finish(self, result, opts: options.DenseOptions, dtype):
    """The dense call's result as the MLA call's: absorbed outputs times ``W_UV``."""
    if not self.absorb:
      return result
    out, stats = result if opts.return_stats else (result, None)
    out = _einsum("btnr,rnv->btnv", out, self.w_uv, dtype)
    return (out, stats) if opts.return_stats else out


def _einsum(spec: str, x: Array, w: Array, dtype) -> Array:
  """``einsum(spec, x, w)`` accumulated in float32, returned in ``dtype``."""
  out = jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=jnp.float32)
  return out.astype(dtype)


def expanded_inputs(inputs: options.DenseInputs, w_uk: Array, w_uv: Array) -> options.DenseInputs:
  """The expanded dense inputs of an MLA call: ``N`` key heads ``[c W_UK | k_rope]`` and
  values ``c W_UV`` (``inputs.k`` is ``k_rope [B, S, 1, d_r]``, ``inputs.v`` the latent
  ``[B, S, 1, R]``)."""
  latent, k_rope = inputs.v[:, :, 0], inputs.k
  dtype = inputs.q.dtype
  k_nope = _einsum("bsr,rnd->bsnd", latent, w_uk, dtype)
  B, S, N, _ = k_nope.shape
  k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (B, S, N, k_rope.shape[3]))], axis=-1)
  v = _einsum("bsr,rnv->bsnv", latent, w_uv, dtype)
  return dataclasses.replace(inputs, k=k, v=v)


def absorbed_inputs(inputs: options.DenseInputs, w_uk: Array, w_uv: Array) -> options.DenseInputs:
  """The absorbed dense inputs of an MLA call: MQA over ``[c | k_rope]``, queries
  ``[q_nope W_UK^T | q_rope]``, values ``c`` (``W_UV`` is applied to the output)."""
  del w_uv
  q, latent, k_rope = inputs.q, inputs.v, inputs.k
  d_n = q.shape[3] - k_rope.shape[3]
  q_latent = _einsum("btnd,rnd->btnr", q[..., :d_n], w_uk, q.dtype)
  q_abs = jnp.concatenate([q_latent, q[..., d_n:]], axis=-1)
  k_abs = jnp.concatenate([latent, k_rope], axis=-1)
  return dataclasses.replace(inputs, q=q_abs, k=k_abs, v=latent)


# ---------------------------------------------------------------------------
# Validation.


def check_shapes(q, k_rope, latent, w_uk, w_uv) -> tuple[int, int, int, int, int]:
  """Checks an MLA call's arrays; returns ``(R, N, d_n, d_r, d_v)``.

  Raises:
    ValueError: a wrong rank, a latent or rope key with more than one head, sizes that
      disagree, a non-positive ``R``, ``d_n``, ``d_r`` or ``d_v`` (each named with the
      shapes seen).
    TypeError: a non-floating array, or ``q``, ``k_rope`` and ``latent`` of different dtypes.
  """
  shapes = {
    n: validators.shape_of(x) for n, x in (("q", q), ("k_rope", k_rope), ("latent", latent))
  }
  for name, letters in (("q", "[B, T, N, d_n + d_r]"), ("k_rope", "[B, S, 1, d_r]")):
    if len(shapes[name]) != 4:
      raise ValueError(f"{name} must have rank 4 {letters}, got shape {shapes[name]}")
  if len(shapes["latent"]) != 4:
    raise ValueError(f"latent must have rank 4 [B, S, 1, R], got shape {shapes['latent']}")
  for name, w, letters in (("w_uk", w_uk, "[R, N, d_n]"), ("w_uv", w_uv, "[R, N, d_v]")):
    if len(validators.shape_of(w)) != 3:
      raise ValueError(f"{name} must have rank 3 {letters}, got shape {validators.shape_of(w)}")
  for name, x in (("q", q), ("k_rope", k_rope), ("latent", latent), ("w_uk", w_uk), ("w_uv", w_uv)):
    validators.check_floating(name, x)
  if not (q.dtype == k_rope.dtype == latent.dtype):
    raise TypeError(
      f"q, k_rope and latent must share a dtype, got {q.dtype}, {k_rope.dtype}, {latent.dtype}"
    )
  B, T, N, Hq = q.shape
  R, d_n, d_r, d_v = latent.shape[3], w_uk.shape[2], k_rope.shape[3], w_uv.shape[2]
  seen = (
    f"q {shapes['q']}, k_rope {shapes['k_rope']}, latent {shapes['latent']}, "
    f"w_uk {tuple(w_uk.shape)}, w_uv {tuple(w_uv.shape)}"
  )
  if k_rope.shape[2] != 1 or latent.shape[2] != 1:
    raise ValueError(f"k_rope and latent have one head (axis 2 of size 1), got {seen}")
  if k_rope.shape[:2] != latent.shape[:2] or k_rope.shape[0] != B:
    raise ValueError(
      f"q, k_rope and latent must agree on the batch B and k_rope, latent on S; got {seen}"
    )
  if min(R, d_n, d_r, d_v) <= 0:
    raise ValueError(
      f"head dims must be positive: kv_lora_rank R={R} (latent), d_n={d_n} (w_uk), "
      f"d_r={d_r} (k_rope), d_v={d_v} (w_uv); got {seen}"
    )
  if w_uk.shape[:2] != (R, N) or w_uv.shape[:2] != (R, N):
    raise ValueError(
      f"w_uk and w_uv must be [R, N, .] with R={R} (the latent's width) and N={N} (q's "
      f"heads), got {seen}"
    )
  if Hq != d_n + d_r:
    raise ValueError(
      f"q's head dim must be d_n + d_r = {d_n} + {d_r} = {d_n + d_r} ([nope | rope]), got {seen}"
    )
  return R, N, d_n, d_r, d_v


def _mla(
  q,
  k_rope,
  latent,
  w_uk,
  w_uv,
  *,
  bias,
  mask,
  is_causal,
  scale,
  normalizer,
  normalizer_params,
  sink_logits,
  softcap,
  window,
  segment_ids,
  return_stats,
  score_mod,
  score_mod_args,
  mask_mod,
  mask_mod_args,
  block_layout,
  context_axis,
  context_strategy,
  context_layout,
  absorb,
  implementation,
):
  R, N, d_n, d_r, d_v = check_shapes(q, k_rope, latent, w_uk, w_uv)
  B, T, S = q.shape[0], q.shape[1], latent.shape[1]
  # The dense keywords validated on the expanded call's shapes (the default scale is then
  # (d_n + d_r) ** -0.5), then the call's own arrays in place of the placeholders.
  shape = lambda *s: jax.ShapeDtypeStruct(s, q.dtype)
  inputs, opts = options.validate(
    shape(B, T, N, d_n + d_r),
    shape(B, S, N, d_n + d_r),
    shape(B, S, N, d_v),
    **options.forwarded(DENSE_KEYWORDS, locals()),
  )
  inputs = dataclasses.replace(inputs, q=q, k=k_rope, v=latent)
  if absorb is None:
    absorb = absorbed_is_cheaper(T, S, R, d_n, d_r, d_v)
  # The op runs the form's dense call (its empty answer, context strategy and engines are
  # dense's); the absorbed form's [B, T, N, R] result then meets W_UV.
  form = LatentCall(w_uk, w_uv, absorb)
  return form.finish(op.run(OP, form.dense_call(inputs, opts), implementation), opts, q.dtype)


_mla_jit = static.jit(_mla, options.static(DENSE_KEYWORDS) + ("absorb", "implementation"), flags=())


def _mla_attention(
  q: Array,
  k_rope: Array,
  latent: Array,
  w_uk: Array,
  w_uv: Array,
  *,
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
  return_stats: bool = False,
  score_mod: Optional[Callable[..., Any]] = None,
  score_mod_args: Any = None,
  mask_mod: Optional[Callable[..., Any]] = None,
  mask_mod_args: Any = None,
  block_layout: Any = None,
  context_axis: Optional[str] = None,
  context_strategy: options.ContextStrategy = "ring",
  context_layout: Optional[options.ContextLayout] = None,
  absorb: Optional[bool] = None,
  implementation: Optional[dense.ImplementationName] = None,
):
  """Multi-head latent attention over one cached latent per key (DeepSeek V2/V3, Kimi).

  Per head ``n``, keys are ``[c_j W_UK[:, n] | k_rope_j]`` and values ``c_j W_UV[:, n]``,
  rebuilt from the latent ``c_j`` (``R = kv_lora_rank`` numbers per token) and one RoPE key
  ``k_rope_j`` that every head shares; queries are ``[q_nope | q_rope]`` per head. This is
  dense attention with ``d_qk = d_n + d_r`` and ``d_v`` (every option of
  :func:`attnjax.dot_product_attention` but ``similarity``), computed in one of two forms
  with the same logits:

  - expanded (``absorb=False``): the keys and values above, then the dense engine;
  - absorbed (``absorb=True``): MQA with one key/value head over ``[c | k_rope]``, the
    queries ``[q_nope W_UK^T | q_rope]``, values ``c``, and ``W_UV`` applied to the
    ``[B, T, N, R]`` output. What a decode step over a latent cache runs: it reads
    ``R + d_r`` numbers per cached token and never rebuilds keys or values.

  RoPE is the caller's: ``q``'s last ``d_r`` dims and ``k_rope`` arrive rotated (Kimi
  Linear's MLA rotates neither).

  Args:
    q: queries ``[B, T, N, d_n + d_r]``: per head ``[nope | rope]``.
    k_rope: the shared RoPE key ``[B, S, 1, d_r]``.
    latent: the latent ``c`` ``[B, S, 1, R]`` (DeepSeek RMS-normalises it first).
    w_uk: ``[R, N, d_n]``: the key part of ``kv_b_proj``.
    w_uv: ``[R, N, d_v]``: its value part.
    bias: float, added to the logits; broadcastable to ``[B, N, T, S]``.
    mask: boolean, True = may attend; broadcastable to ``[B, N, T, S]``.
    is_causal: query ``i`` sees keys ``j <= i + S - T``.
    normalizer: a registered normaliser's name (:mod:`attnjax.normalizers`).
    normalizer_params: a weights-only normaliser's learned parameters by name (as
      :func:`attnjax.dot_product_attention`).
    sink_logits: ``[N]`` learned null-column logits (gpt-oss).
    softcap: ``c`` for ``c * tanh(z / c)`` on the scaled logits.
    window: ``(left, right)`` or ``w`` meaning ``(w, 0)``.
    segment_ids: ``[B, T]`` ids when ``T == S``, or a pair ``([B, T], [B, S])``.
    return_stats: also return :class:`attnjax.AttentionStats`.
    score_mod, score_mod_args, mask_mod, mask_mod_args: modifiers, as in
      :func:`attnjax.dot_product_attention` (see :mod:`attnjax.mods`).
    block_layout: a :func:`attnjax.layout.from_mask_mod` layout of ``mask_mod``.
    context_axis, context_strategy, context_layout: context parallelism, as in
      :func:`attnjax.dot_product_attention`: ``q``, ``k_rope``, ``latent`` and segment ids
      sharded along time, ``w_uk`` / ``w_uv`` whole; the form's dense call goes through
      the dense strategies.
    scale: logit scale; None means ``(d_n + d_r) ** -0.5`` (DeepSeek under YaRN multiplies
      it by ``mscale(factor, mscale_all_dim) ** 2``: pass the product).
    absorb: the form; None chooses the one of fewer multiply-adds
      (:func:`attnjax.mla.absorbed_is_cheaper`: absorbed for decode, expanded for ``T = S``).
    implementation: None (auto, as dense attention's on the form's call) or a name of
      :data:`attnjax.mla.ENGINES` (dense's engines): that engine on the form's call
      (``"reference"`` materialises the weights).

  Returns:
    ``[B, T, N, d_v]`` in ``q``'s dtype, or ``(out, AttentionStats)``.
  """
  implementation = op.check_implementation(OP, implementation, where="mla_attention")
  if absorb is not None and not isinstance(absorb, bool):
    raise TypeError(f"absorb must be True, False or None, got {absorb!r}")
  return _mla_jit(
    q,
    k_rope,
    latent,
    w_uk,
    w_uv,
    absorb=absorb,
    implementation=implementation,
    **options.forwarded(DENSE_KEYWORDS, locals()),
  )


mla_attention = static.canonicalized(
  _mla_attention, options.static(DENSE_KEYWORDS) + ("absorb", "implementation")
)


# ---------------------------------------------------------------------------
# The op: a front end of dense attention (the form's dense call), with dense's engines in
# dense's order; so is its empty answer, its context strategy and its kernels' trust class.

ENGINES, PREFERENCES, FALLBACK = dense.ENGINES, dense.PREFERENCES, dense.FALLBACK
IMPLEMENTATIONS, ImplementationName = dense.IMPLEMENTATIONS, dense.ImplementationName


def _latent_arrays(q, k, v):
  """An MLA call from a drawn ``q [B, T, N, H]``, ``k, v [B, S, K, H]``: the rope key
  ``k_rope`` is ``k``'s first head past ``d_n = H // 2``, the latent ``v``'s first head
  (``R = H``), and fixed up-projections ``w_uk [R, N', d_n]``, ``w_uv [R, N', H]`` (so
  ``d_v = d_n + d_r = H``: every engine, jax.nn's included, takes the expanded call). ``N'``
  is the largest multiple of ``k``'s heads not above ``q``'s (``N`` for a valid draw), so a
  draw whose q and k disagree on heads stays a call with mismatched heads."""
  H, N, K = np.shape(q)[-1], np.shape(q)[-2], np.shape(k)[2]
  d_n, heads = H // 2, N // K * K
  rng = np.random.default_rng(0)
  w = lambda d: jnp.asarray(rng.standard_normal((H, heads, d)) * max(H, 1) ** -0.5, jnp.float32)
  return q, k[:, :, :1, d_n:], v[:, :, :1], dict(w_uk=w(d_n), w_uv=w(H))


def _samples() -> tuple[op.Sample, ...]:
  common = dict(
    arrays=_latent_arrays,
    stats=True,
    flags=("is_causal", "return_stats"),
    static=(("scale", 0.5), ("softcap", 3.0), ("window", (2, 0))),
    choices=(("absorb", (True, False, None)),),
    defects=(("absorb", (1, "yes")),),
    dense_keywords=DENSE_KEYWORDS,
    context=True,
  )
  return (
    op.Sample(mla_attention, options=dict(is_causal=True, absorb=False), **common),
    op.Sample(
      mla_attention,
      label="mla_attention_absorbed",
      options=dict(is_causal=True, absorb=True),
      **common,
    ),
  )


OP = op.register(dense.front_end("mla", _samples))
