"""What an offline wheelhouse for a GPU box holds: the closure of the kit's roots, stopping at the image.

  python wheelhouse_plan.py REPORT --python 3.12 --roots "papermill ..." --nodeps "librosa" --image "torch numpy ..."

REPORT is pip's ``--report`` of a dry-run resolve, for the box's Python and platform, of the roots together
with the image's packages (so the versions chosen agree with them). Prints ``name==version``, one a line,
for every package reachable from --roots through the requirements in REPORT, never entering a package of
--image (the box has those and whatever they need); --nodeps packages are listed but not entered (they are
installed with ``--no-deps``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.markers import default_environment
    from pip._vendor.packaging.requirements import Requirement


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("report")
    ap.add_argument("--python", required=True, help="the box's X.Y")
    ap.add_argument("--roots", required=True)
    ap.add_argument("--nodeps", default="")
    ap.add_argument("--image", default="")
    a = ap.parse_args()

    env = {**default_environment(), "python_version": a.python, "python_full_version": a.python + ".0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    pkgs = {norm(i["metadata"]["name"]): i["metadata"] for i in json.load(open(a.report))["install"]}
    image, nodeps = {norm(n) for n in a.image.split()}, {norm(n) for n in a.nodeps.split()}

    # (package, extra): a requirement such as bleach[css] also brings what bleach requires for "css".
    seen, visited, todo = set(), set(), [(norm(n), "") for n in a.roots.split() + a.nodeps.split()]
    while todo:
        n, extra = todo.pop()
        if (n, extra) in visited or n in image:
            continue
        if n not in pkgs:
            print(f"wheelhouse_plan: {n} is not in the resolve", file=sys.stderr)
            return 1
        visited.add((n, extra))
        seen.add(n)
        if n in nodeps:
            continue
        for spec in pkgs[n].get("requires_dist") or []:
            r = Requirement(spec)
            if r.marker is None or r.marker.evaluate({**env, "extra": extra}):
                todo += [(norm(r.name), "")] + [(norm(r.name), norm(e)) for e in r.extras]
    for n in sorted(seen):
        print(f"{pkgs[n]['name']}=={pkgs[n]['version']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
