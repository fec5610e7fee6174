"""Feature maps ``phi`` for linear attention: ``exp(q.k)`` is replaced by ``phi(q).phi(k)``.

Every map is a :class:`.FeatureMap`: a small frozen dataclass registered as a
JAX pytree. Its *kind* and options are pytree metadata (static, hashable); the
random projection of the softmax-kernel maps is its only array leaf. So a map
is passed to :func:`attnjax.linear_attention` as an ordinary argument:

- the deterministic maps (``elu_plus_one``, ``relu``, ``identity``,
  ``squared_relu``) have no leaves and are pure static structure, so changing
  the map recompiles and nothing is traced;
- the random maps (``favor_plus``, ``trig_features``) carry their projection
  ``[m, H]`` as a traced array, so redrawing features (a new key) or learning
  the projection never recompiles and nothing random is created inside the
  attention function. The draw happens in the factory, from the key the caller
  passes: the factories are pure.

This keeps ``linear_attention`` pure and jittable without asking callers to
thread a projection through a separate argument.

Random features for the softmax kernel (Choromanski et al. 2021): with input
``x`` scaled by ``H ** -0.25`` (so that ``x_q . x_k = q.k / sqrt(H)``) and rows
``w_r ~ N(0, I_H)``,

- positive (FAVOR+): ``phi(x)_r = exp(w_r.x - |x|^2 / 2) / sqrt(m)``, an unbiased
  and always-positive estimator of ``exp(x_q . x_k)``;
- trigonometric: ``phi(x) = exp(|x|^2 / 2) / sqrt(m) [sin(w.x), cos(w.x)]``
  (``2m`` features), unbiased but signed, with large variance where the kernel
  is small (the comparison the paper makes).

Numerical stabilisation (``stabilize=True``, the default) subtracts a
stop-gradient maximum inside the exponent, as the Performer implementations
do. For *queries* the constant is per row (``max_r`` over the features of that
query), which scales ``phi(q_i)`` by a positive constant ``c_i`` (the constant
``1 / sqrt(m)`` is dropped too): every row of
the estimated attention matrix is scaled by ``c_i``, so any row-normalised
output (``normalize="denominator"``, and ``"output_rms"``) is unchanged
(up to ``eps``). For *keys* the constant must be shared by every key the query
sees, so it is the maximum over the features and all positions of the call
(per batch element and key/value head): a global constant, which cancels in the
same way. It cannot cancel in an unnormalised sum, nor in a state carried from
one call to the next (the next call's keys would have another constant), so
:func:`attnjax.linear_attention` refuses stabilised random maps with
``normalize="none"`` or with ``initial_state``/``return_state``; pass
``stabilize=False`` there (exact estimator, finite while ``|w.x|`` stays below
about 80).

References:
  Katharopoulos et al. 2020, "Transformers are RNNs: Fast Autoregressive
  Transformers with Linear Attention" (elu + 1).
  Choromanski et al. 2021, "Rethinking Attention with Performers" (FAVOR+,
  orthogonal random features, trigonometric features).
  Hua et al. 2022, "Transformer Quality in Linear Time" (squared ReLU).
"""

from attnjax._src.feature_maps import (DETERMINISTIC, NONNEGATIVE, RANDOM, FeatureMap, by_name,
                                       elu_plus_one, favor_plus, gaussian_projection, identity,
                                       relu, squared_relu, trig_features)

__all__ = ["DETERMINISTIC", "NONNEGATIVE", "RANDOM", "FeatureMap", "by_name", "elu_plus_one",
    "favor_plus", "gaussian_projection", "identity", "relu", "squared_relu", "trig_features"]
