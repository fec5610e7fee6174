"""One API vocabulary: ``"reference"`` in every family, Literal types equal to the runtime names."""

from __future__ import annotations

import typing
import warnings

import jax.numpy as jnp
import pytest

import attnjax
from attnjax import _checks, dense, feature_maps, linear, qk_norm, sparse
from helpers import assert_close, rand_qkv


def test_check_implementation_passes_current_names_and_maps_old_ones():
  allowed = ("reference", "fast")
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # current names and None never warn
    assert _checks.check_implementation("implementation", None, allowed) is None
    assert _checks.check_implementation("implementation", "fast", allowed) == "fast"
  with pytest.warns(DeprecationWarning, match="implementation='old' is deprecated; use "
                                              "implementation='reference'"):
    assert _checks.check_implementation("implementation", "old", allowed,
                                        deprecated={"old": "reference"}) == "reference"
  with pytest.raises(ValueError, match="implementation='slow' is not one of: None, 'reference', "
                                       "'fast'"):
    _checks.check_implementation("implementation", "slow", allowed)
  with pytest.raises(TypeError, match="implementation must be a str or None, got int 3"):
    _checks.check_implementation("implementation", 3, allowed)


@pytest.mark.parametrize("literal,names", [
    (dense.ImplementationName, tuple(dense.IMPLEMENTATIONS)),
    (dense.Similarity, dense.SIMILARITIES),
    (sparse.ImplementationName, sparse.IMPLEMENTATIONS),
    (linear.ImplementationName, linear.IMPLEMENTATIONS),
    (linear.Normalize, linear.NORMALIZE),
    (qk_norm.Norm, qk_norm.NORMS),
    (qk_norm.CosineConvention, qk_norm.COSINE_CONVENTIONS),
    (feature_maps.DeterministicKind, feature_maps.DETERMINISTIC),
], ids=["dense", "similarity", "sparse", "linear", "normalize", "norm", "convention", "kind"])
def test_literal_types_name_what_the_functions_accept(literal, names):
  assert typing.get_args(literal) == names


def test_every_family_calls_its_readable_form_reference():
  q, k, v = rand_qkv(B=1, T=8, N=2, K=1, H=4, source="numpy")
  kw = dict(implementation="reference")
  ref = attnjax.dot_product_attention(q, k, v, is_causal=True, **kw)
  assert_close(attnjax.sparse_attention(q, k, v, pattern=attnjax.patterns.causal(),
                                        block_size=4, **kw), ref, "sparse causal", atol=1e-6)
  assert_close(attnjax.qk_norm_attention(q, k, v, norm="l2", scale=1.0, is_causal=True, **kw),
               attnjax.cosine_attention(q, k, v, temperature=jnp.ones(2), convention="scale",
                                        is_causal=True, **kw), "l2 qk-norm vs cosine", atol=1e-5)
  out = attnjax.linear_attention(q, k, v, is_causal=True, **kw)
  assert_close(out, attnjax.linear_attention(q, k, v, is_causal=True), "linear", atol=1e-5)
