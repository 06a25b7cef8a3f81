"""A store's pulls into caller buffers: its consumer's, once its re-served offer is withdrawn.

The buffers a store re-serves (``Store.serve``) may be the very buffers a pull is about to
write. Every pull of a store — ``get_into``, ``get``, and ``recover`` fetching from live
sources — goes through :class:`Pulls`, which first withdraws the offer (waiting, bounded, for
its readers) and then pulls.
"""

from __future__ import annotations

from collections.abc import Mapping

from astate_store.catalog import Version
from astate_store.get.consumer import Consumer
from astate_store.model.layout import TensorLike
from astate_store.model.progress import Progress
from astate_store.put.serving import Serving

__all__ = ["Pulls"]


class Pulls:
    """One store's pulls (``Store.get`` pulls with it as its ``get.kv.BegunReads``).

    Args:
        consumer: the store's consumer, which pulls.
        serving: the store's re-served offer, withdrawn before each pull.
    """

    def __init__(self, consumer: Consumer, serving: Serving):
        self.consumer, self.serving = consumer, serving

    def begin(self, step: int) -> Version:
        """Register as a reader of committed ``step`` and read it (``Consumer.begin``)."""
        return self.consumer.begin(step)

    def end(self, step: int) -> None:
        """End a read begun with :meth:`begin` that no pull follows."""
        self.consumer.end(step)

    def get_into(
        self,
        buffers: Mapping[str, TensorLike],
        step: int | None,
        timeout: float | None,
        progress: Progress | None = None,
        *,
        begun: Version | None = None,
    ) -> int:
        """Withdraw the offer, then pull the newest committed version >= ``step`` into the
        buffers (``Consumer.get_into``); returns the step delivered."""
        if self.serving.active:
            self.serving.withdraw()  # these buffers may be among the re-served ones: withdraw before writing
        return self.consumer.get_into(buffers, step, timeout, progress, begun=begun)
