"""A pre-norm decoder-only language model around :class:`attnjax.nn.Attention`.

``TransformerLM(config, rngs=...)(tokens)`` returns float32 logits ``[B, T, V]``;
``return_log_z=True`` also returns ``log Z = logsumexp(logits)`` ``[B, T]`` (z-loss and
the drift metric, Wortsman et al. 2023). Weights start from a truncated normal with std
``1 / sqrt(fan_in)`` and carry logical axis names for sharding; under ``nnx.capture``
each block sows its hidden state's statistics.

Guide: docs/guides/layers.md, "MLPs, norms and initialisation", "What the layers sow".
Implementation behind the public module :mod:`attnjax.nn`.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from attnjax._src.deprecation import warn_once
from attnjax._src.logits import softcap
from attnjax._src.nn import _layers, intermediates
from attnjax._src.nn import mlp as mlp_lib
from attnjax._src.nn.attention import Attention
from attnjax._src.nn.config import ModelConfig
from attnjax._src.nn.mlp import MLP

Array = jnp.ndarray


def _norm(config: ModelConfig, *, rngs, dtype, param_dtype):
  return mlp_lib.norm(
    config.norm,
    config.d_model,
    config.norm_eps,
    rngs=rngs,
    dtype=dtype,
    param_dtype=param_dtype,
    use_bias=config.norm_bias,
  )


class TransformerBlock(nnx.Module):
  """One block: attention then MLP, each added to the residual stream ``h``.

  The norms sit as ``config.norm_placement`` says: ``"pre"`` (``h + f(norm(h))``,
  the default), ``"sandwich"`` (``h + post_norm(f(norm(h)))``), ``"post"``
  (``h + post_norm(f(h))``) or ``"post_residual"`` (``post_norm(h + f(h))``, BERT).
  Parameters: ``attn_norm`` / ``mlp_norm`` (``"pre"``, ``"sandwich"``; not the first
  block's ``attn_norm`` with ``config.first_attn_norm=False``), ``attn_post_norm`` /
  ``mlp_post_norm`` (the others), ``attention``, ``mlp`` (none if ``mlp="none"``).

  Args:
    config: the :class:`.ModelConfig`.
    layer: index of this block (selects its attention config).
    rngs: ``nnx.Rngs``.
  """

  def __init__(self, config: ModelConfig, layer: int, rngs: nnx.Rngs):
    dtype, param_dtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
    kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    D = config.d_model
    has_mlp = config.mlp != "none"
    pre = config.norm_placement in ("pre", "sandwich")
    post = config.norm_placement != "pre"
    self.residual_norm = config.norm_placement == "post_residual"

    def norm(present: bool):
      return _norm(config, **kw) if present else None

    self.attn_norm = norm(pre and (layer > 0 or config.first_attn_norm))
    self.attention = Attention(config.attention_for(layer), D, **kw)
    self.mlp_norm = norm(has_mlp and pre)
    if not has_mlp:
      self.mlp = None
    elif config.is_moe_layer(layer):
      self.mlp = mlp_lib.MixtureOfExperts(
        D,
        config.hidden_dim,
        num_experts=config.num_experts,
        top_k=config.experts_per_token,
        alpha=config.moe_alpha,
        limit=config.moe_limit,
        experts=config.moe_experts,
        router=config.moe_router,
        router_bias=config.moe_router_bias,
        groups=config.moe_groups,
        group_topk=config.moe_group_topk,
        score_bias=config.moe_score_bias,
        normalize=config.moe_normalize,
        scale=config.moe_scale,
        shared_dim=config.moe_shared_dim,
        shared_gate=config.moe_shared_gate,
        **kw,
      )
    elif config.mlp == "moe":  # a dense layer of a MoE model (first_k_dense_replace, ...)
      self.mlp = MLP("swiglu", D, config.dense_mlp_dim or config.hidden_dim, **kw)
    else:
      self.mlp = MLP(
        config.mlp,
        D,
        config.hidden_dim,
        activation=config.mlp_activation,
        use_bias=config.mlp_bias,
        **kw,
      )
    # Declared after the layers they follow: the rngs stream of the defaults is unchanged.
    self.attn_post_norm = norm(post)
    self.mlp_post_norm = norm(has_mlp and post)

  def __call__(
    self,
    h: Array,
    *,
    mask: Optional[Array] = None,
    segment_ids: Optional[Array] = None,
    positions: Optional[Array] = None,
    sow_weights: Optional[bool] = None,
    sow_hidden: bool = False,
  ) -> Array:
    """``h`` ``[B, T, D]`` -> ``[B, T, D]``; the other arguments as :class:`.Attention`'s."""
    a = self.attention(
      self._apply(self.attn_norm, h),
      mask=mask,
      segment_ids=segment_ids,
      positions=positions,
      sow_weights=sow_weights,
    )
    if sow_hidden:
      _layers.sow(self, "attn_out", a)
    h = self._feed_forward(self._residual(h, a, self.attn_post_norm), sow_hidden)
    self._sow_hidden(h, sow_hidden)
    return h

  def decode(
    self,
    h: Array,
    cache,
    *,
    segment_ids: Optional[Array] = None,
    positions: Optional[Array] = None,
    sow_weights: Optional[bool] = None,
    sow_hidden: bool = False,
  ):
    a, cache = self.attention.decode(
      self._apply(self.attn_norm, h),
      cache,
      segment_ids=segment_ids,
      positions=positions,
      sow_weights=sow_weights,
    )
    h = self._feed_forward(self._residual(h, a, self.attn_post_norm), False)
    self._sow_hidden(h, sow_hidden)
    return h, cache

  @staticmethod
  def _apply(norm, x: Array) -> Array:
    return x if norm is None else norm(x)

  def _residual(self, h: Array, f: Array, post_norm) -> Array:
    """``h + post_norm(f)``, or ``post_norm(h + f)`` with ``"post_residual"``."""
    if self.residual_norm:
      return post_norm(h + f)
    return h + self._apply(post_norm, f)

  def _feed_forward(self, h: Array, sow_output: bool) -> Array:
    if self.mlp is None:
      return h
    f = self.mlp(self._apply(self.mlp_norm, h))
    if sow_output:
      _layers.sow(self, "mlp_out", f)
    return self._residual(h, f, self.mlp_post_norm)

  def _sow_hidden(self, h: Array, full: bool) -> None:
    if not _layers.capturing(self):
      return
    mag = jnp.reshape(jnp.abs(h.astype(jnp.float32)), (h.shape[0], -1))
    _layers.sow(self, "hidden_max_abs", jnp.max(mag, axis=-1))
    _layers.sow(self, "hidden_median_abs", jnp.median(mag, axis=-1))
    if full:
      _layers.sow(self, "hidden", h)


class TransformerLM(nnx.Module):
  """Decoder-only LM: embedding, ``num_layers`` blocks, final norm, output head.

  Besides the token embedding ``embed`` (scaled by ``config.embed_scale``), a
  model with ``config.learned_positions`` adds ``position_embed`` of each
  token's position (``positions``, default ``0..T-1``; when decoding, the
  position after the tokens the cache has seen). ``config.final_softcap`` caps
  the output logits.

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
      1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=0
    )
    self.embed = nnx.Embed(
      V,
      D,
      dtype=dtype,
      param_dtype=param_dtype,
      embedding_init=_layers.with_names(embed_init, ("vocab", "embed")),
      rngs=rngs,
    )
    self.blocks = nnx.List(
      [TransformerBlock(config, i, rngs=rngs) for i in range(config.num_layers)]
    )
    # post_residual blocks end in a norm: their last output is the features.
    post_residual = config.norm_placement == "post_residual"
    self.final_norm = (
      None if post_residual else _norm(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    )
    if not config.tie_embeddings:
      self.head = _layers.linear(
        D, V, ("embed", "vocab"), rngs=rngs, dtype=dtype, param_dtype=param_dtype
      )
    self.position_embed = (
      None
      if config.learned_positions is None
      else nnx.Embed(
        config.learned_positions,
        D,
        dtype=dtype,
        param_dtype=param_dtype,
        embedding_init=_layers.with_names(embed_init, (None, "embed")),
        rngs=rngs,
      )
    )
    # Declared last: the rngs stream of the decoders before them is unchanged.
    self.token_type_embed = (
      None
      if config.token_types is None
      else nnx.Embed(
        config.token_types,
        D,
        dtype=dtype,
        param_dtype=param_dtype,
        embedding_init=_layers.with_names(embed_init, (None, "embed")),
        rngs=rngs,
      )
    )
    self.embed_norm = (
      _norm(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype) if config.embed_norm else None
    )

  def __call__(
    self,
    tokens: Array,
    *,
    segment_ids: Optional[Array] = None,
    positions: Optional[Array] = None,
    return_log_z: bool = False,
    sow_weights: Optional[bool] = None,
    sow_hidden: bool = False,
  ):
    """Logits ``[B, T, V]`` float32 of ``tokens`` ``[B, T]`` (and ``log Z`` ``[B, T]``).

    Args:
      tokens: ``[B, T]`` integer tokens.
      segment_ids: ``[B, T]`` int: packed documents; no token attends across a
        document boundary.
      positions: ``[T]`` or ``[B, T]`` RoPE positions, and positions of learned
        position embeddings (default ``0..T-1``), e.g.
        restarting at 0 in every packed document.
      return_log_z: also return ``log Z = logsumexp(logits)``.
      sow_weights: sow attention weights (under ``nnx.capture``).
      sow_hidden: sow every block's output hidden state (under ``nnx.capture``).
    """
    h = self.features(
      tokens,
      segment_ids=segment_ids,
      positions=positions,
      sow_weights=sow_weights,
      sow_hidden=sow_hidden,
    )
    return self._logits(h, return_log_z)

  def features(
    self,
    tokens: Array,
    *,
    segment_ids: Optional[Array] = None,
    positions: Optional[Array] = None,
    sow_weights: Optional[bool] = None,
    sow_hidden: bool = False,
  ) -> Array:
    """The hidden states the output head reads: the last block's output, final-normed.

    ``model(tokens)`` is ``model.output_logits(model.features(tokens))`` (plus
    ``log Z`` under a capture); a long sequence's loss can take the logits of
    a few positions at a time from these ``[B, T, D]`` features instead of the
    ``[B, T, V]`` logits at once. Arguments as calling the model.
    """
    h = self._embed(tokens, positions)
    return self._blocks(
      h,
      mask=None,
      segment_ids=segment_ids,
      positions=positions,
      sow_weights=sow_weights,
      sow_hidden=sow_hidden,
    )

  def _blocks(self, h, *, mask, segment_ids, positions, sow_weights, sow_hidden) -> Array:
    """The blocks and the final norm over the embedded tokens ``h`` ``[B, T, D]``."""
    flags = dict(sow_weights=sow_weights, sow_hidden=sow_hidden)

    def run(blk, h, mask, seg, pos):
      return blk(h, mask=mask, segment_ids=seg, positions=pos, **flags)

    for block in self.blocks:
      if self.config.remat:
        h = nnx.remat(run)(block, h, mask, segment_ids, positions)
      else:
        h = run(block, h, mask, segment_ids, positions)
    return TransformerBlock._apply(self.final_norm, h)

  def output_logits(self, features: Array) -> Array:
    """Float32 logits ``[..., T, V]`` of :meth:`features` ``[..., T, D]``: the output head
    (the tied embedding or ``head``) and ``config.final_softcap``."""
    h = _layers.quantize_input(features)
    if self.config.tie_embeddings:
      w = _layers.quantize_weight(self.embed.embedding[...]).astype(h.dtype)
      logits = jnp.einsum("...d,vd->...v", h, w, preferred_element_type=jnp.float32)
    else:
      w = _layers.quantize_weight(self.head.kernel[...]).astype(h.dtype)
      logits = jnp.einsum("...d,dv->...v", h, w, preferred_element_type=jnp.float32)
    logits = logits.astype(jnp.float32)
    return softcap(logits, self.config.final_softcap)

  def decode(
    self,
    tokens: Array,
    cache: list,
    *,
    segment_ids: Optional[Array] = None,
    positions: Optional[Array] = None,
    sow_weights: Optional[bool] = None,
    sow_hidden: bool = False,
  ):
    """Runs ``tokens`` ``[B, T]`` (the next ``T`` tokens) through the caches: ``(logits, cache)``.

    A prefill is one call with the prompt; each step after it is a call with
    ``T = 1``. Prefill plus steps gives the logits of the full forward. A packed
    decode passes the new tokens' ``segment_ids`` (and ``positions``) on every call.
    """
    if len(cache) != len(self.blocks):
      raise ValueError(f"cache has {len(cache)} layers, the model {len(self.blocks)}")
    embed_positions = positions
    if positions is None and self.position_embed is not None:
      # Learned positions continue from the tokens the caches have seen.
      embed_positions = cache[0].index + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    h = self._embed(tokens, embed_positions)
    new_cache = []
    for block, layer_cache in zip(self.blocks, cache):
      h, layer_cache = block.decode(
        h,
        layer_cache,
        segment_ids=segment_ids,
        positions=positions,
        sow_weights=sow_weights,
        sow_hidden=sow_hidden,
      )
      new_cache.append(layer_cache)
    return self._logits(TransformerBlock._apply(self.final_norm, h), False), new_cache

  def init_cache(self, batch_size: int, max_len: int) -> list:
    """Empty per-layer caches (a list, a pytree) for sequences up to ``max_len`` tokens."""
    return [block.attention.init_cache(batch_size, max_len) for block in self.blocks]

  def _embed(
    self, tokens: Array, positions: Optional[Array] = None, token_type_ids: Optional[Array] = None
  ) -> Array:
    """Token embeddings (scaled), plus learned positions and token types, then ``embed_norm``."""
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"tokens must be integer [B, T], got {tokens.dtype} {tokens.shape}")
    c = self.config
    if not isinstance(tokens, jax.core.Tracer):
      check_token_ids(tokens, c.vocab_size)
    h = self.embed(tokens)
    if c.embed_scale is not None:
      h = h * jnp.asarray(c.embed_scale, c.param_dtype).astype(h.dtype)
    if self.position_embed is not None:
      T = tokens.shape[1]
      if positions is None:
        if T > c.learned_positions:
          raise ValueError(
            f"tokens {tokens.shape}: T={T} exceeds the "
            f"learned_positions={c.learned_positions} of this model"
          )
        positions = jnp.arange(T, dtype=jnp.int32)
      pos = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), tokens.shape)
      h = h + self.position_embed(pos).astype(h.dtype)
    if self.token_type_embed is not None:
      if token_type_ids is None:
        token_type_ids = jnp.zeros(tokens.shape, jnp.int32)
      h = h + self.token_type_embed(token_type_ids).astype(h.dtype)
    elif token_type_ids is not None:
      raise ValueError(
        f"token_type_ids {jnp.shape(token_type_ids)}: this model has no token-type "
        f"embeddings (ModelConfig.token_types=None)"
      )
    return TransformerBlock._apply(self.embed_norm, h)

  def _logits(self, features: Array, return_log_z: bool):
    logits = self.output_logits(features)
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
LOGICAL_AXIS_RULES = (("embed", None), ("heads", "model"), ("mlp", "model"), ("vocab", "model"))


def state_shardings(model: nnx.Module, mesh: jax.sharding.Mesh, rules=LOGICAL_AXIS_RULES):
  """``NamedSharding`` for every variable of ``nnx.state(model)``, from its logical names.

  Example (a ``(data, 1)`` mesh here; e.g. ``(4, 2)`` on 8 devices):

  >>> import jax
  >>> from flax import nnx
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> from attnjax import nn
  >>> cfg = nn.ModelConfig(vocab_size=64, d_model=32, num_layers=2,
  ...                      attention=nn.AttentionConfig(num_heads=4))
  >>> model = nn.TransformerLM(cfg, rngs=nnx.Rngs(0))
  >>> tokens = jax.random.randint(jax.random.key(0), (len(jax.devices()) * 2, 16), 0, 64)
  >>> mesh = jax.make_mesh((len(jax.devices()), 1), ("data", "model"))
  >>> graphdef, state = nnx.split(model)
  >>> state = jax.device_put(state, nn.state_shardings(model, mesh))
  >>> tokens = jax.device_put(tokens, NamedSharding(mesh, P("data")))
  >>> tuple(state["embed"]["embedding"].sharding.spec)    # [vocab, embed]
  ('model', None)

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


def check_token_ids(tokens, vocab_size: int) -> None:
  """Raises ValueError unless every id of concrete ``tokens`` is in ``[0, vocab_size)``.

  The model checks the ids it is given outside ``jax.jit`` (an embedding lookup past the
  table gives NaN logits, a negative id wraps to the table's end). Under ``jax.jit`` the ids
  are traced: wrap the jitted function with ``jax.experimental.checkify.checkify(fn,
  errors=checkify.index_checks)``, whose error reports an id ``>= vocab_size`` (a negative
  id is a valid index there: check those before).
  """
  ids = np.asarray(tokens)
  if ids.size == 0:
    return
  bad = (ids < 0) | (ids >= vocab_size)
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(
      f"tokens hold ids outside [0, vocab_size={vocab_size}): {int(bad.sum())} of {ids.size}, "
      f"first {int(ids[where])} at {list(where)} (min {int(ids.min())}, max {int(ids.max())}); "
      f"an id past the embedding table gives NaN logits"
    )


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


def _forward_for_stats(model, tokens, inputs=None, *, weights: bool, hidden: bool):
  return model(tokens, sow_weights=weights or None, sow_hidden=hidden, **(inputs or {}))


_jit_forward_for_stats = nnx.jit(_forward_for_stats, static_argnames=("weights", "hidden"))


def _sown_stats(
  model: TransformerLM,
  tokens: Array,
  *,
  weights: bool,
  hidden: bool,
  jit: bool,
  inputs: Optional[dict] = None,
) -> dict[str, Any]:
  """The ``"sown"`` view of ``attnjax.nn.layer_stats``: one pass read from ``nnx.Intermediate``.

  ``inputs``: more keyword arguments of the model's call (an encoder's ``attention_mask``).
  """
  fwd = _jit_forward_for_stats if jit else _forward_for_stats
  logits, inter = nnx.capture(fwd, nnx.Intermediate)(
    model, tokens, inputs, weights=weights, hidden=hidden
  )
  recorded = intermediates.read(inter, len(model.blocks))
  return {
    "logits": logits,
    "log_z": recorded.model.get("log_z"),
    "layers": [intermediates.fields(layer) for layer in recorded.layers],
  }


def collect_stats(
  model: TransformerLM,
  tokens: Array,
  *,
  weights: bool = False,
  hidden: bool = False,
  jit: bool = True,
) -> dict[str, Any]:
  """Deprecated: ``attnjax.nn.layer_stats(model, tokens, view="sown")``, which returns the same.

  Per-layer statistics of one forward pass, read from ``nnx.Intermediate``: a
  dict with ``"logits"``, ``"log_z"`` and ``"layers"`` (see ``layer_stats``).
  """
  warn_once("attnjax.nn.collect_stats", "attnjax.nn.layer_stats(model, tokens, view='sown')")
  if not isinstance(model, TransformerLM):
    raise TypeError(f"collect_stats takes an attnjax.nn.TransformerLM, got {type(model).__name__}")
  return _sown_stats(model, tokens, weights=weights, hidden=hidden, jit=jit)
