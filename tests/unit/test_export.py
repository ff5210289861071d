"""Adapters leave the tool and come back: PEFT folders both ways (bit-exact), plain peft and transformers code on
hivegrpo's adapters, hivegrpo on plain peft's, and which swarm version ``hivegrpo export`` takes. (Exporting from a
live swarm, as an adapter and as a merged model: tests/integration/test_swarm_outputs.py.)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from peer.model.adapter import AdapterError
from peer.model.config import LoRAConfig
from peer.model.peft_folder import blob_from_tensors, read_adapter, write_peft_folder

ENV = dict(os.environ, OMP_NUM_THREADS="1")

# Plain transformers + peft: the bundled model's folder is the only thing taken from hivegrpo.
PLAIN_GREEDY = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import PeftModel
from peer.model.loading import bundled_path
from peer.tasks import get_task

base_dir, adapter_dir, n = str(bundled_path()), sys.argv[1], int(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(base_dir)
tokenizer.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
{load_or_train}
model.eval()
task = get_task("addition", {{}})
examples = task.heldout(n, 0)
batch = tokenizer([e.prompt for e in examples], return_tensors="pt", padding=True)
with torch.no_grad():
    out = model.generate(**batch, do_sample=False, max_new_tokens=6, pad_token_id=tokenizer.pad_token_id)
texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
same = None
if adapter_dir != "-":  # transformers' own adapter loading gives the same model
    other = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    other.load_adapter(adapter_dir)
    with torch.no_grad():
        same = bool(torch.allclose(other(**batch).logits, model(**batch).logits, atol=1e-6))
correct = sum(task.is_correct(t, e) for t, e in zip(texts, examples))
print(json.dumps({{"correct": correct, "texts": texts, "same_as_transformers": same}}))
"""

# Plain peft training: a LoRA shape hivegrpo never uses by default (r=4, alpha=8, two targets, dropout), trained by
# next-token loss on the task's answers, saved by peft itself.
PLAIN_TRAIN = """
from peft import LoraConfig, get_peft_model
model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj"]))
torch.manual_seed(0)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
train = get_task("addition", {}).example
model.train()
for step in range(30):
    texts = [train(0, step * 8 + i).prompt + train(0, step * 8 + i).reference for i in range(8)]
    ids = tokenizer(texts, return_tensors="pt", padding=True)
    labels = ids["input_ids"].masked_fill(ids["attention_mask"] == 0, -100)
    model(**ids, labels=labels).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
model.save_pretrained(adapter_dir)
"""


def _run(argv: list[str], timeout: float = 240) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _plain(adapter_dir: Path | str, n: int, train: bool = False) -> dict:
    load = 'model = PeftModel.from_pretrained(model, adapter_dir) if adapter_dir != "-" else model'
    code = PLAIN_GREEDY.format(load_or_train=PLAIN_TRAIN if train else load)
    return json.loads(_run([sys.executable, "-c", code, str(adapter_dir), str(n)]))


def _hivegrpo(*args: str, timeout: float = 240) -> dict:
    return json.loads(_run([sys.executable, "-m", "peer.cli", *args, "--json"], timeout))


def _tensors(**shapes) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"base_model.model.{k}.weight": torch.randn(s, generator=g) for k, s in shapes.items()}


# --------------------------------------------------------------------------------------------- pure conversion


def test_a_blob_becomes_a_peft_folder_and_reads_back_byte_for_byte(tmp_path):
    lora = LoRAConfig(r=2, alpha=4, target_modules=("v_proj", "q_proj"))
    blob = blob_from_tensors(_tensors(**{"l.q_proj.lora_A": (2, 3), "l.q_proj.lora_B": (3, 2)}), lora)
    write_peft_folder(tmp_path / "a", blob, "org/base")
    assert (tmp_path / "a" / "adapter_model.safetensors").read_bytes() == blob, "the weights file is the blob"
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 2, 4)
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["base_model_name_or_path"] == "org/base"
    back, got = read_adapter(tmp_path / "a")
    assert back == blob and (got.r, got.alpha, set(got.target_modules)) == (2, 4, {"q_proj", "v_proj"})
    assert read_adapter(tmp_path / "a" / "adapter_model.safetensors")[0] == blob, "the file inside the folder too"


def test_a_folder_of_another_writer_converts_exactly_whatever_its_float_dtype(tmp_path):
    tensors = _tensors(**{"l.q_proj.lora_A": (2, 3), "l.q_proj.lora_B": (3, 2)})
    folder = tmp_path / "peft"
    folder.mkdir()
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, folder / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 8.0, "target_modules": ["q_proj"], "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    blob, lora = read_adapter(folder)
    assert (lora.r, lora.alpha, lora.target_modules) == (2, 8, ("q_proj",))
    write_peft_folder(tmp_path / "again", blob, "m")
    got = load_file(tmp_path / "again" / "adapter_model.safetensors")
    for key, t in tensors.items():  # bfloat16 -> float32 is exact
        assert got[key].dtype == torch.float32 and torch.equal(got[key], t.to(torch.bfloat16).float()), key
    assert read_adapter(tmp_path / "again")[0] == blob


@pytest.mark.parametrize(
    "change, says",
    [
        ({"use_dora": True}, "use_dora"),
        ({"use_rslora": True}, "use_rslora"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"target_modules": ".*proj"}, "pattern"),
        ({"peft_type": "IA3"}, "LoRA adapters only"),
        ({"r": "eight"}, "lacks a readable r"),
        ({"r": 0}, "r must be"),
    ],
)
def test_what_hivegrpo_cannot_run_is_refused_by_name(tmp_path, change, says):
    blob = blob_from_tensors(_tensors(**{"l.q_proj.lora_A": (2, 3)}), LoRAConfig(r=2, target_modules=("q_proj",)))
    write_peft_folder(tmp_path, blob, "m")
    config = json.loads((tmp_path / "adapter_config.json").read_text()) | change
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(AdapterError, match=says):
        read_adapter(tmp_path)


def test_export_picks_the_newest_admitted_version_or_an_ancestor_it_names():
    from types import SimpleNamespace

    from peer.errors import UserError
    from peer.export import _choose

    def record(version, parent_chain):
        return SimpleNamespace(
            version=version, sha256=f"s{version}", size=10, providers=("p",), created=float(version),
            parent_sha256=f"s{version - 1}", ancestors=tuple(parent_chain), demand=None,
        )  # fmt: skip

    records = [(b"k1", record(20, [f"s{v}" for v in range(19, 3, -1)])), (b"k2", record(19, ["s18"]))]
    assert _choose(records, None)[:2] == (20, "s20")
    assert _choose(records, 19)[:2] == (19, "s19")
    assert _choose(records, 10)[:2] == (10, "s10"), "the tenth ancestor"
    with pytest.raises(UserError, match="not announced any more"):
        _choose(records, 2)
    with pytest.raises(UserError, match="no admitted learner"):
        _choose([], None)


def test_broken_or_unsafe_folders_say_what_is_wrong(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        read_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4, "target_modules": ["q"]}))
    with pytest.raises(AdapterError, match="weights are missing"):
        read_adapter(tmp_path)
    (tmp_path / "adapter_model.bin").write_bytes(b"a pickle")
    with pytest.raises(AdapterError, match="pickle"):
        read_adapter(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"junk")
    with pytest.raises(AdapterError, match="not a valid safetensors"):
        read_adapter(tmp_path)
    bare = tmp_path / "bare.safetensors"
    save_file({"x": torch.ones(2)}, bare)
    with pytest.raises(AdapterError, match="no LoRA configuration"):
        read_adapter(bare)
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match="holds no adapter"):
        read_adapter(tmp_path / "empty")


# ------------------------------------------------------------------------------------ peft and hivegrpo, both ways


@pytest.mark.timeout(400)
def test_train_local_saves_a_folder_plain_peft_loads_to_the_same_greedy_outputs(tmp_path):
    folder, report = tmp_path / "trained", tmp_path / "report.json"
    trained = _hivegrpo(
        "train-local", "--quantization", "none", "--max-steps", "6", "--eval-n", "200", "--eval-every", "1000",
        "--lr", "1e-2", "--save-adapter", str(folder), "--report", str(report),
    )  # fmt: skip
    assert trained["steps"] == 6 and [p["step"] for p in trained["curve"]] == [0, 6]
    assert json.loads(report.read_text()) == trained
    ours = _hivegrpo("eval", "--quantization", "none", "--adapter", str(folder), "--n", "200")
    assert ours["adapter_sha256"] == trained["adapter_sha256"]
    assert ours["exact_match"] == pytest.approx(trained["final_exact_match"])  # the same held-out set, greedy
    plain = _plain(folder, 200)
    assert plain["correct"] == ours["correct"], (plain["correct"], ours)
    assert plain["same_as_transformers"], "transformers' load_adapter gives another model than peft's"
    assert trained["curve"][0]["exact_match"] != ours["exact_match"], "the adapter changed nothing: proves nothing"


@pytest.mark.timeout(400)
def test_a_folder_plain_peft_trained_is_evaluated_by_hivegrpo(tmp_path):
    folder = tmp_path / "plain"
    plain = _plain(folder, 200, train=True)  # trains, saves with peft, then scores itself
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
    ours = _hivegrpo("eval", "--quantization", "none", "--adapter", str(folder), "--n", "200")
    assert ours["correct"] == plain["correct"], (ours, plain["correct"])


def test_push_to_hub_without_a_token_is_one_line_and_keeps_the_export(tmp_path):
    blob = blob_from_tensors(_tensors(**{"l.q_proj.lora_A": (2, 3)}), LoRAConfig(r=2, target_modules=("q_proj",)))
    write_peft_folder(tmp_path / "a", blob, "m")
    env = {k: v for k, v in ENV.items() if not k.startswith("HF_")} | {"HF_HOME": str(tmp_path / "hf")}
    argv = [sys.executable, "-m", "peer.cli", "export", "--adapter", str(tmp_path / "a"), "--out", str(tmp_path / "o")]
    done = subprocess.run([*argv, "--push-to-hub", "alice/adapter"], capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("Error: --push-to-hub alice/adapter: no Hugging Face token")
    assert read_adapter(tmp_path / "o")[0] == blob, "the export itself is kept"
    bad = subprocess.run([*argv, "--push-to-hub", "not a repo"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "'--push-to-hub'" in bad.stderr and "Traceback" not in bad.stderr
