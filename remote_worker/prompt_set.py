"""Prompt sets: a JSONL file of conversations, one a line — `{"id": "...", "messages": [{"role", "content"}]}`.

A line ends at `\n` and nowhere else (JSON Lines): a JSON text holds no raw newline, so that split can never
cut a record, while `str.splitlines` also breaks on U+2028, U+2029, U+0085, form feeds and the other
separators that scraped text carries inside its strings. The file this side writes (`to_jsonl`) escapes
everything outside ASCII as well, so any reader splits it the same way; a leading BOM is skipped, a CR
before the `\n` is JSON whitespace.

A multi-turn conversation (MT-Bench) adds `"followups": ["turn 2", ...]`: the user's later turns. Each turn is
decoded as its own record; before turn k+1 one answer to turn k (the last method's) becomes the assistant
turn, so every method decodes the later turn from the same history (`Prompt.next_turn`).

Standard library only: the orchestrator checks a prompt file with this same parser before anything is
launched, and the worker reads the copy that travelled with the run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remote_worker.safe_files import Folder, UnsafePath

DEFAULT_PROMPTS = Path(__file__).parent / "data" / "prompts_default.jsonl"
RUN_PROMPTS_FILE = "prompts.jsonl"  # the copy of the run's prompt set in its run folder


class PromptSetError(ValueError):
    """A malformed prompt set; the message names the file and the line."""


@dataclass(frozen=True)
class Prompt:
    id: str
    messages: list[dict[str, str]]
    line: int = field(default=0, compare=False)  # its line in the file it was read from (0: not from a file)
    followups: tuple[str, ...] = ()  # the user's later turns, each decoded after an answer to the one before

    def as_record(self) -> dict[str, Any]:
        record: dict[str, Any] = {"id": self.id, "messages": self.messages}
        if self.followups:
            record["followups"] = list(self.followups)
        return record

    @property
    def turns(self) -> int:
        return 1 + len(self.followups)

    def turn_id(self, turn: int) -> str:
        """The record's id: the prompt's own for its first turn, `<id>#2`, `#3`, … for later ones."""
        return self.id if turn == 1 else f"{self.id}#{turn}"

    def next_turn(self, answer: str) -> Prompt:
        """The conversation for the next turn: `answer` as the assistant's turn, then the first followup."""
        if not self.followups:
            raise ValueError(f"prompt {self.id!r} has no further turn")
        later = [{"role": "assistant", "content": answer}, {"role": "user", "content": self.followups[0]}]
        messages = [*self.messages, *later]
        return Prompt(id=self.id, messages=messages, line=self.line, followups=self.followups[1:])


def unencodable(text: str) -> str | None:
    """Why `text` cannot reach a tokenizer, or None: a lone surrogate (from a `\\ud800` escape in JSON, or a
    string decoded with `surrogateescape`) has no UTF-8 form, and every tokenizer encodes UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"a lone surrogate U+{ord(text[exc.start]):04X} at character {exc.start}, which has no UTF-8 form"
    return None


def _encodable(text: str, what: str) -> None:
    reason = unencodable(text)
    if reason is not None:
        raise ValueError(f"{what} holds {reason}")


def _prompt(raw: Any, number: int) -> Prompt:
    if not isinstance(raw, dict):
        raise ValueError("a line must be a JSON object")
    messages = raw.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError('"messages" must be a non-empty list')
    for message in messages:
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            raise ValueError("each message needs a role and a content")
        if not isinstance(message["role"], str) or not isinstance(message["content"], str):
            raise ValueError("a message's role and content must be strings")
        _encodable(message["content"], "a message's content")
    prompt_id = raw.get("id", f"prompt-{number}")
    if not isinstance(prompt_id, (str, int)) or isinstance(prompt_id, bool) or not str(prompt_id).strip():
        raise ValueError('"id" must be a non-empty string')
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    followups = raw.get("followups", [])
    if not isinstance(followups, list) or not all(isinstance(turn, str) for turn in followups):
        raise ValueError('"followups" must be a list of strings (the user\'s later turns)')
    for turn in followups:
        _encodable(turn, "a followup")
    if followups and messages[-1]["role"] != "user":
        raise ValueError('a conversation with "followups" must end with a user turn')
    return Prompt(id=str(prompt_id), messages=messages, line=number, followups=tuple(followups))


def parse_prompts(text: str, source: str) -> list[Prompt]:
    """Every conversation of a JSONL text (blank lines skipped); `source` names it in errors."""
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(text.removeprefix("\ufeff").split("\n"), start=1):
        if not line.strip(" \t\r"):
            continue
        try:
            prompt = _prompt(json.loads(line), number)
        except (json.JSONDecodeError, ValueError) as exc:
            raise PromptSetError(f"{source}:{number}: not a prompt line ({exc})") from exc
        if prompt.id in seen:
            raise PromptSetError(f"{source}:{number}: id {prompt.id!r} is already used on line {seen[prompt.id]}")
        seen[prompt.id] = number
        prompts.append(prompt)
    if not prompts:
        raise PromptSetError(f"{source}: the prompt set is empty")
    return prompts


def load_prompt_file(path: Path, limit: int | None = None) -> list[Prompt]:
    """A prompt file's conversations, the first `limit` of them when given."""
    try:
        data = Folder(path.parent).read(path.name)  # a link at the file's own name is not followed
        if data is None:
            raise PromptSetError(f"{path}: no such prompt file")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError, UnsafePath) as exc:
        raise PromptSetError(f"{path}: cannot be read as UTF-8 text ({exc})") from exc
    prompts = parse_prompts(text, str(path))
    return prompts[:limit] if limit else prompts


def to_jsonl(prompts: list[Prompt]) -> str:
    """The prompts as JSON Lines in ASCII: every other character escaped, so no reader finds a line break or
    an encoding question inside a record."""
    return "".join(json.dumps(p.as_record(), ensure_ascii=True) + "\n" for p in prompts)


def round_trip(prompts: list[Prompt], source: str) -> str:
    """`to_jsonl(prompts)`, proven to read back with the worker's own parser as the very same records: the
    orchestrator calls this before anything starts on the host, so a file the worker cannot read costs no
    GPU minute."""
    text = to_jsonl(prompts)
    back = parse_prompts(text, source)
    for number, (sent, read) in enumerate(zip(prompts, back, strict=False), start=1):
        if sent.as_record() != read.as_record():
            raise PromptSetError(f"{source}: prompt {sent.id!r} (record {number}) does not read back as written")
    if len(back) != len(prompts):
        raise PromptSetError(f"{source}: {len(prompts)} prompts written, {len(back)} read back")
    return text
