"""The options several ``hivegrpo`` commands share, declared once: ``peer.cli`` and ``coordinator.cli`` both use them.

Each is a decorator (``@network_options``, ``@cache_dir_option``, ...) or a factory of one where commands differ in a
default or a word of help (``@quantization_option(default=None, more=...)``, ``@json_option("the status")``). An
option that sets one field of a config (:class:`peer.model.config.ModelConfig`,
:class:`peer.network.swarm.NetworkConfig`) is a :class:`FieldOption`: its help is that field's ``metadata["help"]``,
so the flag and the field say the same thing and it is written once. Choices come from the config that validates
them (:data:`peer.model.config.QUANTIZATIONS`, :data:`~peer.model.config.DTYPES`); value checks are the callbacks of
:mod:`peer.cli_checks`.

Beside the options: the functions that turn an option group into its config (:func:`network_config`,
:func:`prompt_config`) and what every command does before its work (:func:`use_threads`, :func:`stop_on_signals`).
Like :mod:`peer.cli`, this module imports no torch, hivemind or network code until a command runs, so ``hivegrpo
--help`` stays instant.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

import click

from peer import cli_checks
from peer.model.config import BUNDLED, DTYPES, QUANTIZATIONS

MODEL_CONFIG = "peer.model.config:ModelConfig"
NETWORK_CONFIG = "peer.network.swarm:NetworkConfig"


def field_help(config_field: str, more: str = "") -> str:
    """The help of a config field named ``"module:Class.field"``, as a sentence, then ``more``."""
    module, _, name = config_field.partition(":")
    cls_name, _, field_name = name.partition(".")
    cls = getattr(importlib.import_module(module), cls_name)
    text = {f.name: f for f in dataclasses.fields(cls)}[field_name].metadata["help"]
    sentence = text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")
    return f"{sentence} {more}" if more else sentence


class FieldOption(click.Option):
    """An option that sets one config field (``config_field="module:Class.field"``): its help is the field's, plus
    ``more`` (what only the command line says, e.g. a default taken from elsewhere). It is looked up when first read
    (to show help), not when the command is declared: the config's module may import more than ``hivegrpo --help``
    needs (``peer.network.swarm`` loads the protocol's record schemas)."""

    def __init__(self, *param_decls, config_field: str, more: str = "", **attrs):
        self.config_field = config_field
        self.more = more
        super().__init__(*param_decls, **attrs)

    @property
    def help(self) -> str | None:
        if self._help is None:
            self._help = field_help(self.config_field, self.more)
        return self._help

    @help.setter
    def help(self, text: str | None) -> None:
        self._help = text


# Any command


def threads_option(f):
    """``--threads``: torch's thread count on this machine (see :func:`use_threads`)."""
    return click.option(
        "--threads", type=click.IntRange(1), default=1, show_default=True, help="torch threads (CPU)."
    )(f)


def use_threads(num_threads: int) -> None:
    """Peer processes share few cores: one thread each unless the user says otherwise (see docs). Imports torch."""
    os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))
    import torch

    torch.set_num_threads(num_threads)


def stop_on_signals(stop) -> None:
    """SIGINT/SIGTERM call ``stop()`` (installed once the DHT's child processes exist, so only this one reacts)."""
    import signal

    def handler(signum, frame):
        click.echo(f"{signal.Signals(signum).name}: stopping after the current batch", err=True)
        stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def json_option(what: str = "the result"):
    """``--json``: print ``what`` as one JSON object instead of a line for people."""
    return click.option("--json", "as_json", is_flag=True, help=f"Print {what} as one JSON object.")


# The swarm and the run


def network_options(f):
    """How a peer reaches the swarm: the options :func:`network_config` turns into a
    :class:`~peer.network.swarm.NetworkConfig`."""
    f = click.option(
        "--invite",
        cls=FieldOption,
        config_field=f"{NETWORK_CONFIG}.invite",
        envvar="HIVEGRPO_INVITE",
        show_envvar=True,
        default=None,
        callback=cli_checks.invite,
    )(f)
    f = click.option("--no-relay", is_flag=True, help="Do not use libp2p relays (closed networks).")(f)
    f = click.option("--client-mode", cls=FieldOption, config_field=f"{NETWORK_CONFIG}.client_mode", is_flag=True)(f)
    f = click.option(
        "--identity",
        cls=FieldOption,
        config_field=f"{NETWORK_CONFIG}.identity_path",
        type=click.Path(dir_okay=False),
        default=None,
        callback=cli_checks.identity,
    )(f)
    f = click.option(
        "--announce-maddrs",
        cls=FieldOption,
        config_field=f"{NETWORK_CONFIG}.announce_maddrs",
        multiple=True,
        callback=cli_checks.announce_maddrs,
    )(f)
    f = click.option(
        "--host-maddrs",
        cls=FieldOption,
        config_field=f"{NETWORK_CONFIG}.host_maddrs",
        more="Repeat for several.",
        multiple=True,
        callback=cli_checks.host_maddrs,
    )(f)
    f = click.option(
        "--initial-peers",
        cls=FieldOption,
        config_field=f"{NETWORK_CONFIG}.initial_peers",
        more="Repeat for several.",
        multiple=True,
        callback=cli_checks.initial_peers,
    )(f)
    return f


def network_config(initial_peers, host_maddrs, announce_maddrs, identity, client_mode, no_relay, invite=None):
    """The :class:`~peer.network.swarm.NetworkConfig` of :func:`network_options`' values (a command passes them on
    as ``**network``). Several multiaddrs may come in one ``--initial-peers`` value, pasted from the host's line."""
    from peer.network.swarm import NetworkConfig

    peers = tuple(m for value in initial_peers for m in value.split())
    options = dict(initial_peers=peers, announce_maddrs=tuple(announce_maddrs), identity_path=identity, invite=invite)
    if host_maddrs:
        options["host_maddrs"] = tuple(host_maddrs)
    return NetworkConfig(client_mode=client_mode, use_relay=not no_relay, use_auto_relay=not no_relay, **options)


def run_id_option(help: str, required: bool = True):
    """``--run-id``: a run's name, by the protocol's rule for run ids."""
    return click.option("--run-id", required=required, callback=cli_checks.run_id, help=help)


def run_options(what: str, required: bool = True):
    """``--run-id`` and ``--coordinator``: which run, signed by which host (as ``hivegrpo host`` printed them)."""

    def decorate(f):
        f = click.option(
            "--coordinator",
            default=None,
            callback=cli_checks.coordinator,
            help="Fingerprint of the host's key, as the host printed it (picks the run's manifest).",
        )(f)
        return run_id_option(f"{what}, as the host printed it.", required=required)(f)

    return decorate


def allow_task_option(f):
    """``--allow-task``: the plug-in task modules a peer lets a run's manifest import."""
    return click.option(
        "--allow-task",
        "allow_task",
        multiple=True,
        metavar="MODULE",
        callback=cli_checks.allowed_tasks,
        help="Let the run's manifest name a plug-in task from this module ('module' of 'module:attribute'; "
        "repeat for several). Importing a module runs its code: allow only a host you trust.",
    )(f)


def cache_dir_option(f):
    """``--cache-dir``: where a peer keeps fetched models and blobs (checked writable before anything starts)."""
    return click.option(
        "--cache-dir",
        type=click.Path(file_okay=False),
        default="~/.cache/hivegrpo",
        show_default=True,
        callback=cli_checks.output_folder,
        help="Where fetched models and blobs are kept.",
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


def name_option(f):
    """``--name``: how status, the host's page and the credit table call this peer."""
    return click.option(
        "--name",
        default=None,
        callback=cli_checks.peer_name,
        help="A name for this peer in `hivegrpo status`, the host's page and the contributors' credit (1-32 "
        "printable characters; others see it). Default: none (the key fingerprint alone).",
    )(f)


def metrics_options(f):
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


def ledger_option(what: str):
    """``--ledger``: a file this peer appends ``what`` JSON lines to."""
    return click.option(
        "--ledger",
        type=click.Path(dir_okay=False),
        default=None,
        callback=cli_checks.output_file,
        help=f"Append {what} JSON lines here.",
    )


# The model


def model_option(default: str | None = BUNDLED, help: str | None = None):
    """``--model``: the base model; its help is :class:`~peer.model.config.ModelConfig`'s ``name`` unless ``help``
    replaces it (an option that means something else by it)."""
    attrs = {} if help is not None else dict(cls=FieldOption, config_field=f"{MODEL_CONFIG}.name", show_default=True)
    return click.option("--model", default=default, callback=cli_checks.model, help=help, **attrs)


def revision_option(f):
    """``--revision``: the hub revision of ``--model``."""
    return click.option("--revision", cls=FieldOption, config_field=f"{MODEL_CONFIG}.revision", default=None)(f)


def quantization_option(default: str | None = "nf4", more: str = "", help: str | None = None):
    """``--quantization``, one of :data:`~peer.model.config.QUANTIZATIONS`; its help is the config field's, then
    ``more``, unless ``help`` replaces it (an option that means something else by it)."""
    attrs = {} if default is None else dict(show_default=True)
    if help is None:
        attrs |= dict(cls=FieldOption, config_field=f"{MODEL_CONFIG}.quantization", more=more)
    return click.option("--quantization", type=click.Choice(QUANTIZATIONS), default=default, help=help, **attrs)


def device_options(f):
    """``--device`` and ``--dtype``: where this machine computes and in what precision (a peer's own choice)."""
    f = click.option(
        "--dtype",
        cls=FieldOption,
        config_field=f"{MODEL_CONFIG}.dtype",
        type=click.Choice(DTYPES),
        default="auto",
        show_default=True,
    )(f)
    f = click.option(
        "--device",
        cls=FieldOption,
        config_field=f"{MODEL_CONFIG}.device",
        default="auto",
        show_default=True,
        callback=cli_checks.device,
    )(f)
    return f


def model_options(f):
    """``--model``, ``--quantization``, ``--device``, ``--dtype``: a model this command loads itself."""
    f = device_options(f)
    f = quantization_option()(f)
    return model_option()(f)


def adapter_option(lead: str):
    """``--adapter``: a LoRA adapter on disk, in any form hivegrpo reads."""
    return click.option(
        "--adapter",
        type=click.Path(exists=True),
        default=None,
        help=f"{lead}: a PEFT folder (hivegrpo's or peft's, a learner's checkpoint folder) or a hivegrpo file.",
    )


# The task and its prompts


def task_options(f):
    """``--task`` and ``--task-config``: what the run trains on (checked together by :func:`peer.cli_checks.task`)."""
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


def prompt_options(f):
    """``--chat-template``, ``--system-prompt``, ``--stop``: how questions become prompts (see docs/models.md);
    :func:`prompt_config` makes them a config."""
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


def prompt_config(chat_template: str, system_prompt: str, stop: tuple[str, ...]):
    """The :class:`~peer.grpo.config.PromptConfig` of :func:`prompt_options`' values; one it refuses is a usage
    error."""
    from peer.grpo.config import PromptConfig

    try:
        return PromptConfig(chat_template=chat_template, system_prompt=system_prompt, stop=tuple(stop))
    except ValueError as e:
        raise click.UsageError(str(e)) from None


# Learning


def lr_option(f):
    """``--lr``: the learning rate of the LoRA update."""
    return click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=2e-3, show_default=True)(f)


def _micro_batch_tokens(ctx, param, value: int | None) -> int | None:
    return value or None  # 0: the whole batch at once


def learner_memory_options(f):
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
