"""CLI subcommands that live next to what they drive (see ``fedskew.cli.COMMAND_MODULES``).

Each module defines ``add_parsers(sub)`` (adds its argparse subparsers) and ``HANDLERS`` (subcommand name -> function
taking the parsed arguments and returning the exit status). Modules import their heavy dependencies inside the
handlers, so ``fedskew --help`` stays fast and an optional extra (Flower) is needed only by its own command.
"""

from typing import Any


def console(**kwargs: Any) -> Any:
    """A rich ``Console`` for fedskew's output. Emoji codes are off: rich would print a study named
    ``fedsa-cpu:moon:tau=1.0`` (method MOON) with a moon emoji in place of ``:moon:``."""
    from rich.console import Console

    return Console(emoji=False, **kwargs)
