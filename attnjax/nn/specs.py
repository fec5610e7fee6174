"""Per-family attention specs: each family's options, parameters, attention call and cache.

An :class:`attnjax.nn.AttentionConfig` holds the options every layer has and one *spec*,
a frozen dataclass of its family's options that builds the family's parameters
(:meth:`.AttentionSpec.init_params`), calls its pure function for self-attention,
cross-attention and decoding (:meth:`.AttentionSpec.attend`), makes its decode cache
(:meth:`.AttentionSpec.init_cache`) and says which pairs it allows and what q/k it
compares (:meth:`.AttentionSpec.allowed_mask`, :meth:`.AttentionSpec.compared_qk`).
``Attention`` never branches on the family: a new family is one spec class registered
with :func:`.register_family`.

Guide: :doc:`/guides/layers` (the families, and how to add one).
"""

from attnjax._src.nn.specs import (
  DEFAULT_TEMPERATURE,
  FAMILY_SPECS,
  FEATURE_MAPS,
  GATED_FAMILIES,
  PATTERNS,
  STREAMING_ROPE,
  AttentionSpec,
  BlockSelectCache,
  BlockSelectSpec,
  Call,
  CompressedSpec,
  MLASpec,
  CosineSpec,
  DeltaNetSpec,
  DenseSpec,
  DotProductSpec,
  DSACache,
  DSASpec,
  GLASpec,
  GatedDeltaNetSpec,
  KDASpec,
  GatedSpec,
  LinearSpec,
  Mamba2DecaySpec,
  NSACache,
  NSASpec,
  QKNormSpec,
  RetNetSpec,
  ScoreSpec,
  SparseSpec,
  register_family,
)

__all__ = [
  "DEFAULT_TEMPERATURE",
  "FAMILY_SPECS",
  "FEATURE_MAPS",
  "GATED_FAMILIES",
  "PATTERNS",
  "STREAMING_ROPE",
  "AttentionSpec",
  "BlockSelectCache",
  "BlockSelectSpec",
  "Call",
  "CompressedSpec",
  "MLASpec",
  "CosineSpec",
  "DeltaNetSpec",
  "DenseSpec",
  "DotProductSpec",
  "DSACache",
  "DSASpec",
  "GLASpec",
  "GatedDeltaNetSpec",
  "KDASpec",
  "GatedSpec",
  "LinearSpec",
  "Mamba2DecaySpec",
  "NSACache",
  "NSASpec",
  "QKNormSpec",
  "RetNetSpec",
  "ScoreSpec",
  "SparseSpec",
  "register_family",
]
