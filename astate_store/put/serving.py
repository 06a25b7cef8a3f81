"""Re-serving (P2P fan-out): a consumer offers the buffers it just pulled as an extra source.

The buffers are registered in place (the same registry as zero-copy publishing: only their
page-rounded spans), and the catalog lists them as a replica of the step, on the consumer's
lease. Before the buffers change (the next ``get_into``), or at ``unserve``, the offer is
withdrawn, its readers waited for, and the registrations only the offer held are released.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from astate_store.context import StoreContext
from astate_store.errors import LayoutError
from astate_store.model import codec
from astate_store.model.layout import TensorLike
from astate_store.model.validation import Entry, validate_tensors, with_aliases
from astate_store.put.registry import Registry

if TYPE_CHECKING:
    from astate_store.get.consumer import Consumer

__all__ = ["Serving"]

log = logging.getLogger("astate_store")

_HOLDER = "serve"  # the registry's holder name for offered buffers


class Serving:
    """The steps this process re-serves, as (step, group, layout id)."""

    def __init__(self, ctx: StoreContext, registry: Registry, consumer: Consumer):
        self.ctx, self.registry = ctx, registry
        self.consumer = consumer  # whose last get_into filled the buffers that may be offered
        self._offers: list[tuple[int, str, str]] = []

    @property
    def active(self) -> bool:
        return bool(self._offers)

    def serve(self, step: int, buffers: Mapping[str, TensorLike], group: str | None) -> None:
        """Offer ``buffers`` as a source of ``step``; see ``Store.serve``.

        Raises:
            LayoutError: a buffer that this store's last ``get_into`` did not fill with ``step``.
        """
        entries = validate_tensors(buffers, "serve(buffers)")
        got, filled = self.consumer.delivered_step, self.consumer.buffers.entries
        # The very views get_into filled, under the same names: a view of the same first byte with
        # other strides or another box would offer other bytes as this step's.
        delivered = {e.name: _identity(e) for e in filled} if step == got else {}
        for e in entries:
            if delivered.get(e.name) != _identity(e):
                raise LayoutError(
                    f"tensor {e.name!r}: serve() of step {step} needs buffers that get_into "
                    "filled with that step (the same names and views)"
                )
        # Rank 0: a group's members are numbered by the consumer when it plans against them.
        shards = with_aliases(entries, self.registry.acquire(_HOLDER, entries, 0))  # tied weights: every name
        grp = group or f"solo-{self.ctx.reader_id}"
        try:
            desc = codec.encode("ucx_descriptor", self.ctx.transport.descriptor())
            lid = self.ctx.catalog.replicas.add(step, grp, self.ctx.reader_id, shards, desc)
        except BaseException:  # nothing offered (e.g. the step was dropped meanwhile): expose nothing
            self.registry.sweep(self.registry.release_newest(_HOLDER))
            raise
        finally:
            self.ctx.stats.registrations = self.registry.count
        self._offers.append((step, grp, lid))
        log.info("re-serving step %d as %s/%s (%d tensors)", step, grp, self.ctx.reader_id, len(shards))

    def withdraw(self) -> int:
        """Withdraw every offer; returns readers that had not finished within the wait."""
        left = 0
        for step, grp, lid in self._offers:
            left += self.ctx.catalog.replicas.remove(
                step, grp, self.ctx.reader_id, lid, timeout=self.ctx.options.retire_timeout
            )
        self._offers.clear()
        # Nobody reads the offered buffers any more: stop exposing them.
        self.registry.sweep(self.registry.release(_HOLDER))
        self.ctx.stats.registrations = self.registry.count
        return left


def _identity(e: Entry) -> tuple[object, ...]:
    """What makes a buffer the one get_into filled: its memory, its view of it, its box."""
    t = e.tensor
    return t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, e.box, e.global_shape
