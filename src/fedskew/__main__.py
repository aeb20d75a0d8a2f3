"""``python -m fedskew``: the command line without the installed ``fedskew`` script (e.g. from a source tree)."""

from fedskew.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
