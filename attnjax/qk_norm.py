"""QK-normalised and cosine attention: normalise q and k over the head dim, then dense attention.

Both are front ends of dense attention, each an op with dense's engines (``"qk_norm"``,
``"cosine"``): every dense option and implementation works unchanged after the normalisation.

References:
  Dehghani et al. 2023 (ViT-22B) and Wortsman et al. 2023: QK LayerNorm.
  Henry et al. 2020, "Query-Key Normalization for Transformers".
  Liu et al. 2022, "Swin Transformer V2": cosine attention with a learned,
  clamped log-scale per head.
  Loshchilov et al. 2024, "nGPT": unit-norm q, k scaled by a learned ``s_qk``
  and a softmax scale of ``sqrt(H)``.
"""

from attnjax._src.ops.cosine.attention import (
  COSINE_CONVENTIONS,
  COSINE_KEYWORDS,
  SWIN_MAX_LOG_SCALE,
  cosine_attention,
)
from attnjax._src.ops.qk_norm.attention import (
  NORMS,
  QK_NORM_KEYWORDS,
  RENAMED_KEYWORDS,
  normalize_head,
  qk_norm_attention,
)

__all__ = [
  "COSINE_CONVENTIONS",
  "COSINE_KEYWORDS",
  "NORMS",
  "QK_NORM_KEYWORDS",
  "RENAMED_KEYWORDS",
  "SWIN_MAX_LOG_SCALE",
  "cosine_attention",
  "normalize_head",
  "qk_norm_attention",
]
