"""Entry points run inside network namespaces (``ip netns exec NS python -m tests._netns_worker ...``).

Each prints JSON lines on stdout and exits when its stdin closes, so the test controls its lifetime.
"""

from __future__ import annotations

import json
import sys

import torch


def _emit(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def _weights(step: int) -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(256 * 1024, dtype=torch.float32).reshape(256, 1024) + step,
        "b": torch.full((1024,), float(step)),
    }


def main() -> None:
    role = sys.argv[1]
    if role == "etcd":
        from astate_store.etcd.embedded import EmbeddedEtcd

        with EmbeddedEtcd(host=sys.argv[2]) as e:
            _emit(endpoint=e.endpoint)
            sys.stdin.read()
        return
    from astate_store import Shard
    from astate_store.store import Store

    endpoint, ns = sys.argv[2], sys.argv[3]
    if role == "publish":
        rank = int(sys.argv[4])
        with Store(ns, endpoint=endpoint, rank=rank, world_size=2, transport="auto", session_id="netns") as s:
            for step in (1, 2):
                full = _weights(step)
                s.put(
                    step,
                    {
                        "w": Shard(
                            full["w"][rank * 128 : (rank + 1) * 128].clone(), (rank * 128, 0), (256, 1024)
                        ),
                        "b": full["b"],
                    },
                )
            _emit(put=2, rank=rank)
            sys.stdin.read()
    elif role == "consume":
        with Store(ns, endpoint=endpoint, transport="auto") as s:
            cols = {"w": Shard(torch.zeros(256, 512), (0, 512), (256, 1024)), "b": torch.zeros(1024)}
            got = s.get_into(cols, step=2, timeout=60)
            want = _weights(got)
            exact = bool(
                torch.equal(cols["w"].tensor, want["w"][:, 512:]) and torch.equal(cols["b"], want["b"])
            )
            peers = [s.transport.peer_info(p).lanes for p in s.transport.peers]
            streamed = [s.transport.peer_info(p).streamed for p in s.transport.peers]
            _emit(
                got=got,
                exact=exact,
                tcp=all("tcp" in p for p in peers),
                peers=len(peers),
                info=peers[0][:400],
                streamed=streamed,
                streamed_bytes=s.transport.streamed_bytes,
            )


if __name__ == "__main__":
    main()
