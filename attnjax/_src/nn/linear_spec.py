"""The linear-attention family spec: kernel feature maps with a recurrent decode state."""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax.numpy as jnp

from attnjax._src import validators, feature_maps
from attnjax._src.ops.linear import attention as linear_lib
from attnjax._src.nn import _layers
from attnjax._src.nn.caches import FeatureProjection, LinearCache
from attnjax._src.nn.spec_base import (
  FEATURE_MAPS,
  AttentionSpec,
  _rope,
  check_int,
  check_type,
  register_family,
  run_and_sow,
)

Array = jnp.ndarray


@dataclasses.dataclass(frozen=True)
class LinearSpec(AttentionSpec):
  """Kernel feature-map attention (:func:`attnjax.linear_attention`).

  Attributes:
    feature_map: a name from :mod:`attnjax.feature_maps` (``"elu_plus_one"``,
      ``"relu"``, ``"identity"``, ``"squared_relu"``, or the random
      ``"favor_plus"`` / ``"trig"``, whose projection ``[m, H]`` the layer draws
      at init and keeps as a non-trained variable).
    num_features: random features m of ``favor_plus`` / ``trig``.
    stabilize_features: random maps: subtract the stop-gradient maxima in the
      full forward (Performer practice). A decode state cannot carry them, so
      decoding always uses the exact estimator; with
      ``linear_normalize="denominator"`` the constants cancel and the two agree
      up to the denominator's ``eps``.
    linear_normalize: the ``normalize`` form of :func:`attnjax.linear_attention`.
    chunk_size: chunk size of the chunked implementation.

  No mask or segment ids: linear attention sums over every allowed key without
  forming the weights, so only causal, non-causal and cross-attention exist.
  """

  family: ClassVar[str] = "linear"
  optional_params: ClassVar[tuple[str, ...]] = ("feature_projection",)
  op: ClassVar[str] = "linear"
  takes_segment_ids: ClassVar[bool] = False

  feature_map: str = "elu_plus_one"
  num_features: int = 64
  stabilize_features: bool = True
  linear_normalize: str = "denominator"
  chunk_size: int = 64

  def validate(self) -> None:
    check_int("num_features", self.num_features)
    check_int("chunk_size", self.chunk_size)
    check_type("stabilize_features", self.stabilize_features, bool, "a bool")
    validators.check_choice("feature_map", self.feature_map, FEATURE_MAPS)
    validators.check_choice("linear_normalize", self.linear_normalize, linear_lib.NORMALIZE)

  def init_params(self, layer, rngs, param_dtype) -> None:
    layer.orthogonal_features = False
    if self.feature_map in feature_maps.RANDOM:
      factory = (
        feature_maps.favor_plus if self.feature_map == "favor_plus" else feature_maps.trig_features
      )
      drawn = factory(rngs.params(), self.num_features, head_dim=layer.head_dim)
      layer.feature_projection = FeatureProjection(drawn.projection)
      layer.orthogonal_features = drawn.orthogonal

  def default_function(self, layer):
    return linear_lib.linear_attention

  def make_feature_map(self, layer, *, decoding: bool) -> feature_maps.FeatureMap:
    if self.feature_map not in feature_maps.RANDOM:
      return feature_maps.by_name(self.feature_map)
    # A carried state needs the exact (unstabilised) estimator; see the class docstring.
    return feature_maps.FeatureMap(
      self.feature_map,
      layer.feature_projection[...],
      stabilize=self.stabilize_features and not decoding,
      orthogonal=layer.orthogonal_features,
    )

  def redraw(self, layer, key: Array) -> None:
    if self.feature_map not in feature_maps.RANDOM:
      raise ValueError(
        f"redraw_features needs a random feature map, this layer has "
        f"family='linear', feature_map={self.feature_map!r}"
      )
    layer.feature_projection[...] = feature_maps.gaussian_projection(
      key, self.num_features, layer.head_dim, orthogonal=layer.orthogonal_features
    )

  def attend(self, layer, q, k, v, call):
    c = layer.config
    if call.mask is not None:
      raise ValueError(
        "mask: family='linear' cannot take a mask (it never forms the weights); "
        "only causal, non-causal and cross-attention exist"
      )
    if call.segment_ids is not None:
      raise ValueError(
        "segment_ids: family='linear' cannot take segment_ids (packed sequences "
        "need a mask, which linear attention cannot apply)"
      )
    cache = call.cache
    is_causal = c.is_causal and not call.cross
    if not call.cross:
      T = q.shape[1]
      idx = jnp.arange(T, dtype=jnp.int32)
      if cache is not None:
        self.check_decode_cache(layer, cache, LinearCache)
        idx = idx + cache.index
      positions = idx if call.positions is None else call.positions
      q, k = _rope(layer, q, positions), _rope(layer, k, positions)
    fm = self.make_feature_map(layer, decoding=cache is not None)
    kwargs = dict(
      feature_map=fm,
      is_causal=is_causal,
      normalize=self.linear_normalize,
      implementation=c.implementation,
      chunk_size=self.chunk_size,
    )
    fn = self.function(layer)

    def weights():
      return linear_lib.linear_attention_weights(
        q, k, feature_map=fm, is_causal=is_causal, normalize=self.linear_normalize
      )

    if cache is None:
      run = functools.partial(fn, **kwargs)
      return run_and_sow(layer, run, q, k, v, call, weights=weights), None
    result = fn(
      q, k, v, initial_state=cache.state, return_state=True, return_stats=call.capture, **kwargs
    )
    # return_stats wraps the primary result, here (out, state): see attnjax.linear.
    (out, state), stats = result if call.capture else (result, None)
    new_cache = LinearCache(state=state, index=cache.index + q.shape[1])
    if call.capture:
      _layers.sow(layer, "attention_stats", stats)
      if call.sow_weights:
        _layers.sow(layer, "weights", weights())
    return out, new_cache

  def init_cache(self, layer, batch_size, max_len):
    K, H = layer.num_kv_heads, layer.head_dim
    F = self.make_feature_map(layer, decoding=True).num_features(H)
    return LinearCache(
      state=linear_lib.zeros_state(batch_size, K, F, H), index=jnp.zeros((), jnp.int32)
    )

  def allowed_mask(self, layer, length):
    if layer.config.is_causal:
      return jnp.tril(jnp.ones((length, length), bool))[None, None]
    return jnp.ones((1, 1, length, length), bool)


register_family(LinearSpec)
