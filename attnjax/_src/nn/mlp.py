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
  """gpt-oss's mixture of experts (see the module docstring).

  Parameters: ``router`` (``nnx.Linear`` D -> E with bias), ``gate`` and ``up``
  ``[E, D, hidden]`` with ``gate_bias`` / ``up_bias`` ``[E, hidden]``, ``down``
  ``[E, hidden, D]`` with ``down_bias`` ``[E, D]``.

  Args:
    d_model: D.
    hidden: each expert's hidden width.
    num_experts: E.
    top_k: experts per token.
    alpha: the SwiGLU's sigmoid slope.
    limit: the clip of the gate (above) and of the up projection (both sides);
      None = no clip.
    rngs, dtype, param_dtype: as the other modules.
  """

  def __init__(
    self,
    d_model: int,
    hidden: int,
    *,
    num_experts: int,
    top_k: int,
    alpha: float,
    limit,
    rngs,
    dtype,
    param_dtype,
  ):
    self.num_experts, self.top_k = num_experts, top_k
    self.alpha, self.limit = float(alpha), None if limit is None else float(limit)
    self.dtype = jnp.dtype(dtype)
    E, D, I = num_experts, d_model, hidden
    self.router = _layers.linear(
      D, E, ("embed", None), rngs=rngs, dtype=dtype, param_dtype=param_dtype, use_bias=True
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
    self.gate_bias = _layers.param(jnp.zeros((E, I), param_dtype), (None, "mlp"))
    self.up_bias = _layers.param(jnp.zeros((E, I), param_dtype), (None, "mlp"))
    self.down_bias = _layers.param(jnp.zeros((E, D), param_dtype), (None, "embed"))

  def routing(self, x: Array) -> Array:
    """``[B, T, E]`` routing weights: softmax over each token's ``top_k`` logits, else 0."""
    logits = self.router(x)
    top, index = jax.lax.top_k(logits, self.top_k)
    probs = jax.nn.softmax(top.astype(jnp.float32), axis=-1).astype(logits.dtype)
    onehot = jax.nn.one_hot(index, self.num_experts, dtype=probs.dtype)  # [B, T, k, E]
    return jnp.einsum("btk,btke->bte", probs, onehot)

  def __call__(self, x: Array) -> Array:
    x = x.astype(self.dtype)
    weights = jnp.moveaxis(self.routing(x), -1, 0)  # [E, B, T]
    params = tuple(
      p[...].astype(self.dtype)
      for p in (self.gate, self.gate_bias, self.up, self.up_bias, self.down, self.down_bias)
    )

    def expert(acc, xs):
      w, (wg, bg, wu, bu, wd, bd) = xs
      gate = jnp.einsum("btd,di->bti", x, wg) + bg[None, None]
      up = jnp.einsum("btd,di->bti", x, wu) + bu[None, None]
      if self.limit is not None:
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
      h = (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))
      out = jnp.einsum("bti,id->btd", h, wd) + bd[None, None]
      return acc + (out * w[..., None]).astype(acc.dtype), None

    acc, _ = jax.lax.scan(expert, jnp.zeros_like(x), (weights, params))
    return acc
