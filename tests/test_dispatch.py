"""Auto-dispatch per platform: which implementation each branch of ``implementation=None`` picks.

``dense.dispatch_table(inputs, opts)`` is what ``jax.lax.platform_dependent``
receives when a call with ``implementation=None`` is traced: for each platform
the first engine of ``dense.PREFERENCES[platform]`` and then ``dense.FALLBACK``
whose ``unsupported`` accepts the call. For every option combination below the
choice of every platform must support every option of the call (no option is
dropped), and the choices follow the documented order: cuda: cudnn (only where
this host has the cuDNN library), else mosaic_gpu on a Hopper, else
pallas_gpu, else by length; tpu: splash, else pallas_tpu, else by length; cpu:
by length (``blockwise`` from ``BLOCKWISE_MIN_LENGTH_CPU`` on, else
``reference``). The module runs with every kernel allowed (``all_kernels``):
the kernel-trust filter on these lists is tests/test_trust.py's.
"""

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attnjax
import attnjax.kernels.pallas_gpu
from attnjax._src import sharding as _sharding, target as _target, mods, normalizers
from attnjax._src.ops.dense import attention as dense
from attnjax._src.kernels import jax_nn, splash
from attnjax._src.kernels.mosaic_gpu import kernel as mosaic_gpu
from attnjax._src.kernels.pallas_gpu import kernel as pallas_gpu
from helpers import rand_qkv, run_kernel

pytestmark = pytest.mark.usefixtures("all_kernels")

STRUCTURES = {
  "none": {},
  "causal": dict(is_causal=True),
  "window": dict(window=(8, 0)),
  "segments": "segments",
}
EXTRAS = {
  "plain": {},
  "sink": "sink",
  "softcap": dict(softcap=5.0),
  "stats": dict(return_stats=True),
  "bias": "bias",
  "mask": "mask",
  "euclid": dict(similarity="neg_sq_euclidean"),
  "score_mod": "score_mod",
  "mask_mod": "mask_mod",
}


def _call(normalizer, structure, extra, T, dtype, H=8):
  q, k, v = rand_qkv(B=1, T=T, N=2, K=1, H=H, dtype=dtype)
  kw: dict[str, Any] = dict(normalizer=normalizer)
  s = STRUCTURES[structure]
  kw.update(dict(segment_ids=jnp.zeros((1, T), int)) if s == "segments" else s)
  e = EXTRAS[extra]
  if e == "sink":
    if not normalizers.REGISTRY[normalizer].accepts_sink_logits:
      return None
    e = dict(sink_logits=jnp.zeros(2))
  elif e == "bias":
    e = dict(bias=jnp.zeros((1, 1, T, T)))
  elif e == "mask":
    e = dict(mask=jnp.ones((1, 1, T, T), bool))
  elif e == "score_mod":
    e = dict(score_mod=mods.alibi, score_mod_args=(jnp.asarray(mods.alibi_slopes(2)),))
  elif e == "mask_mod":
    e = dict(mask_mod=mods.prefix_lm_mask, mask_mod_args=(jnp.asarray([5]),))
  kw.update(e)
  return dense.prepare(q, k, v, **kw)


def _expected(inputs, opts, T, dtype, major=None) -> dict[str, str]:
  by_length = "blockwise" if T >= dense.BLOCKWISE_MIN_LENGTH_CPU else "reference"
  pallas_ok = (
    inputs.bias is None
    and inputs.mask is None
    and opts.similarity == "dot"
    and opts.score_mod is None
    and opts.mask_mod is None
  )
  splash_ok = (
    normalizers.REGISTRY[opts.normalizer].platform_kernel
    and pallas_ok
    and not opts.return_stats
    and T % 128 == 0
    and dtype != jnp.float16
  )
  # cuDNN: softmax without sinks, softcap, statistics or modifiers, bf16/fp16 (bias and mask
  # arrays it takes), where jax can trace its cuDNN call on this host.
  cudnn_ok = (
    _target.cudnn_version() is not None
    and opts.normalizer == "softmax"
    and inputs.sink_logits is None
    and opts.softcap is None
    and not opts.return_stats
    and opts.similarity == "dot"
    and opts.score_mod is None
    and opts.mask_mod is None
    and dtype in (jnp.bfloat16, jnp.float16)
  )
  # mosaic_gpu: on a Hopper (compute capability 9) only; bf16/fp16, head dims 64/128/256.
  mosaic_ok = (
    major == 9
    and pallas_ok
    and dtype in (jnp.bfloat16, jnp.float16)
    and inputs.q.shape[-1] in (64, 128, 256)
  )
  cuda = (
    "cudnn" if cudnn_ok else "mosaic_gpu" if mosaic_ok else "pallas_gpu" if pallas_ok else by_length
  )
  # pallas_tpu: no bias / mask array, dot similarity, fp32 / bf16; the modifiers here (ALiBi's
  # slopes[n], prefix lengths[b]) read their arguments by scalar index, which it evaluates.
  tpu_ok = (
    inputs.bias is None
    and inputs.mask is None
    and opts.similarity == "dot"
    and dtype in (jnp.float32, jnp.bfloat16)
  )
  tpu = "splash" if splash_ok else "pallas_tpu" if tpu_ok else by_length
  return {"cpu": by_length, "cuda": cuda, "tpu": tpu}


@pytest.mark.skipif(
  jax.default_backend() != "cpu",
  reason="the expected cuda choice assumes a host without a GPU (head dims above 128 for cuDNN)",
)
@pytest.mark.parametrize("normalizer", normalizers.NORMALIZERS)
def test_every_platform_choice_supports_every_option(normalizer):
  for structure, extra, T, dtype in itertools.product(
    STRUCTURES, EXTRAS, (64, 256), (jnp.float32, jnp.bfloat16)
  ):
    call = _call(normalizer, structure, extra, T, dtype)
    if call is None:
      continue
    inputs, opts = call
    table = dense.dispatch_table(inputs, opts)
    what = (normalizer, structure, extra, T, jnp.dtype(dtype).name)
    assert table == _expected(inputs, opts, T, dtype), (what, table)
    for platform, name in table.items():
      assert dense.ENGINES[name].unsupported(inputs, opts) == [], (what, platform, name)
    assert dense.select_implementation(inputs, opts) == table["cpu"]


@pytest.mark.skipif(
  jax.default_backend() != "cpu",
  reason="the expected cuda choice assumes a host without a GPU (head dims above 128 for cuDNN)",
)
@pytest.mark.parametrize("major", [None, 8, 9, 10])
def test_the_cuda_choice_follows_the_compute_capability(monkeypatch, major):
  # The GPU a program is traced for (attnjax._target.cuda_major: the ambient mesh's device
  # kind, else this process's GPU), read by mosaic_gpu.unsupported: a Hopper takes mosaic_gpu
  # where cuDNN does not cover the call; Ampere, Blackwell (no wgmma) and an unknown GPU take
  # pallas_gpu.
  monkeypatch.setattr(_target, "cuda_major", lambda: major)
  seen = set()
  for normalizer, structure, extra, dtype, H in itertools.product(
    ("softmax", "sigmoid"), STRUCTURES, EXTRAS, (jnp.float32, jnp.bfloat16, jnp.float16), (64, 96)
  ):
    call = _call(normalizer, structure, extra, 128, dtype, H=H)
    if call is None:
      continue
    inputs, opts = call
    table = dense.dispatch_table(inputs, opts)
    what = (major, normalizer, structure, extra, jnp.dtype(dtype).name, H)
    assert table == _expected(inputs, opts, 128, dtype, major), (what, table)
    assert dense.ENGINES[table["cuda"]].unsupported(inputs, opts) == [], what
    seen.add(table["cuda"])
  assert ("mosaic_gpu" in seen) == (major == 9), seen
  inputs, opts = _call("sigmoid", "causal", "plain", 128, jnp.bfloat16, H=64)
  reasons = mosaic_gpu.unsupported(inputs, opts)
  assert (reasons == []) == (major == 9), reasons
  assert mosaic_gpu.unsupported(inputs, opts, interpret=True) == []  # the interpreter: any host


def test_the_device_count_never_changes_the_choice(monkeypatch):
  # Platform kernels run inside shard_map under a multi-device mesh (tests/test_targets.py
  # compiles them so), so the choice is the same on one device or many.
  inputs, opts = _call("softmax", "causal", "plain", 256, jnp.bfloat16)
  tables = []
  for n in (1, 8):
    monkeypatch.setattr(jax, "device_count", lambda *a, n=n: n)
    tables.append(dense.dispatch_table(inputs, opts))
  assert tables[0] == tables[1] and tables[0]["tpu"] == "splash"


@pytest.mark.parametrize("axis_type", ["auto", "explicit"])
def test_platform_kernels_run_per_shard_under_a_mesh(axis_type):
  # The kernel runs inside shard_map over the mesh axes that divide the batch and kv heads and
  # is told where its shard starts; equal to the unsharded call. Auto axes (as the train loop's
  # mesh): the Pallas GPU kernel in interpret mode; explicit axes (arrays typed replicated,
  # resharded to the kernel's specs): the reference stands for the kernel (interpret-mode
  # Pallas refuses explicitly sharded refs).
  kind = jax.sharding.AxisType.Auto if axis_type == "auto" else jax.sharding.AxisType.Explicit
  mesh = jax.make_mesh((4, 2), ("data", "tensor"), axis_types=(kind, kind))
  assert _sharding.kernel_axes(mesh, 8, 2) == (("data",), ("tensor",))
  assert _sharding.kernel_axes(mesh, 2, 3) == ((), ())  # neither divides: unsharded
  q, k, v = rand_qkv(B=8, T=40, N=4, K=2, H=16)
  kw = dict(is_causal=True, normalizer="softpick", return_stats=True)
  opts = dense.prepare(q, k, v, **kw)[1]
  seen = []

  def kernel(i, offsets):
    seen.append((i.q.shape, i.k.shape, offsets))
    if axis_type == "auto":
      return run_kernel(attnjax.kernels.pallas_gpu, i, opts, interpret=True)
    return dense.reference(i, opts)

  want = kernel(dense.prepare(q, k, v, **kw)[0], _sharding.ShardOffsets())
  assert seen[-1][2] == (0, 0)  # outside a mesh: the whole call
  with jax.set_mesh(mesh):
    got = jax.jit(lambda *a: _sharding.per_shard(kernel, dense.prepare(*a, **kw)[0]))(q, k, v)
  assert seen[-1][:2] == ((2, 40, 2, 16), (2, 40, 1, 16))  # a device's batch rows and heads
  assert all(isinstance(x, jax.core.Tracer) for x in seen[-1][2])  # axis_index * shard size
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@dataclasses.dataclass(frozen=True)
class _NewOptions(dense.DenseOptions):
  """A dense call with an option added after the platform kernels were written."""

  future_option: Any = None


def test_an_option_a_kernel_does_not_know_is_never_dropped():
  inputs, opts = _call("softmax", "causal", "plain", 256, jnp.bfloat16)
  new = _NewOptions(**dataclasses.asdict(opts), future_option=lambda z, *idx: z)
  for check in (
    pallas_gpu.unsupported,
    dense.pallas_tpu.unsupported,
    splash.unsupported,
    jax_nn.cudnn_unsupported,
    mosaic_gpu.unsupported,
  ):
    assert any("future_option" in r for r in check(inputs, new)), check
  # at the default, the new field is no reason
  assert pallas_gpu.unsupported(inputs, _NewOptions(**dataclasses.asdict(opts))) == []
  table = dense.dispatch_table(inputs, new)
  assert not {"pallas_gpu", "pallas_tpu", "splash"} & set(table.values()), table


def test_auto_dispatch_runs_the_cpu_branch_and_matches_the_reference():
  # cpu -> reference, cuda -> pallas_gpu, tpu -> pallas_tpu: one program holding the three
  # branches, run on the CPU.
  q, k, v = rand_qkv(B=1, T=40, N=4, K=2, H=16)
  kw = dict(normalizer="softpick", is_causal=True, return_stats=True)
  assert len(set(dense.dispatch_table(*dense.prepare(q, k, v, **kw)).values())) == 3

  def loss(q, impl):
    out, st = attnjax.dot_product_attention(q, k, v, implementation=impl, **kw)
    return jnp.sum(out**2) + jnp.sum(st.logsumexp)

  for got, want in zip(jax.value_and_grad(loss)(q, None), jax.value_and_grad(loss)(q, "reference")):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# Dispatch is data: a record in dense.ENGINES and a name in a list of dense.PREFERENCES.


def _counting_reference(calls: list):
  """The reference under another name, counting its traces."""

  def compute(inputs, opts):
    calls.append(opts.normalizer)
    return dense.reference(inputs, opts)

  return compute


def test_a_stand_in_engine_is_chosen_where_it_covers_the_call(monkeypatch):
  # One record and one list entry, no other edit: auto-dispatch takes the stand-in where its
  # unsupported accepts the call (softmax), and the old choice elsewhere (sigmoid) and once it
  # is gone. A length no other test uses keeps jax's trace caches out of the way.
  q, k, v = rand_qkv(B=1, T=37, N=2, K=1, H=8)
  softmax, sigmoid = (dense.prepare(q, k, v, normalizer=n) for n in ("softmax", "sigmoid"))
  before = {
    n: dense.dispatch_table(*call) for n, call in (("softmax", softmax), ("sigmoid", sigmoid))
  }
  calls = []
  stand_in = dense.Engine(
    "counting",
    _counting_reference(calls),
    lambda inputs, opts: [] if opts.normalizer == "softmax" else ["only softmax"],
  )
  with monkeypatch.context() as m:
    m.setitem(dense.ENGINES, "counting", stand_in)
    m.setitem(dense.PREFERENCES, "cpu", ("counting",))
    assert dense.dispatch_table(*softmax) == dict(before["softmax"], cpu="counting")
    assert dense.dispatch_table(*sigmoid) == before["sigmoid"]
    out = jax.jit(lambda q: attnjax.dot_product_attention(q, k, v))(q)
    assert calls == ["softmax"]
    np.testing.assert_allclose(out, dense.reference(*softmax), rtol=1e-6, atol=1e-6)
    # ... and by name, as every engine of the registry
    attnjax.dot_product_attention(q, k, v, implementation="counting")
    assert calls == ["softmax"] * 2
  assert {
    n: dense.dispatch_table(*call) for n, call in (("softmax", softmax), ("sigmoid", sigmoid))
  } == before
  with pytest.raises(ValueError, match="implementation='counting' is not one of"):
    attnjax.dot_product_attention(q[:, :36], k, v, implementation="counting")  # a new trace


def test_each_engine_is_checked_once_per_call(monkeypatch):
  # Auto-dispatch asks each engine's unsupported once however many platforms' lists name it,
  # and a named call once (the engine's computation does not ask again).
  q, k, v = rand_qkv(B=1, T=41, N=2, K=1, H=8)
  asked = []
  for name, engine in list(dense.ENGINES.items()):

    def counted(inputs, opts, *, _name=name, _check=engine.unsupported):
      asked.append(_name)
      return _check(inputs, opts)

    monkeypatch.setitem(dense.ENGINES, name, dataclasses.replace(engine, unsupported=counted))
  bias = jnp.zeros((1, 1, 41, 41))  # no platform kernel takes it: every list ends on reference
  jax.jit(lambda q: attnjax.dot_product_attention(q, k, v, bias, normalizer="softpick"))(q)
  assert sorted(asked) == sorted(
    {"cudnn", "mosaic_gpu", "pallas_gpu", "splash", "pallas_tpu", "reference"}
  ), asked
  asked.clear()
  jax.jit(lambda q: attnjax.dot_product_attention(q, k, v, implementation="blockwise"))(q)
  assert asked == ["blockwise"]


def test_the_records_say_who_vouches_for_each_engine():
  vouched = {name: e.vouched_by for name, e in dense.ENGINES.items()}
  assert vouched == {
    "reference": "attnjax",
    "blockwise": "attnjax",
    "xla": "jax",
    "cudnn": "jax",
    "splash": "jax",
    "pallas_gpu": "device-check",
    "pallas_tpu": "device-check",
    "mosaic_gpu": "device-check",
  }
  assert dense.IMPLEMENTATIONS == tuple(dense.ENGINES)
  for platform, names in dense.PREFERENCES.items():
    assert all(dense.ENGINES[n].platform == platform for n in names), platform
  assert {n for names in dense.PREFERENCES.values() for n in names} == {
    n for n, e in dense.ENGINES.items() if e.per_shard
  }
