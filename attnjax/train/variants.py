"""Named attention variants: the arms of the experiments, as ``attnjax.nn.AttentionConfig`` fields.

``config.variant = "cosine"`` selects one; :func:`.attention_kwargs` gives the
fields passed to ``AttentionConfig``. The experiments' reports and docs/guides/experiments.md
use these names.
"""

from attnjax._src.train.variants import (
  COMPARE,
  GATED,
  LATENT,
  SINK_FREE,
  VARIANTS,
  attention_kwargs,
  check_variants,
  describe,
)

__all__ = [
  "COMPARE",
  "GATED",
  "LATENT",
  "SINK_FREE",
  "VARIANTS",
  "attention_kwargs",
  "check_variants",
  "describe",
]
