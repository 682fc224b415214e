"""bench.sass: loops found from an nvdisasm listing's backward branches, the per-channel loop split into its plane
loops and the rest, the spill stores of a global load's data counted, and bad arguments exit 2 with one line."""

import pytest

from bench import sass

LISTING = """
        /*0000*/                   MOV R0, RZ ;
.L_x_1:
        /*0010*/                   LDS R1, [R2] ;
        /*0020*/                   ISETP.GE.AND P0, PT, R0, R3, PT ;
.L_x_2:
        /*0030*/                   SHF.R.U64 R4, RZ, R5, R1 ;
        /*0040*/                   LOP3.LUT R6, R6, R4, R7, 0xf8, !PT ;
        /*0050*/              @!P0 BRA `(.L_x_2) ;
        /*0060*/                   FFMA R8, R9, R6, R8 ;
.L_x_3:
        /*0070*/                   VIADD R5, R5, 0x1 ;
        /*0080*/              @!P1 BRA `(.L_x_3) ;
        /*0090*/                   @P2 BRA `(.L_x_1) ;
        /*00a0*/                   BRA `(.L_x_4) ;
.L_x_4:
        /*00b0*/                   EXIT ;
"""


def test_loops_are_backward_branches_and_the_channel_loop_splits_into_its_plane_loops():
    listing, labels = sass.instructions(LISTING)
    assert len(listing) == 12 and labels == {"L_x_1": 0x10, "L_x_2": 0x30, "L_x_3": 0x70, "L_x_4": 0xb0}
    assert sass.loops(listing, labels) == [(1, 9), (3, 5), (7, 8)]  # the forward BRA to L_x_4 is no loop
    loop = sass.channel_loop(LISTING)
    assert loop == sass.ChannelLoop(fixed=4, per_plane=5, plane_loops=2)
    assert [loop.instructions(b) for b in (1, 2, 4)] == [4, 9, 19]  # plane 0 in the fixed part, b - 1 plane passes


def test_a_spill_store_of_a_global_loads_data_is_counted_and_others_are_not():
    listing, _ = sass.instructions("""
        /*0000*/                   LDG.E.64 R28, desc[UR22][R28.64] ;
        /*0010*/                   STL.64 [R1], R28 (*"SpillRefill"*) ;
        /*0020*/              @!P0 LDG.E R30, desc[UR22][R2.64] ;
        /*0030*/                   IADD3 R31, R4, 0x1, RZ ;
        /*0040*/                   STL [R1+0x8], R30 (*"SpillRefill"*) ;
        /*0050*/                   LDG.E R32, desc[UR22][R2.64] ;
        /*0060*/                   IADD3 R32, R32, 0x1, RZ ;
        /*0070*/                   STL [R1+0xc], R32 (*"SpillRefill"*) ;
        /*0080*/                   STL.64 [R1+0x10], RZ ;
        /*0090*/                   EXIT ;
""")
    # R28 and R30 are a load's data (a predicated load, an unrelated write between); R32 was rewritten by an add
    assert sass.loads_spilled(listing) == 2


def test_a_listing_without_an_fma_loop_is_refused():
    with pytest.raises(ValueError, match="FFMA"):
        sass.channel_loop(LISTING.replace("FFMA", "FMUL"))


@pytest.mark.parametrize("argv, message", [(["--heads", "0"], "--heads must each be 1..8, got 0"),
                                           (["--heads", "4", "9"], "--heads must each be 1..8, got 9"),
                                           (["--cap", "96"], "--cap must be a power of two 1..128, got 96")])
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        sass.main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"error: {message}\n"
