"""The aggregator's ALU model (agents.aggregator.logic): sums, duplicates, drops by reason,
concurrent jobs, shadow copies, int32 wrap-around, and a two-level tree."""

from __future__ import annotations

import json

import numpy as np
import pytest

from agents.aggregator.logic import (
    Aggregator,
    Contributor,
    DropReason,
    JobConfig,
    jobs_from_json,
    sampled_counters,
)
from agents.collectives.ina import InaJob, InaWorker
from agents.wire.ina import (
    AGGREGATOR,
    EXP_NONE,
    Header,
    PacketType,
    build,
    gen_of,
    parse,
    slot_of,
)
from tests.unit.ina_sim import Net

AGG = ("10.0.1.1", 48000)


def _members(n: int, first: int = 0, net: int = 0) -> tuple[Contributor, ...]:
    return tuple(Contributor(w, f"10.0.{net}.{w + 10}", 47000 + w) for w in range(first,
                                                                                  first + n))


def _job(jid: int = 1, n: int = 3, slots: int = 4, elements: int = 8, **kw) -> JobConfig:
    return JobConfig(id=jid, members=_members(n), slots=slots, slot_elements=elements, **kw)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 10.0
        return self.t


def _agg(*jobs: JobConfig, parent=None) -> Aggregator:
    return Aggregator(jobs or (_job(),), Clock(), parent=parent)


def _req(job: JobConfig, worker: int, chunk: int, values, exponent: int = 0,
         next_exp: int = EXP_NONE, **override) -> bytes:
    h = Header(PacketType.REQUEST, job.id, chunk, slot_of(chunk, job.slots),
               gen_of(chunk, job.slots), worker, exponent, next_exp)
    return build(h._replace(**override), np.asarray(values, dtype=np.int32))


def _addr(job: JobConfig, worker: int) -> tuple[str, int]:
    return next(m.addr for m in job.members if m.id == worker)


def _contribute(agg: Aggregator, job: JobConfig, worker: int, chunk: int, values, **kw):
    return agg.handle(_req(job, worker, chunk, values, **kw), _addr(job, worker))


def _drops(agg: Aggregator) -> dict[str, int]:
    return {k: v for k, v in agg.counters()["drops"].items() if v}


def test_three_workers_sum_and_every_member_gets_the_result():
    job = _job()
    agg = _agg(job)
    rng = np.random.default_rng(0)
    xs = [rng.integers(-1000, 1000, size=8) for _ in range(3)]
    assert _contribute(agg, job, 0, 0, xs[0], next_exp=3) == []
    assert _contribute(agg, job, 1, 0, xs[1], next_exp=7) == []
    assert agg.counters()["slots_in_use"] == 1
    out = _contribute(agg, job, 2, 0, xs[2])          # EXP_NONE: no proposal
    assert sorted(addr for _, addr in out) == sorted(m.addr for m in job.members)
    assert len({data for data, _ in out}) == 1        # one packet, multicast
    pkt = parse(out[0][0])
    assert pkt.header == Header(PacketType.RESULT, 1, 0, 0, 0, AGGREGATOR, 0, 7, 0b111, 8)
    assert np.array_equal(pkt.values, sum(xs))
    c = agg.counters()
    assert (c["aggregated"], c["completed"], c["results_sent"], c["slots_in_use"],
            c["slots_in_use_max"], c["duplicates"]) == (3, 1, 3, 0, 1, 0)
    assert c["jobs"]["1"]["open_fabric_ns"]["count"] == 1
    assert _drops(agg) == {} and not any(c["malformed"].values())


def test_a_duplicate_contribution_is_ignored_and_counted():
    job = _job()
    agg = _agg(job)
    _contribute(agg, job, 0, 0, [5] * 8)
    assert _contribute(agg, job, 0, 0, [5] * 8) == []
    _contribute(agg, job, 1, 0, [1] * 8)
    out = _contribute(agg, job, 2, 0, [1] * 8)
    assert parse(out[0][0]).values.tolist() == [7] * 8
    assert agg.counters()["duplicates"] == 1 and agg.counters()["aggregated"] == 3


def test_non_members_unknown_jobs_and_misfits_are_dropped_by_reason():
    job = _job(slots=4, elements=8)
    agg = _agg(job)
    assert agg.handle(_req(job, 9, 0, [1]), ("10.0.0.19", 47009)) == []   # no such member
    assert agg.handle(_req(job, 0, 0, [1]), ("10.0.0.99", 47000)) == []   # id of 0, not its ip
    assert agg.handle(_req(job, 0, 0, [1]), ("10.0.0.10", 1)) == []       # nor its port
    assert agg.handle(_req(job, 1, 0, [1]), _addr(job, 0)) == []          # 1's id from 0
    other = _job(jid=2)
    assert agg.handle(_req(other, 0, 0, [1]), _addr(job, 0)) == []
    partial = build(Header(PacketType.PARTIAL, 1, 0, 0, 0, 0, bitmap=1), b"")
    assert agg.handle(partial, _addr(job, 0)) == []                       # members REQUEST
    result = build(Header(PacketType.RESULT, 1, 0, 0, 0, AGGREGATOR, bitmap=1), b"")
    assert agg.handle(result, ("10.0.9.9", 48000)) == []                  # a root has no parent
    assert _contribute(agg, job, 0, 1, [1], slot=9) == []
    assert _contribute(agg, job, 0, 1, [1], slot=2) == []
    assert _contribute(agg, job, 0, 1, [1], gen=1) == []
    assert _contribute(agg, job, 0, 1, [1] * 9) == []
    assert agg.handle(b"IN\x01\x09" + bytes(28), _addr(job, 0)) == []
    assert agg.handle(b"garbage", _addr(job, 0)) == []
    assert _drops(agg) == {"not_member": 4, "unknown_job": 1, "not_child": 1,
                           "unexpected_result": 1, "bad_slot": 1, "schedule_mismatch": 2,
                           "too_long": 1}
    c = agg.counters()
    assert {k: v for k, v in c["malformed"].items() if v} == {"UNKNOWN_TYPE": 1,
                                                              "TOO_SHORT": 1}
    assert c["aggregated"] == 0 and c["slots_in_use"] == 0 and c["packets_sent"] == 0


def test_each_configured_address_has_its_own_received_discarded_and_sent():
    job = _job(slots=4, elements=8, uplink_id=0)
    parent = ("10.0.9.1", 48000)
    agg = _agg(job, parent=parent)
    for w in range(3):
        _contribute(agg, job, w, 0, [1] * 8)                 # the last one sends a PARTIAL
    _contribute(agg, job, 0, 0, [1] * 8)                     # a duplicate: re-sends it
    agg.handle(_req(_job(jid=7), 1, 1, [1]), _addr(job, 1))  # unknown job, from member 1
    agg.handle(b"garbage", _addr(job, 2))
    agg.handle(_req(job, 0, 1, [1]), ("10.0.0.99", 47000))   # forged id 0: not its address
    result = build(Header(PacketType.RESULT, 1, 0, 0, 0, AGGREGATOR, bitmap=7),
                   np.full(8, 3, dtype=np.int32))
    agg.handle(result, parent)                               # relayed to every member
    peers = agg.counters()["peers"]
    ip = {w: f"{a[0]}:{a[1]}" for w, a in ((w, _addr(job, w)) for w in range(3))}
    assert peers == {ip[0]: {"received": 2, "discarded": 0, "sent": 1},
                     ip[1]: {"received": 2, "discarded": 1, "sent": 1},
                     ip[2]: {"received": 2, "discarded": 1, "sent": 1},
                     "10.0.9.1:48000": {"received": 1, "discarded": 0, "sent": 2}}
    c = agg.counters()
    assert c["received_from_others"] == 1 and c["drops"]["not_member"] == 1
    assert c["packets_received"] == sum(p["received"] for p in peers.values()) + 1
    assert c["packets_sent"] == sum(p["sent"] for p in peers.values())


def test_count_and_exponent_must_match_the_chunks_first_contribution():
    job = _job()
    agg = _agg(job)
    _contribute(agg, job, 0, 0, [1] * 8, exponent=-20)
    assert _contribute(agg, job, 1, 0, [1] * 7, exponent=-20) == []
    assert _contribute(agg, job, 1, 0, [1] * 8, exponent=-21) == []
    assert _drops(agg) == {"count_mismatch": 1, "exponent_mismatch": 1}


def test_two_concurrent_jobs_use_separate_pools_and_never_mix():
    a = _job(jid=10, n=3, slots=2, elements=4)
    b = JobConfig(id=11, members=_members(2, first=5), slots=2, slot_elements=4)
    agg = _agg(a, b)
    results = {}
    # the same chunk numbers, hence the same slots, interleaved packet by packet
    for chunk in range(6):
        sends = [(a, w, [100 * (w + 1) + chunk] * 4) for w in range(3)]
        sends += [(b, 5 + w, [-(w + 1) - chunk] * 4) for w in range(2)]
        order = [sends[i] for i in (0, 3, 1, 4, 2)]
        for job, w, v in order:
            for data, _ in _contribute(agg, job, w, chunk, v):
                p = parse(data)
                results[(p.header.job, p.header.chunk)] = p.values.tolist()
    for chunk in range(6):
        assert results[(10, chunk)] == [600 + 3 * chunk] * 4
        assert results[(11, chunk)] == [-3 - 2 * chunk] * 4
    c = agg.counters()
    assert c["jobs"]["10"]["completed"] == c["jobs"]["11"]["completed"] == 6
    assert c["slots_total"] == 8 and _drops(agg) == {}


def test_shadow_copy_answers_a_retransmitted_request_after_its_result_was_lost():
    job = _job(slots=2)                  # chunks 0, 2, 4 share slot 0: gens 0, 1, 0
    agg = _agg(job)
    for w in range(3):
        out = _contribute(agg, job, w, 0, [w + 1] * 8)
    result0 = out[0][0]
    # worker 1 lost result 0 and times out: its retransmission is answered, to it alone
    again = _contribute(agg, job, 1, 0, [2] * 8)
    assert again == [(result0, _addr(job, 1))]
    # the others go on to chunk 2 (same slot, the other copy); 1 still has only chunk 0 in
    _contribute(agg, job, 0, 2, [1] * 8)
    _contribute(agg, job, 2, 2, [1] * 8)
    assert _contribute(agg, job, 1, 0, [2] * 8) == [(result0, _addr(job, 1))]
    out = _contribute(agg, job, 1, 2, [1] * 8)
    assert parse(out[0][0]).values.tolist() == [3] * 8
    # chunk 4 reuses copy (0, 0): by now every worker has sent chunk 2, so holds result 0
    _contribute(agg, job, 0, 4, [0] * 8)
    assert _contribute(agg, job, 1, 0, [2] * 8) == []
    c = agg.counters()
    assert c["shadow_answers"] == 2 and c["results_sent"] == 3 + 2 + 3
    assert _drops(agg) == {"stale": 1}


def test_a_newer_chunk_cannot_take_a_copy_still_summing():
    job = _job(slots=2)
    agg = _agg(job)
    _contribute(agg, job, 0, 0, [1] * 8)
    assert _contribute(agg, job, 1, 4, [1] * 8) == []        # chunk 4 = slot 0, gen 0
    assert _drops(agg) == {"slot_busy": 1}


def test_int32_sums_wrap_like_a_switch_alu_and_are_counted():
    job = _job(n=2, elements=3)
    agg = _agg(job)
    big = (1 << 31) - 1
    _contribute(agg, job, 0, 0, [big, -(1 << 31), 5])
    out = _contribute(agg, job, 1, 0, [1, -1, -5])
    assert parse(out[0][0]).values.tolist() == [-(1 << 31), big, 0]
    expect = (np.array([big, -(1 << 31), 5], np.int32) + np.array([1, -1, -5], np.int32))
    assert parse(out[0][0]).values.tolist() == expect.tolist()      # numpy int32 wraps alike
    assert agg.counters()["overflow_elements"] == 2


def test_an_exponent_only_chunk_aggregates_the_max_proposal():
    job = _job()
    agg = _agg(job)
    for w, e in enumerate((-3, EXP_NONE, 12)):
        out = _contribute(agg, job, w, 0, [], next_exp=e)
    h = parse(out[0][0]).header
    assert h.elements == 0 and h.next_exp == 12


# --------------------------------------------------------------------------- tree

ROOT = ("10.0.9.1", 48000)
LEAVES = [("10.0.9.2", 48000), ("10.0.9.3", 48000)]


def _tree(jid: int = 5, slots: int = 4, elements: int = 16):
    """2 leaves x 2 workers + a root. Leaf k's members are workers 2k, 2k+1; the root's
    children are the leaves, with ids 100 + k."""
    root_job = JobConfig(id=jid, members=(), slots=slots, slot_elements=elements,
                         children=tuple(Contributor(100 + k, *LEAVES[k]) for k in range(2)))
    leaf_jobs = [JobConfig(id=jid, members=_members(2, first=2 * k, net=k), slots=slots,
                           slot_elements=elements, uplink_id=100 + k) for k in range(2)]
    root = Aggregator([root_job], Clock())
    leaves = [Aggregator([leaf_jobs[k]], Clock(), parent=ROOT) for k in range(2)]
    return root, leaves, leaf_jobs


def _tree_net(dtype, size: int, loss: float = 0.0, seed: int = 0, slots: int = 4,
              elements: int = 16):
    root, leaves, leaf_jobs = _tree(slots=slots, elements=elements)
    rng = np.random.default_rng(seed)
    if dtype == np.int32:
        xs = [rng.integers(-(1 << 31), 1 << 31, size=size).astype(np.int32) for _ in range(4)]
    else:
        xs = [rng.standard_normal(size).astype(dtype) for _ in range(4)]
    outs = [np.zeros_like(x) for x in xs]
    ina = InaJob(job_id=5, workers=4, slots=slots, slot_elements=elements)
    workers = {}
    for k, job in enumerate(leaf_jobs):
        for m in job.members:
            workers[m.addr] = (InaWorker(ina, m.id, xs[m.id], outs[m.id], aggregator=LEAVES[k],
                                         timeout_ns=50_000), LEAVES[k])
    net = Net({ROOT: root, LEAVES[0]: leaves[0], LEAVES[1]: leaves[1]}, workers, loss=loss,
              seed=seed)
    net.run()
    return net, root, leaves, xs, outs, workers


def test_a_two_level_tree_sums_and_each_leaf_forwards_one_partial_per_slot():
    net, root, leaves, xs, outs, workers = _tree_net(np.int32, 16 * 10 + 3)
    expect = xs[0] + xs[1] + xs[2] + xs[3]                     # int32, wrapping
    for out in outs:
        assert np.array_equal(out, expect)
    chunks = 11                                               # int32: no exponent round
    for leaf in leaves:
        c = leaf.counters()
        assert c["partials_forwarded"] == chunks and c["partials_resent"] == 0
        assert c["completed"] == chunks and c["results_sent"] == 2 * chunks
        assert c["results_received"] == chunks and c["aggregated"] == 2 * chunks
    r = root.counters()
    assert r["aggregated"] == 2 * chunks and r["partials_received"] == 2 * chunks
    assert r["completed"] == chunks and r["results_sent"] == 2 * chunks
    assert r["requests"] == 0 and r["overflow_elements"] > 0   # random int32 sums wrap
    assert all(_drops(a) == {} for a in (root, *leaves))
    assert all(w.c.retransmissions == 0 for w, _ in workers.values())


def test_a_tree_with_float_data_agrees_exponents_through_partials():
    net, root, leaves, xs, outs, workers = _tree_net(np.float32, 1000)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    assert np.max(np.abs(outs[0].astype(np.float64) - exact)) < 1e-5
    assert all(np.array_equal(outs[0], o) for o in outs)      # every worker, the same bits
    assert root.counters()["completed"] == 4 + 63             # 4 exponent-only + data chunks
    assert root.counters()["overflow_elements"] == 0


def test_a_lossy_tree_still_sums_exactly_through_retransmissions():
    net, root, leaves, xs, outs, workers = _tree_net(np.int32, 16 * 40, loss=0.04, seed=7)
    expect = xs[0] + xs[1] + xs[2] + xs[3]
    for out in outs:
        assert np.array_equal(out, expect)
    assert net.lost > 0 and sum(w.c.retransmissions for w, _ in workers.values()) > 0
    resent = sum(leaf.counters()["partials_resent"] for leaf in leaves)
    answered = sum(a.counters()["shadow_answers"] for a in (root, *leaves))
    assert resent + answered > 0


def test_a_leaf_takes_results_only_from_its_parent_and_counts_repeats():
    root, leaves, leaf_jobs = _tree(slots=2, elements=2)
    leaf, job = leaves[0], leaf_jobs[0]
    _contribute(leaf, job, 0, 0, [1, 2])
    (partial, to), = _contribute(leaf, job, 1, 0, [3, 4])
    assert to == ROOT and parse(partial).header.type == PacketType.PARTIAL
    assert parse(partial).header.sender == 100 and parse(partial).header.bitmap == 0b11
    # a worker retransmits while the chunk waits upstream: the PARTIAL goes up again
    assert _contribute(leaf, job, 1, 0, [3, 4]) == [(partial, ROOT)]
    result = build(Header(PacketType.RESULT, 5, 0, 0, 0, AGGREGATOR, bitmap=0b11),
                   np.array([40, 60], np.int32))
    assert leaf.handle(result, ("10.0.9.9", 48000)) == []
    out = leaf.handle(result, ROOT)
    assert sorted(a for _, a in out) == sorted(m.addr for m in job.members)
    assert all(data == result for data, _ in out)             # relayed as the root sent it
    assert leaf.handle(result, ROOT) == []
    early = build(Header(PacketType.RESULT, 5, 1, 1, 0, AGGREGATOR, bitmap=0b11), b"")
    assert leaf.handle(early, ROOT) == []                     # nothing forwarded for chunk 1
    c = leaf.counters()
    assert c["duplicate_results"] == 1 and c["partials_resent"] == 1
    assert _drops(leaf) == {"not_parent": 1, "unexpected_result": 1}


def test_a_leaf_needs_its_uplink_id():
    with pytest.raises(ValueError, match="uplink_id"):
        Aggregator([_job()], Clock(), parent=ROOT)


# --------------------------------------------------------------------------- config


def test_jobs_json_round_trip():
    text = json.dumps([{"id": 3, "members": [[0, "198.18.0.1", 47000], [1, "198.18.0.3", 47001]],
                        "children": [[7, "198.18.0.5", 48000]], "slots": 32,
                        "slot_elements": 1024, "uplink_id": None}])
    (job,) = jobs_from_json(json.loads(text))
    assert job.contributors[2] == Contributor(7, "198.18.0.5", 48000)
    assert (job.slots, job.slot_elements, job.uplink_id) == (32, 1024, None)


@pytest.mark.parametrize("jobs, match", [
    ({}, "non-empty JSON list"),
    ([], "non-empty JSON list"),
    ([5], "must be an object"),
    ([{"id": 1, "members": [], "slots": 1}], "missing keys"),
    ([{"id": 1, "members": [[0, "1.2.3.4", 1]], "slots": 1, "slot_elements": 1, "x": 1}],
     "unknown keys"),
    ([{"id": "1", "members": [[0, "1.2.3.4", 1]], "slots": 1, "slot_elements": 1}],
     "id must be an integer"),
    ([{"id": 1, "members": [[0, "1.2.3.4", 1]], "slots": True, "slot_elements": 1}],
     "slots must be an integer"),
    ([{"id": 1, "members": [[0, "1.2.3.4"]], "slots": 1, "slot_elements": 1}], "entry"),
    ([{"id": 1, "members": [[0, "1.2.3.400", 1]], "slots": 1, "slot_elements": 1}], "IPv4"),
    ([{"id": 1, "members": [[0, "1.2.3.4", 0]], "slots": 1, "slot_elements": 1}], "port"),
    ([{"id": 1, "members": [[0xFFFF, "1.2.3.4", 1]], "slots": 1, "slot_elements": 1}],
     "contributor id"),
    ([{"id": 1, "members": [[0, "1.2.3.4", 1], [0, "1.2.3.5", 1]], "slots": 1,
       "slot_elements": 1}], "appears twice"),
    ([{"id": 1, "members": [[0, "1.2.3.4", 1], [1, "1.2.3.4", 1]], "slots": 1,
       "slot_elements": 1}], "share an address"),
    ([{"id": 1, "members": [], "slots": 1, "slot_elements": 1}], "members \\+ children"),
    ([{"id": 1, "members": [[i, "1.2.3.4", 1000 + i] for i in range(65)], "slots": 1,
       "slot_elements": 1}], "members \\+ children"),
    ([{"id": 1, "members": [[0, "1.2.3.4", 1]], "slots": 0, "slot_elements": 1}], "slots"),
    ([{"id": 1, "members": [[0, "1.2.3.4", 1]], "slots": 1, "slot_elements": 99999}],
     "slot_elements"),
    ([{"id": 1, "members": [[0, "1.2.3.4", 1]], "slots": 1, "slot_elements": 1}] * 2,
     "job id appears twice"),
])
def test_bad_jobs_json_names_the_problem(jobs, match):
    with pytest.raises(ValueError, match=match):
        jobs_from_json(jobs)


def test_counters_have_every_key_from_the_start():
    agg = _agg(_job())
    before = agg.counters()
    job = _job()
    for w in range(3):
        _contribute(agg, job, w, 0, [1] * 8)
    agg.handle(b"x", ("1.1.1.1", 1))
    after = agg.counters()

    def keys(d, prefix=""):
        return {prefix + k for k, v in d.items()} | {
            x for k, v in d.items() if isinstance(v, dict) for x in keys(v, f"{prefix}{k}.")}
    assert keys(before) == keys(after)
    assert set(before["drops"]) == {r.value for r in DropReason}


def test_the_sampled_counters_are_flat_numbers_with_occupancy_per_job_and_drops_by_reason():
    a = _job(jid=10, n=3, slots=4, elements=4)
    b = JobConfig(id=11, members=_members(2, first=5), slots=2, slot_elements=4)
    agg = _agg(a, b)
    for chunk in (0, 1):                   # two chunks of job 10 open (2 of 3 workers in)
        for w in (0, 1):
            _contribute(agg, a, w, chunk, [1] * 4)
    _contribute(agg, a, 0, 0, [1] * 4)     # a duplicate
    for w in (5, 6):                       # job 11's chunk completes: its copy is free again
        _contribute(agg, b, w, 0, [2] * 4)
    _contribute(agg, a, 0, 0, [1] * 5)     # longer than the job's slots: dropped
    flat = sampled_counters(agg.counters())
    assert all(isinstance(v, int | float) and not isinstance(v, bool) for v in flat.values())
    assert flat["slots_in_use"] == 2 and flat["slots"] == 6 and flat["slots_total"] == 12
    assert (flat["job10_slots_in_use"], flat["job10_slots"]) == (2, 4)
    assert (flat["job11_slots_in_use"], flat["job11_slots"]) == (0, 2)
    assert flat["aggregated"] == 6 and flat["duplicates"] == 1 and flat["results_sent"] == 2
    assert flat["drops_too_long"] == 1 and flat["drops_stale"] == 0
    assert {f"drops_{r.value}" for r in DropReason} <= set(flat)
    assert flat["malformed_TOO_SHORT"] == 0
