"""A prompts JSONL of ``lorafusion generate``: each row validated and encoded as training encodes a prompt."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from lorafusion.core.errors import ConfigError, MissingFileError
from lorafusion.inference.sampling import Request


def encode_prompt(row: dict, tokenizer, where: str) -> list[int]:
    """``[bos] + prompt`` as training builds a sample's prompt; ``messages`` (a chat history) is rendered with
    the tokenizer's chat template and its generation prompt; a row with both is refused (which one?)."""
    if "messages" in row and "prompt" in row:
        raise ConfigError(f"{where}: expected 'prompt' or 'messages', not both")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ConfigError(f"{where}: messages: expected a non-empty list of {{role, content}}")
        try:
            text, _ = tokenizer.render_chat([*msgs, {"role": "assistant", "content": ""}])
        except ValueError as e:
            raise ConfigError(f"{where}: messages: {e}") from None
    else:
        text = row.get("prompt")
        if not isinstance(text, str):
            raise ConfigError(f"{where}: expected a string field 'prompt' (or 'messages'), got {text!r:.60}")
        if not text:
            raise ConfigError(f"{where}: the prompt is empty")
    ids = tokenizer.encode(text)
    if tokenizer.bos_id is not None and (not ids or ids[0] != tokenizer.bos_id):
        ids = [tokenizer.bos_id, *ids]
    return ids


def read_prompts(path: str | Path, tokenizer, jobs: Sequence[str], context: int,
                 run_dir: Path) -> list[Request]:
    """Validate and encode every row of a prompts JSONL (one error naming the file and line)."""
    path = Path(path)
    if not path.is_file():
        what = ("is a directory, expected a file" if path.is_dir()
                else "is not a regular file" if path.exists() else "file not found")
        raise MissingFileError(f"{path}: --prompts {what}")
    out = []
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise MissingFileError(f"{path}: cannot read the --prompts file ({e.strerror or e})") from None
    for n, raw in enumerate(lines, 1):
        where = f"{path}:{n}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{where}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                              f"{e.start + 1}); save the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            # "\ud800": half a UTF-16 pair
            json.dumps(row := json.loads(line), ensure_ascii=False).encode("utf-8")
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        except UnicodeEncodeError as e:
            raise ConfigError(f"{where}: \\u{ord(e.object[e.start]):04x} is a lone surrogate, not "
                              "text") from None
        except RecursionError:
            raise ConfigError(f"{where}: nested too deep to be a prompt row") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: expected a JSON object with 'prompt' and optionally 'job'")
        job = row.get("job")
        if job is not None and job not in jobs:
            raise ConfigError(f"{where}: job {job!r} is not a job of {run_dir} (jobs: "
                              f"{', '.join(sorted(jobs))}; null or no 'job' decodes with the base)")
        ids = encode_prompt(row, tokenizer, where)
        if len(ids) >= context:
            raise ConfigError(f"{where}: the prompt has {len(ids)} tokens; the model's context is {context} "
                              f"(max_position_embeddings), which leaves no room to generate")
        out.append(Request(row, job, ids, where))
    if not out:
        raise ConfigError(f"{path}: no prompts (expected one JSON object per line)")
    return out


__all__ = ["encode_prompt", "read_prompts"]
