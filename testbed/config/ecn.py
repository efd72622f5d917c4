"""The ECN marking curve's fields, shared by a port class's `ecn` (models.EcnConfig, which
adds what marks) and the timeline's `ecn` event (models.EcnEvent). Its fields are
documented in the tables of those two models."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from testbed.fields import SizeBytes, Strict

EcnPresetName = Literal["hpcc-ns3", "dcqcn-paper", "ns3-rdma"]


EcnMarkerName = Literal["bpf", "red"]


class EcnCurve(Strict):
    """DCQCN CP marking curve. A preset, or kmin/kmax/pmax, or a step at k."""

    preset: EcnPresetName | None = Field(
        None, description="a named curve (kmin / kmax / pmax): hpcc-ns3 (100 KB / 400 KB per "
                          "25 Gb/s of port rate / 0.2), dcqcn-paper (5 KB / 200 KB / 0.01), "
                          "ns3-rdma (40 KB / 1000 KB / 1); not with kmin/kmax or k. An ecn "
                          "mapping with none of them is dcqcn-paper")
    kmin_bytes: SizeBytes | None = Field(
        None, alias="kmin", description="queue at which marking starts (no marks at or below "
                                        "it); goes with kmax")
    kmax_bytes: SizeBytes | None = Field(
        None, alias="kmax", description="queue at which the mark probability reaches pmax; "
                                        "every packet is marked above it")
    pmax: float | None = Field(None, gt=0, le=1, description="mark probability at kmax, rising "
                                                             "linearly from kmin (unset: 1)")
    k_bytes: SizeBytes | None = Field(None, alias="k", description="step marking (DCTCP style): "
                                      "every packet is marked above this queue")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
