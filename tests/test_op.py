"""The op abstraction (attnjax/_src/op.py): one choose and one run for every family, read from the
registry; engines named, refused, lowered off-platform and renamed the same way everywhere."""

from __future__ import annotations

import dataclasses
import importlib
import pathlib
import re
import typing
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
from attnjax._src import deprecation as _deprecation, op as _op, patterns
from attnjax._src.ops.linear import attention as linear

from helpers import rand_qkv

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_warnings(monkeypatch):
  """Forget the deprecated names warned about so far in this process."""
  monkeypatch.setattr(_deprecation, "_warned", set())


def _stand_in(asked: list, **op_fields) -> _op.Op:
  """An op over the call ``(x,)``: "wide" refuses odd lengths, "tpu_only" lowers for TPUs,
  "long" waits for length 8, "plain" takes everything."""

  def refuses_odd(x):
    asked.append("wide")
    return ["odd lengths"] if x.shape[0] % 2 else []

  engines = {
    e.name: e
    for e in (
      _op.Engine("plain", lambda x: x + 1.0, _op.supports_everything),
      _op.Engine("wide", lambda x: x + 2.0, refuses_odd),
      _op.Engine("long", lambda x: x + 3.0, _op.supports_everything, min_length=8),
      _op.Engine(
        "tpu_only",
        lambda x: x + 4.0,
        _op.supports_everything,
        platform="tpu",
        where="runs on a TPU only (a stand-in)",
      ),
    )
  }
  return _op.Op(
    "stand_in",
    engines,
    {"tpu": ("tpu_only", "wide"), "cuda": ("wide",)},
    ("long", "plain"),
    length=lambda x: x.shape[0],
    **op_fields,
  )


def test_choose_takes_each_platforms_first_engine_that_covers_the_call():
  asked = []
  op = _stand_in(asked)
  assert _op.choose(op, (jnp.zeros(4),), ("cpu", "cuda", "tpu")) == {
    "cpu": "plain",
    "cuda": "wide",
    "tpu": "tpu_only",
  }
  assert _op.choose(op, (jnp.zeros(5),), ("cpu", "cuda")) == {"cpu": "plain", "cuda": "plain"}
  assert _op.choose(op, (jnp.zeros(8),), ("cpu",)) == {"cpu": "long"}
  assert asked == ["wide", "wide"]  # once per call, however many lists name it
  assert _op.select(op, (jnp.zeros(4),), "cuda") == "wide"
  narrow = dataclasses.replace(op, preferences={}, fallback=("wide",))
  with pytest.raises(
    ValueError,
    match=r"stand_in: no engine covers this call on 'cpu' "
    r"\(wide: odd lengths\)",
  ):
    _op.choose(narrow, (jnp.zeros(3),), ("cpu",))


def test_run_lowers_the_choices_as_platform_branches():
  op = _stand_in([])
  x = jnp.zeros(4)
  np.testing.assert_array_equal(jax.jit(lambda x: _op.run(op, (x,), None))(x), x + 1.0)
  branched = str(jax.make_jaxpr(lambda x: _op.run(op, (x,), None))(x))
  assert "branches_platforms" in branched and "4.0" in branched  # the TPU branch is there
  same = dataclasses.replace(op, preferences={})  # every platform takes "plain": one branch
  assert "branches_platforms" not in str(jax.make_jaxpr(lambda x: _op.run(same, (x,), None))(x))


def test_a_named_engine_off_its_platform_raises_its_where():
  op = _stand_in([])
  x = jnp.zeros(4)
  with pytest.raises(
    ValueError,
    match=r"implementation='tpu_only' runs on a TPU only "
    r"\(a stand-in\); use implementation=None",
  ):
    jax.jit(lambda x: _op.run(op, (x,), "tpu_only"))(x)


def test_a_named_engine_names_its_unsupported_reasons():
  op = _stand_in([])
  with pytest.raises(
    ValueError,
    match="implementation='wide' does not support odd lengths. "
    "Use implementation='reference' or None",
  ):
    _op.run(op, (jnp.zeros(3),), "wide")
  np.testing.assert_array_equal(_op.run(op, (jnp.zeros(4),), "wide"), 2.0)


def test_the_empty_answer_and_the_context_strategy_come_before_any_engine():
  seen = []
  op = _stand_in(
    [],
    empty=lambda x: "empty",
    is_empty=lambda x: x.shape[0] == 0,
    context=lambda call, impl, local: seen.append(impl) or "context",
    context_axis=lambda x: "seq" if x.shape[0] == 6 else None,
  )
  assert _op.run(op, (jnp.zeros(0),), "wide") == "empty"
  assert _op.run(op, (jnp.zeros(6),), "plain") == "context" and seen == ["plain"]


# The families known today (NSA and DSA will follow) and every family folder under
# attnjax/_src/ops/: each is one registered op.
TEN = (
  "dense",
  "qk_norm",
  "cosine",
  "mla",
  "sparse",
  "compressed",
  "block_select",
  "linear",
  "gated_linear",
  "delta_rule",
)
FAMILIES = tuple(
  sorted(p.parent.name for p in (ROOT / "attnjax" / "_src" / "ops").glob("*/attention.py"))
)


def op_module(name: str):
  """The module that declares the op ``name`` (attnjax/_src/ops/<name>/attention.py)."""
  return importlib.import_module(f"attnjax._src.ops.{name}.attention")


def test_every_registered_family_is_declared_at_module_level():
  # One op per family folder, and no op registered elsewhere (the stand-in family's is
  # registered only for its own tests).
  assert set(_op.OPS) == set(FAMILIES), sorted(_op.OPS)
  assert set(TEN) <= set(FAMILIES)
  for name, op in _op.OPS.items():
    module = op_module(name)
    assert module.OP is op, name
    # The one source of the names: the module's tables, the op's and every derived list.
    assert op.engines is module.ENGINES and tuple(op.fallback) == module.FALLBACK, name
    assert dict(op.preferences) == module.PREFERENCES, name
    assert module.IMPLEMENTATIONS == tuple(module.ENGINES) == op.implementations, name
    assert typing.get_args(module.ImplementationName) == module.IMPLEMENTATIONS, name
    assert op.empty is not None, f"{name} has no empty rule"
    assert "reference" in op.engines and op.fallback[-1] in op.engines, name
    assert op.samples(), f"{name} supplies no sample call"


def test_check_implementation_one_message_for_every_family():
  for name, op in _op.OPS.items():
    valid = ", ".join(repr(n) for n in (None, *op.implementations))
    with pytest.raises(ValueError, match=f"^implementation='nope' is not one of: {valid}$"):
      _op.check_implementation(op, "nope")
    with pytest.raises(TypeError, match="implementation must be a str or None"):
      _op.check_implementation(op, 1)
  assert _op.OPS["sparse"].implementations == ("reference", "blockwise")
  assert _op.OPS["linear"].implementations == ("reference", "recurrent", "quadratic", "chunked")


@pytest.mark.parametrize("name", FAMILIES)
def test_every_engine_runs_through_the_one_runner(name, monkeypatch):
  """Each family's public function hands its call to the op: the engine that computes it
  (auto-dispatch's, or the one named) is computed by ``op.compute`` and nowhere else."""
  op = _op.OPS[name]
  computed = []
  compute = _op.compute
  monkeypatch.setattr(
    _op,
    "compute",
    lambda engine, call, **kw: computed.append(engine.name) or compute(engine, call, **kw),
  )
  sample = op.samples()[0]
  q, k, v = rand_qkv(B=1, T=8, N=2, K=1, H=4)
  for implementation in (None, "reference"):
    computed.clear()
    jax.make_jaxpr(lambda q, k, v: sample.call(q, k, v, implementation=implementation))(q, k, v)
    assert computed, (name, implementation)
    if implementation is not None:
      assert computed == ["reference"], (name, computed)


def test_the_layer_families_map_onto_the_ops_by_data():
  """nn's family names are the layer's; each names the op it runs, whose engines and old names
  are the family's implementations (no list kept twice)."""
  from attnjax._src.nn import specs

  assert {cls.op for cls in specs.FAMILY_SPECS.values()} == set(_op.OPS)
  for family, cls in specs.FAMILY_SPECS.items():
    op = _op.OPS[cls.op]
    assert cls.implementations == op.implementations, family
    assert cls.deprecated_implementations == dict(op.renamed), family
  assert specs.FAMILY_SPECS["gla"].op == "gated_linear"
  assert specs.FAMILY_SPECS["gated_deltanet"].op == "delta_rule"


def test_a_second_op_of_one_name_is_refused():
  with pytest.raises(ValueError, match="an op named 'dense' is already registered"):
    _op.register(_op.Op("dense", {}, {}, ()))


def _warned_once(fn, match):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first, second = fn(), fn()
  messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
  assert len(messages) == 1 and match in messages[0], messages
  return first, second


def test_old_engine_names_still_work_and_warn_once(fresh_warnings):
  q, k, v = rand_qkv(B=1, T=8, N=2, K=1, H=4)
  pattern = patterns.sliding_window(2)
  new = attnjax.sparse_attention(q, k, v, pattern=pattern, block_size=4, implementation="blockwise")
  old, _ = _warned_once(
    lambda: attnjax.sparse_attention(
      q, k, v, pattern=pattern, block_size=4, implementation="block_sparse"
    ),
    "sparse_attention(implementation='block_sparse') is deprecated; use "
    "sparse_attention(implementation='blockwise')",
  )
  np.testing.assert_array_equal(old, new)
  for fn, name in (
    (attnjax.linear_attention, "linear_attention"),
    (
      lambda q, k, v, **kw: attnjax.gated_linear_attention(
        q, k, v, log_decay=-0.1 * jnp.ones(q.shape[:3]), **kw
      ),
      "gated_linear_attention",
    ),
    (
      lambda q, k, v, **kw: attnjax.delta_rule_attention(
        q, k, v, 0.5 * jnp.ones(q.shape[:3]), **kw
      ),
      "delta_rule_attention",
    ),
  ):
    new = fn(q, k, v, implementation="quadratic")
    old, _ = _warned_once(
      lambda: fn(q, k, v, implementation="parallel"),
      f"{name}(implementation='parallel') is deprecated",
    )
    np.testing.assert_array_equal(old, new)


def test_the_renamed_form_functions_warn_once(fresh_warnings):
  q, k, v = rand_qkv(B=1, T=4, N=2, K=1, H=4)
  phi = jnp.abs(q[:, :, :, None, :]), jnp.abs(k)
  state = linear.zeros_state(1, 1, 4, 4)
  old, _ = _warned_once(
    lambda: linear.parallel(*phi, v, state, is_causal=True),
    "attnjax.linear.parallel is deprecated; use attnjax.linear.quadratic",
  )
  new = linear.quadratic(*phi, v, state, is_causal=True)
  for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new)):
    np.testing.assert_array_equal(a, b)


TABLE = re.compile(
  r"<!-- ops table: attnjax._src.op.table\(\) -->\n(.*?)<!-- end of ops table -->", re.S
)


def guide_table() -> str:
  """The ops table of docs/guides/architecture.md."""
  found = TABLE.search((ROOT / "docs" / "guides" / "architecture.md").read_text())
  assert found, "docs/guides/architecture.md has no ops table"
  return found.group(1)


def test_the_architecture_guide_lists_every_op_and_engine():
  assert guide_table() == _op.table(), (
    "regenerate docs/guides/architecture.md's ops table with attnjax._src.op.table()"
  )
