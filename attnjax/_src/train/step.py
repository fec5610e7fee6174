"""Pure, jittable ``train_step`` and ``eval_step`` over an NNX model split into (graphdef, state).

The model is split once with ``nnx.split(model, nnx.Param, ...)``: the
parameters are the differentiated pytree, everything else (random-feature
keys, buffers) is ``rest`` and passes through unchanged. Each step merges a
fresh module from the arrays it receives, so the step is a pure function of
``(state, rest, batch)`` and can be jitted, sharded and checkpointed as plain
pytrees. Metrics stay on the device: the loop reads them every
``train.log_every`` steps, never inside the step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from attnjax._src.attention_stats import AttentionStats
from attnjax._src.nn import intermediates as nn_intermediates

Array = jax.Array


def attention_stats_by_layer(intermediates: Any) -> list[AttentionStats]:
  """The ``AttentionStats`` sown by each attention layer, in layer order.

  Reads an ``nnx.Intermediate`` state of a ``TransformerLM`` forward through
  :func:`attnjax.nn.intermediates.read`, the reader ``attnjax.nn.layer_stats``
  uses; layers that sowed none are skipped.
  """
  layers = nn_intermediates.read(intermediates).layers
  found = [nn_intermediates.find(layer, "attention_stats") for layer in layers]
  return [s for s in found if isinstance(s, AttentionStats)]


def summarize_attention(stats: list[AttentionStats]) -> dict[str, Array]:
  """Per-layer ``[L]`` float32 arrays: max logit, mean/min-over-heads entropy, F-Attn.

  F-Attn (Qiu et al. 2025) is the mean weight on key 0 over queries ``i >= 1``
  (0-based), which is ``AttentionStats.sink_mass``; layers whose family has no
  such quantity (e.g. unnormalised linear attention) give NaN so the column
  stays aligned with the layers.
  """
  out: dict[str, Array] = {}
  if not stats:
    return out

  def per_layer(fn, field):
    values = []
    for s in stats:
      x = getattr(s, field)
      values.append(jnp.float32(jnp.nan) if x is None else fn(x.astype(jnp.float32)))
    return jnp.stack(values)

  out["max_logit"] = per_layer(jnp.max, "max_logit")
  out["entropy"] = per_layer(jnp.mean, "entropy")
  out["entropy_min"] = per_layer(lambda e: jnp.min(jnp.mean(e, axis=0)), "entropy")
  out["f_attn"] = per_layer(jnp.mean, "sink_mass")
  return out


def _rms(tree: Any) -> Array:
  leaves = [jnp.asarray(x, jnp.float32) for x in jax.tree.leaves(tree)]
  total = sum(jnp.sum(jnp.square(x)) for x in leaves)
  count = sum(x.size for x in leaves)
  return jnp.sqrt(total / max(count, 1))


def cross_entropy(logits: Array, targets: Array) -> Array:
  """Per-token cross-entropy (nats), float32 ``[B, T]``."""
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)


def forward(
  graphdef: nnx.GraphDef,
  params: Any,
  rest: Any,
  inputs: Array,
  *,
  stats: bool,
  packing: Optional[dict[str, Array]] = None,
) -> tuple[Array, Array, dict[str, Array]]:
  """``(logits [B, T, V], log Z [B, T], per-layer attention summary)`` of a merged model.

  With ``stats=True`` the forward runs under ``nnx.capture(..., nnx.Intermediate)``
  so the layers compute and sow their ``AttentionStats``; otherwise they skip it.
  ``packing`` (a packed batch's ``segment_ids`` and ``positions``) goes to the model.
  """
  model = nnx.merge(graphdef, params, rest)
  kw = (
    {}
    if packing is None
    else dict(segment_ids=packing["segment_ids"], positions=packing["positions"])
  )
  if not stats:
    logits, log_z = model(inputs, return_log_z=True, **kw)
    return logits, log_z, {}
  (logits, log_z), inter = nnx.capture(
    lambda m, x: m(x, return_log_z=True, **kw), nnx.Intermediate
  )(model, inputs)
  return logits, log_z, summarize_attention(attention_stats_by_layer(inter))


def weight_total(packing: dict[str, Array]) -> Array:
  """The denominator of a packed batch's weighted mean: ``max(sum(weights), 1)``, float32."""
  return jnp.maximum(jnp.sum(packing["weights"].astype(jnp.float32)), 1.0)


def mean_loss(
  values: Array, packing: Optional[dict[str, Array]], total: Optional[Array] = None
) -> Array:
  """Mean of ``[B, T]`` per-token values; a packed batch weighs them by ``packing["weights"]``.

  The weights are 0 where a target crosses into the next document, so those
  targets count nowhere (neither in the sum nor in the count).

  Args:
    values: ``[B, T]`` per-token values.
    packing: a packed batch's ``{"segment_ids", "positions", "weights"}``, or None.
    total: for a packed batch, the denominator; defaults to ``weight_total``
      of ``packing``. A microbatch passes the whole batch's total, so that its
      weighted sum divided by it adds up over the microbatches to the whole
      batch's weighted mean.

  Returns:
    A float32 scalar.
  """
  if packing is None:
    return jnp.mean(values)
  w = packing["weights"].astype(jnp.float32)
  return jnp.sum(values * w) / (weight_total(packing) if total is None else total)


def make_train_step(
  graphdef: nnx.GraphDef,
  optimizer: optax.GradientTransformation,
  *,
  z_loss: float = 0.0,
  stats: bool = True,
  microbatches: int = 1,
) -> Callable:
  """``train_step(state, rest, inputs, targets) -> (state, metrics)``; pure, jit it outside.

  Args:
    graphdef: from ``nnx.split(model, nnx.Param, ...)``.
    optimizer: the optax transformation (see ``attnjax._src.train.optim``).
    z_loss: coefficient of ``mean((log Z)^2)`` added to the loss (Wortsman sec. 3.1.2).
    stats: compute per-layer attention statistics in the training forward.
    microbatches: split the batch into this many equal microbatches and sum
      their gradients in a ``lax.scan`` (gradient accumulation): the same update
      as the whole batch up to float summation order, with a working set
      ``microbatches`` times smaller (on a CPU, one that fits in cache). Rows
      ``m, m + M, m + 2M, ...`` form microbatch ``m``, so a batch sharded over
      devices stays sharded. An unpacked batch's loss is the mean of the
      microbatches' means; a packed batch's is the whole batch's weighted mean
      even when the microbatches hold different numbers of weighted targets:
      the total weight is summed once over the whole batch and each microbatch
      adds its weighted sum divided by it.

  Returns:
    The step ``train_step(state, rest, inputs, targets, packing=None)``; ``packing``
    is a packed batch's ``{"segment_ids", "positions", "weights"}`` ``[B, T]``
    (:meth:`attnjax.data.Batch.packing`): the model sees the segments and
    positions, and the losses weigh targets by ``weights``. ``state`` is
    ``{"params", "opt_state", "step", "initial_loss"}``; ``metrics``
    holds float32 device scalars (``loss`` is the cross-entropy before the
    update; ``total_loss`` adds the z-loss) and per-layer ``[L]`` arrays.
  """

  def loss_fn(params, rest, inputs, targets, packing=None, total_weight=None):
    logits, log_z, layer_stats = forward(
      graphdef, params, rest, inputs, stats=stats, packing=packing
    )
    ce = cross_entropy(logits, targets)
    loss = mean_loss(ce, packing, total_weight)
    z_term = z_loss * mean_loss(jnp.square(log_z), packing, total_weight)
    aux = {"loss": loss, "z_loss": z_term, "log_z": jnp.mean(log_z), **layer_stats}
    return loss + z_term, aux

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def accumulated(params, rest, inputs, targets, packing=None):
    B, T = inputs.shape
    if B % microbatches:
      raise ValueError(f"batch size {B} is not divisible by microbatches={microbatches}")
    split = lambda x: jnp.swapaxes(jnp.reshape(x, (B // microbatches, microbatches, T)), 0, 1)

    # A packed microbatch divides its weighted sums by the whole batch's total
    # weight, so the sums over microbatches are the whole batch's weighted means.
    kw = {} if packing is None else {"total_weight": weight_total(packing)}

    def body(acc, batch):
      (total, aux), grads = grad_fn(params, rest, *batch, **kw)
      return jax.tree.map(jnp.add, acc, (total, aux, grads)), aux.get("max_logit")

    first = lambda x: x[: B // microbatches]
    batch = (inputs, targets) if packing is None else (inputs, targets, packing)
    shapes = jax.eval_shape(grad_fn, params, rest, *jax.tree.map(first, batch))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    zeros = (zeros[0][0], zeros[0][1], zeros[1])
    (total, aux, grads), max_logits = jax.lax.scan(body, zeros, jax.tree.map(split, batch))
    scale = 1.0 / microbatches
    if packing is None:
      total, aux, grads = jax.tree.map(lambda x: x * scale, (total, aux, grads))
    else:  # the losses and gradients are sums already; the rest are means of means
      aux = {k: v if k in ("loss", "z_loss") else v * scale for k, v in aux.items()}
    if max_logits is not None:  # a maximum, not a mean, over microbatches
      aux["max_logit"] = jnp.max(max_logits, axis=0)
    return (total, aux), grads

  def train_step(state, rest, inputs, targets, packing=None):
    if microbatches == 1:
      (total, aux), grads = grad_fn(state["params"], rest, inputs, targets, packing)
    else:
      (total, aux), grads = accumulated(state["params"], rest, inputs, targets, packing)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = dict(
      aux,
      total_loss=total,
      grad_norm=optax.tree.norm(grads),
      update_rms=_rms(updates),
      param_rms=_rms(params),
    )
    return dict(state, params=params, opt_state=opt_state, step=state["step"] + 1), metrics

  return train_step


def make_eval_step(graphdef: nnx.GraphDef) -> Callable:
  """The evaluation step of a model: summed next-token cross-entropy and its count.

  Args:
    graphdef: the model's ``nnx.GraphDef`` (``nnx.split(model)[0]``).

  Returns:
    ``eval_step(params, rest, inputs, targets, packing=None) -> {"ce_sum", "count"}``,
    pure (jit it outside): ``inputs`` and ``targets`` integer ``[B, T]``, ``packing``
    the packed batch's ``{"segment_ids", "positions", "weights"}`` ``[B, T]`` or None;
    float32 scalars, a packed batch counting only targets of weight 1.
  """

  def eval_step(params, rest, inputs, targets, packing=None):
    logits, _, _ = forward(graphdef, params, rest, inputs, stats=False, packing=packing)
    ce = cross_entropy(logits, targets)
    if packing is None:
      return {"ce_sum": jnp.sum(ce), "count": jnp.float32(ce.size)}
    w = packing["weights"].astype(jnp.float32)
    return {"ce_sum": jnp.sum(ce * w), "count": jnp.sum(w)}

  return eval_step
