"""A subscriber of vLLM's KV events, as a router in front of vLLM engines runs one: it decodes
every message with vLLM's msgspec schema (declared below as vllm/distributed/kv_events.py
declares it), so a message that does not follow the schema fails here, and prints each event as
one JSON line for the test that started it.

It connects a SUB socket first, then asks the publisher's ROUTER socket to replay from sequence
0, so nothing published before it joined is missed; a sequence number that jumps ahead, or no
message for a while, makes it ask for a replay of what it lacks. Events are printed once each,
in sequence order.

usage: kv_events_subscriber.py PUB_ENDPOINT REPLAY_ENDPOINT [TOPIC]
"""

import json
import sys
from typing import Any, Optional, Union

import msgspec
import zmq

ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def hexes(hashes):
    return [h.hex() if isinstance(h, bytes) else h for h in hashes]


def as_json(seq, batch, event):
    out = {"seq": seq, "ts": batch.ts, "type": type(event).__name__}
    if batch.data_parallel_rank is not None:
        out["dataParallelRank"] = batch.data_parallel_rank
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        out.update(
            blockHashes=hexes(event.block_hashes),
            parentBlockHash=parent.hex() if isinstance(parent, bytes) else parent,
            tokenIds=event.token_ids,
            blockSize=event.block_size,
            medium=event.medium,
            loraId=event.lora_id,
        )
    elif isinstance(event, BlockRemoved):
        out.update(blockHashes=hexes(event.block_hashes), medium=event.medium)
    return json.dumps(out)


def main():
    pub_endpoint, replay_endpoint = sys.argv[1], sys.argv[2]
    topic = sys.argv[3].encode() if len(sys.argv) > 3 else b""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(pub_endpoint)
    replay = ctx.socket(zmq.DEALER)
    replay.connect(replay_endpoint)
    expected = 0

    def emit(seq, payload):
        nonlocal expected
        if seq != expected:
            return
        batch = decoder.decode(payload)
        for event in batch.events:
            print(as_json(seq, batch, event), flush=True)
        expected += 1

    def catch_up():
        replay.send_multipart([b"", expected.to_bytes(8, "big")])
        while True:
            _, seq_bytes, payload = replay.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq < 0:
                return
            emit(seq, payload)

    print(json.dumps({"ready": True}), flush=True)
    catch_up()
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while True:
        if not poller.poll(200):
            # quiet: ask for anything published before the subscription took effect
            catch_up()
            continue
        got_topic, seq_bytes, payload = sub.recv_multipart()
        assert got_topic == topic, got_topic
        seq = int.from_bytes(seq_bytes, "big")
        if seq > expected:
            catch_up()
        emit(seq, payload)


if __name__ == "__main__":
    main()
