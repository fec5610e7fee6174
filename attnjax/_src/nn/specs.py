"""Per-family attention specs: each family's options, parameters, attention call and cache.

Implementation behind the public module :mod:`attnjax.nn.specs`.
"""

from attnjax._src.nn.linear_spec import LinearSpec
from attnjax._src.nn.softmax_specs import (
  CosineSpec,
  DenseSpec,
  DotProductSpec,
  QKNormSpec,
  ScoreSpec,
  SparseSpec,
)

# After the others: the gated families register after them (FAMILY_SPECS keeps that order).
from attnjax._src.nn.gated_spec import (
  GATED_FAMILIES,
  DeltaNetSpec,
  GatedDeltaNetSpec,
  KDASpec,
  GatedSpec,
  GLASpec,
  Mamba2DecaySpec,
  RetNetSpec,
)
from attnjax._src.nn.block_select_spec import BlockSelectCache, BlockSelectSpec
from attnjax._src.nn.compressed_spec import CompressedSpec
from attnjax._src.nn.dsa_spec import DSACache, DSASpec
from attnjax._src.nn.nsa_spec import NSACache, NSASpec
from attnjax._src.nn.mla_spec import MLASpec
from attnjax._src.nn.spec_base import (
  DEFAULT_TEMPERATURE,
  FAMILY_SPECS,
  FEATURE_MAPS,
  PATTERNS,
  STREAMING_ROPE,
  AttentionSpec,
  Call,
  check_int,
  check_type,
  register_family,
  run_and_sow,
)

__all__ = [
  "AttentionSpec",
  "BlockSelectCache",
  "BlockSelectSpec",
  "Call",
  "CompressedSpec",
  "CosineSpec",
  "DEFAULT_TEMPERATURE",
  "DSACache",
  "DSASpec",
  "DeltaNetSpec",
  "DenseSpec",
  "FAMILY_SPECS",
  "FEATURE_MAPS",
  "GATED_FAMILIES",
  "GLASpec",
  "GatedDeltaNetSpec",
  "KDASpec",
  "GatedSpec",
  "DotProductSpec",
  "LinearSpec",
  "MLASpec",
  "Mamba2DecaySpec",
  "NSACache",
  "NSASpec",
  "PATTERNS",
  "QKNormSpec",
  "RetNetSpec",
  "STREAMING_ROPE",
  "ScoreSpec",
  "SparseSpec",
  "check_int",
  "check_type",
  "register_family",
  "run_and_sow",
]
