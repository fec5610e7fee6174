"""Delta-rule linear attention: the update of DeltaNet and Gated DeltaNet.

Names, as in the papers: the *delta rule* is the update (this module, the
function :func:`attnjax.delta_rule_attention`); *DeltaNet* and *Gated DeltaNet*
are the models whose layers wrap it in their projections, short convolution and
norms (the ``attnjax.nn`` families and experiment variants ``deltanet`` and
``gated_deltanet``).

Per query head the state ``S_t`` is an ``[H, Hv]`` fast-weight matrix updated by
the delta rule (Schlag et al. 2021), optionally with a scalar decay per head and
step (the gated delta rule of Gated DeltaNet, Yang et al. 2025):

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = scale * S_t^T q_t

``beta_t`` in (0, 1) is the write strength, ``g_t <= 0`` the log decay
(``g = 0``: the plain delta rule, DeltaNet's). ``k`` is taken as given; the
papers' layers L2-normalise ``q`` and ``k`` before the call.

Three forms (``implementation``, the names of every recurrent family, see
``attnjax._recurrent``) compute the same function and are tested equal in
value, final state and every gradient:

- ``recurrent``: ``lax.scan`` over time, one rank-1 update per step; the
  decode form. It is the readable definition, so ``"reference"`` names it
  (:data:`~attnjax.delta_rule.REFERENCE_FORM`).
- ``quadratic`` (formerly ``parallel``, which still works and warns once): the
  chunk form below over the whole sequence as one chunk
  (no scan): a ``[T, T]`` triangular solve and the masked ``(Q K^T * Gamma)``
  product; for short sequences and tests.
- ``chunked`` (default): the WY / UT-transform chunk form (Yang et al. 2024).
  Inside a chunk of length ``C`` with cumulative log gates
  ``G_t = g_1 + ... + g_t`` and chunk-initial state ``S_0``, unrolling the
  recurrence gives

      S_t = exp(G_t) S_0 + sum_{j <= t} exp(G_t - G_j) k_j u_j^T

  with pseudo-values ``u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)``, i.e.
  ``(I + A) U = diag(beta) V - diag(beta exp(G)) K S_0`` where
  ``A_tj = beta_t exp(G_t - G_j) k_t.k_j`` for ``j < t``. One unit
  lower-triangular solve (the inverse by block doubling,
  :func:`.unit_lower_inverse`) gives ``U = T V`` and ``W = T' K`` (the UT
  transform, ``T = (I + A)^{-1} diag(beta)``), then ``U' = U - W S_0``,
  ``O = diag(exp(G)) Q S_0 + (Q K^T * Gamma) U'`` with the causal decay matrix
  ``Gamma_tj = exp(G_t - G_j)`` (``j <= t``), and
  ``S_C = exp(G_C) S_0 + K^T diag(exp(G_C - G)) U'``. Only differences
  ``G_t - G_j <= 0`` (``j <= t``) and ``G_t <= 0`` are exponentiated, so strong
  gates and long chunks underflow to 0 and never overflow.

The delta rule's output is not a masked product ``(Q K^T * M) V`` of the
values themselves: the pseudo-values ``U`` need the triangular solve above, so
its quadratic whole-sequence form (``"quadratic"``) is the chunk form with one
chunk of ``T`` tokens.

``segment_ids`` reset the state where the id changes between consecutive
tokens (packed documents); the ``initial_state`` belongs to the document of
token 0, so a call continuing a document with its state equals one call on the
concatenation. Resets enter the chunked form as a same-document mask on
``Gamma`` and on the ``exp(G)`` factors of ``S_0``.

Return rule (as :mod:`attnjax.linear`): ``out``, or ``(out, state)`` with
``return_state=True``. There are no statistics (no ``return_stats``).

References:
  Schlag, Irie, Schmidhuber 2021, "Linear Transformers Are Secretly Fast
  Weight Programmers".
  Yang, Wang, Zhang, Shen, Kim 2024, "Parallelizing Linear Transformers with
  the Delta Rule over Sequence Length".
  Yang, Kautz, Hatamizadeh 2025, "Gated Delta Networks: Improving Mamba2 with
  Delta Rule".
"""

from attnjax._src.ops.delta_rule.attention import IMPLEMENTATIONS
from attnjax._src.ops.delta_rule.attention import (DELTA_STATIC, OP, REFERENCE_FORM, chunked,
                                                   delta_rule_attention, parallel, quadratic,
                                                   recurrent, unit_lower_inverse, unit_lower_solve)

__all__ = ["DELTA_STATIC", "IMPLEMENTATIONS", "OP", "REFERENCE_FORM", "chunked",
    "delta_rule_attention", "parallel", "quadratic", "recurrent", "unit_lower_inverse",
    "unit_lower_solve"]
