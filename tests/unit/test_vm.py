"""VM mode without qemu: the initramfs archive, module order, qemu argv, the job file,
the accelerator choice, copy-back, the records that let `down` end a VM by pid, and the
pre-build refusal of a config whose kernel features are missing."""

from __future__ import annotations

import gzip
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.cli import vmmode
from testbed.run import requirements
from testbed.vm import guest, initramfs, qemu, runner
from testbed.vm.job import Job, Share


def _read_newc(data: bytes) -> list[tuple[str, int, bytes, tuple[int, int]]]:
    """(name, mode, contents, rdev) of every member, checking the format as the kernel
    does: magic, hex fields, 4-byte alignment of names and data, the trailer last."""
    out = []
    pos = 0
    while True:
        assert data[pos:pos + 6] == b"070701", f"bad magic at {pos}"
        fields = [int(data[pos + 6 + 8 * i: pos + 14 + 8 * i], 16) for i in range(13)]
        mode, size, rmaj, rmin, namesize = fields[1], fields[6], fields[9], fields[10], fields[11]
        pos += 110
        name = data[pos:pos + namesize - 1].decode()
        assert data[pos + namesize - 1] == 0
        pos += namesize
        pos += -pos % 4
        body = data[pos:pos + size]
        pos += size
        pos += -pos % 4
        if name == "TRAILER!!!":
            assert pos == len(data)
            return out
        out.append((name, mode, body, (rmaj, rmin)))


def _module_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "lib" / "modules" / "6.1.0-test"
    lines = []
    deps = {"kernel/fs/9p/9p.ko": ["kernel/net/9p/9pnet.ko", "kernel/fs/netfs/netfs.ko"],
            "kernel/net/9p/9pnet.ko": [],
            "kernel/fs/netfs/netfs.ko": [],
            "kernel/net/9p/9pnet_virtio.ko": ["kernel/net/9p/9pnet.ko",
                                              "kernel/drivers/virtio/virtio_ring.ko",
                                              "kernel/drivers/virtio/virtio.ko"],
            "kernel/drivers/virtio/virtio.ko": [],
            "kernel/drivers/virtio/virtio_ring.ko": [],
            "kernel/fs/overlayfs/overlay.ko": []}
    for path, d in deps.items():
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_bytes(b"\x7fELF" + path.encode())
        lines.append(f"{path}: {' '.join(d)}")
    (tree / "modules.dep").write_text("\n".join(lines) + "\n")
    return tree


def test_module_order_puts_every_dependency_first(tmp_path):
    tree = _module_tree(tmp_path)
    order = initramfs.module_order((tree / "modules.dep").read_text(),
                                   ["9p", "9pnet_virtio", "overlay"])
    names = [Path(p).stem for p in order]
    assert names.index("9pnet") < names.index("9p")
    assert names.index("netfs") < names.index("9p")
    assert names.index("virtio") < names.index("9pnet_virtio")
    assert names.index("virtio_ring") < names.index("9pnet_virtio")
    assert len(names) == len(set(names)) == 7


def test_module_order_names_a_module_the_kernel_lacks(tmp_path):
    tree = _module_tree(tmp_path)
    with pytest.raises(ValueError, match="no_such_module"):
        initramfs.module_order((tree / "modules.dep").read_text(), ["no_such_module"])


def test_initramfs_is_a_valid_newc_archive_with_init_busybox_and_modules(tmp_path):
    tree = _module_tree(tmp_path)
    busybox = tmp_path / "busybox"
    busybox.write_bytes(b"\x7fELF-busybox")
    data = gzip.decompress(initramfs.build(busybox, tree, ["9p", "overlay"]))
    members = {name: (mode, body, rdev) for name, mode, body, rdev in _read_newc(data)}
    mode, body, _ = members["init"]
    assert stat.S_ISREG(mode) and mode & 0o111 and body.startswith(b"#!/bin/busybox sh")
    assert members["bin/busybox"][1] == b"\x7fELF-busybox"
    assert stat.S_ISLNK(members["bin/sh"][0]) and members["bin/sh"][1] == b"busybox"
    mode, _, rdev = members["dev/console"]
    assert stat.S_ISCHR(mode) and rdev == (5, 1)
    listed = members["modules.list"][1].decode().split()
    assert listed.index("9pnet") < listed.index("9p")
    for name in listed:
        assert members[f"mods/{name}.ko"][1].startswith(b"\x7fELF")


def test_initramfs_is_reproducible_and_its_hash_follows_its_inputs(tmp_path):
    tree = _module_tree(tmp_path)
    busybox = tmp_path / "busybox"
    busybox.write_bytes(b"one")
    assert initramfs.build(busybox, tree, ["9p"]) == initramfs.build(busybox, tree, ["9p"])
    first = initramfs.recipe_hash(busybox, tree)
    busybox.write_bytes(b"two")
    assert initramfs.recipe_hash(busybox, tree) != first


def _spec(**kw) -> qemu.VmSpec:
    base = dict(vmlinuz="/c/vmlinuz", initrd="/c/initrd.gz", modules="/c/mods",
                python="/v/bin/python", job_dir="/run/testbed/vm/x",
                shares=[("out0", "/work/runs")])
    base.update(kw)
    return qemu.VmSpec(**base)


def test_qemu_argv_has_no_network_and_shares_the_root_read_only():
    argv = qemu.qemu_argv(_spec())
    assert argv[0] == "qemu-system-x86_64"
    assert argv[argv.index("-nic") + 1] == "none"
    fsdevs = [argv[i + 1] for i, a in enumerate(argv) if a == "-fsdev"]
    devices = [argv[i + 1] for i, a in enumerate(argv) if a == "-device"]
    root = next(f for f in fsdevs if ",path=/," in f)
    assert "readonly=on" in root
    assert any("path=/c/mods" in f and "readonly=on" in f for f in fsdevs)
    job = next(f for f in fsdevs if "path=/run/testbed/vm/x" in f)
    assert "readonly" not in job
    tags = sorted(d.split("mount_tag=")[1] for d in devices)
    assert tags == ["hostroot", "job", "modules", "out0"]
    cmdline = argv[argv.index("-append") + 1]
    assert "tb.python=/v/bin/python" in cmdline and "console=ttyS0" in cmdline
    assert "-no-reboot" in argv


def test_qemu_argv_accelerators():
    tcg = qemu.qemu_argv(_spec())
    assert tcg[tcg.index("-accel") + 1].startswith("tcg")
    kvm = qemu.qemu_argv(_spec(accel="kvm"))
    assert kvm[kvm.index("-accel") + 1] == "kvm"


def test_accel_choice_probes_once_and_falls_back_to_tcg(tmp_path, monkeypatch):
    monkeypatch.delenv("TESTBED_VM_ACCEL", raising=False)
    monkeypatch.setattr(qemu.os, "access", lambda p, m: True)
    calls = []

    def hangs():
        calls.append(1)
        return False, "no power-off within 30 s"

    accel, why = qemu.choose_accel(tmp_path, hangs)
    assert accel == "tcg" and "no power-off" in why
    assert qemu.choose_accel(tmp_path, hangs)[0] == "tcg"
    assert len(calls) == 1                       # the verdict is cached
    monkeypatch.setattr(qemu.os, "access", lambda p, m: False)
    assert qemu.choose_accel(tmp_path / "other", hangs)[0] == "tcg"
    monkeypatch.setenv("TESTBED_VM_ACCEL", "kvm")
    assert qemu.choose_accel(tmp_path, hangs) == ("kvm", "TESTBED_VM_ACCEL=kvm")


def test_job_round_trips(tmp_path):
    job = Job(argv=["python", "-m", "testbed", "run", "x.yaml"], cwd="/work", env={"A": "1"},
              copy_back=[Share("out0", "/work/runs")], rw=[Share("rw0", "/var/lib/testbed/vm")],
              modules=["rdma_rxe"], stay_up=True, stop_argv=["down"])
    job.dump(tmp_path)
    assert Job.load(tmp_path) == job
    assert json.loads((tmp_path / "job.json").read_text())["argv"][-1] == "x.yaml"


def test_copy_back_copies_only_new_or_changed_entries(tmp_path):
    runs = tmp_path / "runs"
    (runs / "old").mkdir(parents=True)
    (runs / "old" / "f").write_text("x")
    os.utime(runs / "old" / "f", (1, 1))
    os.utime(runs / "old", (1, 1))
    job = Job(argv=[], cwd="/", env={}, copy_back=[Share("out0", str(runs))])
    before = {"out0": guest.snapshot(runs)}
    (runs / "new-run").mkdir()
    (runs / "new-run" / "summary.json").write_text("{}")
    out = tmp_path / "out"
    (out / "out0").mkdir(parents=True)
    copied = guest.copy_back(job, before, out_base=out)
    assert copied == [str(runs / "new-run")]
    assert (out / "out0" / "new-run" / "summary.json").read_text() == "{}"
    assert not (out / "out0" / "old").exists()


def test_guest_argv_drops_only_the_vm_flag():
    argv = vmmode._guest_argv(["run", "--vm", "configs/x.yaml", "--runs-dir", "r"])
    assert argv[:3] == [sys.executable, "-m", "testbed"]
    assert argv[3:] == ["run", "configs/x.yaml", "--runs-dir", "r"]


def test_records_let_down_end_a_vm_by_pid(tmp_path, monkeypatch):
    monkeypatch.setenv("TESTBED_VM_STATE_DIR", str(tmp_path / "state"))
    proc = subprocess.Popen(["sleep", "60"])         # stands in for a qemu that hangs
    try:
        job_dir = tmp_path / "state" / "up-lab-1"
        job_dir.mkdir(parents=True)
        rec = runner.VmRecord("up-lab-1", proc.pid, runner._start_time(proc.pid), str(job_dir),
                              "lab", ["x"])
        rec.save()
        # the same pid with another start time is a recycled pid: never ours to kill
        stale = runner.VmRecord("run-2", proc.pid, "1", str(tmp_path / "gone"), "", ["y"])
        stale.save()
        assert {r.id for r in runner.records()} == {"up-lab-1", "run-2"}
        assert runner.stop(stale) is False
        assert proc.poll() is None
        assert [r.id for r in runner.records()] == ["up-lab-1"]
        assert runner.stop_lab("other-lab", grace_s=0.2) is False
        assert proc.poll() is None
        assert runner.stop_lab("lab", grace_s=0.2) is True
        assert (job_dir.exists() is False) and runner.records() == []
        proc.wait(timeout=10)
        assert proc.returncode == -15                 # SIGTERM, by pid
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_plan_needing_a_missing_feature_stops_before_building(monkeypatch):
    from testbed.net import probe as probe_mod

    monkeypatch.setattr(requirements, "NEEDS",
                        [lambda plan: {"rdma_rxe": "host h1 has endpoint: rxe"}])
    monkeypatch.setattr(probe_mod, "probe", lambda: [probe_mod.Feature(
        "rdma_rxe", False, "not in this kernel", "rxe endpoints")])
    monkeypatch.delenv("TESTBED_VM", raising=False)
    with pytest.raises(vmmode.CliError) as err:
        vmmode.require_kernel_features(object(), "run", "configs/x.yaml")
    text = str(err.value)
    assert err.value.code == 2
    assert "rdma_rxe (host h1 has endpoint: rxe): not in this kernel" in text
    assert "testbed run --vm configs/x.yaml" in text
    monkeypatch.setattr(probe_mod, "probe", lambda: [probe_mod.Feature(
        "rdma_rxe", True, "ok", "rxe endpoints")])
    vmmode.require_kernel_features(object(), "run", "configs/x.yaml")
