"""The UET NIC's fast request writer (agents.uet.nic.pack_segment) gives the bytes
agents.wire.uet.pack_request gives for the same fields, and they parse back."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agents.uet.nic import pack_segment, ses_request
from agents.uet.ses import OP_SEND, OP_WRITE, Segment
from agents.wire.uet import Request, data_offset, pack_request, parse


@settings(max_examples=300, deadline=None)
@given(opcode=st.sampled_from([OP_WRITE, OP_SEND]), som=st.booleans(), eom=st.booleans(),
       mid=st.integers(0, 0xFFFF), length=st.integers(0, 2**32 - 1),
       boff=st.integers(0, 2**64 - 1), key=st.integers(0, 2**64 - 1),
       hdr=st.integers(0, 2**64 - 1), moff=st.integers(1, 2**32 - 1),
       payload=st.binary(max_size=300), psn=st.integers(0, 2**32 - 1),
       ids=st.tuples(st.integers(0, 0xFFFF), st.integers(0, 0xFFFF)),
       retrans=st.booleans(), ackreq=st.booleans(),
       target=st.one_of(st.none(), st.integers(0, 2**24 - 1)))
def test_pack_segment_writes_what_pack_request_packs(opcode, som, eom, mid, length, boff,
                                                     key, hdr, moff, payload, psn, ids,
                                                     retrans, ackreq, target):
    seg = Segment(opcode, som, eom, mid, length, boff, key, hdr if som else 0,
                  0 if som else moff, memoryview(payload))
    buf = bytearray(16 + 44 + 300)
    n = pack_segment(buf, psn, ids[0], ids[1], retrans, ackreq, target, seg)
    req = Request(psn, ids[0], ids[1], retrans=retrans, ackreq=ackreq,
                  ccc_id=None if target is None else 0, credit_target=target)
    want = pack_request(req, ses_request(seg), payload)
    assert bytes(buf[:n]) == want
    p = parse(want)
    assert p.ses == ses_request(seg) and bytes(p.payload) == payload
    assert data_offset(p.ses) == seg.message_offset


def test_options_name_every_bad_field_at_once():
    import pytest

    from agents.uet.nic import UetOptions

    with pytest.raises(ValueError) as e:
        UetOptions(dscp=70, cc="dcqcn", entropies=0, drop_prob=1.0, rto_ns=0)
    msg = str(e.value)
    for field in ("dscp", "cc", "entropies", "drop_prob", "rto_ns"):
        assert f"{field} must be" in msg
    assert UetOptions(dscp=26).cc == "nscc"
    with pytest.raises(ValueError, match="trim_dscp must differ"):
        UetOptions(dscp=26, trim_dscp=26)
