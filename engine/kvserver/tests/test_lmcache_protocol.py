"""LMCache's own ``lm://`` client against the KV server (real sockets on loopback), and the
protocol's edges spoken by hand: refusals, LIST, a header that is no command."""

from __future__ import annotations

import time

import torch
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.protocol import (
    ClientCommand,
    ClientMetaMessage,
    ServerMetaMessage,
    ServerReturnCode,
)

from agentserving.engine.vllm.hashes import wire_hash
from testkit.kvserver import CHUNK_BYTES, LmClient, raw_connection, recv_exactly


def header(command: ClientCommand, key=None, length: int = 0) -> bytes:  # type: ignore[no-untyped-def]
    key = key if key is not None else LmClient.key(1)
    return ClientMetaMessage(command, key, length, MemoryFormat(1), torch.float16,
                             torch.Size([length, 0, 0, 0])).serialize()


def reply(sock) -> ServerMetaMessage:  # type: ignore[no-untyped-def]
    return ServerMetaMessage.deserialize(recv_exactly(sock, ServerMetaMessage.packlength()))


def test_lmcache_client_gets_back_exactly_what_it_put(kvserver, lm_client_factory):
    client = lm_client_factory(kvserver.lm_port)
    keys = [client.key(h) for h in (0x1234, -0x77, (1 << 200) + 5)]  # signed and wide hashes
    objs = [client.chunk(seed) for seed in range(3)]
    for key, obj in zip(keys, objs, strict=True):
        client.put(key, obj)
    assert all(client.exists(k) for k in keys)
    assert not client.exists(client.key(0xdead))
    assert client.get(client.key(0xdead)) is None
    for key, obj in zip(keys, objs, strict=True):
        got = client.get(key)
        assert got is not None
        assert bytes(got.byte_array) == bytes(obj.byte_array)
        assert (got.get_shape(), got.get_dtype(), got.get_memory_format()) == (
            obj.get_shape(), obj.get_dtype(), obj.get_memory_format())
    # held under the chunk hashes the kvindex and the memory API use
    assert {e.chunk for e in kvserver.store.listing()[1]} == {wire_hash(k.chunk_hash)
                                                             for k in keys}
    assert kvserver.metric("agentserving_kvserver_hits_total", 'command="GET"') == 3
    assert kvserver.metric("agentserving_kvserver_misses_total", 'command="EXIST"') == 1
    assert kvserver.metric("agentserving_kvserver_put_bytes_total") == 3 * CHUNK_BYTES


def test_a_put_flood_past_the_bound_evicts_least_recently_used_first(kvserver_factory,
                                                                    lm_client_factory):
    server = kvserver_factory(capacity_bytes=5 * CHUNK_BYTES)
    client = lm_client_factory(server.lm_port)
    keys = [client.key(0x100 + i) for i in range(8)]
    objs = [client.chunk(i) for i in range(8)]
    for key, obj in zip(keys[:5], objs[:5], strict=True):
        client.put(key, obj)
    assert client.get(keys[0]) is not None  # key 0 becomes the most recently used
    for key, obj in zip(keys[5:], objs[5:], strict=True):
        client.put(key, obj)
        assert client.exists(key)  # answered once the PUT before it is stored
        assert server.store.used_bytes <= server.store.capacity_bytes
    held = [client.exists(k) for k in keys]
    assert held == [True, False, False, False, True, True, True, True]
    assert bytes(client.get(keys[0]).byte_array) == bytes(objs[0].byte_array)
    assert server.metric("agentserving_kvserver_evictions_total", 'reason="lru"') == 3
    assert server.metric("agentserving_kvserver_evicted_bytes_total",
                         'reason="lru"') == 3 * CHUNK_BYTES
    assert server.metric("agentserving_kvserver_stored_bytes") == 5 * CHUNK_BYTES


def test_exist_after_puts_on_one_connection_sees_them_stored(kvserver, lm_client_factory):
    """LMCache's prefill flush barrier: PUTs, then an EXIST of the last key on the same
    connection; the answer comes only after every PUT before it was stored."""
    client = lm_client_factory(kvserver.lm_port)
    for round_ in range(5):
        keys = [client.key(round_ * 1000 + i) for i in range(20)]
        for i, key in enumerate(keys):
            client.put(key, client.chunk(i))
        assert client.exists(keys[-1])
        assert all(kvserver.store.contains(k.to_string()) for k in keys)


def test_health_list_and_an_oversized_put_on_one_connection(kvserver_factory):
    server = kvserver_factory(capacity_bytes=1000)
    with raw_connection(server.lm_port) as sock:
        sock.sendall(header(ClientCommand.HEALTH))
        assert reply(sock).code == ServerReturnCode.SUCCESS
        sock.sendall(header(ClientCommand.LIST))
        assert reply(sock).code == ServerReturnCode.FAIL
        big = LmClient.key(0xb16)
        sock.sendall(header(ClientCommand.PUT, big, 4096) + b"x" * 4096)  # over the bound
        small = LmClient.key(0x5a)
        sock.sendall(header(ClientCommand.PUT, small, 100) + b"y" * 100)
        sock.sendall(header(ClientCommand.EXIST, big))
        assert reply(sock).code == ServerReturnCode.FAIL  # refused, and the stream in step
        sock.sendall(header(ClientCommand.GET, small))
        meta = reply(sock)
        assert (meta.code, meta.length) == (ServerReturnCode.SUCCESS, 100)
        assert recv_exactly(sock, 100) == b"y" * 100
    assert server.metric("agentserving_kvserver_evictions_total", 'reason="refused"') == 1
    assert server.metric("agentserving_kvserver_evicted_bytes_total",
                         'reason="refused"') == 4096
    assert server.store.used_bytes == 100


def test_a_header_that_is_no_command_closes_only_its_connection(kvserver):
    with raw_connection(kvserver.lm_port) as sock:
        sock.sendall(b"\x63" * ClientMetaMessage.packlength())  # command 0x63636363
        assert sock.recv(1) == b""  # closed
    bad_key = bytearray(header(ClientCommand.HEALTH))
    bad_key[36:] = b"not-a-key".ljust(len(bad_key) - 36)
    with raw_connection(kvserver.lm_port) as sock:
        sock.sendall(bytes(bad_key))
        assert sock.recv(1) == b""
    assert kvserver.metric("agentserving_kvserver_protocol_errors_total") == 2
    with raw_connection(kvserver.lm_port) as sock:  # the server itself is fine
        sock.sendall(header(ClientCommand.HEALTH))
        assert reply(sock).code == ServerReturnCode.SUCCESS


def test_a_client_gone_mid_payload_stores_nothing(kvserver):
    with raw_connection(kvserver.lm_port) as sock:
        sock.sendall(header(ClientCommand.PUT, LmClient.key(0xcafe), 5000) + b"z" * 1000)
    deadline = time.monotonic() + 5
    while kvserver.metric("agentserving_kvserver_connections") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kvserver.metric("agentserving_kvserver_connections") == 0
    assert len(kvserver.store) == 0 and kvserver.store.used_bytes == 0
