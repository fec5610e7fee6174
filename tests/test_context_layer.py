"""``nn.Attention`` under a mesh with a ``context`` axis: the sequence-sharded path (attnjax.nn._context).

The suite runs on 8 host devices (conftest). Under ``jax.set_mesh`` of a mesh
with ``context`` > 1 a layer's training forward runs its family function inside
``shard_map`` with ``context_axis="context"`` (a ring of key/value shards for the
dense family, state passing for the recurrent ones): values, gradients and the
sown statistics equal the same layer without a mesh.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from attnjax import nn
from attnjax._src.nn import _context
from helpers import assert_close, reduction_tolerance

AXES = ("data", "fsdp", "tensor", "context")
B, T, D = 4, 64, 32


def make_mesh(data=1, fsdp=1, tensor=1, context=1):
  devices = np.asarray(jax.devices()[: data * fsdp * tensor * context])
  return jax.sharding.Mesh(devices.reshape(data, fsdp, tensor, context), AXES)


def inputs():
  x = jax.random.normal(jax.random.key(1), (B, T, D))
  seg = jnp.concatenate([jnp.zeros((B, 30), jnp.int32), jnp.ones((B, T - 30), jnp.int32)], 1)
  return x, seg


def loss_fn(graphdef, segments: bool, capture: bool):
  def loss(state, x, seg):
    layer = nnx.merge(graphdef, state)
    call = lambda m: m(x, segment_ids=seg if segments else None)
    if capture:
      y, sown = nnx.capture(call, nnx.Intermediate)(layer)
      stats = [s for p, s in jax.tree.leaves_with_path(sown) if "attention_stats" in str(p)]
    else:
      y, stats = call(layer), []
    return jnp.sum(jnp.sin(y)), (y, stats)

  return jax.jit(jax.value_and_grad(loss, has_aux=True))


def run_both(config, mesh_sizes, *, capture=False):
  layer = nn.Attention(config, d_model=D, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(layer)
  f = loss_fn(graphdef, config.spec.takes_segment_ids, capture)
  x, seg = inputs()
  reference = f(state, x, seg)
  mesh = make_mesh(**mesh_sizes)
  with jax.set_mesh(mesh):
    rows = NamedSharding(mesh, P(("data", "fsdp"), "context"))
    xs, ss = jax.device_put(x, rows), jax.device_put(seg, rows)
    jaxpr = str(jax.make_jaxpr(f)(state, xs, ss))
    sharded = f(state, xs, ss)
  return reference, sharded, jaxpr


CASES = {
  "dense sinks+alibi, tensor=2": (
    dict(family="dense", sink_logits=True, alibi=True),
    dict(fsdp=2, tensor=2, context=2),
  ),
  "dense sigmoid window": (
    dict(family="dense", normalizer="sigmoid", window=10),
    dict(data=2, context=4),
  ),
  "qk_norm softpick": (dict(family="qk_norm", normalizer="softpick"), dict(data=2, context=4)),
  "cosine": (dict(family="cosine"), dict(tensor=2, context=4)),
  "gla": (dict(family="gla"), dict(data=2, context=4)),
  "gated_deltanet, tensor=2": (dict(family="gated_deltanet"), dict(fsdp=2, tensor=2, context=2)),
  "retnet, tensor=2": (dict(family="retnet"), dict(tensor=2, context=4)),
  "linear": (dict(family="linear"), dict(data=2, context=4)),
  "sparse dilated window": (
    dict(
      family="sparse", block_size=8, pattern=("dilated_window", (("window", 16), ("dilation", 4)))
    ),
    dict(data=2, context=4),
  ),
  # A named implementation, which the ring cannot run: heads <-> sequence where the axis
  # divides the heads, else keys/values gathered.
  "dense xla, all_to_all": (dict(family="dense", implementation="xla"), dict(data=2, context=4)),
  "dense reference, all_gather": (
    dict(family="dense", implementation="reference", window=12),
    dict(context=8),
  ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layer_shards_the_sequence_and_matches(case):
  options, sizes = CASES[case]
  config = nn.AttentionConfig(num_heads=4, **options)
  (l0, (y0, _)), g0 = (reference := run_both(config, sizes))[0]
  (l1, (y1, _)), g1 = reference[1]
  jaxpr = reference[2]
  # The family function ran inside shard_map over the context axis (GSPMD would have none).
  assert "shard_map" in jaxpr and "context" in jaxpr
  if (
    options["family"] in ("dense", "qk_norm", "cosine", "sparse")
    and "implementation" not in options
  ):
    assert "ppermute" in jaxpr  # the ring
  if "all_to_all" in case:
    assert "all_to_all" in jaxpr and "ppermute" not in jaxpr
  if "all_gather" in case:
    assert "all_gather" in jaxpr and "ppermute" not in jaxpr
  assert_close(y1, y0, scaled=True)
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-5, atol=1e-4)  # a sum of B*T*D terms
  # A projection's gradient sums B*T tokens, each a sum over up to T positions (the ring's
  # rows, the recurrence's state): two reductions of B*T*T terms in another order.
  tol = reduction_tolerance(jnp.float32, B * T * T, depth=2)
  assert_close(g1, g0, rtol=1e-4, atol=tol, scaled=True)


def test_sown_statistics_match_under_context_parallelism():
  config = nn.AttentionConfig(num_heads=4, family="dense", sink_logits=True)
  (_, (_, s0)), _ = (both := run_both(config, dict(data=2, context=4), capture=True))[0]
  (_, (_, s1)), _ = both[1]
  assert s0 and len(s0) == len(s1)
  assert_close(s1, s0, scaled=True)


def test_linear_statistics_under_a_context_mesh_are_those_of_the_whole_call():
  # linear_attention's statistics from a shard: its rows against the gathered key features.
  config = nn.AttentionConfig(num_heads=4, family="linear")
  (_, (y0, s0)), _ = (both := run_both(config, dict(data=2, context=4), capture=True))[0]
  (_, (y1, s1)), _ = both[1]
  assert s0 and len(s0) == len(s1)
  assert_close((y1, s1), (y0, s0), scaled=True)


def test_what_cannot_shard_the_sequence_runs_as_before():
  # A mask array (its key columns would live on other shards) and kv_bias (an extra key
  # column) take the XLA-partitioned path; the values are the same either way.
  layer = nn.Attention(
    nn.AttentionConfig(num_heads=4, family="dense", kv_bias=True), d_model=D, rngs=nnx.Rngs(0)
  )
  x, _ = inputs()
  pad = jnp.arange(T)[None, None, None, :] < 50
  plain = nn.Attention(nn.AttentionConfig(num_heads=4), d_model=D, rngs=nnx.Rngs(0))
  want = (layer(x), plain(x, mask=pad))
  mesh = make_mesh(data=2, context=4)
  with jax.set_mesh(mesh):
    assert _context.context_size() == 4
    got = jax.jit(lambda m1, m2, x: (m1(x), m2(x, mask=pad)))(layer, plain, x)
    jaxpr = str(jax.make_jaxpr(lambda x: plain(x, mask=pad))(x))
  assert "shard_map" not in jaxpr
  assert_close(got, want, scaled=True)


def test_decode_stays_unsharded_under_a_context_mesh():
  layer = nn.Attention(nn.AttentionConfig(num_heads=4), d_model=D, rngs=nnx.Rngs(0))
  x, _ = inputs()
  full = layer(x[:1, :8])
  with jax.set_mesh(make_mesh(data=2, context=4)):
    cache = layer.init_cache(1, 16)
    y, cache = layer.decode(x[:1, :8], cache)
    jaxpr = str(jax.make_jaxpr(lambda c: layer.decode(x[:1, 8:9], c))(cache))
  assert "shard_map" not in jaxpr
  assert_close(y, full, scaled=True)
