"""`testbed down NAME | --all`: remove a lab, or every lab and leftover namespace."""

from __future__ import annotations

import sys

from testbed.cli.common import EXIT_OK, EXIT_USAGE, CliError, lab_name_arg, require_root


def add_parser(sub):
    p = sub.add_parser("down", help="tear down a lab (or --all labs and leftovers); needs root")
    p.add_argument("name", nargs="?", help="lab name (the config's `name:`)")
    p.add_argument("--all", action="store_true",
                   help="every recorded lab, then any namespace with the tb- prefix")
    return p


def run(args) -> int:
    from testbed.net import destroy_all, destroy_lab, list_states

    if bool(args.name) == bool(args.all):
        print("down: give a lab name or --all", file=sys.stderr)
        return EXIT_USAGE
    if args.name:
        try:
            lab_name_arg(args.name)
        except CliError as exc:
            print(f"down: {exc}", file=sys.stderr)
            return exc.code
    try:
        require_root("down")
    except CliError as exc:
        print(exc, file=sys.stderr)
        return exc.code
    from testbed.vm.runner import stop_all, stop_lab

    if args.all:
        vms = stop_all()
        if vms:
            print(f"down: stopped {len(vms)} VM(s): {', '.join(vms)}")
        labs, orphans = destroy_all()
        print(f"down: removed {len(labs)} lab(s){': ' + ', '.join(labs) if labs else ''}; "
              f"{len(orphans)} leftover namespace(s)"
              f"{': ' + ', '.join(orphans) if orphans else ''}")
        return EXIT_OK
    if stop_lab(args.name):
        print(f"down: lab {args.name!r} was up inside a VM; the VM is down")
        return EXIT_OK
    known = [s.lab for s in list_states()]
    if args.name not in known:
        print(f"down: no lab {args.name!r} is recorded (recorded: {', '.join(known) or 'none'});"
              " `testbed down --all` also clears leftovers", file=sys.stderr)
        return 1
    removed = destroy_lab(args.name)
    print(f"down: lab {args.name!r} removed ({len(removed)} namespaces)")
    return EXIT_OK
