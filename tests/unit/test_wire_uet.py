"""UET wire formats (agents.wire.uet), cross-checked against the scapy layers of
agents.wire.uet_scapy in both directions, and against byte strings written out by hand
from the layout (so a mistake shared by both implementations is caught). No root needed.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scapy.layers.inet import IP, UDP
from scapy.packet import Raw, raw

from agents.wire.uet import (
    ACK_BYTES,
    ACK_CC_BYTES,
    CONTROL_BYTES,
    NACK_BYTES,
    PDS_CC_REQUEST_BYTES,
    PDS_REQUEST_BYTES,
    SES_PAYLOAD_LENGTH_MAX,
    SES_STD_BYTES,
    UET_UDP_PORT,
    Ack,
    CcType,
    Control,
    CtlType,
    MalformedUet,
    Nack,
    NackCode,
    NextHdr,
    Parsed,
    PdsType,
    Request,
    RequestPacker,
    SesOpcode,
    SesRequest,
    data_offset,
    pack_ack,
    pack_control,
    pack_nack,
    pack_request,
    parse,
)
from agents.wire.uet_scapy import UETPDSAck, UETPDSControl, UETPDSNack, UETPDSRequest, UETSESStd

U8, U16, U24, U32, U64 = (st.integers(0, (1 << b) - 1) for b in (8, 16, 24, 32, 64))
SPORT = 0xD003      # an entropy source port, as the senders use


# --------------------------------------------------------------------------- strategies

@st.composite
def requests(draw: st.DrawFn, std: bool) -> Request:
    cc = draw(st.booleans())
    if std:
        next_hdr = NextHdr.REQUEST_STD
    else:
        next_hdr = draw(st.sampled_from([h for h in NextHdr if h != NextHdr.REQUEST_STD]))
    return Request(psn=draw(U32), spdcid=draw(U16), dpdcid=draw(U16),
                   clear_psn_offset=draw(U16), retrans=draw(st.booleans()),
                   ackreq=draw(st.booleans()), syn=draw(st.booleans()), next_hdr=next_hdr,
                   ccc_id=draw(U8) if cc else None, credit_target=draw(U24) if cc else None)


@st.composite
def ses_requests(draw: st.DrawFn) -> SesRequest:
    som = draw(st.booleans())
    hdr_data = draw(st.booleans())
    carries_header_data = som and hdr_data
    return SesRequest(
        opcode=draw(st.integers(0, 0x3F)), som=som, eom=draw(st.booleans()),
        message_id=draw(U16), request_length=draw(U32), buffer_offset=draw(U64),
        memory_key=draw(U64), header_data=draw(U64) if carries_header_data else 0,
        message_offset=0 if som else draw(U32),
        payload_length=0 if carries_header_data else draw(st.integers(0, 64)),
        job_id=draw(U24), pid_on_fep=draw(st.integers(0, 0xFFF)),
        resource_index=draw(st.integers(0, 0xFFF)), initiator=draw(U32),
        ri_generation=draw(U8), hdr_data_present=hdr_data,
        delivery_complete=draw(st.booleans()))


@st.composite
def std_packets(draw: st.DrawFn) -> tuple[Request, SesRequest, bytes]:
    ses = draw(ses_requests())
    # payload_length 0 states nothing (no trim check), so any payload goes with it
    n = ses.payload_length or draw(st.integers(0, 64))
    return draw(requests(std=True)), ses, draw(st.binary(min_size=n, max_size=n))


@st.composite
def acks(draw: st.DrawFn) -> Ack:
    base = dict(cack_psn=draw(U32), ack_psn_offset=draw(U16), spdcid=draw(U16),
                dpdcid=draw(U16), ecn_marked=draw(st.booleans()), retrans=draw(st.booleans()),
                probe=draw(st.booleans()), request=draw(st.integers(0, 3)))
    cc = draw(st.sampled_from([None, CcType.NSCC, CcType.CREDIT]))
    if cc is None:
        return Ack(**base)
    common = dict(cc_type=cc, mpr=draw(U8), sack_psn_offset=draw(U16), sack_bitmap=draw(U64),
                  ooo_count=draw(U16))
    if cc == CcType.NSCC:
        return Ack(**base, **common, service_time=draw(U16), restore_cwnd=draw(st.booleans()),
                   rcv_cwnd_pend=draw(st.integers(0, 0x7F)), rcvd_bytes=draw(U24))
    return Ack(**base, **common, credit=draw(U24))


nacks = st.builds(Nack, nack_code=U8, nack_psn=U32, spdcid=U16, dpdcid=U16,
                  ecn_marked=st.booleans(), retrans=st.booleans(),
                  nack_type=st.integers(0, 1), vendor_code=U8, payload=U32)
controls = st.builds(Control, ctl_type=st.sampled_from(list(CtlType)), psn=U32, spdcid=U16,
                     dpdcid=U16, payload=U32, probe_opaque=U16, retrans=st.booleans(),
                     ackreq=st.booleans(), syn=st.booleans())


# --------------------------------------------------------------------------- round trips

@given(std_packets())
def test_a_request_with_ses_header_round_trips(pkt: tuple[Request, SesRequest, bytes]) -> None:
    req, ses, payload = pkt
    data = pack_request(req, ses, payload)
    assert len(data) == (PDS_CC_REQUEST_BYTES if req.ccc_id is not None
                         else PDS_REQUEST_BYTES) + SES_STD_BYTES + len(payload)
    p = parse(data)
    assert (p.pds, p.ses, bytes(p.payload)) == (req, ses, payload)
    assert not p.trimmed


@given(requests(std=False), st.binary(max_size=40))
def test_a_request_without_ses_header_round_trips(req: Request, payload: bytes) -> None:
    p = parse(pack_request(req, None, payload))
    assert (p.pds, p.ses, bytes(p.payload)) == (req, None, payload)


@given(acks())
def test_an_ack_round_trips(ack: Ack) -> None:
    data = pack_ack(ack)
    assert len(data) == (ACK_BYTES if ack.cc_type is None else ACK_CC_BYTES)
    p = parse(data)
    assert (p.pds, p.ses, bytes(p.payload)) == (ack, None, b"")


@given(nacks)
def test_a_nack_round_trips(nack: Nack) -> None:
    data = pack_nack(nack)
    assert len(data) == NACK_BYTES and parse(data).pds == nack


@given(controls)
def test_a_control_packet_round_trips(c: Control) -> None:
    data = pack_control(c)
    assert len(data) == CONTROL_BYTES and parse(data).pds == c


def test_parse_takes_bytearray_memoryview_and_a_slice_of_a_larger_buffer() -> None:
    data = pack_nack(Nack(NackCode.TRIMMED, 5, 1, 2))
    big = bytearray(b"\xff" * 8 + data + b"\xee" * 8)
    for form in (bytearray(data), memoryview(data), memoryview(big)[8:8 + len(data)]):
        assert parse(form).pds == Nack(NackCode.TRIMMED, 5, 1, 2)
    assert parse(memoryview(data).cast("c")).pds.nack_psn == 5   # type: ignore[union-attr]


# --------------------------------------------------------------------------- known answers

KNOWN = [
    pytest.param(
        pack_request(Request(psn=0x01020304, spdcid=0x0A0B, dpdcid=0x0C0D,
                             clear_psn_offset=5, retrans=True, ackreq=True),
                     SesRequest(SesOpcode.WRITE, som=False, eom=True, message_id=0x1234,
                                request_length=0x00100000, buffer_offset=0x1122334455667788,
                                memory_key=0x0102030405060708, message_offset=0x1000,
                                payload_length=4, job_id=0x789ABC, pid_on_fep=0x123,
                                resource_index=0xABC, initiator=0xDEADBEEF,
                                ri_generation=0x56, delivery_complete=True), b"UET!"),
        # prologue: type 2 (00010) next_hdr 3 (0011) flags retrans|ackreq (0011000)
        "1198 0005 01020304 0a0b 0c0d"
        # opcode 1 | flags dc|eom | msg id | ri_gen, job | pid | ri index
        " 01 22 1234 56789abc 0123 0abc"
        " 1122334455667788 deadbeef 0102030405060708"
        # rsvd | payload_length 4 | message_offset 0x1000 | request_length
        " 0000 0004 00001000 00100000"
        " 55455421", id="rud_req+ses_nonsom"),
    pytest.param(
        pack_request(Request(psn=1, spdcid=1, dpdcid=2, syn=True, ccc_id=0x11,
                             credit_target=0x010000),
                     SesRequest(SesOpcode.SEND, som=True, eom=True, message_id=1,
                                request_length=10, header_data=0xCAFEBABE00000001,
                                hdr_data_present=True)),
        # type 13 (01101) next_hdr 3 (0011) flags syn (0000100); ccc_id 0x11, credit 65536
        "6984 0000 00000001 0001 0002 11010000"
        # opcode SEND | flags hdr_data_present, eom, som
        " 05 07 0001 00000000 0000 0000 0000000000000000 00000000 0000000000000000"
        " cafebabe00000001 0000000a", id="rud_cc_req+ses_som_header_data"),
    pytest.param(
        pack_ack(Ack(cack_psn=0x100, ack_psn_offset=3, spdcid=2, dpdcid=1, ecn_marked=True,
                     request=2, cc_type=CcType.NSCC, mpr=8, sack_psn_offset=2,
                     sack_bitmap=0b1011, service_time=1500, restore_cwnd=True,
                     rcv_cwnd_pend=5, rcvd_bytes=8192, ooo_count=4)),
        # type 8 (01000) next_hdr 0 flags ecn|request=2 (0100100)
        "4024 0003 00000100 0002 0001 00 08 0002 000000000000000b 05dc 85002000 0004",
        id="ack_cc_nscc"),
    pytest.param(
        pack_ack(Ack(cack_psn=7, ack_psn_offset=0, spdcid=1, dpdcid=2, cc_type=CcType.CREDIT,
                     credit=0x1000, ooo_count=1)),
        "4000 0000 00000007 0001 0002 10 00 0000 0000000000000000 00100000 0000 0001",
        id="ack_cc_credit"),
    pytest.param(
        pack_ack(Ack(cack_psn=0xFFFFFFFF, ack_psn_offset=1, spdcid=9, dpdcid=8, probe=True)),
        "3808 0001 ffffffff 0009 0008", id="ack"),
    pytest.param(
        pack_nack(Nack(NackCode.TRIMMED, nack_psn=0xFFFFFFFE, spdcid=1, dpdcid=2,
                       retrans=True, payload=7)),
        # type 10 (01010) next_hdr 0 flags retrans (0010000)
        "5010 01 00 fffffffe 0001 0002 00000007", id="nack_trimmed"),
    pytest.param(
        pack_control(Control(CtlType.CREDIT, psn=9, spdcid=3, dpdcid=4, payload=4096,
                             ackreq=True)),
        # type 11 (01011) ctl_type 7 (0111) flags ackreq (0001000)
        "5b88 0000 00000009 0003 0004 00001000", id="control_credit"),
]


@pytest.mark.parametrize(("data", "expected"), KNOWN)
def test_packets_match_bytes_written_out_by_hand(data: bytes, expected: str) -> None:
    assert data.hex() == expected.replace(" ", "")


def test_the_known_request_parses_back_to_its_fields() -> None:
    p = parse(bytes.fromhex(KNOWN[0].values[1].replace(" ", "")))
    assert isinstance(p.pds, Request) and p.ses is not None
    assert (p.pds.psn, p.pds.retrans, p.pds.ackreq, p.pds.syn) == (0x01020304, True, True, False)
    assert (p.ses.job_id, p.ses.ri_generation, data_offset(p.ses)) == (0x789ABC, 0x56, 0x1000)
    assert bytes(p.payload) == b"UET!"


# --------------------------------------------------------------------------- scapy

def _udp(data: bytes) -> UDP:
    return UDP(raw(UDP(sport=SPORT, dport=UET_UDP_PORT) / Raw(data)))


@given(std_packets())
def test_our_request_bytes_read_the_same_in_scapy(pkt: tuple[Request, SesRequest, bytes]) -> None:
    req, ses, payload = pkt
    s = _udp(pack_request(req, ses, payload))
    r, h = s[UETPDSRequest], s[UETSESStd]
    assert r.type == (PdsType.RUD_CC_REQ if req.ccc_id is not None else PdsType.RUD_REQ)
    assert (r.next_hdr, r.psn, r.spdcid, r.dpdcid, r.clear_psn_offset) == (
        NextHdr.REQUEST_STD, req.psn, req.spdcid, req.dpdcid, req.clear_psn_offset)
    assert (r.retrans, r.ackreq, r.syn) == (req.retrans, req.ackreq, req.syn)
    if req.ccc_id is not None:
        assert (r.ccc_id, r.credit_target) == (req.ccc_id, req.credit_target)
    assert (h.opcode, h.som, h.eom, h.message_id, h.request_length, h.buffer_offset,
            h.memory_key, h.job_id, h.pid_on_fep, h.resource_index, h.initiator,
            h.ri_generation, h.hdr_data_present, h.delivery_complete, h.version) == (
        ses.opcode, ses.som, ses.eom, ses.message_id, ses.request_length, ses.buffer_offset,
        ses.memory_key, ses.job_id, ses.pid_on_fep, ses.resource_index, ses.initiator,
        ses.ri_generation, ses.hdr_data_present, ses.delivery_complete, 0)
    if ses.som and ses.hdr_data_present:
        assert h.header_data == ses.header_data
    else:
        assert (h.payload_length, h.message_offset) == (ses.payload_length, ses.message_offset)
    assert bytes(h.payload) == payload


@given(acks())
def test_our_ack_bytes_read_the_same_in_scapy(ack: Ack) -> None:
    s = _udp(pack_ack(ack))[UETPDSAck]
    assert (s.type, s.ack_psn_offset, s.cack_psn, s.spdcid, s.dpdcid, s.ecn_marked,
            s.retrans, s.probe, s.request) == (
        PdsType.ACK if ack.cc_type is None else PdsType.ACK_CC, ack.ack_psn_offset,
        ack.cack_psn, ack.spdcid, ack.dpdcid, ack.ecn_marked, ack.retrans, ack.probe,
        ack.request)
    if ack.cc_type is None:
        return
    assert (s.cc_type, s.mpr, s.sack_psn_offset, s.sack_bitmap, s.ooo_count) == (
        ack.cc_type, ack.mpr, ack.sack_psn_offset, ack.sack_bitmap, ack.ooo_count)
    if ack.cc_type == CcType.NSCC:
        assert (s.service_time, s.restore_cwnd, s.rcv_cwnd_pend, s.rcvd_bytes) == (
            ack.service_time, ack.restore_cwnd, ack.rcv_cwnd_pend, ack.rcvd_bytes)
    else:
        assert s.credit == ack.credit


@given(nacks)
def test_our_nack_bytes_read_the_same_in_scapy(n: Nack) -> None:
    s = _udp(pack_nack(n))[UETPDSNack]
    assert (s.type, s.nack_code, s.nack_psn, s.spdcid, s.dpdcid, s.ecn_marked, s.retrans,
            s.nack_type, s.vendor_code, s.nack_payload) == (
        PdsType.NACK, n.nack_code, n.nack_psn, n.spdcid, n.dpdcid, n.ecn_marked, n.retrans,
        n.nack_type, n.vendor_code, n.payload)


@given(controls)
def test_our_control_bytes_read_the_same_in_scapy(c: Control) -> None:
    s = _udp(pack_control(c))[UETPDSControl]
    assert (s.type, s.ctl_type, s.psn, s.spdcid, s.dpdcid, s.ctl_payload, s.probe_opaque,
            s.retrans, s.ackreq, s.syn) == (
        PdsType.CONTROL, c.ctl_type, c.psn, c.spdcid, c.dpdcid, c.payload, c.probe_opaque,
        c.retrans, c.ackreq, c.syn)


@given(std_packets())
def test_scapy_request_bytes_parse_to_the_same_fields(
        pkt: tuple[Request, SesRequest, bytes]) -> None:
    req, ses, payload = pkt
    cc = req.ccc_id is not None
    pds = UETPDSRequest(type=PdsType.RUD_CC_REQ if cc else PdsType.RUD_REQ,
                        retrans=req.retrans, ackreq=req.ackreq, syn=req.syn,
                        clear_psn_offset=req.clear_psn_offset, psn=req.psn,
                        spdcid=req.spdcid, dpdcid=req.dpdcid,
                        **({"ccc_id": req.ccc_id, "credit_target": req.credit_target}
                           if cc else {}))
    tail = ({"header_data": ses.header_data} if ses.som and ses.hdr_data_present else
            {"payload_length": ses.payload_length, "message_offset": ses.message_offset})
    hdr = UETSESStd(opcode=ses.opcode, som=ses.som, eom=ses.eom, message_id=ses.message_id,
                    request_length=ses.request_length, buffer_offset=ses.buffer_offset,
                    memory_key=ses.memory_key, job_id=ses.job_id, pid_on_fep=ses.pid_on_fep,
                    resource_index=ses.resource_index, initiator=ses.initiator,
                    ri_generation=ses.ri_generation, hdr_data_present=ses.hdr_data_present,
                    delivery_complete=ses.delivery_complete, **tail)
    frame = IP(raw(IP(dst="10.0.0.2") / UDP(sport=SPORT) / pds / hdr / Raw(payload)))
    assert frame[UDP].dport == UET_UDP_PORT
    p = parse(raw(frame[UDP].payload))
    assert (p.pds, p.ses, bytes(p.payload)) == (req, ses, payload)


@given(acks())
def test_scapy_ack_bytes_parse_to_the_same_fields(ack: Ack) -> None:
    fields = {f: getattr(ack, f) for f in ("ack_psn_offset", "cack_psn", "spdcid", "dpdcid",
                                           "ecn_marked", "retrans", "probe", "request")}
    if ack.cc_type is None:
        s = UETPDSAck(type=PdsType.ACK, **fields)
    else:
        cc = {f: getattr(ack, f) for f in ("cc_type", "mpr", "sack_psn_offset", "sack_bitmap",
                                           "ooo_count")}
        state = ({f: getattr(ack, f) for f in ("service_time", "restore_cwnd",
                                               "rcv_cwnd_pend", "rcvd_bytes")}
                 if ack.cc_type == CcType.NSCC else {"credit": ack.credit})
        s = UETPDSAck(type=PdsType.ACK_CC, **fields, **cc, **state)
    assert parse(raw(UDP(sport=SPORT) / s)[8:]).pds == ack


@given(nacks, controls)
def test_scapy_nack_and_control_bytes_parse_to_the_same_fields(n: Nack, c: Control) -> None:
    s = UETPDSNack(nack_code=n.nack_code, nack_psn=n.nack_psn, spdcid=n.spdcid,
                   dpdcid=n.dpdcid, ecn_marked=n.ecn_marked, retrans=n.retrans,
                   nack_type=n.nack_type, vendor_code=n.vendor_code, nack_payload=n.payload)
    assert parse(raw(s)).pds == n
    k = UETPDSControl(ctl_type=c.ctl_type, psn=c.psn, spdcid=c.spdcid, dpdcid=c.dpdcid,
                      ctl_payload=c.payload, probe_opaque=c.probe_opaque, retrans=c.retrans,
                      ackreq=c.ackreq, syn=c.syn)
    assert parse(raw(k)).pds == c


def test_scapy_picks_the_layer_from_the_pds_type_whatever_the_source_port() -> None:
    for data, cls in ((pack_ack(Ack(1, 0, 1, 2)), UETPDSAck),
                      (pack_nack(Nack(1, 1, 1, 2)), UETPDSNack),
                      (pack_control(Control(CtlType.PROBE, 1, 1, 2)), UETPDSControl),
                      (pack_request(Request(1, 1, 2, next_hdr=NextHdr.NONE), None), UETPDSRequest)):
        for sport in (SPORT, 53):                     # 53: scapy binds it to DNS
            assert type(UDP(raw(UDP(sport=sport, dport=UET_UDP_PORT) / Raw(data))).payload) \
                is cls


# --------------------------------------------------------------------------- malformed

def _samples() -> list[tuple[str, bytes, int]]:
    """(name, packet, header bytes): one of each type; cuts below `header` are errors."""
    req = Request(psn=3, spdcid=1, dpdcid=2)
    ses = SesRequest(SesOpcode.WRITE, som=False, eom=False, message_id=1, request_length=8192,
                     message_offset=4096, payload_length=16)
    cc_req = Request(psn=3, spdcid=1, dpdcid=2, ccc_id=1, credit_target=4096)
    return [
        ("rud_req", pack_request(req, ses, bytes(16)), PDS_REQUEST_BYTES + SES_STD_BYTES),
        ("rud_cc_req", pack_request(cc_req, ses, bytes(16)),
         PDS_CC_REQUEST_BYTES + SES_STD_BYTES),
        ("rud_req_no_ses", pack_request(Request(3, 1, 2, next_hdr=NextHdr.NONE), None),
         PDS_REQUEST_BYTES),
        ("ack", pack_ack(Ack(1, 0, 1, 2)), ACK_BYTES),
        ("ack_cc_nscc", pack_ack(Ack(1, 0, 1, 2, cc_type=CcType.NSCC)), ACK_CC_BYTES),
        ("ack_cc_credit", pack_ack(Ack(1, 0, 1, 2, cc_type=CcType.CREDIT, credit=5)),
         ACK_CC_BYTES),
        ("nack", pack_nack(Nack(NackCode.TRIMMED, 1, 1, 2)), NACK_BYTES),
        ("control", pack_control(Control(CtlType.CREDIT, 1, 1, 2, payload=9)), CONTROL_BYTES),
    ]


@pytest.mark.parametrize(("name", "data", "header"), _samples())
def test_every_truncation_of_a_header_raises_malformed_uet(name: str, data: bytes,
                                                           header: int) -> None:
    for n in range(header):
        with pytest.raises(MalformedUet) as e:
            parse(data[:n])
        assert e.value.reason in ({"short"} if n < 2 else {"truncated", "truncated_ses"}), n
        assert isinstance(e.value, ValueError)


def test_a_cut_inside_the_ses_header_still_hands_back_the_pds_header() -> None:
    data = _samples()[0][1]
    with pytest.raises(MalformedUet) as e:
        parse(data[:PDS_REQUEST_BYTES + 10])
    assert e.value.reason == "truncated_ses"
    assert e.value.pds == Request(psn=3, spdcid=1, dpdcid=2)


def test_a_packet_cut_inside_its_payload_is_recognised_as_trimmed() -> None:
    data = _samples()[0][1]                  # payload_length 16
    header = PDS_REQUEST_BYTES + SES_STD_BYTES
    assert not parse(data).trimmed
    for n in range(header, len(data)):
        p = parse(data[:n])
        assert p.trimmed and len(p.payload) == n - header
    # a switch keeping 128 IP bytes (IP 20 + UDP 8): 100 bytes of UDP payload
    som = SesRequest(SesOpcode.WRITE, som=True, eom=False, message_id=1, request_length=1 << 20,
                     payload_length=4096)
    cut = pack_request(Request(1, 1, 2), som, bytes(4096))[:100]
    p = parse(cut)
    assert p.trimmed and p.ses is not None and p.ses.payload_length == 4096
    assert len(p.payload) == 100 - header


def test_more_payload_than_the_ses_header_says_is_inconsistent() -> None:
    with pytest.raises(MalformedUet, match="inconsistent_length"):
        parse(_samples()[0][1] + b"x")


SUPPORTED = {PdsType.RUD_REQ, PdsType.RUD_CC_REQ, PdsType.ACK, PdsType.ACK_CC, PdsType.NACK,
             PdsType.CONTROL}


@pytest.mark.parametrize("pds_type", range(32))
def test_types_we_do_not_speak_are_malformed_with_a_reason(pds_type: int) -> None:
    if pds_type in SUPPORTED:
        return
    data = struct.pack("!H", pds_type << 11) + bytes(60)
    with pytest.raises(MalformedUet) as e:
        parse(data)
    known = pds_type in set(PdsType)
    assert e.value.reason == ("unsupported_type" if known else "unknown_type")


def test_bad_next_hdr_ctl_type_cc_type_and_ses_version_are_malformed() -> None:
    req = bytearray(_samples()[0][1])
    for nh in range(7, 16):
        req[0:2] = struct.pack("!H", (PdsType.RUD_REQ << 11) | (nh << 7))
        with pytest.raises(MalformedUet, match="bad_next_hdr"):
            parse(req)
    ack = bytearray(pack_ack(Ack(1, 0, 1, 2)))
    ack[0:2] = struct.pack("!H", (PdsType.ACK << 11) | (NextHdr.RESPONSE << 7))
    with pytest.raises(MalformedUet, match="bad_next_hdr"):
        parse(ack)
    ctl = bytearray(pack_control(Control(CtlType.NOOP, 1, 1, 2)))
    for t in range(10, 16):
        ctl[0:2] = struct.pack("!H", (PdsType.CONTROL << 11) | (t << 7))
        with pytest.raises(MalformedUet, match="bad_ctl_type"):
            parse(ctl)
    acc = bytearray(pack_ack(Ack(1, 0, 1, 2, cc_type=CcType.NSCC)))
    for t in range(2, 16):
        acc[12] = t << 4
        with pytest.raises(MalformedUet, match="bad_cc_type"):
            parse(acc)
    for version in (1, 2, 3):
        req = bytearray(_samples()[0][1])
        req[PDS_REQUEST_BYTES + 1] |= version << 6
        with pytest.raises(MalformedUet, match="bad_ses_version"):
            parse(req)


@settings(max_examples=500)
@given(st.binary(max_size=96))
def test_parse_of_any_bytes_returns_or_raises_malformed_uet_only(data: bytes) -> None:
    try:
        assert isinstance(parse(data), Parsed)
    except MalformedUet as e:
        assert e.reason


def test_reserved_bits_and_unmodelled_flags_are_ignored_on_read() -> None:
    c = bytearray(pack_control(Control(CtlType.CREDIT, 1, 1, 2)))
    c[1] |= 0x20 | 0x40 | 0x03                                   # isrod, reserved
    assert parse(c).pds == Control(CtlType.CREDIT, 1, 1, 2)


# --------------------------------------------------------------------------- pack checks

@pytest.mark.parametrize(("build", "field"), [
    (lambda: pack_request(Request(1 << 32, 1, 2, next_hdr=NextHdr.NONE), None), "psn"),
    (lambda: pack_request(Request(1, 1 << 16, 2, next_hdr=NextHdr.NONE), None), "spdcid"),
    (lambda: pack_request(Request(1, 1, -1, next_hdr=NextHdr.NONE), None), "dpdcid"),
    (lambda: pack_request(Request(1, 1, 2, next_hdr=NextHdr.NONE, ccc_id=256,
                                  credit_target=0), None), "ccc_id"),
    (lambda: pack_request(Request(1, 1, 2, next_hdr=NextHdr.NONE, ccc_id=1,
                                  credit_target=1 << 24), None), "credit_target"),
    (lambda: pack_request(Request(1, 1, 2, next_hdr=NextHdr.NONE, ccc_id=1), None),
     "credit_target"),
    (lambda: pack_request(Request(1, 1, 2), None), "next_hdr"),
    (lambda: pack_request(Request(1, 1, 2), SesRequest(64, True, True, 1, 1)), "opcode"),
    (lambda: pack_request(Request(1, 1, 2), SesRequest(1, True, True, 1 << 16, 1)),
     "message_id"),
    (lambda: pack_request(Request(1, 1, 2), SesRequest(1, False, True, 1, 1,
                                                       payload_length=1 << 14)),
     "payload_length"),
    (lambda: pack_request(Request(1, 1, 2), SesRequest(1, True, True, 1, 1, job_id=1 << 24)),
     "job_id"),
    (lambda: pack_request(Request(1, 1, 2), SesRequest(1, True, True, 1, 1, pid_on_fep=4096)),
     "pid_on_fep"),
    (lambda: pack_request(Request(1, 1, 2), SesRequest(1, True, True, 1, 1, header_data=1)),
     "header_data"),
    (lambda: pack_request(Request(1, 1, 2), SesRequest(1, True, True, 1, 1,
                                                       message_offset=1)), "message_offset"),
    (lambda: pack_ack(Ack(1, 1 << 16, 1, 2)), "ack_psn_offset"),
    (lambda: pack_ack(Ack(1, 0, 1, 2, request=4)), "request"),
    (lambda: pack_ack(Ack(1, 0, 1, 2, sack_bitmap=1)), "sack_bitmap"),
    (lambda: pack_ack(Ack(1, 0, 1, 2, cc_type=CcType.NSCC, service_time=1 << 16)),
     "service_time"),
    (lambda: pack_ack(Ack(1, 0, 1, 2, cc_type=CcType.NSCC, rcv_cwnd_pend=128)),
     "rcv_cwnd_pend"),
    (lambda: pack_ack(Ack(1, 0, 1, 2, cc_type=CcType.NSCC, credit=1)), "credit"),
    (lambda: pack_ack(Ack(1, 0, 1, 2, cc_type=CcType.CREDIT, rcvd_bytes=1)), "rcvd_bytes"),
    (lambda: pack_ack(Ack(1, 0, 1, 2, cc_type=2)), "cc_type"),
    (lambda: pack_nack(Nack(256, 1, 1, 2)), "nack_code"),
    (lambda: pack_nack(Nack(1, 1, 1, 2, nack_type=2)), "nack_type"),
    (lambda: pack_control(Control(16, 1, 1, 2)), "ctl_type"),
    (lambda: pack_control(Control(1, 1, 1, 2, payload=1 << 32)), "payload"),
])
def test_pack_names_the_field_that_is_out_of_range(build, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        build()


# --------------------------------------------------------------------------- fast path

@given(st.one_of(std_packets(),
                 st.tuples(requests(std=False), st.none(), st.binary(max_size=64))))
def test_request_packer_writes_the_bytes_pack_request_writes(pkt) -> None:
    req, ses, payload = pkt
    packer = RequestPacker(max_payload_bytes=64)
    expected = pack_request(req, ses, payload)
    assert bytes(packer.pack(req, ses, payload)) == expected
    assert bytes(packer.pack(req, ses, memoryview(payload), check=False)) == expected


def test_request_packer_reuses_its_buffer_and_refuses_a_payload_too_big() -> None:
    packer = RequestPacker(max_payload_bytes=8)
    ses = SesRequest(SesOpcode.WRITE, som=True, eom=True, message_id=1, request_length=8,
                     payload_length=8)
    a = packer.pack(Request(1, 1, 2), ses, b"abcdefgh")
    b = packer.pack(Request(2, 1, 2), ses, b"ABCDEFGH")
    assert a.obj is b.obj and bytes(b)[-8:] == b"ABCDEFGH"
    with pytest.raises(ValueError, match="max_payload_bytes"):
        packer.pack(Request(1, 1, 2), ses, bytes(9))
    with pytest.raises(ValueError, match="psn"):
        packer.pack(Request(-1, 1, 2), ses, b"")


def test_data_offset_is_the_message_offset_and_zero_on_the_first_packet() -> None:
    first = SesRequest(SesOpcode.SEND, som=True, eom=False, message_id=1, request_length=9000)
    later = SesRequest(SesOpcode.SEND, som=False, eom=True, message_id=1, request_length=9000,
                       message_offset=8192, payload_length=808)
    assert (data_offset(first), data_offset(later)) == (0, 8192)


def test_payload_length_limit_is_fourteen_bits() -> None:
    assert SES_PAYLOAD_LENGTH_MAX == 16383


def test_parsed_headers_are_the_frozen_dataclasses_init_makes() -> None:
    import dataclasses
    req = Request(psn=1, spdcid=2, dpdcid=3, ccc_id=4, credit_target=5)
    ses = SesRequest(SesOpcode.SEND, som=True, eom=True, message_id=1, request_length=3,
                     payload_length=3)
    p = parse(pack_request(req, ses, b"abc"))
    assert (p.pds, p.ses) == (req, ses) and hash(p.pds) == hash(req) and hash(p.ses) == hash(ses)
    for obj, name in ((p, "payload"), (p.pds, "psn"), (p.ses, "som"),
                      (parse(pack_ack(Ack(1, 0, 1, 2))).pds, "cack_psn")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, 9)
