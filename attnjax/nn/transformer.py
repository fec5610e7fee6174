"""A pre-norm decoder-only language model around :class:`attnjax.nn.Attention`.

``TransformerLM(config, rngs=...)(tokens)`` returns float32 logits ``[B, T, V]``;
``return_log_z=True`` also returns ``log Z = logsumexp(logits)`` ``[B, T]``, the
output log-normaliser of z-loss and of the drift metric (Wortsman et al. 2023,
sec. 3.1.2). Every weight matrix starts from a truncated normal with std
``1 / sqrt(fan_in)`` (Wortsman et al. 2023), the embedding with std
``1 / sqrt(D)`` (the fan-in of the tied output projection). Parameters carry
logical axis names (``"embed"``, ``"heads"``, ``"mlp"``, ``"vocab"``) as
``out_sharding`` metadata for ``nnx.get_partition_spec``.

Under ``nnx.capture(..., nnx.Intermediate)`` each block also sows
``hidden_max_abs`` and ``hidden_median_abs`` ``[B]`` of its output hidden state
(massive activations, Sun et al. 2024) and, with ``sow_hidden=True``, the hidden
state ``[B, T, D]`` itself; the model sows ``log_z`` ``[B, T]``.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from attnjax.nn import _layers, intermediates
from attnjax.nn.attention import Attention
from attnjax.nn.config import ModelConfig

Array = jnp.ndarray


def _norm(kind: str, d: int, eps: float, *, rngs, dtype, param_dtype):
  names = _layers.with_names
  if kind == "rms":
    return nnx.RMSNorm(d, epsilon=eps, dtype=dtype, param_dtype=param_dtype,
                       scale_init=names(jax.nn.initializers.ones, ("embed",)), rngs=rngs)
  return nnx.LayerNorm(d, epsilon=eps, dtype=dtype, param_dtype=param_dtype,
                       scale_init=names(jax.nn.initializers.ones, ("embed",)),
                       bias_init=names(jax.nn.initializers.zeros, ("embed",)), rngs=rngs)


class MLP(nnx.Module):
  """GELU (``down(gelu(up x))``) or SwiGLU (``down(silu(gate x) * up x)``, Shazeer 2020).

  Maps ``[..., D]`` to ``[..., D]`` through a hidden width ``hidden``; the weights carry
  the logical axes ``("embed", "mlp")`` and ``("mlp", "embed")``.

  Args:
    kind: ``"gelu"`` or ``"swiglu"``.
    d_model: ``D``.
    hidden: the hidden width.
    rngs: the ``nnx.Rngs`` of the initialisers.
    dtype: the computation dtype.
    param_dtype: the parameters' dtype.
  """

  def __init__(self, kind: str, d_model: int, hidden: int, *, rngs, dtype, param_dtype):
    lin = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    self.kind = kind
    self.up = _layers.linear(d_model, hidden, ("embed", "mlp"), **lin)
    if kind == "swiglu":
      self.gate = _layers.linear(d_model, hidden, ("embed", "mlp"), **lin)
    self.down = _layers.linear(hidden, d_model, ("mlp", "embed"), **lin)

  def __call__(self, x: Array) -> Array:
    if self.kind == "swiglu":
      return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
    return self.down(jax.nn.gelu(self.up(x)))


class TransformerBlock(nnx.Module):
  """Pre-norm block: ``h + attn(norm(h))`` then ``h + mlp(norm(h))`` (no MLP if ``mlp="none"``).

  Args:
    config: the :class:`.ModelConfig`.
    layer: index of this block (selects its attention config).
    rngs: ``nnx.Rngs``.
  """

  def __init__(self, config: ModelConfig, layer: int, rngs: nnx.Rngs):
    dtype, param_dtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    D = config.d_model
    self.attn_norm = _norm(config.norm, D, config.norm_eps, **kw)
    self.attention = Attention(config.attention_for(layer), D, **kw)
    self.mlp_norm = None if config.mlp == "none" else _norm(config.norm, D, config.norm_eps, **kw)
    self.mlp = None if config.mlp == "none" else MLP(config.mlp, D, config.hidden_dim, **kw)

  def __call__(self, h: Array, *, segment_ids: Optional[Array] = None,
               positions: Optional[Array] = None, sow_weights: Optional[bool] = None,
               sow_hidden: bool = False) -> Array:
    """``h`` ``[B, T, D]`` -> ``[B, T, D]``; the other arguments as :class:`.Attention`'s."""
    h = h + self.attention(self.attn_norm(h), segment_ids=segment_ids, positions=positions,
                           sow_weights=sow_weights)
    if self.mlp is not None:
      h = h + self.mlp(self.mlp_norm(h))
    self._sow_hidden(h, sow_hidden)
    return h

  def decode(self, h: Array, cache, *, segment_ids: Optional[Array] = None,
             positions: Optional[Array] = None, sow_weights: Optional[bool] = None,
             sow_hidden: bool = False):
    a, cache = self.attention.decode(self.attn_norm(h), cache, segment_ids=segment_ids,
                                     positions=positions, sow_weights=sow_weights)
    h = h + a
    if self.mlp is not None:
      h = h + self.mlp(self.mlp_norm(h))
    self._sow_hidden(h, sow_hidden)
    return h, cache

  def _sow_hidden(self, h: Array, full: bool) -> None:
    if not _layers.capturing(self):
      return
    mag = jnp.reshape(jnp.abs(h.astype(jnp.float32)), (h.shape[0], -1))
    _layers.sow(self, "hidden_max_abs", jnp.max(mag, axis=-1))
    _layers.sow(self, "hidden_median_abs", jnp.median(mag, axis=-1))
    if full:
      _layers.sow(self, "hidden", h)


class TransformerLM(nnx.Module):
  """Decoder-only LM: embedding, ``num_layers`` pre-norm blocks, final norm, output head.

  Args:
    config: the :class:`.ModelConfig`.
    rngs: ``nnx.Rngs`` (the ``params`` stream initialises every weight).
  """

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    if not isinstance(config, ModelConfig):
      raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    self.config = config
    dtype, param_dtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
    D, V = config.d_model, config.vocab_size
    # [V, D] with fan_in = D (in_axis=1), the fan-in of the tied output projection.
    embed_init = jax.nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=0)
    self.embed = nnx.Embed(V, D, dtype=dtype, param_dtype=param_dtype,
                           embedding_init=_layers.with_names(embed_init, ("vocab", "embed")),
                           rngs=rngs)
    self.blocks = nnx.List([TransformerBlock(config, i, rngs=rngs)
                            for i in range(config.num_layers)])
    self.final_norm = _norm(config.norm, D, config.norm_eps, rngs=rngs, dtype=dtype,
                            param_dtype=param_dtype)
    if not config.tie_embeddings:
      self.head = _layers.linear(D, V, ("embed", "vocab"), rngs=rngs, dtype=dtype,
                                 param_dtype=param_dtype)

  def __call__(self, tokens: Array, *, segment_ids: Optional[Array] = None,
               positions: Optional[Array] = None, return_log_z: bool = False,
               sow_weights: Optional[bool] = None, sow_hidden: bool = False):
    """Logits ``[B, T, V]`` float32 of ``tokens`` ``[B, T]`` (and ``log Z`` ``[B, T]``).

    Args:
      tokens: ``[B, T]`` integer tokens.
      segment_ids: ``[B, T]`` int: packed documents; no token attends across a
        document boundary.
      positions: ``[T]`` or ``[B, T]`` RoPE positions (default ``0..T-1``), e.g.
        restarting at 0 in every packed document.
      return_log_z: also return ``log Z = logsumexp(logits)``.
      sow_weights: sow attention weights (under ``nnx.capture``).
      sow_hidden: sow every block's output hidden state (under ``nnx.capture``).
    """
    h = self._embed(tokens)
    flags = dict(sow_weights=sow_weights, sow_hidden=sow_hidden)
    for block in self.blocks:
      if self.config.remat:
        h = nnx.remat(lambda blk, h, seg, pos: blk(h, segment_ids=seg, positions=pos, **flags))(
            block, h, segment_ids, positions)
      else:
        h = block(h, segment_ids=segment_ids, positions=positions, **flags)
    return self._logits(h, return_log_z)

  def decode(self, tokens: Array, cache: list, *, segment_ids: Optional[Array] = None,
             positions: Optional[Array] = None, sow_weights: Optional[bool] = None,
             sow_hidden: bool = False):
    """Runs ``tokens`` ``[B, T]`` (the next ``T`` tokens) through the caches: ``(logits, cache)``.

    A prefill is one call with the prompt; each step after it is a call with
    ``T = 1``. Prefill plus steps gives the logits of the full forward. A packed
    decode passes the new tokens' ``segment_ids`` (and ``positions``) on every call.
    """
    if len(cache) != len(self.blocks):
      raise ValueError(f"cache has {len(cache)} layers, the model {len(self.blocks)}")
    h = self._embed(tokens)
    new_cache = []
    for block, layer_cache in zip(self.blocks, cache):
      h, layer_cache = block.decode(h, layer_cache, segment_ids=segment_ids,
                                    positions=positions, sow_weights=sow_weights,
                                    sow_hidden=sow_hidden)
      new_cache.append(layer_cache)
    return self._logits(h, False), new_cache

  def init_cache(self, batch_size: int, max_len: int) -> list:
    """Empty per-layer caches (a list, a pytree) for sequences up to ``max_len`` tokens."""
    return [block.attention.init_cache(batch_size, max_len) for block in self.blocks]

  def _embed(self, tokens: Array) -> Array:
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be integer [B, T], got {tokens.dtype} {tokens.shape}")
    return self.embed(tokens)

  def _logits(self, h: Array, return_log_z: bool):
    h = self.final_norm(h)
    if self.config.tie_embeddings:
      w = self.embed.embedding[...].astype(h.dtype)
      logits = jnp.einsum("btd,vd->btv", h, w, preferred_element_type=jnp.float32)
    else:
      w = self.head.kernel[...].astype(h.dtype)
      logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
    logits = logits.astype(jnp.float32)
    capture = _layers.capturing(self)
    if not (return_log_z or capture):
      return logits
    log_z = log_normalizer(logits)
    _layers.sow(self, "log_z", log_z)
    return (logits, log_z) if return_log_z else logits

  def num_params(self, *, exclude_embeddings: bool = False) -> int:
    """Number of trainable parameters (optionally without the token embedding)."""
    return num_params(self, exclude_embeddings=exclude_embeddings)


# Logical axis -> mesh axis for a ("data", "model") mesh: Megatron-style tensor
# parallelism over heads, MLP width and vocabulary; the batch goes on "data".
LOGICAL_AXIS_RULES = (("embed", None), ("heads", "model"), ("mlp", "model"),
                      ("vocab", "model"))


def state_shardings(model: nnx.Module, mesh: jax.sharding.Mesh,
                    rules=LOGICAL_AXIS_RULES):
  """``NamedSharding`` for every variable of ``nnx.state(model)``, from its logical names.

  Example::

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    graphdef, state = nnx.split(model)
    state = jax.device_put(state, nn.state_shardings(model, mesh))
    tokens = jax.device_put(tokens, NamedSharding(mesh, P("data")))

  Args:
    model: any module built by attnjax.nn.
    mesh: the device mesh.
    rules: ``((logical, mesh_axis or None), ...)``; every logical name used
      (``"embed"``, ``"heads"``, ``"mlp"``, ``"vocab"``) must appear.

  Returns:
    A pytree of ``NamedSharding`` shaped as ``nnx.state(model)``.
  """
  with nnx.logical_axis_rules(rules):
    return nnx.get_named_sharding(nnx.state(model), mesh)


def log_normalizer(logits: Array) -> Array:
  """``log Z = logsumexp(logits)`` over the vocabulary.

  z-loss is ``coef * mean(log Z ** 2)``; the drift metric is ``mean(log Z)``.

  Args:
    logits: ``[B, T, V]``.

  Returns:
    float32 ``[B, T]``.
  """
  return jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)


def num_params(model: nnx.Module, *, exclude_embeddings: bool = False) -> int:
  """Number of parameters (``nnx.Param`` elements) of ``model``.

  Args:
    model: any ``nnx.Module``.
    exclude_embeddings: leave out a :class:`.TransformerLM`'s token embedding.

  Returns:
    The count.
  """
  state = nnx.state(model, nnx.Param)
  total = sum(x.size for x in jax.tree.leaves(state))
  if exclude_embeddings and isinstance(model, TransformerLM):
    total -= model.embed.embedding[...].size
  return int(total)


# ---------------------------------------------------------------------------
# Statistics of one forward pass.


def _forward_for_stats(model, tokens, *, weights: bool, hidden: bool):
  return model(tokens, sow_weights=weights or None, sow_hidden=hidden)


_jit_forward_for_stats = nnx.jit(_forward_for_stats, static_argnames=("weights", "hidden"))


def collect_stats(model: TransformerLM, tokens: Array, *, weights: bool = False,
                  hidden: bool = False, jit: bool = True) -> dict[str, Any]:
  """Per-layer statistics of one forward pass, read from ``nnx.Intermediate``.

  Args:
    model: a :class:`.TransformerLM`.
    tokens: ``[B, T]`` integer tokens.
    weights: also return each layer's attention weights ``[B, N, T, S]``.
    hidden: also return each block's output hidden state ``[B, T, D]``.
    jit: run the forward under ``nnx.jit``.

  Returns:
    A dict with ``"logits"`` ``[B, T, V]``, ``"log_z"`` ``[B, T]`` and
    ``"layers"``, a list (one per layer) of dicts with ``sink_mass``,
    ``entropy``, ``max_logit``, ``row_sum`` ``[B, N]``, ``logsumexp``
    ``[B, N, T]`` (those an attention family defines), ``q_rms`` ``[B, N]``,
    ``k_rms`` ``[B, K]``, ``hidden_max_abs`` and ``hidden_median_abs`` ``[B]``,
    ``gate_mean`` ``[B, N]`` for gated layers, and ``weights`` / ``hidden``
    when asked.
  """
  fwd = _jit_forward_for_stats if jit else _forward_for_stats
  logits, inter = nnx.capture(fwd, nnx.Intermediate)(model, tokens, weights=weights,
                                                     hidden=hidden)
  recorded = intermediates.read(inter, len(model.blocks))
  return {"logits": logits, "log_z": recorded.model["log_z"],
          "layers": [intermediates.fields(layer) for layer in recorded.layers]}
