"""A run's invite book: the invites and learner credentials its coordinator issued, and those it revoked.

The file lives beside the coordinator's identity (``<identity>.<run>.invites.json``, mode 0600: it holds the
tokens). ``hivegrpo invite`` writes it — it needs no network, and works while the host runs or not — and the
running host re-reads it every few seconds and publishes the revoked ids (signed by the issuer key, under the
coordinator's own subkey) to the swarm, where every peer refuses those invites (:mod:`peer.network.access`) and
those learner credentials (:class:`peer.network.admission.Admitted`) from then on.

Learner credentials expire: in ``LEARNER_EXPIRY`` (7 days) unless issued with another ``--expires``, and the
host's own (the learn line's ``default``) is replaced at a start once it has less than ``RENEW_BEFORE`` left.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from peer.errors import UserError
from peer.files import write_private
from peer.network.access import MAX_REVOKED, Invite, InviteError, issue_invite, issuer_key
from peer.network.admission import Credential, issue_credential, parse_credential
from peer.network.swarm import load_signing_key

LEARNER_EXPIRY = 7 * 86400.0  # s a learner credential is valid unless issued otherwise (--expires)
RENEW_BEFORE = 86400.0  # s: the host's default credential is replaced at a start once it expires sooner than this
DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])\Z")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds of ``30m``, ``12h``, ``7d`` (or 0 for ``never``)."""
    text = text.strip().lower()
    if text == "never":
        return 0.0
    match = DURATION.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise InviteError(f"cannot read the duration {text!r}: use e.g. 30m, 12h, 7d, or never")
    return float(match.group(1)) * UNITS[match.group(2)]


def book_path(identity: str | Path, run_id: str) -> Path:
    return Path(f"{identity}.{run_id}.invites.json")


class InviteBook:
    """The invites of run ``run_id`` whose coordinator keeps its identity at ``identity``."""

    def __init__(self, identity: str | Path, run_id: str):
        if not Path(f"{identity}.rsa").exists():
            raise UserError(
                f"no coordinator identity at {identity} (its signing key {identity}.rsa is missing): pass the "
                "--identity the host runs with (a private host needs one)"
            )
        self.run_id = run_id
        self.path = book_path(identity, run_id)
        self.signing_key = load_signing_key(str(identity))
        self.issuer = issuer_key(self.signing_key)
        self.data = self._load()

    def _load(self) -> dict:
        if not self.path.exists():
            return {"issued": [], "revoked": []}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data.get("issued"), list) or not isinstance(data.get("revoked"), list):
                raise ValueError("missing 'issued' or 'revoked'")
        except (OSError, ValueError, AttributeError) as e:
            raise UserError(f"the invite book {self.path} is unreadable ({e}); move it away to start a new one") from e
        return data

    def _save(self) -> None:
        write_private(self.path, json.dumps(self.data, indent=1))

    def issue(self, name: str = "", expires_in: float = 0.0) -> Invite:
        """A new invite (``expires_in`` seconds from now; 0: never), recorded in the book."""
        expires = time.time() + expires_in if expires_in else 0.0
        invite = issue_invite(self.issuer, self.run_id, name, expires)
        self.data["issued"].append(
            {"id": invite.invite_id, "name": name, "expires": expires, "created": time.time(), "token": invite.token}
        )
        self._save()
        return invite

    def issue_learner(self, name: str = "", expires_in: float = LEARNER_EXPIRY) -> Credential:
        """A new learner credential (:mod:`peer.network.admission`), recorded in the book with role ``learner``
        (``expires_in`` seconds from now; 0: never)."""
        expires = time.time() + expires_in if expires_in else 0.0
        credential = issue_credential(self.signing_key, self.run_id, name, expires)
        self.data["issued"].append(
            {
                "id": credential.certificate.credential_id,
                "role": "learner",
                "name": name,
                "expires": expires,
                "created": time.time(),
                "token": credential.token,
            }
        )
        self._save()
        return credential

    def default_learner(self, name: str = "default") -> Credential:
        """A learner credential the host prints in a learn line (``default``, then ``learner-2``… with
        ``--learners N``): the book's one of that name while valid for ``RENEW_BEFORE`` more (one that never
        expires, from before credentials expired by default, is replaced)."""
        soon = time.time() + RENEW_BEFORE
        for e in reversed(self.entries()):
            if e["role"] == "learner" and e["name"] == name and e["state"] == "valid" and e["expires"] > soon:
                return parse_credential(e["token"])
        return self.issue_learner(name)

    def revoke(self, invite_id: str) -> dict:
        """Revoke an issued invite or learner credential by id; the entry revoked."""
        entry = next((e for e in self.data["issued"] if e["id"] == invite_id), None)
        if entry is None:
            known = ", ".join(e["id"] for e in self.data["issued"][-5:]) or "none"
            raise UserError(f"no invite {invite_id!r} in {self.path} (recent: {known}); see `hivegrpo invite --list`")
        if invite_id not in self.data["revoked"]:
            if len(self.data["revoked"]) >= MAX_REVOKED:
                raise UserError(f"{MAX_REVOKED} invites are revoked already: start a new run for more")
            self.data["revoked"].append(invite_id)
            self._save()
        return entry

    def revoked(self) -> list[str]:
        return list(self.data["revoked"])

    def entries(self) -> list[dict]:
        """Every issued invite with ``state``: valid, expired or revoked."""
        now = time.time()
        out = []
        for e in self.data["issued"]:
            state = "revoked" if e["id"] in self.data["revoked"] else "valid"
            if state == "valid" and e["expires"] and e["expires"] <= now:
                state = "expired"
            out.append({**e, "role": e.get("role", "member"), "state": state})
        return out

    def default_invite(self) -> Invite:
        """The invite the host prints in its join lines: the book's ``default`` one while valid, else a new one."""
        for e in reversed(self.entries()):
            if e["role"] == "member" and e["name"] == "default" and e["state"] == "valid":
                from peer.network.access import parse_invite

                return parse_invite(e["token"])
        return self.issue("default")


__all__ = ["LEARNER_EXPIRY", "InviteBook", "book_path", "parse_duration"]
