"""The model probe: runs an ``attnjax.nn.TransformerLM`` once and computes every statistic.

:func:`.capture_from_model` records one forward pass (through the one reader,
:mod:`attnjax.nn.intermediates`) into an ``attnjax.stats.ProbeCapture``; the
statistics themselves are the pure ``attnjax.stats.probe_statistics``. The
probe asks each layer what it does instead of re-deriving it:
``Attention.allowed_mask`` gives the pairs the layer allows, and
``Attention.compared_qk`` turns the raw projections into the q and k its
attention function compares (QK norm, gains, RoPE).

For example:

>>> import json
>>> import jax
>>> from flax import nnx
>>> from attnjax import nn, stats
>>> from attnjax.nn import probe as probe_lib
>>> cfg = nn.ModelConfig(vocab_size=64, d_model=32, num_layers=2,
...                      attention=nn.AttentionConfig(num_heads=4))
>>> model = nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
>>> probe_tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 64)  # usually [B, >= 64]
>>> out = probe_lib.probe(model, probe_tokens, length=16)
>>> flat = json.dumps(stats.to_jsonable(out))
>>> len(out["f_attn/per_layer"]), bool(0 <= out["sink_rate/rate"] <= 100)
(2, True)
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnjax.attention_stats import AttentionStats
from attnjax.nn import intermediates
from attnjax.nn.transformer import TransformerLM
from attnjax.stats.inputs import check_probability, shape_of, stats_layers
from attnjax.stats.capture import ProbeCapture, probe_statistics

Array = jnp.ndarray


def _fill_missing_fields(stats: list) -> list:
  """Layers of different families may lack a field others have: NaN there (not defined)."""
  for field in AttentionStats._fields:
    present = [getattr(st, field) for st in stats if getattr(st, field) is not None]
    if present and len(present) < len(stats):
      nan = jnp.full(jnp.shape(present[0]), jnp.nan, jnp.float32)
      stats = [st if getattr(st, field) is not None else st._replace(**{field: nan})
               for st in stats]
  return stats


def capture_from_model(model: TransformerLM, tokens: Array, *,
                       weights: bool = True) -> ProbeCapture:
  """Runs ``model`` (an ``attnjax.nn.TransformerLM``) once and gathers a ``ProbeCapture``.

  Uses ``nnx.capture``: the layers' sown ``nnx.Intermediate`` values
  (``AttentionStats``, gate means, weights with ``weights=True``) and, through
  ``method_outputs``, each module's call output: the q/k/v projections and
  every block's output hidden state, so no model code changes. Each layer
  gives its allowed pairs (``Attention.allowed_mask``) and the q/k it
  compares (``Attention.compared_qk``). Traceable: :func:`~attnjax.nn.probe.probe` runs it
  inside ``nnx.jit``.

  Args:
    model: an ``attnjax.nn.TransformerLM``.
    tokens: ``[B, T]`` integer tokens.
    weights: also collect the attention weights ``[B, N, T, S]`` per layer.

  Returns:
    An ``attnjax.stats.ProbeCapture``.

  Raises:
    ValueError: when layers differ in their head layout (N, K, H).
  """
  def forward(m, t):
    return m(t, sow_weights=True if weights else None)

  logits, inter = nnx.capture(forward, nnx.Intermediate,
                              method_outputs=nnx.Intermediate)(model, tokens)
  recorded = intermediates.read(inter, len(model.blocks))
  B, T = tokens.shape
  stats, ws, qs, ks, vs, hidden, gates, nulls, masks = [], [], [], [], [], [], [], [], []
  for block, layer in zip(model.blocks, recorded.layers):
    attention = block.attention
    N, K, H = attention.num_heads, attention.num_kv_heads, attention.head_dim
    stats.append(layer.get("attention/attention_stats", AttentionStats()))
    if weights:
      ws.append(layer["attention/weights"])
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
  if len({q.shape for q in qs}) > 1 or len({k.shape for k in ks}) > 1:
    raise ValueError("probe needs the same head layout in every layer (N, K, H); got "
                     f"q shapes {[q.shape for q in qs]}, k shapes {[k.shape for k in ks]}")
  # Layers with a k/v bias slot have one more key: pad the others with zero
  # weights and disallowed columns.
  S = max([w.shape[-1] for w in ws] + [m.shape[-1] for m in masks])
  pad = lambda x, value: jnp.pad(x, ((0, 0),) * 3 + ((0, S - x.shape[-1]),),
                                 constant_values=value)
  return ProbeCapture(
      logits=logits,
      attention_stats=stats_layers(_fill_missing_fields(stats)),
      weights=jnp.stack([pad(w.astype(jnp.float32), 0.0) for w in ws]) if ws else None,
      allowed=jnp.stack([pad(m, False) for m in masks]),
      q=jnp.stack(qs), k=jnp.stack(ks), v=jnp.stack(vs), hidden=jnp.stack(hidden),
      gate_mean=jnp.stack(gates) if any("attention/gate_mean" in layer
                                        for layer in recorded.layers) else None,
      null_column=jnp.asarray(nulls))


def _probe_pass(model, tokens, *, weights: bool, options: tuple) -> dict:
  capture = capture_from_model(model, tokens, weights=weights)
  out = probe_statistics(capture, **dict(options))
  # Next-token cross-entropy of the probe batch (nats), beside the statistics.
  logp = jax.nn.log_softmax(capture.logits[:, :-1].astype(jnp.float32), axis=-1)
  target = tokens[:, 1:]
  out["loss"] = -jnp.mean(jnp.take_along_axis(logp, target[..., None], axis=-1))
  return out


_probe_jit = nnx.jit(_probe_pass, static_argnames=("weights", "options"))


def probe(model, tokens, *, length: Optional[int] = 64, weights: bool = True,
          eps: float = 0.3, sparsity_threshold: float = 0.01, z_loss_coef: float = 1e-4,
          massive_abs: float = 100.0, massive_ratio: float = 1000.0) -> dict:
  """Every per-layer / per-head statistic of a model on a fixed probe batch, in one jitted pass.

  Runs :func:`.capture_from_model` and ``attnjax.stats.probe_statistics`` under one
  ``nnx.jit`` and adds ``loss``, the next-token cross-entropy of the batch.
  Gu et al. measure sinks on held-out sequences of length 64; ``length``
  keeps the first ``length`` tokens of each sequence (None: all).

  Args:
    model: an ``attnjax.nn.TransformerLM``.
    tokens: ``[B, T]`` integer tokens (a fixed batch: the same every time).
    length: probe length (``T >= length`` required), or None.
    weights: collect full attention weights (needed for exact ``alpha_k`` with
      k/v bias slots and for sparsity; ``O(L B N T^2)``).
    eps, sparsity_threshold, z_loss_coef, massive_abs, massive_ratio: see
      ``attnjax.stats.probe_statistics``.

  Returns:
    ``dict[str, Array]``: the keys of ``attnjax.stats.probe_statistics`` plus ``loss``;
    ``attnjax.stats.to_jsonable`` makes it JSON.

  Raises:
    TypeError: ``model`` is not a ``TransformerLM``.
    ValueError: bad tokens, or fewer than ``length`` of them.
  """
  if not isinstance(model, TransformerLM):
    raise TypeError(
        f"probe takes an attnjax.nn.TransformerLM, got {type(model).__name__}; for another "
        f"model fill a ProbeCapture from its forward pass and call probe_statistics")
  if np.ndim(tokens) != 2 or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
    raise ValueError(f"tokens must be integer [B, T], got shape {shape_of(tokens)} and dtype "
                     f"{jnp.result_type(tokens)}")
  if length is not None:
    if np.shape(tokens)[1] < length:
      raise ValueError(f"tokens have T={np.shape(tokens)[1]} < length={length}; pass a longer "
                       f"probe batch or length=None")
    tokens = tokens[:, :length]
  if np.shape(tokens)[1] < 2 or np.shape(tokens)[0] < 1:
    raise ValueError(f"probe needs at least one sequence of two tokens, got {shape_of(tokens)}")
  eps = check_probability("eps", eps)
  sparsity_threshold = check_probability("sparsity_threshold", sparsity_threshold)
  options = (("eps", eps), ("sparsity_threshold", sparsity_threshold),
             ("z_loss_coef", float(z_loss_coef)), ("massive_abs", float(massive_abs)),
             ("massive_ratio", float(massive_ratio)))
  return _probe_jit(model, jnp.asarray(tokens), weights=bool(weights), options=options)
