"""The in-cluster Redis with Sentinel (``spec.kvindex.redis.replicas`` >= 2).

A StatefulSet ``NAME-redis`` of N pods, each running redis-server and a sentinel beside it;
a headless Service ``NAME-redis-headless`` gives every pod a stable DNS name
(``NAME-redis-K.NAME-redis-headless.NS.svc``), which Redis and the sentinels announce instead
of pod IPs (``replica-announce-ip``, ``sentinel announce-ip``, ``resolve-hostnames`` and
``announce-hostnames``), so an address survives a pod's restart. ``NAME-redis-sentinel``
(26379) is where the kvindex asks for the master (``redis+sentinel://``).

The config files come from the pure ``redis_conf`` and ``sentinel_conf``, which take every
host name and port as parameters: the operator renders them with placeholders that each pod's
``start.sh`` fills in (its own name, the master it finds), a test renders them with loopback
addresses and runs a real failover. The ConfigMap is read-only and a sentinel rewrites its
config file, so ``start.sh`` writes both files to an emptyDir.

Who is master: a new set starts with pod 0 as master and the others replicating it. A pod
that (re)starts asks the other pods' sentinels which member is master now and replicates
that one. Nothing is persisted (the index is rebuilt from the workers' reports), so a master
whose Redis restarted empty must not stay master: ``start.sh`` waits until the sentinels
have promoted a replica before it starts, instead of handing the replicas an empty data set.
"""

from __future__ import annotations

from typing import Any

from .common import (
    CONFIG_HASH_ANNOTATION,
    REDIS_PORT,
    Instance,
    SpecError,
    content_hash,
    env_var,
    field_env,
    labels,
    metadata,
    selector_labels,
)

SENTINEL_PORT = 26379
MASTER_NAME = "kvindex"  # the Sentinel service name in the kvindex's redis+sentinel:// URL
MAX_REPLICAS = 9
CONF_DIR = "/etc/redis-ha"
DATA_DIR = "/data"
REDIS_UID = 999  # the redis user of the official redis images (alpine and Debian)
# Placeholders in the ConfigMap's files, filled in by start.sh in each pod.
SELF, MASTER_HOST, MASTER_PORT = "@SELF@", "@MASTER_HOST@", "@MASTER_PORT@"
# How long a sentinel waits before it declares a silent master down, and how long a
# restarted master waits for the others to promote a replica before it starts anyway.
DOWN_AFTER_MS = 5000
FAILOVER_TIMEOUT_MS = 30000
MASTER_WAIT_S = 60


def redis_replicas(inst: Instance) -> int:
    """Members of the in-cluster Redis (1: the single Deployment; 2+: Sentinel)."""
    redis = inst.spec["kvindex"].get("redis") or {}
    replicas = redis.get("replicas", 1)
    if replicas is None:
        return 1
    if not isinstance(replicas, int) or isinstance(replicas, bool) or not (
            1 <= replicas <= MAX_REPLICAS):
        raise SpecError("spec.kvindex.redis.replicas",
                        f"must be a whole number from 1 to {MAX_REPLICAS}, not {replicas!r}")
    if replicas > 1 and not redis.get("inCluster"):
        raise SpecError("spec.kvindex.redis.replicas",
                        "more than one Redis member is the in-cluster Redis with Sentinel: "
                        "set inCluster: true (and no url)")
    return replicas


def wants_sentinel(inst: Instance) -> bool:
    return redis_replicas(inst) > 1


def quorum(replicas: int) -> int:
    """Sentinels that must agree the master is down: a majority of the members."""
    return replicas // 2 + 1


def headless_name(inst: Instance) -> str:
    return inst.child_name("redis-headless")


def member_host(inst: Instance, ordinal: int) -> str:
    """Pod ``ordinal``'s stable DNS name, through the headless Service."""
    return f"{inst.child_name('redis')}-{ordinal}.{headless_name(inst)}.{inst.namespace}.svc"


def sentinel_store_url(inst: Instance) -> str:
    """The kvindex's --store: the sentinels' Service, which names the master."""
    return (f"redis+sentinel://{inst.service_host('redis-sentinel')}:{SENTINEL_PORT}/"
            f"{MASTER_NAME}/0")


def redis_conf(*, announce_host: str, port: int | str = REDIS_PORT, bind: str = "0.0.0.0",
               data_dir: str = DATA_DIR, replica_of: tuple[str, int | str] | None = None
               ) -> str:
    """One member's redis.conf: no persistence (the index is soft state), the member known
    by ``announce_host`` (its stable name), a replica of ``replica_of`` if given."""
    lines = [
        f"bind {bind}",
        f"port {port}",
        "protected-mode no",  # reached from other pods; the NetworkPolicy guards it
        f"dir {data_dir}",
        'save ""',
        "appendonly no",
        f"replica-announce-ip {announce_host}",
        "repl-diskless-sync yes",
        "repl-diskless-sync-delay 0",
    ]
    if replica_of is not None:
        lines.append(f"replicaof {replica_of[0]} {replica_of[1]}")
    return "\n".join(lines) + "\n"


def sentinel_conf(*, announce_host: str, master: tuple[str, int | str], quorum: int,
                  port: int | str = SENTINEL_PORT, bind: str = "0.0.0.0",
                  data_dir: str = DATA_DIR, master_name: str = MASTER_NAME,
                  down_after_ms: int = DOWN_AFTER_MS,
                  failover_timeout_ms: int = FAILOVER_TIMEOUT_MS) -> str:
    """One member's sentinel.conf: it watches ``master`` under ``master_name`` and names
    every instance by host name (resolve-hostnames, announce-hostnames)."""
    host, master_port = master
    return "\n".join([
        f"bind {bind}",
        f"port {port}",
        "protected-mode no",
        f"dir {data_dir}",
        "sentinel resolve-hostnames yes",
        "sentinel announce-hostnames yes",
        f"sentinel announce-ip {announce_host}",
        f"sentinel monitor {master_name} {host} {master_port} {quorum}",
        f"sentinel down-after-milliseconds {master_name} {down_after_ms}",
        f"sentinel failover-timeout {master_name} {failover_timeout_ms}",
        f"sentinel parallel-syncs {master_name} 1",
    ]) + "\n"


# Runs in the redis image (busybox sh on alpine, dash on Debian): `start.sh redis|sentinel`.
START_SH = r"""#!/bin/sh
# start.sh redis|sentinel|master: start this member's Redis or sentinel from the rendered
# templates in $CONF, or print the master the set has now ("host port").
# Environment: SELF (this member's stable host name), REDIS_PORT, SENTINEL_PORT, PEERS
# (every member's sentinel, host:port), SEED (host:port: the master of a new set),
# MASTER_NAME, CONF (templates), DATA (writable), MASTER_WAIT_S.
set -eu

ask_sentinels() {  # the master the other members' sentinels name, "host port"; else nothing
  for peer in $PEERS; do
    [ "$peer" = "$SELF:$SENTINEL_PORT" ] && continue
    out=$(timeout 3 redis-cli -h "${peer%:*}" -p "${peer##*:}" --raw \
          sentinel get-master-addr-by-name "$MASTER_NAME" 2>/dev/null) || continue
    set -- $out
    if [ $# -eq 2 ]; then echo "$1 $2"; return 0; fi
  done
  return 0
}

seed() { echo "${SEED%:*} ${SEED##*:}"; }

case "${1:-}" in
master)
  addr=$(ask_sentinels)
  echo "${addr:-$(seed)}"
  ;;
redis)
  deadline=$(( $(date +%s) + ${MASTER_WAIT_S:-60} ))
  while :; do
    addr=$(ask_sentinels)
    # none answers (a new set) or they name another member: go
    [ -z "$addr" ] || [ "$addr" != "$SELF $REDIS_PORT" ] && break
    # they still name this member, which lost its data on restart: let them promote a
    # replica first, or the replicas would copy an empty data set
    [ "$(date +%s)" -ge "$deadline" ] && break
    echo "the sentinels still name $SELF as master: waiting for a failover" >&2
    sleep 1
  done
  set -- ${addr:-$(seed)}
  sed -e "s/@SELF@/$SELF/g" "$CONF/redis.conf" > "$DATA/redis.conf"
  if [ "$1 $2" != "$SELF $REDIS_PORT" ]; then
    echo "replicaof $1 $2" >> "$DATA/redis.conf"
  fi
  exec redis-server "$DATA/redis.conf"
  ;;
sentinel)
  addr=$(ask_sentinels)
  set -- ${addr:-$(seed)}
  # a sentinel refuses to start on a master name that does not resolve yet
  i=0
  until [ $i -ge 30 ] || timeout 3 redis-cli -h "$1" -p "$2" ping >/dev/null 2>&1; do
    i=$((i + 1)); sleep 1
  done
  sed -e "s/@SELF@/$SELF/g" -e "s/@MASTER_HOST@/$1/g" -e "s/@MASTER_PORT@/$2/g" \
    "$CONF/sentinel.conf" > "$DATA/sentinel.conf"
  exec redis-server "$DATA/sentinel.conf" --sentinel
  ;;
*)
  echo "usage: $0 redis|sentinel|master" >&2
  exit 2
  ;;
esac
"""


def config_data(replicas: int) -> dict[str, str]:
    """The ConfigMap's files: the two templates and the start script."""
    return {
        "redis.conf": redis_conf(announce_host=SELF),
        "sentinel.conf": sentinel_conf(announce_host=SELF, master=(MASTER_HOST, MASTER_PORT),
                                       quorum=quorum(replicas)),
        "start.sh": START_SH,
    }


def _probe(port: int) -> dict[str, Any]:
    return {"exec": {"command": ["sh", "-c", f"redis-cli -p {port} ping | grep -q PONG"]},
            "periodSeconds": 5, "timeoutSeconds": 3}


def _container(name: str, image: str, port: int, env: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": name,
        "image": image,
        "command": ["sh", f"{CONF_DIR}/start.sh", name],
        "env": env,
        "ports": [{"name": name, "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": _probe(port),
        "volumeMounts": [{"name": "config", "mountPath": CONF_DIR, "readOnly": True},
                         {"name": "data", "mountPath": DATA_DIR}],
    }


def build_redis_sentinel(inst: Instance, image: str) -> list[dict[str, Any]]:
    """The StatefulSet, its headless Service, the sentinels' Service and the ConfigMap."""
    replicas = redis_replicas(inst)
    name = inst.child_name("redis")
    data = config_data(replicas)
    env = [
        field_env("POD_NAME", "metadata.name"),
        env_var("SELF", f"$(POD_NAME).{headless_name(inst)}.{inst.namespace}.svc"),
        env_var("REDIS_PORT", REDIS_PORT),
        env_var("SENTINEL_PORT", SENTINEL_PORT),
        env_var("PEERS", " ".join(f"{member_host(inst, k)}:{SENTINEL_PORT}"
                                  for k in range(replicas))),
        env_var("SEED", f"{member_host(inst, 0)}:{REDIS_PORT}"),
        env_var("MASTER_NAME", MASTER_NAME),
        env_var("CONF", CONF_DIR),
        env_var("DATA", DATA_DIR),
        env_var("MASTER_WAIT_S", MASTER_WAIT_S),
    ]
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(inst, "redis"),
        "spec": {
            "replicas": replicas,
            "serviceName": headless_name(inst),
            # pod 0 (the first master) is Ready before pod 1 starts and asks who is master
            "podManagementPolicy": "OrderedReady",
            "selector": {"matchLabels": selector_labels(inst, "redis")},
            "template": {
                "metadata": {"labels": labels(inst, "redis"),
                             "annotations": {CONFIG_HASH_ANNOTATION: content_hash(data)}},
                "spec": {
                    "containers": [_container("redis", image, REDIS_PORT, env),
                                   _container("sentinel", image, SENTINEL_PORT, env)],
                    "enableServiceLinks": False,
                    "securityContext": {"runAsUser": REDIS_UID, "runAsNonRoot": True},
                    # one member per node where the nodes allow it: losing a node loses one
                    "affinity": {"podAntiAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [{
                            "weight": 100,
                            "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {
                                    "matchLabels": selector_labels(inst, "redis")}}}]}},
                    "volumes": [
                        {"name": "config", "configMap": {"name": name}},
                        {"name": "data", "emptyDir": {}},
                    ],
                },
            },
        },
    }
    ports = [{"name": "redis", "port": REDIS_PORT, "targetPort": REDIS_PORT, "protocol": "TCP"},
             {"name": "sentinel", "port": SENTINEL_PORT, "targetPort": SENTINEL_PORT,
              "protocol": "TCP"}]
    headless = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(inst, "redis", headless_name(inst)),
        "spec": {"clusterIP": "None", "selector": selector_labels(inst, "redis"),
                 # members resolve each other while starting (before they are Ready)
                 "publishNotReadyAddresses": True, "ports": ports},
    }
    sentinels = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(inst, "redis", inst.child_name("redis-sentinel")),
        "spec": {"type": "ClusterIP", "selector": selector_labels(inst, "redis"),
                 "ports": [ports[1]]},
    }
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(inst, "redis"),
        "data": data,
    }
    return [config, statefulset, headless, sentinels]
