"""The in-cluster Redis with Sentinel (``spec.kvindex.redis.replicas``): the objects for 1 and
3 members, the sentinels' quorum, the kvindex's store and min-acks, the refusals, and the
switch between the two as the reconciler prunes it. The real failover of the rendered set is
``test_redis_sentinel_failover.py``."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess

import pytest

from agentserving.operator import reconcile
from agentserving.operator.builders import SpecError, build_children, workloads
from agentserving.operator.builders.common import CONFIG_HASH_ANNOTATION
from agentserving.operator.builders.redis_ha import (
    MASTER_HOST,
    MASTER_PORT,
    SELF,
    START_SH,
    quorum,
    redis_conf,
    sentinel_conf,
)

from .operator_testing import make_instance
from .test_reconcile import FakeKube, body

HEADLESS = "demo-redis-headless.ns1.svc"


def by_key(children):
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def spec(redis, kvindex_replicas=2):
    return {"model": {"name": "tiny"}, "kvindex": {"replicas": kvindex_replicas,
                                                   "redis": redis}}


def kvindex_command(children):
    return by_key(children)[("Deployment", "demo-kvindex")]["spec"]["template"]["spec"][
        "containers"][0]["command"]


def test_one_member_is_the_single_deployment_as_before(settings):
    unset = build_children(make_instance(spec({"inCluster": True})), settings)
    one = build_children(make_instance(spec({"inCluster": True, "replicas": 1})), settings)
    assert one == unset
    kids = by_key(one)
    assert ("Deployment", "demo-redis") in kids and ("Service", "demo-redis") in kids
    assert not any(k[1].startswith("demo-redis-") for k in kids)
    assert ("StatefulSet", "demo-redis") not in kids
    assert kvindex_command(one)[-2:] == ["--store", "redis://demo-redis.ns1.svc:6379/0"]
    assert workloads(make_instance(spec({"inCluster": True, "replicas": 1})))["redis"] == (
        "Deployment", "demo-redis")


def test_three_members_are_a_statefulset_with_a_sentinel_beside_each_redis(settings):
    kids = by_key(build_children(make_instance(spec({"inCluster": True, "replicas": 3})),
                                 settings))
    redis_kids = sorted(k for k in kids if k[1].startswith("demo-redis"))
    assert redis_kids == [("ConfigMap", "demo-redis"), ("Service", "demo-redis-headless"),
                          ("Service", "demo-redis-sentinel"), ("StatefulSet", "demo-redis")]
    sts = kids[("StatefulSet", "demo-redis")]["spec"]
    assert sts["replicas"] == 3 and sts["serviceName"] == "demo-redis-headless"
    assert sts["podManagementPolicy"] == "OrderedReady"
    pod = sts["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["redis", "sentinel"]
    for c in pod["containers"]:
        assert c["image"] == "redis:7.4-alpine"
        assert c["command"] == ["sh", "/etc/redis-ha/start.sh", c["name"]]
        assert {m["mountPath"] for m in c["volumeMounts"]} == {"/etc/redis-ha", "/data"}
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["SELF"] == f"$(POD_NAME).{HEADLESS}"  # the pod's stable DNS name
        assert env["PEERS"] == " ".join(f"demo-redis-{k}.{HEADLESS}:26379" for k in range(3))
        assert env["SEED"] == f"demo-redis-0.{HEADLESS}:6379"  # a new set's first master
        assert env["MASTER_NAME"] == "kvindex"
    assert [c["ports"][0]["containerPort"] for c in pod["containers"]] == [6379, 26379]
    assert pod["volumes"] == [{"name": "config", "configMap": {"name": "demo-redis"}},
                              {"name": "data", "emptyDir": {}}]
    assert pod["securityContext"]["runAsNonRoot"] is True
    config = kids[("ConfigMap", "demo-redis")]["data"]
    assert set(config) == {"redis.conf", "sentinel.conf", "start.sh"}
    assert sts["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
    sentinel = config["sentinel.conf"].splitlines()
    assert "sentinel monitor kvindex @MASTER_HOST@ @MASTER_PORT@ 2" in sentinel  # quorum 2/3
    assert {"sentinel resolve-hostnames yes", "sentinel announce-hostnames yes",
            "sentinel announce-ip @SELF@"} <= set(sentinel)
    assert "replica-announce-ip @SELF@" in config["redis.conf"].splitlines()
    headless = kids[("Service", "demo-redis-headless")]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert [p["port"] for p in headless["ports"]] == [6379, 26379]
    sentinels = kids[("Service", "demo-redis-sentinel")]["spec"]
    assert [p["port"] for p in sentinels["ports"]] == [26379]
    assert sentinels["selector"] == sts["selector"]["matchLabels"]
    # the kvindex asks the sentinels for the master and waits for one replica per write
    assert kvindex_command(list(kids.values()))[-4:] == [
        "--store", "redis+sentinel://demo-redis-sentinel.ns1.svc:26379/kvindex/0",
        "--redis-min-acks", "1"]
    assert workloads(make_instance(spec({"inCluster": True, "replicas": 3})))["redis"] == (
        "StatefulSet", "demo-redis")


@pytest.mark.parametrize("min_acks, flags", [(2, ["--redis-min-acks", "2"]), (0, [])])
def test_min_acks_as_set_wins_over_the_default(settings, min_acks, flags):
    command = kvindex_command(build_children(make_instance(spec(
        {"inCluster": True, "replicas": 3, "minAcks": min_acks})), settings))
    assert command[command.index("--store") + 2:] == flags


@pytest.mark.parametrize("members, expected", [(2, 2), (3, 2), (4, 3), (5, 3), (9, 5)])
def test_quorum_is_a_majority(settings, members, expected):
    assert quorum(members) == expected
    config = by_key(build_children(make_instance(spec({"inCluster": True,
                                                       "replicas": members})), settings))
    assert (f"sentinel monitor kvindex @MASTER_HOST@ @MASTER_PORT@ {expected}"
            in config[("ConfigMap", "demo-redis")]["data"]["sentinel.conf"])


def test_an_image_override_and_the_token_stay_out_of_redis(settings):
    kids = by_key(build_children(
        make_instance(spec({"inCluster": True, "replicas": 3, "image": "me/redis:7"})),
        dataclasses.replace(settings, token_key="k")))
    pod = kids[("StatefulSet", "demo-redis")]["spec"]["template"]["spec"]
    assert {c["image"] for c in pod["containers"]} == {"me/redis:7"}
    assert "AGENTSERVING_INTERNAL_TOKEN" not in json.dumps(pod)


@pytest.mark.parametrize("redis, field", [
    ({"url": "redis://r.example:6379/0", "replicas": 2}, "spec.kvindex.redis.replicas"),
    ({"replicas": 3}, "spec.kvindex.redis.replicas"),  # not inCluster
    ({"inCluster": True, "replicas": 0}, "spec.kvindex.redis.replicas"),
    ({"inCluster": True, "replicas": -1}, "spec.kvindex.redis.replicas"),
    ({"inCluster": True, "replicas": 10}, "spec.kvindex.redis.replicas"),
    ({"inCluster": True, "replicas": "3"}, "spec.kvindex.redis.replicas"),
    ({"inCluster": True, "replicas": 3, "minAcks": 3}, "spec.kvindex.redis.minAcks"),
    ({"inCluster": True, "replicas": 2, "minAcks": 2}, "spec.kvindex.redis.minAcks"),
])
def test_unservable_redis_specs_name_the_field(settings, redis, field):
    with pytest.raises(SpecError) as e:
        build_children(make_instance(spec(redis)), settings)
    assert e.value.field_path == field and str(e.value).startswith(field)


def test_the_templates_filled_in_are_the_rendered_configs(settings):
    """What start.sh writes in a pod (placeholders replaced) is what the renderer gives for
    that pod's names, which is what the loopback failover test runs."""
    me, master = f"demo-redis-1.{HEADLESS}", f"demo-redis-0.{HEADLESS}"
    data = by_key(build_children(make_instance(spec({"inCluster": True, "replicas": 3})),
                                 settings))[("ConfigMap", "demo-redis")]["data"]
    assert data["start.sh"] == START_SH
    filled = data["redis.conf"].replace(SELF, me) + f"replicaof {master} 6379\n"
    assert filled == redis_conf(announce_host=me, replica_of=(master, 6379))
    filled = (data["sentinel.conf"].replace(SELF, me).replace(MASTER_HOST, master)
              .replace(MASTER_PORT, "6379"))
    assert filled == sentinel_conf(announce_host=me, master=(master, 6379), quorum=2)


@pytest.mark.skipif(shutil.which("sh") is None, reason="no sh")
def test_start_script_is_valid_sh():
    assert subprocess.run(["sh", "-n"], input=START_SH, text=True).returncode == 0


def test_switching_members_prunes_the_other_kind(settings):
    kube = FakeKube()
    kube.resource = body(spec({"inCluster": True}))
    reconcile.reconcile(kube, settings, kube.resource)
    assert ("Deployment", "ns1", "demo-redis") in kube.objects
    kube.resource = body(spec({"inCluster": True, "replicas": 3}), generation=2) | {
        "status": kube.resource["status"]}
    status = reconcile.reconcile(kube, settings, kube.resource)
    assert {("Deployment", "demo-redis"), ("Service", "demo-redis")} <= set(kube.deleted)
    for key in (("StatefulSet", "ns1", "demo-redis"), ("ConfigMap", "ns1", "demo-redis"),
                ("Service", "ns1", "demo-redis-headless"),
                ("Service", "ns1", "demo-redis-sentinel")):
        assert key in kube.objects, key
    assert ("Deployment", "ns1", "demo-redis") not in kube.objects
    assert status["redis"]["replicas"] == 3  # from the StatefulSet
    assert status["redis"]["ready"] == "0/3"
    kube.deleted.clear()
    kube.resource = body(spec({"inCluster": True}), generation=3) | {
        "status": kube.resource["status"]}
    status = reconcile.reconcile(kube, settings, kube.resource)
    assert set(kube.deleted) == {("StatefulSet", "demo-redis"), ("ConfigMap", "demo-redis"),
                                 ("Service", "demo-redis-headless"),
                                 ("Service", "demo-redis-sentinel")}
    assert ("Deployment", "ns1", "demo-redis") in kube.objects
    assert status["redis"]["replicas"] == 1
