"""The sharer's notes (`encode --sharer-notes N`): at encode time the sharer reads each passage
and writes up to N tokens of notes about it; the notes become part of the stored passage.

- The request is asked through the same prompt template as a question (the passage, then
  `NOTES_REQUEST` in the question's place), greedy, so the same passage gets the same notes.
- The fused cache covers the passage and its notes: the receiver reads both, the sharer reads
  both (its KV over the notes is its own KV over text it wrote), and the fuser fuses them.
- The row keeps the passage's own text (the index, the content hash and re-runs see only
  that) and the notes in `metadata["sharer_notes"]`; `PassageRow.read_text` puts them
  together for the caches and for the `text` system, so `text` and `cache` over a notes store
  are the controls "the notes as plain text" and "the notes' receiver-own cache".
"""

from __future__ import annotations

NOTES_REQUEST = "List the key facts of this passage as short question-answer pairs, one per line."


def notes_identity(tokens: int | None) -> dict | None:
    """The store identity's `notes` (None, the key absent, without notes)."""
    return {"tokens": int(tokens), "request": NOTES_REQUEST} if tokens else None


def add_notes(chunks: list, session, max_tokens: int) -> None:
    """Give every chunk without notes the sharer's notes, and its token ids with them."""
    from cachegraft_cli.store.rows import with_notes

    todo = [c for c in chunks if c.notes is None]
    memo = session.notes_written
    new = [c for c in todo if (c.passage.title, c.text, max_tokens) not in memo]
    if new:
        written = write_notes(session.sharer, session.choice.instruction, [(c.passage.title, c.text) for c in new],
                              max_tokens)
        memo.update({(c.passage.title, c.text, max_tokens): notes for c, notes in zip(new, written)})
    for chunk in todo:
        chunk.notes = memo[(chunk.passage.title, chunk.text, max_tokens)]
        chunk.ids = session.template.passage_ids(chunk.passage.title, with_notes(chunk.text, chunk.notes))


def write_notes(sharer, instruction: str, passages: list[tuple[str, str]], max_tokens: int) -> list[str]:
    """The sharer's notes on each (title, text), decoded together: greedy, blank lines dropped.
    `train-fuser --sharer-notes` writes its training passages' notes with this too."""
    from cachegraft_cli.lm.generation import Prompt, generate_batch
    from cachegraft_cli.lm.sampling import GenerationOptions
    from cachegraft_cli.lm.template import PromptTemplate

    asking = PromptTemplate.for_tokenizer(sharer.tokenizer, instruction)
    request = asking.question_ids(NOTES_REQUEST)
    prompts = [Prompt.plain(None, asking.prefix_ids() + asking.passage_ids(title, text) + request, 0)
               for title, text in passages]
    return ["\n".join(line.strip() for line in gen.text.splitlines() if line.strip())
            for gen in generate_batch(sharer, prompts, GenerationOptions(max_tokens))]
