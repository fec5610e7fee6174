"""The feed-forward layers and norms of :class:`attnjax.nn.TransformerBlock`.

:class:`MLP` (``"gelu"``, or gated ``"swiglu"`` / ``"geglu"``, optionally with biases),
:class:`MixtureOfExperts` (gpt-oss's: top-k routing and its limited SwiGLU, every expert
run on every token and weighted, exactly the routed computation) and :func:`norm`
(RMSNorm, LayerNorm, or Gemma's ``1 + w`` RMSNorm, :class:`PlusOneRMSNorm`).

Guide: docs/guides/layers.md, section "MLPs, norms and initialisation".
Implementation behind the public module :mod:`attnjax.nn`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from attnjax._src.nn import _layers

Array = jnp.ndarray

ACTIVATIONS = {
  "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
  "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
  "silu": jax.nn.silu,
}


class PlusOneRMSNorm(nnx.Module):
  """RMSNorm with gain ``1 + w`` (``w`` zero-initialised), in float32, as Gemma's.

  ``y = x / sqrt(mean(x^2) + eps) * (1 + w)`` computed in float32 and cast to
  the compute dtype (the product before the cast, unlike Llama's RMSNorm).
  """

  def __init__(self, d: int, *, eps: float, dtype, param_dtype):
    self.eps = eps
    self.dtype = jnp.dtype(dtype)
    self.scale = _layers.param(jnp.zeros((d,), param_dtype), ("embed",))

  def __call__(self, x: Array) -> Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    gain = 1.0 + jnp.reshape(self.scale[...].astype(jnp.float32), (1,) * (x.ndim - 1) + (-1,))
    return (y * gain).astype(self.dtype)


def norm(kind: str, d: int, eps: float, *, rngs, dtype, param_dtype, use_bias: bool = True):
  """A norm over the last axis of width ``d``: ``"rms"``, ``"layer"`` or ``"rms_plus_one"``.

  ``use_bias=False`` drops LayerNorm's bias (ModernBERT's ``norm_bias=False``).
  """
  names = _layers.with_names
  if kind == "rms":
    return nnx.RMSNorm(
      d,
      epsilon=eps,
      dtype=dtype,
      param_dtype=param_dtype,
      scale_init=names(jax.nn.initializers.ones, ("embed",)),
      rngs=rngs,
    )
  if kind == "rms_plus_one":
    return PlusOneRMSNorm(d, eps=eps, dtype=dtype, param_dtype=param_dtype)
  return nnx.LayerNorm(
    d,
    epsilon=eps,
    dtype=dtype,
    param_dtype=param_dtype,
    use_bias=use_bias,
    scale_init=names(jax.nn.initializers.ones, ("embed",)),
    bias_init=names(jax.nn.initializers.zeros, ("embed",)),
    rngs=rngs,
  )


class MLP(nnx.Module):
  """GELU (``down(act(up x))``) or gated (``down(act(gate x) * up x)``) feed-forward layer.

  Args:
    kind: ``"gelu"`` (ungated), ``"swiglu"`` or ``"geglu"`` (gated).
    d_model: D.
    hidden: hidden width.
    activation: a name of ``ACTIVATIONS`` (None = the kind's: ``gelu_tanh`` for
      ``"gelu"`` and ``"geglu"``, ``silu`` for ``"swiglu"``).
    use_bias: biases on every projection.
    rngs, dtype, param_dtype: as the other modules.
  """

  def __init__(
    self,
    kind: str,
    d_model: int,
    hidden: int,
    *,
    rngs,
    dtype,
    param_dtype,
    activation=None,
    use_bias: bool = False,
  ):
    lin = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, use_bias=use_bias)
    self.kind = kind
    self.activation = activation or ("silu" if kind == "swiglu" else "gelu_tanh")
    self.up = _layers.linear(d_model, hidden, ("embed", "mlp"), **lin)
    if kind in ("swiglu", "geglu"):
      self.gate = _layers.linear(d_model, hidden, ("embed", "mlp"), **lin)
    self.down = _layers.linear(hidden, d_model, ("mlp", "embed"), **lin)

  def __call__(self, x: Array) -> Array:
    act = ACTIVATIONS[self.activation]
    if self.kind in ("swiglu", "geglu"):
      return self.down(act(self.gate(x)) * self.up(x))
    return self.down(act(self.up(x)))


class MixtureOfExperts(nnx.Module):
  """A mixture of experts: a router, top-k routing, the experts, optional shared experts.

  One module for gpt-oss's and DeepSeek V2/V3's (see :class:`attnjax.nn.ModelConfig`'s
  ``moe_*`` fields). Routing (float32): scores from the router's logits (``"topk_softmax"``:
  softmax over each token's top-k logits; ``"softmax"``: over every expert; ``"sigmoid"``),
  groups limited to the ``group_topk`` best, the top ``top_k`` by ``score (+ score_bias)``,
  weighted by the unbiased scores, optionally normalised, times ``scale``. Every expert
  then runs on every token, weighted by its routing weight (zero where not routed): exactly
  the routed computation. Shared experts (one SwiGLU MLP) are added to every token.

  Parameters: ``router`` (``nnx.Linear`` D -> E, with a bias for gpt-oss), ``score_bias``
  ``[E]`` (``score_bias=True``), ``gate`` and ``up`` ``[E, D, hidden]``, ``down`` ``[E,
  hidden, D]``, with ``gate_bias`` / ``up_bias`` ``[E, hidden]`` and ``down_bias`` ``[E, D]``
  for gpt-oss's experts, ``shared`` (an :class:`MLP`) with ``shared_dim``.

  Args:
    d_model: D.
    hidden: each expert's hidden width.
    num_experts: E.
    top_k: experts per token.
    alpha: gpt-oss's SwiGLU sigmoid slope.
    limit: gpt-oss's clip of the gate (above) and of the up projection (both sides);
      None = no clip.
    experts: ``"gpt_oss"`` or ``"swiglu"``.
    router: ``"topk_softmax"``, ``"softmax"`` or ``"sigmoid"``.
    router_bias: the router has a bias.
    groups, group_topk: expert groups and how many are eligible (None: all).
    score_bias: a learned choice bias per expert (DeepSeek V3).
    normalize: divide the chosen weights by their sum.
    scale: multiplier of the routed weights.
    shared_dim: hidden width of the shared experts, or None.
    shared_gate: the shared experts' output is scaled by ``sigmoid(x w)`` per token
      (``shared_gate``, ``nnx.Linear`` D -> 1 without bias; Qwen3-Next).
    rngs, dtype, param_dtype: as the other modules.
  """

  def __init__(
    self,
    d_model: int,
    hidden: int,
    *,
    num_experts: int,
    top_k: int,
    alpha: float = 1.702,
    limit=7.0,
    experts: str = "gpt_oss",
    router: str = "topk_softmax",
    router_bias: bool = True,
    groups: int = 1,
    group_topk=None,
    score_bias: bool = False,
    normalize: bool = False,
    scale: float = 1.0,
    shared_dim=None,
    shared_gate: bool = False,
    rngs,
    dtype,
    param_dtype,
  ):
    self.num_experts, self.top_k = num_experts, top_k
    self.alpha, self.limit = float(alpha), None if limit is None else float(limit)
    self.experts, self.router_kind = experts, router
    self.groups, self.group_topk = groups, group_topk
    self.normalize, self.scale = normalize, float(scale)
    self.dtype = jnp.dtype(dtype)
    E, D, I = num_experts, d_model, hidden
    self.router = _layers.linear(
      D, E, ("embed", None), rngs=rngs, dtype=dtype, param_dtype=param_dtype, use_bias=router_bias
    )
    self.score_bias = (
      _layers.param(jnp.zeros((E,), jnp.float32), (None,)) if score_bias else nnx.data(None)
    )
    key = rngs.params()
    k1, k2, k3 = jax.random.split(key, 3)
    init = _layers.fan_in_init

    def weights(k, shape, names):
      # fan_in is the middle axis: [E, fan_in, fan_out].
      value = jax.vmap(lambda kk: init(kk, shape[1:], param_dtype))(jax.random.split(k, E))
      return _layers.param(value, names)

    self.gate = weights(k1, (E, D, I), (None, "embed", "mlp"))
    self.up = weights(k2, (E, D, I), (None, "embed", "mlp"))
    self.down = weights(k3, (E, I, D), (None, "mlp", "embed"))
    if experts == "gpt_oss":
      self.gate_bias = _layers.param(jnp.zeros((E, I), param_dtype), (None, "mlp"))
      self.up_bias = _layers.param(jnp.zeros((E, I), param_dtype), (None, "mlp"))
      self.down_bias = _layers.param(jnp.zeros((E, D), param_dtype), (None, "embed"))
    self.shared = (
      None
      if shared_dim is None
      else MLP("swiglu", D, shared_dim, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    )
    self.shared_gate = (
      _layers.linear(D, 1, ("embed", None), rngs=rngs, dtype=dtype, param_dtype=param_dtype)
      if shared_gate
      else None
    )

  def routing(self, x: Array) -> Array:
    """``[B, T, E]`` float32 routing weights: each token's chosen experts' weights, else 0."""
    E, k = self.num_experts, self.top_k
    if self.router_kind == "topk_softmax":
      logits = self.router(x)
      top, index = jax.lax.top_k(logits, k)
      probs = jax.nn.softmax(top.astype(jnp.float32), axis=-1).astype(logits.dtype)
      return jnp.einsum("btk,btke->bte", probs, jax.nn.one_hot(index, E, dtype=probs.dtype))
    w = self.router.kernel[...].astype(jnp.float32)
    logits = jnp.einsum("btd,de->bte", x.astype(jnp.float32), w)
    if self.router.bias is not None:
      logits = logits + self.router.bias[...].astype(jnp.float32)[None, None]
    if self.router_kind == "sigmoid":
      scores = jax.nn.sigmoid(logits)
      choice = scores if self.score_bias is None else scores + self.score_bias[...][None, None]
    else:
      scores = choice = jax.nn.softmax(logits, axis=-1)
    if self.group_topk is not None and self.group_topk < self.groups:
      G = self.groups
      grouped = jnp.reshape(choice, choice.shape[:-1] + (G, E // G))
      if self.router_kind == "sigmoid":  # the sum of each group's two best
        group_score = jnp.sum(jax.lax.top_k(grouped, min(2, E // G))[0], axis=-1)
      else:  # its best
        group_score = jnp.max(grouped, axis=-1)
      _, best = jax.lax.top_k(group_score, self.group_topk)
      keep = jnp.sum(jax.nn.one_hot(best, G, dtype=jnp.int32), axis=-2) > 0  # [B, T, G]
      keep = jnp.repeat(keep, E // G, axis=-1)
      choice = jnp.where(keep, choice, -jnp.inf)
    _, index = jax.lax.top_k(choice, k)
    onehot = jax.nn.one_hot(index, E, dtype=jnp.float32)  # [B, T, k, E]
    weights = jnp.einsum("btke,bte->btk", onehot, scores)
    if self.normalize:
      weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return jnp.einsum("btk,btke->bte", weights * self.scale, onehot)

  def __call__(self, x: Array) -> Array:
    x = x.astype(self.dtype)
    weights = jnp.moveaxis(self.routing(x), -1, 0)  # [E, B, T]
    names = ("gate", "up", "down")
    if self.experts == "gpt_oss":
      names += ("gate_bias", "up_bias", "down_bias")
    params = tuple(getattr(self, n)[...].astype(self.dtype) for n in names)

    def expert(acc, xs):
      w, p = xs
      gate = jnp.einsum("btd,di->bti", x, p[0])
      up = jnp.einsum("btd,di->bti", x, p[1])
      if self.experts == "gpt_oss":
        gate, up = gate + p[3][None, None], up + p[4][None, None]
        if self.limit is not None:
          gate = jnp.minimum(gate, self.limit)
          up = jnp.clip(up, -self.limit, self.limit)
        h = (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))
        out = jnp.einsum("bti,id->btd", h, p[2]) + p[5][None, None]
      else:
        out = jnp.einsum("bti,id->btd", jax.nn.silu(gate) * up, p[2])
      return acc + (out * w[..., None]).astype(acc.dtype), None

    acc, _ = jax.lax.scan(expert, jnp.zeros_like(x), (weights, params))
    if self.shared is not None:
      shared = self.shared(x)
      if self.shared_gate is not None:
        shared = jax.nn.sigmoid(self.shared_gate(x)) * shared
      acc = acc + shared
    return acc
