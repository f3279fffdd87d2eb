"""Write tests/durations.json (seconds per test file) from a pytest junit report, for the
longest-first file scheduling of the default run (tests/conftest.py).

    pytest -n 2 --dist loadfile --junitxml=report.xml
    python -m tests.durations report.xml

Run it after adding or changing a slow file: the order only needs rough numbers.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "durations.json"


def file_of(classname: str) -> str | None:
    """tests.backends.test_vllm(.TestClass) -> tests/backends/test_vllm.py (None if gone)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (ROOT / path).is_file():
            return path
    return None


def per_file(report: Path) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        path = file_of(case.get("classname", ""))
        if path is not None:
            seconds[path] += float(case.get("time", 0.0))
    return {path: round(s, 1) for path, s in sorted(seconds.items(), key=lambda kv: -kv[1])}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    table = per_file(Path(argv[0]))
    OUT.write_text(json.dumps(table, indent=0) + "\n")
    print(f"{len(table)} files, {sum(table.values()):.0f} s in all -> {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
