"""Feature maps ``phi`` for linear attention: ``exp(q.k)`` is replaced by ``phi(q).phi(k)``.

Implementation behind the public module :mod:`attnjax.feature_maps`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal, Optional, get_args

import jax
import jax.numpy as jnp
import numpy as np

from attnjax._src import validators
from attnjax._src.numerics import einsum

Array = jnp.ndarray

DeterministicKind = Literal["elu_plus_one", "relu", "identity", "squared_relu"]
RandomKind = Literal["favor_plus", "trig"]
DETERMINISTIC: tuple[str, ...] = get_args(DeterministicKind)
RANDOM: tuple[str, ...] = get_args(RandomKind)
# Kinds whose features are never negative, so phi(q).phi(k) >= 0.
NONNEGATIVE = ("elu_plus_one", "relu", "squared_relu", "favor_plus")


@dataclasses.dataclass(frozen=True, eq=False)
class FeatureMap:
  """A feature map ``phi``: static ``kind`` and options, plus an optional projection.

  Attributes:
    kind: one of ``DETERMINISTIC`` or ``RANDOM``.
    projection: ``[m, H]`` random directions for the random kinds (a pytree
      leaf, traced under jit); None for the deterministic kinds.
    stabilize: random kinds only: subtract the stop-gradient maxima described
      in the module docstring.
    orthogonal: how ``projection`` was drawn (informational; static).
  """

  kind: DeterministicKind | RandomKind
  projection: Optional[Array] = None
  stabilize: bool = True
  orthogonal: bool = False

  @property
  def nonnegative(self) -> bool:
    """True when every feature is ``>= 0`` (so the implied weights are too)."""
    return self.kind in NONNEGATIVE

  @property
  def is_random(self) -> bool:
    return self.kind in RANDOM

  @property
  def needs_consistent_scale(self) -> bool:
    """True when features carry data-dependent stabilising constants (see module doc)."""
    return self.is_random and self.stabilize

  def num_features(self, head_dim: int) -> int:
    """Feature dimension ``F`` for inputs of head dim ``H``."""
    if self.kind == "favor_plus":
      return self.projection.shape[0]
    if self.kind == "trig":
      return 2 * self.projection.shape[0]
    return head_dim

  def check(self, head_dim: int) -> None:
    """Raises if this map cannot take inputs of head dim ``head_dim``."""
    validators.check_choice("feature_map.kind", self.kind, DETERMINISTIC + RANDOM)
    if self.is_random:
      if self.projection is None or np.ndim(self.projection) != 2:
        raise ValueError(
          f"feature_map {self.kind!r} needs a projection [m, H], got shape "
          f"{None if self.projection is None else validators.shape_of(self.projection)}"
        )
      if self.projection.shape[1] != head_dim:
        raise ValueError(
          f"feature_map {self.kind!r} projection has shape "
          f"{validators.shape_of(self.projection)}, expected [m, H] with H={head_dim}"
        )
      validators.check_floating("feature_map.projection", self.projection)
    elif self.projection is not None:
      raise ValueError(f"feature_map {self.kind!r} takes no projection")

  def __call__(self, x: Array, *, is_query: bool, position_axis: int = -3) -> Array:
    """Float32 features ``[..., F]`` of ``x`` ``[..., H]``.

    Args:
      x: inputs, last axis the head dim.
      is_query: queries get a per-row stabiliser, keys a global one (random
        kinds with ``stabilize=True`` only).
      position_axis: the sequence axis of ``x`` (``[B, T, heads, H]`` -> -3),
        over which the keys' global stabiliser is taken.
    """
    x = x.astype(jnp.float32)
    if self.kind == "elu_plus_one":
      return jax.nn.elu(x) + 1.0
    if self.kind == "relu":
      return jax.nn.relu(x)
    if self.kind == "identity":
      return x
    if self.kind == "squared_relu":
      return jnp.square(jax.nn.relu(x))
    H = x.shape[-1]
    m = self.projection.shape[0]
    xs = x * H**-0.25
    wx = einsum("...h,mh->...m", xs, self.projection.astype(jnp.float32))
    half_sq = 0.5 * jnp.sum(jnp.square(xs), axis=-1, keepdims=True)
    global_axes = (position_axis % x.ndim, x.ndim - 1)
    # Stabilised maps also drop the constant 1/sqrt(m): after the maxima are
    # subtracted it only shrinks phi(q).z towards the eps of the denominator
    # (by ~1/m), which would then bias large-m estimates; it cancels anyway.
    if self.kind == "favor_plus":
      exponent = wx - half_sq
      if not self.stabilize:
        return jnp.exp(exponent) * m**-0.5
      axes = -1 if is_query else global_axes
      return jnp.exp(exponent - jax.lax.stop_gradient(jnp.max(exponent, axis=axes, keepdims=True)))
    # trig: exp(|x|^2/2) [sin, cos]; the magnitude factor is the part that overflows.
    if self.stabilize:
      axes = -1 if is_query else global_axes
      scale = jnp.exp(half_sq - jax.lax.stop_gradient(jnp.max(half_sq, axis=axes, keepdims=True)))
    else:
      scale = jnp.exp(half_sq) * m**-0.5
    return jnp.concatenate([jnp.sin(wx) * scale, jnp.cos(wx) * scale], axis=-1)


jax.tree_util.register_dataclass(
  FeatureMap, data_fields=["projection"], meta_fields=["kind", "stabilize", "orthogonal"]
)


elu_plus_one = FeatureMap("elu_plus_one")
"""``elu(x) + 1`` (Katharopoulos et al. 2020): positive, identity-like for ``x > 0``."""
relu = FeatureMap("relu")
"""``max(x, 0)``; a row can have no positive feature (then its weights are all 0)."""
identity = FeatureMap("identity")
"""``x``: plain (signed) linear attention ``q.k``; denominators can vanish or change sign."""
squared_relu = FeatureMap("squared_relu")
"""``max(x, 0) ** 2`` (Hua et al. 2022)."""


def by_name(name: DeterministicKind) -> FeatureMap:
  """The deterministic feature map called ``name`` (for configs).

  Random maps need a key: use :func:`.favor_plus` or :func:`.trig_features`.

  Args:
    name: ``"elu_plus_one"``, ``"relu"``, ``"identity"`` or ``"squared_relu"``.

  Returns:
    The :class:`.FeatureMap` of that name.

  Raises:
    ValueError: an unknown name (the message lists the valid ones).
  """
  validators.check_choice("feature map name", name, DETERMINISTIC)
  return {
    "elu_plus_one": elu_plus_one,
    "relu": relu,
    "identity": identity,
    "squared_relu": squared_relu,
  }[name]


def gaussian_projection(
  key: Array, num_features: int, head_dim: int, *, orthogonal: bool = True
) -> Array:
  """Random directions ``[m, H]`` whose rows are marginally ``N(0, I_H)``.

  With ``orthogonal=True`` the rows come in blocks of ``H`` mutually
  orthogonal directions (QR of a Gaussian matrix, sign-corrected so the
  directions are Haar-distributed), and each row is rescaled to an
  independent chi(H)-distributed norm, the norm of a Gaussian vector, so every
  row keeps the ``N(0, I_H)`` marginal and the estimator stays unbiased while
  its variance drops (Choromanski et al. 2021, ORF). ``m > H`` stacks
  independent blocks; the last one is truncated.

  Args:
    key: PRNG key.
    num_features: ``m``.
    head_dim: ``H``.
    orthogonal: orthogonal blocks (True) or i.i.d. Gaussian rows (False).

  Returns:
    float32 ``[m, H]``.

  Raises:
    TypeError, ValueError: ``num_features`` or ``head_dim`` is not a positive int.
  """
  num_features = validators.check_positive_int("num_features", num_features)
  head_dim = validators.check_positive_int("head_dim", head_dim)
  return _draw_projection(key, num_features, head_dim, bool(orthogonal))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draw_projection(key: Array, num_features: int, head_dim: int, orthogonal: bool) -> Array:
  if not orthogonal:
    return jax.random.normal(key, (num_features, head_dim), jnp.float32)
  num_blocks = -(-num_features // head_dim)
  key_blocks, key_norms = jax.random.split(key)
  gauss = jax.random.normal(key_blocks, (num_blocks, head_dim, head_dim), jnp.float32)
  q, r = jnp.linalg.qr(gauss)
  # Columns of q are orthonormal; fixing the signs by diag(r) makes them Haar.
  q = q * jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))[:, None, :]
  directions = jnp.reshape(jnp.swapaxes(q, -1, -2), (num_blocks * head_dim, head_dim))
  directions = directions[:num_features]
  norms = jnp.linalg.norm(
    jax.random.normal(key_norms, (num_features, head_dim), jnp.float32), axis=-1
  )
  return directions * norms[:, None]


def favor_plus(
  key: Array,
  num_features: int,
  orthogonal: bool = True,
  *,
  head_dim: int = 64,
  stabilize: bool = True,
) -> FeatureMap:
  """Positive random features for the softmax kernel (FAVOR+).

  ``phi(q) . phi(k)`` is an unbiased estimate of ``exp(q.k / sqrt(H))`` (up to
  the stabilising constants that row normalisation cancels; module docstring).

  Args:
    key: PRNG key; the same key gives the same features (redraw = new key).
    num_features: ``m`` random features.
    orthogonal: orthogonal blocks with chi norms (True) or i.i.d. Gaussian rows.
    head_dim: ``H`` of the queries and keys the map will see.
    stabilize: subtract the per-row (queries) / global (keys) maxima.

  Returns:
    A :class:`.FeatureMap` with ``projection`` ``[m, H]`` and ``F = m``.

  References:
    Choromanski et al. 2021, "Rethinking Attention with Performers", Lemma 1
    and Section 2.4 (orthogonal random features).
  """
  return FeatureMap(
    "favor_plus",
    gaussian_projection(key, num_features, head_dim, orthogonal=orthogonal),
    stabilize=bool(stabilize),
    orthogonal=bool(orthogonal),
  )


def trig_features(
  key: Array,
  num_features: int,
  orthogonal: bool = False,
  *,
  head_dim: int = 64,
  stabilize: bool = True,
) -> FeatureMap:
  """Trigonometric random features for the softmax kernel, for comparison with FAVOR+.

  ``phi(x) = exp(|x|^2 / 2) / sqrt(m) [sin(w.x), cos(w.x)]`` on ``x`` scaled by
  ``H ** -0.25``; ``F = 2m``. Unbiased but signed: the estimated attention
  denominators can be near zero or negative, the failure Choromanski et al.
  report for this map.

  Args:
    key: PRNG key.
    num_features: ``m`` random directions (``2m`` features).
    orthogonal: orthogonal blocks (True) or i.i.d. Gaussian rows (False, the
      classic random Fourier features).
    head_dim: ``H``.
    stabilize: subtract the per-row / global maxima of ``|x|^2 / 2``.

  Returns:
    A :class:`.FeatureMap` with ``projection`` ``[m, H]``.

  References:
    Rahimi and Recht 2007, "Random Features for Large-Scale Kernel Machines".
    Choromanski et al. 2021, "Rethinking Attention with Performers", Section 2.3.
  """
  return FeatureMap(
    "trig",
    gaussian_projection(key, num_features, head_dim, orthogonal=orthogonal),
    stabilize=bool(stabilize),
    orthogonal=bool(orthogonal),
  )
