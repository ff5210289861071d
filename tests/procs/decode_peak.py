"""Peak resident memory of one sampled batch, for tests/unit/test_memory.py: ``decode_peak.py ROWS PROMPT NEW DTYPE
VOCAB`` builds a small Qwen2 model from a config (random weights, no files), decodes ROWS rows of PROMPT tokens for
NEW tokens each with the sampler's own loop, and prints JSON: the rise of the process's peak RSS over its resident
size just before the batch (the kernel's high-water mark, reset through /proc/self/clear_refs), and the model's
config. A one-row batch runs first so that what is allocated once (kernels, caches) is not counted."""

import json
import os
import re
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from peer.model.sampling import decode  # noqa: E402


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def main() -> None:
    rows, prompt, new, dtype, vocab = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
        int(sys.argv[5]),
    )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen2Config(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1024,
        vocab_size=vocab,
        tie_word_embeddings=True,
        max_position_embeddings=prompt + new + 8,
    )
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype)).eval()

    def run(n: int) -> None:
        ids = torch.randint(3, vocab, (n, prompt))
        decode(
            model,
            ids,
            torch.ones_like(ids),
            max_new_tokens=new,
            eos_id=vocab + 1,  # no row ends early: every row holds its whole cache at the end
            pad_id=0,
            generator=torch.Generator().manual_seed(0),
        )

    run(1)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak to the current resident size
    before = status("VmRSS")
    run(rows)
    print(json.dumps({"rise": status("VmHWM") - before, "config": config.to_dict()}))


if __name__ == "__main__":
    main()
