"""Outlier statistics of a model in one jitted pass: :func:`attnjax.nn.outlier_stats`.

Implementation behind the public module :mod:`attnjax.nn`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax.numpy as jnp
from flax import nnx

from attnjax._src.nn import _layers, intermediates
from attnjax._src.nn.encoder import EncoderLM
from attnjax._src.nn.transformer import TransformerLM
from attnjax._src.stats.outliers import POSITIONS, outlier_arrays, masked_lm_loss

Array = jnp.ndarray


def _loss(model, logits, tokens, targets):
  if targets is None:  # a decoder's next-token loss
    return masked_lm_loss(logits[:, :-1], tokens[:, 1:])
  return masked_lm_loss(logits, targets)


def _pass(model, tokens, targets, inputs, *, delimiter_ids, top_k, bits):
  def forward(m):
    return m(tokens, sow_hidden=True, **inputs)

  logits, inter = nnx.capture(forward, nnx.Intermediate)(model)
  recorded = intermediates.read(inter, len(model.blocks))
  out: dict[str, Any] = {}
  mask = inputs.get("attention_mask")
  for name in POSITIONS:
    layers = [intermediates.find(layer, name) for layer in recorded.layers]
    if any(x is None for x in layers):
      continue  # attention-only blocks have no MLP output
    out[name] = outlier_arrays(
      jnp.stack(layers), tokens, delimiter_ids, attention_mask=mask, top_k=top_k
    )
  out["loss"] = _loss(model, logits, tokens, targets)
  if bits is not None:
    with _layers.fake_quantization(bits):
      quantized = model(tokens, **inputs)
    out["loss_w8a8" if bits == 8 else f"loss_w{bits}a{bits}"] = _loss(
      model, quantized, tokens, targets
    )
    out["logits_change"] = jnp.max(jnp.abs(quantized - logits))
  return out


_jit_pass = nnx.jit(_pass, static_argnames=("delimiter_ids", "top_k", "bits"))


def outlier_stats(
  model: TransformerLM,
  tokens: Array,
  *,
  targets: Optional[Array] = None,
  attention_mask: Optional[Array] = None,
  token_type_ids: Optional[Array] = None,
  delimiter_ids: Sequence[int] = (),
  top_k: int = 100,
  bits: Optional[int] = 8,
  jit: bool = True,
) -> dict[str, Any]:
  """Outlier statistics per layer and the loss in float and under W8A8, in one jitted pass.

  Runs the model once as it is (capturing each block's attention output, MLP output and
  residual stream) and once with every linear layer's weight and input fake-quantised
  (per-tensor, ``bits`` wide: :func:`attnjax.stats.fake_quantize`), as Bondarenko et al.
  2023 report a model's outliers beside its W8A8 accuracy.

  Args:
    model: an ``attnjax.nn.EncoderLM`` (or ``TransformerLM``).
    tokens: ``[B, T]`` int: the (masked) input tokens.
    targets: ``[B, T]`` int: the tokens to predict, ``-1`` where not scored (an encoder's
      masked-LM targets); None for a decoder: the next token.
    attention_mask, token_type_ids: an encoder's padding mask and token types ``[B, T]``.
    delimiter_ids: the delimiter token ids (``[SEP]``, ``.``, ``,``).
    top_k: how many of the largest entries the delimiter and first-token shares count.
    bits: the fake quantisation's width (None: no quantised pass).
    jit: under ``nnx.jit`` (False: eagerly, or inside your own trace).

  Returns:
    ``{"attn_out", "mlp_out", "hidden": attnjax.stats.OutlierStats (each field [L]),
    "loss": float loss, "loss_w8a8": the quantised model's loss, "logits_change":
    max |logits_w8a8 - logits|}``.

  Raises:
    TypeError: ``model`` is not an attnjax LM.
    ValueError: an encoder without ``targets``, or mis-shaped inputs.
  """
  if not isinstance(model, TransformerLM):
    raise TypeError(
      f"outlier_stats takes an attnjax.nn.TransformerLM or EncoderLM, got {type(model).__name__}"
    )
  encoder = isinstance(model, EncoderLM)
  tokens = jnp.asarray(tokens)
  if encoder and targets is None:
    raise ValueError("targets: an encoder's loss needs its masked-LM targets [B, T] (-1 unscored)")
  if targets is not None and jnp.shape(targets) != tokens.shape:
    raise ValueError(
      f"targets must be [B, T] = {tokens.shape} like tokens, got {jnp.shape(targets)}"
    )
  inputs = {}
  for name, value in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
    if value is not None:
      if not encoder:
        raise ValueError(f"{name}: an argument of an attnjax.nn.EncoderLM, got a TransformerLM")
      inputs[name] = jnp.asarray(value)
  if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
    raise ValueError(f"top_k must be an int >= 1, got {top_k!r}")
  run = _jit_pass if jit else _pass
  return run(
    model,
    tokens,
    None if targets is None else jnp.asarray(targets),
    inputs,
    delimiter_ids=tuple(int(i) for i in delimiter_ids),
    top_k=top_k,
    bits=bits,
  )
