"""The orchestrator's torch-free token count (`orchestrator/config/chat_tokens.py`) against transformers' own
tokenizer, the worker's: the same ids for the same prompts, or no fast reading at all."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from orchestrator.config.chat_tokens import plain_chat_tokenizer
from remote_worker.models.loading import PACKAGE_DIR
from remote_worker.prompt_set import DEFAULT_PROMPTS, Prompt, load_prompt_file
from remote_worker.prompts import token_ids
from tests.paper_mirror import ODD_TEXT

FIXTURES = [PACKAGE_DIR / "fixtures" / name / "target" for name in ("tiny_trained", "tiny_trained_dense")]

# What Qwen3's template does that a trivial one does not: a namespace written in a reversed loop, loop
# controls, tojson, raise_exception, a named special token, the thinking switch, the generation prompt.
QWEN_STYLE = (
    "{%- if messages[0].role != 'system' and messages[0].role != 'user' %}"
    "{{- raise_exception('a conversation starts with the system or the user') }}{%- endif %}\n"
    "{%- set ns = namespace(last_user=0) %}\n"
    "{%- for message in messages[::-1] %}{%- if message.role == 'user' %}"
    "{%- set ns.last_user = messages | length - 1 - loop.index0 %}{%- break %}{%- endif %}{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    <|im_start|>{{ message.role }}{{ '\\n' }}{{ message.content | trim }}"
    "{%- if loop.index0 == ns.last_user %} {{ {'last': true, 'text': message.content[:3]} | tojson }}{%- endif %}"
    "<|im_end|>{{ eos_token }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    "{%- endif %}"
)


def prompts() -> list[Prompt]:
    shipped = load_prompt_file(DEFAULT_PROMPTS, 3)
    odd = [
        Prompt("odd", [{"role": "user", "content": f"a{ODD_TEXT}b"}]),
        Prompt(
            "turns",
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "  Wie viel ist 2+2?  "},
                {"role": "assistant", "content": "4 🧪"},
                {"role": "user", "content": "e\u0301\u2028{{ x }}"},
            ],
        ),
    ]
    return shipped + odd


def assert_same_ids(checkpoint: Path) -> None:
    plain = plain_chat_tokenizer(checkpoint)
    assert plain is not None
    reference = transformers.AutoTokenizer.from_pretrained(checkpoint)
    for prompt in prompts():
        for thinking in (False, True):
            expected = token_ids(prompt, reference, 512, thinking)
            assert token_ids(prompt, plain, 512, thinking) == expected, (checkpoint.name, prompt.id, thinking)
            assert len(expected) > 2


@pytest.mark.parametrize("checkpoint", FIXTURES, ids=lambda p: p.parent.name)
def test_the_shipped_tokenizers_count_as_transformers_does(checkpoint: Path) -> None:
    assert_same_ids(checkpoint)


def qwen_style(tmp_path: Path, template_in_file: bool) -> Path:
    """The trained pair's tokenizer with the Qwen-style template, special tokens as AddedToken dicts."""
    checkpoint = tmp_path / "qwen_style"
    checkpoint.mkdir()
    shutil.copy(FIXTURES[0] / "tokenizer.json", checkpoint)
    config = json.loads((FIXTURES[0] / "tokenizer_config.json").read_text())
    config["eos_token"] = {"__type": "AddedToken", "content": "<|endoftext|>", "special": True}
    if template_in_file:
        (checkpoint / "chat_template.jinja").write_text(QWEN_STYLE)
        config["chat_template"] = "{{ 'the saved file wins' }}"
    else:
        config["chat_template"] = QWEN_STYLE
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    return checkpoint


@pytest.mark.parametrize("template_in_file", [False, True], ids=["config", "file"])
def test_a_qwen_style_template_counts_as_transformers_does(tmp_path: Path, template_in_file: bool) -> None:
    assert_same_ids(qwen_style(tmp_path, template_in_file))


def test_a_template_that_raises_raises_the_same_error(tmp_path: Path) -> None:
    plain = plain_chat_tokenizer(qwen_style(tmp_path, False))
    assistant_first = Prompt("bad", [{"role": "assistant", "content": "x"}])
    with pytest.raises(Exception, match="starts with the system or the user") as err:
        token_ids(assistant_first, plain, 512)
    assert type(err.value).__name__ == "TemplateError"


@pytest.mark.parametrize(
    "change",
    ["model-specific class", "special tokens file", "several templates", "no template", "no tokenizer.json"],
)
def test_anything_but_the_plain_case_is_left_to_transformers(tmp_path: Path, change: str) -> None:
    checkpoint = qwen_style(tmp_path, False)
    config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    if change == "model-specific class":
        config["tokenizer_class"] = "Qwen2Tokenizer"  # rebuilds its tokenizer from the vocabulary at load
    elif change == "special tokens file":
        (checkpoint / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|pad|>"}))
    elif change == "several templates":
        config["chat_template"] = [{"name": "default", "template": QWEN_STYLE}]
    elif change == "no template":
        del config["chat_template"]
    else:
        (checkpoint / "tokenizer.json").unlink()
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(config))
    assert plain_chat_tokenizer(checkpoint) is None


def test_counting_a_shipped_models_prompts_imports_no_torch() -> None:
    """The config check of a run on the trained pair: its prompts counted, torch never imported (it was, through
    AutoTokenizer: 4 s of CPU for every orchestrator process)."""
    code = (
        "import sys\n"
        "from orchestrator.config.prompt_lengths import prompt_lengths\n"
        "model = {'name': 'tiny_trained', 'source': 'pretrained', 'path': 'fixtures/tiny_trained/target'}\n"
        "container = {'model': model, 'host': {'kind': 'local'}, 'experiment': {}}\n"
        "lengths = prompt_lengths(container, 512)\n"
        "assert lengths and all(p.tokens > 2 for p in lengths), lengths\n"
        "print(sorted(k for k in ('torch', 'transformers.modeling_utils') if k in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
