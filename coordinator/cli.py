"""The coordinator's commands (``hivegrpo host``), registered with the ``hivegrpo`` command as an entry point."""

from __future__ import annotations

import click

from peer import cli_checks
from peer.cli_options import (
    cache_dir_option,
    json_option,
    max_upload_option,
    model_option,
    network_config,
    network_options,
    prompt_config,
    prompt_options,
    quantization_option,
    revision_option,
    run_id_option,
    stop_on_signals,
    task_options,
    use_threads,
)


@click.command("host")
@network_options
@run_id_option("Name of the run (letters, digits, '_' and '-').")
@model_option()
@revision_option
@quantization_option()
@task_options
@prompt_options
@click.option("--seed", type=int, default=0, show_default=True, help="Run seed: every prompt derives from it.")
@click.option("--group-size", type=click.IntRange(2, 64), default=8, show_default=True)
@click.option(
    "--max-new-tokens",
    type=click.IntRange(1, 1024),
    default=6,
    show_default=True,
    help="Completion length cap in tokens (the bundled task's answers need 6; reasoning tasks need more).",
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="Sampling temperature of the rollout peers (the learners' log-probs use it too).",
)
@click.option("--groups-per-version", type=click.IntRange(1, 4096), default=16, show_default=True)
@click.option(
    "--tau-max",
    type=click.IntRange(0, 61),
    default=4,
    show_default=True,
    help="Learners drop groups more than this many adapter versions old.",
)
@click.option(
    "--token-floor",
    type=click.FloatRange(0.0, 0.1),
    default=1e-3,
    show_default=True,
    help="Learners learn nothing from a completion token the policy gives less than this probability, and ban a "
    "signer whose group holds far more such tokens than sampling gives (written text, not sampled); 0 turns both off.",
)
@cache_dir_option
@click.option(
    "--info-file",
    type=click.Path(dir_okay=False),
    default=None,
    callback=cli_checks.output_file,
    help="Write the join details as JSON.",
)
@click.option(
    "--private",
    is_flag=True,
    help="Only invited peers may join (needs --identity); `hivegrpo invite` issues and revokes invites.",
)
@click.option(
    "--web-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve the live status page, JSON API and /metrics on this port (0: any free port).",
)
@click.option(
    "--web-host", default="127.0.0.1", show_default=True, help="Address of the status page (0.0.0.0: every interface)."
)
@click.option(
    "--eval-every",
    type=click.FloatRange(min=0),
    default=0,
    show_default=True,
    help="Measure the newest adapter's held-out exact match every this many seconds, for the page (0: never).",
)
@click.option("--eval-n", type=click.IntRange(1), default=200, show_default=True, help="Examples per measurement.")
@click.option(
    "--learners",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Print this many learn lines, each with its own credential: a credential admits one machine (two live "
    "learners on one credential are both refused).",
)
@max_upload_option
def host_cmd(
    run_id,
    model,
    revision,
    quantization,
    task,
    task_config,
    chat_template,
    system_prompt,
    stop,
    seed,
    group_size,
    max_new_tokens,
    temperature,
    groups_per_version,
    tau_max,
    token_floor,
    cache_dir,
    info_file,
    private,
    web_port,
    web_host,
    eval_every,
    eval_n,
    learners,
    max_upload,
    **network,
):
    """Host a swarm: publish the run, seed the base model and adapter v0, print the line others paste."""
    from pathlib import Path

    cli_checks.task(task, task_config)
    if private and not network["identity"]:
        raise click.UsageError(
            "a private swarm needs --identity FILE: its invites are signed with the host's key, which must survive "
            "a restart (or every invite given out would stop working)"
        )
    cli_checks.listen(web_host, web_port, "--web-port")
    use_threads(1)
    prompt = prompt_config(chat_template, system_prompt, stop)
    from coordinator.manifest import ManifestTooLarge, RunSettings, check_settings
    from peer.grpo import LossConfig, SamplingConfig, StalenessConfig

    settings = RunSettings(
        run_id=run_id,
        model=model,
        revision=revision,
        quantization=quantization,
        task=task,
        task_config=task_config,
        sampling=SamplingConfig(group_size=group_size, max_new_tokens=max_new_tokens, temperature=temperature),
        prompt=prompt,
        groups_per_version=groups_per_version,
        staleness=StalenessConfig(tau_max=tau_max),
        loss=LossConfig(token_floor=token_floor),
        seed=seed,
        access="private" if private else "public",
    )
    try:
        check_settings(settings)
    except ManifestTooLarge as e:
        raise click.UsageError(str(e)) from None
    from coordinator.host import Host, HostConfig

    config = HostConfig(
        settings,
        network_config(**network),
        cache_dir=Path(cache_dir).expanduser(),
        web_port=web_port,
        web_host=web_host,
        eval_every=eval_every,
        eval_n=eval_n,
        max_upload=max_upload,
        learners=learners,
    )
    host = Host(config)
    try:
        host.start()
        if info_file:
            host.write_info(info_file)
        click.echo(
            f"hosting run {run_id}. Rollout peers join with:\n  {host.join_command('join')}\n"
            + _learn_lines(host)
            + f"Anyone sees the swarm with:\n  {host.join_command('status')}"
            + (f"\nLive status page: {host.web.url}" if host.web else "")
            + (
                f"\nThis swarm is private: the lines above carry invite {host.invite.invite_id}; give each peer its "
                f"own with `hivegrpo invite --identity {network['identity']} --run-id {run_id} --name NAME`."
                if host.invite
                else ""
            )
        )
        stop_on_signals(host.request_stop)
        host.wait()
    finally:
        host.close()


def _learn_lines(host) -> str:
    lines = [host.join_command("learn", i) for i in range(len(host.learner_credentials))]
    if len(lines) == 1:
        return f"Learners join with:\n  {lines[0]}\n"
    return "Learners join with one line each (a credential admits one machine):\n" + "".join(f"  {x}\n" for x in lines)


def _invite_name(ctx, param, value: str) -> str:
    from peer.network.access import MAX_NAME

    if len(value) > MAX_NAME:
        raise click.BadParameter(f"an invite's name has at most {MAX_NAME} characters, got {len(value)}; shorten it")
    return value


def _expires(ctx, param, value: str) -> float:
    from coordinator.invites import parse_duration
    from peer.network.access import InviteError

    try:
        return parse_duration(value)
    except InviteError as e:
        raise click.BadParameter(str(e)) from None


def _invite_ids(ctx, param, values: tuple[str, ...]) -> tuple[str, ...]:
    import re

    for value in values:
        if re.fullmatch("[0-9a-f]{16}", value) is None:
            raise click.BadParameter(
                f"{value!r} is not an invite id (16 hex digits); `hivegrpo invite --list` shows the ids issued"
            )
    return values


@click.command("invite")
@click.option(
    "--identity",
    required=True,
    type=click.Path(dir_okay=False),
    callback=cli_checks.host_identity,
    help="The host's --identity file.",
)
@run_id_option("The private run, as the host runs it.")
@click.option("--name", default="", callback=_invite_name, help="Who the invite is for (shown in --list).")
@click.option(
    "--expires",
    default="7d",
    show_default=True,
    callback=_expires,
    help="How long it stays valid: 30m, 12h, 7d, ... or never.",
)
@click.option(
    "--revoke",
    "revoke",
    multiple=True,
    metavar="ID",
    callback=_invite_ids,
    help="Revoke the invite with this id (repeatable).",
)
@click.option("--list", "show", is_flag=True, help="List the invites issued, with their state.")
@click.option(
    "--role",
    type=click.Choice(["member", "learner"]),
    default="member",
    show_default=True,
    help="member: an invite to a private swarm; learner: a credential admitting a learner (public or private runs).",
)
@json_option()
def invite_cmd(identity, run_id, name, expires, revoke, show, role, as_json):
    """Issue (default), revoke or list invites (private swarms) and learner credentials (any swarm); the running
    host applies revocations in seconds."""
    import json

    from coordinator.invites import InviteBook

    book = InviteBook(identity, run_id)
    if role == "learner" and not (revoke or show):
        credential = book.issue_learner(name, expires)
        c = credential.certificate
        if as_json:
            click.echo(
                json.dumps({"id": c.credential_id, "name": name, "expires": c.expires, "credential": credential.token})
            )
        else:
            click.echo(
                f"learner credential {c.credential_id} ({name or 'unnamed'}) for run {run_id}:\n{credential.token}\n"
                "the learner passes it as --learner-credential (or HIVEGRPO_LEARNER_CREDENTIAL); keep it secret"
            )
        return
    if revoke or show:
        for invite_id in revoke:
            entry = book.revoke(invite_id)
            if not as_json:
                click.echo(f"revoked invite {invite_id} ({entry['name'] or 'unnamed'})")
        if show or as_json:
            entries = [{k: v for k, v in e.items() if k != "token"} for e in book.entries()]
            if as_json:
                click.echo(json.dumps({"invites": entries, "revoked": book.revoked()}))
            else:
                import time

                for e in entries:
                    until = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(e["expires"])) if e["expires"] else "never"
                    click.echo(f"{e['id']}  {e['role']:7}  {e['state']:8}  expires {until:20}  {e['name']}")
        return
    invite = book.issue(name, expires)
    if as_json:
        click.echo(
            json.dumps({"id": invite.invite_id, "name": name, "expires": invite.expires, "invite": invite.token})
        )
    else:
        click.echo(f"{invite.describe()}:\n{invite.token}\npeers pass it as --invite (or HIVEGRPO_INVITE)")
