"""Status aggregation: WeightCacheNodes -> WeightCache status; Deployment -> InferenceDeployment status."""

import datetime as dt

from keepwarm_api.common import condition, merge_conditions
from keepwarm_api.weightcache import WeightCacheSpec
from keepwarm_api.weightcachenode import WeightCacheNodeStatus
from keepwarm_operator.builders.meta import warm_label_key
from keepwarm_operator.status import (
    gpu_mismatches,
    inference_status,
    is_stale,
    last_heard,
    node_belongs,
    node_gpus,
    node_warm_labels,
    status_changed,
    weightcache_status,
)

SPEC = WeightCacheSpec.model_validate(
    {"models": [{"name": "a", "source": {"path": "/a"}}, {"name": "b", "source": {"path": "/b"}}]}
)
NOW = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.UTC)


def node(phase="Ready", **states):
    models = [{"name": n, "state": s} for n, s in states.items()]
    return WeightCacheNodeStatus.model_validate(
        {"phase": phase, "models": models, "heartbeat": NOW.isoformat()}
    )


def test_ready_when_every_node_holds_every_model():
    status = weightcache_status(
        SPEC, 3, 2, [node(a="Resident", b="Resident"), node(a="Resident", b="Resident")]
    )
    assert (status.desired_nodes, status.ready_nodes, status.model_count) == (2, 2, 2)
    ready, degraded = status.conditions
    assert (ready.type, ready.status.value, ready.reason) == ("Ready", "True", "AllNodesReady")
    assert (degraded.status.value, degraded.reason) == ("False", "AsExpected")
    assert ready.observed_generation == 3 and status.observed_generation == 3


def test_partial_failed_and_stale_nodes():
    nodes = [
        node(a="Resident", b="Loading"),
        node(a="Failed", b="Resident"),
        node("Stale", a="Resident", b="Resident"),
    ]
    status = weightcache_status(SPEC, 1, 3, nodes)
    assert status.ready_nodes == 0 and status.stale_nodes == 1
    residency = {m.name: (m.resident_nodes, m.failed_nodes) for m in status.models}
    assert residency == {"a": (1, 1), "b": (1, 0)}  # stale nodes count for nothing
    ready, degraded = status.conditions
    assert ready.reason == "NodesNotReady" and "0/3" in ready.message
    assert (degraded.status.value, degraded.reason) == ("True", "NodesStale")


WITH_ADAPTERS = WeightCacheSpec.model_validate(
    {
        "models": [
            {
                "name": "a",
                "source": {"path": "/a"},
                "adapters": [
                    {"name": "sql", "source": {"path": "/a-sql"}},
                    {"name": "de", "source": {"path": "/a-de"}},
                ],
            }
        ]
    }
)


def node_with_adapters(phase="Ready", model="Resident", **adapters):
    return WeightCacheNodeStatus.model_validate(
        {
            "phase": phase,
            "models": [{"name": "a", "state": model}],
            "adapters": [{"model": "a", "name": n, "state": s} for n, s in adapters.items()],
            "heartbeat": NOW.isoformat(),
        }
    )


def test_adapters_are_counted_and_a_node_is_ready_only_with_every_adapter():
    nodes = [
        node_with_adapters(sql="Resident", de="Resident"),
        node_with_adapters(sql="Resident", de="Failed"),
        node_with_adapters(sql="Loading"),  # de not reported yet
        node_with_adapters("Stale", sql="Resident", de="Resident"),
    ]
    status = weightcache_status(WITH_ADAPTERS, 2, 4, nodes)
    counts = {(r.model, r.name): (r.resident_nodes, r.failed_nodes) for r in status.adapters}
    assert counts == {("a", "de"): (1, 1), ("a", "sql"): (2, 0)}  # a stale node counts for nothing
    assert status.ready_nodes == 1 and status.models[0].resident_nodes == 3
    ready, degraded = status.conditions
    assert ready.reason == "NodesNotReady" and "1/4 nodes hold every model and adapter" in ready.message
    assert degraded.reason == "NodesStale"
    status = weightcache_status(WITH_ADAPTERS, 2, 3, nodes[:3])
    assert status.conditions[1].reason == "ModelsFailed" and "a/de" in status.conditions[1].message


def test_no_matching_nodes():
    ready = weightcache_status(SPEC, 1, 0, []).conditions[0]
    assert (ready.status.value, ready.reason) == ("False", "NoMatchingNodes")


def test_stale_after_missed_heartbeats():
    fresh = node(a="Resident")
    assert not is_stale(last_heard(fresh, None, NOW), 15, NOW + dt.timedelta(seconds=59))
    assert is_stale(last_heard(fresh, None, NOW), 15, NOW + dt.timedelta(seconds=61))
    never = WeightCacheNodeStatus()
    assert is_stale(last_heard(never, None, NOW), 15, NOW + dt.timedelta(seconds=61))


def test_a_renewed_lease_keeps_a_node_fresh_without_status_writes():
    quiet = node(a="Resident")  # status written at NOW, never since
    renewed = NOW + dt.timedelta(seconds=300)
    assert last_heard(quiet, renewed, NOW - dt.timedelta(hours=1)) == renewed
    assert not is_stale(last_heard(quiet, renewed, NOW), 15, renewed + dt.timedelta(seconds=59))
    assert is_stale(last_heard(quiet, renewed, NOW), 15, renewed + dt.timedelta(seconds=61))


def test_node_labels_from_resident_models_only():
    wcns = [
        {
            "spec": {"weightCache": "c1", "nodeName": "n"},
            "status": {"models": [{"name": "a", "state": "Resident"}, {"name": "b", "state": "Loading"}]},
        },
        {
            "spec": {"weightCache": "c2", "nodeName": "n"},
            "status": {"phase": "Stale", "models": [{"name": "a", "state": "Resident"}]},
        },
        {"spec": {"weightCache": "c3", "nodeName": "n"}},
    ]
    assert node_warm_labels(wcns) == {warm_label_key("c1", "a"): "true"}


def test_inference_status_from_deployment():
    warm = condition("CacheWarm", True, "ModelResident", "", 2)
    rolling = {
        "metadata": {"generation": 4},
        "status": {
            "observedGeneration": 4,
            "replicas": 3,
            "readyReplicas": 1,
            "availableReplicas": 1,
            "updatedReplicas": 3,
        },
    }
    s = inference_status(2, "k=v", rolling, 3, warm, 2)
    assert (s.replicas, s.ready_replicas, s.selector, s.warm_nodes) == (3, 1, "k=v", 2)
    available, progressing, cache = s.conditions
    assert (available.status.value, available.reason) == ("False", "ReplicasUnavailable")
    assert (progressing.status.value, progressing.reason) == ("True", "RollingUpdate")
    assert cache.type == "CacheWarm"
    done = {
        "metadata": {"generation": 4},
        "status": {
            "observedGeneration": 4,
            "replicas": 3,
            "readyReplicas": 3,
            "availableReplicas": 3,
            "updatedReplicas": 3,
        },
    }
    available, progressing, _ = inference_status(2, "k=v", done, 3, warm, 2).conditions
    assert (available.status.value, progressing.status.value, progressing.reason) == (
        "True",
        "False",
        "RolloutComplete",
    )


def test_problem_condition_wins():
    problem = condition("Available", False, "CacheNotFound", "WeightCache 'x' not found", 1)
    s = inference_status(1, "k=v", None, 1, condition("CacheWarm", False, "CacheNotFound", "", 1), 0, problem)
    assert [(c.type, c.reason) for c in s.conditions[:2]] == [
        ("Available", "CacheNotFound"),
        ("Progressing", "CacheNotFound"),
    ]


def test_merge_conditions_keeps_transition_time_when_unchanged():
    first = merge_conditions([], [condition("Ready", True, "AllNodesReady", "", 1)], NOW)
    later = NOW + dt.timedelta(minutes=5)
    same = merge_conditions(first, [condition("Ready", True, "AllNodesReady", "x", 2)], later)
    assert same[0]["lastTransitionTime"] == first[0]["lastTransitionTime"]
    flipped = merge_conditions(first, [condition("Ready", False, "NodesNotReady", "", 2)], later)
    assert flipped[0]["lastTransitionTime"] != first[0]["lastTransitionTime"]


def test_status_is_written_only_when_merging_it_changes_something():
    spec = WeightCacheSpec.model_validate({"models": [{"name": "m", "source": {"path": "/m"}}]})
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    status = weightcache_status(spec, 1, 2, []).wire()
    stored = {
        **status,
        "conditions": merge_conditions(None, weightcache_status(spec, 1, 2, []).conditions, now),
    }
    again = weightcache_status(spec, 1, 2, []).wire()
    again["conditions"] = merge_conditions(
        stored["conditions"], weightcache_status(spec, 1, 2, []).conditions, now
    )
    assert not status_changed(stored, again)  # a resync that finds nothing new writes nothing
    assert status_changed(stored, {**again, "desiredNodes": 3})
    assert status_changed(None, again) and status_changed({}, {"observedGeneration": 1})
    assert not status_changed({**stored, "extra": 1}, again)  # a merge patch would leave it anyway


def test_node_belongs_while_it_exists_and_matches_the_selector():
    assert node_belongs({"pool": "a", "x": "1"}, {"pool": "a"})
    assert node_belongs({}, {})  # an empty selector means every node
    assert not node_belongs({"pool": "b"}, {"pool": "a"}) and not node_belongs({}, {"pool": "a"})
    assert not node_belongs(None, {})  # the Node is gone


def test_gpu_mismatches_names_nodes_whose_agent_sees_another_gpu_count():
    def reported(phase, uuids):
        return WeightCacheNodeStatus.model_validate({"phase": phase, "gpuUuids": uuids})

    four = [f"GPU-{i}" for i in range(4)]
    reports = [
        ("n1", reported("Ready", four)),  # matches its Node
        ("n2", reported("Ready", four[:2])),  # the agent sees 2 of 4
        ("n3", reported("Pending", [])),  # not reported yet: not judged
        ("n4", reported("Stale", [])),  # silent: not judged
        ("n5", reported("Loading", four)),  # Node without the resource: nothing to compare
        ("n6", reported("Degraded", four)),  # the agent sees more than the Node offers pods
    ]
    offered = {"n1": 4, "n2": 4, "n3": 4, "n4": 4, "n5": None, "n6": 2}
    assert gpu_mismatches(reports, offered) == [
        "n2: agent sees 2 GPU(s), Node allocatable nvidia.com/gpu is 4",
        "n6: agent sees 4 GPU(s), Node allocatable nvidia.com/gpu is 2",
    ]


def test_node_gpus_prefers_allocatable_and_tolerates_nodes_without_the_resource():
    assert (
        node_gpus({"status": {"capacity": {"nvidia.com/gpu": "8"}, "allocatable": {"nvidia.com/gpu": "7"}}})
        == 7
    )
    assert node_gpus({"status": {"capacity": {"nvidia.com/gpu": "8"}}}) == 8
    assert node_gpus({"status": {"allocatable": {"cpu": "4"}}}) is None
    assert node_gpus({}) is None


def test_gpus_match_condition_only_on_the_gpu_tier_and_false_on_a_mismatch():
    assert [c.type for c in weightcache_status(SPEC, 1, 1, []).conditions] == ["Ready", "Degraded"]
    ok = weightcache_status(SPEC, 1, 1, [], gpu_mismatch=[]).conditions[2]
    assert (ok.type, ok.status.value, ok.reason) == ("GPUsMatch", "True", "GPUCountsMatch")
    lines = [f"n{i}: agent sees 1 GPU(s), Node allocatable nvidia.com/gpu is 8" for i in range(7)]
    bad = weightcache_status(SPEC, 1, 1, [], gpu_mismatch=lines).conditions[2]
    assert (bad.status.value, bad.reason) == ("False", "GPUCountMismatch")
    assert bad.message.startswith("n0: agent sees 1 GPU(s)") and bad.message.endswith("and 2 more node(s)")
