"""shared/placement.py: the cluster description and the rendezvous placement rule."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from shared.placement import (
    Cluster,
    Ingester,
    PlacementError,
    bucket_placement_key,
    parse_ingester_spec,
    placement_key,
    score,
)

THREE = Cluster.of({"ing-a": "http://10.0.0.1:4437", "ing-b": "http://10.0.0.2:4437",
                    "ing-c": "http://10.0.0.3:4437"}, generation=7)


# Fixed owners for a fixed description: a change to the rule (the hash, its key, the
# placement key of buckets, the tie-break) changes some of these and must be deliberate, since
# every deployed stream would move.
@pytest.mark.parametrize(("path", "owner"), [
    ("a", "ing-c"),
    ("b", "ing-b"),
    ("f", "ing-a"),
    ("k", "ing-a"),
    ("orders/2026/eu", "ing-c"),
    ("chat/room-1", "ing-b"),
    ("chat/room-2", "ing-c"),
    ("日本/ストリーム", "ing-c"),
    ("x" * 400, "ing-b"),
    # bucketed streams are placed by their bucket: every stream of tenant-1 on ing-b
    ("\x00b/tenant-1/s1", "ing-b"),
    ("\x00b/tenant-1/s2", "ing-b"),
    ("\x00b/tenant-1/anything else", "ing-b"),
    ("\x00b/tenant-2/s1", "ing-c"),
    ("\x00b/tenant-6/s", "ing-a"),
])
def test_stable_owners(path: str, owner: str) -> None:
    assert THREE.owner(path).id == owner


def _reference_owner(ids: list[str], key: str) -> str:
    """The documented rule, written out independently of the module."""
    def weight(i: str) -> tuple[int, str]:
        h = hashlib.blake2b(key.encode(), key=i.encode(), digest_size=8).digest()
        return int.from_bytes(h, "big"), i

    return max(ids, key=weight)


def test_matches_the_documented_rule() -> None:
    for n in range(500):
        path = f"stream/{n}"
        assert THREE.owner(path).id == _reference_owner(list(THREE.ids), path)
        assert THREE.owner(path).id == max(THREE.ids, key=lambda i, p=path: score(i, p))  # type: ignore[misc]


def test_placement_keys() -> None:
    assert placement_key("plain/path") == "plain/path"
    assert placement_key("\x00b/tenant-1/s1") == "\x00b/tenant-1/" == bucket_placement_key("tenant-1")
    for b in ("tenant-1", "tenant-2", "tenant-6", "abcd"):
        assert THREE.bucket_owner(b) == THREE.owner(f"\x00b/{b}/some stream")
    # a plain path can never look like a bucket key (it has no NUL), so the surfaces cannot collide
    assert THREE.owner("b/tenant-1/s1") is not None


def test_order_of_ingesters_does_not_matter() -> None:
    shuffled = Cluster.of([("ing-c", "http://10.0.0.3:4437"), ("ing-a", "http://10.0.0.1:4437"),
                           ("ing-b", "http://10.0.0.2:4437")], generation=7)
    assert shuffled == THREE
    assert all(shuffled.owner(f"p{n}") == THREE.owner(f"p{n}") for n in range(200))


def test_urls_do_not_move_streams() -> None:
    moved = Cluster.of({"ing-a": "http://elsewhere:1", "ing-b": "http://10.0.0.2:4437",
                        "ing-c": "http://10.0.0.3:4437"}, generation=8)
    assert all(moved.owner(f"p{n}").id == THREE.owner(f"p{n}").id for n in range(500))


def test_single_ingester_owns_everything() -> None:
    one = Cluster.of({"solo": "http://127.0.0.1:4438"})
    for path in ("a", "b/c", "\x00b/tenant-1/s", "x" * 480):
        assert one.owner(path) == Ingester("solo", "http://127.0.0.1:4438")


PATHS = [f"tenant-{n % 97}/stream-{n}" for n in range(10_000)]


def test_balanced() -> None:
    counts = Counter(THREE.owner(p).id for p in PATHS)
    assert set(counts) == {"ing-a", "ing-b", "ing-c"}
    for n in counts.values():
        assert 3000 <= n <= 3700, counts


def test_adding_an_ingester_moves_about_one_in_n() -> None:
    four = THREE.with_ingesters({**{i.id: i.url for i in THREE.ingesters}, "ing-d": "http://10.0.0.4:4437"})
    assert four.generation == 8
    before = {p: THREE.owner(p).id for p in PATHS}
    after = {p: four.owner(p).id for p in PATHS}
    moved = [p for p in PATHS if before[p] != after[p]]
    fraction = len(moved) / len(PATHS)
    assert 0.20 <= fraction <= 0.30, fraction
    assert all(after[p] == "ing-d" for p in moved)  # none moves between the surviving ingesters
    # and removing it again moves back exactly those
    assert {p for p in PATHS if four.owner(p).id != THREE.owner(p).id} == set(moved)


def test_removing_an_ingester_moves_only_its_streams() -> None:
    two = THREE.with_ingesters({"ing-a": "http://10.0.0.1:4437", "ing-c": "http://10.0.0.3:4437"})
    moved = [p for p in PATHS if THREE.owner(p).id != two.owner(p).id]
    assert all(THREE.owner(p).id == "ing-b" for p in moved)
    assert len(moved) == sum(1 for p in PATHS if THREE.owner(p).id == "ing-b")
    spread = Counter(two.owner(p).id for p in moved)
    assert min(spread.values()) > 0.4 * len(moved), spread  # spread over the rest, not dumped on one


@pytest.mark.parametrize(("build", "message"), [
    (lambda: Cluster.of({}), "no ingesters"),
    (lambda: Cluster.of([("a", "http://h:1"), ("a", "http://h:2")]), "'a' appears more than once"),
    (lambda: Cluster.of([("a", "http://h:1"), ("b", "http://h:1/")]), "same url"),
    (lambda: Cluster.of({"a": "ftp://h:1"}), "ingester a: url 'ftp://h:1' must start with http:// or https://"),
    (lambda: Cluster.of({"a": "h:1"}), "must start with http:// or https://"),
    (lambda: Cluster.of({"a": "http://"}), "has no host"),
    (lambda: Cluster.of({"a": "http://h:99999"}), "is not a URL"),
    (lambda: Cluster.of({"a": "http://h:1/v1"}), "no path, query or fragment"),
    (lambda: Cluster.of({"a": "http://h:1?x=1"}), "no path, query or fragment"),
    (lambda: Cluster.of({"a": "http://u:p@h:1"}), "must not carry credentials"),
    (lambda: Cluster.of({"a": ""}), "is empty"),
    (lambda: Cluster.of({"": "http://h:1"}), "ingester id '' is invalid"),
    (lambda: Cluster.of({"a b": "http://h:1"}), "ingester id 'a b' is invalid"),
    (lambda: Cluster.of({"-a": "http://h:1"}), "starting with a letter or digit"),
    (lambda: Cluster.of({"x" * 65: "http://h:1"}), "1 to 64 letters"),
    (lambda: Cluster.of({"a": "http://h:1"}, generation=0), "generation 0 is invalid"),
    (lambda: Cluster.of({"a": "http://h:1"}, generation=True), "generation True is invalid"),
    (lambda: Cluster(1, (Ingester("a", "http://h:1/"),)), "must not end with '/'"),
    (lambda: parse_ingester_spec("a:http://h:1"), "write it as id=url"),
])
def test_validation(build: object, message: str) -> None:
    with pytest.raises(PlacementError) as e:
        build()  # type: ignore[operator]
    assert message in str(e.value)


def test_stored_form_round_trips() -> None:
    data = THREE.encode()
    assert Cluster.decode(data) == THREE
    assert THREE.to_json() == {"version": 1, "generation": 7, "ingesters": [
        {"id": "ing-a", "url": "http://10.0.0.1:4437"}, {"id": "ing-b", "url": "http://10.0.0.2:4437"},
        {"id": "ing-c", "url": "http://10.0.0.3:4437"}]}
    assert parse_ingester_spec(" ing-a = http://h:1/ ") == ("ing-a", "http://h:1")


@pytest.mark.parametrize(("data", "message"), [
    (b"nope", "not JSON"),
    (b"[]", "is a JSON object"),
    (b'{"version": 2, "generation": 1, "ingesters": []}', "newer than this server's 1"),
    (b'{"generation": 1, "ingesters": [], "extra": 1}', "unknown fields ['extra']"),
    (b'{"ingesters": [{"id": "a", "url": "http://h:1"}]}', "generation is missing"),
    (b'{"generation": 1, "ingesters": {}}', "ingesters must be a list"),
    (b'{"generation": 1, "ingesters": [{"id": "a"}]}', "ingesters[0] must be an object with exactly id and url"),
    (b'{"generation": 1, "ingesters": [{"id": 1, "url": "http://h:1"}]}', "must be strings"),
    (b'{"generation": 1, "ingesters": []}', "no ingesters"),
    (b'{"generation": "1", "ingesters": [{"id": "a", "url": "http://h:1"}]}', "generation '1' is invalid"),
])
def test_decode_errors(data: bytes, message: str) -> None:
    with pytest.raises(PlacementError) as e:
        Cluster.decode(data)
    assert message in str(e.value)


def test_a_description_carries_the_one_it_replaced() -> None:
    """`previous` (issue 15 item 4): the generation before, so a new owner finds a moved
    stream's previous owner; one level deep, and validated like the rest."""
    first = Cluster.of({"a": "http://h:1"}, 1)
    second = first.with_ingesters({"a": "http://h:1", "b": "http://h:2"})
    assert second.previous == first and second.generation == 2
    assert Cluster.decode(second.encode()) == second
    assert second.with_ingesters({"b": "http://h:2"}).previous == second.alone()
    d = second.to_json()
    for bad, why in [({"generation": 5, "ingesters": d["previous"]["ingesters"]}, "must be 1"),
                     ({"generation": 1}, "exactly generation and ingesters"),
                     ({"generation": 1, "ingesters": [{"id": "a"}]}, "previous: ingesters")]:
        with pytest.raises(PlacementError, match=why):
            Cluster.from_json({**d, "previous": bad})
