"""Redis backends: the kvindex's directory shared by every kvindex replica in a cluster.

Each operation is one Lua script, loaded once and called by EVALSHA, so it is atomic and costs
one round trip. The key layout (``P`` is ``key_prefix``, default ``as:``):

- ``P pods`` (set): every registered pod, live or lapsed-but-not-yet-reaped.
- ``P p:<pod>`` (hash): the registration (``reg``, JSON), ``role``, timestamps, ``seq``, ``rs``
  (needs resync), per-tier chunk counts ``n1/n2/n4`` and bytes ``b1/b2/b4`` (by tier bit).
- ``P l:<pod>`` (string with a PX TTL): the lease. A pod is live exactly while this key
  exists, so every read skips a lapsed pod at once, before ``expire_leases`` reaps it.
- ``P slots`` (hash ``slot -> pod``): each registered pod holds a small integer slot (the
  lowest free one), released when it is dropped.
- ``P chunks`` (hash ``chunk -> holders``): the per-chunk view. ``holders`` is a byte string
  whose byte ``slot`` (1-based) is the tier mask of the pod in that slot, 0 where it holds
  nothing; trailing zeros are trimmed and an empty string is deleted. One hash rather than a
  key per chunk, and bytes rather than ``{pod: mask}`` fields, because that is what makes the
  targets reachable: a lookup reads a 512-chunk chain with one HMGET of 512 short strings and
  walks it run by run (consecutive chunks with the same holders compare as one interned Lua
  string), and an event batch updates its chunks with one HMGET and one HSET instead of one
  command per chunk.
- ``P pc:<pod>`` (hash ``chunk -> mask``): the per-pod view, for snapshots, ``cleared`` events
  and dropping a pod. Every script writes both views together, so they never disagree.
- Sessions: ``P s:<sid>`` (hash: parent, created/updated, and the lifecycle: ``exp`` expiry,
  ``pin`` pinned-until, ``prio`` priority, each absent when never/none/default), ``P si:<sid>``
  (hash ``intent -> JSON list``), ``P sc:<sid>`` (hash ``chunk -> number of the session's
  intents naming it``), ``P refs`` (hash ``chunk -> number of sessions referencing it``),
  ``P cr:<chunk>`` (set: the sessions referencing it, what an evict's protection is decided
  from) and ``P sexp`` (sorted set ``sid`` by expiry, for the session reaper). Times are the
  client's clock, passed in as ``repr`` strings and stored as given, so they read back exactly.
- Stored responses: ``P resp:<key>`` (string with a PX TTL: Redis expires it, no reaper) and
  ``P resps`` (sorted set ``key`` by write time), which bounds how many are kept: a put past
  the bound pops the oldest members and deletes their strings. Members whose string expired
  stay until popped, so the set never holds more than the bound.

The scripts touch keys they compute from their arguments, which standalone Redis (and
Sentinel) allows; Redis Cluster is not supported (``P chunks`` is one key by design).
Scripts pass masks to Redis as strings: Redis formats Lua numbers with snprintf, slow in bulk.

Failure contract: any connection error or timeout raises ``BackendUnavailable``; after one, a
circuit breaker fails every call at once, without touching a socket, for ``breaker_s``, then
lets calls probe again. The client reconnects by itself once Redis answers; a stale pooled
connection (Redis restarted) is retried once on a fresh one, transparently. A pooled
connection found on a replica (a failover moved the master under it) is unavailable too, and
the pool is emptied, so that every call reconnects to the master the sentinels name now.

High availability: a ``redis+sentinel://`` store (``sentinel_parts``) reaches whichever Redis
the sentinels name master, so a failover costs the calls in flight and the breaker's second,
then every replica of the kvindex carries on against the promoted replica. Redis replicates
asynchronously, so a master killed right after a write may take it along; with ``min_acks``
(``--redis-min-acks``) every write script is followed by ``WAIT`` on its own connection and
acknowledged only once that many replicas hold it (else 503, ``NotReplicated``): what the
kvindex acknowledged survives the failover. The proxy's routing records (``put_route``) are
soft state and not waited on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

try:
    import hiredis
except ImportError:  # the pure-Python packer and parser still work, only slower
    hiredis = None

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import BusyLoadingError, ReadOnlyError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from agentserving.core.schemas import (
    DEFAULT_PRIORITY,
    TIERS_FASTEST_FIRST,
    ChunkLocation,
    ChunkSnapshot,
    EventBatch,
    EventBatchResult,
    EventOp,
    LeaseInfo,
    PodInfo,
    PodRegistration,
    PodRole,
    SessionInfo,
)
from agentserving.kvindex.index.base import (
    TIER_BITS,
    BackendUnavailable,
    PrefixCount,
    SessionExists,
    SessionLife,
    SessionRefs,
    UnknownPod,
    UnknownSession,
    session_expiry,
    tiers_of,
)

T = TypeVar("T")

_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, ReadOnlyError, OSError)

# ---------------------------------------------------------------------------------------------
# Lua. Every script starts with this library; ARGV[1] is always the key prefix.

_LIB = r"""
local P = ARGV[1]
local W = 1000  -- fields per variadic call (Lua's unpack limit is ~8000 values)
local function live(pod) return redis.call('EXISTS', P .. 'l:' .. pod) == 1 end
local function window(cmd, key, list)  -- W is even: field/value pairs stay together
  for i = 1, #list, W do redis.call(cmd, key, unpack(list, i, math.min(i + W - 1, #list))) end
end
local function hmget(key, list)  -- HMGET of any number of fields
  local out = {}
  for i = 1, #list, W do
    local got = redis.call('HMGET', key, unpack(list, i, math.min(i + W - 1, #list)))
    for k = 1, #got do out[#out + 1] = got[k] end
  end
  return out
end
-- A chunk's holders: field <chunk> of the hash P chunks is a string whose byte ``slot`` is the
-- tier mask of the pod with that slot (0: none); trailing zeros are trimmed, '' is deleted.
local CK = P .. 'chunks'
local CHAR = {[0] = '\0', '\1', '\2', '\3', '\4', '\5', '\6', '\7'}
-- Masks as strings: Redis formats a Lua number argument with snprintf, which is slow in bulk.
local DIGIT = {'1', '2', '3', '4', '5', '6', '7'}
local ZEROS = {[0] = ''}
local function with_mask(row, slot, m)
  row = row or ''
  if #row < slot then
    if m == 0 then return row end
    local n = slot - 1 - #row
    local z = ZEROS[n]
    if z == nil then z = string.rep('\0', n); ZEROS[n] = z end
    return row .. z .. CHAR[m]
  end
  row = string.sub(row, 1, slot - 1) .. CHAR[m] .. string.sub(row, slot + 1)
  if m == 0 then row = string.gsub(row, '%z+$', '') end
  return row
end
-- Set the pod's byte to masks[j] in the holders of chunks[j] (one read, one or two writes).
local function set_masks(slot, chunks, masks)
  if #chunks == 0 then return end
  local rows = hmget(CK, chunks)
  local sets, dels = {}, {}
  for j = 1, #chunks do
    local row = with_mask(rows[j], slot, masks[j])
    if row == '' then dels[#dels + 1] = chunks[j]
    else sets[#sets + 1] = chunks[j]; sets[#sets + 1] = row end
  end
  if #sets > 0 then window('HSET', CK, sets) end
  if #dels > 0 then window('HDEL', CK, dels) end
end
local function alloc_slot(pod)
  local k = 1
  while redis.call('HSETNX', P .. 'slots', k, pod) == 0 do k = k + 1 end
  return k
end
local function drop(pod)
  local pk, pc = P .. 'p:' .. pod, P .. 'pc:' .. pod
  local slot = tonumber(redis.call('HGET', pk, 'slot'))
  if slot then
    local chunks, zeros = redis.call('HKEYS', pc), {}
    for i = 1, #chunks do zeros[i] = 0 end
    set_masks(slot, chunks, zeros)
    redis.call('HDEL', P .. 'slots', slot)
  end
  redis.call('DEL', pc, pk, P .. 'l:' .. pod)
  redis.call('SREM', P .. 'pods', pod)
end
local POD_FIELDS = {'reg', 'ra', 'hb', 'exp', 'seq', 'rs', 'n1', 'n2', 'n4', 'b1', 'b2', 'b4'}
local function pod_info(pod) return redis.call('HMGET', P .. 'p:' .. pod, unpack(POD_FIELDS)) end
"""

# ARGV: P, pod, reg_json, role, now, expires_at, ttl_ms
_REGISTER = _LIB + r"""
local pod = ARGV[2]
local pk = P .. 'p:' .. pod
if redis.call('EXISTS', pk) == 1 and not live(pod) then drop(pod) end
if redis.call('EXISTS', pk) == 0 then
  redis.call('HSET', pk, 'reg', ARGV[3], 'role', ARGV[4], 'ra', ARGV[5], 'hb', ARGV[5],
             'exp', ARGV[6], 'seq', -1, 'rs', 0, 'n1', 0, 'n2', 0, 'n4', 0,
             'b1', 0, 'b2', 0, 'b4', 0, 'slot', alloc_slot(pod))
  redis.call('SADD', P .. 'pods', pod)
else
  redis.call('HSET', pk, 'reg', ARGV[3], 'role', ARGV[4], 'hb', ARGV[5], 'exp', ARGV[6])
end
redis.call('SET', P .. 'l:' .. pod, '1', 'PX', ARGV[7])
return pod_info(pod)
"""

# ARGV: P, pod, now, expires_at, ttl_ms
_HEARTBEAT = _LIB + r"""
local pod = ARGV[2]
if not live(pod) then return false end
local pk = P .. 'p:' .. pod
redis.call('HSET', pk, 'hb', ARGV[3], 'exp', ARGV[4])
redis.call('SET', P .. 'l:' .. pod, '1', 'PX', ARGV[5])
return redis.call('HMGET', pk, 'exp', 'seq', 'rs')
"""

# ARGV: P, pod
_DEREGISTER = _LIB + r"""
if redis.call('SISMEMBER', P .. 'pods', ARGV[2]) == 0 then return 0 end
drop(ARGV[2])
return 1
"""

# ARGV: P, pod
_GET_POD = _LIB + r"""
if not live(ARGV[2]) then return false end
return pod_info(ARGV[2])
"""

# ARGV: P, pod. False when the pod is not live; else {chunk, mask, ...}.
_POD_CHUNKS = _LIB + r"""
if not live(ARGV[2]) then return false end
return redis.call('HGETALL', P .. 'pc:' .. ARGV[2])
"""

# ARGV: P
_LIST_PODS = _LIB + r"""
local names = redis.call('SMEMBERS', P .. 'pods')
table.sort(names)
local out = {}
for _, pod in ipairs(names) do
  if live(pod) then out[#out + 1] = pod_info(pod) end
end
return out
"""

# ARGV: P
_EXPIRE = _LIB + r"""
local names = redis.call('SMEMBERS', P .. 'pods')
table.sort(names)
local gone = {}
for _, pod in ipairs(names) do
  if not live(pod) then drop(pod); gone[#gone + 1] = pod end
end
return gone
"""

# ARGV: P, pod, seq, then per event: op ('s'|'r'|'c'), tier bit (0: every tier), bytes (-1: none),
# n, n chunk hashes. Returns false (unknown pod) or {applied, chunk_events, needs_resync}.
_APPLY = _LIB + r"""
local pod = ARGV[2]
if not live(pod) then return false end
local pk, pc = P .. 'p:' .. pod, P .. 'pc:' .. pod
local seq = tonumber(ARGV[3])
local st = redis.call('HMGET', pk, 'seq', 'rs', 'b1', 'b2', 'b4', 'slot')
local last, rs, slot = tonumber(st[1]), tonumber(st[2]), tonumber(st[6])
if last >= 0 then
  if seq <= last then return {0, 0, rs} end
  if seq ~= last + 1 then rs = 1 end
end
local used = {[1] = tonumber(st[3]), [2] = tonumber(st[4]), [4] = tonumber(st[5])}
local dn = {[1] = 0, [2] = 0, [4] = 0}  -- change in the pod's chunk count per tier bit
-- Writes are collected per window of chunks and done before the next window is read, so a
-- chunk named again later in the batch is read as already changed.
local csets, cdels, psets, pdels = {}, {}, {}, {}
local function change(c, row, new)
  row = with_mask(row, slot, new)
  if row == '' then cdels[#cdels + 1] = c
  else csets[#csets + 1] = c; csets[#csets + 1] = row end
  if new == 0 then pdels[#pdels + 1] = c
  else psets[#psets + 1] = c; psets[#psets + 1] = DIGIT[new] end
end
local function write()
  if #csets > 0 then window('HSET', CK, csets) end
  if #cdels > 0 then window('HDEL', CK, cdels) end
  if #psets > 0 then window('HSET', pc, psets) end
  if #pdels > 0 then window('HDEL', pc, pdels) end
  csets, cdels, psets, pdels = {}, {}, {}, {}
end
local count = 0
local i = 4
while i <= #ARGV do
  local op, b, nbytes, n = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]),
                           tonumber(ARGV[i + 3])
  local first = i + 4
  i = first + n
  if op == 'c' then
    local bits = b == 0 and 7 or b
    local all = redis.call('HGETALL', pc)
    local hit, olds = {}, {}
    for k = 1, #all, 2 do
      local old = tonumber(all[k + 1])
      if bit.band(old, bits) ~= 0 then hit[#hit + 1] = all[k]; olds[#olds + 1] = old end
    end
    for s = 1, #hit, W do
      local e = math.min(s + W - 1, #hit)
      local got = redis.call('HMGET', CK, unpack(hit, s, e))
      for k = s, e do
        local row, old = got[k - s + 1], olds[k]
        local new = bit.band(old, 7 - bits)
        for tb, _ in pairs(dn) do
          if bit.band(old - new, tb) ~= 0 then dn[tb] = dn[tb] - 1 end
        end
        change(hit[k], row, new)
      end
      write()
    end
    for tb, _ in pairs(used) do
      if bit.band(bits, tb) ~= 0 then used[tb] = 0 end
    end
    count = count + 1
  else
    local stored = op == 's'
    for s = first, i - 1, W do
      local e = math.min(s + W - 1, i - 1)
      local got = redis.call('HMGET', CK, unpack(ARGV, s, e))
      local seen = {}
      for k = s, e do
        local c = ARGV[k]
        if not seen[c] then
          seen[c] = true
          local row = got[k - s + 1]
          local old = row and string.byte(row, slot) or 0
          local has = old % (b + b) >= b
          if stored and not has then
            change(c, row, old + b); dn[b] = dn[b] + 1
          elseif has and not stored then
            change(c, row, old - b); dn[b] = dn[b] - 1
          end
        end
      end
      write()
    end
    if nbytes > 0 then
      used[b] = math.max(0, used[b] + (stored and nbytes or -nbytes))
    end
    count = count + n
  end
end
redis.call('HSET', pk, 'seq', ARGV[3], 'rs', rs, 'b1', used[1], 'b2', used[2], 'b4', used[4])
for tb, d in pairs(dn) do
  if d ~= 0 then redis.call('HINCRBY', pk, 'n' .. tb, d) end
end
return {1, count, rs}
"""

# ARGV: P, pod, seq, bytes device/cpu/disk, count device/cpu/disk, then the chunks of each tier.
# Writes only the difference from what the index holds. Returns false or {exp, seq, rs}.
_REPLACE = _LIB + r"""
local pod = ARGV[2]
if not live(pod) then return false end
local pk, pc = P .. 'p:' .. pod, P .. 'pc:' .. pod
local slot = tonumber(redis.call('HGET', pk, 'slot'))
local new, n = {}, {[1] = 0, [2] = 0, [4] = 0}
local idx = 10
for t, b in ipairs({1, 2, 4}) do
  local cnt = tonumber(ARGV[6 + t])
  for k = idx, idx + cnt - 1 do
    local c = ARGV[k]
    local m = new[c] or 0
    if bit.band(m, b) == 0 then new[c] = bit.bor(m, b); n[b] = n[b] + 1 end
  end
  idx = idx + cnt
end
local all = redis.call('HGETALL', pc)
local old, dels, sets, names, masks = {}, {}, {}, {}, {}
for k = 1, #all, 2 do
  local c = all[k]
  old[c] = tonumber(all[k + 1])
  if new[c] == nil then
    dels[#dels + 1] = c
    names[#names + 1] = c; masks[#masks + 1] = 0
  end
end
for c, m in pairs(new) do
  if old[c] ~= m then
    sets[#sets + 1] = c; sets[#sets + 1] = DIGIT[m]
    names[#names + 1] = c; masks[#masks + 1] = m
  end
end
set_masks(slot, names, masks)
if #dels > 0 then window('HDEL', pc, dels) end
if #sets > 0 then window('HSET', pc, sets) end
redis.call('HSET', pk, 'seq', ARGV[3], 'rs', 0, 'b1', ARGV[4], 'b2', ARGV[5], 'b4', ARGV[6],
           'n1', n[1], 'n2', n[2], 'n4', n[4])
return redis.call('HMGET', pk, 'exp', 'seq', 'rs')
"""

# ARGV: P, role ('' for any), number of pod filters (-1: none), the filters, then the chain.
# Holder rows are read with HMGET in growing windows and walked run by run: consecutive chunks
# with the same holders and tiers (the common case: a turn's chunks were stored together) cost
# one string comparison (Lua strings are interned).
# Returns {pod, prefix_chunks, on_device, on_cpu, on_disk, ...} flattened.
_LOOKUP = _LIB + r"""
local FAST = {1, 2, 1, 3, 1, 2, 1}  -- tier mask -> index of its fastest tier (device, cpu, disk)
local role, nf = ARGV[2], tonumber(ARGV[3])
local c0 = 4 + math.max(nf, 0)
if c0 > #ARGV then return {} end
local row = redis.call('HGET', CK, ARGV[c0])
if not row then return {} end
local wanted = nil
if nf >= 0 then
  wanted = {}
  for k = 4, 3 + nf do wanted[ARGV[k]] = true end
end
-- Candidates: the live pods (passing the filters) that hold the first chunk.
local slots, pods, tallies = {}, {}, {}
for k = 1, #row do
  if string.byte(row, k) ~= 0 then
    local pod = redis.call('HGET', P .. 'slots', k)
    local ok = pod and (wanted == nil or wanted[pod]) and live(pod)
    if ok and role ~= '' then
      local r = redis.call('HGET', P .. 'p:' .. pod, 'role')
      ok = r == role or r == 'both'
    end
    if ok then
      slots[#slots + 1] = k; pods[k] = pod; tallies[k] = {0, 0, 0, 0}
    end
  end
end
local out = {}
local function finish(k)
  local t = tallies[k]
  out[#out + 1] = pods[k]; out[#out + 1] = t[4]
  out[#out + 1] = t[1]; out[#out + 1] = t[2]; out[#out + 1] = t[3]
end
local alive, run = slots, 1  -- `row` holds for `run` consecutive chunks so far
local function credit()
  for _, k in ipairs(alive) do
    local t, f = tallies[k], FAST[string.byte(row, k)]
    t[f] = t[f] + run; t[4] = t[4] + run
  end
end
local s, w = c0 + 1, 64
while s <= #ARGV and #alive > 0 do
  local e = math.min(s + w - 1, #ARGV)
  local got = redis.call('HMGET', CK, unpack(ARGV, s, e))
  for j = 1, #got do
    local nxt = got[j]
    if nxt == row then
      run = run + 1
    else
      credit()
      local still = {}
      for _, k in ipairs(alive) do
        local m = nxt and string.byte(nxt, k)
        if m and m ~= 0 then still[#still + 1] = k else finish(k) end
      end
      alive, row, run = still, nxt, 1
      if #alive == 0 then break end
    end
  end
  s, w = e + 1, math.min(w * 4, W)
end
if #alive > 0 then
  credit()
  for _, k in ipairs(alive) do finish(k) end
end
return out
"""

# ARGV: P, chunks. Returns {chunk, pod, mask, ...} for live holders.
_HOLDERS = _LIB + r"""
local names, alive, out = {}, {}, {}
local chunks = {}
for i = 2, #ARGV do chunks[i - 1] = ARGV[i] end
local rows = hmget(CK, chunks)
for i = 2, #ARGV do
  local row = rows[i - 1]
  if row then
    for k = 1, #row do
      local m = string.byte(row, k)
      if m ~= 0 then
        if names[k] == nil then
          local pod = redis.call('HGET', P .. 'slots', k)
          names[k] = pod or false
          alive[k] = pod and live(pod) or false
        end
        if alive[k] then
          out[#out + 1] = ARGV[i]; out[#out + 1] = names[k]; out[#out + 1] = m
        end
      end
    end
  end
end
return out
"""

# -------------------------------------------------------------------------------- sessions

_SLIB = _LIB + r"""
-- Count a session's references: sc[chunk] = how many of its intents name the chunk; refs[chunk]
-- = how many sessions name it, cr:<chunk> = which. ``list`` may repeat a chunk; it counts once
-- per intent.
local function addrefs(sid, list, d)
  local sc, seen = P .. 'sc:' .. sid, {}
  for _, c in ipairs(list) do
    if not seen[c] then
      seen[c] = true
      local v = redis.call('HINCRBY', sc, c, d)
      if d > 0 and v == 1 then
        redis.call('HINCRBY', P .. 'refs', c, 1)
        redis.call('SADD', P .. 'cr:' .. c, sid)
      elseif d < 0 and v <= 0 then
        redis.call('HDEL', sc, c)
        if redis.call('HINCRBY', P .. 'refs', c, -1) <= 0 then
          redis.call('HDEL', P .. 'refs', c)
        end
        redis.call('SREM', P .. 'cr:' .. c, sid)
      end
    end
  end
end
-- base.SessionLife.live: the session exists and has no expiry or `now` is before it.
local function alive(sid, now)
  local s = redis.call('HMGET', P .. 's:' .. sid, 'ca', 'exp')
  if not s[1] then return false end
  return (not s[2]) or now < tonumber(s[2])
end
-- Drop a session with its references; the chunks it referenced.
local function drop_session(sid)
  local sc = P .. 'sc:' .. sid
  local chunks = redis.call('HKEYS', sc)
  for _, c in ipairs(chunks) do
    if redis.call('HINCRBY', P .. 'refs', c, -1) <= 0 then redis.call('HDEL', P .. 'refs', c) end
    redis.call('SREM', P .. 'cr:' .. c, sid)
  end
  redis.call('DEL', P .. 's:' .. sid, P .. 'si:' .. sid, sc)
  redis.call('ZREM', P .. 'sexp', sid)
  return chunks
end
-- A write at `now`: expiry = base.session_expiry, i.e. max(idle_exp, pin) where idle_exp is
-- now + the idle TTL ('' when sessions never expire idle).
local function touch(sid, now, idle_exp)
  local sk = P .. 's:' .. sid
  redis.call('HSET', sk, 'ua', now)
  if idle_exp == '' then
    redis.call('HDEL', sk, 'exp')
    redis.call('ZREM', P .. 'sexp', sid)
    return
  end
  local pin = redis.call('HGET', sk, 'pin')
  local exp = idle_exp
  if pin and tonumber(pin) > tonumber(idle_exp) then exp = pin end
  redis.call('HSET', sk, 'exp', exp)
  redis.call('ZADD', P .. 'sexp', exp, sid)
end
local function session(sid)
  local s = redis.call('HMGET', P .. 's:' .. sid, 'parent', 'ca', 'ua', 'prio', 'pin', 'exp')
  return {s[1], s[2], s[3], s[4], s[5], s[6], redis.call('HGETALL', P .. 'si:' .. sid)}
end
"""

# ARGV: P, sid, intent, chunks JSON, now, idle_exp
_PUT_INTENT = _SLIB + r"""
local sid, intent = ARGV[2], ARGV[3]
local sk, si = P .. 's:' .. sid, P .. 'si:' .. sid
if redis.call('EXISTS', sk) == 1 and not alive(sid, tonumber(ARGV[5])) then drop_session(sid) end
if redis.call('EXISTS', sk) == 0 then
  redis.call('HSET', sk, 'parent', '', 'ca', ARGV[5], 'ua', ARGV[5])
end
addrefs(sid, cjson.decode(ARGV[4]), 1)
local old = redis.call('HGET', si, intent)
if old then addrefs(sid, cjson.decode(old), -1) end
redis.call('HSET', si, intent, ARGV[4])
touch(sid, ARGV[5], ARGV[6])
return session(sid)
"""

# ARGV: P, sid, intent, now. Returns -1 (no session), -2 (no intent) or the JSON list.
_GET_INTENT = _SLIB + r"""
if not alive(ARGV[2], tonumber(ARGV[4])) then return -1 end
return redis.call('HGET', P .. 'si:' .. ARGV[2], ARGV[3]) or -2
"""

# ARGV: P, sid, intent, now, idle_exp
_DELETE_INTENT = _SLIB + r"""
local sid, intent = ARGV[2], ARGV[3]
if not alive(sid, tonumber(ARGV[4])) then return -1 end
local old = redis.call('HGET', P .. 'si:' .. sid, intent)
if not old then return -2 end
addrefs(sid, cjson.decode(old), -1)
redis.call('HDEL', P .. 'si:' .. sid, intent)
touch(sid, ARGV[4], ARGV[5])
return session(sid)
"""

# ARGV: P, sid, now
_GET_SESSION = _SLIB + r"""
if not alive(ARGV[2], tonumber(ARGV[3])) then return false end
return session(ARGV[2])
"""

# ARGV: P, sid, now. Returns false (no such session) or {was_live, chunks}.
_CLOSE_SESSION = _SLIB + r"""
local sid = ARGV[2]
if redis.call('EXISTS', P .. 's:' .. sid) == 0 then return false end
local was_live = alive(sid, tonumber(ARGV[3])) and 1 or 0
return {was_live, drop_session(sid)}
"""

# ARGV: P, parent, child, now, idle_exp. Returns -1 (no parent), -2 (child exists) or the child.
_FORK = _SLIB + r"""
local parent, child, now = ARGV[2], ARGV[3], tonumber(ARGV[4])
if not alive(parent, now) then return -1 end
if alive(child, now) then return -2 end
if redis.call('EXISTS', P .. 's:' .. child) == 1 then drop_session(child) end
redis.call('HSET', P .. 's:' .. child, 'parent', parent, 'ca', ARGV[4], 'ua', ARGV[4])
local prio = redis.call('HGET', P .. 's:' .. parent, 'prio')
if prio then redis.call('HSET', P .. 's:' .. child, 'prio', prio) end
local intents = redis.call('HGETALL', P .. 'si:' .. parent)
if #intents > 0 then window('HSET', P .. 'si:' .. child, intents) end
local counts = redis.call('HGETALL', P .. 'sc:' .. parent)
if #counts > 0 then window('HSET', P .. 'sc:' .. child, counts) end
for k = 1, #counts, 2 do
  redis.call('HINCRBY', P .. 'refs', counts[k], 1)
  redis.call('SADD', P .. 'cr:' .. counts[k], child)
end
touch(child, ARGV[4], ARGV[5])
return session(child)
"""

# ARGV: P, sid, now, idle_exp, op ('pin' | 'release' | 'prio'), value. False: no session.
_LIFECYCLE = _SLIB + r"""
local sid, op = ARGV[2], ARGV[5]
if not alive(sid, tonumber(ARGV[3])) then return false end
local sk = P .. 's:' .. sid
if op == 'pin' then redis.call('HSET', sk, 'pin', ARGV[6])
elseif op == 'release' then redis.call('HDEL', sk, 'pin')
elseif ARGV[6] == '0' then redis.call('HDEL', sk, 'prio')
else redis.call('HSET', sk, 'prio', ARGV[6]) end
touch(sid, ARGV[3], ARGV[4])
return session(sid)
"""

# ARGV: P, also ('' for none), chunks. Returns {{chunk, n, n session ids, ...},
# {sid, exp, pin, prio, ...}} ('' for an absent field): the raw material of
# base.protected_chunks, which decides in Python for every backend.
_REFERENCES = _SLIB + r"""
local chunks = {}
for i = 3, #ARGV do chunks[i - 2] = ARGV[i] end
local counts = hmget(P .. 'refs', chunks)
local refs, seen, order = {}, {}, {}
for j, c in ipairs(chunks) do
  if counts[j] then
    local sids = redis.call('SMEMBERS', P .. 'cr:' .. c)
    refs[#refs + 1] = c; refs[#refs + 1] = #sids
    for _, sid in ipairs(sids) do
      refs[#refs + 1] = sid
      if not seen[sid] then seen[sid] = true; order[#order + 1] = sid end
    end
  end
end
local also = ARGV[2]
if also ~= '' and not seen[also] and redis.call('EXISTS', P .. 's:' .. also) == 1 then
  order[#order + 1] = also
end
local lives = {}
for _, sid in ipairs(order) do
  local f = redis.call('HMGET', P .. 's:' .. sid, 'exp', 'pin', 'prio')
  lives[#lives + 1] = sid
  lives[#lives + 1] = f[1] or ''; lives[#lives + 1] = f[2] or ''; lives[#lives + 1] = f[3] or ''
end
return {refs, lives}
"""

# ARGV: P, now, most. Drops up to `most` sessions whose expiry is at or before now.
_EXPIRE_SESSIONS = _SLIB + r"""
local gone = redis.call('ZRANGEBYSCORE', P .. 'sexp', '-inf', ARGV[2], 'LIMIT', 0, ARGV[3])
for _, sid in ipairs(gone) do drop_session(sid) end
return gone
"""


# ARGV: P, key, value, ttl ms, now, most. Keeps the value, then drops the oldest past `most`.
_PUT_STORED_RESPONSE = _LIB + r"""
local key = ARGV[2]
redis.call('SET', P .. 'resp:' .. key, ARGV[3], 'PX', ARGV[4])
redis.call('ZADD', P .. 'resps', ARGV[5], key)
local over = redis.call('ZCARD', P .. 'resps') - tonumber(ARGV[6])
if over > 0 then
  local gone = redis.call('ZPOPMIN', P .. 'resps', over)
  for i = 1, #gone, 2 do redis.call('DEL', P .. 'resp:' .. gone[i]) end
end
return over
"""

# ARGV: P, key. 1 when a live value was dropped.
_DELETE_STORED_RESPONSE = _LIB + r"""
redis.call('ZREM', P .. 'resps', ARGV[2])
return redis.call('DEL', P .. 'resp:' .. ARGV[2])
"""


# ---------------------------------------------------------------------------------------------


class RedisBackend:
    """A redis.asyncio client with the scripts registered and a circuit breaker in front."""

    _SCRIPTS: dict[str, str] = {}
    _WRITES: frozenset[str] = frozenset()  # the scripts that write (``min_acks`` waits on them)

    def __init__(self, url: str, *, key_prefix: str = "as:", connect_timeout_s: float = 0.25,
                 op_timeout_s: float = 2.0, breaker_s: float = 1.0,
                 max_connections: int = 64, min_acks: int = 0) -> None:
        self.url = url
        self._prefix = key_prefix
        self._breaker_s = breaker_s
        self._op_timeout_s = op_timeout_s
        self._min_acks = min_acks
        self._open_until = 0.0  # monotonic time until which calls fail without trying
        # One retry, on connection errors only: it reconnects a pooled connection that went
        # stale when Redis restarted (or, under Sentinel, asks again for the master after a
        # failover). Timeouts are not retried (the op may be running).
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        if url.startswith(SENTINEL_SCHEME):
            self._redis = _sentinel_master(url, connect_timeout_s, op_timeout_s, retry)
            pool = self._redis.connection_pool
        else:
            # A blocking pool: past max_connections, calls queue for a connection (up to the
            # op timeout) instead of failing, so a burst of lookups is not mistaken for an
            # outage.
            pool = aioredis.BlockingConnectionPool.from_url(
                url, decode_responses=True, socket_connect_timeout=connect_timeout_s,
                socket_timeout=op_timeout_s, max_connections=max_connections,
                timeout=op_timeout_s, retry=retry)
            self._redis = aioredis.Redis(connection_pool=pool)
        if hiredis is not None:
            pool.connection_class = _hiredis_packing(pool.connection_class)
        self._scripts = {name: self._redis.register_script(src)
                         for name, src in self._SCRIPTS.items()}

    def _unavailable(self, exc: BaseException | None) -> BackendUnavailable:
        why = f"{type(exc).__name__}: {exc}" if exc else "circuit open after a recent failure"
        return BackendUnavailable(f"redis at {_redact(self.url)} unavailable ({why})")

    async def _guard(self, make: Callable[[], Awaitable[T]]) -> T:
        if self._open_until and time.monotonic() < self._open_until:
            raise self._unavailable(None)
        try:
            result = await make()
        except _UNAVAILABLE as exc:
            self._open_until = time.monotonic() + self._breaker_s
            raise self._unavailable(exc) from exc
        except ResponseError as exc:
            if not on_replica(exc):
                raise
            # A script that did not write runs on a replica, and only the WAIT after it
            # fails: unlike a refused write (ReadOnlyError, which redis-py's sentinel client
            # answers by reconnecting), this leaves the connection in the pool, pointing at
            # the replica for good (seen in a Sentinel failover: the reapers failed on it
            # for 10 s while every heartbeat met the open breaker, and the pods' leases
            # lapsed). Drop every pooled connection: each reconnects through the sentinels.
            await self._redis.connection_pool.disconnect()
            self._open_until = time.monotonic() + self._breaker_s
            raise self._unavailable(exc) from exc
        self._open_until = 0.0
        return result

    async def _run(self, name: str, *args: Any) -> Any:
        script = self._scripts[name]
        if self._min_acks and name in self._WRITES:
            return await self._guard(lambda: self._replicated(script, [self._prefix, *args]))
        return await self._guard(lambda: script(args=[self._prefix, *args]))

    async def _replicated(self, script: Any, args: list[Any]) -> Any:
        """The script, then WAIT on the same connection: the write is acknowledged only once
        ``min_acks`` replicas have it, so a failover to one of them loses nothing the kvindex
        acknowledged. Fewer replicas in time: ``NotReplicated``, answered 503 (the write may
        stand on the master; every write is idempotent, so the caller's retry is safe)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            await script(args=args, client=pipe)
            pipe.execute_command("WAIT", self._min_acks, _ttl_ms(self._op_timeout_s / 2))
            result, acks = await pipe.execute()
        if int(acks) < self._min_acks:
            raise NotReplicated(f"redis at {_redact(self.url)}: the write reached {acks} of "
                                f"{self._min_acks} replicas in time")
        return result

    async def ping(self) -> None:
        await self._guard(self._redis.ping)

    async def close(self) -> None:
        await self._redis.aclose()

    async def flush_prefix(self) -> int:
        """Delete every key under this backend's prefix (tests and benches); returns how many."""
        async def flush() -> int:
            n, cursor = 0, 0
            while True:
                cursor, keys = await self._redis.scan(cursor, match=f"{self._prefix}*",
                                                      count=5000)
                if keys:
                    n += await self._redis.unlink(*keys)
                if cursor == 0:
                    return n

        return await self._guard(flush)


def _hiredis_packing(cls: type) -> type:
    """``cls`` packing commands with hiredis (C) instead of redis-py's pure-Python asyncio packer,
    which dominates the client's cost of a 512-chunk lookup or event batch."""

    def pack_command(self: Any, *args: Any) -> list[bytes]:
        if isinstance(args[0], str):
            args = (*args[0].encode().split(), *args[1:])
        return [hiredis.pack_command(args)]

    return type(f"HiredisPacking{cls.__name__}", (cls,), {"pack_command": pack_command})


SENTINEL_SCHEME = "redis+sentinel://"


def on_replica(exc: ResponseError) -> bool:
    """Redis refused a command because the connection reached a replica: WAIT there answers
    "WAIT cannot be used with replica instances"."""
    return "replica instance" in str(exc)


class NotReplicated(BackendUnavailable):
    """A write the master took but too few replicas acknowledged (``min_acks``)."""


def sentinel_parts(url: str) -> tuple[list[tuple[str, int]], str, int, str | None]:
    """``redis+sentinel://[:password@]host:port[,host:port...]/service[/db]`` ->
    (sentinels, master service name, db, password); a sentinel's port defaults to 26379."""
    rest = url[len(SENTINEL_SCHEME):]
    auth, _, rest = rest.rpartition("@")
    hosts, _, path = rest.partition("/")
    service, _, db = path.strip("/").partition("/")
    if not hosts or not service:
        raise ValueError(f"store: {_redact(url)!r} needs sentinels and a service name "
                         f"({SENTINEL_SCHEME}host:26379[,host:26379]/mymaster[/0])")
    sentinels = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":") if ":" in host else (host, "", "26379")
        sentinels.append((name, int(port)))
    return sentinels, service, int(db or 0), auth.partition(":")[2] or None


def _sentinel_master(url: str, connect_timeout_s: float, op_timeout_s: float,
                     retry: Retry) -> aioredis.Redis:
    """A client of the master the sentinels name now; each new connection asks them again,
    so after a failover the one retry reconnects to the new master."""
    from redis.asyncio.sentinel import Sentinel

    sentinels, service, db, password = sentinel_parts(url)
    timeouts = {"socket_timeout": op_timeout_s, "socket_connect_timeout": connect_timeout_s}
    return Sentinel(sentinels, sentinel_kwargs=timeouts).master_for(
        service, db=db, password=password, decode_responses=True, retry=retry, **timeouts)


def _redact(url: str) -> str:
    """The URL without its password, for error messages."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url


_BIT_TIERS = {bit: tier for tier, bit in TIER_BITS.items()}


def _pod_info(fields: list[Any]) -> PodInfo:
    reg, ra, hb, exp, seq, rs, *rest = fields
    counts, used = rest[:3], rest[3:]
    bits = (1, 2, 4)
    return PodInfo(
        **json.loads(reg), registered_at=float(ra), last_heartbeat=float(hb),
        lease_expires_at=float(exp), seq=int(seq), needs_resync=rs == "1",
        chunks={_BIT_TIERS[b]: int(n) for b, n in zip(bits, counts, strict=True) if int(n)},
        used_bytes={_BIT_TIERS[b]: int(n) for b, n in zip(bits, used, strict=True) if int(n)},
    )


def _ttl_ms(ttl_s: float) -> int:
    return max(1, round(ttl_s * 1000))


class RedisIndex(RedisBackend):
    """``Index`` on Redis; see the module docstring for the layout and failure contract."""

    _SCRIPTS = {"register": _REGISTER, "heartbeat": _HEARTBEAT, "deregister": _DEREGISTER,
                "get_pod": _GET_POD, "list_pods": _LIST_PODS, "expire": _EXPIRE,
                "apply": _APPLY, "replace": _REPLACE, "lookup": _LOOKUP, "holders": _HOLDERS,
                "pod_chunks": _POD_CHUNKS}
    _WRITES = frozenset({"register", "heartbeat", "deregister", "expire", "apply", "replace"})

    def __init__(self, url: str, *, clock: Callable[[], float] = time.time,
                 **options: Any) -> None:
        super().__init__(url, **options)
        self._clock = clock

    # -- pods
    async def register_pod(self, reg: PodRegistration, ttl_s: float) -> PodInfo:
        now = self._clock()
        fields = await self._run("register", reg.pod, reg.model_dump_json(), reg.role.value,
                                 repr(now), repr(now + ttl_s), _ttl_ms(ttl_s))
        return _pod_info(fields)

    async def heartbeat(self, pod: str, ttl_s: float) -> LeaseInfo:
        now = self._clock()
        got = await self._run("heartbeat", pod, repr(now), repr(now + ttl_s), _ttl_ms(ttl_s))
        if got is None:
            raise UnknownPod(pod)
        return _lease(pod, got)

    async def deregister(self, pod: str) -> bool:
        return bool(await self._run("deregister", pod))

    async def get_pod(self, pod: str) -> PodInfo:
        fields = await self._run("get_pod", pod)
        if fields is None:
            raise UnknownPod(pod)
        return _pod_info(fields)

    async def list_pods(self) -> list[PodInfo]:
        return [_pod_info(f) for f in await self._run("list_pods")]

    async def expire_leases(self) -> list[str]:
        return list(await self._run("expire"))

    # -- residency
    async def apply_events(self, batch: EventBatch) -> EventBatchResult:
        args: list[Any] = [batch.pod, batch.seq]
        for event in batch.events:
            if event.op is EventOp.CLEARED:
                args += ("c", TIER_BITS[event.tier] if event.tier else 0, -1, 0)
                continue
            assert event.tier is not None
            args += ("s" if event.op is EventOp.STORED else "r", TIER_BITS[event.tier],
                     -1 if event.bytes is None else event.bytes, len(event.chunk_hashes))
            args += event.chunk_hashes
        got = await self._run("apply", *args)
        if got is None:
            raise UnknownPod(batch.pod)
        applied, count, rs = got
        return EventBatchResult(pod=batch.pod, seq=batch.seq, applied=bool(applied),
                                chunk_events=count, needs_resync=bool(rs))

    async def replace_chunks(self, pod: str, snapshot: ChunkSnapshot) -> LeaseInfo:
        lists = [snapshot.chunks.get(t, []) for t in TIERS_FASTEST_FIRST]
        args: list[Any] = [pod, snapshot.seq]
        args += [snapshot.bytes.get(t, 0) for t in TIERS_FASTEST_FIRST]
        args += [len(chunks) for chunks in lists]
        for chunks in lists:
            args += chunks
        got = await self._run("replace", *args)
        if got is None:
            raise UnknownPod(pod)
        return _lease(pod, got)

    async def locate(self, chunk_hash: str) -> list[ChunkLocation]:
        flat = await self._run("holders", chunk_hash)
        held = sorted((flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3))
        return [ChunkLocation(pod=pod, tier=t) for pod, mask in held for t in tiers_of(mask)]

    async def lookup(self, chunk_hashes: list[str], pods: list[str] | None = None,
                     role: PodRole | None = None) -> list[PrefixCount]:
        if not chunk_hashes:
            return []
        filters = [] if pods is None else list(pods)
        flat = await self._run("lookup", str(role) if role else "",
                               -1 if pods is None else len(filters), *filters, *chunk_hashes)
        out = []
        for i in range(0, len(flat), 5):
            tiers = {t: n for t, n in zip(TIERS_FASTEST_FIRST, flat[i + 2:i + 5], strict=True)
                     if n}
            out.append(PrefixCount(pod=flat[i], prefix_chunks=flat[i + 1], tiers=tiers))
        return out

    async def holders(self, chunk_hashes: list[str]) -> dict[str, dict[str, int]]:
        if not chunk_hashes:
            return {}
        flat = await self._run("holders", *chunk_hashes)
        out: dict[str, dict[str, int]] = {}
        for i in range(0, len(flat), 3):
            out.setdefault(flat[i + 1], {})[flat[i]] = flat[i + 2]
        return out


    async def pod_chunks(self, pod: str) -> dict[str, int]:
        flat = await self._run("pod_chunks", pod)
        if flat is None:
            raise UnknownPod(pod)
        return {flat[i]: int(flat[i + 1]) for i in range(0, len(flat), 2)}


def _lease(pod: str, got: list[Any]) -> LeaseInfo:
    exp, seq, rs = got
    return LeaseInfo(pod=pod, lease_expires_at=float(exp), seq=int(seq), needs_resync=rs == "1")


class RedisSessionStore(RedisBackend):
    """``SessionStore`` on Redis, with per-session and global chunk reference counts."""

    _SCRIPTS = {"put_intent": _PUT_INTENT, "get_intent": _GET_INTENT,
                "delete_intent": _DELETE_INTENT, "get_session": _GET_SESSION,
                "close_session": _CLOSE_SESSION, "fork": _FORK, "lifecycle": _LIFECYCLE,
                "references": _REFERENCES, "expire_sessions": _EXPIRE_SESSIONS,
                "put_stored_response": _PUT_STORED_RESPONSE,
                "delete_stored_response": _DELETE_STORED_RESPONSE}
    # a stored response is waited on (unlike a routing record): the client was told it is kept
    _WRITES = frozenset({"put_intent", "delete_intent", "close_session", "fork", "lifecycle",
                         "expire_sessions", "put_stored_response", "delete_stored_response"})
    # sessions one expiry script drops at most, so a large backlog never blocks Redis long
    EXPIRE_BATCH = 1000

    def __init__(self, url: str, *, clock: Callable[[], float] = time.time,
                 **options: Any) -> None:
        super().__init__(url, **options)
        self._clock = clock

    async def put_intent(self, session_id: str, intent: str, chunks: list[str],
                         idle_ttl_s: float | None = None) -> SessionInfo:
        now = self._clock()
        got = await self._run("put_intent", session_id, intent, json.dumps(list(chunks)),
                              repr(now), _idle_exp(now, idle_ttl_s))
        return _session_info(session_id, got, now)

    async def get_intent(self, session_id: str, intent: str) -> list[str]:
        got = await self._run("get_intent", session_id, intent, repr(self._clock()))
        if got == -1:
            raise UnknownSession(session_id)
        if got == -2:
            raise UnknownSession(session_id, intent)
        return json.loads(got)

    async def delete_intent(self, session_id: str, intent: str,
                            idle_ttl_s: float | None = None) -> SessionInfo:
        now = self._clock()
        got = await self._run("delete_intent", session_id, intent, repr(now),
                              _idle_exp(now, idle_ttl_s))
        if got == -1:
            raise UnknownSession(session_id)
        if got == -2:
            raise UnknownSession(session_id, intent)
        return _session_info(session_id, got, now)

    async def get_session(self, session_id: str) -> SessionInfo:
        now = self._clock()
        got = await self._run("get_session", session_id, repr(now))
        if got is None:
            raise UnknownSession(session_id)
        return _session_info(session_id, got, now)

    async def close_session(self, session_id: str) -> list[str] | None:
        await self._guard(lambda: self._redis.delete(self._route_key(session_id)))
        got = await self._run("close_session", session_id, repr(self._clock()))
        if got is None or not got[0]:
            return None
        return sorted(got[1])

    def _route_key(self, session_id: str) -> str:
        return f"{self._prefix}route:{session_id}"

    async def put_route(self, session_id: str, route: str, ttl_s: float | None = None
                        ) -> None:
        """One key with Redis's own TTL: expiry needs no reaper."""
        px = None if ttl_s is None else _ttl_ms(ttl_s)
        await self._guard(lambda: self._redis.set(self._route_key(session_id), route, px=px))

    async def get_route(self, session_id: str) -> str | None:
        return await self._guard(lambda: self._redis.get(self._route_key(session_id)))

    async def put_stored_response(self, key: str, value: str, ttl_s: float,
                                  max_count: int) -> None:
        """One script: the count bound holds however many replicas put at once."""
        await self._run("put_stored_response", key, value, _ttl_ms(ttl_s),
                        repr(self._clock()), max_count)

    async def get_stored_response(self, key: str) -> str | None:
        return await self._guard(lambda: self._redis.get(f"{self._prefix}resp:{key}"))

    async def delete_stored_response(self, key: str) -> bool:
        return bool(await self._run("delete_stored_response", key))

    async def fork(self, session_id: str, child: str,
                   idle_ttl_s: float | None = None) -> SessionInfo:
        now = self._clock()
        got = await self._run("fork", session_id, child, repr(now), _idle_exp(now, idle_ttl_s))
        if got == -1:
            raise UnknownSession(session_id)
        if got == -2:
            raise SessionExists(child)
        return _session_info(child, got, now)

    async def _lifecycle(self, session_id: str, op: str, value: str,
                         idle_ttl_s: float | None, now: float) -> SessionInfo:
        got = await self._run("lifecycle", session_id, repr(now), _idle_exp(now, idle_ttl_s),
                              op, value)
        if got is None:
            raise UnknownSession(session_id)
        return _session_info(session_id, got, now)

    async def pin(self, session_id: str, ttl_s: float,
                  idle_ttl_s: float | None = None) -> SessionInfo:
        now = self._clock()
        return await self._lifecycle(session_id, "pin", repr(now + ttl_s), idle_ttl_s, now)

    async def release(self, session_id: str, idle_ttl_s: float | None = None) -> SessionInfo:
        now = self._clock()
        return await self._lifecycle(session_id, "release", "", idle_ttl_s, now)

    async def set_priority(self, session_id: str, priority: int,
                           idle_ttl_s: float | None = None) -> SessionInfo:
        now = self._clock()
        return await self._lifecycle(session_id, "prio", str(int(priority)), idle_ttl_s, now)

    async def references(self, chunk_hashes: list[str],
                         also: str | None = None) -> SessionRefs:
        now = self._clock()
        if not chunk_hashes and also is None:
            return SessionRefs(now=now)
        flat_refs, flat_lives = await self._run("references", also or "", *chunk_hashes)
        out = SessionRefs(now=now)
        i = 0
        while i < len(flat_refs):
            n = flat_refs[i + 1]
            out.refs[flat_refs[i]] = sorted(flat_refs[i + 2:i + 2 + n])
            i += 2 + n
        for k in range(0, len(flat_lives), 4):
            sid, exp, pin, prio = flat_lives[k:k + 4]
            out.sessions[sid] = SessionLife(expires_at=float(exp) if exp else None,
                                            pinned_until=float(pin) if pin else None,
                                            priority=int(prio) if prio else DEFAULT_PRIORITY)
        return out

    async def expire_sessions(self) -> list[str]:
        now = repr(self._clock())
        gone: list[str] = []
        while True:
            batch = await self._run("expire_sessions", now, self.EXPIRE_BATCH)
            gone += batch
            if len(batch) < self.EXPIRE_BATCH:
                return sorted(gone)


def _idle_exp(now: float, idle_ttl_s: float | None) -> str:
    """``session_expiry`` before the pin is taken into account (the script does that): ''
    when sessions never expire idle."""
    expiry = session_expiry(now, idle_ttl_s, None)
    return "" if expiry is None else repr(expiry)


def _session_info(session_id: str, got: list[Any], now: float) -> SessionInfo:
    parent, created, updated, prio, pin, exp, flat = got
    intents = {flat[i]: json.loads(flat[i + 1]) for i in range(0, len(flat), 2)}
    life = SessionLife(expires_at=float(exp) if exp else None,
                       pinned_until=float(pin) if pin else None,
                       priority=int(prio) if prio else DEFAULT_PRIORITY)
    return SessionInfo(session_id=session_id, parent=parent or None, intents=intents,
                       created_at=float(created), updated_at=float(updated),
                       priority=life.priority,
                       pinned_until=life.pinned_until if life.pinned(now) else None,
                       expires_at=life.expires_at)


__all__ = ["RedisIndex", "RedisSessionStore"]
