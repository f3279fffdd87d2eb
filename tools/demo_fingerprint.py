"""The demo's SFT half in 200 steps: numbers that change whenever the demo's numbers would.

    python tools/demo_fingerprint.py            # measure and compare with the record
    python tools/demo_fingerprint.py --record   # measure and (re)write this CPU's record

`nox -s demo` takes minutes and its held-out accuracy is the README's headline number, so a
change anywhere on its path (data, tokenisation, packing, the loss, the optimizer, the kernels a
new torch picks) must not go unnoticed: packed micro-batches changed the SFT path's float
summation order in November 2026 and the README's numbers were stale for a week. This runs
`roll sft recipes/tiny-arith-sft.yaml` for 200 steps (1 thread, eval on 100 held-out rows at the
end) through the real CLI and reads its final train and eval loss. Runs are bit-exact for one
install on one CPU type, so the record (tests/assets/demo_fingerprint.json) holds the exact
numbers per CPU type (`cpu|cpu_capability`, as every run's meta.json records them) together with
the README's demo numbers measured on that CPU type at the same time; tests/tools/
test_demo_fingerprint.py fails when they differ. Then: re-run `nox -s demo` on that CPU, update
the README's table, and record the new numbers here (`--record --sft PCT --rlvr PCT`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "assets" / "demo_fingerprint.json"
STEPS = 200
OVERRIDES = [
    f"trainer.max_steps={STEPS}",
    f"eval.every_steps={STEPS}",
    "eval.max_samples=100",
    "eval.batch_size=100",
    f"checkpoint.every_steps={STEPS}",
    "tracking.backends=[jsonl]",
]


def measure(roll: str = "roll", env: dict[str, str] | None = None) -> dict[str, object]:
    """Run the shortened demo SFT with the `roll` console script; its numbers and CPU key."""
    with tempfile.TemporaryDirectory(prefix="roll-demo-fp-") as tmp:
        runs = Path(tmp) / "runs"
        cmd = [roll, "sft", str(ROOT / "recipes/tiny-arith-sft.yaml"), "--run-id", "fp"]
        env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            [*cmd, *OVERRIDES, f"runs_dir={runs}"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        run_dir = runs / "fp"
        if done.returncode != 0:
            raise RuntimeError(
                f"roll sft failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
            )
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        versions = json.loads((run_dir / "meta.json").read_text())["versions"]
    last = {k: v for row in rows for k, v in row.items()}  # the latest value of every key
    return {
        "cpu": f"{versions['cpu']}|{versions.get('cpu_capability', '?')}",
        "train_loss": last["train/loss"],
        "eval_loss": last["eval/loss"],
        "eval_exact_match": last["eval/exact_match"],
        "torch": versions["torch"],
    }


def load_record() -> dict[str, dict[str, object]]:
    return json.loads(RECORD.read_text()) if RECORD.exists() else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help="write this CPU's record")
    parser.add_argument("--sft", type=float, help="the demo's SFT exact match (%%) on this CPU")
    parser.add_argument("--rlvr", type=float, help="the demo's RLVR exact match (%%) on this CPU")
    args = parser.parse_args()
    got = measure(str(Path(sys.executable).parent / "roll"))
    key = str(got.pop("cpu"))
    record = load_record()
    print(json.dumps({key: got}, indent=2))
    if not args.record:
        want = record.get(key)
        if want is None:
            print(f"no record for {key!r} (recorded: {sorted(record)})")
            return 1
        same = all(want[k] == got[k] for k in ("train_loss", "eval_loss", "eval_exact_match"))
        print("same as the record" if same else f"differs from the record: {want}")
        return 0 if same else 1
    if args.sft is None or args.rlvr is None:
        parser.error(
            "--record needs --sft and --rlvr: the demo's numbers on this CPU, measured now"
        )
    record[key] = {**got, "demo_sft_exact_match": args.sft, "demo_rlvr_exact_match": args.rlvr}
    RECORD.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    print(f"recorded {key!r} in {RECORD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
