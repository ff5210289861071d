"""CPU seconds by process of a command and everything it starts, sampled from /proc every second.

Each process is labelled by what it is: a hivegrpo role by its sub-command (``join`` → rollout, ``learn``, ``host``,
``demo``) or, forked by the demo, by its name (``hivegrpo-join``), a helper process by the name the peer gives it
(``hivegrpo-dht``, ``hivegrpo-publis``) under its parent's label, ``p2pd`` under the label of the peer whose DHT
process started it (``rollout 1 p2pd``), or as itself. A process's CPU is its last sample (user + system), so a
process that ends between two samples loses at most its last second::

    python -m tests.benchmarks.cpu --out cpu.json -- hivegrpo demo --json --report-dir /tmp/demo
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter

import psutil

ROLES = {"join": "rollout", "learn": "learner", "host": "host", "demo": "demo", "eval": "eval"}
PRESTART = "peer.demo.prestart"


def label(process: psutil.Process, labels: dict[int, str]) -> str:
    """What ``process`` is (see the module docstring); ``labels`` holds its parent's, if seen."""
    try:
        name, cmdline, parent = process.name(), process.cmdline(), process.ppid()
    except psutil.Error:
        return "?"
    if name.startswith("hivegrpo-"):  # a role forked from the demo (hivegrpo-join), or a peer's helper process
        return role_of([], name) or f"{labels.get(parent, '?')} {name.removeprefix('hivegrpo-')}"
    if name == "p2pd" or any(part.endswith("p2pd") for part in cmdline[:1]):
        owner = labels.get(parent, "")  # a DHT process starts its node's daemon: name it after that peer
        return f"{owner.removesuffix(' dht')} p2pd" if owner.endswith(" dht") else "p2pd"
    if parent in labels:  # forked and not (yet) named: its parent's command line, not a role of its own
        try:
            if psutil.Process(parent).cmdline() == cmdline:
                return f"{labels[parent]} child"
        except psutil.Error:
            pass
    return role_of(cmdline) or name


def role_of(cmdline: list[str], name: str = "") -> str | None:
    """The hivegrpo role a command line runs (``rollout`` for ``hivegrpo join ...``), or that a process ``name``
    says (``hivegrpo-join``: forked by the demo, with the demo's command line), or None."""
    if name.startswith("hivegrpo-") and name.removeprefix("hivegrpo-") in ROLES:
        return ROLES[name.removeprefix("hivegrpo-")]
    start = 1
    if PRESTART in cmdline:  # python -m peer.demo.prestart INFO TIMEOUT MODULE COMMAND ...: the demo's early child
        start = cmdline.index(PRESTART) + 4
    for part in cmdline[start : start + 3]:
        if part in ROLES:
            return ROLES[part]
    return None


class CpuSampler:
    """Samples the CPU seconds of ``root`` and its descendants; :meth:`by_label` sums them per label (instances of
    the same role are numbered in the order they were first seen: ``rollout 1``, ``rollout 2``)."""

    def __init__(self, root: int):
        self.root = psutil.Process(root)
        self.labels: dict[int, str] = {}
        self.seconds: dict[int, float] = {}
        self._seen: Counter = Counter()

    def sample(self) -> None:
        try:
            processes = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return
        for p in processes:  # parents before children: a helper's label names its parent's
            base = label(p, self.labels)
            if base == "?":  # ending between the listing and the look (its name is gone): keep what it was
                base = self.labels.get(p.pid, base)
            if base in ("rollout", "learner"):  # numbered once, in the order first seen
                known = self.labels.get(p.pid, "")
                if not known.startswith(base):
                    self._seen[base] += 1
                    known = f"{base} {self._seen[base]}"
                base = known
            self.labels[p.pid] = base  # again each time: a helper names itself only once it has started
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            self.seconds[p.pid] = t.user + t.system

    def by_label(self) -> dict[str, float]:
        out: Counter = Counter()
        for pid, seconds in self.seconds.items():
            out[self.labels[pid]] += seconds
        return {k: round(v, 1) for k, v in sorted(out.items())}


def groups(by_label: dict[str, float]) -> dict[str, float]:
    """The table's totals: the peers' own processes, their helpers (DHT, publisher), p2pd, and all."""
    total = sum(by_label.values())
    dht = sum(v for k, v in by_label.items() if k.endswith(" dht"))
    p2pd = sum(v for k, v in by_label.items() if k == "p2pd" or k.endswith(" p2pd"))
    return {
        "all": round(total, 1),
        "dht": round(dht, 1),
        "p2pd": round(p2pd, 1),
        "publisher": round(sum(v for k, v in by_label.items() if k.endswith(" publis")), 1),
        "dht_and_p2pd_share": round((dht + p2pd) / total, 3) if total else 0.0,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--out", default=None, help="write the result here (JSON)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    started = time.monotonic()
    child = subprocess.Popen(command)
    sampler = CpuSampler(child.pid)
    try:
        while child.poll() is None:
            sampler.sample()
            time.sleep(args.every)
    finally:
        if child.poll() is None:
            child.terminate()
            child.wait(timeout=60)
    wall = time.monotonic() - started
    by_label = sampler.by_label()
    result = {
        "command": command,
        "exit_code": child.returncode,
        "wall_seconds": round(wall, 1),
        "cpu_seconds": by_label,
        "totals": groups(by_label),
    }
    for name, seconds in by_label.items():
        print(f"{name:24s} {seconds:8.1f}", file=sys.stderr)
    print(json.dumps(result["totals"]), file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    sys.exit(child.returncode)


if __name__ == "__main__":
    main()
