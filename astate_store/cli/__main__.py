"""``python -m astate_store.cli``: the ``astate`` console script."""

from astate_store.cli import main

main()
