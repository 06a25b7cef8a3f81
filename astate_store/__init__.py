"""astate-store: versioned tensor state for RL weight synchronization.

``connect`` opens a namespace's :class:`Store`: ``put`` publishes a version, ``get_into`` pulls
the newest committed one into preallocated buffers of any layout.
"""

from astate_store.errors import *  # noqa: F401,F403
from astate_store.errors import __all__ as _errors_all
from astate_store.hub import SessionHub, connect_many
from astate_store.metrics import PullStats, Stats
from astate_store.model.layout import Shard
from astate_store.store import Store, connect

__version__ = "0.1.0"
__all__ = ["connect", "connect_many", "SessionHub", "Store", "Shard", "Stats", "PullStats", *_errors_all]
