"""Redis for kvmeta, with failover by Sentinel (docs/redis-failover.md).

A StatefulSet of REDIS_REPLICAS pods, each a Redis server and a Sentinel beside it. Pod 0 starts as
the master on a fresh cluster; a pod that (re)starts asks the Sentinels first who the master is now,
so a restarted old master comes back as a replica, never as a second master. kvmeta finds the master
through the Sentinels (its `redis_sentinels`, `redis_master`), the same names as here.
"""

from __future__ import annotations

from typing import Any

from .cluster import REDIS, REDIS_PORT, REDIS_REPLICAS, SENTINEL_PORT, Cluster
from .workloads import disruption_budget, labels, meta

IMAGE = "redis:7.4"
QUORUM = REDIS_REPLICAS // 2 + 1
DOWN_AFTER_MS = 5000      # a master silent this long is down (the failover time is about this plus an election)
FAILOVER_TIMEOUT_MS = 60000

# Who the master is: the Sentinels' answer, or pod 0 on a fresh cluster.
_FIND_MASTER = f"""\
HOST="$(hostname).{REDIS}"
MASTER=""
for i in $(seq 0 {REDIS_REPLICAS - 1}); do
  MASTER="$(redis-cli -h {REDIS}-$i.{REDIS} -p {SENTINEL_PORT} --raw sentinel get-master-addr-by-name "$MASTER_NAME" 2>/dev/null | head -n 1)"
  [ -n "$MASTER" ] && break
done
[ -n "$MASTER" ] || MASTER="{REDIS}-0.{REDIS}"
"""

REDIS_SCRIPT = f"""#!/bin/sh
set -eu
{_FIND_MASTER}
set -- --port {REDIS_PORT} --dir /data --appendonly yes --replica-announce-ip "$HOST"
if [ "$MASTER" != "$HOST" ]; then set -- "$@" --replicaof "$MASTER" {REDIS_PORT}; fi
exec redis-server "$@"
"""

SENTINEL_SCRIPT = f"""#!/bin/sh
set -eu
{_FIND_MASTER}
cat > /tmp/sentinel.conf <<EOF
port {SENTINEL_PORT}
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip $HOST
sentinel monitor $MASTER_NAME $MASTER {REDIS_PORT} {QUORUM}
sentinel down-after-milliseconds $MASTER_NAME {DOWN_AFTER_MS}
sentinel failover-timeout $MASTER_NAME {FAILOVER_TIMEOUT_MS}
sentinel parallel-syncs $MASTER_NAME 1
EOF
exec redis-server /tmp/sentinel.conf --sentinel
"""


def _container(name: str, script: str, port: int, master: str, volume_mounts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "image": IMAGE, "command": ["sh", f"/scripts/{script}"],
            "env": [{"name": "MASTER_NAME", "value": master}],
            "ports": [{"name": name, "containerPort": port}],
            "readinessProbe": {"exec": {"command": ["redis-cli", "-p", str(port), "ping"]}, "periodSeconds": 5},
            "livenessProbe": {"tcpSocket": {"port": port}, "periodSeconds": 10},
            "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
            "volumeMounts": [{"name": "scripts", "mountPath": "/scripts"}, *volume_mounts]}


def redis_documents(cluster: Cluster) -> list[dict[str, Any]]:
    master = cluster.configs["kvmeta"].redis_master
    pod_labels = labels("redis")
    scripts = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(f"{REDIS}-scripts", "redis"),
               "data": {"redis.sh": REDIS_SCRIPT, "sentinel.sh": SENTINEL_SCRIPT}}
    headless = {"apiVersion": "v1", "kind": "Service", "metadata": meta(REDIS, "redis"),
                "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,  # pods find each other while starting
                         "selector": pod_labels,
                         "ports": [{"name": "tcp-redis", "port": REDIS_PORT}, {"name": "tcp-sentinel", "port": SENTINEL_PORT}]}}
    statefulset = {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta(REDIS, "redis"),
        "spec": {
            "serviceName": REDIS, "replicas": REDIS_REPLICAS, "selector": {"matchLabels": pod_labels},
            "template": {"metadata": {"labels": pod_labels}, "spec": {
                "serviceAccountName": REDIS,
                "securityContext": {"runAsNonRoot": True, "runAsUser": 999, "fsGroup": 999},
                "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
                    "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                       "labelSelector": {"matchLabels": pod_labels}}}]}},
                "containers": [_container("redis", "redis.sh", REDIS_PORT, master,
                                          [{"name": "data", "mountPath": "/data"}]),
                               _container("sentinel", "sentinel.sh", SENTINEL_PORT, master, [])],
                "volumes": [{"name": "scripts", "configMap": {"name": f"{REDIS}-scripts"}}]}},
            "volumeClaimTemplates": [{"metadata": {"name": "data"}, "spec": {
                "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}],
        },
    }
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(REDIS, "redis")}
    return [account, scripts, headless, statefulset, disruption_budget(REDIS, "redis", pod_labels)]

