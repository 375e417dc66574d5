"""Command-line plumbing shared by `shardfuse` (the console script) and `examples/*.py`.

A bad argument, whether argparse finds it (a wrong type, an unknown choice)
or the library does (a `ValueError` naming the value and what would be
valid), ends the program the same way: ONE line `prog: error: message` on
stderr and exit status 2, never a traceback. Errors met while the program
runs (after its arguments were accepted) are not argument errors and keep
their traceback.
"""

import argparse
import sys

EXIT_BAD_ARGUMENTS = 2


def one_line(message) -> str:
    """`message` (any object) as one line: its lines joined with "; "."""
    return "; ".join(line.strip() for line in str(message).splitlines() if line.strip())


def fail(prog: str, message) -> int:
    """Prints `prog: error: message` (one line) to stderr; returns the exit status 2."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr, flush=True)
    return EXIT_BAD_ARGUMENTS


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are one line: `prog: error: message`, status 2.

    (argparse prints its usage block first; `prog --help` still shows it.)
    Sub-parsers made by `add_subparsers` are of this class too.

    Example usage::

      >>> from shardfuse.cli import ArgumentParser, positive_int
      >>> parser = ArgumentParser(prog="demo")
      >>> _ = parser.add_argument("--steps", type=positive_int)
      >>> parser.parse_args(["--steps", "3"]).steps
      3
    """

    def error(self, message):
        self.exit(EXIT_BAD_ARGUMENTS, f"{self.prog}: error: {one_line(message)}\n")


def positive_int(text: str) -> int:
    """argparse `type`: an int >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse `type`: an int >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
    return value
