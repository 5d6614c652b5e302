from lockgate.gateway.replicas.routing import ReplicaLoad, choose_replica


def test_sticky_replica_is_kept_while_within_the_imbalance_bound() -> None:
    loads = [ReplicaLoad("a", True, 3), ReplicaLoad("b", True, 0)]
    assert choose_replica(loads, "a", max_imbalance=4) == "a"
    assert choose_replica(loads, "a", max_imbalance=2) == "b"


def test_new_sessions_go_to_the_least_loaded_healthy_replica() -> None:
    loads = [ReplicaLoad("a", True, 2), ReplicaLoad("b", False, 0), ReplicaLoad("c", True, 1)]
    assert choose_replica(loads, None) == "c"


def test_unhealthy_or_excluded_sticky_replica_loses_the_session() -> None:
    loads = [ReplicaLoad("a", False, 0), ReplicaLoad("b", True, 5)]
    assert choose_replica(loads, "a") == "b"
    loads = [ReplicaLoad("a", True, 0), ReplicaLoad("b", True, 5)]
    assert choose_replica(loads, "a", exclude=frozenset({"a"})) == "b"


def test_no_healthy_replica_gives_none() -> None:
    assert choose_replica([ReplicaLoad("a", False, 0)], "a") is None
    assert choose_replica([], None) is None


def test_new_sessions_go_to_the_fewest_open_sessions_plus_calls_in_flight() -> None:
    loads = [ReplicaLoad("a", True, 0, sessions=3), ReplicaLoad("b", True, 0, sessions=2)]
    assert choose_replica(loads, None) == "b"
    # A replica quiet this instant but holding many sessions (their agents are thinking) does
    # not take the new one.
    loads = [ReplicaLoad("a", True, 0, sessions=9), ReplicaLoad("b", True, 1, sessions=1)]
    assert choose_replica(loads, None) == "b"
    # Calls piling up count too: a slow replica gets fewer new sessions.
    loads = [ReplicaLoad("a", True, 4, sessions=4), ReplicaLoad("b", True, 0, sessions=5)]
    assert choose_replica(loads, None) == "b"
    # Equal load: the fewer calls in flight now.
    loads = [ReplicaLoad("a", True, 2, sessions=2), ReplicaLoad("b", True, 1, sessions=3)]
    assert choose_replica(loads, None) == "b"


def test_a_session_shed_by_an_overloaded_replica_goes_where_the_load_is_least() -> None:
    loads = [
        ReplicaLoad("a", True, 9, sessions=9),
        ReplicaLoad("b", True, 0, sessions=8),
        ReplicaLoad("c", True, 1, sessions=2),
    ]
    assert choose_replica(loads, "a", max_imbalance=4) == "c"
