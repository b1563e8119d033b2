"""The stored-responses table: bounded in bytes (oldest out first), entries
expire, a deleted one is gone; and the reply-to-blocks split the Responses
and Messages answers share gives the same blocks however the text arrives."""

from __future__ import annotations

import pytest

from service.reply import CALL, TEXT, ReplyBlocks
from service.responses_protocol import MessageItem
from service.responses_store import ResponsesStore
from service.tool_calls import GENERIC, HERMES, ToolPlan


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


ITEMS = (MessageItem(role="user", content="hi"),)


def test_entries_expire_after_the_ttl():
    clock = Clock()
    store = ResponsesStore(max_bytes=1000, ttl=60, clock=clock)
    assert store.put("a", b"{}", ITEMS, 10)
    clock.now = 30
    store.put("b", b"{}", ITEMS, 10)
    assert store.get("a").conversation == ITEMS
    clock.now = 61
    assert store.get("a") is None and store.get("b") is not None
    clock.now = 91
    assert store.get("b") is None and len(store) == 0 and store.num_bytes == 0
    store.check_integrity()


def test_the_oldest_go_first_beyond_the_byte_bound():
    store = ResponsesStore(max_bytes=100, ttl=3600, clock=Clock())
    for name in "abcd":
        assert store.put(name, b"x" * 10, ITEMS, 20)   # 30 bytes each
    assert [n for n in "abcd" if store.get(n)] == ["b", "c", "d"]
    assert store.num_bytes == 90
    assert not store.put("huge", b"x" * 90, ITEMS, 20)    # larger than the whole store
    assert store.get("huge") is None and store.num_bytes == 90
    store.check_integrity()


def test_delete_and_replace():
    store = ResponsesStore(max_bytes=100, ttl=3600, clock=Clock())
    store.put("a", b"1", ITEMS, 9)
    store.put("a", b"22", ITEMS, 9)
    assert store.get("a").response_json == b"22" and store.num_bytes == 11
    assert store.delete("a") and not store.delete("a")
    assert store.num_bytes == 0
    assert not ResponsesStore(max_bytes=0).enabled


def _plan(fmt: str) -> ToolPlan:
    fn = {"name": "count", "parameters": {"type": "object"}}
    return ToolPlan(fmt, {"count": fn}, "auto")


REPLIES = {
    HERMES: 'Let me count.\n<tool_call>\n{"name": "count", "arguments": {"n": 3}}\n</tool_call>'
            '\n<tool_call>\n{"name": "count", "arguments": {"n": 12}}\n</tool_call>\nDone.',
    GENERIC: '{"tool_calls": [{"name": "count", "arguments": {"n": 3}}]}',
}
EXPECTED = {
    HERMES: [(TEXT, "Let me count.\n"), (CALL, '{"n": 3}'), (CALL, '{"n": 12}'),
             (TEXT, "Done.")],
    GENERIC: [(CALL, '{"n": 3}')],
}


@pytest.mark.parametrize("fmt", [HERMES, GENERIC])
@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_blocks_are_the_same_however_the_reply_is_split(fmt, step):
    reply = REPLIES[fmt]
    blocks = ReplyBlocks(_plan(fmt))
    events = []
    pieces = [reply[i:i + step] for i in range(0, len(reply), step)]
    for i, piece in enumerate(pieces):
        events += blocks.feed(piece, final=i == len(pieces) - 1)
    assert [(b.kind, b.text) for b in blocks.blocks] == EXPECTED[fmt]
    # Events open, grow and close each block in order, one block open at a time.
    opened = [e.block.index for e in events if e.kind == "open"]
    closed = [e.block.index for e in events if e.kind == "close"]
    assert opened == closed == list(range(len(EXPECTED[fmt])))
    for block in blocks.blocks:
        assert "".join(e.text for e in events if e.kind == "delta" and e.block is block) \
            == block.text
    calls = [b for b in blocks.blocks if b.kind == CALL]
    assert all(b.call_id.startswith("call_") and b.name == "count" for b in calls)


def test_a_reply_without_text_gets_one_empty_block_when_asked():
    blocks = ReplyBlocks(None)
    assert blocks.feed("", final=True) == []
    events = blocks.empty_text_block()
    assert [e.kind for e in events] == ["open", "close"] and blocks.blocks[0].text == ""
    assert blocks.empty_text_block() == []


def test_whitespace_is_layout_around_calls_and_content_alone():
    alone = ReplyBlocks(None)
    alone.feed(" \n")
    alone.feed("", final=True)
    assert [(b.kind, b.text) for b in alone.blocks] == [(TEXT, " \n")]
    around = ReplyBlocks(_plan(HERMES))
    around.feed('\n<tool_call>\n{"name": "count", "arguments": {}}\n</tool_call>\n\n',
                final=True)
    assert [b.kind for b in around.blocks] == [CALL]
