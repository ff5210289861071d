"""The host's own measure of learning (``hivegrpo host --eval-every S``): held-out exact match of the newest adapter.

The host already has the base model (it builds adapter v0 from it). With ``--eval-every`` it keeps it, with LoRA
attached, follows the learners' announcements like any peer (:class:`~peer.run.adapters.AdapterFollower`: the
blob comes over P2P and must hash to what was announced), and every ``every`` seconds measures greedy exact match
on the task's held-out set (:func:`peer.model.evaluate.exact_match`, what ``hivegrpo eval`` runs) on the newest
version it holds. Results go to the status page's exact-match curve and ``/metrics``. It costs the host CPU; it is
off by default.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from peer.log import get_logger

logger = get_logger(__name__)


class HostEvaluator:
    def __init__(
        self,
        swarm,
        blobs,
        folder: Path,
        settings,
        *,
        every: float,
        n: int,
        on_result: Callable[[int, float], None],
        admitted=None,
    ):
        self.swarm, self.blobs, self.folder, self.settings = swarm, blobs, folder, settings
        self.admitted = admitted  # whose announcements count (peer.network.admission.Admitted)
        self.every, self.n, self.on_result = every, n, on_result
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="host-evaluator", daemon=True)
        self.follower = None

    def start(self) -> HostEvaluator:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:  # the evaluation is a view, never the host's reason to stop
            logger.exception("the host's exact-match evaluation stopped")

    def _loop(self) -> None:

        from peer.model.adapter import AdapterError, attach_lora, load_adapter_bytes, parse_adapter
        from peer.model.config import ModelConfig
        from peer.model.evaluate import exact_match
        from peer.model.loading import load_base
        from peer.run.adapters import AdapterFollower
        from peer.tasks import get_task

        s = self.settings
        base = load_base(ModelConfig(name=str(self.folder), quantization=s.quantization, device="cpu"))
        model = attach_lora(base.model, s.lora)
        task = get_task(s.task, s.task_config)

        def check(blob: bytes) -> str | None:
            try:
                parse_adapter(model, blob)
            except AdapterError as e:
                return str(e)
            return None

        held = self.admitted.adapter0_sha256 if self.admitted is not None else ""
        self.follower = AdapterFollower(
            self.swarm, self.blobs, 0, admitted=self.admitted, check=check, held_sha=held
        ).start()
        try:
            self._measure(model, base.tokenizer, task, load_adapter_bytes, exact_match)
        finally:
            self.follower.stop()

    def _measure(self, model, tokenizer, task, load_adapter_bytes, exact_match) -> None:
        import torch

        s = self.settings
        version = 0
        while True:
            started = time.monotonic()
            with torch.no_grad():
                result = exact_match(
                    model, tokenizer, task, n=self.n, max_new_tokens=s.sampling.max_new_tokens, prompt=s.prompt
                )
            logger.info("exact match of adapter v%d: %.3f (n=%d)", version, result.exact_match, self.n)
            self.on_result(version, result.exact_match)
            if self._stop.wait(max(0.0, self.every - (time.monotonic() - started))):
                return
            while (ready := self.follower.take()) is None:  # wait for a newer version than the one measured
                if self._stop.wait(1.0):
                    return
            found, blob = ready
            load_adapter_bytes(model, blob, found.sha256)
            self.follower.mark_held(found.version, found.sha256)
            version = found.version

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)


__all__ = ["HostEvaluator"]
