"""The schemas of the team protocol's messages (``hivegrpo.team.v2``, :mod:`peer.roles.learner.team.lead`), strict and
bounded.

Every request a leader receives and every answer a helper receives is checked here before anything else reads it:
types are strict (pydantic v1's ``Strict*``: nothing is converted, so a checked message is used as it came), unknown
fields are refused, and every list, map, string and bytes field has a bound. A message that does not fit is a
:class:`~peer.network.blobs.wire.ProtocolError` that says which field and why, never an exception deep in the
learner. The bounds are generous for an honest team; they are not what keeps memory small — the byte limits of
:mod:`peer.network.rpc` are — but what keeps a malformed or hostile message out of the learner's state.

Requests (:func:`parse_request`): ``probe``, ``work``, ``result``. Answers: to a probe (:func:`parse_probe_answer`),
to a work request (:func:`parse_work_answer`: exactly one of ``steps``, ``state``, ``task``, ``idle``,
``leader``, ``refused``, with ``members``), to a result (:func:`parse_result_answer`).
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic.v1 as pydantic

from peer.network.access import MAX_INVITE_CHARS
from peer.network.blobs.wire import ProtocolError
from peer.protocol.limits import MAX_GROUP_BYTES, MAX_INT, MAX_OWNER_KEY_BYTES, MAX_PEER_ID_CHARS

KEEP_STEPS = 32  # updates a leader keeps to bring a helper that fell behind up to date: a steps answer's bound
MAX_ANSWER = 64 << 20  # bytes: a state (adapter + AdamW state + the intake's seqs) of a large adapter
MAX_MEMBERS = 64  # learners one answer lists as the team
MAX_TASK_GROUPS = 4096  # groups in one share (a run's groups_per_version is at most 4096)
MAX_PARAMETERS = 4096  # LoRA tensors whose AdamW state a state carries
MAX_SIGNERS = 1 << 16  # signers in the intake's used seqs or bans, in one message
MAX_USED_PER_SIGNER = 1 << 20  # (seq, version) pairs of one signer
MAX_REASON_CHARS = 1024  # a ban's reason, a refusal's sentence
MAX_RECORD_ITEMS = 1 << 18  # values in one step's ledger record (its group ids, the leader's bans)
MAX_RECORD_DEPTH = 4
MAX_RECORD_CHARS = 4096  # one string in a ledger record

MAX_TAU = 1024  # a run's tau_max is at most this (peer.grpo.StalenessConfig)


def answer_containers(batch: int, remembered: int) -> int:
    """The maps and arrays an answer to a helper may hold, in a run of ``batch`` groups per version whose intake
    remembers used seqs for ``remembered`` versions (the staleness window and its margins): msgpack unpacks a message
    within this budget (:mod:`peer.network.rpc`), so a leader's 64 MiB answer of empty arrays — ~38x that in Python
    objects — is refused as it is read. The largest honest answer is a state, whose ``used`` holds one pair per
    group of the remembered versions' updates plus, per signer, a list and its floor entry; a steps answer holds
    ``KEEP_STEPS`` steps of ``batch`` pairs each; a task ``MAX_TASK_GROUPS`` groups. Twice the largest, and slack."""
    state = remembered * batch + 2 * MAX_SIGNERS + MAX_PARAMETERS + 64
    steps = KEEP_STEPS * (2 * batch + 64)
    task = 2 * MAX_TASK_GROUPS + 64
    return 2 * max(state, steps, task) + 4096


MAX_ANSWER_CONTAINERS = answer_containers(MAX_TASK_GROUPS, MAX_TAU + 16)  # the widest run's


Count = pydantic.conint(strict=True, ge=0, le=MAX_INT)
Finite = pydantic.confloat(strict=True, allow_inf_nan=False)
Sha256 = pydantic.constr(strict=True, regex=r"[0-9a-f]{64}\Z")
ShaOrEmpty = pydantic.constr(strict=True, regex=r"([0-9a-f]{64})?\Z")
PeerId = pydantic.constr(strict=True, min_length=1, max_length=MAX_PEER_ID_CHARS, regex=r"[1-9A-HJ-NP-Za-km-z]+\Z")
Members = pydantic.conlist(PeerId, max_items=MAX_MEMBERS)
Invite = pydantic.constr(strict=True, max_length=MAX_INVITE_CHARS) | None
Blob = pydantic.conbytes(strict=True, max_length=MAX_ANSWER)
OwnerHex = pydantic.constr(strict=True, min_length=2, max_length=2 * MAX_OWNER_KEY_BYTES, regex=r"(?:[0-9a-f]{2})+\Z")
Reason = pydantic.constr(strict=True, max_length=MAX_REASON_CHARS)
SeqVersion = pydantic.conlist(Count, min_items=2, max_items=2)
Used = dict[OwnerHex, pydantic.conlist(SeqVersion, max_items=MAX_USED_PER_SIGNER)]
Banned = dict[OwnerHex, Reason]


class _Message(pydantic.BaseModel):
    class Config:
        extra = pydantic.Extra.forbid
        frozen = True


def _signers(value: dict) -> dict:
    if len(value) > MAX_SIGNERS:
        raise ValueError(f"at most {MAX_SIGNERS} signers, got {len(value)}")
    return value


# ---------------------------------------------------------------------------------------------------- requests


class Probe(_Message):
    op: Literal["probe"]
    invite: Invite = None


class Work(_Message):
    op: Literal["work"]
    version: Count
    sha: Sha256
    need_state: pydantic.StrictBool = False
    invite: Invite = None


class ShareStats(_Message):
    """What :func:`peer.roles.learner.update.share_gradient` measured (a share without signal sends ``{}``)."""

    loss: Finite
    clip_fraction: Finite
    ratio_mean: Finite
    ratio_max: Finite
    rows: Count
    improbable: Count = 0  # tokens below the run's token_floor, left out of the loss


class Result(_Message):
    """A helper's gradient of its share. ``tokens`` is the helper's count, a diagnostic only: the leader weighs the
    share by the count it computed itself from the groups it assigned."""

    op: Literal["result"]
    task: Count
    grads: Blob
    tokens: Count
    stats: ShareStats | None = pydantic.Field(...)  # {} from a share without signal
    invite: Invite = None

    @pydantic.validator("stats", pre=True)
    def _empty(cls, value):
        return None if value == {} else value


# ---------------------------------------------------------------------------------------------------- answers


class ProbeAnswer(_Message):
    leading: pydantic.StrictBool
    leader: PeerId | None = pydantic.Field(...)
    version: pydantic.conint(strict=True, ge=-1, le=MAX_INT)  # -1: holds nothing yet
    sha: ShaOrEmpty


class IntakeDelta(_Message):
    """What an update changed in the leader's intake: the seqs it used, the bans since the previous update."""

    used: Used
    banned: Banned

    _bounded = pydantic.validator("used", "banned", allow_reuse=True)(_signers)


def _json_like(value: Any, depth: int, budget: list[int]) -> None:
    """A ledger record's value: what ``json.dumps`` writes, within depth, length and item bounds."""
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(f"more than {MAX_RECORD_ITEMS} values")
    if value is None or isinstance(value, (bool, float)):
        return
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise ValueError("an integer out of range")
        return
    if isinstance(value, str):
        if len(value) > MAX_RECORD_CHARS:
            raise ValueError(f"a string of over {MAX_RECORD_CHARS} characters")
        return
    if depth >= MAX_RECORD_DEPTH:
        raise ValueError(f"nested over {MAX_RECORD_DEPTH} levels")
    if isinstance(value, list):
        for item in value:
            _json_like(item, depth + 1, budget)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str) or len(key) > MAX_RECORD_CHARS:
                raise ValueError("a key that is not a short string")
            _json_like(item, depth + 1, budget)
    else:
        raise ValueError(f"a {type(value).__name__}, not a JSON value")


class Step(_Message):
    """An update the leader made: its clipped gradient (checked against the LoRA shapes where it is loaded)."""

    version: Count
    parent: ShaOrEmpty
    sha: Sha256
    size: Count
    grads: Blob
    intake: IntakeDelta
    record: dict[str, Any]  # the ledger's line for this version

    @pydantic.validator("record")
    def _record(cls, value: dict) -> dict:
        _json_like(value, 0, [MAX_RECORD_ITEMS])
        return value

    @pydantic.root_validator(skip_on_failure=True)
    def _record_is_this_steps(cls, values: dict) -> dict:
        record = values["record"]
        if record.get("version") != values["version"] or record.get("sha256") != values["sha"]:
            raise ValueError("the step's record names another version or sha256")
        return values


class OptimizerState(_Message):
    """AdamW's per-parameter state (:func:`peer.roles.learner.update.optimizer_state_to_wire`): step counts and
    moments."""

    steps: pydantic.conlist(Count, max_items=MAX_PARAMETERS)
    tensors: Blob


class IntakeState(_Message):
    used: Used
    banned: Banned

    _bounded = pydantic.validator("used", "banned", allow_reuse=True)(_signers)


class State(_Message):
    version: Count
    sha: Sha256
    parent: ShaOrEmpty
    adapter: pydantic.conbytes(strict=True, min_length=1, max_length=MAX_ANSWER)
    optimizer: OptimizerState
    intake: IntakeState


class TaskGroup(_Message):
    owner: pydantic.conbytes(strict=True, min_length=1, max_length=MAX_OWNER_KEY_BYTES)
    group: pydantic.conbytes(strict=True, min_length=1, max_length=MAX_GROUP_BYTES)


class Task(_Message):
    id: Count
    version: Count
    groups: pydantic.conlist(TaskGroup, min_items=1, max_items=MAX_TASK_GROUPS)


class StepsAnswer(_Message):
    steps: pydantic.conlist(Step, min_items=1, max_items=KEEP_STEPS)
    members: Members


class StateAnswer(_Message):
    state: State
    members: Members


class TaskAnswer(_Message):
    task: Task
    members: Members


class IdleAnswer(_Message):
    idle: Literal[True]
    members: Members


class LeaderAnswer(_Message):
    leader: PeerId | None = pydantic.Field(...)


class RefusedAnswer(_Message):
    refused: Reason


WORK_ANSWERS = {
    "steps": StepsAnswer,
    "state": StateAnswer,
    "task": TaskAnswer,
    "idle": IdleAnswer,
    "leader": LeaderAnswer,
    "refused": RefusedAnswer,
}
REQUESTS = {"probe": Probe, "work": Work, "result": Result}


class ResultAnswer(_Message):
    ok: Literal[True]


# ---------------------------------------------------------------------------------------------------- parsing


def _parse(model: type[_Message], obj: dict, what: str) -> _Message:
    try:
        return model.parse_obj(obj)
    except pydantic.ValidationError as e:
        errors = e.errors()
        reasons = "; ".join(
            f"{'.'.join(str(part) for part in err['loc']) or what}: {err['msg']}" for err in errors[:3]
        )
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise ProtocolError(f"malformed {what}: {reasons}{more}"[:MAX_REASON_CHARS]) from None


def parse_request(obj: dict) -> Probe | Work | Result:
    """A request as its model (by ``op``), or ProtocolError."""
    op = obj.get("op")
    model = REQUESTS.get(op) if isinstance(op, str) else None
    if model is None:
        raise ProtocolError(f"unknown op {op!r:.40}: one of {', '.join(REQUESTS)}")
    return _parse(model, obj, f"{op} request")


def parse_probe_answer(obj: dict) -> dict:
    """``obj`` checked as a probe's answer (returned as it came: nothing was converted)."""
    _parse(ProbeAnswer, obj, "probe answer")
    return obj


def parse_work_answer(obj: dict) -> dict:
    """``obj`` checked as a work request's answer: exactly one kind, and the members (returned as it came)."""
    kinds = [k for k in obj if k in WORK_ANSWERS]
    if len(kinds) != 1:
        raise ProtocolError(f"a work answer is one of {', '.join(WORK_ANSWERS)}; got the fields {sorted(obj)[:8]}")
    _parse(WORK_ANSWERS[kinds[0]], obj, f"{kinds[0]} answer")
    return obj


def parse_result_answer(obj: dict) -> dict:
    _parse(ResultAnswer, obj, "result answer")
    return obj


__all__ = [
    "KEEP_STEPS",
    "MAX_ANSWER",
    "MAX_ANSWER_CONTAINERS",
    "MAX_MEMBERS",
    "Probe",
    "Result",
    "Work",
    "answer_containers",
    "parse_probe_answer",
    "parse_request",
    "parse_result_answer",
    "parse_work_answer",
]
