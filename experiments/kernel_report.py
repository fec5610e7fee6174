"""The deviceless kernel report: what ptxas made of each Mosaic GPU kernel, for an H200.

  python experiments/kernel_report.py [--normalizers softmax,sigmoid] [--tokamax] [--out F.md]

Compiles attnjax's ``mosaic_gpu`` forward, dq and dk/dv kernels (bf16, causal, head dim 128) for
an H200 from this host (``attnjax.targets``; the ``kernel-report`` extra: jax's CUDA plugin and
``nvidia-cuda-nvdisasm``) with jax's Mosaic GPU dump switches, and prints per kernel: threads,
registers, spills, shared memory, the hot loop's SASS per tile per warp, its matmul units and
the order of its barriers, exponentials and wgmma issues. With tokamax importable (Python 3.12+)
it prints the same for tokamax's sm90 kernels. Guide: docs/guides/kernels.md, "Kernel report".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import os
import re
import shutil
import sys
import tempfile
import threading

# --------------------------------------------------------------------------------------------
# SASS: instructions, loops, the hot loop and its events (pure text; tests/test_kernel_report.py)

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*?`?\(?(\.L_x_\d+)\)?")
_FUNCTION = re.compile(r"^\s*\.text\.(\S+?):\s*$")


@dataclasses.dataclass(frozen=True)
class Instr:
  """One SASS instruction: ``opcode`` without its predicate, ``text`` the whole line."""

  opcode: str
  text: str


def split_functions(sass: str) -> list[tuple[str, list[str]]]:
  """nvdisasm output (one or more cubins) -> ``[(function name, its lines)]`` in order."""
  out: list[tuple[str, list[str]]] = []
  for line in sass.splitlines():
    m = _FUNCTION.match(line)
    if m:
      out.append((m.group(1), []))
    elif out:
      out[-1][1].append(line)
  return out


def parse(lines: list[str]) -> tuple[list[Instr], dict[str, int]]:
  """A function's instructions and the instruction index each label points at."""
  instrs: list[Instr] = []
  labels: dict[str, int] = {}
  for line in lines:
    lm = _LABEL.match(line.strip())
    if lm:
      labels[lm.group(1)] = len(instrs)
      continue
    m = _INSTR.match(line)
    if m:
      body = m.group(2).strip()
      op = body.split()[0] if not body.startswith("@") else body.split()[1]
      instrs.append(Instr(op, body))
  return instrs, labels


def loops(instrs: list[Instr], labels: dict[str, int]) -> list[tuple[int, int]]:
  """``[start, end]`` instruction ranges closed by a backward branch (``end`` the branch).

  ptxas puts out-of-line blocks (an mbarrier wait's retry) after the function's last EXIT and
  branches from them back into the code: those branches close no loop (taken for one, they
  would span every tile loop between their target and the end)."""
  last_exit = max((i for i, ins in enumerate(instrs) if ins.opcode == "EXIT"), default=len(instrs))
  found = []
  for i, ins in enumerate(instrs[: last_exit + 1]):
    if ins.opcode.startswith("BRA"):
      m = _BRANCH.search(ins.text)
      if m and m.group(1) in labels and labels[m.group(1)] <= i:
        found.append((labels[m.group(1)], i))
  return found


def hot_loop(instrs, labels) -> tuple[int, int] | None:
  """A tile's step: a loop holding wgmma issues (HGMMA) and a whole tile's exponentials
  (MUFU.EX2, at least half of the most any candidate holds) that holds no smaller such loop;
  of those, the shortest (the unmasked interior's step, where masked edge steps have loops
  of their own)."""
  candidates = []
  for lo, hi in loops(instrs, labels):
    body = instrs[lo : hi + 1]
    ex2 = sum(1 for x in body if x.opcode == "MUFU.EX2")
    if ex2 and any(x.opcode.startswith("HGMMA") for x in body):
      candidates.append((lo, hi, ex2))
  if not candidates:
    return None
  most = max(e for _, _, e in candidates)
  whole = [(lo, hi, e) for lo, hi, e in candidates if 2 * e >= most]
  inner = [
    (lo, hi)
    for lo, hi, _ in whole
    if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b, _ in whole)
  ]
  return min(inner, key=lambda span: span[1] - span[0])


def _barrier_id(text: str) -> str:
  """A named barrier's id (its first operand), or ``wg`` for one held in a register (Mosaic
  GPU's warpgroup barrier: 1 + the warpgroup's index)."""
  m = re.search(r"BAR\.[A-Z_.]+\s+([^,\s]+)", text)
  if m is None:
    return ""
  return str(int(m.group(1), 0)) if re.fullmatch(r"0x[0-9a-f]+|\d+", m.group(1)) else "wg"


def events(body: list[Instr]) -> list[tuple[int, str]]:
  """The hot loop's order: wgmma groups (``mma<k>`` from their first to their committing
  HGMMA), wgmma waits, exponentials (first..last of each run), named-barrier arrives / syncs
  (``bar.arv<id>``, ``bar.sync<id>``) and mbarrier arrives / waits, by instruction index."""
  out: list[tuple[int, str]] = []
  group_start = None
  groups = 0
  ex2_run: list[int] = []

  def close_ex2():
    if ex2_run:
      out.append((ex2_run[0], f"ex2x{len(ex2_run)}@{ex2_run[0]}-{ex2_run[-1]}"))
      ex2_run.clear()

  for i, ins in enumerate(body):
    op = ins.opcode
    if op == "MUFU.EX2":
      ex2_run.append(i)
      continue
    if op.startswith("HGMMA"):
      if group_start is None:
        group_start = i
      if "gsb0" in ins.text:
        close_ex2()
        out.append((group_start, f"mma{groups}@{group_start}-{i}"))
        groups += 1
        group_start = None
      continue
    if op.startswith(("FMUL", "FFMA", "FADD", "FMNMX", "F2FP", "FSEL", "FSETP")):
      continue  # arithmetic between the exponentials keeps their run open
    close_ex2()
    if op.startswith("WARPGROUP.DEPBAR"):
      out.append((i, f"wait@{i}"))
    elif op.startswith("BAR.ARV"):
      out.append((i, f"bar.arv{_barrier_id(ins.text)}@{i}"))
    elif op.startswith("BAR.SYNC") or op.startswith("BAR.RED"):
      out.append((i, f"bar.sync{_barrier_id(ins.text)}@{i}"))
    elif op.startswith("SYNCS.ARRIVE"):
      out.append((i, f"mbar.arrive@{i}"))
    elif op.startswith("SYNCS.PHASECHK"):
      out.append((i, f"mbar.wait@{i}"))
  close_ex2()
  return sorted(out)


@dataclasses.dataclass
class LoopStats:
  instructions: int
  fmul: int
  ffma: int
  ex2: int
  hgmma: int
  units: int
  order: list[tuple[int, str]]
  register_lhs_units: int = 0  # committed wgmma groups whose lhs is a register tile

  @property
  def arrive_after_last_ex2(self) -> bool | None:
    """Whether each turn's named-barrier sync (the schedule barrier before ``W V``) comes
    after that turn's last exponential; None without named barriers or exponentials."""
    ex2_end = [int(name.split("-")[-1]) for _, name in self.order if name.startswith("ex2")]
    syncs = [i for i, name in self.order if name.startswith("bar.sync")]
    if not ex2_end or not syncs:
      return None
    last = max(ex2_end)
    return any(s > last for s in syncs)


def loop_stats(instrs, labels) -> LoopStats | None:
  span = hot_loop(instrs, labels)
  if span is None:
    return None
  body = instrs[span[0] : span[1] + 1]
  count = lambda p: sum(1 for x in body if x.opcode.startswith(p))
  committing = [x for x in body if x.opcode.startswith("HGMMA") and "gsb0" in x.text]
  return LoopStats(
    instructions=len(body),
    fmul=count("FMUL"),
    ffma=count("FFMA"),
    ex2=count("MUFU.EX2"),
    hgmma=count("HGMMA"),
    units=sum(1 for x in body if x.opcode.startswith("HGMMA") and "gsb0" in x.text),
    order=events(body),
    register_lhs_units=sum(1 for x in committing if _REGISTER_LHS.match(x.text)),
  )


# ``HGMMA.<shape> Rd, Ra, gdesc[...]``: the lhs a register tile (``gdesc`` first: shared memory).
_REGISTER_LHS = re.compile(r"^(?:@!?U?P\w+\s+)?HGMMA\S*\s+R\d+,\s*R\d+,")


def backward_kind(loop: LoopStats | None) -> str | None:
  """An unnamed backward kernel's kind from its hot loop: the dk/dv kernel's tile ends in two
  products with a register lhs (``dV += W^T dO``, ``dK += dS^T Q``), the dq kernel's in one
  (``dQ += dS K``). tokamax 0.0.17 names neither kernel, and the order ptxas's dumps come in
  is not the order they were lowered in (dq first)."""
  if loop is None:
    return None
  return {1: "dq", 2: "dkv"}.get(loop.register_lhs_units)


# --------------------------------------------------------------------------------------------
# ptxas's report

_PTXAS_FN = re.compile(r"Function properties for (\S+)")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?")


def parse_ptxas(text: str) -> list[tuple[str, dict]]:
  """``[(function, {registers, barriers, spill_stores, spill_loads, notes})]`` of ptxas -v, in
  order (a note such as C7511, wgmmas serialised for lack of registers, precedes its function's
  properties)."""
  out: list[tuple[str, dict]] = []
  current = None
  notes: list[str] = []
  for line in text.splitlines():
    m = _PTXAS_FN.search(line)
    if m:
      current = dict(registers=None, barriers=None, spill_stores=0, spill_loads=0, notes=notes)
      out.append((m.group(1), current))
      notes = []
      continue
    if "(C75" in line:
      notes.append(re.search(r"\((C75\d\d)\)", line).group(1))
    if current is None or "warning" in line:  # a spill warning precedes its function's lines
      continue
    m = _PTXAS_SPILL.search(line)
    if m:
      current["spill_stores"], current["spill_loads"] = int(m[1]), int(m[2])
    m = _PTXAS_USED.search(line)
    if m:
      current["registers"] = int(m[1])
      current["barriers"] = int(m[2]) if m[2] else None
  return out


# --------------------------------------------------------------------------------------------
# Compiling with the dumps on


def nvdisasm_root() -> str:
  """A CUDA root whose ``bin/nvdisasm`` is the PyPI one (``nvidia-cuda-nvdisasm``) or one on
  PATH: Mosaic GPU runs ``$MOSAIC_GPU_CUDA_ROOT/bin/nvdisasm`` for its SASS dump."""
  found = shutil.which("nvdisasm")
  if found is None:
    try:
      import nvidia.cu13 as cu13  # nvidia-cuda-nvdisasm >= 13

      for folder in cu13.__path__:  # a namespace package
        candidate = os.path.join(folder, "bin", "nvdisasm")
        found = candidate if os.path.exists(candidate) else found
    except ImportError:
      found = None
  if found is None:
    raise SystemExit(
      "kernel_report needs nvdisasm: pip install 'attnjax[kernel-report]' (nvidia-cuda-nvdisasm)"
    )
  root = tempfile.mkdtemp(prefix="attnjax-cuda-root-")
  os.makedirs(os.path.join(root, "bin"))
  os.symlink(found, os.path.join(root, "bin", "nvdisasm"))
  return root


_launches = threading.local()


@contextlib.contextmanager
def record_launches(record: dict):
  """Records each Mosaic GPU kernel's threads and dynamic shared memory as jax lowers it
  (``record[kernel name] = [(threads, bytes), ...]``), by wrapping two private functions of jax's
  Mosaic GPU core; where they are missing the figures print as '?'. Several kernels of one
  name are recorded in the order they are lowered."""
  try:
    from jax.experimental.mosaic.gpu import core
  except ImportError:
    yield
    return
  lower, launch, size = (
    getattr(core, n, None) for n in ("_lower_as_gpu_kernel", "_launch", "_smem_tree_size")
  )
  if lower is None or launch is None or size is None:
    yield
    return
  lower_sig = inspect.signature(lower)

  def lower_spy(*args, **kwargs):
    bound = lower_sig.bind_partial(*args, **kwargs)
    _launches.name = bound.arguments.get("kernel_name")
    return lower(*args, **kwargs)

  def launch_spy(token, grid, cluster, block, smem_buffers, *args, **kwargs):
    name = getattr(_launches, "name", None)
    if name is not None:
      record.setdefault(name, []).append((block[0] * block[1] * block[2], size(smem_buffers)))
    return launch(token, grid, cluster, block, smem_buffers, *args, **kwargs)

  core._lower_as_gpu_kernel, core._launch = lower_spy, launch_spy
  try:
    yield
  finally:
    core._lower_as_gpu_kernel, core._launch = lower, launch


@contextlib.contextmanager
def captured_stdout(path: str):
  """File descriptor 1 (where Mosaic GPU's C++ dumps go) into ``path``."""
  sys.stdout.flush()
  saved = os.dup(1)
  with open(path, "w") as f:
    os.dup2(f.fileno(), 1)
    try:
      yield
    finally:
      sys.stdout.flush()
      os.dup2(saved, 1)
      os.close(saved)


@dataclasses.dataclass
class KernelFacts:
  name: str
  threads: object
  smem: object
  ptxas: dict
  loop: LoopStats | None


def compile_and_read(compile_fn) -> list[KernelFacts]:
  """Runs ``compile_fn()`` (a deviceless ``.compile()``) with the PTXAS and SASS dumps on and
  returns the facts of each Mosaic GPU kernel in it."""
  import jax

  import jax.experimental.mosaic.gpu.core  # sets MOSAIC_GPU_CUDA_ROOT on import

  os.environ["MOSAIC_GPU_CUDA_ROOT"] = nvdisasm_root()
  os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
  os.environ["MOSAIC_GPU_DUMP_SASS"] = "1"
  jax.config.update("jax_enable_compilation_cache", False)  # a cached program dumps nothing
  launches: dict = {}
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "dump.txt")
    try:
      with record_launches(launches), captured_stdout(path):
        compile_fn()
    finally:
      for key in ("MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_SASS"):
        os.environ.pop(key, None)
    with open(path) as f:
      text = f.read()
  ptxas: dict = {}
  for fn, info in parse_ptxas(text):
    ptxas.setdefault(fn, []).append(info)
  facts = []
  for fn, lines in split_functions(text):
    instrs, labels = parse(lines)
    base = fn.removesuffix("_mosaic_gpu_kernel")
    queue = launches.get(base) or [("?", "?")]
    threads, smem = queue.pop(0) if len(queue) > 1 else queue[0]
    infos = ptxas.get(fn) or [{}]
    info = infos.pop(0) if len(infos) > 1 else infos[0]
    facts.append(KernelFacts(base, threads, smem, info, loop_stats(instrs, labels)))
  return facts


# --------------------------------------------------------------------------------------------
# attnjax's kernels and tokamax's


def attnjax_programs(normalizers, T=4096, N=16, H=128):
  """``{normaliser: compile thunk}``: forward + backward of ``mosaic_gpu`` for an H200."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from attnjax import targets
  from attnjax.kernels import mosaic_gpu

  mesh = targets.mesh(targets.gpu_devices("h200", 1))
  x = jax.ShapeDtypeStruct((1, T, N, H), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

  def thunk(normalizer):
    def loss(q, k, v):
      out = mosaic_gpu.attention(q, k, v, is_causal=True, normalizer=normalizer)
      return jnp.sum(out.astype(jnp.float32) ** 2)

    def compile_():
      with jax.set_mesh(mesh):
        jax.jit(jax.grad(loss, (0, 1, 2))).lower(x, x, x).compile()

    return compile_

  return {n: thunk(n) for n in normalizers}


def tokamax_programs(T=4096, N=16, H=128):
  """``{"tokamax softmax": compile thunk}`` of tokamax's sm90 forward and backward kernels
  (empty where tokamax is not importable)."""
  try:
    from tokamax._src.ops.attention import (
      pallas_mosaic_gpu_kernel_sm90 as fwd,
      pallas_mosaic_gpu_vjp_kernel_sm90 as bwd,
      pallas_mosaic_gpu_vjp_common as bwd_common,
    )
  except ImportError:
    return {}
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from attnjax import targets

  mesh = targets.mesh(targets.gpu_devices("h200", 1))
  rep = NamedSharding(mesh, P())
  x = jax.ShapeDtypeStruct((T, N, H), jnp.bfloat16, sharding=rep)
  rows = jax.ShapeDtypeStruct((N, T), jnp.float32, sharding=rep)
  scale = H**-0.5

  def forward(q, k, v):
    config = fwd.Config(block_q=64, block_kv=128, num_stages=2, persistent=False)
    return fwd.flash_attention_kernel(
      q, k, v, None, None, None, None, is_causal=True, logits_soft_cap=None,
      logits_scale=scale, out_dtype=q.dtype, normalize_output=True, return_residuals=True,
      use_stable_softmax=True, rescale_threshold=1.0, config=config,
    )  # fmt: skip

  def backward(q, k, v, m, l, out, dout):
    config = bwd_common.Config(
      block_q_dq=64, block_kv_dq=64, block_q_dkv=64, block_kv_dkv=64, num_stages=2
    )
    return bwd.flash_attention_vjp_kernel(
      q, k, v, (m, l), out, dout, None, None, None, None, logits_scale=scale,
      logits_soft_cap=None, is_causal=True, ds_dtype=None, config=config,
    )  # fmt: skip

  def compile_():
    with jax.set_mesh(mesh):
      jax.jit(forward).lower(x, x, x).compile()
      jax.jit(backward).lower(x, x, x, rows, rows, x, x).compile()

  return {"tokamax softmax": compile_}


# --------------------------------------------------------------------------------------------
# The table


def _kind(name: str) -> str:
  for key, kind in (
    ("row_dot", "D_i (tiles)"),
    ("dkdv", "dk/dv"),
    ("dkv", "dk/dv"),
    ("dq", "dq"),
    ("forward", "forward"),
    ("flash_attention_sm90", "forward"),
  ):
    if key in name:
      return kind
  return name


def render(rows: list[tuple[str, KernelFacts]]) -> str:
  head = (
    "| kernel | normaliser | threads | registers | spills (B st/ld) | smem (B) | hot loop SASS"
    " / tile / warp | FMUL | FFMA | EX2 | HGMMA | matmul units / tile | notes |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
  )
  lines, orders = [], []
  for label, f in rows:
    p, lp = f.ptxas, f.loop
    spills = f"{p.get('spill_stores', '?')}/{p.get('spill_loads', '?')}"
    loop = (
      ("-",) * 6 if lp is None else (lp.instructions, lp.fmul, lp.ffma, lp.ex2, lp.hgmma, lp.units)
    )
    notes = ", ".join(p.get("notes") or ())
    lines.append(
      f"| {_kind(f.name)} | {label} | {f.threads} | {p.get('registers', '?')} | {spills} | "
      f"{f.smem} | " + " | ".join(str(x) for x in loop) + f" | {notes} |"
    )
    if lp is not None:
      verdict = lp.arrive_after_last_ex2
      tail = "" if verdict is None else f" (turn sync after the last exp2: {verdict})"
      order = " ".join(name for _, name in lp.order)
      orders.append(f"- {_kind(f.name)}, {label}{tail}: {order}")
  return (
    head
    + "\n".join(lines)
    + "\n\nHot-loop order (instruction index in the loop):\n\n"
    + ("\n".join(orders))
  )


def main(argv=None) -> None:
  from attnjax import normalizers as nz

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--normalizers", default=",".join(nz.NORMALIZERS))
  parser.add_argument("--tokamax", action=argparse.BooleanOptionalAction, default=True)
  parser.add_argument("--attnjax", action=argparse.BooleanOptionalAction, default=True)
  parser.add_argument("--out", help="also write the report (markdown) to this file")
  args = parser.parse_args(argv)
  import jax

  rows = []
  programs = {}
  if args.attnjax:
    programs.update(attnjax_programs([n for n in args.normalizers.split(",") if n]))
  if args.tokamax:
    programs.update(tokamax_programs())
  for label, thunk in programs.items():
    print(f"compiling {label} ...", file=sys.stderr, flush=True)
    for facts in compile_and_read(thunk):
      if facts.name == "anonymous":  # tokamax's backward kernels
        facts.name = backward_kind(facts.loop) or facts.name
      rows.append((label, facts))
  text = f"H200 (sm_90a), bf16, causal, head dim 128, T = 4096; jax {jax.__version__}\n\n" + render(
    rows
  )
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
