"""The key-value surface of a store: ``keys`` lists what a committed version holds, ``get``
allocates whole tensors and fills them with the normal ``get_into``.

Both read the version's manifests (leaseless, content-addressed: they describe the version
whichever publishers are still alive), so they work from replica servers and re-serving
consumers after the writer is gone. ``get`` never returns bytes of two steps: it is one
``get_into``; when the newest version changes shape between listing and pulling, it lists
again and retries (bounded).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from astate_store.catalog import Catalog, Version
from astate_store.errors import LayoutError, TornReadError, VersionNotFound
from astate_store.model.dtypes import torch_dtype
from astate_store.model.layout import group_layouts
from astate_store.model.progress import Progress

__all__ = ["KeyInfo", "keys", "get"]

log = logging.getLogger("astate_store")

# Times ``get`` lists and allocates again when the newest version changed shape under it.
_SHAPE_RETRIES = 8


class BegunReads(Protocol):
    """The consumer ``get`` pulls with (``get.consumer.Consumer``, through ``Store``)."""

    def begin(self, step: int) -> Version:
        """Register as a reader of ``step`` and read it (raises ``VersionNotFound``)."""

    def end(self, step: int) -> None:
        """End a begun read no pull follows."""

    def get_into(
        self,
        buffers: Mapping[str, torch.Tensor],
        step: int,
        timeout: float | None,
        progress: Progress | None,
        *,
        begun: Version,
    ) -> int:
        """Pull into ``buffers``, the begun read first (it is ended whatever happens)."""


@dataclass(frozen=True)
class KeyInfo:
    """One tensor of a committed version: its global shape, dtype name (``"float32"``, ...) and
    size in bytes."""

    global_shape: tuple[int, ...]
    dtype: str
    nbytes: int


def keys(catalog: Catalog, step: int | None = None) -> dict[str, KeyInfo]:
    """Name -> :class:`KeyInfo` of every tensor of committed version ``step`` (the newest when
    None; ``{}`` when nothing is committed), sorted by name.

    Raises:
        VersionNotFound: ``step`` is not committed (or retention dropped its metadata).
        CatalogError: a manifest the version names is missing or bad.
    """
    if step is None:
        step = catalog.versions.latest()
        if step is None:
            return {}
    return _keys_of(catalog, catalog.versions.read_version(step))


def _keys_of(catalog: Catalog, version: Version, *, layouts_too: bool = False) -> dict[str, KeyInfo]:
    """``keys`` of a version read; ``layouts_too``: read its sources' layouts with the manifests,
    in the same round trip, for the pull that follows (``get``)."""
    if layouts_too:
        catalog.versions.layouts_of(version)  # caches the manifests and layouts
    manifests = catalog.versions.manifests_of(version)
    layouts = group_layouts(rec for r, m in sorted(manifests.items()) for rec in m.records(r))
    return {n: KeyInfo(tuple(t.global_shape), t.dtype, t.nbytes) for n, t in sorted(layouts.items())}


def get(
    catalog: Catalog,
    reads: BegunReads,
    names: Iterable[str] | str | None = None,
    *,
    step: int | None = None,
    timeout: float | None = None,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
) -> tuple[int, dict[str, torch.Tensor]]:
    """(step, name -> tensor) of the newest committed version >= ``step``: whole tensors of the
    published global shape and dtype, allocated on ``device``, filled by one ``get_into``
    (``progress`` as there).

    Raises:
        LayoutError: ``names`` holds names the version does not publish (all of them named), or
            is not a name or a collection of names.
        WaitTimeout: no such version committed within ``timeout``.
        PeerUnreachable: no live source holds the version (writer gone, no server).
        TornReadError: the newest version changed its shapes under every one of the bounded
            retries (or as ``get_into``: kept being retired while read).
    """
    wanted = _names(names)
    dev = torch.device(device)
    deadline = None if timeout is None else time.monotonic() + timeout
    want = step
    for attempt in range(_SHAPE_RETRIES + 1):
        s = catalog.versions.wait_for(want, timeout=_left(deadline))
        try:
            # The pull's own read, begun now: the tensors are listed from it (one round trip
            # for the commit, the live ranks and the reader's registration).
            version = reads.begin(s)
        except VersionNotFound:
            want = s + 1  # retired or dropped meanwhile: only a newer one can serve
            continue
        try:
            info = _keys_of(catalog, version, layouts_too=True)
            chosen = _check(info, wanted, s)
            bufs = {
                n: torch.empty(info[n].global_shape, dtype=torch_dtype(info[n].dtype, tensor=n), device=dev)
                for n in chosen
            }
        except BaseException:
            reads.end(s)
            raise
        try:
            got = reads.get_into(bufs, s, _left(deadline), progress, begun=version)
        except LayoutError as exc:
            # The newest version changed names or shapes between the listing and the pull (the
            # pull refused before any byte moved): list the new one and retry, bounded.
            newer = catalog.versions.latest()
            if newer is None or newer <= s:
                raise
            if attempt == _SHAPE_RETRIES:
                raise TornReadError(
                    f"namespace {catalog.namespace!r}: get(): the newest version changed its tensors' shapes "
                    f"under {_SHAPE_RETRIES + 1} pulls in a row (last: step {s} listed, step {newer} "
                    "newest); "
                    "the publisher changes shapes faster than they can be read"
                ) from exc
            log.info(
                "namespace %s: get(): step %d changed shape under the pull; listing step %d again",
                catalog.namespace,
                s,
                newer,
            )
            want = newer
            continue
        if got != s and not _same_dtypes(catalog, got, bufs):
            want = got  # a newer version with the same shapes but other dtypes: allocate for it
            continue
        return got, bufs
    raise TornReadError(
        f"namespace {catalog.namespace!r}: get(): the newest version kept changing its tensors "
        f"or being dropped under {_SHAPE_RETRIES + 1} pulls in a row"
    )


def _names(names: Iterable[str] | str | None) -> list[str] | None:
    """``names`` as a list (one string is one name).

    Raises:
        LayoutError: not None, a string, or an iterable of strings.
    """
    if names is None:
        return None
    if isinstance(names, str):
        return [names]
    try:
        out = list(names)
    except TypeError:
        raise LayoutError(
            f"get(names=...) must be None, a name or names, got {type(names).__name__}"
        ) from None
    bad = [n for n in out if not isinstance(n, str)]
    if bad:
        raise LayoutError(f"get(names=...): names are strings, got {bad[:4]!r}")
    return list(dict.fromkeys(out))


def _check(info: Mapping[str, KeyInfo], wanted: list[str] | None, step: int) -> list[str]:
    """The names to fetch: all of ``info``, or ``wanted`` when every one is published."""
    if wanted is None:
        return list(info)
    unknown = [n for n in wanted if n not in info]
    if unknown:
        known = list(info)
        raise LayoutError(
            f"get(): tensors {unknown} are not in step {step}'s published tensors "
            f"({', '.join(known[:8])}{', ...' if len(known) > 8 else ''})"
        )
    return wanted


def _same_dtypes(catalog: Catalog, step: int, bufs: Mapping[str, torch.Tensor]) -> bool:
    """Whether step ``step`` publishes every buffer in the buffer's dtype (a pull of a newer
    step than listed fits the shapes, but would have converted another float dtype)."""
    try:
        info = keys(catalog, step)
    except VersionNotFound:
        return True  # already dropped: the pull delivered it whole, as checked by get_into
    return all(n in info and torch_dtype(info[n].dtype, tensor=n) == b.dtype for n, b in bufs.items())


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
