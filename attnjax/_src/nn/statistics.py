"""Statistics per layer of an ``attnjax.nn.TransformerLM``: :func:`attnjax.nn.layer_stats`.

Implementation behind the public module :mod:`attnjax.nn.statistics`.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnjax._src.deprecation import warn_once
from attnjax._src.attention_stats import AttentionStats
from attnjax._src.nn import intermediates
from attnjax._src.nn.encoder import EncoderLM
from attnjax._src.nn.transformer import TransformerLM, _sown_stats
from attnjax._src.stats.inputs import check_probability, shape_of, stats_layers
from attnjax._src.stats.capture import LayerCapture, capture_statistics
from attnjax._src.stats.geometry import value_state_drain

Array = jnp.ndarray


def _fill_missing_fields(stats: list) -> list:
  """Layers of different families may lack a field others have: NaN there (not defined)."""
  for field in AttentionStats._fields:
    present = [getattr(st, field) for st in stats if getattr(st, field) is not None]
    if present and len(present) < len(stats):
      nan = jnp.full(jnp.shape(present[0]), jnp.nan, jnp.float32)
      stats = [
        st if getattr(st, field) is not None else st._replace(**{field: nan}) for st in stats
      ]
  return stats


def _capture(model: TransformerLM, tokens: Array, *, weights: bool = True) -> LayerCapture:
  """Runs ``model`` (an ``attnjax.nn.TransformerLM``) once and gathers a ``LayerCapture``.

  Uses ``nnx.capture``: the layers' sown ``nnx.Intermediate`` values
  (``AttentionStats``, gate means, weights with ``weights=True``) and, through
  ``method_outputs``, each module's call output: the q/k/v projections and
  every block's output hidden state, so no model code changes. Each layer
  gives its allowed pairs (``Attention.allowed_mask``) and the q/k it
  compares (``Attention.compared_qk``). Traceable: the summary view runs it
  inside ``nnx.jit``.

  Args:
    model: an ``attnjax.nn.TransformerLM``.
    tokens: ``[B, T]`` integer tokens.
    weights: also collect the attention weights ``[B, N, T, S]`` per layer.

  Returns:
    An ``attnjax.stats.LayerCapture``; its q, k and v are tuples of per-layer arrays
    where layers differ in their head layout (N, K, H), e.g. an MLA layer (``N`` key
    heads of ``d_n + d_r``) beside GQA layers.
  """

  def forward(m, t):
    return m(t, sow_weights=True if weights else None)

  logits, inter = nnx.capture(forward, nnx.Intermediate, method_outputs=nnx.Intermediate)(
    model, tokens
  )
  recorded = intermediates.read(inter, len(model.blocks))
  B, T = tokens.shape
  stats, ws, qs, ks, vs, hidden, gates, nulls, masks = [], [], [], [], [], [], [], [], []
  for block, layer in zip(model.blocks, recorded.layers):
    attention = block.attention
    N, K, H = attention.num_heads, attention.num_kv_heads, attention.head_dim
    stats.append(layer.get("attention/attention_stats", AttentionStats()))
    if weights:
      ws.append(layer["attention/weights"])
    if "attention/compared_q" in layer:  # a family that projects otherwise sows them (MLA)
      q, k, v = (layer[f"attention/compared_{x}"] for x in "qkv")
    else:
      q = jnp.reshape(layer["attention/q_proj/__call__"], (B, T, N, H))
      k = jnp.reshape(layer["attention/k_proj/__call__"], (B, T, K, H))
      v = jnp.reshape(layer["attention/v_proj/__call__"], (B, T, K, -1))
      q, k = attention.compared_qk(q, k)
    qs.append(q.astype(jnp.float32))
    ks.append(k.astype(jnp.float32))
    vs.append(v.astype(jnp.float32))
    hidden.append(layer["__call__"].astype(jnp.float32))
    gate = layer.get("attention/gate_mean")
    gates.append(jnp.full((B, N), jnp.nan, jnp.float32) if gate is None else gate)
    nulls.append(attention.config.spec.has_null_column())
    masks.append(attention.allowed_mask(T))
  same_layout = all(len({x.shape for x in xs}) == 1 for xs in (qs, ks, vs))
  layers = jnp.stack if same_layout else tuple
  # Layers with a k/v bias slot have one more key: pad the others with zero
  # weights and disallowed columns.
  S = max([w.shape[-1] for w in ws] + [m.shape[-1] for m in masks])
  pad = lambda x, value: jnp.pad(x, ((0, 0),) * 3 + ((0, S - x.shape[-1]),), constant_values=value)
  return LayerCapture(
    logits=logits,
    attention_stats=stats_layers(_fill_missing_fields(stats)),
    weights=jnp.stack([pad(w.astype(jnp.float32), 0.0) for w in ws]) if ws else None,
    allowed=jnp.stack([pad(m, False) for m in masks]),
    q=layers(qs),
    k=layers(ks),
    v=layers(vs),
    hidden=jnp.stack(hidden),
    gate_mean=jnp.stack(gates)
    if any("attention/gate_mean" in layer for layer in recorded.layers)
    else None,
    null_column=jnp.asarray(nulls),
  )


def _summary_pass(model, tokens, *, weights: bool, options: tuple) -> dict:
  capture = _capture(model, tokens, weights=weights)
  out = capture_statistics(capture, **dict(options))
  if isinstance(model, EncoderLM):
    return out  # no next token to predict: an encoder's loss is its masked-LM loss
  # Next-token cross-entropy of the batch (nats), beside the statistics.
  logp = jax.nn.log_softmax(capture.logits[:, :-1].astype(jnp.float32), axis=-1)
  target = tokens[:, 1:]
  out["loss"] = -jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1))
  return out


def _streaming_pass(model: TransformerLM, tokens: Array) -> dict:
  """The ``"streaming"`` view: the fused statistics, value drain and ``|hidden|``, O(T) memory."""

  def forward(m, t):
    return m.features(t)

  features, inter = nnx.capture(forward, nnx.Intermediate, method_outputs=nnx.Intermediate)(
    model, tokens
  )
  recorded = intermediates.read(inter, len(model.blocks))
  out = []
  for block, layer in zip(model.blocks, recorded.layers):
    st = layer["attention/attention_stats"]
    fields = {k: x for k, x in st._asdict().items() if x is not None}
    v = layer.get("attention/compared_v")  # [B, T, N, Hv]: a family that projects otherwise
    if v is None:
      v = layer["attention/v_proj/__call__"]  # [B, T, K * Hv]
      v = jnp.reshape(v, v.shape[:2] + (block.attention.num_kv_heads, -1))
    out.append(
      dict(
        fields,
        value_drain=value_state_drain(v).per_head,
        hidden_max_abs=layer["hidden_max_abs"],
        hidden_median_abs=layer["hidden_median_abs"],
        **{
          name: layer[f"attention/{name}"] for name in LAYER_EXTRAS if f"attention/{name}" in layer
        },
      )
    )
  return {"features": features, "layers": out}


#: What a layer sows beyond its ``AttentionStats`` that the ``"streaming"`` view keeps: a
#: gated layer's ``gate_mean`` and the gate's effect on the first token
#: (``first_token_mass``, ``first_token_gated`` ``[B, N]``); a recurrent layer's
#: ``decay_mean``, ``beta_mean`` ``[B, N]`` and ``state_norm`` ``[B, N, T]``.
LAYER_EXTRAS = (
  "gate_mean",
  "first_token_mass",
  "first_token_gated",
  "decay_mean",
  "beta_mean",
  "state_norm",
)


_summary_jit = nnx.jit(_summary_pass, static_argnames=("weights", "options"))
_streaming_jit = nnx.jit(_streaming_pass)
_capture_jit = nnx.jit(_capture, static_argnames=("weights",))

# The summary's statistic options at their defaults (the signature's).
_SUMMARY_DEFAULTS = (
  ("eps", 0.3),
  ("sparsity_threshold", 0.01),
  ("z_loss_coef", 1e-4),
  ("massive_abs", 100.0),
  ("massive_ratio", 1000.0),
)

#: The views of :func:`attnjax.nn.layer_stats` (its ``view=`` argument).
VIEWS = ("summary", "sown", "streaming", "capture")


def _checked_tokens(tokens, length: Optional[int], view: str) -> Array:
  """``tokens`` as an integer ``[B, T]`` array cut to ``length``, or a ValueError naming them."""
  if tokens is None:
    raise ValueError("tokens must be integer [B, T], got None")
  if np.ndim(tokens) != 2 or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
    raise ValueError(
      f"tokens must be integer [B, T], got shape {shape_of(tokens)} and dtype "
      f"{jnp.result_type(tokens)}"
    )
  if length is not None:
    if np.shape(tokens)[1] < length:
      raise ValueError(
        f"tokens have T={np.shape(tokens)[1]} < length={length}; pass a longer batch or length=None"
      )
    tokens = tokens[:, :length]
  least = 2 if view == "summary" else 1  # the summary's loss needs a next token
  if np.shape(tokens)[1] < least or np.shape(tokens)[0] < 1:
    raise ValueError(
      f"view={view!r} needs at least one sequence of {least} token(s), got "
      f"tokens of shape {shape_of(tokens)}"
    )
  return jnp.asarray(tokens)


def layer_stats(
  model,
  tokens: Optional[Array] = None,
  *,
  view: str = "summary",
  length: Optional[int] = None,
  weights: Optional[bool] = None,
  hidden: bool = False,
  jit: bool = True,
  eps: float = 0.3,
  sparsity_threshold: float = 0.01,
  z_loss_coef: float = 1e-4,
  massive_abs: float = 100.0,
  massive_ratio: float = 1000.0,
  attention_mask: Optional[Array] = None,
  token_type_ids: Optional[Array] = None,
):
  """Statistics per layer of one forward pass of ``model`` on ``tokens``.

  Views of the same pass (``view=``):

  - ``"summary"``: every statistic of ``attnjax.stats`` over the layers as a
    flat ``dict[str, Array]`` keyed ``"<metric>/<field>"`` (per-layer ``[L]``,
    per-head ``[L, N]``, scalars) plus ``loss``, the next-token cross-entropy of the
    batch (not for an ``EncoderLM``: its loss is the masked-LM loss of
    ``attnjax.nn.outlier_stats``); :func:`attnjax.stats.to_jsonable` makes it JSON. The keys are
    those the sections of ``docs/guides/diagnostics.md`` define (Sink_1^eps of
    Gu et al. on row-normalised weights, F-Attn of Qiu et al., entropy, max
    logit, null and gate mass, q/k RMS and cosine, sink geometry, value
    drain, massive activations and kurtosis, output logit drift, sparsity).
    ``model`` may instead be a :class:`~attnjax.stats.LayerCapture` filled
    from any model's forward pass (``tokens`` None): its statistics, no loss.
  - ``"sown"``: what the layers sowed, unreduced: ``{"logits" [B, T, V],
    "log_z" [B, T], "layers": [per layer {"sink_mass", "entropy",
    "max_logit", "row_sum" [B, N], "logsumexp" [B, N, T] (those the family
    defines), "q_rms" [B, N], "k_rms" [B, K], "hidden_max_abs",
    "hidden_median_abs" [B], "gate_mean" [B, N] (gated layers), "weights"
    [B, N, T, S] and "hidden" [B, T, D] when asked}]}``.
  - ``"streaming"``: a long sequence in O(T) memory, nothing ``T x T`` and no
    ``[T, V]`` logits: ``{"features" [B, T, D], "layers": [per layer the
    non-None AttentionStats fields, "value_drain" [1, K] (Guo et al.'s
    ``||v_1|| / mean ||v_j>1||``, :func:`attnjax.stats.value_state_drain`),
    "hidden_max_abs", "hidden_median_abs" [B] and what the layer sowed of
    :data:`~attnjax._src.nn.statistics.LAYER_EXTRAS` (gates' effect, recurrent state statistics)]}``; per-token NLL
    from the features is :func:`attnjax.models.token_nll`.
  - ``"capture"``: the :class:`~attnjax.stats.LayerCapture` the summary is
    computed from (q/k as the attention compares them, allowed pairs, ...).

  Args:
    model: an ``attnjax.nn.TransformerLM`` (or, for the summary, a ``LayerCapture``).
    tokens: ``[B, T]`` integer tokens (a fixed batch, the same every time, to compare
      passes: the training loop's probes).
    view: one of :data:`attnjax.nn.statistics.VIEWS`.
    length: keep the first ``length`` tokens of each sequence (``T >= length``
      required); None keeps all. Gu et al. measure sinks on length 64.
    weights: collect full attention weights (``O(L B N T^2)``; exact ``alpha_k``
      with k/v bias slots, and sparsity). None: True for ``"summary"`` and
      ``"capture"``, False for ``"sown"``; ``"streaming"`` never has them.
    hidden: ``"sown"`` only: also return each block's output hidden state.
    jit: run the pass under ``nnx.jit`` (False: eagerly, or inside your own trace).
    eps, sparsity_threshold, z_loss_coef, massive_abs, massive_ratio: ``"summary"``
      only: the ``Sink_1^eps`` threshold, the H2O sparsity threshold (fraction of
      the row maximum), the z-loss coefficient of ``output/z_loss`` and the
      massive-activation thresholds.
    attention_mask, token_type_ids: ``"sown"`` only, an ``attnjax.nn.EncoderLM``'s
      padding mask and token types ``[B, T]`` (its call's arguments).

  Returns:
    The view's value, as above.

  Raises:
    TypeError: ``model`` is neither a ``TransformerLM`` nor (summary) a ``LayerCapture``.
    ValueError: an unknown view, options the view does not take, bad tokens, or
      fewer than ``length`` of them.
  """
  if view not in VIEWS:
    raise ValueError(f"view={view!r} is not one of: {', '.join(map(repr, VIEWS))}")
  options = (
    ("eps", check_probability("eps", eps)),
    ("sparsity_threshold", check_probability("sparsity_threshold", sparsity_threshold)),
    ("z_loss_coef", float(z_loss_coef)),
    ("massive_abs", float(massive_abs)),
    ("massive_ratio", float(massive_ratio)),
  )
  changed = [f"{k}={v!r}" for (k, v), (_, d) in zip(options, _SUMMARY_DEFAULTS) if v != d]
  if changed and view != "summary":
    raise ValueError(f"{', '.join(changed)}: options of view='summary', got view={view!r}")
  if isinstance(model, LayerCapture) and view == "summary" and tokens is None:
    return capture_statistics(model, **dict(options))
  if not isinstance(model, TransformerLM):
    raise TypeError(
      f"layer_stats takes an attnjax.nn.TransformerLM (or, for view='summary', a "
      f"LayerCapture with tokens=None), got {type(model).__name__} with view={view!r}; for "
      f"another model fill a LayerCapture from its forward pass"
    )
  if view == "streaming" and weights:
    raise ValueError("view='streaming' never materialises attention weights; got weights=True")
  if hidden and view != "sown":
    raise ValueError(f"hidden=True is for view='sown', got view={view!r}")
  tokens = _checked_tokens(tokens, length, view)
  weights = bool(view != "sown" if weights is None else weights)
  if view == "summary":
    return (_summary_jit if jit else _summary_pass)(model, tokens, weights=weights, options=options)
  inputs = {
    name: value
    for name, value in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids))
    if value is not None
  }
  if inputs and (view != "sown" or not isinstance(model, EncoderLM)):
    raise ValueError(
      f"{', '.join(inputs)}: arguments of an attnjax.nn.EncoderLM's call, taken by "
      f"view='sown'; got view={view!r} and a {type(model).__name__}"
    )
  if view == "sown":
    return _sown_stats(model, tokens, weights=weights, hidden=hidden, jit=jit, inputs=inputs)
  if view == "streaming":
    return (_streaming_jit if jit else _streaming_pass)(model, tokens)
  return (_capture_jit if jit else _capture)(model, tokens, weights=weights)


# ---------------------------------------------------------------------------
# Deprecated aliases: each warns once per process and returns what it always did.


def capture_from_model(
  model: TransformerLM, tokens: Array, *, weights: bool = True
) -> LayerCapture:
  """Deprecated: ``layer_stats(model, tokens, view="capture", jit=False)``.

  Runs ``model`` once and gathers a ``LayerCapture`` (traceable).
  """
  warn_once(
    "attnjax.nn.probe.capture_from_model", "attnjax.nn.layer_stats(model, tokens, view='capture')"
  )
  return layer_stats(model, tokens, view="capture", weights=weights, jit=False)
