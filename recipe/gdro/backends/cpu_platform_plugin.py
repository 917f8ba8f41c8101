"""The ``verl.plugins`` entry point of the cpu platform (setup.py): importing this module registers it.

verl's loader (verl/__init__.py) imports an entry point's module and ignores ordinary exceptions, so
:func:`recipe.gdro.backends.cpu_platform.register` reports a refusal by exiting (status 2, one line).
"""

from recipe.gdro.backends.cpu_platform import register

register()
