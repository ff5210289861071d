"""Checks of the command line's option values, made before a command loads a model or touches the network.

Most are click callbacks (``callback=...``); the few that compare two options are functions a command calls first
thing. A bad value becomes click's one line, ``Error: Invalid value for '--option': ...``, saying what to pass
instead, and exit status 2. What can only go wrong later (a swarm that does not answer, a GPU out of memory) is a
:class:`peer.errors.UserError`: one ``Error: ...`` line and exit status 1 (docs/architecture.md, "Command-line
errors"). hivemind and torch are imported only when a value needs them, so ``--help`` stays instant.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import click

PEER_EXAMPLE = "/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..."
LISTEN_EXAMPLE = "/ip4/0.0.0.0/tcp/31337"
ANNOUNCE_EXAMPLE = "/ip4/203.0.113.7/tcp/31337"


def run_id(ctx, param, value: str | None) -> str | None:
    """``--run-id``: the protocol's rule for run ids (:func:`peer.protocol.keys.check_run_id`)."""
    from peer.protocol.keys import check_run_id

    if value is not None:
        try:
            check_run_id(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return value


def coordinator(ctx, param, value: str | None) -> str | None:
    """``--coordinator``: a key fingerprint as ``hivegrpo host`` prints it (:func:`peer.protocol.key_fingerprint`)."""
    from peer.protocol.keys import FINGERPRINT_CHARS

    if value is None:
        return None
    if re.fullmatch(f"[0-9a-f]{{{FINGERPRINT_CHARS}}}", value.strip().lower()) is None:
        raise click.BadParameter(
            f"{value!r} is not a key fingerprint: pass the {FINGERPRINT_CHARS} hex digits `hivegrpo host` printed "
            "after --coordinator, e.g. 3f2a9c0d1b7e4a56"
        )
    return value.strip().lower()


def _multiaddr(value: str, example: str):
    from hivemind.utils.multiaddr import Multiaddr

    try:
        address = Multiaddr(value)
    except ValueError as e:  # hivemind's multiaddr errors are ValueErrors
        reason = re.sub(r"^Invalid MultiAddr '[^']*'[\s:]*", "", str(e))
        raise click.BadParameter(f"{value!r} is not a multiaddr ({reason}); pass one like {example}") from None
    if not address.protocols():
        raise click.BadParameter(f"{value!r} is not a multiaddr (it names no protocol); pass one like {example}")
    return address


def initial_peers(ctx, param, values: tuple[str, ...]) -> tuple[str, ...]:
    """``--initial-peers``: whole multiaddrs with the peer's id, as a running peer prints them (several may come
    in one value, space-separated, as pasted from the host's join line)."""
    for value in values:
        for m in value.split():
            if "p2p" not in [p.name for p in _multiaddr(m, PEER_EXAMPLE).protocols()]:
                raise click.BadParameter(
                    f"{m!r} names no peer (it has no /p2p/PEER_ID part); pass a whole multiaddr the host printed, "
                    f"like {PEER_EXAMPLE}"
                )
    return values


def host_maddrs(ctx, param, values: tuple[str, ...]) -> tuple[str, ...]:
    """``--host-maddrs``: multiaddrs to listen on."""
    for value in values:
        _multiaddr(value, LISTEN_EXAMPLE)
    return values


def announce_maddrs(ctx, param, values: tuple[str, ...]) -> tuple[str, ...]:
    """``--announce-maddrs``: multiaddrs others can reach, with an explicit port (hivemind refuses port 0)."""
    for value in values:
        address = _multiaddr(value, ANNOUNCE_EXAMPLE)
        protocols = [p.name for p in address.protocols()]
        if any(name in protocols and address.value_for_protocol(name) == "0" for name in ("tcp", "udp")):
            raise click.BadParameter(
                f"{value!r} has port 0, which others cannot dial; pass the port forwarded to this machine, like "
                f"{ANNOUNCE_EXAMPLE}"
            )
    return values


def _writable(value: str, folder: bool) -> None:
    """Refuse an output path that could not be written: the nearest existing folder on its way must be a folder
    this user may write to (what is missing below it is made when the command writes)."""
    path = Path(value).expanduser()
    start = path if folder else path.parent
    existing = next((p for p in (start, *start.parents) if p.exists()), None)
    if existing is None:
        raise click.BadParameter(f"cannot write {value}: none of the folders on its way exists; pick another path")
    if not existing.is_dir():
        raise click.BadParameter(f"cannot write {value}: {existing} is a file, not a folder; pick another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise click.BadParameter(f"cannot write {value}: the folder {existing} is not writable; pick another path")


def output_file(ctx, param, value: str | None) -> str | None:
    """An option naming a file this command writes (``--ledger``, ``--report``, ...)."""
    if value is not None:
        _writable(value, folder=False)
    return value


def output_folder(ctx, param, value: str | None) -> str | None:
    """An option naming a folder this command writes into (``--cache-dir``, ``--out``, ...)."""
    if value is not None:
        _writable(value, folder=True)
    return value


def identity(ctx, param, value: str | None) -> str | None:
    """``--identity``: a path where the identity can be made, or files that hold one
    (:func:`peer.network.swarm.check_identity_files`)."""
    if value is None:
        return None
    _writable(value, folder=False)
    from peer.network.swarm import IdentityFileError, check_identity_files

    try:
        check_identity_files(value)
    except IdentityFileError as e:
        raise click.BadParameter(str(e)) from None
    return value


def host_identity(ctx, param, value: str) -> str:
    """``invite --identity``: the identity of a host that ran already (its signing key is there)."""
    if not Path(f"{value}.rsa").is_file():
        raise click.BadParameter(
            f"no host identity at {value} (its signing key {value}.rsa is missing): pass the --identity file that "
            "`hivegrpo host` runs with"
        )
    return identity(ctx, param, value)


def invite(ctx, param, value: str | None) -> str | None:
    """``--invite``: a token that parses and whose signature verifies (:func:`peer.network.access.parse_invite`)."""
    from peer.network.access import InviteError, parse_invite

    if value is not None:
        try:
            parse_invite(value.strip())
        except InviteError as e:
            raise click.BadParameter(str(e)) from None
    return None if value is None else value.strip()


def learner_credential(ctx, param, value: str | None) -> str:
    """``--learner-credential``: required, well formed and not expired (:func:`peer.network.admission
    .parse_credential`); whether the run's coordinator signed it shows once the manifest is read."""
    from peer.network.admission import CredentialError, parse_credential

    if not value:
        raise click.MissingParameter(
            "Only learners the run's host admitted may write its adapter versions: copy the learn line "
            "`hivegrpo host` printed (it carries one), or ask the host for one",
            ctx=ctx,
            param=param,
        )
    try:
        credential = parse_credential(value.strip())
    except CredentialError as e:
        raise click.BadParameter(str(e)) from None
    if credential.certificate.expired():
        raise click.BadParameter(
            f"learner credential {credential.certificate.credential_id} has expired; ask the host for a new one "
            "(`hivegrpo invite --role learner`)"
        )
    return value.strip()


def same_run(run: str, invite_token: str | None, credential_token: str | None = None) -> None:
    """An ``--invite`` or ``--learner-credential`` issued for another run than ``--run-id`` (or expired) is refused
    before anything starts; both were checked by their callbacks already."""
    from peer.network.access import Access, InviteError, parse_invite
    from peer.network.admission import parse_credential

    if invite_token:
        try:
            Access(parse_invite(invite_token), run)
        except InviteError as e:
            raise click.BadParameter(str(e), param_hint="'--invite'") from None
    if credential_token:
        issued_for = parse_credential(credential_token).certificate.run_id
        if issued_for != run:
            raise click.BadParameter(
                f"this credential is for run {issued_for!r}, not {run!r}: check --run-id, or use the credential in "
                "the learn line of that run's host",
                param_hint="'--learner-credential'",
            )


def allowed_tasks(ctx, param, modules: tuple[str, ...]) -> tuple[str, ...]:
    """``--allow-task``: module names alone, the ``module`` of a plug-in task's ``module:attribute``."""
    for module in modules:
        if not module or ":" in module or module.strip() != module:
            raise click.BadParameter(
                f"give the module only, e.g. 'mypkg.tasks' for the task 'mypkg.tasks:MyTask', got {module!r}"
            )
    return tuple(modules)


def model(ctx, param, value: str | None) -> str | None:
    """``--model``: ``bundled``, a model directory or a hub id (:func:`peer.model.config.check_model_name`)."""
    from peer.model.config import check_model_name

    if value is not None:
        try:
            check_model_name(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return value


def hub_repo(ctx, param, value: str | None) -> str | None:
    """``--push-to-hub``: a hub repository id with its namespace (:data:`peer.model.config.HUB_ID`)."""
    from peer.model.config import HUB_ID

    if value is not None and ("/" not in value or HUB_ID.fullmatch(value) is None):
        raise click.BadParameter(f"must be a hub repository id like 'alice/my-adapter', got {value!r}")
    return value


def device(ctx, param, value: str) -> str:
    """``--device``: a name this project runs on, and a GPU torch sees when it names one."""
    from peer.model.config import check_device, check_device_present

    try:
        check_device_present(check_device(value))
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    return value


def task_config(ctx, param, value: str | None) -> dict:
    """``--task-config``: a JSON object (what it may hold is the task's to say: :func:`task`)."""
    import json

    if not value:
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not valid JSON ({e.msg}); pass e.g. '{{\"digits\": 3}}'") from None
    if not isinstance(parsed, dict):
        raise click.BadParameter("must be a JSON object, e.g. '{\"digits\": 3}'")
    return parsed


def task(name: str, config: dict):
    """``--task`` with ``--task-config``: the task resolves (no model needed) and takes that config; returns it."""
    from peer.tasks import TaskError, get_task

    try:
        get_task(name)
    except TaskError as e:
        raise click.BadParameter(str(e), param_hint="'--task'") from None
    try:
        return get_task(name, config)
    except TaskError as e:
        raise click.BadParameter(str(e), param_hint="'--task-config'") from None


def peer_name(ctx, param, value: str | None) -> str | None:
    """``--name``: 1-32 printable characters (the protocol's :class:`peer.protocol.PeerName`)."""
    from peer.protocol.records import peer_name_problem

    if value is not None and (problem := peer_name_problem(value)) is not None:
        raise click.BadParameter(f"{problem}; pick another, e.g. --name alice-laptop")
    return value


def max_upload(ctx, param, value: float | None) -> float | None:
    """``--max-upload MB/s`` → bytes/s (None: no limit); at least what one fetch needs to stay within its deadline."""
    if value is None:
        return None
    from peer.network.blobs.server import MIN_UPLOAD

    if not (value * 1e6 >= MIN_UPLOAD and value < float("inf")):
        raise click.BadParameter(
            f"{value:g} MB/s is not a rate from {MIN_UPLOAD / 1e6:.2f} MB/s up, the least a peer needs to serve one "
            "blob within the time fetchers allow; give a larger value, or leave it out for no limit"
        )
    return value * 1e6


def listen(host: str, port: int | None, option: str) -> None:
    """``host`` can be listened on at ``port`` (None: nothing to serve; 0: any free port), checked by binding it
    once now rather than after the model loaded."""
    if port is None:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:
        raise click.BadParameter(
            f"cannot listen on {host}:{port} ({e.strerror or e}); pick another port (0: any free one) or address",
            param_hint=f"'{option}'",
        ) from None
