"""The normalisers: how a row of logits becomes attention weights, defined once each.

Every normaliser is one object in :data:`REGISTRY` that carries everything each
path needs, written in pure ``jnp`` on blocks (no Python branch depends on a
normaliser's name outside its own class), so the same definition drives the
dense reference, the block-wise kernel (:mod:`attnjax.kernels.blockwise`), the sparse
paths (:mod:`attnjax.sparse`, including the strided merge) and could drive a
Pallas kernel body:

- **materialised weights** :meth:`Normalizer.weights`: float32 logits ``z``
  ``[B, N, T, S]`` and the boolean ``allowed`` mask (broadcastable to it) ->
  ``(weights, log_normalizer)``, where ``log_normalizer`` ``[B, N, T, 1]`` is
  the log of the softmax-style partition (including a null column when there
  is one);
- **online accumulation** over key tiles: :meth:`Normalizer.row_inputs` (per-row
  constants, once per query block), :meth:`Normalizer.init` (state),
  :meth:`Normalizer.visit` (one tile of logits -> new state),
  :meth:`Normalizer.finish` (output rows, backward residuals, statistics rows);
- **merge** of partial results of the same rows over disjoint key sets
  (:meth:`Normalizer.merge`, where ``mergeable``);
- the **backward rule** per tile (:meth:`Normalizer.tile_backward`: ``dz`` from
  ``dp = dO V^T``, the residuals and the logsumexp cotangent) and the gradient of
  a learned null logit (:meth:`Normalizer.null_grad`);
- **capabilities** read by kernels, dispatch and layers instead of names:
  ``needs_counts`` (allowed keys per row up front), ``shift_floor`` (the exp
  shift never goes below the null column's logit), ``null_column``,
  ``accepts_sink_logits``, ``platform_kernel`` (what jax.nn / cuDNN / splash
  compute), ``mergeable`` / ``merge_part`` (the strided fast path),
  ``reads_row_dot`` (the backward needs ``D_i = <dO_i, O_i>``); and, as
  facts for callers (no kernel reads them), ``softmax_like`` (weights are
  ``exp(z - log_normalizer)``) and ``sums_to_one``;
- **statistics** rows (entropy, first-key weight, row sum, logsumexp) from the
  online state, equal to :func:`attnjax.attention_stats.stats_from_weights`.

Masked keys get weight exactly 0 and a row with no allowed key gets all zeros.
Every form is written so that neither value nor gradient can be NaN for finite
logits: masked logits are replaced by -inf before ``exp`` and the running
maximum is a ``stop_gradient`` shift (the result does not depend on it).

=============  ===========================================================  ======================
name           weight of key j in row i                                     source
=============  ===========================================================  ======================
softmax        exp(z_ij) / sum_l exp(z_il)                                  Vaswani et al. 2017
softmax_one    exp(z_ij) / (1 + sum_l exp(z_il))                            Miller 2023 ("off by one")
(sink_logits)  exp(z_ij) / (exp(s_h) + sum_l exp(z_il)), learned s_h         gpt-oss (2025)
sigmoid        sigmoid(z_ij + b_i), b_i = -log(number of allowed keys)      Ramapuram et al. 2024
softpick       relu(exp(z_ij) - 1) / (sum_l abs(exp(z_il) - 1) + eps)       Zuhri et al. 2025
none           z_ij (raw scores)                                             -
relu           relu(z_ij) / n_i, n_i = number of allowed keys of row i      Wortsman et al. 2023
=============  ===========================================================  ======================

Online state and row dictionaries
---------------------------------

``row`` (from :meth:`Normalizer.row_inputs`) holds per-row ``[..., R, 1]``
arrays: ``"floor"`` (the null column's logit, or None), ``"counts"`` (allowed
keys per row, or None; given when ``needs_counts`` or statistics are asked
for) and the normaliser's own constants. The state is a dict of ``[..., R, 1]``
row arrays plus ``"acc"`` ``[..., R, Hv]``; kernels carry it through loops and
never look inside. ``pv(w)`` is the kernel's ``w @ V`` for the current tile.

This module is longer than the project's ~600-line guideline on purpose: each
normaliser is one class holding every path's view of it, and the classes share
helpers, so splitting would separate what the seam keeps together.
"""

from attnjax._src.normalizers import (NORMALIZERS, PV, REGISTRY, SOFTPICK_EPS, SUMS_TO_ONE, TABLE,
                                      Elementwise, Identity, Normalizer, ReLU, Sigmoid,
                                      SoftmaxFamily, Softpick, first_logit, get, normalize,
                                      num_allowed)

__all__ = ["NORMALIZERS", "PV", "REGISTRY", "SOFTPICK_EPS", "SUMS_TO_ONE", "TABLE", "Elementwise",
    "Identity", "Normalizer", "ReLU", "Sigmoid", "SoftmaxFamily", "Softpick", "first_logit", "get",
    "normalize", "num_allowed"]
