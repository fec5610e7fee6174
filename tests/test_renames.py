"""Renamed public names: one name per concept, the old one an alias that warns once.

- ``qk_norm_attention``'s gains: ``q_scale`` / ``k_scale`` are now ``q_gain`` /
  ``k_gain`` (as ``attnjax.nn`` names the parameters); ``scale`` is only the logit scale.
- ``attnjax.nn``'s QK-norm logit scale: ``qk_scale`` is now ``scale``, as the dense family's.
- ``attnjax.config.kernels`` is now ``attnjax.config.auto_kernels`` (``ATTNJAX_KERNELS``:
  ``ATTNJAX_AUTO_KERNELS``), and its value ``"trusted"`` is ``"jax"`` (tests/test_trust.py).
- The public modules' old names (``attnjax/_src/old_names.py``) and the data split ``"probe"``
  (now ``"heldout"``; *probe* is the training loop's periodic statistics only).

Each old name gives identical results and warns once per process with the new name; an old
name that now means another concept (the ``parallel`` aliases of the recurrent families, the
*probe* aliases: tests/test_layer_stats.py) raises an error naming the new spelling.
"""

from __future__ import annotations

import json
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import attnjax
from attnjax._src import deprecation as _deprecation
from attnjax import nn
from attnjax._src.nn import specs


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
  """The once-per-process record of deprecated names, empty for each test."""
  monkeypatch.setattr(_deprecation, "_warned", set())


def _deprecations(record) -> list[str]:
  return [str(w.message) for w in record if issubclass(w.category, DeprecationWarning)]


def test_qk_norm_attention_old_gain_names_warn_once_and_match():
  q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 5, 2, 8))
  gq, gk = jnp.linspace(0.5, 2.0, 8), jnp.linspace(2.0, 0.5, 8)
  want = attnjax.qk_norm_attention(q, k, v, q_gain=gq, k_gain=gk, is_causal=True)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    got = [
      attnjax.qk_norm_attention(q, k, v, q_scale=gq, k_scale=gk, is_causal=True) for _ in range(2)
    ]
  assert _deprecations(record) == [
    "qk_norm_attention(q_scale=...) is deprecated; use qk_norm_attention(q_gain=...) "
    "(the same meaning)",
    "qk_norm_attention(k_scale=...) is deprecated; use qk_norm_attention(k_gain=...) "
    "(the same meaning)",
  ]
  assert all(r.filename == __file__ for r in record)  # points at the caller
  for out in got:
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
  # The gains do something (a test of the alias that cannot pass with the gains dropped).
  assert not np.allclose(
    np.asarray(want), np.asarray(attnjax.qk_norm_attention(q, k, v, is_causal=True))
  )


def test_qk_norm_attention_old_and_new_name_together_is_an_error():
  q = jnp.ones((1, 2, 1, 4))
  with pytest.raises(TypeError, match=r"q_scale= and q_gain= are the same option"):
    attnjax.qk_norm_attention(q, q, q, q_scale=jnp.ones(4), q_gain=jnp.ones(4))
  lowered = attnjax.qk_norm_attention.lower(q, q, q, q_gain=jnp.ones(4))  # forwarded
  assert lowered.compile() is not None


def test_the_logit_scale_of_the_qk_norm_layer_is_scale():
  new = nn.AttentionConfig(family="qk_norm", qk_norm="l2", scale=4.0)
  with pytest.warns(
    DeprecationWarning,
    match=r"AttentionConfig\(qk_scale=...\) is deprecated; "
    r"use AttentionConfig\(scale=...\)",
  ) as record:
    old = nn.AttentionConfig(family="qk_norm", qk_norm="l2", qk_scale=4.0)
    again = nn.AttentionConfig(family="qk_norm", qk_norm="l2").replace(qk_scale=4.0)
  assert len(_deprecations(record)) == 1
  assert old == new == again and new.spec.scale == 4.0
  with pytest.warns(DeprecationWarning, match=r"QKNormSpec\(qk_scale=...\) is deprecated"):
    assert specs.QKNormSpec(qk_scale=2.0) == specs.QKNormSpec(scale=2.0)
  with pytest.warns(DeprecationWarning, match=r"QKNormSpec.replace\(qk_scale=...\)"):
    assert new.spec.replace(qk_scale=2.0).scale == 2.0
  with pytest.warns(DeprecationWarning, match=r"QKNormSpec.qk_scale is deprecated"):
    assert new.qk_scale == 4.0 and new.spec.qk_scale == 4.0
  with pytest.raises(TypeError, match=r"qk_scale= and scale= are the same option"):
    nn.AttentionConfig(family="qk_norm", qk_scale=2.0, scale=2.0)
  # Another family still reads the old flat record's default, and refuses another value.
  assert nn.AttentionConfig().qk_scale is None
  with pytest.raises(
    ValueError,
    match=r"qk_scale=2.0 cannot be used with family='dense': it is "
    r"an option of family 'qk_norm'",
  ):
    nn.AttentionConfig(qk_scale=2.0)


def test_a_stored_config_with_the_old_field_name_loads_silently():
  new = nn.AttentionConfig(family="qk_norm", qk_norm="l2", scale=4.0, num_heads=2)
  stored = new.to_dict()
  assert "scale" in stored and "qk_scale" not in stored
  stored["qk_scale"] = stored.pop("scale")  # as a run directory written before the rename
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    assert nn.AttentionConfig.from_dict(json.loads(json.dumps(stored))) == new
    model = nn.ModelConfig(attention=new)
    old_model = model.to_dict()
    old_model["attention"] = stored
    assert nn.ModelConfig.from_dict(old_model) == model


def test_the_qk_norm_layer_passes_its_gains_by_their_new_names():
  layer = nn.Attention(
    nn.AttentionConfig(family="qk_norm", qk_norm_placement="after_rope", num_heads=2, scale=0.7),
    d_model=8,
    rngs=nnx.Rngs(0),
  )
  kwargs = layer.config.spec.kwargs(layer)
  assert {"q_gain", "k_gain"} <= set(kwargs) and kwargs["scale"] == 0.7
  assert not {"q_scale", "k_scale"} & set(kwargs)


def test_a_checkpoints_logit_scale_survives_a_change_of_family():
  # One name: changing the family of a pretrained layer keeps its scale either way (the
  # qk_norm -> dense direction raised while the qk_norm family called it qk_scale).
  from attnjax._src.models import loader

  qk = nn.AttentionConfig(family="qk_norm", scale=0.3, num_heads=2)
  dense = nn.AttentionConfig(scale=0.3, num_heads=2)
  assert loader.override_attention(qk, {"family": "dense"}) == dense
  assert loader.override_attention(dense, {"family": "qk_norm"}) == qk


# ---------------------------------------------------------------------------
# Old names of the public modules (attnjax/_src/old_names.py): a renamed one warns once and
# gives the same object; one whose spelling now means another concept raises, naming the new.


@pytest.mark.parametrize(
  "module, old, new, same",
  [
    ("attnjax.stats", "ProbeCapture", "attnjax.stats.LayerCapture", "attnjax.stats:LayerCapture"),
    ("attnjax.nn.probe", "layer_stats", "attnjax.nn.layer_stats", "attnjax.nn:layer_stats"),
    ("attnjax.nn.probe", "VIEWS", "attnjax.nn.statistics.VIEWS", "attnjax.nn.statistics:VIEWS"),
    ("attnjax.models.probe", "token_nll", "attnjax.models.token_nll", "attnjax.models:token_nll"),
    (
      "attnjax.train.mesh",
      "MeshParallel",
      "attnjax.train.mesh.RunMesh",
      "attnjax.train.mesh:RunMesh",
    ),
  ]
  + [
    (
      f"attnjax.{family}",
      "REFERENCE_FORM",
      f"attnjax.{family}.REFERENCE_ENGINE",
      f"attnjax.{family}:REFERENCE_ENGINE",
    )
    for family in ("linear", "gated_linear", "delta_rule")
  ],
)
def test_a_renamed_public_name_warns_once_and_is_the_same_object(module, old, new, same):
  import importlib

  public = importlib.import_module(module)
  where, _, name = same.partition(":")
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    got = [getattr(public, old), getattr(public, old)]
    exec(f"from {module} import {old}", {})
  assert _deprecations(record) == [f"{module}.{old} is deprecated; use {new} (the same meaning)"]
  assert record[0].filename == __file__  # points at the reader
  assert got[0] is got[1] is getattr(importlib.import_module(where), name)
  assert old not in public.__all__ and old not in dir(public)


def test_the_old_module_attnjax_models_probe_is_reached_from_attnjax_models(monkeypatch):
  import sys

  import attnjax.models

  monkeypatch.delitem(sys.modules, "attnjax.models.probe", raising=False)
  monkeypatch.delattr(attnjax.models, "probe", raising=False)
  with pytest.warns(DeprecationWarning, match=r"attnjax.models.probe is deprecated; use "):
    old = attnjax.models.probe
  assert old.token_nll is attnjax.models.token_nll


@pytest.mark.parametrize("family", ["linear", "gated_linear", "delta_rule"])
def test_the_parallel_aliases_are_gone_with_an_error_naming_quadratic(family):
  # 'parallel' names context parallelism (attnjax.parallel) only; the masked quadratic engine
  # is `quadratic` (implementation="parallel" still warns: tests/test_op.py).
  import importlib

  from attnjax._src.deprecation import RemovedError

  public = importlib.import_module(f"attnjax.{family}")
  new = f"use attnjax.{family}.quadratic (the same computation)"
  with pytest.raises(RemovedError, match=re.escape(new)):
    public.parallel
  with pytest.raises(ImportError, match=re.escape(new)):
    exec(f"from attnjax.{family} import parallel", {})
  assert callable(public.quadratic) and not hasattr(public, "missing_name")


def test_the_old_split_name_probe_warns_once_and_gives_the_heldout_batches():
  from attnjax import data
  from attnjax.train import base_config

  cfg = base_config().data
  cfg.name, cfg.seq_len, cfg.batch_size = "bigram_backcopy", 16, 2
  batches = data.from_config(cfg, seed=0)
  new = batches.batch("heldout", 3)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    old = [batches.batch("probe", 3), batches.batch("probe", 3)]
  assert _deprecations(record) == [
    "batch('probe', ...) is deprecated; use batch('heldout', ...) (the same meaning)"
  ]
  assert record[0].filename == __file__
  for b in old:
    np.testing.assert_array_equal(b.inputs, new.inputs)
  assert not np.array_equal(new.inputs, batches.batch("val", 3).inputs)
