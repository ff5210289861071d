"""Run manifests (the coordinator's record of the model, task and settings)."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from peer.protocol import keys
from peer.protocol.limits import MAX_BLOB_BYTES, MAX_MODEL_FILES, MAX_NAME_CHARS, MAX_PATH_CHARS, MAX_RUN_ID_LEN
from peer.protocol.records import ManifestRecord, ModelFile, ModelSpec, TaskSpec
from tests.helpers.strategies.common import (
    OVER,
    Kind,
    bad_counts,
    bad_hex,
    bad_json,
    bad_peer_ids,
    bad_string,
    counts,
    fixed,
    grow,
    json_objects,
    names,
    negative_floats,
    path_parts,
    peer_ids,
    run_ids,
    set_at,
    sha256s,
    single_field,
    sized,
    timestamps,
)


@st.composite
def model_files(draw) -> list[ModelFile]:
    def make(parts_sha_size, i):
        parts, sha, size = parts_sha_size
        return ModelFile(path="/".join([f"f{i}", *parts]), sha256=sha, size=size)

    one = st.tuples(st.lists(path_parts, max_size=3), sha256s, st.integers(0, MAX_BLOB_BYTES))
    return draw(sized(one, MAX_MODEL_FILES, min_size=1, distinct=make))


@st.composite
def manifests(draw) -> ManifestRecord:
    return ManifestRecord(
        run_id=draw(run_ids),
        created=draw(timestamps),
        access=draw(st.sampled_from(["public", "private"])),
        seed=draw(counts),
        model=ModelSpec(
            name=draw(st.text(min_size=1, max_size=256)),
            revision=draw(st.none() | names),
            quantization=draw(st.sampled_from(["nf4", "int8", "none"])),
            files=draw(model_files()),
        ),
        task=TaskSpec(name=draw(names), config_json=draw(json_objects)),
        grpo_json=draw(json_objects),
        lora_json=draw(json_objects),
        adapter0_sha256=draw(sha256s),
        coordinator=draw(peer_ids),
    )


def _file(_files, i):
    return {"path": f"file{i}", "sha256": "a" * 64, "size": 1}


MANIFEST = Kind(
    name="manifest",
    cls=ManifestRecord,
    valid=manifests(),
    **single_field(keys.MANIFEST_FIELD),
    out_of_range={
        "run id": set_at(("run_id",), lambda _: bad_string(MAX_RUN_ID_LEN) | st.sampled_from(["a b", "../r", "rün"])),
        "negative created": set_at(("created",), lambda _: negative_floats()),
        "access": set_at(("access",), lambda _: st.sampled_from(["secret", "Public", ""])),
        "seed": set_at(("seed",), lambda _: bad_counts()),
        "model name": set_at(("model", "name"), lambda _: bad_string(256)),
        "revision": set_at(("model", "revision"), lambda _: bad_string(MAX_NAME_CHARS)),
        "quantization": set_at(("model", "quantization"), lambda _: st.sampled_from(["fp4", "NF4", ""])),
        "no files": set_at(("model", "files"), fixed([])),
        "too many files": grow(("model", "files"), MAX_MODEL_FILES, _file),
        "file path": set_at(
            ("model", "files", "*", "path"),
            lambda _: (
                st.sampled_from(["../x", "a/../b", "/etc/passwd", "a//b", "./a", "a\\b", "a\x00b", "a\x7f", ""])
                | bad_string(MAX_PATH_CHARS)
            ),
        ),
        "duplicate file path": lambda d, draw: (
            len(d["model"]["files"]) > 1 and not d["model"]["files"][1].update(path=d["model"]["files"][0]["path"])
        ),
        "file sha256": set_at(("model", "files", "*", "sha256"), bad_hex),
        "file size": set_at(("model", "files", "*", "size"), lambda _: bad_counts() | st.just(MAX_BLOB_BYTES + 1)),
        "task name": set_at(("task", "name"), lambda _: bad_string(MAX_NAME_CHARS)),
        "task config": set_at(("task", "config_json"), lambda _: bad_json()),
        "grpo json": set_at(("grpo_json",), lambda _: bad_json()),
        "lora json": set_at(("lora_json",), lambda _: bad_json()),
        "adapter0 sha256": set_at(("adapter0_sha256",), bad_hex),
        "coordinator": set_at(("coordinator",), bad_peer_ids),
    },
    oversize=lambda d, draw: d.update(grpo_json=json.dumps({"k": "x" * OVER})),
)
