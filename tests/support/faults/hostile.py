"""Hostile input, run inside an actor: a bad record per key family written over what a store
wrote (``op_hostile_record``), and bad API calls on live stores (``op_hostile_api``). Each store
operation after it must give exact bytes or a typed error.
"""

from __future__ import annotations

import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tests.support.faults.model import check_buffers, lazy_torch, make_buffers, poison, spec, tensor_of
from tests.support.faults.stores import close_all, open_publisher, open_store, put_step

# A bad record per key family, written with the raw etcd client over what the store wrote.
# (name, key family, how): ``how`` is interpreted by _bad_record.
HOSTILE_RECORDS: tuple[tuple[str, str], ...] = (
    ("epoch_garbage", "epoch"),
    ("epoch_huge", "epoch"),
    ("session_garbage", "session"),
    ("member_own_garbage", "members"),
    ("member_extra_garbage", "members"),
    ("manifest_garbage", "manifests"),
    ("manifest_wrong_content", "manifests"),
    ("manifest_bad_digest", "manifests"),
    ("manifest_missing_chunks", "manifests"),
    ("manifest_zlib_bomb", "manifests"),
    ("layout_garbage", "layouts"),
    ("layout_wrong_kind", "layouts"),
    ("layout_extra_chunk", "layouts"),
    ("replica_layout_garbage", "layouts/replicas"),
    ("piece_garbage", "versions/pieces"),
    ("piece_non_numeric_key", "versions/pieces"),
    ("piece_offset_out_of_range", "versions/pieces"),
    ("piece_unknown_layout", "versions/pieces"),
    ("piece_extra_rank", "versions/pieces"),
    ("commit_garbage", "versions/commit"),
    ("commit_world_too_big", "versions/commit"),
    ("commit_future_step", "versions/commit"),
    ("commits_index_garbage_key", "commits"),
    ("replica_garbage", "versions/replicas"),
    ("replica_unknown_layout", "versions/replicas"),
    ("latest_garbage", "latest"),
    ("latest_huge", "latest"),
    ("reader_leaseless", "readers"),
    ("delivered_garbage", "delivered"),
    ("consumer_garbage", "consumers"),
    ("consumer_pack_wrong_ndim", "consumers"),
    ("consumer_pack_huge_box", "consumers"),
    ("consumer_pack_unknown_name", "consumers"),
    ("consumer_pack_unknown_rank", "consumers"),
    ("consumer_pack_0dim_convert", "consumers"),
    ("retired_garbage", "retired"),
    ("torn_garbage", "torn"),
    ("checkpoint_garbage", "checkpoints"),
    ("checkpoint_missing_uri", "checkpoints"),
    ("recovery_plan_garbage", "recovery"),
    ("version_key_not_utf8", "versions"),
    ("manifest_key_not_utf8", "manifests"),
    ("layout_key_not_utf8", "layouts"),
    ("stray_key", "(none)"),
)

GARBAGE = b"\xc1\xff\x00 not a record \x93"


def _bad_record(name: str, pub: Any, con: Any, step: int) -> list[tuple[Any, bytes]]:
    """(key, value) pairs to write for hostile record ``name`` after ``step`` committed."""
    from astate_store.catalog.blobs import blob_requests
    from astate_store.catalog.records import pad20
    from astate_store.model import codec

    c = pub.catalog.client
    sess = pub.catalog.session
    e, r = pad20(sess.epoch), pad20(sess.rank)
    vpre = c.key("versions", pad20(step))
    ver = pub.catalog.versions.read_version(step)
    piece = ver.pieces[0]
    lkey = c.key("layouts", e, r, piece.layout_id)
    mkey = c.key("manifests", piece.manifest_id)
    raw = c.raw

    def head_of(data: bytes) -> bytes:
        _chunks, put = blob_requests("x", data)
        return put.value

    def piece_rec(**over: Any) -> bytes:
        rec = {
            "step": step,
            "epoch": sess.epoch,
            "rank": 0,
            "world_size": 1,
            "layout_id": piece.layout_id,
            "base_offset": piece.base_offset,
            "manifest_id": piece.manifest_id,
        }
        rec.update(over)
        return codec.encode("piece", rec)

    if name == "epoch_garbage":
        return [(c.key("epoch"), GARBAGE)]
    if name == "epoch_huge":
        return [(c.key("epoch"), codec.encode_counter(10**19 - 1))]
    if name == "session_garbage":
        return [(c.key("session"), GARBAGE)]
    if name == "member_own_garbage":
        return [(c.key("members", e, r), GARBAGE)]
    if name == "member_extra_garbage":
        return [(c.key("members", e, pad20(7)), GARBAGE)]
    if name == "manifest_garbage":
        return [(mkey, GARBAGE)]
    if name == "manifest_wrong_content":
        # A well-formed manifest blob, but of other shards: its content is not its key's id.
        rec = codec.decode("manifest", _blob_bytes(c, mkey))
        rec["names"] = [n + "x" for n in rec["names"]]
        return [(mkey, head_of(codec.encode("manifest", rec)))]
    if name == "manifest_bad_digest":
        head = codec.decode("blob", raw.get(mkey)[0])
        head["digest"] = "0" * 16
        return [(mkey, codec.encode("blob", head))]
    if name == "manifest_missing_chunks":
        head = codec.decode("blob", raw.get(mkey)[0])
        head.pop("data", None)
        head["chunks"] = 3
        return [(mkey, codec.encode("blob", head)), (mkey + "/000001", GARBAGE)]
    if name == "manifest_zlib_bomb":
        # A well-formed head (digest right) whose zlib data inflates to 1 GiB while the head claims
        # the real size: a reader must not inflate it all.
        import zlib

        from astate_store.catalog import blobs

        z = zlib.compressobj(9)
        zero = bytes(16 << 20)
        stored = b"".join(z.compress(zero) for _ in range(64)) + z.flush()
        head = codec.decode("blob", raw.get(mkey)[0])
        head.update(codec="zlib", chunks=0, data=stored, digest=blobs._digest(stored))
        return [(mkey, codec.encode("blob", head))]
    if name == "layout_garbage":
        return [(lkey, GARBAGE)]
    if name == "layout_wrong_kind":
        return [(lkey, head_of(piece_rec()))]
    if name == "layout_extra_chunk":
        return [(lkey + "/000000", GARBAGE), (lkey + "/zz", GARBAGE)]
    if name == "replica_layout_garbage":
        rid = "ghost-" + uuid.uuid4().hex[:6]
        return [
            (c.key("layouts", "replicas", rid, piece.layout_id), GARBAGE),
            (
                vpre + f"/replicas/g/{rid}",
                codec.encode(
                    "replica",
                    {
                        "step": step,
                        "group": "g",
                        "member": rid,
                        "layout_id": piece.layout_id,
                        "manifest_id": piece.manifest_id,
                    },
                ),
            ),
        ]
    if name == "piece_garbage":
        return [(vpre + f"/pieces/{e}/{r}", GARBAGE)]
    if name == "piece_non_numeric_key":
        return [(vpre + "/pieces/xx/yy", piece_rec())]
    if name == "piece_offset_out_of_range":
        return [(vpre + f"/pieces/{e}/{r}", piece_rec(base_offset=1 << 40))]
    if name == "piece_unknown_layout":
        return [(vpre + f"/pieces/{e}/{r}", piece_rec(layout_id="f" * 24))]
    if name == "piece_extra_rank":
        return [(vpre + f"/pieces/{e}/{pad20(1)}", piece_rec(rank=1, world_size=2))]
    if name == "commit_garbage":
        return [(vpre + "/commit", GARBAGE)]
    if name == "commit_world_too_big":
        rec = codec.decode("commit", raw.get(vpre + "/commit")[0])
        rec["world_size"] = 2
        return [(vpre + "/commit", codec.encode("commit", rec))]
    if name == "commit_future_step":
        rec = codec.decode("commit", raw.get(vpre + "/commit")[0])
        rec["step"] = step + 5
        return [
            (c.key("versions", pad20(step + 5), "commit"), codec.encode("commit", rec)),
            (c.key("commits", pad20(step + 5)), b""),
        ]
    if name == "commits_index_garbage_key":
        return [(c.key("commits", "not-a-step"), GARBAGE)]
    if name == "replica_garbage":
        return [(vpre + "/replicas/g/ghost", GARBAGE)]
    if name == "replica_unknown_layout":
        return [
            (
                vpre + "/replicas/g/ghost",
                codec.encode(
                    "replica",
                    {
                        "step": step,
                        "group": "g",
                        "member": "ghost",
                        "layout_id": "e" * 24,
                        "manifest_id": "d" * 24,
                    },
                ),
            )
        ]
    if name == "latest_garbage":
        return [(c.key("latest"), GARBAGE)]
    if name == "latest_huge":
        return [(c.key("latest"), codec.encode_counter(10**19 - 1))]
    if name == "reader_leaseless":
        # A reader that never finishes and has no lease: the publisher must stop waiting for it.
        return [
            (
                c.key("readers", pad20(step), "ghost"),
                codec.encode("reader", {"step": step, "reader_id": "ghost", "host": "nowhere", "pid": 1}),
            )
        ]
    if name == "delivered_garbage":
        return [(c.key("delivered", pad20(step), "ghost"), GARBAGE)]
    if name == "consumer_garbage":
        return [(c.key("consumers", "ghost"), GARBAGE)]
    packs = {
        "consumer_pack_wrong_ndim": {"rank": 0, "name": "w", "offsets": [0], "sizes": [1]},
        "consumer_pack_huge_box": {"rank": 0, "name": "w", "offsets": [0, 0], "sizes": [1 << 30, 1 << 30]},
        "consumer_pack_unknown_name": {"rank": 0, "name": "nope", "offsets": [0], "sizes": [1]},
        "consumer_pack_unknown_rank": {"rank": 9, "name": "b", "offsets": [0], "sizes": [4]},
        "consumer_pack_0dim_convert": {
            "rank": 0,
            "name": "n",
            "offsets": [],
            "sizes": [],
            "dtype": "bfloat16",
        },
    }
    if name in packs:  # a consumer record asking publishers for a copy that cannot be built
        return [
            (
                c.key("consumers", "ghost"),
                codec.encode("consumer", {"reader_id": "ghost", "packs": [packs[name]]}),
            )
        ]
    if name == "retired_garbage":
        return [(c.key("retired", pad20(step), pad20(5)), GARBAGE)]
    if name == "torn_garbage":
        return [(c.key("torn", pad20(step), pad20(5)), GARBAGE)]
    if name == "checkpoint_garbage":
        return [(c.key("checkpoints", pad20(step)), GARBAGE)]
    if name == "checkpoint_missing_uri":
        return [
            (
                c.key("checkpoints", pad20(step)),
                codec.encode(
                    "checkpoint",
                    {
                        "step": step,
                        "uri": "/nonexistent/astate-fault-" + uuid.uuid4().hex[:6],
                        "world_size": 1,
                        "bytes": 10,
                        "written_at": time.time(),
                    },
                ),
            )
        ]
    if name == "recovery_plan_garbage":
        return [
            (c.key("recovery", pad20(sess.epoch + 1), pad20(0), "plan"), GARBAGE),
            (c.key("recovery", pad20(sess.epoch + 1), pad20(0), "ranks", pad20(0)), GARBAGE),
        ]
    if name == "version_key_not_utf8":
        return [((vpre + "/").encode() + b"\xff\xfe/\x80", GARBAGE)]
    if name == "manifest_key_not_utf8":  # a key inside the manifest blob's range (where its chunks live)
        return [(mkey.encode() + b"/\xff\xfe", GARBAGE)]
    if name == "layout_key_not_utf8":
        return [(lkey.encode() + b"/\xff\xfe", GARBAGE)]
    if name == "stray_key":
        return [(c.key("zzz", "stray"), GARBAGE)]
    raise ValueError(f"unknown hostile record {name!r}")


def _blob_bytes(client: Any, key: str) -> bytes:
    from astate_store.catalog.blobs import blob_from_kvs
    from astate_store.etcd.client import range_end

    kvs = list(client.raw.get_range(key, range_end(key)))
    data = blob_from_kvs(key, kvs)
    assert data is not None, key
    return data


def _attempt(
    res: list[dict[str, Any]],
    what: str,
    fn: Callable[[], Any],
    *,
    pull: Mapping[str, Any] | None = None,
    size: str = "small",
) -> Any:
    """Run one store operation; record its result (exact bytes for a pull) or its error."""
    from astate_store import AStateError

    r: dict[str, Any] = {"what": what}
    try:
        out = fn()
        r["ok"] = True
        if pull is not None:
            r.update(pull=True, step=out, bad=check_buffers(size, pull, out))
            r["exact"] = not r["bad"]
        else:
            r["result"] = (
                out if isinstance(out, (int, float, str, bool, type(None), list)) else repr(out)[:200]
            )
    except AStateError as exc:
        r.update(ok=False, typed=True, etype=type(exc).__name__, msg=str(exc)[:300])
    except Exception as exc:
        r.update(
            ok=False,
            typed=False,
            etype=type(exc).__name__,
            msg=str(exc)[:300],
            tb=traceback.format_exc()[-1500:],
        )
    res.append(r)
    return r


def op_hostile_record(state: dict[str, Any], endpoint: str, name: str) -> list[dict[str, Any]]:
    """A fresh namespace: one publisher commits step 1, a bad record is written over the catalog
    with the raw client, then fresh consumers pull, the publisher puts step 2 and 3, consumers pull
    again (and, for checkpoint and recovery records, restore / recover): each must be exact bytes
    or a typed error."""
    size = "small"
    ns = "fh-" + uuid.uuid4().hex[:10]
    res: list[dict[str, Any]] = []
    pub = open_publisher(endpoint, ns, "a", 0, 1, size, retire_timeout=2.0, lease_ttl=3.0)
    stores = [pub[0]]
    try:
        put_step(pub, 1, True)
        pre = open_store(endpoint, ns, read_timeout=5.0, lease_ttl=3.0)
        stores.append(pre)
        b0 = make_buffers(size, "whole")
        _attempt(res, "baseline pull", lambda: pre.get_into(b0, timeout=5), pull=b0)
        pairs = _bad_record(name, pub[0], pre, 1)
        for k, v in pairs:
            pub[0].catalog.client.raw.put(k, v)
        res.append(
            {"what": "wrote", "ok": True, "keys": [k if isinstance(k, str) else repr(k) for k, _ in pairs]}
        )
        con = open_store(endpoint, ns, read_timeout=5.0, lease_ttl=3.0)
        stores.append(con)
        for i, lay in enumerate(("whole", "cols1")):
            bufs = make_buffers(size, lay)
            poison(bufs)
            _attempt(res, f"fresh pull {lay}", lambda: con.get_into(bufs, timeout=1.5), pull=bufs)
        _attempt(res, "latest", lambda: con.latest())
        _attempt(res, "committed_steps", lambda: con.catalog.versions.committed_steps())
        for s in (2, 3):
            _attempt(res, f"put {s}", lambda: put_step(pub, s, True))
        for lay in ("whole", "cols0"):
            bufs = make_buffers(size, lay)
            poison(bufs)
            _attempt(res, f"pull after puts {lay}", lambda: con.get_into(bufs, timeout=1.5), pull=bufs)
        bufs = make_buffers(size, "whole")
        poison(bufs)
        _attempt(res, "steady consumer pull", lambda: pre.get_into(bufs, timeout=1.5), pull=bufs)
        if name.startswith("checkpoint"):
            bufs = make_buffers(size, "whole")
            poison(bufs)
            _attempt(res, "restore", lambda: con.restore(bufs), pull=bufs)
        if name.startswith("recovery") or name.startswith("epoch") or name.startswith("session"):
            # A restarted publisher session recovers (fences the old one, agrees, republishes).
            pub2 = open_publisher(endpoint, ns, "b", 0, 1, size, retire_timeout=2.0, lease_ttl=3.0)
            stores.append(pub2[0])
            blank = dict(pub2[1])
            poison(blank)

            def recover() -> Any:
                got = pub2[0].recover(blank, timeout=8)
                return got

            r = _attempt(res, "recover", recover)
            if r.get("ok") and r.get("result") is not None:
                bad = check_buffers(size, blank, int(r["result"]))
                r.update(pull=True, step=r["result"], bad=bad, exact=not bad)
    finally:
        close_all(stores)
    return res


HOSTILE_API: tuple[str, ...] = (
    "get_unknown_name",
    "get_wrong_global_shape",
    "get_int_dtype",
    "get_box_out_of_bounds",
    "get_non_tensor_list",
    "get_numpy_array",
    "get_none_value",
    "get_name_not_str",
    "get_empty_mapping",
    "get_aliased_buffers",
    "get_overlapping_strides",
    "get_step_negative",
    "get_step_str",
    "get_step_float",
    "get_step_bool",
    "get_step_huge",
    "get_timeout_negative",
    "get_future_step",
    "get_bf16_conversion",
    "get_strided_view",
    "get_not_a_mapping",
    "get_shard_wrong_rank",
    "put_step_negative",
    "put_step_none",
    "put_step_huge",
    "put_stale_step",
    "put_empty",
    "put_bad_name_slashes",
    "put_bad_name_space",
    "put_name_too_long",
    "put_complex_dtype",
    "put_non_tensor",
    "put_shard_out_of_bounds",
    "put_changed_global_shape",
    "put_aliased",
    "serve_unfilled_buffers",
    "serve_wrong_step",
    "bad_namespace",
    "bad_rank",
    "retire_without_put",
    "checkpoint_uncommitted_step",
    "restore_no_checkpoint",
)


def op_hostile_api(
    state: dict[str, Any], endpoint: str, names: Sequence[str]
) -> dict[str, list[dict[str, Any]]]:
    """Bad API input, one after another on the same stores (a bad call must not poison them):
    each result is followed by a good pull that must be exact."""
    torch = lazy_torch()
    from astate_store import Shard

    size = "small"
    ns = "fa-" + uuid.uuid4().hex[:10]
    out: dict[str, list[dict[str, Any]]] = {}
    pub = open_publisher(endpoint, ns, "a", 0, 1, size, retire_timeout=2.0, lease_ttl=5.0)
    con = open_store(endpoint, ns, read_timeout=5.0, lease_ttl=5.0)
    stores = [pub[0], con]
    other: list[Any] = []
    step = [1]
    try:
        put_step(pub, 1, True)
        good = make_buffers(size, "whole")
        shape = spec(size)["w"][0]

        def get(bufs: Any, **kw: Any) -> Any:
            kw.setdefault("timeout", 1)
            return con.get_into(bufs, **kw)

        def put(tensors: Any, s: Any = None, **kw: Any) -> Any:
            return pub[0].put(step[0] + 1 if s is None else s, tensors, **kw)

        def bad_rank() -> Any:  # rank 2 of a world of 2
            other.append(open_store(endpoint, ns + "x", rank=2, world_size=2))
            return other[-1].put(1, {"b": torch.zeros(4)})

        w = torch.zeros(shape)
        cases: dict[str, tuple[Callable[[], Any], Any]] = {
            "get_unknown_name": (lambda: get({"w": w, "nope": torch.zeros(3)}), None),
            "get_wrong_global_shape": (lambda: get({"w": torch.zeros(shape[0], shape[1] - 1)}), None),
            "get_int_dtype": (lambda: get({"w": torch.zeros(shape, dtype=torch.int32)}), None),
            "get_box_out_of_bounds": (
                lambda: get({"w": Shard(torch.zeros(10, shape[1]), (shape[0] - 5, 0), shape)}),
                None,
            ),
            "get_non_tensor_list": (lambda: get({"w": [[0.0] * shape[1]] * shape[0]}), None),
            "get_numpy_array": (lambda: get({"w": w.numpy()}), None),
            "get_none_value": (lambda: get({"w": None}), None),
            "get_name_not_str": (lambda: get({7: w}), None),
            "get_empty_mapping": (lambda: get({}), None),
            "get_aliased_buffers": (lambda: get({"w": w, "b": w[0]}), None),
            "get_overlapping_strides": (
                lambda: get({"w": torch.zeros(shape[1]).as_strided(shape, (0, 1))}),
                None,
            ),
            "get_step_negative": (lambda: get(good, step=-1), good),
            "get_step_str": (lambda: get(good, step="1"), good),
            "get_step_float": (lambda: get(good, step=1.5), good),
            "get_step_bool": (lambda: get(good, step=True), good),
            "get_step_huge": (lambda: get(good, step=10**30), good),
            "get_timeout_negative": (lambda: get(good, timeout=-5), good),
            "get_future_step": (lambda: get(good, step=step[0] + 1000, timeout=0.5), good),
            "get_bf16_conversion": (lambda: get(bf16), bf16)
            if (bf16 := make_buffers(size, "bf16"))
            else (None, None),
            "get_strided_view": (lambda: get(sv), sv)
            if (sv := make_buffers(size, "strided"))
            else (None, None),
            "get_not_a_mapping": (lambda: get([("w", w)]), None),
            "get_shard_wrong_rank": (lambda: get({"w": Shard(torch.zeros(4), (0, 0), shape)}), None),
            "put_step_negative": (lambda: put(pub[1], -1), None),
            "put_step_none": (lambda: pub[0].put(None, pub[1]), None),
            "put_step_huge": (lambda: put(pub[1], 10**19), None),
            "put_stale_step": (lambda: put(pub[1], 0), None),
            "put_empty": (lambda: put({}), None),
            "put_bad_name_slashes": (lambda: put({**pub[1], "a//b": torch.zeros(2)}), None),
            "put_bad_name_space": (lambda: put({**pub[1], "a b": torch.zeros(2)}), None),
            "put_name_too_long": (lambda: put({**pub[1], "x" * 600: torch.zeros(2)}), None),
            "put_complex_dtype": (lambda: put({**pub[1], "z": torch.zeros(2, dtype=torch.complex64)}), None),
            "put_non_tensor": (lambda: put({**pub[1], "z": [1.0, 2.0]}), None),
            "put_shard_out_of_bounds": (
                lambda: put({**pub[1], "w": Shard(torch.zeros(4, 4), (shape[0] - 2, 0), shape)}),
                None,
            ),
            "put_changed_global_shape": (lambda: put({**pub[1], "b": torch.zeros(shape[1] + 1)}), None),
            "put_aliased": (lambda: put({**pub[1], "alias": tensor_of(pub[1]["w"])[0]}), None),
            "serve_unfilled_buffers": (lambda: con.serve(step[0], make_buffers(size, "whole")), None),
            "serve_wrong_step": (lambda: con.serve(step[0] + 7, good), None),
            "bad_namespace": (lambda: other.append(open_store(endpoint, "a/b")), None),
            "bad_rank": (bad_rank, None),
            "retire_without_put": (
                lambda: _pub_track(other, endpoint, ns + "y", 0, 1, size)[0].retire(timeout=1),
                None,
            ),
            "checkpoint_uncommitted_step": (
                lambda: pub[0].checkpoint(step[0] + 50, tempfile.mkdtemp(prefix="astate-fault-ckpt-")),
                None,
            ),
            "restore_no_checkpoint": (lambda: con.restore(make_buffers(size, "whole")), None),
        }
        for name in names:
            res: list[dict[str, Any]] = []
            fn, pull = cases[name]
            poison(good)
            if pull is not None and pull is not good:
                poison(pull)
            r = _attempt(res, name, fn, pull=pull)
            if name.startswith("put") and r.get("ok") and r.get("result") is not None:
                step[0] += (
                    1  # a put that was accepted published a step (good values: the next pull checks them)
                )
                res[-1]["note"] = "accepted"
            if name.startswith("put") and r.get("ok"):
                # The accepted put published tensors other than the model's: the next good put restores them.
                pass
            # The store still works: a good put and a good pull, exact.
            step[0] += 1
            _attempt(res, "good put", lambda: put_step(pub, step[0], True))
            poison(good)
            _attempt(res, "good pull", lambda: con.get_into(good, step=step[0], timeout=5), pull=good)
            out[name] = res
    finally:
        for s in stores + [o[0] if isinstance(o, tuple) else o for o in other]:
            try:
                s.close()
            except Exception:
                pass
    return out


def _pub_track(other: list[Any], endpoint: str, ns: str, rank: int, world: int, size: str) -> Any:
    p = open_publisher(endpoint, ns, "t", rank, world, size)
    other.append(p)
    return p
