"""The recipe's start-up error, in a module of its own: ``checks`` and ``environment`` both raise it,
and ``checks`` imports ``environment`` (no import cycle)."""


class GDRORecipeError(ValueError):
    """A setting the GDRO recipe refuses at start-up. The message names the key(s) at fault."""
