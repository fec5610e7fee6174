"""The dense keywords are defined once (attnjax.options.DenseKeywords) and every family agrees.

Each family's public signature lists exactly the dense keywords it claims to
forward (its ``*_KEYWORDS`` constant), with the definition's defaults, names
them in its docstring, and hands each of them, unchanged, to
:func:`attnjax.options.validate`. Nothing here compiles: the forwarding test
stops every call at ``validate``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import jax.numpy as jnp
import pytest

import attnjax
from attnjax._src import op as _op, mods, options


def families(ops=None) -> dict:
  """The dense keywords each family's public functions forward, from the sample calls of the
  registered ops (attnjax._src.op.OPS) that forward any: ``{name: (public function, dense
  keywords it forwards, dense keyword names it uses with a meaning of its own, defaults of
  its own, the arguments a call needs besides q, k, v, and its q, k, v)}``: ``q, k, v`` as
  the sample makes them of ``[1, 8, 2, 4]`` arrays (MLA's are its rope key and latent). The
  recurrent families forward no dense keyword: their options are their own."""
  out = {}
  q = jnp.ones((1, 8, 2, 4))
  for op in (_op.OPS if ops is None else ops).values():
    for sample in op.samples():
      if not sample.dense_keywords:
        continue
      qkv = sample.inputs(q, q, q)
      needs = {n: x for n, x in sample.options.items() if n not in options.KEYWORDS}
      out[sample.name] = (
        sample.function,
        sample.dense_keywords,
        sample.own_keywords,
        dict(sample.own_defaults),
        {**needs, **qkv[3]},
        qkv[:3],
      )
  return out


FAMILIES = families()


def test_every_registered_family_is_listed():
  assert {"dot_product_attention", "qk_norm_attention", "cosine_attention"} <= set(FAMILIES)
  assert all(op.samples() for op in _op.OPS.values()), "every op supplies its sample calls"


def test_the_definition():
  assert options.KEYWORDS == (
    "bias",
    "mask",
    "is_causal",
    "scale",
    "normalizer",
    "normalizer_params",
    "sink_logits",
    "softcap",
    "window",
    "segment_ids",
    "similarity",
    "return_stats",
    "score_mod",
    "score_mod_args",
    "mask_mod",
    "mask_mod_args",
    "block_layout",
    "context_axis",
    "context_strategy",
    "context_layout",
  )
  assert set(options.STATIC_NAMES) == {
    "is_causal",
    "scale",
    "normalizer",
    "softcap",
    "window",
    "similarity",
    "return_stats",
    "score_mod",
    "mask_mod",
    "block_layout",
    "context_axis",
    "context_strategy",
    "context_layout",
  }
  assert options.keywords(without=("bias",)) == options.KEYWORDS[1:]
  with pytest.raises(ValueError, match="not keywords of a dense call.*'biass'"):
    options.keywords(without=("biass",))
  q = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(TypeError, match=r"unknown keyword\(s\) \['biass'\] of a dense call"):
    options.validate(q, q, q, biass=None)


def test_the_options_are_the_static_keywords_validated():
  # DenseOptions is written out field by field; it must stay the static keywords of
  # DenseKeywords in order, with their types and defaults (a "validated" default where the
  # keyword declares one: context_layout's), then the INTERNAL_OPTIONS; a call at the
  # defaults validates to exactly those (scale apart: H ** -0.5).
  static = [f for f in dataclasses.fields(options.DenseKeywords) if f.metadata.get("static")]
  assert [f.name for f in static] == list(options.STATIC_NAMES)
  expected = [(f.name, f.type, f.metadata.get("validated", f.default)) for f in static]
  expected += [
    (name, kind.__name__, default) for name, kind, default, _ in options.INTERNAL_OPTIONS
  ]
  fields = dataclasses.fields(options.DenseOptions)
  assert [(f.name, f.type, f.default) for f in fields] == expected
  assert {f.name: f.default for f in fields}["context_layout"] == "contiguous"
  assert all(f.default_factory is dataclasses.MISSING for f in fields)
  assert options.DenseOptions.__dataclass_params__.frozen
  assert hash(options.DenseOptions()) == hash(options.DenseOptions())
  q = jnp.zeros((1, 4, 2, 16))
  _, opts = options.validate(q, q, q)
  assert opts.scale == 0.25 and dataclasses.replace(opts, scale=None) == options.DenseOptions()
  assert opts.local() == opts


@pytest.mark.parametrize("name", FAMILIES)
def test_signature_lists_the_keywords_it_forwards(name):
  fn, forwarded, own, defaults, _, _ = FAMILIES[name]
  params = inspect.signature(fn).parameters
  assert set(forwarded) <= set(options.KEYWORDS)
  assert {p for p in params if p in options.KEYWORDS} == set(forwarded) | set(own), name
  for keyword in forwarded:
    p = params[keyword]
    assert p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD), (name, keyword)
    assert p.default == defaults.get(keyword, options.DEFAULTS[keyword]), (name, keyword)
    assert re.search(rf"\b{keyword}\b", fn.__doc__), f"{name}'s docstring lacks {keyword}"


def _alibi_mod(z, b, n, i, j, slopes):
  return mods.alibi(z, b, n, i, j, slopes)


class _Stop(Exception):
  pass


# A value unlike the default for every dense keyword (B=1, T=S=8, N=2), recognisable after jit.
_PROBES = {
  "bias": jnp.zeros((1, 1, 8, 8)),
  "mask": jnp.ones((1, 1, 8, 1), bool),
  "is_causal": True,
  "scale": 0.375,
  "normalizer": "softmax_one",
  "normalizer_params": {"s": jnp.zeros((2,))},
  "sink_logits": jnp.zeros((3,)),
  "softcap": 7.5,
  "window": (3, 0),
  "segment_ids": jnp.zeros((1, 8), jnp.int32),
  "similarity": "neg_sq_euclidean",
  "return_stats": True,
  "score_mod": _alibi_mod,
  "score_mod_args": (jnp.zeros((5,)),),
  "mask_mod": mods.causal_mask,
  "mask_mod_args": (jnp.zeros((6,)),),
  "block_layout": "a layout",
  "context_axis": "a mesh axis",
  "context_strategy": "all_to_all",
  "context_layout": "zigzag",
}


def _same(got, probe):
  if isinstance(probe, dict):
    return isinstance(got, dict) and all(_same(got.get(k), v) for k, v in probe.items())
  if isinstance(probe, tuple) and probe and hasattr(probe[0], "shape"):
    return [jnp.shape(x) for x in got] == [x.shape for x in probe]
  if hasattr(probe, "shape"):
    return jnp.shape(got) == probe.shape and jnp.result_type(got) == probe.dtype
  return got == probe


@pytest.mark.parametrize("name", FAMILIES)
def test_forwards_each_keyword_unchanged(name, monkeypatch):
  fn, forwarded, _, defaults, required, (q, k, v) = FAMILIES[name]
  seen = {}

  def validate(q, k, v, **kw):
    seen.update(kw)
    raise _Stop

  monkeypatch.setattr(options, "validate", validate)
  probes = {k: _PROBES[k] for k in forwarded}
  if "is_causal" in defaults:
    probes["is_causal"] = not defaults["is_causal"]
  with pytest.raises(_Stop):
    fn(q, k, v, **required, **probes)
  missing = [k for k in forwarded if not _same(seen.get(k), probes[k])]
  assert not missing, f"{name} did not forward {missing} unchanged"


# ---------------------------------------------------------------------------
# A call that cannot be traced says why (attnjax._src.static.diagnose), in every function.


def _public_attention_functions():
  import importlib

  functions = {
    name: getattr(attnjax, name)
    for name in attnjax.__all__
    if name.endswith("_attention") and callable(getattr(attnjax, name))
  }
  for engine in ("blockwise", "pallas_gpu", "pallas_tpu", "mosaic_gpu"):
    module = importlib.import_module(f"attnjax.kernels.{engine}")
    functions[f"{engine}.attention"] = module.attention
  return functions


ATTENTION_FUNCTIONS = _public_attention_functions()


@pytest.mark.parametrize("name", sorted(ATTENTION_FUNCTIONS))
def test_a_misspelled_keyword_is_named_with_the_right_one(name):
  fn = ATTENTION_FUNCTIONS[name]
  q = jnp.ones((1, 8, 2, 4))
  signature = str(inspect.signature(fn))
  wrong, right = ("normaliser", "normalizer")
  if "normalizer" not in signature and "**" not in signature:  # the recurrent families
    wrong, right = ("implementations", "implementation")
  public = name
  with pytest.raises(TypeError) as info:
    fn(q, q, q, **{wrong: "softpick"})
  message = str(info.value)
  assert f"{public}() got an unexpected keyword argument {wrong!r}" in message, message
  assert f"(did you mean {right!r}?)" in message, message
  assert "Error interpreting argument" not in message


def test_a_wrongly_typed_argument_names_the_type_expected():
  q = jnp.ones((1, 8, 2, 4))
  with pytest.raises(
    TypeError, match=r"linear_attention\(\): feature_map expects a FeatureMap, got str 'relu'"
  ):
    attnjax.linear_attention(q, q, q, feature_map="relu")
  with pytest.raises(
    TypeError, match=r"dot_product_attention\(\): query expects an array, got str"
  ):
    attnjax.dot_product_attention("q", q, q)
  with pytest.raises(TypeError, match="normalizer must be a str naming a registered normaliser"):
    attnjax.dot_product_attention(q, q, q, normalizer=("softmax",))
  with pytest.raises(TypeError, match="scale must be a Python float or None, got str"):
    attnjax.dot_product_attention(q, q, q, scale="0.5")
  # A TypeError of the call itself is left as it is.
  with pytest.raises(TypeError, match="is_causal is a flag and must be True or False"):
    attnjax.dot_product_attention(q, q, q, is_causal=1)
