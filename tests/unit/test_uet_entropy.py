"""Entropy choice (agents.uet.entropy): spray, oblivious and REPS-like recycling."""

from __future__ import annotations

import pytest

from agents.uet.entropy import EntropyPicker

PORTS = list(range(0xD000, 0xD008))


def test_spray_goes_round_robin_over_every_port():
    p = EntropyPicker("spray", PORTS, seed=3)
    picks = [p.pick(0.0) for _ in range(24)]
    assert sorted(picks[:8]) == PORTS
    assert picks[8:16] == picks[:8] == picks[16:]
    assert p.counters()["sports"] == dict.fromkeys(PORTS, 3)


def test_oblivious_uses_one_port_for_the_pdc():
    p = EntropyPicker("oblivious", PORTS, seed=5)
    assert len({p.pick(0.0) for _ in range(50)}) == 1
    assert len({EntropyPicker("oblivious", PORTS, seed=s).pick(0.0) for s in range(40)}) > 1


def test_reps_reuses_clean_entropies_and_drops_marked_ones():
    p = EntropyPicker("reps", PORTS, seed=1)
    first = [p.pick(0.0) for _ in range(4)]          # nothing to recycle: explore
    assert len(set(first)) == 4 and p.explored == 4
    p.feedback(first[0], ecn=False, trimmed=False, lost=False)
    p.feedback(first[1], ecn=True, trimmed=False, lost=False)
    p.feedback(first[2], ecn=False, trimmed=True, lost=False)
    p.feedback(first[3], ecn=False, trimmed=False, lost=True)
    assert p.pick(0.0) == first[0] and p.reused == 1         # the clean one comes back
    nxt = [p.pick(0.0) for _ in range(4)]                    # exploring skips the bad ones
    assert not set(nxt) & set(first[1:])
    assert p.abandoned == 3


def test_reps_forgets_bad_marks_when_every_port_is_bad():
    p = EntropyPicker("reps", PORTS[:2], seed=1)
    for port in PORTS[:2]:
        p.feedback(port, ecn=True, trimmed=False, lost=False)
    assert p.pick(0.0) in PORTS[:2]


def test_an_unknown_mode_or_no_ports_is_refused():
    with pytest.raises(ValueError, match="entropy mode"):
        EntropyPicker("ecmp", PORTS)
    with pytest.raises(ValueError, match="at least one"):
        EntropyPicker("spray", [])
