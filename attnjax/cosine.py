"""Cosine attention: logits are ``cos(q_i, k_j)`` times a learned per-head scale.

:func:`attnjax.cosine_attention` normalises q and k to unit length (the query times the
temperature of its ``convention``, :data:`COSINE_CONVENTIONS`) and runs dense attention on
them: a front end of dense attention, an op with dense's engines (``"cosine"``), so every
dense option and implementation works unchanged. The same names are in :mod:`attnjax.qk_norm`.
Guide: :doc:`/guides/qk_norm`.
"""

from attnjax._src.ops.cosine.attention import (
  COSINE_CONVENTIONS,
  COSINE_KEYWORDS,
  SWIN_MAX_LOG_SCALE,
  cosine_attention,
)

__all__ = ["COSINE_CONVENTIONS", "COSINE_KEYWORDS", "SWIN_MAX_LOG_SCALE", "cosine_attention"]
