"""``python -m astate_store.cli``: the ``astate`` console script."""

from . import main

main()
