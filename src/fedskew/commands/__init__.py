"""CLI subcommands that live next to what they drive (see ``fedskew.cli.COMMAND_MODULES``).

Each module defines ``add_parsers(sub)`` (adds its argparse subparsers) and ``HANDLERS`` (subcommand name -> function
taking the parsed arguments and returning the exit status). Modules import their heavy dependencies inside the
handlers, so ``fedskew --help`` stays fast and an optional extra (Flower) is needed only by its own command.
"""
