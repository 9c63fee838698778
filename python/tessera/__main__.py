"""``python -m tessera ...``: the ``tessera`` command."""

from ._cli import entry

entry()
