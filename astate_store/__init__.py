"""astate-store: versioned tensor state for RL weight synchronization.

``connect`` opens a namespace's :class:`Store`: ``put`` publishes a version, ``get_into`` pulls
the newest committed one into preallocated buffers of any layout.
"""

from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .layout import Shard
from .metrics import PullStats, Stats
from .store import Store, connect
from .sessions_hub import SessionHub, connect_many

__version__ = "0.1.0"
__all__ = ["connect", "connect_many", "SessionHub", "Store", "Shard", "Stats", "PullStats", *_errors_all]
