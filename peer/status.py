"""What a swarm looks like right now, read from what its peers publish (``hivegrpo status``, the host's web page).

Everything comes from the DHT, nothing from any one peer's word about the others: the heartbeats under
``{run}_peers`` (role, adapter version, throughput, last seen), the learners' :class:`~peer.protocol.MetricsRecord`
under ``{run}_metrics`` (groups accepted / dropped / rejected, staleness, reward, bans, and per producer how many of
its groups were used or refused), the learners' credit records under ``{run}_credit`` (per contributor over the
whole run: :mod:`peer.run.credit`), the adapter announcements, and the manifest. :func:`read_status` gathers them;
:func:`summarize` (pure) turns them into one JSON-ready dict; :func:`render` draws it as rich tables.

It imports no torch itself; ``hivegrpo status`` is a small DHT client (``client_mode``, serving nobody) that
starts in about 3.5 s here (hivemind's own import loads torch).
"""

from __future__ import annotations

import time
from typing import Any

from peer.protocol import (
    AdapterRecord,
    CreditRecord,
    LearnerRecord,
    ManifestRecord,
    MetricsRecord,
    access_key,
    adapter_key,
    credit_key,
    key_fingerprint,
    learners_key,
    manifest_key,
    metrics_key,
    owned_records,
)

ROLES = ("coordinator", "learner", "rollout")  # the roles status lists as peers; others (observers) are counted
SPARKS = "▁▂▃▄▅▆▇█"
# a heartbeat comes every HEARTBEAT_INTERVAL (10 s) and lives HEARTBEAT_TTL (30 s): one this old missed two beats,
# so the peer is likely dead or frozen (it disappears when the record expires)
SILENT_AFTER = 25.0
LIVE = ("starting", "running")  # the states status counts as live ("silent" and "leaving" are not)


def _records(swarm, key: str, cls) -> list[tuple[bytes, Any]]:
    return owned_records(swarm.get_dict(key), cls)


def read_status(swarm, coordinator: str | None = None) -> dict[str, Any]:
    """The status of ``swarm``'s run, read now; ``coordinator`` (a key fingerprint) picks its manifest."""
    from peer.network.heartbeat import live_peers

    peers = [(p.owner, p.record) for p in live_peers(swarm, include_leaving=True)]
    return summarize(
        swarm.run_id,
        peers,
        _records(swarm, metrics_key(swarm.run_id), MetricsRecord),
        _records(swarm, adapter_key(swarm.run_id), AdapterRecord),
        _records(swarm, manifest_key(swarm.run_id), ManifestRecord),
        coordinator=coordinator,
        learners=_records(swarm, learners_key(swarm.run_id), LearnerRecord),
        credits=_records(swarm, credit_key(swarm.run_id), CreditRecord),
        access=swarm.get_dict(access_key(swarm.run_id)),
    )


def _admitted(
    run_id: str, coordinator_key: bytes | None, learners, revoked=frozenset(), now: float | None = None
) -> tuple[dict[bytes, str], dict[str, str], dict[str, int]]:
    """Signer -> peer id of the learners whose admission verifies against the run's coordinator, whose credential
    is not in ``revoked`` and admits them (one key per credential: :func:`~peer.network.admission.one_per_credential`);
    refusals by fingerprint; credential id -> live keys, for credentials bound to more than one."""
    from peer.network.admission import CredentialError, check_binding, one_per_credential, verify_certificate

    verified, refused, bindings = {}, {}, []
    for owner, record in learners:
        try:
            if coordinator_key is None:
                raise CredentialError("no manifest to check its credential against")
            certificate = verify_certificate(record.certificate, coordinator_key, run_id)
            if not check_binding(certificate, record.binding, run_id, owner, record.peer_id):
                raise CredentialError("its binding was not signed by its credential's holder")
            if certificate.credential_id in revoked:
                raise CredentialError(f"its learner credential {certificate.credential_id} was revoked by the host")
            verified[owner] = record.peer_id
            bindings.append((owner, certificate.credential_id, record.created))
        except CredentialError as e:
            refused[key_fingerprint(owner)] = f"learner record refused: {e}"
    kept, why, shared = one_per_credential(bindings, now)
    refused.update({key_fingerprint(owner): f"learner record refused: {w}" for owner, w in why.items()})
    return {owner: verified[owner] for owner in kept}, refused, shared


def _manifest(run_id: str, manifests, peers, coordinator: str | None) -> tuple[dict | None, list[str]]:
    """The run's manifest (signed by ``coordinator``, else by the peer heartbeating as coordinator, else the only
    one) as a short dict, and what status could not settle."""
    mine = [(o, m) for o, m in manifests if m.run_id == run_id]
    if coordinator is not None:
        chosen = [(o, m) for o, m in mine if key_fingerprint(o) == coordinator]
    else:
        hosts = {o for o, r in peers if r.role == "coordinator"}
        chosen = [(o, m) for o, m in mine if o in hosts] or mine
    if len(chosen) != 1:
        who = f" signed by {coordinator}" if coordinator else ""
        if not chosen:
            return None, [f"no manifest{who} in the swarm (the coordinator may be down; peers keep running)"]
        prints = ", ".join(sorted(key_fingerprint(o) for o, _ in chosen))
        return None, [f"{len(chosen)} manifests for this run (coordinators {prints}): pass --coordinator"]
    owner, m = chosen[0]
    grpo = m.grpo()
    sampling = grpo.get("sampling", {}) if isinstance(grpo.get("sampling"), dict) else {}
    staleness = grpo.get("staleness", {}) if isinstance(grpo.get("staleness"), dict) else {}
    return {
        "coordinator": key_fingerprint(owner),
        "coordinator_peer_id": m.coordinator,
        "access": m.access,
        "model": m.model.name,
        "quantization": m.model.quantization,
        "task": m.task.name,
        "group_size": sampling.get("group_size"),
        "tau_max": staleness.get("tau_max"),
        "groups_per_version": grpo.get("groups_per_version"),
        "created": m.created,
    }, []


def _admitted_only(
    run_id,
    manifest,
    manifests,
    learners,
    peers,
    metrics,
    adapters,
    refused: dict,
    credits=(),
    access=None,
    shared=None,
    now=None,
):
    """The heartbeats, metrics, announcements and credit records whose claims hold; what was refused goes into
    ``refused``, the credentials bound to several keys into ``shared``. ``access``: the ``{run}_access`` items read
    (the coordinator's revocation list)."""
    from peer.network.admission import read_revoked

    host = next((o for o, _ in manifests if manifest and key_fingerprint(o) == manifest["coordinator"]), None)
    found = read_revoked(access, run_id, host) if access and host is not None else None
    admitted, why, bound = _admitted(run_id, host, learners, found[0] if found else frozenset(), now)
    refused.update(why)
    if shared is not None:
        shared.update(bound)

    def claims(owner: bytes, role: str, peer_id: str, what: str) -> bool:
        ok = owner == host if role == "coordinator" else role != "learner" or admitted.get(owner) == peer_id
        if not ok:
            refused.setdefault(key_fingerprint(owner), f"{what} without being admitted by the coordinator")
        return ok

    peers = [(o, r) for o, r in peers if claims(o, r.role, r.peer_id, f"heartbeats as {r.role}")]
    metrics = [(o, m) for o, m in metrics if claims(o, "learner", m.learner, "publishes learner metrics")]
    adapters = [
        (o, a)
        for o, a in adapters
        if (o == host and a.version == 0) or claims(o, "learner", a.learner, f"announced adapter v{a.version}")
    ]
    credits = [(o, c) for o, c in credits if claims(o, "learner", c.learner, "publishes a credit record")]
    return peers, metrics, adapters, credits


def summarize(
    run_id: str,
    peers: list[tuple[bytes, Any]],
    metrics: list[tuple[bytes, MetricsRecord]],
    adapters: list[tuple[bytes, AdapterRecord]],
    manifests: list[tuple[bytes, ManifestRecord]],
    *,
    coordinator: str | None = None,
    now: float | None = None,
    learners: list[tuple[bytes, Any]] | None = None,
    credits: list[tuple[bytes, CreditRecord]] | None = None,
    access: dict | None = None,
) -> dict[str, Any]:
    """One JSON-ready dict of the swarm's state from its records (``(signing key, record)`` pairs).

    With ``learners`` (the ``{run}_learners`` records) only admitted learners' heartbeats, metrics and
    announcements and credit records count, only the manifest's signer is the coordinator, and every other claim is
    listed under ``refused``; without (unit tests of the other parts) every record counts. ``credits``: the learners'
    credit records, merged by maximum into ``contributors`` (see :mod:`peer.run.credit`). ``access``: the
    ``{run}_access`` items as read, whose coordinator's revocation list refuses revoked learners.
    """
    now = time.time() if now is None else now
    manifest, problems = _manifest(run_id, manifests, peers, coordinator)
    refused: dict[str, str] = {}
    shared: dict[str, int] = {}
    credits = credits or []
    if learners is not None:
        peers, metrics, adapters, credits = _admitted_only(
            run_id, manifest, manifests, learners, peers, metrics, adapters, refused, credits, access, shared, now
        )
    from peer.network.admission import shared_problem

    problems += [shared_problem(c, n) for c, n in sorted(shared.items())]
    group_size = (manifest or {}).get("group_size")
    learned = sorted((m for _, m in metrics), key=lambda m: m.version)
    newest = learned[-1] if learned else None
    banned = sorted({fp for m in learned for fp in m.banned})
    tallies: dict[str, list[int]] = {}
    for m in learned:
        for fp, t in m.per_peer.items():
            got = tallies.setdefault(fp, [0, 0])
            got[0] += t.accepted
            got[1] += t.rejected
    rows = []
    for owner, r in peers:
        if r.role not in ROLES:
            continue
        fp = key_fingerprint(owner)
        accepted, rejected = tallies.get(fp, (0, 0))
        silent = r.state != "leaving" and now - r.last_seen > SILENT_AFTER
        if r.role == "rollout":  # a rollout peer reports completions/s, a learner groups/s
            groups_per_s = r.throughput / group_size if group_size else None
        else:
            groups_per_s = r.throughput if r.role == "learner" else None
        rows.append(
            {
                "peer_id": r.peer_id,
                "fingerprint": fp,
                "name": r.name,
                "role": r.role,
                "state": "silent" if silent else r.state,
                "adapter_version": r.adapter_version,
                "throughput": r.throughput,
                "groups_per_s": groups_per_s,
                "team": _team_role(r),
                # a learner's share of wall time spent training, and of its verified groups without signal
                "busy": r.stats.get("busy") if r.role == "learner" else None,
                "no_signal_share": r.stats.get("no_signal_share") if r.role == "learner" else None,
                # bytes its blob server sent to other peers, and it received from theirs (None: it does not say)
                "served_bytes": _count(r.stats.get("served_bytes")),
                "fetched_bytes": _count(r.stats.get("fetched_bytes")),
                "accepted": accepted,
                "rejected": rejected,
                "banned": fp in banned,
                "last_seen_s": round(max(0.0, now - r.last_seen), 1),
                "uptime_s": round(max(0.0, now - r.started), 1),
                "hardware": r.hardware,
                "reachable": r.reachable,
                "maddrs": list(r.maddrs),
            }
        )
    rows.sort(key=lambda row: (ROLES.index(row["role"]), row["peer_id"]))
    versions = [m.version for m in learned] + [a.version for _, a in adapters]
    history = list(newest.reward_history) if newest is not None else []
    half = len(history) // 2
    trend = sum(history[half:]) / (len(history) - half) - sum(history[:half]) / half if half else None
    rejected_by: dict[str, int] = {}
    for m in learned:
        for reason, n in m.groups_rejected.items():
            rejected_by[reason] = rejected_by.get(reason, 0) + n
    return {
        "run_id": run_id,
        "time": now,
        "adapter_version": max(versions, default=-1),
        "manifest": manifest,
        "problems": problems,
        "peers": rows,
        "roles": {role: sum(1 for row in rows if row["role"] == role and row["state"] in LIVE) for role in ROLES},
        "others": sum(1 for _, r in peers if r.role not in ROLES),
        "learners": [
            {
                "peer_id": m.learner,
                "version": m.version,
                "groups_accepted": m.groups_accepted,
                "groups_dropped_stale": m.groups_dropped_stale,
                "groups_rejected": dict(m.groups_rejected),
                "staleness_mean": m.staleness_mean,
                "staleness_max": m.staleness_max,
                "reward_mean": m.reward_mean,
                "step_seconds": m.step_seconds,
                "age_s": round(max(0.0, now - m.created), 1),
            }
            for m in reversed(learned)
        ],
        "groups_accepted": sum(m.groups_accepted for m in learned),
        "groups_rejected": sum(rejected_by.values()),
        "groups_rejected_by_reason": rejected_by,
        "groups_dropped_stale": sum(m.groups_dropped_stale for m in learned),
        "banned": banned,
        "staleness_mean": None if newest is None else newest.staleness_mean,
        "staleness_max": None if newest is None else newest.staleness_max,
        "reward_mean": None if newest is None else newest.reward_mean,
        "reward_history": history,
        "reward_trend": None if trend is None else round(trend, 4),
        "refused": [{"fingerprint": fp, "why": why} for fp, why in sorted(refused.items())],
        **_leading_learner(rows),
        **_contributors(peers, credits),
    }


def _contributors(peers, credits: list[tuple[bytes, CreditRecord]]) -> dict[str, Any]:
    """The learners' credit records merged by maximum, as rows (names from live heartbeats win: the newest)."""
    from peer.run.credit import contributor_rows, merged

    table = merged([record for _, record in credits])
    names = {key_fingerprint(owner): r.name for owner, r in peers if getattr(r, "name", None)}
    rows = contributor_rows(table, names)
    known = max([len(rows), *(record.contributors_known for _, record in credits)])
    return {"contributors": rows, "contributors_known": known, "groups_used_total": table.groups_used}


def _leading_learner(rows: list[dict]) -> dict[str, float | None]:
    """The busy fraction and no-signal share of the live learner that leads (or the only one)."""
    live = [r for r in rows if r["role"] == "learner" and r["state"] in LIVE and r["busy"] is not None]
    lead = next((r for r in live if r["team"] != "helps"), None)
    return {
        "learner_busy": None if lead is None else lead["busy"],
        "no_signal_share": None if lead is None else lead["no_signal_share"],
    }


def sparkline(values: list[float], low: float = 0.0, high: float = 1.0) -> str:
    """``values`` in [low, high] as block characters, one per value."""
    span = (high - low) or 1.0
    return "".join(SPARKS[min(len(SPARKS) - 1, max(0, int((v - low) / span * len(SPARKS))))] for v in values)


def _team_role(r) -> str | None:
    """A learner's part in its team (peer.roles.learner.team.lead): ``leads`` or ``helps``; None for other roles."""
    if r.role != "learner" or "leading" not in r.stats:
        return None
    return "leads" if r.stats["leading"] else "helps"


def _count(value: float | None) -> int | None:
    """A heartbeat's cumulative count as an int; None (unknown, never 0) when the peer does not report it or reports
    a negative one (a heartbeat's stats are any finite floats)."""
    return None if value is None or value < 0 else int(value)


def human_bytes(n: int | None) -> str:
    """``n`` bytes in decimal units to 3 digits ("12.3 MB", "512 kB"), or "—" when unknown."""
    if n is None:
        return "—"
    if n < 1000:
        return f"{n} B"
    value, units = n / 1000, ["kB", "MB", "GB", "TB"]
    while value >= 999.5 and len(units) > 1:
        value, units = value / 1000, units[1:]
    unit = units[0]
    return f"{value:.1f} {unit}" if value < 99.95 else f"{value:.0f} {unit}"


def _ago(seconds: float) -> str:
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def render(status: dict[str, Any], contributors: bool = False):
    """The status as rich renderables (a header, the peers table, the learners table; ``contributors``: the
    contributors' credit table too)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    m = status["manifest"]
    roles = status["roles"]
    head = Text()
    head.append(f"run {status['run_id']}", style="bold")
    head.append(f" · adapter v{status['adapter_version']}")
    if m:
        head.append(f" · {m['model']} ({m['quantization']}) on {m['task']}, G={m['group_size']}, {m['access']}")
    head.append(
        f"\n{roles['coordinator']} coordinator · {roles['learner']} learner(s) · {roles['rollout']} rollout peer(s)"
        f" · groups accepted {status['groups_accepted']}, rejected {status['groups_rejected']}, "
        f"dropped stale {status['groups_dropped_stale']} · banned {len(status['banned'])}"
    )
    if status["staleness_mean"] is not None:
        head.append(f"\nstaleness mean {status['staleness_mean']:.2f}, max {status['staleness_max']}")
    if status.get("learner_busy") is not None:
        head.append(f" · learner busy {status['learner_busy']:.0%}")
        if status.get("no_signal_share") is not None:
            head.append(f" · groups without signal {status['no_signal_share']:.0%}")
    if status["reward_history"]:
        trend = status["reward_trend"]
        head.append(f" · reward {status['reward_mean']:.3f} {sparkline(status['reward_history'])}")
        if trend is not None:
            head.append(
                f" ({'+' if trend >= 0 else ''}{trend:.3f} over the last {len(status['reward_history'])} versions)"
            )
    for problem in status["problems"]:
        head.append(f"\n! {problem}", style="yellow")

    peers = Table(title="peers", title_justify="left")
    for name in ("peer", "role", "state", "v", "groups/s", "used", "refused", "served", "fetched", "seen"):
        peers.add_column(
            name,
            justify="left" if name in ("peer", "role", "state") else "right",
            no_wrap=name in ("role", "served", "fetched"),  # on a narrow terminal the peer's name gives way
        )
    for p in status["peers"]:
        rate = "-" if p["groups_per_s"] is None else f"{p['groups_per_s']:.2f}"
        state = "banned" if p["banned"] else p["state"]
        produces = p["role"] == "rollout"
        peers.add_row(
            Text(f"{p['name']} …{p['peer_id'][-6:]}" if p.get("name") else "…" + p["peer_id"][-8:]),
            p["role"] + (f" ({p['team']})" if p.get("team") else ""),
            Text(state, style="red" if p["banned"] else ("dim" if state not in LIVE else "")),
            str(p["adapter_version"]),
            rate,
            str(p["accepted"]) if produces else "",
            str(p["rejected"]) if produces else "",
            human_bytes(p.get("served_bytes")),
            human_bytes(p.get("fetched_bytes")),
            _ago(p["last_seen_s"]),
        )
    parts = [head, peers]
    if status["learners"]:
        learners = Table(title="learners", title_justify="left")
        for name in ("learner", "v", "used", "stale", "refused", "tau", "reward", "step s"):
            learners.add_column(name, justify="left" if name == "learner" else "right")
        for q in status["learners"]:
            learners.add_row(
                "…" + q["peer_id"][-8:],
                str(q["version"]),
                str(q["groups_accepted"]),
                str(q["groups_dropped_stale"]),
                str(sum(q["groups_rejected"].values())),
                f"{q['staleness_mean']:.2f}",
                f"{q['reward_mean']:.3f}",
                f"{q['step_seconds']:.2f}",
            )
        parts.append(learners)
    if status["banned"]:
        parts.append(Text("banned signers: " + ", ".join(status["banned"]), style="red"))
    if status.get("refused"):
        lines = [f"{r['fingerprint']}: {r['why']}" for r in status["refused"][:10]]
        more = f"\n  … and {len(status['refused']) - 10} more" if len(status["refused"]) > 10 else ""
        parts.append(
            Text("refused signers (every peer ignores them):\n  " + "\n  ".join(lines) + more, style="yellow")
        )
    if contributors:
        parts.append(contributors_table(status))
    return Group(*parts)


SHOWN_CONTRIBUTORS = 50  # rows of the contributors table on a terminal (--json has them all)


def _date(t: float) -> str:
    """A record's time as a local date, or "-" for one no calendar holds (any finite float is a valid timestamp)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))
    except (OverflowError, ValueError, OSError):
        return "-"


def contributors_table(status: dict[str, Any]):
    """The contributors' credit over the whole run (``status["contributors"]``), most groups used first."""
    from rich.table import Table
    from rich.text import Text

    rows = status.get("contributors", [])
    known = status.get("contributors_known", len(rows))
    title = f"contributors ({known})" if known > len(rows) else "contributors"
    table = Table(title=title, title_justify="left")
    for name in ("name", "fingerprint", "used", "refused", "stale", "no signal", "share", "since"):
        table.add_column(name, justify="left" if name in ("name", "fingerprint", "refused", "since") else "right")
    for c in rows[:SHOWN_CONTRIBUTORS]:
        reasons = ", ".join(f"{r} {n}" for r, n in c["reasons"].items())
        table.add_row(
            Text(c["name"] or "-"),  # a Text: a name is shown as written, never read as rich markup
            c["fingerprint"][:8],
            str(c["used"]),
            f"{c['refused']}" + (f" ({reasons})" if reasons else ""),
            str(c["stale"]),
            str(c["no_signal"]),
            f"{c['share']:.1%}",
            _date(c["since"]),
        )
    if not rows:
        table.add_row(Text("no learner has published a credit record yet", style="dim"), *[""] * 7)
    elif len(rows) > SHOWN_CONTRIBUTORS:
        table.caption = f"… and {len(rows) - SHOWN_CONTRIBUTORS} more (--json lists them all)"
    return table


__all__ = ["ROLES", "contributors_table", "human_bytes", "read_status", "render", "sparkline", "summarize"]
