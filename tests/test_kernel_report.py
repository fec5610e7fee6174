"""experiments/kernel_report.py's reading of SASS and ptxas output (synthetic text; the report
itself compiles for an H200 and needs nvdisasm: run by hand, see docs/guides/kernels.md)."""

import importlib.util
import pathlib
import sys

_path = pathlib.Path(__file__).parents[1] / "experiments" / "kernel_report.py"
_spec = importlib.util.spec_from_file_location("experiments_kernel_report", _path)
report = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = report  # registered: its dataclasses look their module up
_spec.loader.exec_module(report)

# Two tiles' loops (a masked one with a compare, the unmasked one) inside an outer loop, a
# spin wait out of line, named barriers around the exponentials.
SASS = """
//--------------------- .text.attnjax_forward_mosaic_gpu_kernel --------------------------
.text.attnjax_forward_mosaic_gpu_kernel:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*0020*/              @!P0 BRA `(.L_x_9) ;
.L_x_2:
        /*0030*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24, gsb0 ;
        /*0050*/                   BAR.ARV R3, 0x100 ;
        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0070*/                   FFMA R4, R24, 0.5, -R5 ;
        /*0080*/                   MUFU.EX2 R4, R4 ;
        /*0090*/                   FFMA R6, R25, 0.5, -R5 ;
        /*00a0*/                   MUFU.EX2 R6, R6 ;
        /*00b0*/                   BAR.SYNC.DEFER_BLOCKING 0x9, 0x100 ;
        /*00c0*/                   HGMMA.64x128x16.F32.BF16 R40, R4, gdesc[UR16], R40, gsb0 ;
        /*00d0*/                   SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR6], RZ ;
        /*00e0*/              @P1 BRA `(.L_x_2) ;
.L_x_3:
        /*00f0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0100*/                   ISETP.GE.AND P2, PT, R7, R8, PT ;
        /*0100*/                   ISETP.GE.AND P4, PT, R7, R9, PT ;
        /*0100*/                   ISETP.GE.AND P5, PT, R7, R10, PT ;
        /*0100*/                   ISETP.GE.AND P6, PT, R7, R11, PT ;
        /*0100*/                   ISETP.GE.AND P6, PT, R7, R11, PT ;
        /*0100*/                   ISETP.GE.AND P6, PT, R7, R11, PT ;
        /*0110*/                   FSEL R24, R24, -INF , P2 ;
        /*0120*/                   MUFU.EX2 R4, R24 ;
        /*0130*/                   FSEL R25, R25, -INF , P2 ;
        /*0140*/                   MUFU.EX2 R6, R25 ;
        /*0150*/                   HGMMA.64x128x16.F32.BF16 R40, R4, gdesc[UR16], R40, gsb0 ;
        /*0160*/              @P2 BRA `(.L_x_3) ;
        /*0170*/              @P3 BRA `(.L_x_1) ;
        /*0180*/                   EXIT ;
.L_x_9:
        /*0190*/                   BRA `(.L_x_1) ;
"""

PTXAS = """ptxas warning : Registers are spilled to local memory in function 'attnjax_forward_mosaic_gpu_kernel', 1440 bytes spill stores, 1244 bytes spill loads
ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized
ptxas info    : Compiling entry function 'attnjax_forward_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for attnjax_forward_mosaic_gpu_kernel
    536 bytes stack frame, 1440 bytes spill stores, 1244 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 536 bytes cumulative stack size
ptxas info    : Function properties for other_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 2 barriers
ptxas warning : Registers are spilled to local memory in function 'third', 8 bytes spill stores, 8 bytes spill loads
"""


def test_the_hot_loop_is_the_unmasked_tile_step():
  ((name, lines),) = report.split_functions(SASS)
  assert name == "attnjax_forward_mosaic_gpu_kernel"
  instrs, labels = report.parse(lines)
  # two tile loops and the outer one; the spin wait's retry after the EXIT closes no loop
  assert len(report.loops(instrs, labels)) == 3
  lo, hi = report.hot_loop(instrs, labels)
  assert instrs[lo].opcode.startswith("HGMMA") and hi - lo == 11  # 0x30 .. 0xe0
  st = report.loop_stats(instrs, labels)
  assert (st.instructions, st.ffma, st.ex2, st.hgmma, st.units) == (12, 2, 2, 3, 2)
  names = [name for _, name in st.order]
  assert names == [
    "mma0@0-1",
    "bar.arvwg@2",
    "wait@3",
    "ex2x2@5-7",
    "bar.sync9@8",
    "mma1@9-9",
    "mbar.arrive@10",
  ]
  assert st.arrive_after_last_ex2 is True


def test_a_sync_hoisted_above_the_exponentials_is_reported():
  text = SASS.replace(
    "        /*0080*/                   MUFU.EX2 R4, R4 ;",
    "        /*0080*/                   BAR.SYNC.DEFER_BLOCKING 0x9, 0x100 ;",
  ).replace(
    "        /*00b0*/                   BAR.SYNC.DEFER_BLOCKING 0x9, 0x100 ;",
    "        /*00b0*/                   MUFU.EX2 R4, R4 ;",
  )
  ((_, lines),) = report.split_functions(text)
  assert report.loop_stats(*report.parse(lines)).arrive_after_last_ex2 is False


def test_ptxas_report():
  (fwd, info), (other, info2) = report.parse_ptxas(PTXAS)
  assert fwd == "attnjax_forward_mosaic_gpu_kernel" and other == "other_mosaic_gpu_kernel"
  assert (info["registers"], info["barriers"], info["spill_stores"], info["spill_loads"]) == (
    168,
    16,
    1440,
    1244,
  )
  assert info["notes"] == ["C7511"] and info2["notes"] == [] and info2["registers"] == 40
  assert info2["spill_stores"] == 0  # the next function's spill warning is not its


def test_an_unnamed_backward_kernel_is_told_by_its_register_lhs_products():
  # tokamax names neither backward kernel, and ptxas dumps them in no fixed order: the dk/dv
  # tile ends in two products with a register lhs (dV, dK), the dq tile in one (dQ)
  def loop(register_lhs: int) -> str:
    lines = [".L_x_1:", "        /*0000*/                   MUFU.EX2 R4, R4 ;"]
    lines += [
      "        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, gsb0 ;"
    ]
    lines += [
      f"        /*0020*/                   HGMMA.64x128x16.F32.BF16 R{40 + 64 * k}, R4,"
      f" gdesc[UR16].tnspB, R{40 + 64 * k}, gsb0 ;"
      for k in range(register_lhs)
    ]
    lines += ["        /*0030*/              @P1 BRA `(.L_x_1) ;", "        /*0040*/   EXIT ;"]
    return lines

  kinds = []
  for n in (1, 2):
    st = report.loop_stats(*report.parse(loop(n)))
    assert st.units == 1 + n and st.register_lhs_units == n
    kinds.append(report.backward_kind(st))
  assert kinds == ["dq", "dkv"]
  assert report.backward_kind(None) is None
