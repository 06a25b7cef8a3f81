"""The bake, engine-neutral: learn from an inference engine's own weight loaders which box of which
published HF tensor each parameter holds, as ``sharded_rdt`` does, so that no per-model table is the
source of truth. Used by the vLLM backend (:mod:`astate_store.integrations.vllm.bake`, which adds its
staged modules) and the SGLang loader (:mod:`astate_store.integrations.sglang.loader`).

How (once per set of published tensors):

1. Every parameter the loaders may write is swapped for a float64 placeholder filled with -1
   (:class:`Swap`; an engine with staged modules swaps those for fresh tensors of their
   pre-processing format in its subclass).
2. The model's own ``load_weights`` is driven with float64 placeholders of the published HF tensors
   whose element ``i`` of tensor ``t`` holds ``t * 2**32 + i + 1`` (exact in float64).
3. Each placeholder parameter is decoded: per HF tensor, the elements it received must form one N-d
   box of that tensor laid out affinely in the parameter (then the box is a strided view of the
   parameter); anything else (a permutation, a scaled or quantized copy) is a loader that transforms,
   and raises :class:`NotACopy`.
4. Everything is put back (also on error).

Pure torch on this process's model; no etcd, no transport.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from astate_store.errors import LayoutError

__all__ = ["Piece", "Baked", "NotACopy", "Swap", "bake_with", "decode", "zero_runs"]

log = logging.getLogger("astate_store.integrations")

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
    staged: dict[str, list[Piece]] = field(
        default_factory=dict
    )  # module -> pieces into pre-processing params
    uncovered: dict[str, int] = field(default_factory=dict)  # in-place parameter -> elements no tensor writes
    unwritten: list[str] = field(default_factory=list)  # parameters no published tensor writes
    unused: list[str] = field(default_factory=list)  # published tensors no parameter receives
    # in-place parameter -> flat element ranges [start, end) the loaders fill with zeros, from no
    # published tensor (padding rows of a vocabulary split, which SGLang's loader zero-fills)
    zeroed: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


_CHUNK = 1 << 22  # elements scanned at a time: the decode's memory is bounded by this, not the parameter


def _unravel(flat: int, shape: Sequence[int]) -> list[int]:
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return out[::-1]


def _row_major(shape: Sequence[int]) -> list[int]:
    return [math.prod(shape[d + 1 :]) for d in range(len(shape))]


def _merge(stats: dict[int, list[int]], t: int, lo: int, hi: int, n: int, p: int) -> None:
    """Fold one chunk's [min, max, count, position of the min] of tensor ``t`` into ``stats``."""
    st = stats.get(t)
    if st is None:
        stats[t] = [lo, hi, n, p]
        return
    if lo < st[0]:
        st[0], st[3] = lo, p
    st[1], st[2] = max(st[1], hi), st[2] + n


def _scan(param: str, flat: torch.Tensor) -> tuple[dict[int, list[int]], int]:
    """One pass in chunks: per HF tensor id [min element, max element, count, position of the min];
    and the number of elements nothing wrote (-1). A chunk that one tensor fills entirely (most chunks
    of a big parameter) takes a few reductions; the others are grouped by tensor (a sort)."""
    stats: dict[int, list[int]] = {}
    untouched = 0
    enc = int(_ENC)
    for s in range(0, flat.numel(), _CHUNK):
        c = flat[s : s + _CHUNK]
        low, high = (float(x) for x in torch.aminmax(c))
        if low >= 1 and bool((c != torch.floor(c)).any()):
            raise NotACopy(f"parameter {param!r}: its loader transforms values (not a copy)")
        first, last = int((low - 1) // _ENC), int((high - 1) // _ENC)
        if low >= 1 and first == last:  # one tensor's elements only: its extremes say it all
            base = first * enc + 1
            _merge(stats, first, int(low) - base, int(high) - base, c.numel(), s + int(c.argmin()))
            continue
        untouched += int((c == -1).sum())
        w = c >= 1
        vals = c[w] - 1
        if bool(((c > 0) & ~w).any()) or bool((vals != torch.floor(vals)).any()):
            raise NotACopy(f"parameter {param!r}: its loader transforms values (not a copy)")
        if vals.numel() == 0:
            continue
        keys = vals.to(torch.int64)
        pos = w.nonzero().squeeze(1) + s
        ids = torch.div(keys, enc, rounding_mode="floor")
        for t in torch.unique(ids).tolist():
            m = ids == t
            idx, at = keys[m] - t * enc, pos[m]
            k = int(idx.argmin())
            _merge(stats, t, int(idx[k]), int(idx.max()), int(idx.numel()), int(at[k]))
    return stats, untouched


def zero_runs(flat: torch.Tensor) -> list[tuple[int, int]]:
    """The ranges ``[start, end)`` of a placeholder parameter that hold 0 after the loaders ran (no
    encoded value is 0: the loaders wrote a constant there), in chunks, merged across chunks."""
    runs: list[tuple[int, int]] = []
    for s in range(0, flat.numel(), _CHUNK):
        c = flat[s : s + _CHUNK]
        if float(c.min()) > 0:  # encoded values only
            continue
        at = (c == 0).nonzero().squeeze(1)
        if at.numel() == 0:
            continue
        breaks = (at[1:] != at[:-1] + 1).nonzero().squeeze(1)
        starts = torch.cat([at[:1], at[breaks + 1]]).tolist()
        ends = torch.cat([at[breaks], at[-1:]]).tolist()
        for a, b in zip(starts, ends):
            if runs and runs[-1][1] == s + a:
                runs[-1] = (runs[-1][0], s + b + 1)
            else:
                runs.append((s + a, s + b + 1))
    return runs


def _positions(flat: torch.Tensor, wanted: Sequence[float]) -> dict[float, int]:
    """Where each of a few encoded values sits in the parameter (second chunked pass)."""
    found: dict[float, int] = {}
    if not wanted:
        return found
    target = torch.tensor(sorted(set(wanted)), dtype=torch.float64)
    for s in range(0, flat.numel(), _CHUNK):
        c = flat[s : s + _CHUNK]
        hit = torch.isin(c, target).nonzero().squeeze(1)
        for i in hit.tolist():
            found.setdefault(float(c[i]), s + i)
        if len(found) == target.numel():  # each value sits once in a copy: the rest adds none
            break
    return found


def _verify(param: str, flat: torch.Tensor, piece: Piece, t: int, shape: Sequence[int]) -> None:
    """Every element of the view holds exactly the HF element it should (in chunks along dim 0)."""
    n = flat.numel()
    top = piece.base + sum((z - 1) * st for z, st in zip(piece.sizes, piece.strides))
    if min(piece.strides, default=0) < 0 or top >= n:
        raise NotACopy(f"parameter {param!r}: {piece.hf!r} is not a strided copy of a box")
    view = flat.as_strided(piece.sizes, piece.strides, flat.storage_offset() + piece.base)
    if not piece.sizes:
        if float(view) != t * _ENC + 1:
            raise NotACopy(f"parameter {param!r}: {piece.hf!r} is not copied")
        return
    hf_strides = _row_major(shape)
    rest = [
        (torch.arange(o, o + z, dtype=torch.int64) * st).reshape(
            [z if i == d else 1 for i in range(len(piece.sizes))]
        )
        for d, (o, z, st) in enumerate(zip(piece.offsets, piece.sizes, hf_strides))
        if d > 0
    ]
    offset = sum(rest, torch.zeros((), dtype=torch.int64)) + t * int(_ENC) + 1
    step = max(1, _CHUNK // max(1, math.prod(piece.sizes[1:])))
    for r in range(0, piece.sizes[0], step):
        rows = (
            torch.arange(
                piece.offsets[0] + r, piece.offsets[0] + min(piece.sizes[0], r + step), dtype=torch.int64
            )
            * hf_strides[0]
        )
        expect = (rows.reshape([-1] + [1] * (len(piece.sizes) - 1)) + offset).to(torch.float64)
        if not torch.equal(view[r : r + step], expect):
            raise NotACopy(
                f"parameter {param!r}: {piece.hf!r} is permuted inside it (not a strided copy of a box)"
            )


def _guesses(
    flat: torch.Tensor, t: int, lo: int, base: int, steps: Sequence[int | None], sizes: Sequence[int]
) -> list[tuple[float, int]]:
    """Where the elements one step along each dim sit, where a copy puts them: at the same offset as
    in the HF tensor, or one box row further (a contiguous box). Checked element by element; what no
    guess finds is searched for (``_positions``), and the view is verified whole in any case."""
    out = []
    for d, k in enumerate(steps):
        if k is None:
            continue
        value = t * _ENC + k + 1
        for at in (base + k - lo, base + math.prod(sizes[d + 1 :])):
            if 0 <= at < flat.numel() and float(flat[at]) == value:
                out.append((value, at))
                break
    return out


def decode(
    param: str, values: torch.Tensor, names: Sequence[str], shapes: Sequence[Sequence[int]]
) -> tuple[list[Piece], int]:
    """The pieces a placeholder parameter received, and how many of its elements nothing wrote.

    1. scan: per HF tensor, its smallest and largest element index, count, and where the smallest sits;
    2. the box between those two corners must have exactly that many elements; its strides in the
       parameter come from where the elements one step along each dim sit (a second scan for those);
    3. verify: the strided view holds exactly the encoded box, element for element.
    Memory: chunks of the parameter and of each box, never the parameter's size in index tensors.
    """
    flat = values.reshape(-1)
    stats, untouched = _scan(param, flat)
    boxes = {}
    wanted: list[float] = []
    guesses: list[tuple[float, int]] = []
    for t, (lo, hi, n, base) in stats.items():
        if t >= len(names) or hi >= max(1, math.prod(shapes[t])):
            raise NotACopy(f"parameter {param!r}: its loader transforms values (not a copy)")
        shape = shapes[t]
        lo_c, hi_c = _unravel(lo, shape), _unravel(hi, shape)
        sizes = [b - a + 1 for a, b in zip(lo_c, hi_c)]
        if math.prod(sizes) != n:
            raise NotACopy(f"parameter {param!r}: the elements of {names[t]!r} it receives are not one box")
        steps = [lo + st if z > 1 else None for z, st in zip(sizes, _row_major(shape))]
        wanted += [t * _ENC + k + 1 for k in steps if k is not None]
        boxes[t] = (lo_c, sizes, base, steps)
        guesses += _guesses(flat, t, lo, base, steps, sizes)
    where = dict(guesses)
    where.update(_positions(flat, [v for v in wanted if v not in where]))
    pieces = []
    for t, (lo_c, sizes, base, steps) in sorted(boxes.items()):
        found = [where.get(t * _ENC + k + 1) if k is not None else base + 1 for k in steps]
        if None in found:
            raise NotACopy(f"parameter {param!r}: the elements of {names[t]!r} it receives are not one box")
        strides = [f - base for f in found]
        piece = Piece(names[t], tuple(lo_c), tuple(sizes), param, base, tuple(strides))
        _verify(param, flat, piece, t, shapes[t])
        pieces.append(piece)
    return pieces, untouched


def _encoded(
    published: Sequence[tuple[str, tuple[int, ...]]], state: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    for t, (name, shape) in enumerate(published):
        state["current"] = name
        n = math.prod(shape)
        first = t * _ENC + 1  # one pass: float64 arange is exact below 2**53
        yield name, torch.arange(first, first + n, dtype=torch.float64).reshape(shape)
    state["current"] = None


class Swap:
    """Placeholders in, the engine's tensors back out (also on error).

    ``staged``: module name -> what the engine's subclass needs to stage it (:meth:`_stage`); those
    modules' parameters are left to it. Without staged modules (``{}``) every parameter is swapped
    in place for a placeholder of its own shape."""

    def __init__(self, model: torch.nn.Module, staged: Mapping[str, Any]):
        self.model, self.staged = model, staged
        self.live: dict[str, tuple[torch.nn.Parameter, torch.Tensor]] = {}  # name -> (param, its data)
        self.kernel: dict[str, dict[str, Any]] = {}  # staged module -> its parameters as the engine runs them
        self.fresh: dict[str, dict[str, torch.Tensor]] = {}  # staged module -> pre-processing placeholders

    def __enter__(self) -> Swap:
        seen: set[int] = set()
        for mname, module in self.model.named_modules():
            if mname in self.staged:
                # its parameters are the staging's; a module tied to them (lm_head) is not swapped
                seen.update(id(p) for p in module._parameters.values() if p is not None)
                self._stage(mname, module, self.staged[mname])
                continue
            for pname, p in module._parameters.items():
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                self.swap_live(_join(mname, pname), p)
        return self

    def swap_live(self, name: str, p: torch.nn.Parameter) -> None:
        self.live[name] = (p, p.data)
        p.data = torch.full(p.shape, -1.0, dtype=torch.float64)

    def _stage(self, mname: str, module: torch.nn.Module, metadata: Any) -> None:
        """Swap a staged module's parameters for fresh placeholders (``self.kernel``, ``self.fresh``):
        the engine's own format, so only an engine with a staged path defines it."""
        raise LayoutError(f"module {mname!r} is staged, but this engine has no staged path")

    def __exit__(self, *exc: Any) -> None:
        for mname, params in self.kernel.items():
            module = self.model.get_submodule(mname)
            module._parameters.clear()
            module._parameters.update(params)
        for p, data in self.live.values():
            p.data = data


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _drive(model: torch.nn.Module, published: Sequence[tuple[str, tuple[int, ...]]], engine: str) -> None:
    state: dict[str, Any] = {"current": None}
    try:
        with torch.no_grad():
            model.load_weights(_encoded(published, state))
    except LayoutError:
        raise
    except Exception as exc:  # the model's own loader refused: name the tensor it was reading
        where = f" at published tensor {state['current']!r}" if state["current"] else ""
        raise LayoutError(
            f"{engine}'s loaders of {type(model).__name__} cannot map the published tensors{where}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def bake_with(swap: Swap, published: Mapping[str, tuple[int, ...]], engine: str) -> Baked:
    """Drive ``swap.model``'s loaders once with placeholders of ``published`` (HF name -> global
    shape), inside ``swap`` (which decides what is swapped, and how staged modules are), and decode
    where every element landed. ``engine`` names the engine in errors ("vLLM", "SGLang").

    Raises:
        LayoutError: the loaders refuse a published tensor (naming it).
        NotACopy: an in-place parameter's loader transforms (naming the parameter).
    """
    if len(published) >= _MAX_TENSORS:
        raise LayoutError(f"{len(published)} published tensors: the bake encodes at most {_MAX_TENSORS}")
    items = sorted((n, tuple(int(s) for s in shape)) for n, shape in published.items())
    names, shapes = [n for n, _ in items], [s for _, s in items]
    out = Baked()
    with swap:
        _drive(swap.model, items, engine)
        for pname, (p, _) in swap.live.items():
            if not p.data.is_contiguous():
                raise NotACopy(f"parameter {pname!r} is not contiguous")
            pieces, untouched = decode(pname, p.data, names, shapes)
            out.pieces += pieces
            if not pieces:
                out.unwritten.append(pname)
            elif untouched:
                out.uncovered[pname] = untouched
            zeros = zero_runs(p.data.view(-1))
            if zeros:
                out.zeroed[pname] = zeros
        for mname, fresh in swap.fresh.items():
            got = []
            for pname, t in fresh.items():
                pieces, _ = decode(_join(mname, pname), t.data, names, shapes)
                got += pieces
                if not pieces:
                    out.unwritten.append(_join(mname, pname))
            out.staged[mname] = got
    received = {p.hf for p in out.pieces} | {p.hf for got in out.staged.values() for p in got}
    out.unused = [n for n in names if n not in received]
    log.info(
        "bake (%s): %d in-place pieces, %d staged modules, %d parameters not written",
        engine,
        len(out.pieces),
        len(out.staged),
        len(out.unwritten),
    )
    return out
