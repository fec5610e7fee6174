"""The training loop: one run directory from one config, resumable bit for bit.

``attnjax.train.train(config)`` writes ``config.run_dir`` and returns ``summary.json``'s
dict. At each step boundary it validates, probes and checkpoints on their schedules, then
runs the step; a resumed run equals one never interrupted (but for ``tokens_per_s``). A
NaN/Inf or runaway loss ends the run as ``"diverged"``, cleanly. The host only
dispatches steps between reads of the metrics, so the device never waits on it.

Guide: docs/guides/training.md, section "The training loop".
Implementation behind the public module :mod:`attnjax.train`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from attnjax._src import data as data_lib
from attnjax._src import nn as nn_lib
from attnjax._src import stats as stats_lib
from attnjax._src.stats import to_jsonable
from attnjax._src.train import config as config_lib
from attnjax._src.train import metrics as run_metrics
from attnjax._src.train import mesh as mesh_lib
from attnjax._src.train import mfu, optim, rundir
from attnjax._src.train.model import build_model, count_params, flops_per_token
from attnjax._src.train.prefetch import Prefetch
from attnjax._src.train.step import make_eval_step, make_train_step

LN2 = math.log(2.0)


def init_distributed() -> None:
  """``jax.distributed.initialize`` when the environment names a coordinator; call it first.

  ``JAX_COORDINATOR_ADDRESS`` (``host:port``) with ``JAX_NUM_PROCESSES`` and
  ``JAX_PROCESS_ID`` (as :mod:`attnjax.train.launch` sets them); or, with no address,
  jax's own cluster detection (a SLURM job of several tasks, or ``ATTNJAX_DISTRIBUTED=1``
  on a TPU pod's workers, where jax reads the coordinator from the TPU metadata). CPU
  processes exchange collectives through gloo. Nothing happens on a single process or
  when jax's distributed runtime is already up.

  Raises:
    KeyError: ``JAX_NUM_PROCESSES`` set without ``JAX_PROCESS_ID``.
    RuntimeError: jax could not reach the coordinator (its own error).
  """
  address = os.environ.get("JAX_COORDINATOR_ADDRESS")
  cluster = (
    os.environ.get("ATTNJAX_DISTRIBUTED") == "1"
    or int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1
  )
  if (not address and not cluster) or jax.distributed.is_initialized():
    return
  if not address:
    jax.distributed.initialize()
    return
  kwargs = {}
  if os.environ.get("JAX_NUM_PROCESSES"):
    kwargs = dict(
      num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
      process_id=int(os.environ["JAX_PROCESS_ID"]),
    )
  if os.environ.get("JAX_PLATFORMS", "") == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=address, **kwargs)


def lr_table(schedule: Any, steps: int) -> np.ndarray:
  """The learning rate of steps ``0..steps`` (float32 ``[steps + 1]``), in one jitted call.

  The loop records each step's rate from this table: a call of the schedule per step would
  be a dozen small device computations and a device-to-host read each time.
  """
  return np.asarray(jax.jit(jax.vmap(schedule))(np.arange(steps + 1, dtype=np.int32)))


def _to_host(metrics: list[dict]) -> list[dict]:
  host = mesh_lib.to_host(metrics)
  out = []
  for m in host:
    out.append(
      {k: (float(v) if np.ndim(v) == 0 else [float(x) for x in np.ravel(v)]) for k, v in m.items()}
    )
  return out


class DivergenceWatch:
  """Finds the step where a run diverged: NaN/Inf loss or grad norm at once, or a loss
  above ``factor`` x the initial loss for ``patience`` steps in a row (a transient
  spike that recovers is not a divergence). Uses ``attnjax.train.metrics.is_diverged``.
  """

  def __init__(self, factor: float, patience: int):
    self.factor, self.patience = factor, patience
    self.run_start: Optional[int] = None
    self.run_length = 0
    self.decided_at: Optional[int] = None  # the step whose loss settled the verdict

  def update(self, records: list[dict], initial_loss: float) -> Optional[int]:
    for r in records:
      loss, gnorm = rundir.finite_or_none(r["loss"]), rundir.finite_or_none(r["grad_norm"])
      if loss is None or gnorm is None:
        self.decided_at = r["step"]
        return r["step"]
      if bool(run_metrics.is_diverged(loss, initial_loss, factor=self.factor)):
        if self.run_length == 0:
          self.run_start = r["step"]
        self.run_length += 1
        if self.run_length >= self.patience:
          self.decided_at = r["step"]
          return self.run_start
      else:
        self.run_length = 0
    return None


@dataclasses.dataclass
class _Progress:
  """What :meth:`.Trainer.run` carries from one step boundary to the next, on the host.

  Attributes:
    start: the step the run began (or resumed) at.
    step: the current step boundary (updates done so far).
    metrics_out, probes_out: the JSONL writers (None on hosts that do not write).
    initial_loss: the loss of the first step (NaN until the first flush).
    train_time: seconds spent in training steps, over every resumed attempt.
    watch: the divergence watch.
    bar: the tqdm progress bar, or None.
    status: ``"finished"``, ``"stopped"`` or ``"diverged"`` once the loop ends.
    diverged_step: the step the run diverged at, or None.
    pending, pending_steps: device metrics not yet read, and their steps.
    last_flush: ``time.perf_counter()`` when training time last started counting.
    tokens_per_s: the rate of each flush.
    last_train, last_val, last_probe: the latest record of each kind.
    times: host seconds by part of the loop (``loop_time_s`` of the summary):
      ``batch_wait`` (waiting for the prefetched batch), ``dispatch`` (enqueueing steps),
      ``metrics_wait`` (reading the metrics: mostly the device finishing its queued steps),
      ``record`` (writing them, the divergence watch, the progress bar), ``boundaries``
      (validation, probes, checkpoints).
  """

  start: int
  step: int
  metrics_out: Optional[rundir.JsonlWriter]
  probes_out: Optional[rundir.JsonlWriter]
  initial_loss: float
  train_time: float
  watch: DivergenceWatch
  bar: Any = None
  status: str = "finished"
  diverged_step: Optional[int] = None
  pending: list = dataclasses.field(default_factory=list)
  pending_steps: list = dataclasses.field(default_factory=list)
  last_flush: float = dataclasses.field(default_factory=time.perf_counter)
  tokens_per_s: list = dataclasses.field(default_factory=list)
  last_train: dict = dataclasses.field(default_factory=dict)
  last_val: dict = dataclasses.field(default_factory=dict)
  last_probe: dict = dataclasses.field(default_factory=dict)
  times: dict = dataclasses.field(
    default_factory=lambda: dict.fromkeys(
      ("batch_wait", "dispatch", "metrics_wait", "record", "boundaries"), 0.0
    )
  )

  def close(self) -> None:
    """Closes the progress bar and the writers."""
    if self.bar is not None:
      self.bar.close()
    for w in (self.metrics_out, self.probes_out):
      if w:
        w.close()


class Trainer:
  """One run: builds data, model, optimizer and checkpointer from ``cfg`` and runs them.

  The model is created sharded over the run's mesh (:class:`attnjax.train.mesh.MeshParallel`),
  the optimizer state sharded like the parameters. :meth:`run` trains or resumes;
  :func:`attnjax.train.train` is the usual entry.

  Args:
    cfg: a validated run config with ``run_dir`` set.
    model: ``(graphdef, params, rest)`` of ``cfg``'s model already initialised at
      ``cfg.seed`` on the run's devices (a seed group initialises its seeds in one program:
      :class:`attnjax.train.SeedGroup`); None builds it here.

  Attributes:
    cfg: the config.
    dir: the :class:`~attnjax.train.RunDir`.
    batches: the run's data (:func:`attnjax.data.from_config`).
    state: ``{"params", "opt_state", "step"}``, sharded over the mesh.
    num_params: parameters of the model.
    skipped_checkpoints: checkpoints that did not restore and were set aside.
    compiled_step: the train step :meth:`run` compiled and stepped with (None before it);
      ``experiments/bench.py --suite trainer`` times it alone against the loop.

  Raises:
    ValueError: a config that does not validate, or no ``run_dir``.
  """

  def __init__(self, cfg: Any, *, model: Optional[tuple] = None):
    self.cfg = cfg
    config_lib.validate(cfg, num_devices=jax.device_count())
    if not cfg.run_dir:
      raise ValueError("run_dir must be set (entry points set runs/<experiment>/<arm>)")
    self.dir = rundir.RunDir(cfg.run_dir)
    self.is_writer = jax.process_index() == 0
    self.batches = data_lib.from_config(cfg.data, seed=cfg.seed)
    self.dp = mesh_lib.MeshParallel(cfg)

    vocab = self.batches.model_vocab_size
    with jax.set_mesh(self.dp.mesh):  # created sharded: no device holds the whole model
      if model is None:
        model = self.dp.init_model(lambda: build_model(cfg, vocab, seed=cfg.seed))
      self.graphdef, params, self.rest = model
      self.num_params = count_params(params)
      self.flops_per_token = flops_per_token(cfg, self.num_params)
      self.optimizer = optim.make_optimizer(cfg)
      self.schedule = optim.schedule(cfg)
      self.state = {
        "params": params,
        "opt_state": self.dp.init_optimizer(self.optimizer, params),
        "step": self.dp.replicate(jnp.zeros((), jnp.int32)),
        "initial_loss": self.dp.replicate(jnp.full((), jnp.nan, jnp.float32)),
      }

    step_fn = make_train_step(
      self.graphdef,
      self.optimizer,
      z_loss=cfg.opt.z_loss,
      stats=cfg.train.step_stats,
      microbatches=cfg.train.microbatches,
    )
    self.train_step = jax.jit(self.dp.keep_shardings(step_fn, self.state), donate_argnums=(0,))
    self.skipped_checkpoints: list[dict] = []
    self.compiled_step = None
    self.eval_step = jax.jit(make_eval_step(self.graphdef))
    self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len

  # -- checkpoints ----------------------------------------------------------

  def _manager(self) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
      max_to_keep=self.cfg.train.keep_checkpoints, enable_async_checkpointing=False
    )
    return ocp.CheckpointManager(self.dir.checkpoints, options=options)

  def restore_latest(self) -> int:
    """Loads the run's latest checkpoint into the trainer's state; returns its step.

    Returns 0, the state left as initialised, when the run has no checkpoint.
    """
    manager = self._manager()
    try:
      return self._restore_latest(manager)
    finally:
      manager.close()

  def _restore_latest(self, manager: ocp.CheckpointManager) -> int:
    """Restores the newest checkpoint that restores. One that fails (its files truncated or
    missing) is named on stderr with the error, moved aside to ``checkpoints.damaged/`` (never
    deleted) and recorded in ``skipped_checkpoints``; the next older one is tried."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, self.state)
    for step in sorted(manager.all_steps(), reverse=True):
      try:
        self.state = manager.restore(step, args=ocp.args.StandardRestore(abstract))
        if self.skipped_checkpoints:
          skipped = ", ".join(str(c["step"]) for c in self.skipped_checkpoints)
          print(
            f"{self.cfg.run_dir}: resumed from checkpoint {step} (skipped damaged "
            f"checkpoint {skipped})",
            file=sys.stderr,
            flush=True,
          )
        return int(step)
      except Exception as e:  # any failure to read a checkpoint: try the previous
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}" if str(e) else repr(e)
        moved = self._set_aside(manager, int(step))
        self.skipped_checkpoints.append({"step": int(step), "error": reason, "moved_to": moved})
        print(
          f"{self.cfg.run_dir}: checkpoint {step} does not restore ({reason}); moved to "
          f"{moved}, trying the one before it",
          file=sys.stderr,
          flush=True,
        )
    return 0

  def _set_aside(self, manager: ocp.CheckpointManager, step: int) -> str:
    """Moves a damaged checkpoint out of the manager's directory; returns where it went."""
    src = os.path.join(self.dir.checkpoints, str(step))
    dst = os.path.join(
      self.dir.root, "checkpoints.damaged", f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    if self.is_writer and os.path.exists(src):
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      shutil.move(src, dst)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      multihost_utils.sync_global_devices(f"attnjax set aside checkpoint {step}")
    manager.reload()
    return dst

  # -- evaluation -----------------------------------------------------------

  def model(self) -> nnx.Module:
    """The model with the current parameters (an ``attnjax.nn.TransformerLM``)."""
    return nnx.merge(self.graphdef, self.state["params"], self.rest)

  def evaluate(self, step: int) -> dict:
    """Validation loss over ``train.eval_batches`` batches.

    Args:
      step: the training step the record is labelled with.

    Returns:
      ``{"kind": "val", "step", "val_loss", "val_bpc", "unit"}`` (loss in nats per token,
      bits per character or byte).
    """
    ce, count = 0.0, 0.0
    for i in range(self.cfg.train.eval_batches):
      b = self.batches.batch("val", i)
      out = self.eval_step(self.state["params"], self.rest, *self.dp.batch_args(b))
      out = mesh_lib.to_host(out)
      ce += float(out["ce_sum"])
      count += float(out["count"])
    loss = ce / max(count, 1.0)
    return {
      "kind": "val",
      "step": step,
      "val_loss": loss,
      "val_bpc": loss / LN2,
      "unit": self.batches.unit,
    }

  def probe(self, step: int) -> dict:
    """Every sink and stability statistic of the model on the fixed probe batch.

    Args:
      step: the training step the record is labelled with.

    Returns:
      ``{"step", ...}`` with the flat keys of :func:`attnjax.nn.layer_stats`, JSON-ready.
    """
    t = self.cfg.train
    b = self.batches.batch("probe", 0, seq_len=t.probe_len, batch_size=t.probe_batch)
    out = nn_lib.layer_stats(self.model(), self.dp.put_batch(b.inputs))
    record = to_jsonable(mesh_lib.to_host(out))
    if isinstance(self.batches, data_lib.MaskedLMBatches):
      record.update(self.encoder_probe(b))
    return {"step": step, **record}

  def encoder_probe(self, b) -> dict:
    """An encoder's outlier statistics, W8A8 loss and mass on [CLS] and delimiters.

    On the probe batch (masked as in training): per layer the outliers of the attention
    output, MLP output and residual stream (``attnjax.nn.outlier_stats``), the masked-LM loss
    in float and with W8A8 fake quantisation, and per layer and head the attention mass on
    the first token (``[CLS]``, the BOS) and on the delimiters (``.``, ``,``, newline).
    """
    model = self.model()
    inputs, targets = self.dp.put_batch(b.inputs), self.dp.put_batch(b.targets)
    scored = np.where(b.weights > 0, b.targets, -1)
    delimiters = encoder_delimiters(self.batches)
    out = nn_lib.outlier_stats(
      model, inputs, targets=self.dp.put_batch(scored), delimiter_ids=delimiters
    )
    del targets
    sown = nn_lib.layer_stats(model, inputs, view="sown", weights=True)
    weights = jnp.stack([layer["weights"] for layer in sown["layers"]])
    record = {
      "outliers/loss": out["loss"],
      "outliers/loss_w8a8": out["loss_w8a8"],
      "token_mass/cls": jnp.mean(
        stats_lib.token_mass(weights, inputs, (self.batches.bos_id,)), axis=1
      ),
      "token_mass/delimiters": jnp.mean(
        stats_lib.token_mass(weights, inputs, delimiters or (-1,)), axis=1
      ),
    }
    for position in ("attn_out", "mlp_out", "hidden"):
      if position in out:
        for field, value in out[position]._asdict().items():
          record[f"outliers/{position}/{field}"] = value
    return to_jsonable(mesh_lib.to_host(record))

  # -- the loop -------------------------------------------------------------

  def run(self) -> dict:
    """Trains (or resumes) the run to ``train.steps``, or until it diverges.

    The run's mesh is the ambient mesh throughout, so attention dispatch puts platform
    kernels inside ``shard_map`` over it. Metrics, probes, checkpoints and the summary go
    to the run directory.

    Returns:
      The summary (also written as ``summary.json``): ``status`` (``"finished"`` or
      ``"diverged"``), the final losses, step, timings and the run's statistics.

    Raises:
      ValueError: the run directory holds a run whose config differs in a key that
        changes what it computes (each key named with both values).
    """
    self.lrs = lr_table(self.schedule, self.cfg.train.steps)
    with jax.set_mesh(self.dp.mesh):
      return self._run()

  def _run(self) -> dict:
    changed = check_config(self.dir, self.cfg)
    if changed:
      print(
        f"{self.cfg.run_dir}: resuming with {', '.join(changed)} changed (keys that do not "
        f"change what the run computes)",
        file=sys.stderr,
        flush=True,
      )
    if self.is_writer:
      rundir.write_json(self.dir.config, self.cfg.to_dict())
    manager = self._manager()
    start = self._restore_latest(manager)
    summary, previous = self._begin(start)
    compiled, compile_s = self._compile(start)
    self.compiled_step = compiled
    progress = self._progress(start, previous)
    try:
      self._loop(compiled, manager, progress)
    finally:
      progress.close()
      manager.close()
    return self._end(summary, progress, compile_s)

  def _begin(self, start: int) -> tuple[dict, dict]:
    """Drops the JSONL lines of steps ``>= start`` and writes the "running" summary.

    Returns ``(summary, previous)``: the new summary and the one a previous
    attempt left (``{}`` if none).
    """
    if self.is_writer:
      rundir.truncate_jsonl(self.dir.metrics, start)
      rundir.truncate_jsonl(self.dir.probes, start)
    previous = self.dir.read_summary() or {}
    summary = {
      "status": "running",
      "variant": self.cfg.variant,
      "run_dir": self.cfg.run_dir,
      "num_params": self.num_params,
      "flops_per_token": self.flops_per_token,
      "devices": int(self.dp.mesh.devices.size),
      "resumed_from": start,
    }
    if self.skipped_checkpoints:
      summary["skipped_checkpoints"] = self.skipped_checkpoints
    if self.is_writer:
      rundir.write_json(self.dir.summary, summary)
    return summary, previous

  def _compile(self, start: int):
    """``(compiled train step, seconds it took)``, compiled for the batch of step ``start``."""
    t0 = time.perf_counter()
    b = self.batches.batch("train", start)
    compiled = self.train_step.lower(self.state, self.rest, *self.dp.batch_args(b)).compile()
    return compiled, time.perf_counter() - t0

  def _progress(self, start: int, previous: dict, *, bar: bool = True) -> _Progress:
    """The host-side state of a run starting at ``start``: writers, bar, divergence watch.

    ``bar=False`` leaves the progress bar out (a seed group draws one for all its seeds).
    """
    t = self.cfg.train
    progress = _Progress(
      start=start,
      step=start,
      metrics_out=rundir.JsonlWriter(self.dir.metrics) if self.is_writer else None,
      probes_out=rundir.JsonlWriter(self.dir.probes) if self.is_writer else None,
      initial_loss=float(mesh_lib.to_host(self.state["initial_loss"])),
      train_time=float(previous.get("train_time_s", 0.0)) if start > 0 else 0.0,
      watch=DivergenceWatch(t.divergence_factor, t.divergence_patience),
    )
    if bar and t.progress and self.is_writer:
      from tqdm.auto import tqdm

      progress.bar = tqdm(
        total=t.steps, initial=start, desc=f"{self.cfg.variant}", leave=False, mininterval=1.0
      )
    if start > 0:  # a streak of high losses may span the checkpoint: replay it
      progress.watch.update(
        [r for r in rundir.read_jsonl(self.dir.metrics) if r.get("kind") == "train"],
        progress.initial_loss,
      )
    return progress

  def _loop(self, compiled, manager: ocp.CheckpointManager, p: _Progress) -> None:
    """Steps until ``train.steps``, ``train.stop_after`` or a divergence (``p.status`` says).

    Between two reads of the metrics (every ``log_every`` steps, one step behind the
    device, and of every pending step at boundaries) the host only takes a prefetched batch
    and enqueues the step: nothing waits for the device.
    """
    t = self.cfg.train
    end = t.stop_after if t.stop_after and p.start <= t.stop_after < t.steps else t.steps
    batches = Prefetch(lambda s: self.dp.batch_args(self.batches.batch("train", s)), p.start, end)
    try:
      while True:
        boundary = self._boundary(p.step, p.start)
        if (boundary or p.step == t.stop_after) and self._diverged(p):
          return
        self._at_boundary(boundary, manager, p)
        if p.step == t.steps:
          return
        if t.stop_after and p.step == t.stop_after:
          p.status = "stopped"
          return
        t0 = time.perf_counter()
        args = batches.get(p.step)
        t1 = time.perf_counter()
        self.state, m = compiled(self.state, self.rest, *args)
        p.times["batch_wait"] += t1 - t0
        p.times["dispatch"] += time.perf_counter() - t1
        p.pending.append(m)
        p.pending_steps.append(p.step)
        p.step += 1
        # Read the oldest log_every steps while the newest one runs: the device is not left
        # idle while the host writes them (a divergence is seen at most log_every steps late).
        if len(p.pending) > t.log_every and self._diverged(p, keep=1):
          return
    finally:
      batches.close()

  def _boundary(self, step: int, start: int) -> list[str]:
    """What is due at step boundary ``step``: ``"eval"``, ``"probe"``, ``"ckpt"``."""
    t = self.cfg.train
    due = []
    if step % t.eval_every == 0 or step == t.steps:
      due.append("eval")
    if step % t.probe_every == 0 or step == t.steps:
      due.append("probe")
    if t.checkpoint_every and step % t.checkpoint_every == 0 and step > start:
      due.append("ckpt")
    return due

  def _at_boundary(self, due: list[str], manager: ocp.CheckpointManager, p: _Progress) -> None:
    """Validation, probe and checkpoint of step ``p.step``, as ``due`` lists."""
    t0 = time.perf_counter()
    if "eval" in due:
      p.last_val = self.evaluate(p.step)
      if p.metrics_out:
        p.metrics_out.write([p.last_val])
    if "probe" in due:
      p.last_probe = self.probe(p.step)
      if p.probes_out:
        p.probes_out.write([p.last_probe])
    if "ckpt" in due:
      manager.save(p.step, args=ocp.args.StandardSave(self.state))
      manager.wait_until_finished()
    if due:  # tokens/s and train_time_s count training steps only
      p.last_flush = time.perf_counter()
      p.times["boundaries"] += p.last_flush - t0

  def _diverged(self, p: _Progress, keep: int = 0) -> bool:
    """Flushes the pending metrics but the newest ``keep``; on a divergence marks ``p``
    diverged and returns True."""
    p.diverged_step = self._flush(p, keep)
    if p.diverged_step is None:
      return False
    p.status = "diverged"
    return True

  def _flush(self, p: _Progress, keep: int = 0) -> Optional[int]:
    """Reads the pending device metrics but the newest ``keep``, writes them, returns the
    divergence step if any."""
    n = len(p.pending) - keep
    if n <= 0:
      return None
    steps = p.pending_steps[:n]
    t0 = time.perf_counter()
    records = _to_host(p.pending[:n])
    p.pending, p.pending_steps = p.pending[n:], p.pending_steps[n:]
    now = time.perf_counter()
    p.times["metrics_wait"] += now - t0
    return self._record(p, steps, records, now)

  def _record(
    self, p: _Progress, steps: list[int], records: list[dict], now: float
  ) -> Optional[int]:
    """Writes the host ``records`` of ``steps`` (read at ``now``), updates the divergence watch
    and the bar; returns the divergence step if any. A seed group reads its stacked metrics
    once and hands each seed's share to that seed's trainer here."""
    elapsed = now - p.last_flush
    p.train_time += elapsed
    p.last_flush = now
    rate = self.tokens_per_step * len(records) / max(elapsed, 1e-9)
    p.tokens_per_s.append(rate)
    for step, r in zip(steps, records):
      r.update(kind="train", step=step, lr=float(self.lrs[step]), tokens_per_s=rate)
    if not math.isfinite(p.initial_loss):
      p.initial_loss = records[0]["loss"]
      self.state["initial_loss"] = self.dp.replicate(np.float32(p.initial_loss))
    bad = p.watch.update(records, p.initial_loss)
    if bad is not None:
      records = [r for r in records if r["step"] <= p.watch.decided_at]
    if p.metrics_out:
      p.metrics_out.write(records)
    p.last_train = records[-1]
    if p.bar is not None:
      p.bar.update(len(records))
      p.bar.set_postfix(loss=f"{p.last_train['loss']:.3f}")
    p.times["record"] += time.perf_counter() - now
    return bad

  def _end(self, summary: dict, p: _Progress, compile_s: float) -> dict:
    """Completes ``summary`` with the outcome and final numbers, writes it (and the plots)."""
    t = self.cfg.train
    summary.update(
      status=p.status,
      steps_done=p.step if p.status != "diverged" else p.diverged_step,
      diverged_step=p.diverged_step,
      initial_loss=p.initial_loss,
      compile_s=compile_s,
      train_time_s=p.train_time,
      tokens_per_s=float(np.median(p.tokens_per_s[1:] or p.tokens_per_s or [float("nan")])),
    )
    summary.update(
      mfu.utilisation(
        self.flops_per_token, summary["tokens_per_s"], list(self.dp.mesh.devices.flat)
      )
    )
    summary["loop_time_s"] = dict(p.times)
    summary.update(final_metrics(self.dir, p.last_train, p.last_val, p.last_probe, p.status))
    if self.is_writer:
      rundir.write_json(self.dir.summary, summary)
      if t.plots and p.status != "stopped":
        from attnjax._src.train.plots import plot_run

        plot_run(self.dir)
    return summary


def encoder_delimiters(batches) -> tuple[int, ...]:
  """The ids of ``.``, ``,`` and the newline in a corpus's tokenizer (those it has)."""
  data = getattr(batches, "data", None)
  tok = getattr(data, "tokenizer", None)
  if tok is None:
    return ()
  ids = []
  for text in (".", ",", "\n"):
    enc = np.asarray(tok.encode(text))
    if enc.shape == (1,) and not (hasattr(tok, "UNK") and int(enc[0]) == tok.UNK):
      ids.append(int(enc[0]))
  return tuple(ids)


def final_metrics(
  run: rundir.RunDir, last_train: dict, last_val: dict, last_probe: dict, status: str
) -> dict:
  """The numbers a report row shows, from the run's files (so a resumed run reads them too)."""
  records = [r for r in rundir.read_jsonl(run.metrics) if r.get("kind") == "train"]
  vals = [r for r in rundir.read_jsonl(run.metrics) if r.get("kind") == "val"]
  probes = rundir.read_jsonl(run.probes)
  out: dict = {}
  if records:
    losses = [rundir.finite_or_none(r["loss"]) for r in records]
    tail_losses = [v for v in losses[-10:] if v is not None]
    out["final_train_loss"] = float(np.mean(tail_losses)) if tail_losses else None
    last = records[-1]
    for key in ("max_logit", "entropy", "entropy_min", "f_attn"):
      if key in last:
        values = [v for v in map(rundir.finite_or_none, last[key]) if v is not None]
        if values:
          out[key] = float(
            max(values)
            if key == "max_logit"
            else min(values)
            if key == "entropy_min"
            else np.mean(values)
          )
    ever = [
      v
      for r in records
      for v in map(rundir.finite_or_none, r.get("max_logit") or [])
      if v is not None
    ]
    out["max_logit_ever"] = float(max(ever)) if ever else None
    out["log_z"] = last.get("log_z")
    out["spike_score"] = run_metrics.loss_spike_score(losses)
  if vals:
    out["val_loss"] = vals[-1]["val_loss"] if status != "diverged" else None
    out["val_bpc"] = vals[-1]["val_bpc"] if status != "diverged" else None
    out["unit"] = vals[-1].get("unit")
  if probes:
    out["probe"] = {k: v for k, v in probes[-1].items() if np.ndim(v) == 0}
  return out


# Config keys that may differ when a run directory is resumed or rerun: where the run is and how
# often it logs, evaluates, probes and checkpoints, and on how many devices and which mesh it
# runs (the same step up to the order of floating-point reductions; a checkpoint is resharded
# onto the new mesh when restored). Every other key changes
# what the run computes; ``train.steps`` too (the learning-rate schedule decays over it, so the
# first steps of a longer run differ: a longer run is a new run).
RESUMABLE_KEYS = (
  "run_dir",
  "train.log_every",
  "train.eval_every",
  "train.probe_every",
  "train.checkpoint_every",
  "train.keep_checkpoints",
  "train.progress",
  "train.stop_after",
  "train.num_devices",
  "train.plots",
  "mesh.data",
  "mesh.fsdp",
  "mesh.tensor",
  "mesh.context",
)


def _flat(tree: Any, prefix: str = "") -> dict:
  if isinstance(tree, dict):
    out = {}
    for key, value in tree.items():
      out.update(_flat(value, f"{prefix}{key}."))
    return out
  return {prefix[:-1]: tree}


def config_changes(old: dict, new: dict) -> dict:
  """``{dotted key: (old value, new value)}`` of two configs (as ``config.json`` holds them)."""
  a = _flat(old)
  b = _flat(json.loads(rundir.dumps(new)))
  return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def check_config(run: rundir.RunDir, cfg: Any) -> list[str]:
  """The keys of ``cfg`` that differ from the run directory's ``config.json`` (none if it has
  none); ValueError naming every key outside ``RESUMABLE_KEYS`` that differs, with both
  values."""
  old = rundir.read_json(run.config)
  if old is None:
    return []
  changes = config_changes(old, cfg.to_dict())
  fixed = {k: v for k, v in changes.items() if k not in RESUMABLE_KEYS}
  if fixed:
    listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in fixed.items())
    raise ValueError(
      f"{run.root} holds a run with another config ({listed}). These keys change what the "
      f"run computes (train.steps sets the length of the learning-rate schedule, so a "
      f"longer run is a new run, not an extension): use a new run directory, or the run's "
      f"own values (its config.json). Keys that may change on resume: " + ", ".join(RESUMABLE_KEYS)
    )
  return sorted(changes)


def train(cfg: Any) -> dict:
  """Runs (or resumes, or returns the summary of, if already ended) the run ``cfg`` describes.

  Args:
    cfg: a run config (:func:`attnjax.train.load_config`) with ``run_dir`` set.

  Returns:
    The run's summary (``summary.json``) as a dict.

  Raises:
    ValueError: an invalid config, or a run directory whose run differs in a key that
      changes what it computes (``opt.lr``, ``train.steps``, ...: each named with both
      values); logging, evaluation, checkpoint cadence and the mesh may change.
  """
  run = rundir.RunDir(cfg.run_dir)
  if run.is_done():
    changed = check_config(run, cfg)
    if changed:
      print(
        f"{cfg.run_dir}: the run has ended; {', '.join(changed)} changed, which an ended "
        f"run does not use (its summary is returned)",
        file=sys.stderr,
        flush=True,
      )
    return run.read_summary()
  return Trainer(cfg).run()
