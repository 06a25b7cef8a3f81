"""The bake: learn from vLLM's own weight loaders which box of which published HF tensor each of this
worker's parameters holds, as ``sharded_rdt`` does, so that no per-model table is the source of truth.

How (once per set of published tensors):

1. Every parameter the loaders may write is swapped for a float64 placeholder filled with -1: the live
   parameter's memory for modules that are written in place, a fresh tensor of the *pre-processing*
   shape (as vLLM recorded it before ``process_weights_after_loading``) for staged modules.
2. The model's own ``load_weights`` is driven with float64 placeholders of the published HF tensors
   whose element ``i`` of tensor ``t`` holds ``t * 2**32 + i + 1`` (exact in float64).
3. Each placeholder parameter is decoded: per HF tensor, the elements it received must form one N-d
   box of that tensor laid out affinely in the parameter (then the box is a strided view of the
   parameter); anything else (a permutation, a scaled or quantized copy) is a loader that transforms,
   and raises :class:`NotACopy`.
4. Everything is put back (the live ``.data`` and the staged modules' kernel parameters).

Pure torch on this process's model; no etcd, no transport.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch

from astate_store.errors import LayoutError

__all__ = ["Piece", "Baked", "NotACopy", "bake", "decode"]

log = logging.getLogger("astate_store.integrations.vllm")

_ENC = float(2**32)  # tensor id * 2**32 + element index + 1: exact in float64 below 2**53
_MAX_TENSORS = 2**20


class NotACopy(LayoutError):
    """A loader that does not copy a box of the HF tensor into the parameter (it transforms)."""


@dataclass(frozen=True)
class Piece:
    """Box ``[offsets, offsets + sizes)`` of HF tensor ``hf`` sits in parameter ``param`` at element
    ``base`` with element ``strides`` (a strided view of the contiguous parameter)."""

    hf: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    param: str
    base: int
    strides: tuple[int, ...]

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.as_strided(self.sizes, self.strides, tensor.storage_offset() + self.base)


@dataclass
class Baked:
    """What the loaders do on this worker for one set of published tensors."""

    pieces: list[Piece] = field(default_factory=list)  # in-place pieces (live parameter names)
    staged: dict[str, list[Piece]] = field(default_factory=dict)  # module -> pieces into pre-processing params
    uncovered: dict[str, int] = field(default_factory=dict)  # in-place parameter -> elements no tensor writes
    unwritten: list[str] = field(default_factory=list)  # parameters no published tensor writes


def _unravel(flat: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    coords = []
    for size in reversed(shape):
        coords.append(flat % size)
        flat = torch.div(flat, size, rounding_mode="floor")
    return torch.stack(coords[::-1], dim=1) if coords else flat.new_zeros((flat.numel(), 0))


def _box(param: str, hf: str, shape: Sequence[int], idx: torch.Tensor, pos: torch.Tensor) -> Piece:
    """The box of HF elements ``idx`` (sorted) found at parameter positions ``pos``, as a strided view."""
    n = idx.numel()
    if len(shape) == 0:
        return Piece(hf, (), (), param, int(pos[0]), ())
    coords = _unravel(idx, shape)
    lo, hi = coords.min(0).values, coords.max(0).values + 1
    sizes = [int(s) for s in (hi - lo)]
    if math.prod(sizes) != n or bool((idx[1:] == idx[:-1]).any()):
        raise NotACopy(f"parameter {param!r}: the elements of {hf!r} it receives are not one box")
    box_strides = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
    strides = [int(pos[box_strides[d]] - pos[0]) if sizes[d] > 1 else 1 for d in range(len(sizes))]
    if min(strides) < 0:
        raise NotACopy(f"parameter {param!r}: {hf!r} is written reversed")
    rel = coords - lo
    expect = pos[0] + rel @ torch.tensor(strides, dtype=torch.int64)
    if not torch.equal(expect, pos):
        raise NotACopy(f"parameter {param!r}: {hf!r} is permuted inside it (not a strided copy of a box)")
    return Piece(hf, tuple(int(o) for o in lo), tuple(sizes), param, int(pos[0]), tuple(strides))


def decode(param: str, values: torch.Tensor, names: Sequence[str],
           shapes: Sequence[Sequence[int]]) -> tuple[list[Piece], int]:
    """The pieces a placeholder parameter received, and how many of its elements nothing wrote."""
    flat = values.reshape(-1)
    untouched = int((flat == -1).sum())
    written = flat >= 1
    if not bool(written.any()):
        return [], untouched
    vals = flat[written] - 1
    if bool((vals != torch.floor(vals)).any()) or bool((flat[~written] > 0).any()):
        raise NotACopy(f"parameter {param!r}: its loader transforms values (not a copy)")
    keys = vals.to(torch.int64)
    pos = written.nonzero().squeeze(1)
    order = torch.argsort(keys)
    keys, pos = keys[order], pos[order]
    ids = torch.div(keys, int(_ENC), rounding_mode="floor")
    idx = keys - ids * int(_ENC)
    uniq, counts = torch.unique_consecutive(ids, return_counts=True)
    pieces, at = [], 0
    for t, c in zip(uniq.tolist(), counts.tolist()):
        if t >= len(names) or int(idx[at + c - 1]) >= math.prod(shapes[t]):
            raise NotACopy(f"parameter {param!r}: its loader transforms values (not a copy)")
        pieces.append(_box(param, names[t], shapes[t], idx[at:at + c], pos[at:at + c]))
        at += c
    return pieces, untouched


def _encoded(published: Sequence[tuple[str, tuple[int, ...]]], state: dict[str, Any]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    for t, (name, shape) in enumerate(published):
        state["current"] = name
        n = math.prod(shape)
        yield name, (torch.arange(1, n + 1, dtype=torch.float64) + t * _ENC).reshape(shape)
    state["current"] = None


class _Swap:
    """Placeholders in, the engine's tensors back out (also on error)."""

    def __init__(self, model: torch.nn.Module, staged: Mapping[str, Any]):
        self.model, self.staged = model, staged
        self.live: dict[str, tuple[torch.nn.Parameter, torch.Tensor]] = {}  # name -> (param, its data)
        self.kernel: dict[str, dict[str, Any]] = {}  # staged module -> its parameters as the engine runs them
        self.fresh: dict[str, dict[str, torch.Tensor]] = {}  # staged module -> pre-processing placeholders

    def __enter__(self) -> "_Swap":
        seen: set[int] = set()
        for mname, module in self.model.named_modules():
            if mname in self.staged:
                self._stage(mname, module, self.staged[mname])
                continue
            for pname, p in module._parameters.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                self.live[_join(mname, pname)] = (p, p.data)
                p.data = torch.full(p.shape, -1.0, dtype=torch.float64)
        return self

    def _stage(self, mname: str, module: torch.nn.Module, metadata: Mapping[str, torch.Tensor]) -> None:
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        self.kernel[mname] = dict(module._parameters)
        for pname, p in module._parameters.items():  # no pre-processing format recorded: stays live (bias)
            if p is not None and pname not in metadata:
                self.live[_join(mname, pname)] = (p, p.data)
                p.data = torch.full(p.shape, -1.0, dtype=torch.float64)
        fresh = {}
        for pname, meta in metadata.items():
            t = torch.full(tuple(meta.shape), -1.0, dtype=torch.float64)
            t.__class__ = meta.__class__
            t.__dict__ = meta.__dict__.copy()
            t = restore_layer_refs(t, module)
            module._parameters[pname] = t
            fresh[pname] = t
        self.fresh[mname] = fresh

    def __exit__(self, *exc: Any) -> None:
        for mname, params in self.kernel.items():
            module = self.model.get_submodule(mname)
            module._parameters.clear()
            module._parameters.update(params)
        for p, data in self.live.values():
            p.data = data


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _drive(model: torch.nn.Module, published: Sequence[tuple[str, tuple[int, ...]]]) -> None:
    state: dict[str, Any] = {"current": None}
    try:
        with torch.no_grad():
            model.load_weights(_encoded(published, state))
    except LayoutError:
        raise
    except Exception as exc:  # the model's own loader refused: name the tensor it was reading
        where = f" at published tensor {state['current']!r}" if state["current"] else ""
        raise LayoutError(f"vLLM's loaders of {type(model).__name__} cannot map the published tensors{where}: "
                          f"{type(exc).__name__}: {exc}") from exc


def bake(model: torch.nn.Module, published: Mapping[str, tuple[int, ...]],
         staged: Mapping[str, Mapping[str, torch.Tensor]]) -> Baked:
    """Drive the model's loaders once with placeholders of ``published`` (HF name -> global shape).

    ``staged``: module name -> its pre-processing parameter metadata (meta tensors vLLM recorded);
    those modules are baked against fresh tensors of that format, never against their live memory.

    Raises:
        LayoutError: the loaders refuse a published tensor (naming it).
        NotACopy: an in-place parameter's loader transforms (naming the parameter).
    """
    if len(published) >= _MAX_TENSORS:
        raise LayoutError(f"{len(published)} published tensors: the bake encodes at most {_MAX_TENSORS}")
    items = sorted((n, tuple(int(s) for s in shape)) for n, shape in published.items())
    names, shapes = [n for n, _ in items], [s for _, s in items]
    out = Baked()
    with _Swap(model, staged) as swap:
        _drive(model, items)
        for pname, (p, _) in swap.live.items():
            if not p.data.is_contiguous():
                raise NotACopy(f"parameter {pname!r} is not contiguous")
            pieces, untouched = decode(pname, p.data, names, shapes)
            out.pieces += pieces
            if not pieces:
                out.unwritten.append(pname)
            elif untouched:
                out.uncovered[pname] = untouched
        for mname, fresh in swap.fresh.items():
            got = []
            for pname, t in fresh.items():
                pieces, _ = decode(_join(mname, pname), t.data, names, shapes)
                got += pieces
                if not pieces:
                    out.unwritten.append(_join(mname, pname))
            out.staged[mname] = got
    log.info("bake: %d in-place pieces, %d staged modules, %d parameters not written", len(out.pieces),
             len(out.staged), len(out.unwritten))
    return out
