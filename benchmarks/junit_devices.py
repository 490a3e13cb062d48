"""Per-device test counts of a pytest run, and whether two runs agree, from their JUnit XML files.

    python benchmarks/junit_devices.py gpu1.xml [gpu2.xml]

Reads the ``mla_device`` property the mla-verify plugin puts on each device test. With two files, lists every
test whose outcome differs between them and exits 1 if any does (e.g. a 1-GPU and a 2-GPU run of
``pytest -m gpu``, which must agree).
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter


def outcomes(path: str) -> dict[str, tuple[str, str | None]]:
    """test id -> (outcome, device or None) for every test case in a JUnit XML file."""
    result = {}
    for case in ET.parse(path).iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        device = next((p.get("value") for p in case.iter("property") if p.get("name") == "mla_device"), None)
        result[f"{case.get('classname')}::{case.get('name')}"] = (kinds[0] if kinds else "passed", device)
    return result


def main(paths: list[str]) -> int:
    runs = [outcomes(path) for path in paths]
    for path, run in zip(paths, runs):
        per_device = Counter((device, outcome) for outcome, device in run.values() if device is not None)
        print(f"{path}: {len(run)} tests")
        for (device, outcome), n in sorted(per_device.items()):
            print(f"  {device}: {n} {outcome}")
    if len(runs) == 2:
        first, second = ({k: v[0] for k, v in run.items()} for run in runs)
        differ = sorted(k for k in first.keys() | second.keys() if first.get(k) != second.get(k))
        for test in differ:
            print(f"DIFFERS {test}: {first.get(test, 'absent')} vs {second.get(test, 'absent')}")
        print(f"{len(differ)} of {len(first.keys() | second.keys())} tests differ in outcome")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
