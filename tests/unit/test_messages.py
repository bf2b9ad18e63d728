"""What the command line lets through to a terminal."""
from gpuguard.core.escape import printable, printable_keeping_colour


def test_colour_passes_and_every_other_control_sequence_is_escaped():
    coloured = "\x1b[1;31mOVER\x1b[0m"
    assert printable_keeping_colour(coloured) == coloured
    hostile = "pts/1\r\x1b[2K\x1b]0;title\x07\x1b[Hforged"
    assert printable_keeping_colour(hostile) == printable(hostile) == r"pts/1\r\x1b[2K\x1b]0;title\x07\x1b[Hforged"
    assert printable_keeping_colour(f"{coloured} \x1b[2J") == coloured + r" \x1b[2J"


def test_a_table_cell_is_one_line_whatever_it_holds(capsys):
    from gpuguard.cli import print_rows

    forged = "A100\ngpu9  0  root  forged row"  # a GPU name as a fleet database may hold it
    print_rows([["NODE", "GPU"], ["gpu1", forged], ["gpu2", "\x1b[2Jcleared"], ["gpu3", "\x1b[31mred\x1b[0m"]])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[1] == "gpu1  A100\\ngpu9  0  root  forged row"
    assert lines[2] == "gpu2  \\x1b[2Jcleared"  # erases nothing
    assert lines[3] == "gpu3  \x1b[31mred\x1b[0m"  # colour, as the status table paints it
