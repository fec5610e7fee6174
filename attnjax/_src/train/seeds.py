"""Seeds of one arm trained together: one jitted step over their stacked states and batches.

``train_seeds(configs)`` trains runs that differ only in ``seed`` (and ``run_dir``) as one
program over parameters, optimiser states and batches stacked on a leading seed axis
(``jax.lax.map`` on a CPU, ``jax.vmap`` on accelerators). Each seed
still writes its own run directory, the files a run of its own writes, equal to it up to
float summation order (tests/test_seeds.py). Seeds stack on a one-device mesh; on several
devices, or when the seeds' checkpoints stand at different steps, they run one after another.

Guide: docs/guides/training.md, section "Seeds".
Implementation behind :func:`attnjax.train.train_seeds`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flax import nnx

from attnjax._src.data import sources as data_lib
from attnjax._src.train import config as config_lib
from attnjax._src.train import loop, rundir
from attnjax._src.train import mesh as mesh_lib
from attnjax._src.train.model import build_model
from attnjax._src.train.prefetch import Prefetch
from attnjax._src.train.step import make_train_step

# Config keys in which the runs of one seed group may differ.
PER_SEED_KEYS = ("seed", "run_dir")
# How a group steps its stacked seeds: ``jax.lax.map`` (one program that runs the step's
# kernels once per seed, in turn) or ``jax.vmap`` (one program of batched kernels).
STACKINGS = ("map", "vmap")


def default_stacking(platform: str) -> str:
  """``"map"`` on a CPU, where batched small kernels run slower than the same kernels in
  turn (``experiments/bench.py --suite seeds``); ``"vmap"`` on accelerators, whose width the
  batched kernels fill."""
  return "map" if platform == "cpu" else "vmap"


def stacked_step(step_fn: Any, stacking: str, *, donate: bool = True) -> Any:
  """``step_fn`` over a leading seed axis of every argument, jitted.

  Args:
    step_fn: ``(state, rest, *batch) -> (state, metrics)`` of one seed
      (:func:`attnjax.train.make_train_step`).
    stacking: ``"map"`` or ``"vmap"`` (:data:`~attnjax._src.train.seeds.STACKINGS`).
    donate: donate the stacked state (the training loop's choice; a benchmark that calls
      the step on the same state again keeps it).

  Returns:
    The jitted step over stacked arguments.

  Raises:
    ValueError: an unknown ``stacking``.
  """
  donated = (0,) if donate else ()
  if stacking == "vmap":
    return jax.jit(jax.vmap(step_fn), donate_argnums=donated)
  if stacking == "map":
    return jax.jit(lambda *args: jax.lax.map(lambda a: step_fn(*a), args), donate_argnums=donated)
  raise ValueError(f"stacking={stacking!r} is not one of: {', '.join(STACKINGS)}")


def check_group(configs: Sequence[Any]) -> None:
  """ValueError unless ``configs`` differ only in :data:`PER_SEED_KEYS`, with distinct run dirs."""
  if not configs:
    raise ValueError("a seed group needs at least one config")
  first = configs[0].to_dict()
  for cfg in configs[1:]:
    changed = [k for k in loop.config_changes(first, cfg.to_dict()) if k not in PER_SEED_KEYS]
    if changed:
      raise ValueError(
        f"the runs of a seed group may differ only in {', '.join(PER_SEED_KEYS)}; "
        f"{cfg.run_dir} differs from {configs[0].run_dir} in {', '.join(changed)}"
      )
  dirs = [c.run_dir for c in configs]
  if len(set(dirs)) != len(dirs):
    raise ValueError(f"the runs of a seed group need distinct run_dir, got {dirs}")


def init_models(configs: Sequence[Any]) -> list[tuple]:
  """``(graphdef, params, rest)`` of each config's model at its seed, initialised on the
  default device by one ``jax.vmap`` over the seeds' keys (one compile for the group; the
  values equal each seed's own initialisation, ``nnx.Rngs(seed)``)."""
  cfg = configs[0]
  vocab = data_lib.from_config(cfg.data, seed=cfg.seed).model_vocab_size

  def make(key):
    _, params, rest = nnx.split(build_model(cfg, vocab, seed=key), nnx.Param, ...)
    return params, rest

  graphdef = nnx.split(nnx.eval_shape(lambda: build_model(cfg, vocab, seed=0)), nnx.Param, ...)[0]
  keys = jax.vmap(jax.random.key)(jnp.asarray([c.seed for c in configs], jnp.uint32))
  params, rest = jax.jit(jax.vmap(make))(keys)
  return [
    (graphdef, jax.tree.map(lambda x: x[i], params), jax.tree.map(lambda x: x[i], rest))
    for i in range(len(configs))
  ]


def _stack(trees: Sequence[Any]) -> Any:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _host_records(host: list[dict], i: int) -> list[dict]:
  """Seed ``i``'s share of stacked metrics read to the host, as the single-run loop writes."""
  return [
    {
      k: (float(v[i]) if np.ndim(v[i]) == 0 else [float(x) for x in np.ravel(v[i])])
      for k, v in m.items()
    }
    for m in host
  ]


class SeedGroup:
  """Runs that differ only in their seed, trained as one stacked program.

  Each seed is a :class:`~attnjax.train.Trainer` (its data, model, checkpoints and run
  directory); the group owns the stacked state and the one compiled step, reads the
  stacked metrics once per flush and hands each seed its share. A seed that diverges stops
  recording (its lane of the stacked step keeps computing, unread) and the others go on.

  Args:
    configs: validated run configs differing only in ``seed`` and ``run_dir``.
    stacking: ``"map"`` or ``"vmap"`` (:data:`~attnjax._src.train.seeds.STACKINGS`); None: :func:`~attnjax._src.train.seeds.default_stacking`
      of the devices' platform.

  Attributes:
    trainers: one :class:`~attnjax.train.Trainer` per seed.
    stacked: whether the seeds train stacked (one device, checkpoints at one step);
      otherwise :meth:`run` trains them one after another.
    compiled_step: the stacked step after :meth:`run` (None before it, or when not stacked).
    state: the stacked training state after :meth:`run`.
    rest: the stacked non-parameter variables after :meth:`run`.

  Raises:
    ValueError: configs that differ in another key (named), or repeated run directories.
  """

  def __init__(self, configs: Sequence[Any], *, stacking: Optional[str] = None):
    check_group(configs)
    if stacking is not None and stacking not in STACKINGS:
      raise ValueError(f"stacking={stacking!r} is not one of: {', '.join(STACKINGS)}")
    for cfg in configs:
      config_lib.validate(cfg, num_devices=jax.device_count())
    one_device = mesh_lib.RunMesh(configs[0]).mesh.devices.size == 1
    self.stacked = len(configs) > 1 and one_device
    models = init_models(configs) if self.stacked else [None] * len(configs)
    self.trainers = [loop.Trainer(cfg, model=m) for cfg, m in zip(configs, models)]
    first = self.trainers[0]
    self.stacking = stacking or default_stacking(first.dp.mesh.devices.flat[0].platform)
    for t in self.trainers[1:]:  # one compiled evaluation for every seed
      t.eval_step = first.eval_step
    self.compiled_step = None
    self.state = None
    self.rest = None

  @property
  def cfg(self) -> Any:
    return self.trainers[0].cfg

  def run(self) -> list[dict]:
    """Trains (or resumes) every seed to ``train.steps``; returns their summaries, in order."""
    if not self.stacked:
      return [t.run() for t in self.trainers]
    lrs = loop.lr_table(self.trainers[0].schedule, self.cfg.train.steps)
    for t in self.trainers:
      t.lrs = lrs
    with jax.set_mesh(self.trainers[0].dp.mesh):
      return self._run()

  # -- the stacked run ------------------------------------------------------

  def _run(self) -> list[dict]:
    trainers = self.trainers
    for t in trainers:
      changed = loop.check_config(t.dir, t.cfg)
      if changed:
        print(
          f"{t.cfg.run_dir}: resuming with {', '.join(changed)} changed (keys that do not "
          f"change what the run computes)",
          file=sys.stderr,
          flush=True,
        )
      if t.is_writer:
        rundir.write_json(t.dir.config, t.cfg.to_dict())
    managers = [t._manager() for t in trainers]
    starts = [t._restore_latest(m) for t, m in zip(trainers, managers)]
    if len(set(starts)) > 1:  # checkpoints of different steps: each seed resumes on its own
      for m in managers:
        m.close()
      print(
        f"{self.cfg.run_dir}: the seeds' checkpoints stand at steps {starts}; training them "
        f"one after another",
        file=sys.stderr,
        flush=True,
      )
      return [t.run() for t in trainers]
    start = starts[0]
    begun = [t._begin(start) for t in trainers]
    self.state = _stack([t.state for t in trainers])
    self.rest = _stack([t.rest for t in trainers])
    t0 = time.perf_counter()
    first = trainers[0]
    step_fn = make_train_step(
      first.graphdef,
      first.optimizer,
      z_loss=self.cfg.opt.z_loss,
      stats=self.cfg.train.step_stats,
      microbatches=self.cfg.train.microbatches,
    )
    step = stacked_step(step_fn, self.stacking)
    self.compiled_step = step.lower(self.state, self.rest, *self.batch(start)).compile()
    compile_s = time.perf_counter() - t0
    progress = [
      t._progress(start, previous, bar=False) for t, (_, previous) in zip(trainers, begun)
    ]
    bar = None
    if self.cfg.train.progress and first.is_writer:
      from tqdm.auto import tqdm

      bar = tqdm(
        total=self.cfg.train.steps,
        initial=start,
        desc=f"{self.cfg.variant} x{len(trainers)} seeds",
        leave=False,
        mininterval=1.0,
      )
    try:
      self._loop(managers, progress, start, bar)
    finally:
      for p in progress:
        p.close()
      for m in managers:
        m.close()
      if bar is not None:
        bar.close()
    out = []
    for t, (summary, _), p in zip(trainers, begun, progress):
      summary["seed_group"] = {
        "seeds": [c.cfg.seed for c in trainers],
        "stacked": True,
        "stacking": self.stacking,
      }
      out.append(t._end(summary, p, compile_s))
    return out

  def batch(self, step: int) -> tuple:
    """The seeds' training batches of ``step``, stacked ``[S, B, T]`` on the device."""
    rows = [t.batches.batch("train", step) for t in self.trainers]
    arrays = [np.stack([b.inputs for b in rows]), np.stack([b.targets for b in rows])]
    packing = rows[0].packing()
    put = self.trainers[0].dp.replicate
    with jax.transfer_guard_host_to_device("allow"):
      args = tuple(put(a) for a in arrays)
      if packing is not None:
        args += ({k: put(np.stack([b.packing()[k] for b in rows])) for k in packing},)
    return args

  def member_state(self, i: int) -> dict:
    """Seed ``i``'s slice of the stacked state (a copy; the stacked state is donated)."""
    return jax.tree.map(lambda x: x[i], self.state)

  def _loop(self, managers, progress, start: int, bar) -> None:
    """The single-run loop (:meth:`attnjax.train.Trainer._loop`) over the stacked seeds."""
    trainers = self.trainers
    t = self.cfg.train
    end = t.stop_after if t.stop_after and start <= t.stop_after < t.steps else t.steps
    active = list(range(len(trainers)))
    pending: list = []
    pending_steps: list = []
    step = start

    def flush(keep: int = 0) -> None:
      n = len(pending) - keep
      if n <= 0:
        return
      steps = pending_steps[:n]
      t0 = time.perf_counter()
      host = mesh_lib.to_host(pending[:n])
      del pending[:n], pending_steps[:n]
      now = time.perf_counter()
      for i in list(active):
        p = progress[i]
        p.times["metrics_wait"] += now - t0
        bad = trainers[i]._record(p, steps, _host_records(host, i), now)
        if bad is not None:
          p.diverged_step, p.status = bad, "diverged"
          active.remove(i)
      if bar is not None:
        bar.update(n)
        losses = [progress[i].last_train.get("loss") for i in active]
        if losses:
          bar.set_postfix(loss=f"{np.mean(losses):.3f}")

    batches = Prefetch(self.batch, start, end)
    try:
      while True:
        due = trainers[0]._boundary(step, start)
        if due or step == t.stop_after:
          flush()
        if not active:
          return
        if due:
          for i in active:
            trainers[i].state = dict(
              self.member_state(i),
              initial_loss=trainers[i].dp.replicate(np.float32(progress[i].initial_loss)),
            )
            trainers[i]._at_boundary(due, managers[i], progress[i])
          now = time.perf_counter()
          for i in active:  # every seed waited for all the seeds' boundaries
            progress[i].last_flush = now
        if step == t.steps:
          return
        if t.stop_after and step == t.stop_after:
          for i in active:
            progress[i].status = "stopped"
          return
        t0 = time.perf_counter()
        args = batches.get(step)
        t1 = time.perf_counter()
        self.state, metrics = self.compiled_step(self.state, self.rest, *args)
        t2 = time.perf_counter()
        pending.append(metrics)
        pending_steps.append(step)
        step += 1
        for i in active:
          progress[i].step = step
          progress[i].times["batch_wait"] += t1 - t0
          progress[i].times["dispatch"] += t2 - t1
        if len(pending) > t.log_every:
          flush(keep=1)
          if not active:
            return
    finally:
      batches.close()


@dataclasses.dataclass
class StepHandle:
  """An arm's compiled training step after its run, with what to call it on again.

  Attributes:
    run_dir: the arm's folder (for a seed group, the folder above its seeds' run dirs).
    step: the compiled step (donates its first argument).
    state, rest, args: its state, non-parameter variables and a training batch.
    tokens: tokens one call trains on (every seed's).
    seeds: how many seeds one call trains.
  """

  run_dir: str
  step: Any
  state: Any
  rest: Any
  args: tuple
  tokens: int
  seeds: int

  @classmethod
  def of_trainer(cls, trainer: loop.Trainer) -> "StepHandle":
    cfg = trainer.cfg
    args = trainer.dp.batch_args(trainer.batches.batch("train", 0))
    return cls(
      cfg.run_dir, trainer.compiled_step, trainer.state, trainer.rest, args,
      cfg.data.batch_size * cfg.data.seq_len, 1,
    )  # fmt: skip

  @classmethod
  def of_group(cls, group: SeedGroup) -> "StepHandle":
    cfg = group.cfg
    S = len(group.trainers)
    return cls(
      os.path.dirname(os.path.normpath(cfg.run_dir)), group.compiled_step, group.state,
      group.rest, group.batch(0), S * cfg.data.batch_size * cfg.data.seq_len, S,
    )  # fmt: skip

  def time(self, calls: int) -> float:
    """Seconds that ``calls`` steps take, the device waited for."""
    t0 = time.perf_counter()
    for _ in range(calls):
      self.state, metrics = self.step(self.state, self.rest, *self.args)
    jax.block_until_ready((self.state, metrics))
    return time.perf_counter() - t0


def train_seeds(
  configs: Sequence[Any], *, keep: Optional[list] = None, stacking: Optional[str] = None
) -> list[dict]:
  """Trains runs that differ only in their seed together; returns their summaries, in order.

  Runs that already ended are not trained again (their summaries are returned, as
  :func:`attnjax.train.train` does); the others train as one :class:`.SeedGroup`:
  stacked on a one-device mesh, else one after another.

  Args:
    configs: validated run configs (``run_dir`` set) that differ only in ``seed`` and
      ``run_dir``.

    keep: a list to which the :class:`~attnjax._src.train.seeds.StepHandle` of what trained here is appended (one
      per stacked group or single run; none for seeds that ran one after another), for a
      bare-step timing after the sweep.
    stacking: how the group steps its seeds (:class:`.SeedGroup`); None: by platform.

  Returns:
    One summary per config (``summary.json`` of its run directory).

  Raises:
    ValueError: configs that differ in another key, or an invalid config.
  """
  check_group(configs)
  todo = [i for i, c in enumerate(configs) if not rundir.RunDir(c.run_dir).is_done()]
  out = [None] * len(configs)
  for i, cfg in enumerate(configs):
    if i not in todo:
      out[i] = loop.train(cfg)
  if len(todo) == 1:
    trainer = loop.Trainer(configs[todo[0]])
    out[todo[0]] = trainer.run()
    if keep is not None and trainer.compiled_step is not None:
      keep.append(StepHandle.of_trainer(trainer))
  elif todo:
    group = SeedGroup([configs[i] for i in todo], stacking=stacking)
    for i, summary in zip(todo, group.run()):
      out[i] = summary
    if keep is not None and group.compiled_step is not None:
      keep.append(StepHandle.of_group(group))
  return out


def bare_step_rates(handles: Sequence[StepHandle], *, rounds: int = 5, calls: int = 3) -> dict:
  """Tokens/s of each arm's compiled step alone, measured interleaved in one window.

  Each round times ``calls`` steps of every arm, in an order rotated by one arm per round
  (after one untimed call each), so load from elsewhere falls on every arm alike.

  Args:
    handles: the arms' :class:`~attnjax._src.train.seeds.StepHandle` (from :func:`.train_seeds`'s ``keep``).
    rounds: timed rounds.
    calls: steps per arm and round.

  Returns:
    ``{"rounds", "calls", "load": [before, after], "arms": [{"run_dir", "seeds", "tokens",
    "rates": [tokens/s per round]}]}``.
  """
  from attnjax._src.train import host

  before = host.current_load()
  for h in handles:
    h.time(1)
  rates: list[list[float]] = [[] for _ in handles]
  for r in range(rounds):
    for j in range(len(handles)):
      i = (j + r) % len(handles)
      rates[i].append(handles[i].tokens * calls / handles[i].time(calls))
  return {
    "rounds": rounds,
    "calls": calls,
    "load": [before, host.current_load()],
    "arms": [
      {"run_dir": h.run_dir, "seeds": h.seeds, "tokens": h.tokens, "rates": rate}
      for h, rate in zip(handles, rates)
    ],
  }
