"""``python -m fastattn {run,doctor,bench,workbook,budget,diff,gpu-check} ...``: ``run`` is the runtime's; the
others are the lab's, imported only when one of them runs."""

from __future__ import annotations

import sys
from importlib import import_module

COMMANDS = {
    "run": ("run", "run a program with voxcpm patched in every Python process it starts"),
    "doctor": ("lab.doctor", "print the environment that decides which attention kernel runs"),
    "bench": ("lab.bench", "run benchmark sweeps and write records"),
    "workbook": ("lab.workbook", "run the notebooks headless into a new reports/ folder"),
    "budget": ("lab.budget", "probe this machine and print the workbook's plan"),
    "diff": ("lab.upstream", "print (or --write) the upstream-ready diff against the installed voxcpm"),
    "gpu-check": ("lab.gpucheck", "validate the CUDA path in one command (--device cpu --quick tests the kit)"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m fastattn {{{','.join(COMMANDS)}}} [options]\n")
        for name, (_, help_) in COMMANDS.items():
            print(f"  {name:<9} {help_}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return import_module(f"fastattn.{COMMANDS[argv[0]][0]}").main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
