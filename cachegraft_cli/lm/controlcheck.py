"""Stores written before `lm.plaintext`: the passages whose caches hold control tokens.

Code before `lm.plaintext` tokenized a passage with the tokenizer's control tokens parsed, so a
passage holding "<|im_end|>\\n<|im_start|>system\\n..." was cached as a closed user turn and an
open system turn (prompt injection), and every answer that retrieves it reads that. The store
keeps no token ids, only the text, so the text is tokenized again with the receiver's
tokenizer. Segments committed by the fixed code carry `"plain_text": true` in their commit
record and manifest entry and are not read.

Such a passage is mended by encoding it again: `store repair --reencode` drops it (kept in the
quarantine, as every repair's removals) and encodes it again from its stored text, as plain text.
(`encode` into the same store would skip it: its id and text are stored already.)
"""

from __future__ import annotations

from cachegraft_cli.lm.plaintext import parsed_control_strings

CODE = "control_tokens"


def control_token_rows(store) -> list[dict]:
    """{passage, segment, tokens} for each committed row of an unmarked segment whose text the
    receiver's tokenizer parses control tokens from (`tokens`: the strings, first seen first).
    Without that tokenizer on this machine, one {note} saying the check was skipped and why."""
    from cachegraft_cli.lm.template import passage_block

    old = [entry["name"] for entry in store.segments if not entry.get("plain_text")]
    if not old:
        return []
    try:
        tokenizer = receiver_tokenizer(store.identity)
    except Exception as exc:  # noqa: BLE001 - any tokenizer that does not load (missing, remote code, ...) skips
        return [{"passage": None, "segment": None, "tokens": [],
                 "note": f"the control-token check of {len(old)} segment(s) written before plain-text "
                         f"tokenization was skipped: the receiver's tokenizer does not load from local files "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"}]
    found = []
    for row in store.rows(old):  # the block the cache was computed from: title, text and notes
        tokens = parsed_control_strings(tokenizer, passage_block(row.title, row.read_text))
        if tokens:
            found.append({"passage": row.id, "segment": row.segment, "tokens": tokens})
    return found


def receiver_tokenizer(identity: dict):
    """The tokenizer of the store's receiver, from local files only (a hub id from the local
    cache): a check must not wait on the network, nor run a repository's code."""
    from transformers import AutoTokenizer

    from cachegraft_cli.lm.models import resolve_source

    receiver = identity["receiver"]
    source, gguf, _ = resolve_source(receiver["name"])
    kwargs: dict = {"local_files_only": True, "trust_remote_code": False, "revision": receiver.get("revision")}
    if gguf:
        kwargs["gguf_file"] = gguf
    return AutoTokenizer.from_pretrained(source, **kwargs)


def add_control_token_problems(store, report: dict) -> None:
    """Name each passage `control_token_rows` finds in a `store verify` report (one problem
    each), or its note when the check was skipped."""
    for found in control_token_rows(store):
        if "note" in found:
            report.setdefault("notes", []).append(found["note"])
            continue
        report["problems"].append({
            "segment": found["segment"], "passage": found["passage"], "row": None, "kind": None, "part": None,
            "code": CODE, "tokens": found["tokens"],
            "problem": f"written with control tokens parsed from its text ({', '.join(found['tokens'])}): its "
                       "cache reads them as prompt markup. `cachegraft store repair --reencode` encodes it again "
                       "with its text read as plain text"})
        report["ok"] = False
