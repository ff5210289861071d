"""DHT requests by kind: what each peer's DHT process sends while a command runs (``peer.network.request_counts``).

    python -m tests.benchmarks.requests --out requests.json -- hivegrpo demo --json --no-target --duration 60

The command runs with ``HIVEGRPO_COUNT_REQUESTS`` set to a temporary folder, so every DHT process it starts counts
its outgoing requests (``out:call_store<_store_file:holders_N``: stores caused by a holder record's store) and the
side-channel calls that caused them (``call:...``). Each process is labelled by its peer's role, numbered in the
order of their process ids (``rollout 1``, ``rollout 2``). Every request one node sends, another serves, so the
``out:`` counts of all of them are the swarm's DHT traffic. Counts cover up to the last second before each process
ended. docs/demo.md, "Start-up beside the host, and fewer DHT requests", has what they showed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from peer.network.request_counts import ENV
from tests.benchmarks.cpu import role_of


def merge(folder: Path) -> dict[str, dict[str, int]]:
    """The counts of every DHT process that wrote to ``folder``, by its peer's label."""
    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        found.append(
            (int(data["pid"]), role_of(data.get("parent", []), data.get("parent_name", "")) or "?", data["counts"])
        )
    seen: Counter = Counter()
    out = {}
    for _, role, counts in sorted(found):
        seen[role] += 1
        label = role if role in ("host", "demo", "?") and seen[role] == 1 else f"{role} {seen[role]}"
        out[label] = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return out


def outgoing(counts: dict[str, int]) -> int:
    return sum(n for kind, n in counts.items() if kind.startswith("out:"))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the counts here (JSON)")
    parser.add_argument("--top", type=int, default=12, help="kinds shown per process")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    with tempfile.TemporaryDirectory(prefix="hivegrpo-requests-") as tmp:
        code = subprocess.call(command, env={**os.environ, ENV: tmp})
        by_label = merge(Path(tmp))
    for label, counts in by_label.items():
        print(f"{label}: {outgoing(counts)} requests sent", file=sys.stderr)
        for kind, n in list(counts.items())[: args.top]:
            print(f"  {n:7d}  {kind}", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": command, "exit_code": code, "counts": by_label}, f, indent=1)
    sys.exit(code)


if __name__ == "__main__":
    main()
