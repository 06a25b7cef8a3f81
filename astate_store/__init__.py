"""astate-store: versioned tensor state for RL weight synchronization."""

from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .layout import Shard

__version__ = "0.1.0"
__all__ = ["Shard", *_errors_all]
