"""Batches built and placed on the devices ahead of the training loop, in a background thread.

    batches = Prefetch(lambda step: dp.batch_args(data.batch("train", step)), start, stop)
    args = batches.get(step)     # steps start, start + 1, ... in order
    batches.close()

A batch is a pure function of its step, so building it early changes nothing
the run computes: :meth:`Prefetch.get` returns exactly what ``make(step)``
returns, in step order. What it saves is the host's time: the numpy work of a
batch and its host-to-device copy overlap the device's steps (and the host's
own reads of metrics) instead of sitting between two steps.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from attnjax._src import validators

_POLL_S = 0.05  # how often a full queue's producer looks for close()


class Prefetch:
  """``make(step)`` for ``step`` in ``[start, stop)``, computed ``depth`` steps ahead.

  Args:
    make: the step's batch on the devices (``step -> any``); called in a daemon thread.
    start: the first step.
    stop: one past the last step.
    depth: how many batches may wait ready (each holds device memory); >= 1.

  Raises:
    TypeError, ValueError: ``depth`` not an int, or below 1.
  """

  def __init__(self, make: Callable[[int], Any], start: int, stop: int, depth: int = 2):
    validators.check_positive_int("depth", depth)
    self.next_step = start
    self.stop = stop
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._closed = threading.Event()
    self._thread = threading.Thread(
      target=self._produce, args=(make, start, stop), name="attnjax-prefetch", daemon=True
    )
    self._thread.start()

  def _produce(self, make: Callable[[int], Any], start: int, stop: int) -> None:
    for step in range(start, stop):
      try:
        item = (step, make(step), None)
      except BaseException as e:  # every error is handed to get(), which raises it
        item = (step, None, e)
      while not self._closed.is_set():
        try:
          self._queue.put(item, timeout=_POLL_S)
          break
        except queue.Full:
          continue
      if item[2] is not None or self._closed.is_set():
        return

  def get(self, step: int) -> Any:
    """The batch of ``step``, which must be the next one.

    Raises:
      ValueError: ``step`` is not the next step, or is past ``stop``.
      Exception: whatever ``make(step)`` raised, re-raised here.
    """
    if step != self.next_step or step >= self.stop:
      raise ValueError(
        f"Prefetch.get({step}): the next batch is step {self.next_step} "
        f"(steps end before {self.stop})"
      )
    got, value, error = self._queue.get()
    if error is not None:
      raise error
    assert got == step, (got, step)
    self.next_step += 1
    return value

  def close(self) -> None:
    """Stops the thread and drops the batches it built ahead."""
    self._closed.set()
    self._drain()
    self._thread.join()
    self._drain()  # one it put while closing

  def _drain(self) -> None:
    while True:
      try:
        self._queue.get_nowait()
      except queue.Empty:
        return
