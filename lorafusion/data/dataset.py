"""One adapter job's dataset → tokenized samples (``input_ids``, ``prompt_len``) indexed by sample id.

Files are read with ``datasets.load_dataset(<json|parquet|csv>, data_files=..., split="train")`` from local
paths only, kept in memory, with a throw-away cache directory. Row ``i`` of the file is sample id ``i``.

A sample is ``[bos] + prompt + response + [eos]`` (``bos`` only when the tokenizer has one; not doubled
when the rendered prompt already starts with it; ``eos`` not doubled when the response already ends
with it). ``prompt_len`` is the number of leading tokens that carry no loss: ``len([bos] + prompt)`` with
``mask_prompt: true``, else 0; always 0 for ``text``. Formats:

- ``prompt_response``: ``prompt = row[prompt_field]``, ``response = row[response_field]`` (strings,
  concatenated as they are: put any separator in the data);
- ``chat``: ``row[messages_field]`` is a list of ``{"role", "content"}``; the last message (the
  assistant's) is the response, the rest is rendered by ``tokenizer.apply_chat`` (a JSON string is
  accepted too, e.g. from CSV);
- ``text``: ``row[text_field]``, all tokens trained.

Every problem raises one :class:`DataError` naming the job, the file and the row / sample id.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorafusion.config.schema import JobConfig
from lorafusion.core.errors import ConfigError

__all__ = ["DataError", "JobData", "build_sample", "load_job_samples", "read_rows"]


class DataError(ConfigError):
    """A dataset problem (subclass of ConfigError, so both print as one clear error)."""


@dataclass
class JobData:
    """Tokenized samples of one job: ``samples[sample_id] = (input_ids, prompt_len)``."""

    job_name: str
    path: str
    samples: list[tuple[list[int], int]]
    lengths: list[int] = field(default_factory=list)
    num_truncated: int = 0

    def __post_init__(self) -> None:
        if not self.lengths:
            self.lengths = [len(ids) for ids, _ in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


@contextlib.contextmanager
def _quiet_datasets():
    import datasets
    from datasets.utils import logging as dlog

    bars = dlog.is_progress_bar_enabled()
    level = dlog.get_verbosity()
    datasets.disable_progress_bars()
    dlog.set_verbosity(dlog.CRITICAL)  # reader failures are re-raised as one DataError, not logged
    try:
        yield datasets
    finally:
        dlog.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def _first_line(e: BaseException) -> str:
    # datasets wraps the real reader error; the innermost cause says what is wrong with the file
    while e.__cause__ is not None or e.__context__ is not None:
        nxt = e.__cause__ or e.__context__
        if nxt is e:
            break
        e = nxt
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def read_rows(job: JobConfig, section: str = "dataset") -> Any:
    """The job's file (``job.<section>``: ``dataset`` or ``eval_dataset``) as a ``datasets.Dataset`` (errors
    name the job and the file)."""
    ds_cfg = getattr(job, section)
    path = Path(ds_cfg.path)
    where = f"job {job.name!r}: {section} {path}"
    if not path.exists():
        raise DataError(f"{where}: file not found")
    if not path.is_file():
        raise DataError(f"{where}: not a file")
    try:
        open(path, "rb").close()
    except OSError as e:  # (the reader below would name no file, or the CLI call it a write error)
        raise DataError(f"{where}: cannot read ({e.strerror or e})") from None
    if path.stat().st_size == 0:
        raise DataError(f"{where}: empty dataset (the file is empty)")
    builder = ds_cfg.builder
    if builder in ("json", "csv"):
        _check_utf8(path, where)
    kwargs: dict[str, Any] = {}
    if builder == "csv":
        # every column as a string (pandas would turn "42" into an int): read the header first
        import csv

        try:
            # (a BOM is no part of the first column's name)
            with open(path, newline="", encoding="utf-8-sig") as f:
                rows = csv.reader(f)
                header, first = next(rows, None), next(rows, None)
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            raise DataError(f"{where}: cannot read as csv ({e})") from None
        if not header or first is None:  # (the reader: 'Instruction "train" corresponds to no data!')
            raise DataError(f"{where}: empty dataset "
                            f"({'no csv header' if not header else 'a csv header, no rows'})")
        from datasets import Features, Value

        kwargs.update(features=Features({c: Value("string") for c in header}), keep_default_na=False,
                      encoding="utf-8-sig")
    # a JSON document: the reader keeps the last
    if builder == "json" and (msg := _duplicate_in_document(path)):
        raise DataError(f"{where}: {msg}")
    # every line checked with the stdlib first: the reader crashes on some
    if builder == "json" and (msg := _diagnose_json(path)):
        raise DataError(f"{where}: cannot read as {ds_cfg.file_type or builder}: {msg}")
    with _quiet_datasets() as datasets, tempfile.TemporaryDirectory(prefix="lorafusion-ds-") as cache:
        try:
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", keep_in_memory=True,
                                       cache_dir=cache, **kwargs)
        except Exception as e:  # noqa: BLE001 - datasets raises many types; all mean "unreadable"
            msg = _diagnose_json(path) if builder == "json" else None
            # (the reader's "in row N" counts within a block of the file, not from its start: left out)
            raise DataError(f"{where}: cannot read as {ds_cfg.file_type or builder}: "
                            f"{msg or re.sub(r' in row [0-9]+', '', _first_line(e))}") from None
    if ds.num_rows == 0:
        raise DataError(f"{where}: empty dataset (0 rows)")
    return ds


def _check_utf8(path: Path, where: str) -> None:
    """Text data must be UTF-8 (the reader would accept the bytes and fail later, naming no file)."""
    import codecs

    dec = codecs.getincrementaldecoder("utf-8")()
    line, offset = 1, 0
    with open(path, "rb") as f:
        while True:
            block = f.read(1 << 20)
            try:
                dec.decode(block, final=not block)
            except UnicodeDecodeError as e:
                start = max(0, e.start)
                bad = block[start:start + 1]  # (at a block boundary the first bad byte is near enough)
                line += block[:start].count(b"\n")
                raise DataError(f"{where}: line {line}: not valid UTF-8 (byte "
                                f"{bad.hex() and '0x' + bad.hex()} at offset {offset + start}); save the "
                                "file as UTF-8") from None
            if not block:
                return
            line += block.count(b"\n")
            offset += len(block)


def _unique_keys(pairs: list) -> dict:
    """A JSON object's keys each once (json keeps the last of a duplicate; the reader fails on it
    obscurely)."""
    keys = [k for k, _ in pairs]
    if dup := [k for k in keys if keys.count(k) > 1]:
        raise ValueError(f"duplicate key {dup[0]!r}")
    return dict(pairs)


class _Obj(dict):
    dup: str | None = None  # the first key given twice in this object or one inside it


def _flag_duplicates(pairs: list) -> _Obj:
    obj, keys = _Obj(pairs), [k for k, _ in pairs]
    inner = [x for v in obj.values() for x in (v if isinstance(v, list) else [v])
             if isinstance(x, _Obj) and x.dup]
    obj.dup = next((k for k in keys if keys.count(k) > 1), None) or (inner[0].dup if inner else None)
    return obj


def _duplicate_in_document(path: Path) -> str | None:
    """A JSON array of rows (not JSON lines) read whole keeps the last of a key given twice, silently: which
    row."""
    with open(path, "rb") as f:
        if f.read(64).lstrip()[:1] != b"[":
            return None
    try:
        rows = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_flag_duplicates)
    except (ValueError, RecursionError):
        return None
    for i, row in enumerate(rows if isinstance(rows, list) else []):
        if isinstance(row, _Obj) and row.dup is not None:
            return f"row {i}: duplicate key {row.dup!r} (a key given twice; the reader would keep the last)"
    return None


def _big_int(obj) -> str | None:
    """A key of ``obj`` (a row) whose integer is outside 64 bits (the reader fails on it, naming no row)."""
    for k, v in obj.items():
        if isinstance(v, int) and not isinstance(v, bool) and not -(1 << 63) <= v < (1 << 63):
            return f"{k!r}: a number too large for 64 bits"
        # (NaN, Infinity, 1e999: the reader fails obscurely)
        if isinstance(v, float) and not math.isfinite(v):
            return f"{k!r}: {v} is not a finite number"
    return None


def _diagnose_json(path: Path) -> str | None:
    """Find the first invalid line of a JSON-lines file (or the error of a JSON document)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        return str(e)
    try:
        doc = json.loads(text, object_pairs_hook=_unique_keys)
        rows = doc if isinstance(doc, list) else [doc]
        if bad := [i for i, r in enumerate(rows) if not isinstance(r, dict)]:
            return f"row {bad[0]}: expected a JSON object per row, got {_json_type(rows[bad[0]])}"
        big = [(i, k) for i, r in enumerate(rows) if (k := _big_int(r))]
        return f"row {big[0][0]}: field {big[0][1]}" if big else None
    except (ValueError, RecursionError):  # (JSON lines; a deep line is named below)
        pass
    row, kinds = -1, {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line, object_pairs_hook=_unique_keys)
        except RecursionError:
            return f"line {n}: nested too deep to be a row of data"
        except ValueError as e:
            col = f", column {e.colno}" if hasattr(e, "colno") else ""
            return f"line {n}{col}: invalid JSON ({getattr(e, 'msg', e)})"
        if not isinstance(obj, dict):
            return f"line {n}: expected a JSON object per line, got {_json_type(obj)}"
        row += 1
        if key := _big_int(obj):
            return f"line {n} (row {row}): field {key}"
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:  # "\ud800": JSON escapes a lone surrogate, which is no character
            return (f"line {n} (row {row}): \\u{ord(e.object[e.start]):04x} is a lone surrogate "
                    f"(half a UTF-16 pair), not text")
        # the reader fails on a field's JSON type changing (when it cannot fall back)
        for k, v in obj.items():
            if v is not None and kinds.setdefault(k, _json_kind(v)) != _json_kind(v):
                return (f"line {n} (row {row}): field {k!r}: {_json_kind(v)}, "
                        f"where the rows before have {kinds[k]}")
    return None


def _json_type(v) -> str:
    return "null" if v is None else "a JSON " + {str: "string", bool: "boolean",
                                                 list: "array"}.get(type(v), "number")


def _json_kind(v) -> str:
    return {str: "a string", bool: "a boolean", list: "a list", dict: "an object"}.get(type(v), "a number")


def _field(row_value: Any, name: str, where: str) -> str:
    if row_value is None:
        raise DataError(f"{where}: missing field {name!r}")
    if not isinstance(row_value, str):
        raise DataError(f"{where}: field {name!r}: expected a string, got {type(row_value).__name__} "
                        f"{row_value!r:.60}")
    return row_value


def build_sample(prompt_ids: list[int], response_ids: list[int], tokenizer, mask_prompt: bool) \
        -> tuple[list[int], int]:
    """``[bos] + prompt + response + [eos]`` and its prompt length (see the module docstring)."""
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    head = [bos] if bos is not None and (not prompt_ids or prompt_ids[0] != bos) else []
    tail = [] if response_ids and response_ids[-1] == eos else [eos]
    ids = head + list(prompt_ids) + list(response_ids) + tail
    return ids, (len(head) + len(prompt_ids) if mask_prompt else 0)


def load_job_samples(job: JobConfig, tokenizer, section: str = "dataset") -> JobData:
    """Read and tokenize ``job.dataset`` (or ``job.eval_dataset``: ``section``); one :class:`DataError` (job,
    file, row) on any problem."""
    cfg = getattr(job, section)
    ds = read_rows(job, section)
    where = f"job {job.name!r}: {section} {cfg.path}"
    columns = list(ds.column_names)
    needed = {"prompt_response": [cfg.prompt_field, cfg.response_field], "chat": [cfg.messages_field],
              "text": [cfg.text_field]}[cfg.format]
    for f in needed:
        if f not in columns:
            key = {cfg.prompt_field: "prompt_field", cfg.response_field: "response_field",
                   cfg.messages_field: "messages_field", cfg.text_field: "text_field"}[f]
            raise DataError(f"{where}: no field {f!r} in the rows (format {cfg.format}, {section}.{key}); "
                            f"the rows have {columns}")
    cols = {f: list(ds[f]) for f in needed}  # whole columns: datasets' lazy Column reads a row in ~1 ms
    samples: list[tuple[list[int], int]] = []
    truncated = 0
    for i in range(ds.num_rows):
        row = f"{where}: row {i}"
        if cfg.format == "prompt_response":
            prompt = _field(cols[cfg.prompt_field][i], cfg.prompt_field, row)
            response = _field(cols[cfg.response_field][i], cfg.response_field, row)
            p_ids, r_ids = tokenizer.encode(prompt), tokenizer.encode(response)
        elif cfg.format == "chat":
            msgs = cols[cfg.messages_field][i]
            if msgs is None:
                raise DataError(f"{row}: missing field {cfg.messages_field!r}")
            if isinstance(msgs, str):
                try:
                    msgs = json.loads(msgs)
                except ValueError:
                    raise DataError(f"{row}: field {cfg.messages_field!r}: expected a list of messages "
                                    f"(or its JSON), got {msgs!r:.60}") from None
            try:
                p_ids, r_ids = tokenizer.apply_chat(msgs)
            except ValueError as e:
                raise DataError(f"{row}: field {cfg.messages_field!r}: {e}") from None
        else:
            text = _field(cols[cfg.text_field][i], cfg.text_field, row)
            p_ids, r_ids = [], tokenizer.encode(text)
        if not r_ids:
            raise DataError(f"{row}: no response tokens (the {_resp_name(cfg)} is empty); every sample "
                            f"needs at least one trained token")
        ids, plen = build_sample(p_ids, r_ids, tokenizer, cfg.mask_prompt and cfg.format != "text")
        if len(ids) > cfg.max_seq_len:
            if not cfg.truncate:
                raise DataError(f"{where}: sample {i} (row {i}) is {len(ids)} tokens, longer than "
                                f"{section}.max_seq_len = {cfg.max_seq_len}; raise max_seq_len or set "
                                f"{section}.truncate: true")
            ids = ids[:cfg.max_seq_len]
            truncated += 1
            if plen >= len(ids):
                raise DataError(f"{where}: sample {i} (row {i}): its prompt ({plen} tokens) fills "
                                f"{section}.max_seq_len = {cfg.max_seq_len}; no response tokens are left "
                                f"after truncation")
        samples.append((ids, plen))
    return JobData(job_name=job.name, path=cfg.path, samples=samples, num_truncated=truncated)


def _resp_name(cfg) -> str:
    return {"prompt_response": f"field {cfg.response_field!r}", "chat": "last assistant message",
            "text": f"field {cfg.text_field!r}"}[cfg.format]
