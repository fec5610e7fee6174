"""A new family is one folder and one registry entry: the stand-in (tests/stand_in_family/) is
dispatched, validated, tested by the engine base and documented once its op is registered, and
every suite that covers all families calls it from the sample calls its op supplies, with no
entry of its own in any of them.

The ``stand_in`` fixture registers the op for one test and removes it after, so no other test
sees it.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest

import stand_in_family
import test_context_parallel
import test_edge_inputs
import test_forward_mode
import test_op_engines
import test_option_space
import test_options
from attnjax._src import op as _op
from helpers import assert_close, rand_qkv
from op_base import OpTests
from test_op import guide_table


@pytest.fixture
def stand_in():
  """The stand-in's registry entry, for one test."""
  op = _op.register(stand_in_family.OP)
  yield op
  del _op.OPS[op.name]


def _qkv(T=8):
  return rand_qkv(B=1, T=T, N=2, K=2, H=4)


def test_it_is_dispatched(stand_in):
  q, k, v = _qkv()
  assert _op.choose(stand_in, (q, k, v), ("cpu", "cuda", "tpu")) == dict.fromkeys(
    ("cpu", "cuda", "tpu"), "cumulative"
  )
  traced = str(jax.make_jaxpr(lambda *a: stand_in_family.attention(*a))(q, k, v))
  assert "cumsum" in traced and "branches_platforms" not in traced  # one engine everywhere
  want = stand_in_family.attention(q, k, v, implementation="reference")
  for implementation in (None, "cumulative"):
    assert_close(
      stand_in_family.attention(q, k, v, implementation=implementation),
      want,
      str(implementation),
      rtol=1e-5,
      atol=1e-5,
      scaled=True,
    )


def test_it_is_validated(stand_in):
  q, k, v = _qkv()
  with pytest.raises(
    ValueError,
    match=r"^implementation='chunked' is not one of: None, "
    r"'reference', 'cumulative'$",
  ):
    stand_in_family.attention(q, k, v, implementation="chunked")
  with pytest.raises(TypeError, match="implementation must be a str or None"):
    stand_in_family.attention(q, k, v, implementation=1)
  with pytest.raises(ValueError, match=r"k and v must agree .* k \(1, 7, 2, 4\)"):
    stand_in_family.attention(q, k[:, :7], v)


class TestStandIn(OpTests):
  """The engine base on the stand-in: its engines are read from its op."""

  op = stand_in_family.NAME
  length = 8 * 4

  def op_record(self):  # collected before the fixture registers it
    return stand_in_family.OP

  @pytest.fixture(autouse=True)
  def registered(self, stand_in):
    del stand_in

  def sample(self):
    return (lambda impl, q, k, v: stand_in_family.attention(q, k, v, implementation=impl), _qkv())


def test_the_base_tests_every_engine_and_catches_a_wrong_one(stand_in, monkeypatch):
  assert TestStandIn().engine_names() == ("cumulative", None)

  # The engine that forgets the last key: the base fails it on the value and the gradients.
  def forgets_the_last_key(q, k, v):
    return stand_in_family.cumulative(q, k.at[:, -1].set(0.0), v)

  monkeypatch.setitem(
    stand_in.engines,
    "cumulative",
    dataclasses.replace(stand_in.engines["cumulative"], compute=forgets_the_last_key),
  )
  with pytest.raises(AssertionError, match=r"stand_in\[cumulative\]"):
    TestStandIn().test_engine_matches_reference("cumulative")


def test_it_is_documented(stand_in):
  # The generated ops table gets its row; the guide's (tests/test_op.py holds them equal) then
  # lacks only that row until it is regenerated.
  row = (
    "| `stand_in` | `reference`, `cumulative` | `cumulative`, `reference` | "
    "`cumulative`, `reference` | `cumulative`, `reference` |"
  )
  table = _op.table().splitlines()
  assert row in table
  assert [line for line in table if line != row] == guide_table().splitlines()


def test_the_edge_inputs_call_it(stand_in):
  cases = [c for c in test_edge_inputs.family_cases() if c.name.startswith("stand_in_attention")]
  assert {c.name for c in cases} == {
    f"stand_in_attention-{i}" for i in ("reference", "cumulative", None)
  }
  for case in cases:
    test_edge_inputs.test_zero_queries(case)
    test_edge_inputs.test_head_dim_zero(case)


def test_the_option_walk_draws_it(stand_in):
  assert ("stand_in", "stand_in_attention", 0) in test_option_space.samples()
  for seed in range(test_option_space.DRAWS):
    test_option_space.walk("stand_in", 0, seed)


def test_the_forward_mode_walk_covers_it(stand_in):
  (case,) = [
    c
    for c in test_forward_mode.family_cases(test_forward_mode._arrays())
    if c.name.startswith("stand_in_attention")
  ]
  assert case.name == "stand_in_attention[cumulative]"
  got = jax.jvp(case.fast, case.args, test_forward_mode._tangents(case.args))
  want = jax.jvp(case.reference, case.args, test_forward_mode._tangents(case.args))
  assert_close(got, want, case.name, **test_forward_mode.TOL)


def test_the_engine_tables_test_it(stand_in):
  tests = test_op_engines.op_tests(stand_in_family.NAME)()
  assert tests.engine_names() == ("cumulative", None)
  for engine in tests.engine_names():
    tests.test_engine_matches_reference(engine)


def test_the_keyword_and_context_suites_skip_what_it_does_not_take(stand_in):
  # It forwards no dense keyword and has no context-parallel strategy.
  assert "stand_in_attention" not in test_options.families()
  assert all(c["op"] != "stand_in" for c in test_context_parallel.sample_cases())


def test_the_entry_is_gone_after_the_test():
  assert stand_in_family.NAME not in _op.OPS
  with pytest.raises(KeyError):
    stand_in_family.attention(*_qkv())
