"""No-recompile claims, each checked with ``chex.assert_max_traces``.

Every test wraps the Python function behind one of the library's jitted entry
points in ``chex.assert_max_traces`` and jits it the way the library does (the
same static arguments, ``nnx.jit``, the Trainer's ``jax.jit`` with donation),
or swaps the wrapped function into the module global the library calls, and
then calls it again with new values of the same shapes: a call that traces
again (a new compilation) fails with chex's "is traced > n times".
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from attnjax._src.ops.dense import attention as dense
from attnjax._src import feature_maps, mods
from attnjax import nn
from attnjax._src.ops.linear import attention as linear
from attnjax._src.stats import approximation
from attnjax._src.train import config as config_lib
from attnjax._src.train import loop, step as step_lib
from helpers import rand_qkv


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def fresh_trace_counts():
  """chex counts traces per wrapping site across the process: start each test at zero."""
  chex.clear_trace_counter()
  yield
  chex.clear_trace_counter()


def _differ(a, b) -> bool:
  return not np.allclose(np.asarray(a, np.float32), np.asarray(b, np.float32))


# ---------------------------------------------------------------------------
# Random feature maps: the projection is a traced leaf of the map.


def test_linear_attention_with_a_new_favor_plus_key_does_not_retrace():
  # feature_maps: "redrawing features (a new key) ... never recompiles"; README: "a new key
  # does not recompile".
  attend = jax.jit(
    chex.assert_max_traces(linear._linear_attention, n=1), static_argnames=linear.LINEAR_STATIC
  )
  q, k, v = rand_qkv(1, 16, 16, 2, 2, 8, dtype=jnp.bfloat16)
  outs = [
    attend(
      q,
      k,
      v,
      feature_map=feature_maps.favor_plus(jax.random.key(seed), 16, head_dim=8),
      is_causal=True,
    )
    for seed in (0, 1)
  ]
  assert outs[0].dtype == jnp.bfloat16
  assert _differ(*outs), "the second key's features did not reach the output"


def test_feature_map_error_with_a_new_favor_plus_key_does_not_retrace(monkeypatch):
  # stats.approximation: "redrawing features does not recompile" (the map goes to the traced entry).
  for name, static in (
    ("_feature_map_error_traced", ("is_causal", "scale")),
    ("_feature_map_error_static", ("feature_map", "is_causal", "scale")),
  ):
    monkeypatch.setattr(
      approximation,
      name,
      jax.jit(
        chex.assert_max_traces(approximation._feature_map_error, n=1), static_argnames=static
      ),
    )
  q, k, _ = rand_qkv(1, 8, 8, 2, 2, 8)
  errs = [
    approximation.feature_map_attention_error(
      q, k, feature_map=feature_maps.favor_plus(jax.random.key(seed), 8, head_dim=8)
    )
    for seed in (0, 1)
  ]
  assert _differ(*errs)


# ---------------------------------------------------------------------------
# Score and mask modifiers: static functions (equal factory instances hash alike), traced args.


@pytest.mark.parametrize("implementation", ["reference", "blockwise"])
def test_new_score_and_mask_mod_args_do_not_retrace(implementation):
  # dense: score_mod is static, score_mod_args traced; mods: "two equal configurations share
  # one compiled program". Each call builds its own (equal) T5 modifier.
  attend = jax.jit(
    chex.assert_max_traces(dense._dot_product_attention, n=1), static_argnames=dense.DENSE_STATIC
  )
  B, T, N = 2, 16, 2
  q, k, v = rand_qkv(B, T, T, N, N, 4)
  rng = np.random.default_rng(0)
  outs = []
  for cut in (5, 11):
    table = jnp.asarray(rng.standard_normal((8, N)), jnp.float32)
    ids = jnp.asarray(np.broadcast_to(np.arange(T) >= cut, (B, T)), jnp.int32)
    outs.append(
      attend(
        q,
        k,
        v,
        is_causal=True,
        implementation=implementation,
        score_mod=mods.t5_relative_bias(8, 16),
        score_mod_args=(table,),
        mask_mod=mods.document_mask,
        mask_mod_args=(ids,),
      )
    )
  assert _differ(*outs)


def test_new_alibi_slopes_do_not_retrace():
  attend = jax.jit(
    chex.assert_max_traces(dense._dot_product_attention, n=1), static_argnames=dense.DENSE_STATIC
  )
  q, k, v = rand_qkv(1, 8, 8, 4, 2, 4)
  slopes = jnp.asarray(mods.alibi_slopes(4))
  outs = [
    attend(q, k, v, is_causal=True, score_mod=mods.alibi, score_mod_args=(s,))
    for s in (slopes, 4.0 * slopes)
  ]
  assert _differ(*outs)


# ---------------------------------------------------------------------------
# Decoding: the caches keep their types and shapes from step to step.

DECODE_LAYERS = (
  nn.AttentionConfig(num_heads=4, num_kv_heads=2),  # KVCache
  nn.AttentionConfig(window=2, num_sinks=1, num_kv_heads=2),  # rolling KVCache
  nn.AttentionConfig(family="linear", num_kv_heads=2),  # LinearCache
  nn.AttentionConfig(family="gla", short_conv=3),  # GatedCache + conv
)


def test_decode_steps_after_the_first_do_not_retrace():
  # nn.decode_step (nnx.jit) one token at a time from nn.init_cache: the first step traces,
  # the second and third reuse its trace (every cache a step returns matches the empty one).
  model = nn.TransformerLM(
    nn.ModelConfig(vocab_size=11, d_model=16, num_layers=4, layer_attention=DECODE_LAYERS),
    rngs=nnx.Rngs(0),
  )
  decode = nnx.jit(chex.assert_max_traces(inspect.unwrap(nn.decode_step), n=1))
  tokens = jax.random.randint(jax.random.key(1), (2, 3), 0, 11)
  cache = nn.init_cache(model, 2, 4)
  steps = []
  for t in range(3):
    logits, cache = decode(model, tokens[:, t : t + 1], cache)
    steps.append(logits)
  assert all(int(c.index) == 3 for c in cache)
  assert _differ(steps[1], steps[2])


def test_packed_decode_steps_with_new_positions_do_not_retrace():
  # A packed decode passes the new tokens' segment_ids and positions on every call.
  model = nn.TransformerLM(
    nn.ModelConfig(vocab_size=11, d_model=16, num_layers=1, layer_attention=DECODE_LAYERS[:1]),
    rngs=nnx.Rngs(0),
  )
  decode = nnx.jit(chex.assert_max_traces(inspect.unwrap(nn.decode_step), n=1))
  cache = nn.init_cache(model, 2, 4)
  for t in range(3):
    tokens = jnp.full((2, 1), t + 1, jnp.int32)
    segment_ids = jnp.asarray([[0], [0 if t < 2 else 1]], jnp.int32)
    positions = jnp.asarray([[t], [t if t < 2 else 0]], jnp.int32)
    _, cache = decode(model, tokens, cache, segment_ids=segment_ids, positions=positions)
  assert int(cache[0].index) == 3


# ---------------------------------------------------------------------------
# Training: the state a step returns is the state the next step takes.


def test_second_and_third_train_steps_do_not_retrace(tmp_path, monkeypatch):
  # The Trainer's own jax.jit (donated state) around the step make_train_step builds, on a
  # two-device data-parallel mesh, with initial_loss set between steps as the loop sets it.
  monkeypatch.setattr(
    loop,
    "make_train_step",
    lambda *a, **kw: chex.assert_max_traces(step_lib.make_train_step(*a, **kw), n=1),
  )
  c = config_lib.base_config()
  c.run_dir = str(tmp_path)
  c.data.update(dict(name="bigram_backcopy", seq_len=8, batch_size=4, bb_vocab_size=16))
  c.model.update(dict(d_model=16, num_layers=1, num_heads=2, mlp_ratio=1))
  c.train.update(dict(num_devices=2, microbatches=1, progress=False, plots=False))
  trainer = loop.Trainer(c)
  losses = []
  with jax.set_mesh(trainer.dp.mesh):
    for i in range(3):
      b = trainer.batches.batch("train", i)
      trainer.state, metrics = trainer.train_step(
        trainer.state, trainer.rest, *trainer.dp.batch_args(b)
      )
      losses.append(float(metrics["loss"]))
      if i == 0:
        trainer.state["initial_loss"] = trainer.dp.replicate(jnp.float32(losses[0]))
  assert int(trainer.state["step"]) == 3 and np.all(np.isfinite(losses))


# ---------------------------------------------------------------------------
# The first call of a process.

FIRST_CALL = """
import chex, jax, jax.numpy as jnp
from jax._src import config as jax_config
from attnjax._src.ops.dense import attention as dense
from attnjax._src import mods
attend = jax.jit(chex.assert_max_traces(dense._dot_product_attention, n=1),
                 static_argnames=dense.DENSE_STATIC)
q = jnp.ones((1, 8, 2, 4))
slopes = jnp.asarray(mods.alibi_slopes(2))
context = getattr(jax_config, "trace_context_names", lambda: ())
names = set(context())
attend(q, q, q, is_causal=True, score_mod=mods.alibi, score_mod_args=(slopes,))
added = sorted(set(context()) - names)
print("tracing context values added by the first call:", added, flush=True)
attend(q, q, q, is_causal=True, score_mod=mods.alibi, score_mod_args=(2.0 * slopes,))
"""


def test_the_first_auto_dispatched_call_of_a_process_does_not_make_the_next_retrace():
  # The claims above, on the first attention call of a fresh process with the default
  # (auto) implementation: what that trace does must leave jax's tracing context as it was.
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join(
      [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    ),
  )
  run = subprocess.run(
    [sys.executable, "-c", FIRST_CALL],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  added = [line for line in run.stdout.splitlines() if line.startswith("tracing context")]
  retraced = "is traced > 1 times" in run.stderr
  assert run.returncode == 0, (
    "the second call of a fresh process traced (and compiled) again: the first call's "
    f"trace changed jax's tracing context ({added[0] if added else 'no report'}; on jax "
    "0.12 importing jax's Pallas splash package inside that trace added "
    "pallas_fuser_disable_nested_fuse; attnjax.kernels.splash imports it with the module)"
    if retraced
    else "the script failed"
  ) + f"; stderr tail:\n{run.stderr[-1500:]}"
