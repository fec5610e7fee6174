"""Feature maps ``phi`` for linear attention: ``exp(q.k)`` is replaced by ``phi(q).phi(k)``.

Every map is a :class:`.FeatureMap`, a frozen dataclass registered as a pytree: its kind
and options are static, the random projection of ``favor_plus`` / ``trig_features`` its
only array leaf, so a map is an ordinary argument of :func:`attnjax.linear_attention`
(a new key recompiles nothing) and the factories are pure. Deterministic maps:
``elu_plus_one``, ``relu``, ``identity``, ``squared_relu``; random features for the
softmax kernel (Choromanski et al. 2021) are stabilised by default (``stabilize=True``).

Guide: :doc:`/guides/linear`, sections "Linear attention" and "Feature maps".
"""

from attnjax._src.feature_maps import (
  DETERMINISTIC,
  NONNEGATIVE,
  RANDOM,
  FeatureMap,
  by_name,
  elu_plus_one,
  favor_plus,
  gaussian_projection,
  identity,
  relu,
  squared_relu,
  trig_features,
)

__all__ = [
  "DETERMINISTIC",
  "NONNEGATIVE",
  "RANDOM",
  "FeatureMap",
  "by_name",
  "elu_plus_one",
  "favor_plus",
  "gaussian_projection",
  "identity",
  "relu",
  "squared_relu",
  "trig_features",
]
