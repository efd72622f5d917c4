"""`--vm` on run, up, smoke and calibrate: the same command inside a stock-kernel VM.

Not a verb: cli/__init__.py hands a parsed command with `--vm` to `run_in_vm_mode`,
which checks the config on the host first (a typo should not cost a VM boot), then
runs the same argv minus `--vm` in a qemu guest booting Debian's stock kernel
(testbed/vm). Also here: the check every run, up and smoke makes before building,
which stops a config that needs a kernel feature this kernel lacks and suggests --vm.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

from testbed.cli.common import EXIT_USAGE, CliError, load_and_plan, require_root
from testbed.plan import Plan

VM_VERBS = ("run", "up", "smoke", "calibrate")


def add_vm_flag(parser) -> None:
    parser.add_argument("--vm", action="store_true",
                        help="run it inside a qemu VM booting Debian's stock kernel (which has "
                             "rdma_rxe, sch_netem and sch_red); installs qemu and the kernel "
                             "package on first use")


def add_vm_part_flags(parser, default_file: str | None = None) -> None:
    """`--vm [NAME]`, `--vms VMS.yaml`, `--underlay-netns NS` for a verb that can build one
    VM's part of a fabric spread over VMs (`--vms` with `--vm NAME`) or run in VM mode
    (`--vm` alone). The verb's `file` positional must be optional (nargs="?")."""
    parser.add_argument("--vm", nargs="?", const=True, default=False, metavar="NAME",
                        help="with --vms: only VM NAME's part of the fabric (its nodes and "
                             "its ends of the VXLAN tunnels to the others). Alone: run it "
                             "inside a qemu VM booting Debian's stock kernel (which has "
                             "rdma_rxe, sch_netem and sch_red); installs qemu and the kernel "
                             "package on first use")
    parser.add_argument("--vms", metavar="VMS.yaml",
                        help="the fabric is spread over these VMs (docs/scale-out.md); needs "
                             "--vm NAME")
    parser.add_argument("--underlay-netns", metavar="NS",
                        help="with --vms: the namespace whose address and routes carry the "
                             "tunnels (default: the one testbed runs in, the VM's own)")
    parser.set_defaults(_normalize=_normalize_vm_part, _default_file=default_file)


def _normalize_vm_part(parser, args) -> None:
    """`--vm` takes an optional NAME, so `VERB --vm FILE` reads FILE as the NAME: without
    --vms that is VM mode with FILE."""
    if isinstance(args.vm, str) and not args.vms:
        if args.file is not None:
            parser.error(f"--vm {args.vm}: a VM name needs --vms VMS.yaml (VM mode is "
                         "--vm with no name)")
        args.file, args.vm = args.vm, True
    if args.file is None:
        args.file = args._default_file
    if args.file is None:
        parser.error("the following arguments are required: file")
    if args.vms and not isinstance(args.vm, str):
        parser.error("--vms needs --vm NAME: the VM whose part to build here")
    if args.underlay_netns and not args.vms:
        parser.error("--underlay-netns goes with --vms and --vm NAME")


def require_kernel_features(plan: Plan, verb: str, path: str) -> None:
    """Stop before anything is built when the plan needs a feature this kernel lacks."""
    from testbed.run.requirements import needed_features

    needed = needed_features(plan)
    if not needed:
        return
    from testbed.net.probe import probe

    found = {f.name: f for f in probe()}
    missing = {name: why for name, why in needed.items()
               if name not in found or not found[name].present}
    if not missing:
        return
    lines = [f"{name} ({why}): {found[name].detail if name in found else 'not probed'}"
             for name, why in missing.items()]
    in_vm = os.environ.get("TESTBED_VM") == "1"
    hint = ("" if in_vm else
            f"; run it inside a VM with Debian's stock kernel: testbed {verb} --vm {path}")
    raise CliError(f"{verb}: {path} needs what kernel {platform.release()} lacks: "
                   + "; ".join(lines) + hint, EXIT_USAGE)


def _guest_argv(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "testbed", *[a for a in argv if a != "--vm"]]


def run_in_vm_mode(args, argv: list[str]) -> int:
    from testbed.vm.kernel import VmSetupError
    from testbed.vm.runner import VM_CALIBRATION_DIR, run_in_vm

    verb = args.verb
    try:
        require_root(f"{verb} --vm")
        if os.environ.get("TESTBED_VM") == "1":
            raise CliError(f"{verb} --vm: this is already the testbed VM", EXIT_USAGE)
        if verb in ("run", "up", "smoke"):
            load_and_plan(args.file)        # bad input: exit 2 here, not after a boot
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
    if verb == "up":
        from testbed.vm.runner import start_detached

        _, plan = load_and_plan(args.file)
        try:
            return start_detached(_guest_argv(argv),
                                  [sys.executable, "-m", "testbed", "down", plan.lab],
                                  lab=plan.lab, rw=[VM_CALIBRATION_DIR])
        except VmSetupError as exc:
            print(f"up --vm: {exc}", file=sys.stderr)
            return 1
    copy_back: list[Path] = []
    if verb == "run":
        copy_back.append(Path(args.runs_dir))
    try:
        return run_in_vm(_guest_argv(argv), copy_back=copy_back, rw=[VM_CALIBRATION_DIR],
                         label=verb)
    except VmSetupError as exc:
        print(f"{verb} --vm: {exc}", file=sys.stderr)
        return 1
