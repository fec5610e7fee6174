"""Training on a full mesh (attnjax.train.mesh): data, FSDP, tensor and context axes.

The suite runs on 8 host devices (conftest), so every mesh below is real: the
model is created sharded, the optimizer state sharded like it, and the step
compiled for the mesh. The same seed gives the same losses on every mesh shape
(up to the order of floating-point reductions).
"""

import jax
import numpy as np
import pytest

from attnjax._src.train import config as config_lib
from attnjax._src.train import mesh as mesh_lib
from attnjax._src.train import rundir
from attnjax._src.train.loop import Trainer, train

MESHES = {
  "data=8": dict(data=8),
  "data=2,fsdp=4": dict(data=2, fsdp=4),
  "fsdp=4,tensor=2": dict(data=1, fsdp=4, tensor=2),
  "data=2,context=4": dict(data=2, context=4),
  "fsdp=2,tensor=2,context=2": dict(data=1, fsdp=2, tensor=2, context=2),
}


# One layer and no microbatches on top of the cpu preset: a layer holds every kind of
# parameter the meshes shard, and microbatching is test_train's (half the CPU time: 6.8 s
# against 13.9 s for the data=2,context=4 run). test_multiprocess passes them as flags.
SMALLER = {"model.num_layers": 1, "train.microbatches": 1}


def cpu_preset(run_dir, mesh: dict, steps: int = 20, **train):
  """The cpu preset's model and data on ``mesh``, made :data:`SMALLER`."""
  c = config_lib.apply_preset(config_lib.base_config(), "cpu")
  for dotted, value in SMALLER.items():
    section, name = dotted.split(".")
    c[section][name] = value
  c.run_dir = str(run_dir)
  c.data.name = "bigram_backcopy"
  c.train.update(
    dict(
      dict(
        steps=steps,
        log_every=5,
        eval_every=1000,
        probe_every=1000,
        checkpoint_every=0,
        progress=False,
        plots=False,
      ),
      **train,
    )
  )
  c.mesh.update(**mesh)
  return c


def losses(run_dir) -> list[float]:
  return [r["loss"] for r in rundir.read_jsonl(rundir.RunDir(str(run_dir)).metrics) if "loss" in r]


def test_mesh_sizes_and_bad_shapes_are_clear_errors():
  cfg = config_lib.base_config()
  assert mesh_lib.mesh_sizes(cfg.mesh, 8) == dict(data=8, fsdp=1, tensor=1, context=1)
  cfg.mesh.update(data=-1, fsdp=2, tensor=2)
  assert mesh_lib.mesh_sizes(cfg.mesh, 8)["data"] == 2
  cfg.mesh.update(data=3, fsdp=2, tensor=1)
  with pytest.raises(
    ValueError,
    match=r"data=3 x fsdp=2 x tensor=1 x context=1 = 6 devices, "
    r"but the run has 8",
  ):
    mesh_lib.mesh_sizes(cfg.mesh, 8)
  cfg.mesh.update(data=-1, fsdp=3)
  with pytest.raises(ValueError, match="cannot fill 8 devices"):
    mesh_lib.mesh_sizes(cfg.mesh, 8)
  c = cpu_preset("/tmp/unused", dict(data=1, tensor=8))  # 4 heads
  with pytest.raises(ValueError, match=r"model.num_heads=4 .* not divisible by mesh.tensor=8"):
    config_lib.validate(c, num_devices=8)
  c = cpu_preset("/tmp/unused", dict(data=1, context=8))
  c.data.seq_len = 60
  with pytest.raises(ValueError, match=r"data.seq_len=60 is not divisible by mesh.context=8"):
    config_lib.validate(c, num_devices=8)


def test_fsdp_shards_parameters_and_optimizer_state(tmp_path):
  # Parameters + Adam state bytes per device: FSDP over 8 devices holds at most 1/6 of the
  # replicated run's (every matrix is split along its model width; gains stay whole).
  per_device = {}
  for name, mesh in (("replicated", dict(data=8)), ("fsdp", dict(data=1, fsdp=8))):
    t = Trainer(cpu_preset(tmp_path / name, mesh))
    tree = (t.state["params"], t.state["opt_state"])
    per_device[name] = max(mesh_lib.bytes_per_device(tree).values())
    embedding = jax.tree.leaves(t.state["params"]["embed"])[0]
    assert embedding.sharding.is_fully_replicated == (name == "replicated"), embedding.sharding
  assert per_device["fsdp"] <= per_device["replicated"] / 6, per_device


@pytest.fixture(scope="module")
def data_parallel_losses(tmp_path_factory):
  root = tmp_path_factory.mktemp("data8")
  assert train(cpu_preset(root, MESHES["data=8"]))["status"] == "finished"
  return losses(root)


@pytest.mark.parametrize(
  "mesh",
  [
    pytest.param(
      name, marks=[] if name in ("fsdp=4,tensor=2", "data=2,context=4") else [pytest.mark.slow]
    )
    for name in MESHES
    if name != "data=8"
  ],
)
def test_every_mesh_gives_the_same_losses(tmp_path, mesh, data_parallel_losses):
  assert train(cpu_preset(tmp_path / "other", MESHES[mesh]))["status"] == "finished"
  a, b = data_parallel_losses, losses(tmp_path / "other")
  assert len(a) == len(b) == 20
  np.testing.assert_allclose(b, a, rtol=1e-5)


@pytest.mark.slow  # ~25 s: two training runs; test_train's resume tests run in the default
def test_a_checkpoint_resumes_on_another_mesh(tmp_path, data_parallel_losses):
  # Saved at fsdp=4, tensor=2 after 10 steps, resumed at data=8 (orbax reshards on restore):
  # the same losses as the uninterrupted data=8 run of the fixture.
  cut = cpu_preset(tmp_path / "cut", MESHES["fsdp=4,tensor=2"], stop_after=10, checkpoint_every=5)
  assert train(cut)["status"] == "stopped"
  cut.train.stop_after = 0
  cut.mesh.update(**dict(data=8, fsdp=1, tensor=1, context=1))
  resumed = train(cut)
  assert resumed["status"] == "finished" and resumed["resumed_from"] == 10
  assert resumed["devices"] == 8
  np.testing.assert_allclose(losses(tmp_path / "cut"), data_parallel_losses, rtol=1e-5)


def test_context_axis_runs_the_attention_ring(tmp_path):
  # With mesh.context > 1 the layers' attention runs sequence-sharded (a ring of key/value
  # shards: collective-permutes in the compiled step); without it, none.
  for name, ring in (("data=2,context=4", True), ("data=8", False)):
    t = Trainer(cpu_preset(tmp_path / name, MESHES[name]))
    with jax.set_mesh(t.dp.mesh):
      compiled, _ = t._compile(0)
    assert ("collective-permute" in compiled.as_text()) == ring, name
