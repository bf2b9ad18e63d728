"""What the command line lets through to a terminal."""
from gpuguard.core.escape import printable, printable_keeping_colour


def test_colour_passes_and_every_other_control_sequence_is_escaped():
    coloured = "\x1b[1;31mOVER\x1b[0m"
    assert printable_keeping_colour(coloured) == coloured
    hostile = "pts/1\r\x1b[2K\x1b]0;title\x07\x1b[Hforged"
    assert printable_keeping_colour(hostile) == printable(hostile) == r"pts/1\r\x1b[2K\x1b]0;title\x07\x1b[Hforged"
    assert printable_keeping_colour(f"{coloured} \x1b[2J") == coloured + r" \x1b[2J"
