"""Linear (kernel-feature) attention: ``exp(q.k)`` replaced by ``phi(q) . phi(k)``.

With a feature map ``phi`` (see :mod:`attnjax.feature_maps`) the causal output
of query ``i`` only needs the running sums

    S_i = sum_{j <= i} phi(k_j) v_j^T   [F, Hv]        z_i = sum_{j <= i} phi(k_j)   [F]

so attention becomes a recurrence with a fixed-size state (Katharopoulos et al.
2020). Three causal forms (``implementation``, the names of every recurrent
family, see ``attnjax._recurrent``) compute the same function and are tested
equal in value, final state and gradient:

- ``quadratic`` (formerly ``parallel``, which still works and warns once):
  materialises the masked ``[T, S]`` matrix ``phi(Q) phi(K)^T``,
  O(T^2). Linear attention is defined as attention with these weights, so
  this is its readable definition and ``"reference"`` names it
  (:data:`~attnjax.linear.REFERENCE_FORM`).
- ``recurrent``: ``lax.scan`` over time carrying ``(S, z)``; the decode form.
- ``chunked``: splits time into chunks of ``chunk_size``; inside a chunk the
  masked quadratic form, across chunks the state summed over earlier chunks.
  O(T * chunk_size) time, any ``T`` (the last chunk is padded).

Non-causal attention is O(T) through ``phi(K)^T V`` (``chunked``, the default)
or the ``quadratic`` form (= ``reference``); there is no ``recurrent``. The forms are the
engines of :data:`~attnjax.linear.OP` (:mod:`attnjax._op`).

The three ways of normalising (``normalize``):

- ``"denominator"`` (alias ``True``): ``phi(q_i).S_i / (phi(q_i).z_i + eps)``,
  Katharopoulos et al. 2020;
- ``"none"`` (alias ``False``): the unnormalised ``phi(q_i).S_i``;
- ``"output_rms"``: ``RMSNorm(phi(q_i).S_i)`` over the value dim, no
  denominator, no gain (the gain belongs to a module): Qin et al. 2022 show the
  denominator makes gradients unbounded and normalise the output instead.

An ``initial_state`` is a prefix every query sees (causal: the keys before the
first query); the returned state is the initial state plus this call's keys,
so calling the recurrent form token by token equals one call on the whole
sequence.

What :func:`.linear_attention` returns (the rule every stateful family follows):
the *primary result* ``r`` is ``out`` when ``return_state=False`` and the pair
``(out, state)`` when ``return_state=True``; ``return_stats=True`` wraps it as
``(r, AttentionStats)``, exactly as in every other family. So the four cases are
``out``, ``(out, state)``, ``(out, stats)`` and ``((out, state), stats)``.
"""

from attnjax._src.ops.linear.attention import IMPLEMENTATIONS
from attnjax._src.ops.linear.attention import (DEFAULT_EPS, LINEAR_STATIC, NORMALIZE, OP,
                                               REFERENCE_FORM, LinearState, chunked, finish,
                                               linear_attention, linear_attention_weights,
                                               noncausal, parallel, quadratic, recurrent,
                                               zeros_state)

__all__ = ["DEFAULT_EPS", "IMPLEMENTATIONS", "LINEAR_STATIC", "NORMALIZE", "OP", "REFERENCE_FORM",
    "LinearState", "chunked", "finish", "linear_attention", "linear_attention_weights",
    "noncausal", "parallel", "quadratic", "recurrent", "zeros_state"]
